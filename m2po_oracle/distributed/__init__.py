"""Distributed runs: the rank layout, a warm world of ranks, the distributed contract's
implementations and controls, the per-rank checks, their diagnosis, the runner that serves
``compare --topology`` and the one under ``torchrun``."""
