"""Names of the checks of a whole training step (see ``trainer_checks``)."""

TRAINER_CHECKS: dict[str, str] = {
    "trainer.behavior_logp": "behaviour log-probs are the sampled tokens' log-probs under the policy that sampled them (the stale copy)",
    "trainer.policy_logp": "the loss pass's log-probs are the current policy's, recomputed deterministically (no dropout, no other model)",
    "trainer.parameter_gradient": "each parameter's gradient is the analytic per-token gradient pulled back through the model (a VJP)",
    "trainer.accumulation": "with k micro-batches the mask, loss and accumulated gradient are those of the same step in one micro-batch",
    "trainer.optimizer_step": "the parameters after the step are one optimizer step from the parameters before, with the reported gradient",
}
