"""The production M2PO loss in torch: inputs, the collective fail-closed agreement, exact
selection (a radix descent, no sort), the fused CPU passes and the loss.

This face is the public API: ``m2po_loss`` for one process, ``select_tokens`` /
``select_micro_batches`` and ``loss_from_selection`` for trainers that select once per
optimizer batch.
"""

from m2po_oracle.core.agreement import validate_across_ranks
from m2po_oracle.core.loss import CoreResult, loss_from_selection, m2po_loss, select_micro_batches, select_tokens
from m2po_oracle.core.scratch import CPU_CHUNK
from m2po_oracle.core.selection import Selection

__all__ = [
    "CPU_CHUNK",
    "CoreResult",
    "Selection",
    "loss_from_selection",
    "m2po_loss",
    "select_micro_batches",
    "select_tokens",
    "validate_across_ranks",
]
