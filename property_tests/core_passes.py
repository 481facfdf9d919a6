"""Run a test through each of the core's two ways of making its passes over the batch:
the fused CPU passes (``m2po_oracle.core.fused``, the default on CPU where they apply) and the
torch operators (what every other device runs). Parametrize with ``PASSES``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from m2po_oracle.core import fused

PASSES = ["fused", "torch operators"]


@contextlib.contextmanager
def core_passes(which: str) -> Iterator[None]:
    if which == "fused":
        if not fused.built():
            pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
        yield
    else:
        with fused.disabled():
            yield
