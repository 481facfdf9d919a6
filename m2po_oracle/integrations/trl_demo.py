"""A short real TRL training with M2PO on CPU, recorded for ``m2po-oracle audit``.

Everything is built in code (nothing is downloaded): a random-weight two-layer Llama
(hidden 32, vocab 64), a ``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel
vocabulary, an in-memory ``datasets.Dataset`` of prompts and a deterministic reward (the
share of completion tokens whose id is a multiple of 3). The rollouts are stale: each
generation batch serves ``steps_per_generation / gradient_accumulation_steps`` optimizer
batches, each iterated ``num_iterations`` times, so every optimizer step after the first
trains on completions an older policy sampled.

    HF_HUB_OFFLINE=1 python -m m2po_oracle.integrations.trl_demo --capture runs/trl
    m2po-oracle audit runs/trl

Data parallel, two processes on gloo (accelerate reads torchrun's environment; ``accelerate
launch --cpu --num_processes 2`` starts one process unless given an MPI hostfile):

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 -m m2po_oracle.integrations.trl_demo --capture runs/trl-dp2

``--fault NAME`` plants one of the integration's bugs (``TRLFaults``), for the audit to catch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, fields
from typing import Any

from m2po_oracle.integrations.demo import DemoKnobs
from m2po_oracle.integrations.trl import M2POGRPOTrainer, TRLFaults
from m2po_oracle.trainer.grpo import tiny_llama as step_llama

#: Token ids of the toy vocabulary (as the seed trainer's).
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB_SIZE = 64


@dataclass(frozen=True)
class DemoSetup(DemoKnobs):
    """One short TRL training run: the shared knobs, tau 0.1, and the prompts each
    generation batch draws from."""

    prompts_per_generation: int = 4
    tau: float = 0.1


def tokenizer() -> Any:
    """A WordLevel tokenizer over ``<pad> <bos> <eos> t3 ... t63`` (ids 0..63), built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, **{f"t{i}": i for i in range(3, VOCAB_SIZE)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def tiny_llama(seed: int) -> Any:
    """The trainer step's random-weight two-layer Llama (float32, eager attention, no
    dropout) over this demo's vocabulary, in training mode as a Trainer receives it."""
    return step_llama(seed, vocab_size=VOCAB_SIZE).train()


def prompts(count: int, seed: int) -> Any:
    """An in-memory dataset of ``count`` prompts of three to five tokens."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict(
        {"prompt": [" ".join(f"t{rng.randrange(3, VOCAB_SIZE)}" for _ in range(rng.randrange(3, 6))) for _ in range(count)]}
    )


def multiple_of_three(completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of a completion's tokens whose id is a multiple of 3."""
    return [sum(1 for t in ids if t % 3 == 0) / max(len(ids), 1) for ids in completion_ids]


def grpo_config(setup: DemoSetup, output_dir: str, **overrides: Any) -> Any:
    from trl import GRPOConfig

    options: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        disable_dropout=True,
        gradient_checkpointing=False,
        per_device_train_batch_size=setup.per_device_train_batch_size,
        gradient_accumulation_steps=setup.gradient_accumulation_steps,
        steps_per_generation=setup.steps_per_generation,
        num_iterations=setup.num_iterations,
        num_generations=setup.num_generations,
        max_completion_length=setup.max_completion_length,
        learning_rate=setup.learning_rate,
        max_steps=setup.steps,
        logging_steps=1,
        save_strategy="no",
        seed=setup.seed,
        max_grad_norm=setup.max_grad_norm,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    options.update(overrides)
    return GRPOConfig(**options)


def build_trainer(
    setup: DemoSetup, output_dir: str, *, capture: str | None = None, faults: Any = None, model: Any = None, **overrides: Any
) -> Any:
    """An ``M2POGRPOTrainer`` over the toy model, tokenizer, prompts and reward."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dataset = prompts(setup.prompts_per_generation * max(setup.steps, 1) * 4, setup.seed)
    return M2POGRPOTrainer(
        model=model if model is not None else tiny_llama(setup.seed),
        reward_funcs=multiple_of_three,
        args=grpo_config(setup, output_dir, **overrides),
        train_dataset=dataset,
        processing_class=tokenizer(),
        m2po_tau=setup.tau,
        capture=capture,
        faults=faults,
    )


def train(setup: DemoSetup = DemoSetup(), *, capture: str | None = None, faults: Any = None, output_dir: str | None = None) -> Any:
    """Run the training; returns the trainer (its ``state.log_history`` holds TRL's logs)."""
    with tempfile.TemporaryDirectory(prefix="m2po-trl-") as scratch:
        trainer = build_trainer(setup, output_dir or scratch, capture=capture, faults=faults)
        trainer.train()
    return trainer


def _save_inputs(trainer: Any, directory: str) -> None:
    """Write the token ids and masks of every micro-batch ``_compute_loss`` receives."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    compute_loss = trainer._compute_loss

    def saving(model: Any, inputs: dict[str, Any]) -> Any:
        micro = trainer._step % trainer.current_gradient_accumulation_steps
        names = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        save_file(
            {name: inputs[name].detach().cpu().contiguous() for name in names},
            os.path.join(directory, f"rank{trainer.accelerator.process_index}-step{trainer.state.global_step}-mb{micro}.safetensors"),
        )
        return compute_loss(model, inputs)

    trainer._compute_loss = saving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m2po_oracle.integrations.trl_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True, help="directory to record every micro-batch in (for m2po-oracle audit)")
    parser.add_argument("--steps", type=int, default=DemoSetup.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--tau", type=float, default=DemoSetup.tau, help="M2PO's budget (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DemoSetup.seed)
    fault_names = [f.name for f in fields(TRLFaults)]
    parser.add_argument("--fault", choices=fault_names, help="plant one of the integration's bugs (a negative control)")
    parser.add_argument(
        "--max-grad-norm", type=float, default=DemoSetup.max_grad_norm, help="gradient clipping (0: off; default %(default)s)"
    )
    parser.add_argument(
        "--save-inputs",
        metavar="DIR",
        help="also write each micro-batch's token ids and masks to DIR (safetensors), so that a test can recompute "
        "the step's parameter gradient from the capture",
    )
    args = parser.parse_args(argv)
    setup = DemoSetup(steps=args.steps, tau=args.tau, seed=args.seed, max_grad_norm=args.max_grad_norm)
    faults = TRLFaults(**{args.fault: True}) if args.fault else None
    with tempfile.TemporaryDirectory(prefix="m2po-trl-") as scratch:
        trainer = build_trainer(setup, scratch, capture=args.capture, faults=faults)
        if args.save_inputs:
            _save_inputs(trainer, args.save_inputs)
        trainer.train()
    for entry in trainer.state.log_history:
        shown = {k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items() if k.startswith("m2po/") or k in ("loss", "step")}
        if shown:
            print(shown)
    accelerator = trainer.accelerator
    world = f"{accelerator.num_processes} process(es), {accelerator.distributed_type}"
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        world += f" on {dist.get_backend()}, model wrapped as {type(trainer.model_wrapped).__name__}"
    print(
        f"rank {accelerator.process_index} of {world}: captured {trainer.state.global_step} optimizer steps in {args.capture}; "
        f"audit: m2po-oracle audit {args.capture}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
