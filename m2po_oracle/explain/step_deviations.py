"""The deviations of the step around the loss, one registry: every name a distributed run, a
training step or an audit can report, declared once with what each world's report says of it.

A single-batch deviation (:data:`~m2po_oracle.explain.deviations.VARIANTS`) is a set of knobs
of one computation; these are about where the computation runs (which ranks select, what
each divides by, which log-probs and which policy reach it), so each world recognises them
with its own evidence and words them for what its report shows. The order is the order in
which a world prefers its names where several reproduce the same failing steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The worlds that name step deviations: ``compare --topology``, ``compare --impl trainer``
#: (and TRL's and ms-swift's steps), ``m2po-oracle audit``.
WORLDS = ("distributed", "trainer", "audit")


@dataclass(frozen=True)
class StepDeviation:
    """A deviation of the step, by name, and what each world that names it says (a world absent: it cannot tell it)."""

    name: str
    said: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.said) - set(WORLDS)
        if unknown or not self.said:
            raise ValueError(f"{self.name}: said: expected descriptions for some of {WORLDS}, got {sorted(self.said)}")


_AUDIT_CP_OWN_N = "(its denominator is named beside it where the loss reproduces a known one)"

STEP_DEVIATIONS: tuple[StepDeviation, ...] = (
    StepDeviation(
        "local_shard_selection",
        {
            "distributed": "each rank selects over its own CP shard only, without communication",
            "audit": "each rank selects over its own CP shard without communication and divides by the shard's valid count",
        },
    ),
    StepDeviation(
        "local_denominator",
        {
            "distributed": "the global mask, but each rank's loss divided by its own valid count",
            "audit": "each record's loss divided by its own valid count (its rank's micro-batch, its CP shard), not the optimizer batch's N",
        },
    ),
    StepDeviation(
        "dp_cp_group_double_count",
        {
            "distributed": "selection over the DP x CP group after CP reconstruction: every token counted once per CP replica",
            "audit": "selection and N over the DP x CP group after CP reconstruction: every token counted once per CP replica",
        },
    ),
    StepDeviation(
        "per_rank_selection_global_n",
        {
            "distributed": "each DP rank selects over its own rows without communication, dividing by the global N",
            "audit": "each DP rank selects over its own rows without communication (dividing by the global N)",
        },
    ),
    StepDeviation(
        "per_cp_chunk_selection_global_n",
        {
            "distributed": "each CP rank selects over its own shard without communication, dividing by the global N",
            "audit": "each CP rank selects over its own shard without communication, dividing by the global N",
        },
    ),
    StepDeviation(
        "kept_count_denominator",
        {
            "distributed": "the optimizer batch's mask, but the loss divided by the global kept count instead of N",
            "trainer": "the optimizer batch's mask, but the loss divided by its kept count instead of N, its valid tokens before masking",
            "audit": "the loss divided by the optimizer batch's kept count instead of its valid count N",
        },
    ),
    StepDeviation(
        "cp_shard_counts",
        {
            "distributed": "the global mask, but N counted on the CP shard and summed over DP only: too low by a factor cp",
            "audit": "N counted on the CP shard and summed over DP only: too low by a factor cp",
        },
    ),
    StepDeviation(
        "per_micro_batch_mask",
        {
            "trainer": "the mask is selected within each gradient-accumulation micro-batch",
            "audit": "the mask is selected within each gradient-accumulation micro-batch alone, not over the optimizer batch",
        },
    ),
    StepDeviation(
        "per_micro_batch_denominator",
        {
            "trainer": "each micro-batch divides by its own valid count (then by k), not the optimizer batch's",
            "audit": "each micro-batch divides by its own valid count (then by k), not the optimizer batch's N",
        },
    ),
    StepDeviation(
        "current_policy_as_behavior",
        {
            "trainer": "the current policy's log-probs are used as the behaviour log-probs",
            "audit": "the behaviour log-probs are the current policy's, not the sampler's: d is 0 and nothing is ever masked",
        },
    ),
    StepDeviation(
        "stochastic_forward",
        {
            "trainer": "the policy's forward is stochastic (dropout or similar): the log-probs differ from a deterministic "
            "recomputation and the model has stochastic layers",
            "audit": "the policy's forward is stochastic (dropout left on?): the selection's and the loss's forwards differ in every micro-batch",
        },
    ),
    StepDeviation(
        "optimizer_step_per_micro_batch",
        {
            "trainer": "optimizer.step() runs after every micro-batch instead of once per optimizer batch",
            "audit": "optimizer.step() runs after every micro-batch: micro-batch 0's loss pass sees the selection's policy, later ones a moved policy",
        },
    ),
    StepDeviation(
        "parameters_without_gradient",
        {
            "trainer": "some parameters get no gradient (frozen or detached by mistake) while the loss depends on them",
            "audit": "some parameters get no gradient (frozen or detached by mistake) while the loss depends on them",
        },
    ),
    StepDeviation(
        "kl_k1_estimator",
        {"trainer": "the KL term uses the k1 estimator logp - ref_logp instead of k3, exp(ref - logp) - (ref - logp) - 1"},
    ),
    StepDeviation(
        "unweighted_micro_batch_metric_mean",
        {
            "trainer": "the logged metrics are each micro-batch's own values on the optimizer batch's mask, averaged with equal "
            "weight per micro-batch (as verl 0.9.1 averages what a policy loss returns): not Algorithm 1's token-weighted "
            "value; the selection is right",
            "audit": "each record logs its own micro-batch's metrics on the optimizer batch's mask (the selection is right); a "
            "trainer that averages them with equal weight per micro-batch, as verl 0.9.1 does, logs a number other than "
            "Algorithm 1's token-weighted one",
        },
    ),
    StepDeviation(
        "per_rank_selection_local_n",
        {"audit": "each DP rank selects over its own rows without communication and divides by its own rows' valid count"},
    ),
    StepDeviation(
        "per_rank_selection",
        {
            "audit": f"each DP rank selects over its own rows without communication; the loss is not divided by the global N {_AUDIT_CP_OWN_N}"
        },
    ),
    StepDeviation(
        "per_cp_chunk_selection",
        {
            "audit": f"each CP rank selects over its own shard without communication; the loss is not divided by the global N {_AUDIT_CP_OWN_N}"
        },
    ),
)
_BY_NAME = {d.name: d for d in STEP_DEVIATIONS}


def described(world: str) -> dict[str, str]:
    """The step deviations ``world`` names, in the registry's order, with what its report says of each."""
    if world not in WORLDS:
        raise ValueError(f"world: expected one of {WORLDS}, got {world!r}")
    return {d.name: d.said[world] for d in STEP_DEVIATIONS if world in d.said}


def said(world: str, name: str) -> str:
    """What ``world``'s report says of the step deviation ``name``."""
    found = _BY_NAME.get(name)
    if found is None or world not in found.said:
        raise ValueError(f"name: {name!r} is no step deviation {world} names; it names {', '.join(described(world))}")
    return found.said[world]
