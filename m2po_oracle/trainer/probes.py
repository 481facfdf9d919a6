"""Setups the trainer must refuse (fail closed), run as its validation probes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m2po_oracle.judge.validation import ProbeResult, is_rejection
from m2po_oracle.trainer.cases import TrainerCase
from m2po_oracle.trainer.grpo import M2POKLWarning, TrainerConfig
from m2po_oracle.trainer.run import STEP_LR, TrainerFactory, builtin_trainer, setup_case


@dataclass(frozen=True)
class TrainerProbe:
    """A setup the trainer must refuse (or, for ``expected="warned"``, allow with a warning)."""

    name: str
    description: str
    argument: str  # the setting the error (or warning) must name
    config: dict[str, Any] = field(default_factory=dict)  # TrainerConfig fields
    backend: str = "hf"  # the rollout's engine
    record_logp: bool = True  # whether the engine returned behaviour log-probs
    model_dropout: float = 0.0
    expected: str = "rejected"


TRAINER_PROBES: tuple[TrainerProbe, ...] = (
    TrainerProbe(
        "deployment_behavior_logp_missing",
        "deployment-backed rollout returned no behaviour log-probs",
        "behavior_logp",
        {"rollout_backend": "deployment"},
        backend="deployment",
        record_logp=False,
    ),
    TrainerProbe(
        "deployment_behavior_logp_from_trainer",
        "deployment-backed rollout, behaviour log-probs recomputed by the trainer",
        "behavior_logp_source",
        {"rollout_backend": "deployment", "behavior_logp_source": "trainer"},
        backend="deployment",
    ),
    TrainerProbe(
        "stochastic_mask_prepass", "policy with attention dropout 0.1 (mask prepass and loss pass would differ)", "model", model_dropout=0.1
    ),
    TrainerProbe(
        "sequence_level_is", "importance_sampling_level='sequence'", "importance_sampling_level", {"importance_sampling_level": "sequence"}
    ),
    TrainerProbe(
        "rollout_is_correction",
        "an extra rollout-IS correction (rollout_importance_sampling_mode='token_tis')",
        "rollout_importance_sampling_mode",
        {"rollout_importance_sampling_mode": "token_tis"},
    ),
    TrainerProbe("kl_coefficient", "beta=0.01: a KL term on top of M2PO", "beta", {"beta": 0.01}, expected="warned"),
)
PROBE_CASE = TrainerCase(
    seed=7, prompts=2, group_size=2, prompt_len=2, max_new_tokens=4, lags=(1, 2), staleness_lr=0.02, tau=0.04, split=(4,)
)


def run_trainer_probe(
    probe: TrainerProbe,
    *,
    dtype: str = "float64",
    faults: dict[str, bool | str] | None = None,
    device: str = "cpu",
    make_trainer: TrainerFactory | None = None,
) -> Any:
    """One step of the trainer under ``probe``'s setup; never raises because of the trainer."""
    import warnings

    versions, samplers, rollout = setup_case(
        PROBE_CASE, dtype=dtype, dropout=probe.model_dropout, device=device, backend=probe.backend, record_logp=probe.record_logp
    )
    config = TrainerConfig(**{"tau": PROBE_CASE.tau, "lr": STEP_LR, **probe.config})
    make_trainer = make_trainer or builtin_trainer(faults)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make_trainer(versions[-1], config, behaviour=samplers, reference=versions[0]).step(rollout)
        except (Exception, SystemExit) as error:
            if not is_rejection(error):  # from inside the step, not a deliberate refusal
                return ProbeResult(
                    probe.name,
                    probe.description,
                    "crashed",
                    f"crashed on invalid setup (not a deliberate ValueError/TypeError): {type(error).__name__}: {error}",
                    probe.expected,
                )
            return ProbeResult(probe.name, probe.description, "rejected", f"{type(error).__name__}: {error}", probe.expected)
    warned = [w for w in caught if issubclass(w.category, M2POKLWarning)]
    if warned:
        return ProbeResult(probe.name, probe.description, "warned", f"{warned[0].category.__name__}: {warned[0].message}", probe.expected)
    return ProbeResult(probe.name, probe.description, "accepted", "the step ran without an error or a warning", probe.expected)
