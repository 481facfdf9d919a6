"""A short real ms-swift GRPO training with M2PO on CPU, recorded for ``m2po-oracle audit``.

Everything is built in code (nothing is downloaded): a random-weight two-layer Llama
(hidden 32; a long EOS row, so completions end at varied lengths) saved with ``save_pretrained``, a byte-level BPE tokenizer without merges (one
token per byte), a JSONL file of short prompts and a deterministic reward (the share of the
sum of the completion's code points modulo 5, registered as an ms-swift ORM
by the demo's own plugin file). Then ``swift rlhf --rlhf_type grpo`` runs in this process
with the M2PO plugin. The rollouts are stale: each generation batch serves
``steps_per_generation / gradient_accumulation_steps`` optimizer batches, each iterated
``num_iterations`` times, so every optimizer step after the first trains on completions an
older policy sampled.

    python -m m2po_oracle.integrations.swift_demo --capture runs/swift
    m2po-oracle audit runs/swift

Data parallel, two processes on gloo (ms-swift reads torchrun's environment and starts gloo on
the CPU), one selection across both per optimizer batch:

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 -m m2po_oracle.integrations.swift_demo --capture runs/swift-dp2

``--fault NAME`` plants one of the integration's bugs (``SwiftFaults``), for the audit to
catch; ``--prepare DIR`` only writes the model and data to DIR and prints the plain ``swift rlhf``
command (with the plugin's environment variables) that trains on them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from m2po_oracle.integrations.demo import DemoKnobs

#: The demo's reward, an ms-swift ORM registered by this plugin file (beside the M2PO plugin).
REWARD_PLUGIN = Path(__file__).with_name("swift_plugin") / "m2po_demo_reward.py"
REWARD_NAME = "m2po_demo_code_points"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
#: The EOS row's scale (the other rows' is the init's 0.02): the EOS logit's spread across contexts.
EOS_ROW_SCALE = 0.15


@dataclass(frozen=True)
class DemoSetup(DemoKnobs):
    """One short ms-swift training run (the shared knobs, tau 0.05)."""


def tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: one token per byte, three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(sorted(alphabet))})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def write_model(directory: Path, seed: int) -> Path:
    """A random-weight two-layer Llama and its tokenizer, saved where ``--model`` can load them."""
    demo_model(seed).save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return directory


def demo_model(seed: int) -> Any:
    """The demo's random-weight two-layer Llama, deterministic in ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # A random model's logits are nearly flat over 259 tokens, so no completion would end
            # before max_completion_length and every micro-batch would hold the same number of
            # tokens, which hides a per-micro-batch denominator. A long random EOS row makes
            # the EOS logit vary widely with the context: completions end at varied lengths.
            model.lm_head.weight[tok.eos_token_id] = torch.randn(config.hidden_size) * EOS_ROW_SCALE
    return model


def write_dataset(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            prompt = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 6)))
            out.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    return path


def swift_arguments(setup: DemoSetup, model: Path, dataset: Path, output_dir: Path, **overrides: Any) -> list[str]:
    """The ``swift rlhf`` arguments of the run (every option M2PO's rules look at is explicit)."""
    from m2po_oracle.integrations.swift import PLUGIN_FILE

    options: dict[str, Any] = dict(
        rlhf_type="grpo",
        model=str(model),
        model_type="llama",
        template="default",
        check_model="false",
        use_vllm="false",
        dataset=str(dataset),
        reward_funcs=REWARD_NAME,
        external_plugins=[str(PLUGIN_FILE), str(REWARD_PLUGIN)],
        output_dir=str(output_dir),
        loss_type="dapo",
        beta=0,
        num_generations=setup.num_generations,
        per_device_train_batch_size=setup.per_device_train_batch_size,
        gradient_accumulation_steps=setup.gradient_accumulation_steps,
        steps_per_generation=setup.steps_per_generation,
        num_iterations=setup.num_iterations,
        max_completion_length=setup.max_completion_length,
        learning_rate=setup.learning_rate,
        max_steps=setup.steps,
        max_grad_norm=setup.max_grad_norm,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        repetition_penalty=1.0,
        seed=setup.seed,
        data_seed=setup.seed,
        torch_dtype="float32",
        tuner_type="full",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        split_dataset_ratio=0,
        dataloader_num_workers=0,
        dataset_num_proc=1,
        lr_scheduler_type="constant",
        warmup_ratio=0,
        report_to="none",
        use_cpu="true",
        gradient_checkpointing="false",
        log_completions="false",
    )
    options.update(overrides)
    argv: list[str] = []
    for name, value in options.items():
        argv.append(f"--{name}")
        argv.extend(str(v) for v in value) if isinstance(value, list) else argv.append(str(value))
    return argv


def _save_inputs(trainer: Any, directory: str) -> None:
    """Write the model inputs (token ids, masks, the completion frame) of every micro-batch
    the loss receives, as ``rank{R}-step{S}-mb{M}.safetensors``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    compute = trainer._compute_loss_and_metrics

    def saving(model: Any, model_inputs: dict[str, Any], grpo_batch: Any) -> Any:
        micro = trainer._step % trainer.current_gradient_accumulation_steps
        tensors = {name: value.detach().cpu().contiguous() for name, value in model_inputs.items() if isinstance(value, torch.Tensor)}
        tensors["completion_mask"] = grpo_batch.completion_mask.detach().cpu().contiguous()
        tensors["logits_to_keep"] = torch.tensor(int(grpo_batch.logits_to_keep))
        save_file(
            tensors,
            os.path.join(directory, f"rank{trainer.accelerator.process_index}-step{trainer.state.global_step}-mb{micro}.safetensors"),
        )
        return compute(model, model_inputs, grpo_batch)

    trainer._compute_loss_and_metrics = saving


def _rlhf(argv: list[str], save_inputs: str | None) -> Any:
    """``swift rlhf`` in this process (``rlhf_main``); with ``save_inputs``, ms-swift's own
    pipeline with the trainer it builds writing its inputs there first."""
    from swift.pipelines import rlhf_main

    if save_inputs is None:
        return rlhf_main(argv)
    from swift.pipelines.train.rlhf import SwiftRLHF

    directory = save_inputs  # narrowed to str here, where the nested method cannot see the check

    class SavingInputs(SwiftRLHF):
        def train(self, trainer: Any) -> Any:
            _save_inputs(trainer, directory)
            return super().train(trainer)

    return SavingInputs(argv).main()


def run(
    setup: DemoSetup,
    capture: str | None,
    fault: str | None = None,
    scratch: str | None = None,
    save_inputs: str | None = None,
    **overrides: Any,
) -> list[str]:
    """Build the model and data in ``scratch`` and run ``swift rlhf`` in this process; returns its arguments."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MODELSCOPE_OFFLINE", "1")
    os.environ["M2PO_TAU"] = repr(setup.tau)
    if capture:
        os.environ["M2PO_CAPTURE"] = str(capture)
    else:
        os.environ.pop("M2PO_CAPTURE", None)
    if fault:
        os.environ["M2PO_SWIFT_FAULT"] = fault
    else:
        os.environ.pop("M2PO_SWIFT_FAULT", None)
    with tempfile.TemporaryDirectory(prefix="m2po-swift-") as tmp:
        root = Path(scratch or tmp)
        model = write_model(root / "model", setup.seed)
        dataset = write_dataset(root / "prompts.jsonl", 64, setup.seed)
        argv = swift_arguments(setup, model, dataset, root / "output", **overrides)
        _rlhf(argv, save_inputs)
    return argv


def main(argv: list[str] | None = None) -> int:
    from m2po_oracle.integrations.swift import SwiftFaults

    parser = argparse.ArgumentParser(prog="python -m m2po_oracle.integrations.swift_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", help="directory to record every micro-batch in (for m2po-oracle audit)")
    parser.add_argument("--steps", type=int, default=DemoSetup.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--tau", type=float, default=DemoSetup.tau, help="M2PO's budget (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DemoSetup.seed)
    parser.add_argument(
        "--fault", choices=[f.name for f in fields(SwiftFaults)], help="plant one of the integration's bugs (a negative control)"
    )
    parser.add_argument(
        "--swift-option",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="override one swift rlhf option (e.g. --swift-option loss_type grpo, which M2PO refuses)",
    )
    parser.add_argument("--save-inputs", metavar="DIR", help="also write every micro-batch's model inputs to DIR (to recompute gradients)")
    parser.add_argument(
        "--prepare",
        metavar="DIR",
        help="only write the model, tokenizer and prompts to DIR and print the swift rlhf command that trains on them",
    )
    args = parser.parse_args(argv)
    setup = DemoSetup(steps=args.steps, tau=args.tau, seed=args.seed)
    overrides = dict(args.swift_option)
    if args.prepare:
        root = Path(args.prepare).resolve()
        root.mkdir(parents=True, exist_ok=True)
        model = write_model(root / "model", setup.seed)
        dataset = write_dataset(root / "prompts.jsonl", 64, setup.seed)
        environment = f"HF_HUB_OFFLINE=1 M2PO_TAU={setup.tau!r} M2PO_CAPTURE={shlex.quote(args.capture or 'runs/swift')}"
        if args.fault:
            environment += f" M2PO_SWIFT_FAULT={args.fault}"
        print(f"{environment} swift rlhf {shlex.join(swift_arguments(setup, model, dataset, root / 'output', **overrides))}")
        return 0
    if not args.capture:
        parser.error("--capture: required unless --prepare")
    run(setup, args.capture, args.fault, save_inputs=args.save_inputs, **overrides)
    import torch.distributed as dist

    world = f"rank {dist.get_rank()} of {dist.get_world_size()} process(es) on {dist.get_backend()}: " if dist.is_initialized() else ""
    print(f"{world}captured in {args.capture}; audit: m2po-oracle audit {args.capture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
