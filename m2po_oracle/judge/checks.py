"""The one check registry: every check by the name its failures carry, with what it asserts.

Each runner takes its own list from here (a loss function in one process runs
:data:`CHECKS`; a distributed world adds :data:`DISTRIBUTED_CHECKS`; a training step runs
the value checks and :data:`TRAINER_CHECKS`; an audit runs :data:`AUDIT_CHECKS`), and
reports list only the checks that ran.
"""

from __future__ import annotations

#: The checks of a loss function called in one process, by the name failures carry.
CHECKS: dict[str, str] = {
    "call": "the implementation returns a result under the contract (no exception, right types and shapes)",
    "selection.keep_only_valid": "padding tokens are never kept",
    "selection.only_trust_region_masked": "only trust-region tokens (A > 0 & d > 0 or A < 0 & d < 0) are ever masked",
    "selection.budget": "after masking, the mean M2 of the kept trust-region tokens is <= tau",
    "selection.minimal": "the mask is minimal: keeping the next removed token would break the budget",
    "selection.largest_removed_first": "removed tokens have the largest M2 (any choice among ties)",
    "loss": "loss equals -(1/N) sum keep * exp(d) * A on the implementation's own mask",
    "gradient": "autograd d loss / d logp equals -(1/N) * keep * exp(d) * A",
    "metrics.m2_before": "m2_before equals the mean M2 over the trust region",
    "metrics.m2_after": "m2_after equals the mean M2 over the kept trust-region tokens",
    "metrics.masked_fraction": "masked_fraction equals masked / N",
    "metrics.trust_region_fraction": "trust_region_fraction equals |T| / N",
    "metrics.valid_count": "valid_count equals N",
    "metrics.trust_region_count": "trust_region_count equals |T|",
    "metrics.kept_trust_region_count": "kept_trust_region_count equals the kept trust-region tokens",
    "padding_immunity": "NaN/inf padding, and padding of small trust-region tokens, change neither the mask, the loss nor the gradient",
    "determinism": "the same input gives the same mask, loss and gradient",
    "inputs_not_mutated": "the implementation does not modify its input tensors",
}
#: The per-rank checks of a distributed step (``compare --topology``).
DISTRIBUTED_CHECKS: dict[str, str] = {
    "distributed.replica_masks_identical": "tensor- and context-parallel replicas keep identical masks",
    "distributed.global_selection": "the mask assembled over the DP ranks is an outcome of Algorithm 1 on the whole optimizer batch",
    "distributed.loss_sum": "the rank losses of one replica set add up to the global loss",
    "distributed.shard_gradient": "each rank's gradient is the analytic gradient (global N) on its rows and CP shard, zero elsewhere",
    "distributed.metrics": "every rank reports the global metrics and counts",
    "distributed.split_invariance": "the same optimizer batch through one rank (dp=1) and through the topology gives the same mask (up to ties), loss sum and gradient",
}
#: The model-level checks of a whole training step (``compare --impl trainer``).
TRAINER_CHECKS: dict[str, str] = {
    "trainer.behavior_logp": "behaviour log-probs are the sampled tokens' log-probs under the policy that sampled them (the stale copy)",
    "trainer.policy_logp": "the loss pass's log-probs are the current policy's, recomputed deterministically (no dropout, no other model)",
    "trainer.parameter_gradient": "each parameter's gradient is the analytic per-token gradient pulled back through the model (a VJP)",
    "trainer.accumulation": "with k micro-batches the mask, loss and accumulated gradient are those of the same step in one micro-batch",
    "trainer.optimizer_step": "the parameters after the step are one optimizer step from the parameters before, with the reported gradient",
    "trainer.kl_term": "with beta != 0, loss and d loss / d logp are Algorithm 1's plus beta * KL, KL the k3 estimator "
    "exp(ref - logp) - (ref - logp) - 1 over the valid tokens / N against the reference model",
}
#: The checks of a recorded step (``m2po-oracle audit``), judged on the optimizer batch the
#: records put back together (``m2po_oracle.audit`` says how each reads the files).
AUDIT_CHECKS: dict[str, str] = {
    "audit.replicas_identical": "tensor-parallel replicas recorded the same tensors, losses and metrics",
    "audit.selection": "the assembled mask is an outcome of Algorithm 1 on the whole optimizer batch, on the log-probs the selection saw",
    "audit.policy_logp": "the selection's log-probs are the loss pass's: one deterministic forward of one policy",
    "audit.behavior_logp": "the behaviour log-probs the loss used are those the sampler reported (float32 precision at best)",
    "audit.loss_sum": "the losses of one replica set add up to Algorithm 1's loss -(1/N) sum keep exp(d) A, N the optimizer batch's valid count",
    "audit.gradient": "each captured d loss / d logp equals -(1/N) keep exp(d) A on that record's tokens",
    "audit.metrics": "every captured metric named like Algorithm 1's equals the optimizer batch's, on every rank",
    "audit.parameter_gradient": "no trainable parameter is left without a gradient at every recorded step where some parameter has one",
}
#: Every check of every runner, for descriptions; a runner declares the subset it runs.
ALL_CHECKS: dict[str, str] = {**CHECKS, **DISTRIBUTED_CHECKS, **TRAINER_CHECKS, **AUDIT_CHECKS}
#: The checks that judge values against Algorithm 1 on one batch (a step runner reuses them).
VALUE_CHECKS: tuple[str, ...] = tuple(n for n in CHECKS if n in ("loss", "gradient") or n.startswith(("selection.", "metrics.")))
#: Checks about behaviour rather than the values computed; they do not make an
#: observation evidence for an output variant. A trainer's own checks are about the step
#: around the loss (which model, how accumulated); trainer variants explain those.
BEHAVIOURAL_CHECKS = frozenset({"call", "padding_immunity", "determinism", "inputs_not_mutated"}) | frozenset(TRAINER_CHECKS)


def result_field(check: str) -> str | None:
    """The ``M2POResult`` field a value check judges (None: a behavioural or step check)."""
    if check.startswith("selection."):
        return "keep"
    if check in ("loss", "gradient"):
        return {"loss": "loss", "gradient": "grad"}[check]
    if check.startswith("metrics."):
        return check.partition(".")[2]
    return None
