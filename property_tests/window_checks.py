"""What the trainer integration tests (TRL, ms-swift) check on a captured window, once:
its micro-batches re-assembled as one batch, and the oracle's Algorithm 1 judged on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.judge.equivalence import same_up_to_ties, valid_m2
from m2po_oracle.oracle.batch import Batch


def window_batch(records: Sequence[Mapping[str, Any]], logp_field: str = "selection_logp") -> Batch:
    """The captured micro-batches of one window (rows of any widths) as one right-padded batch."""
    width = max(r["mask"].shape[1] for r in records)

    def cat(field: str, fill: float) -> np.ndarray:
        return np.concatenate(
            [np.pad(r[field].double().numpy(), ((0, 0), (0, width - r[field].shape[1])), constant_values=fill) for r in records]
        )

    valid = np.concatenate([np.pad(r["mask"].numpy(), ((0, 0), (0, width - r["mask"].shape[1]))) for r in records])
    return Batch(cat(logp_field, 0.0), cat("behavior_logp", 0.0), cat("advantages", 0.0), valid, records[0]["tau"])


def assert_one_selection_per_window(windows: Mapping[int, Sequence[Mapping[str, Any]]], steps: int) -> None:
    """Each window's kept mask is Algorithm 1 over the whole window (up to ties), and the
    assertion has teeth: rollouts are stale, the cut falls inside the trust region, and
    selecting each micro-batch alone would have kept another mask on some step."""
    per_micro_differs = cut_inside = stale = 0
    for step, records in windows.items():
        batch = window_batch(records)
        keep = np.concatenate([r["keep"].numpy() for r in records])
        algorithm_1 = oracle.m2po(batch).keep
        assert same_up_to_ties(keep, algorithm_1, valid_m2(batch)), f"step {step}: the mask is not Algorithm 1 over the whole window"
        d = np.where(batch.valid, batch.logp - batch.behavior_logp, 0.0)
        stale += bool(np.abs(d).max() > 1e-3)
        removed = int((batch.valid & ~keep).sum())
        trust = int(
            oracle.trust_region(oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid), batch.advantages, batch.valid).sum()
        )
        cut_inside += 0 < removed < trust
        alone = np.concatenate([oracle.m2po(window_batch([r])).keep for r in records])
        per_micro_differs += not same_up_to_ties(alone, algorithm_1, valid_m2(batch))
    assert stale >= steps - 1 and cut_inside >= 1 and per_micro_differs >= 1, (stale, cut_inside, per_micro_differs)
