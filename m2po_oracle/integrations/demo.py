"""What the real-trainer demos (TRL's GRPO and ms-swift's, on CPU) share: the knobs of one
short training run on stale rollouts. Each demo module subclasses :class:`DemoKnobs` as its
``DemoSetup``, with its own tau (where its toy model and reward make M2PO mask tokens) and
whatever its trainer needs besides."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoKnobs:
    """One short training run: the knobs that matter to M2PO. Each generation batch
    serves ``steps_per_generation / gradient_accumulation_steps`` optimizer batches, each
    iterated ``num_iterations`` times, so every optimizer step after the first trains on
    completions an older policy sampled."""

    steps: int = 4  # optimizer steps
    num_generations: int = 2
    per_device_train_batch_size: int = 2
    gradient_accumulation_steps: int = 2
    steps_per_generation: int = 4
    num_iterations: int = 2
    max_completion_length: int = 6
    learning_rate: float = 3e-2
    tau: float = 0.05
    seed: int = 0
    max_grad_norm: float = 1.0
