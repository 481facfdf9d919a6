"""Algorithm 1 in float64 NumPy and the records every computation is reduced to (torch-free).

``algorithm`` is the oracle, one function per step; ``batch`` the optimizer batch it reads;
``record`` the one result record; ``exactsum`` exact float64 sums. This face names the
oracle's functions, so ``m2po_oracle.oracle.m2po(batch)`` reads as the paper.
"""

from m2po_oracle.oracle.algorithm import (
    ExactSum,
    evaluate_with_mask,
    gradient,
    log_ratio,
    m2po,
    metrics,
    objective,
    prefix_means,
    removed_beyond,
    second_moment,
    select_loop,
    select_sorted,
    sorted_candidates,
    trust_region,
)

__all__ = [
    "ExactSum",
    "evaluate_with_mask",
    "gradient",
    "log_ratio",
    "m2po",
    "metrics",
    "objective",
    "prefix_means",
    "removed_beyond",
    "second_moment",
    "select_loop",
    "select_sorted",
    "sorted_candidates",
    "trust_region",
]
