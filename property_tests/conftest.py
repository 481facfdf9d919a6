"""Hypothesis profiles: ``dev`` (default), ``ci`` (derandomized, used by .ci/run), ``thorough``.

Choose one with ``--hypothesis-profile NAME`` or ``M2PO_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest

# Loaded once here: pytester's in-process runs restore sys.modules after each run, and numpy's
# C modules that scipy.stats pulls in (the coverage bound) cannot load twice in one process.
import scipy.stats  # noqa: F401
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", parent=settings.get_profile("default"), max_examples=60, **_COMMON)
settings.register_profile(
    "ci", parent=settings.get_profile("default"), max_examples=60, derandomize=True, database=None, print_blob=True, **_COMMON
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("M2PO_HYPOTHESIS_PROFILE", "dev"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist workers already fill the cores; a second intra-op thread per worker makes small
    # kernels (the trainer's tiny model, scatter-heavy selection) stall on each other.
    torch.set_num_threads(1)
    # ... and so do the processes a test starts (CLI runs, isolated ports, torchrun ranks):
    # a CLI compare of a small port took 135 s with two OpenMP threads and 33 s with one
    # beside the other worker's load.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _sigint_disposition() -> tuple[object, bool | None]:
    """Python's SIGINT handler and whether the kernel ignores SIGINT for this process (None off
    Linux): a C extension's sigaction changes the second without Python knowing."""
    try:
        with open("/proc/self/status") as status:
            mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return signal.getsignal(signal.SIGINT), None
    return signal.getsignal(signal.SIGINT), bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.fixture(autouse=True)
def _sigint_left_as_found():
    """A test that leaves SIGINT ignored makes every later child of its xdist worker ignore Ctrl-C
    (an ignored signal is inherited, and Python then installs no KeyboardInterrupt handler): the
    test that does it fails here, by name, and the handler is put back for the tests after it."""
    before = _sigint_disposition()
    yield
    after = _sigint_disposition()
    if after != before:
        handler = before[0] if before[0] is not None else signal.SIG_DFL
        signal.signal(signal.SIGINT, handler)
        pytest.fail(
            f"this test changed SIGINT's disposition and left it so: Python handler {before[0]!r} -> {after[0]!r}, "
            f"ignored by the kernel {before[1]} -> {after[1]}; restore it (try/finally) where it is changed",
            pytrace=False,
        )


# --- a real browser (the HTML report's and the site's pages) ------------------------------------

CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        reason = f"browser test needs Debian chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI") == "true":  # CI's test command installs it: missing there is a failure
            pytest.fail(reason)
        pytest.skip(reason)
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser test needs the playwright Python package")
    with sync_api.sync_playwright() as playwright:
        # A hung browser must fail the test, not hang the suite: every wait has a limit.
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()
