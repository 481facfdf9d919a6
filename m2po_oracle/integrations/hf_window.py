"""What the TRL and ms-swift integrations share: both hook a Hugging Face Trainer subclass
whose generation batch is buffered, so an optimizer batch's micro-batches are all known when
its first one runs (one selection per window). Framework-neutral: imports transformers only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback


def option(args: Any, name: str, default: Any = None) -> Any:
    """A trainer option by name, ``default`` where this framework version has none."""
    return getattr(args, name, default)


def check_window_fits_the_generation_batch(args: Any) -> None:
    """Refuse a window that would straddle two buffered generation batches (naming the option)."""
    ga = int(option(args, "gradient_accumulation_steps", 1))
    spg = int(option(args, "steps_per_generation", None) or ga)
    if spg % ga:
        raise ValueError(f"steps_per_generation: must be a multiple of gradient_accumulation_steps ({ga}) so that every optimizer batch "
                         f"lies inside one buffered generation batch (M2PO selects over the whole window before its first micro-batch); "
                         f"got {spg}")


@dataclass
class Window:
    """The current optimizer batch: its micro-batches' inputs and one selection over them."""

    index: int  # optimizer steps since training began (the capture's step)
    size: int
    behavior: list[torch.Tensor]
    advantages: list[torch.Tensor]
    masks: list[torch.Tensor]
    prepass: list[torch.Tensor]
    selections: list[Any]
    sampler: list[torch.Tensor | None]
    first: int = 0  # position of its first micro-batch in the generation buffer (where the framework indexes it)


class NoteParameterGradients(TrainerCallback):
    """Notes the parameters' gradient norms right before each optimizer step (after clipping),
    for a trainer with a ``_recorder`` (a capture's, or None) and its current ``_window``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer._recorder is not None and trainer._window is not None:
            trainer._recorder.record_parameter_gradients(step=trainer._window.index, named_parameters=trainer.model.named_parameters())
