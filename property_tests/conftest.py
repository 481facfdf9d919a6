"""Hypothesis profiles: ``dev`` (default), ``ci`` (derandomized, used by .ci/run), ``thorough``.

Choose one with ``--hypothesis-profile NAME`` or ``M2PO_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", parent=settings.get_profile("default"), max_examples=60, **_COMMON)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=60, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("M2PO_HYPOTHESIS_PROFILE", "dev"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist workers already fill the cores; a second intra-op thread per worker makes small
    # kernels (the trainer's tiny model, scatter-heavy selection) stall on each other.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
