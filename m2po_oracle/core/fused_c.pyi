"""The interface of the optional compiled extension built from ``fused_c.c`` (INTERFACE 3;
``fused.py`` calls it and documents each pass). Tensors are passed as their ``data_ptr()``."""

INTERFACE: int

def first_level(
    logp: int,
    behavior_logp: int,
    advantages: int,
    mask: int,
    n: int,
    dtype: int,
    cells: int,
    sums: int,
    counts: int,
    trust: int,
    bucket: int,
    /,
) -> tuple[int, int, bool]: ...
def finish(
    bucket: int, trust: int, mask: int, n: int, below: int, alive: int, every_candidate: bool, keep: int, positions: int, size: int, /
) -> int: ...
def loss_terms(logp: int, behavior_logp: int, advantages: int, keep: int, n: int, dtype: int, ratio: int, weight: int, /) -> None: ...
def first_cut(sums: int, counts: int, tau: float, /) -> tuple[int, float, float, float]: ...
def sorted_cut(
    logp: int,
    behavior_logp: int,
    dtype: int,
    n: int,
    positions: int,
    size: int,
    kept_sum: float,
    kept_count: float,
    tau: float,
    pairs: int,
    keep: int,
    /,
) -> tuple[int, float]: ...
