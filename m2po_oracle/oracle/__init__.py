"""Algorithm 1 in float64 NumPy and the records every computation is reduced to (torch-free).

``algorithm`` is the oracle, one function per step; ``batch`` the optimizer batch it reads;
``record`` the one result record; ``exactsum`` exact float64 sums. This face names the
oracle's functions, so ``m2po_oracle.oracle.m2po(batch)`` reads as the paper.
"""

from m2po_oracle.oracle.algorithm import (
    log_ratio,
    second_moment,
    trust_region,
    select_loop,
    ExactSum,
    sorted_candidates,
    prefix_means,
    select_sorted,
    removed_beyond,
    objective,
    gradient,
    metrics,
    evaluate_with_mask,
    m2po,
)

__all__ = [
    "log_ratio",
    "second_moment",
    "trust_region",
    "select_loop",
    "ExactSum",
    "sorted_candidates",
    "prefix_means",
    "select_sorted",
    "removed_beyond",
    "objective",
    "gradient",
    "metrics",
    "evaluate_with_mask",
    "m2po",
]
