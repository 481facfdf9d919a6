"""Offline audit of a recorded training run against Algorithm 1.

Reads a capture (:mod:`m2po_oracle.capture`) and, for every recorded optimizer step,
reassembles the optimizer batch from every rank's micro-batches and judges it with the
float64 oracle. The world is the manifest's ``dp x cp x tp`` in Megatron order
(:mod:`m2po_oracle.distributed.topology`):

- **TP ranks hold replicas**: the audit checks they recorded identical tensors, losses and
  metrics, then uses tensor-parallel rank 0's;
- **CP ranks hold shards**: each CP rank records its shard of every sequence in the
  Megatron layout (``2 * cp`` chunks, CP rank ``i`` holding chunks ``i`` and ``2 * cp - 1 - i``);
  the audit puts the shards back into sequences;
- **DP ranks hold rows**: the optimizer batch is every DP rank's micro-batches, rows
  concatenated in (dp rank, micro-batch) order, sequences padded to the longest T with
  invalid positions.

Checks per step (loss, gradient and metrics are judged on the mask the run chose, as
``compare`` does, so that a selection bug does not also fail them):

- ``audit.replicas_identical``: TP replicas recorded the same thing ("not run" when tp = 1);
- ``audit.selection``: the assembled ``keep`` is an outcome of Algorithm 1 on the whole
  optimizer batch (:func:`equivalence.check_selection`), on the log-probs the selection
  saw (``selection_logp`` when recorded, else ``logp``);
- ``audit.policy_logp``: the selection's log-probs are the loss pass's (a mask prepass and the
  loss pass must see one deterministic forward of one policy; ``policy_atol`` / ``--policy-atol``
  for nondeterministic kernels); "not run" without ``selection_logp``;
- ``audit.behavior_logp``: the behaviour log-probs the loss used are the ones the sampler
  reported (``rollout_logp``), at float32 precision at best or within ``rollout_atol``
  (``--rollout-atol``: a recomputation under the sampler's weights with other kernels);
  "not run" without ``rollout_logp``;
- ``audit.loss_sum``: the losses of one replica set (every DP and CP rank, every micro-batch,
  TP rank 0) add up to the oracle's global loss ``-(1/N) sum keep exp(d) A``, N the valid
  count of the whole optimizer batch. Each recorded loss is that rank's and micro-batch's
  share with the global N (under DDP, which averages gradients over the DP group, a
  trainer multiplies by the DP size for the backward; the *recorded* loss is the share
  before that factor);
- ``audit.gradient``: each captured gradient (d loss / d logp of that record) equals
  ``-(1/N) keep exp(d) A`` on that record's tokens; "not run" when none was captured;
- ``audit.metrics``: every captured metric named like ours (``m2_before``, ``m2_after``,
  ``masked_fraction``, ``trust_region_fraction``, ``valid_count``, ``trust_region_count``,
  ``kept_trust_region_count``, or logged under a name ports use for one of them, as
  ``compare --adapter`` reads it: ``m2po/masked_fraction``, ``M2``) equals the optimizer batch's, on every rank; where not, the
  summary says what they are where the files show it (a record's own or its DP rank's valid
  count, cp x N, M2 of each micro-batch, DP rank or CP shard alone); "not run" when none is
  logged;
- ``audit.parameter_gradient``: no trainable parameter has an all-zero (or no) gradient on
  every rank at every recorded step where some parameter has one (one step is not evidence:
  :func:`always_silent_parameters`); "not run" when no rank noted its parameters' gradient norms.

Diagnosis of a failing step names only what the loss, the gradient and the mask reproduce
(:data:`DESCRIPTIONS`): the selection's scope (each micro-batch, DP rank or CP shard selecting
alone) where the mask is not Algorithm 1's on the optimizer batch and is that scope's; the
loss's denominator (its own valid count, k times it, the kept count, N counted per CP shard
or once per CP replica) where the loss and the gradient reproduce it and not the global N, a
logged ``valid_count`` only choosing among divisors they cannot tell apart; the behaviour
log-probs (the current policy's), the policy's forward (stochastic, or moved by an optimizer
step between micro-batches) and parameters left without a gradient. A scope's name says
what the loss divides by and never contradicts the loss (``*_global_n`` only with the global
N; ``*_local_n`` / ``local_shard_selection`` with the region's own count; else a bare scope
beside the denominator). A logged number alone names nothing: ``audit.metrics`` says what it
is; logged M2 only choose between explanations the mask, loss and gradient cannot tell apart.

The package's rooms, each importing only those above it in this list: :mod:`.records` (the
report's records, the diagnosis names, a record loaded from a capture), :mod:`.reassembly`
(one step put back together), :mod:`.checks`, :mod:`.diagnosis`, :mod:`.counterexample`
(the worst step's table) and :mod:`.run` (:func:`audit_capture`, every step through them).
"""

from m2po_oracle.audit.checks import REGION_METRICS, REGION_WORDS, LogpBounds, always_silent_parameters
from m2po_oracle.audit.counterexample import COUNTEREXAMPLE_TOKENS, TABLE_ORDER
from m2po_oracle.audit.records import CHECK_NAMES, DESCRIPTIONS, ROLLOUT_LOGP_DTYPE, SCHEMA, AuditCheck, AuditReport, StepAudit
from m2po_oracle.audit.run import audit_capture

__all__ = [
    "CHECK_NAMES",
    "COUNTEREXAMPLE_TOKENS",
    "DESCRIPTIONS",
    "REGION_METRICS",
    "REGION_WORDS",
    "ROLLOUT_LOGP_DTYPE",
    "SCHEMA",
    "TABLE_ORDER",
    "AuditCheck",
    "AuditReport",
    "LogpBounds",
    "StepAudit",
    "always_silent_parameters",
    "audit_capture",
]
