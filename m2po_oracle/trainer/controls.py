"""Planted trainer bugs (negative controls) and the built-in names of whole training steps."""

from __future__ import annotations

from dataclasses import dataclass

from m2po_oracle.explain.step_deviations import said


@dataclass(frozen=True)
class TrainerControl:
    """A planted trainer bug and the checks that must catch it."""

    name: str
    description: str
    faults: dict[str, bool | str]  # TrainerFaults' fields by name (drop_gradient_of names a parameter)
    caught_by: tuple[str, ...]
    model_dropout: float = 0.0
    diagnosed_as: str = ""  # the trainer variant the diagnosis must name (default: the control's name)
    # Steps the suite gives it: a per-micro-batch mask only shows where two micro-batches
    # select differently (about 5 % of generated steps; first caught at 7-71 over seeds 0-5).
    examples: int = 60
    beta: float = 0.0  # the KL coefficient its steps run with (a KL bug only shows with a KL term)

    @property
    def variant(self) -> str:
        return self.diagnosed_as or self.name


TRAINER_CONTROLS: tuple[TrainerControl, ...] = (
    TrainerControl(
        "per_micro_batch_mask",
        said("trainer", "per_micro_batch_mask"),
        {"per_micro_batch_mask": True},
        ("trainer.accumulation",),
        examples=150,
    ),
    # The natural port of gradient accumulation: the core called per micro-batch, each logging
    # its own metrics and valid count, the window's N in the loss. Its loss and gradient are
    # right for its masks: only the mask (and the logs) may name it, never a denominator.
    TrainerControl(
        "core_per_micro_batch",
        "the core is called per micro-batch (its own selection and metrics, its own valid count logged) "
        "with the optimizer batch's N in the loss",
        {"core_per_micro_batch": True},
        ("trainer.accumulation",),
        diagnosed_as="per_micro_batch_mask",
        examples=30,
    ),  # seed 0: first caught at example 8, 11 of 60 steps fail
    TrainerControl(
        "current_policy_as_behavior",
        said("trainer", "current_policy_as_behavior"),
        {"current_policy_as_behavior": True},
        ("trainer.behavior_logp",),
    ),
    TrainerControl(
        "per_micro_batch_denominator",
        said("trainer", "per_micro_batch_denominator"),
        {"per_micro_batch_denominator": True},
        ("trainer.accumulation", "gradient"),
    ),
    TrainerControl(
        "dropout_left_on",
        "attention dropout 0.1 stays on: the mask prepass and the loss pass see different forwards",
        {"skip_determinism_check": True},
        ("trainer.policy_logp",),
        model_dropout=0.1,
        diagnosed_as="stochastic_forward",
    ),
    TrainerControl(
        "optimizer_step_per_micro_batch",
        said("trainer", "optimizer_step_per_micro_batch"),
        {"optimizer_step_per_micro_batch": True},
        ("trainer.optimizer_step",),
    ),
    TrainerControl(
        "embedding_gradient_dropped",
        "the input embedding's gradient is zeroed before the step (a freeze wired to the wrong parameter)",
        {"drop_gradient_of": "model.embed_tokens.weight"},
        ("trainer.parameter_gradient",),
        diagnosed_as="parameters_without_gradient",
    ),
    # k1 has the right expectation under the policy, so only a per-token check sees it: every
    # step with a stale reference has a k1 value and gradient unlike k3's.
    TrainerControl(
        "kl_k1_estimator", said("trainer", "kl_k1_estimator"), {"kl_k1_estimator": True}, ("trainer.kl_term",), examples=6, beta=0.1
    ),
)
CONTROLS_BY_NAME = {c.name: c for c in TRAINER_CONTROLS}


def integrated_controls(framework: str, loss_hook: str) -> tuple[TrainerControl, ...]:
    """The planted bugs of M2PO in a framework's own trainer (``trainer:FRAMEWORK:NAME``), in the
    framework's words: ``loss_hook``, the method that hands the loss one micro-batch. Each sets
    the integration's fault of its name; a KL bug's steps run with a KL term, without which it
    cannot show."""
    return (
        TrainerControl(
            "per_micro_batch_mask",
            f"the mask is selected within each micro-batch {framework} hands {loss_hook}",
            {"per_micro_batch_mask": True},
            ("trainer.accumulation",),
        ),
        TrainerControl(
            "per_micro_batch_denominator",
            "each micro-batch divides by its own valid count, then by the accumulation steps",
            {"per_micro_batch_denominator": True},
            ("trainer.accumulation", "gradient"),
        ),
        TrainerControl(
            "current_policy_as_behavior",
            "the prepass's log-probs (the current policy) are used as behaviour log-probs",
            {"current_policy_as_behavior": True},
            ("trainer.behavior_logp",),
        ),
        TrainerControl(
            "optimizer_step_per_micro_batch",
            "the wrapped optimizer steps after every micro-batch, past accelerate's accumulation guard",
            {"optimizer_step_per_micro_batch": True},
            ("trainer.optimizer_step",),
        ),
        TrainerControl(
            "kl_k1_estimator",
            f"the KL term uses the k1 estimator logp - ref_logp instead of {framework}'s k3",
            {"kl_k1_estimator": True},
            ("trainer.kl_term",),
            beta=0.1,
        ),
    )


#: Built-in names of whole training steps: the trainer and its planted controls.
TRAINER_IMPLEMENTATIONS: tuple[str, ...] = ("trainer", *tuple(f"trainer:{c.name}" for c in TRAINER_CONTROLS))
