"""capture.watch: one line records a framework's own M2PO functions, and the audit judges the
capture as it judges a hand-written one (equivalent when the framework is right, divergent on
the right check when a bug is planted in it).

The "framework" is this module's stand-in section: a mask function and a token-loss function
with a real framework's signatures, and a trainer with gradient accumulation (2 micro-batches
per optimizer step), an optimizer and a tiny policy. The watch wraps this module's attributes,
as it would wrap a framework's module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from audit_run import check_statuses, run_audit

from m2po_oracle import capture
from m2po_oracle.capture import Recorder, watch

TAU = 0.04
MICRO_BATCHES, ROWS, WIDTH, FEATURES = 2, 3, 6, 4

# ---------------------------------------------------------------------------------------------
# The stand-in framework (what a user cannot edit).


def compute_m2po_mask(log_ratio, completion_mask, advantages, m2_threshold=0.04):
    """Algorithm 1 over the tokens it is given: (keep, metrics)."""
    d = log_ratio.detach().double()
    valid = completion_mask.bool()
    trust = valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    m2 = d.square()[trust]
    ordered, order = torch.sort(m2)
    means = torch.cumsum(ordered, 0) / torch.arange(1, m2.numel() + 1, dtype=torch.float64)
    kept = int((means <= m2_threshold).sum())
    keep_trust = torch.zeros(m2.numel(), dtype=torch.bool)
    keep_trust[order[:kept]] = True
    keep = valid.clone()
    keep[trust] = keep_trust
    n = int(valid.sum())
    metrics = {
        "m2_before": float(m2.mean()) if m2.numel() else 0.0,
        "m2_after": float(m2[keep_trust].mean()) if kept else 0.0,
        "masked_fraction": (m2.numel() - kept) / n,
        "valid_count": n,
        "note": "not a number",
    }
    return keep, metrics


def compute_m2po_token_loss(per_token_logps, old_per_token_logps, advantages, completion_mask, m2po_mask):
    """The unreduced loss -exp(d) A on kept tokens (the caller reduces it)."""
    ratio = torch.exp(per_token_logps - old_per_token_logps)
    return torch.where(m2po_mask, -ratio * advantages, torch.zeros_like(advantages))


def compute_m2po_loss(log_ratio, completion_mask, advantages, m2_threshold=0.04):
    """A fused kernel in the style of a framework's: selects on what it is given (through the module's
    global name) and returns (per-token loss, keep, metrics)."""
    keep, metrics = compute_m2po_mask(log_ratio, completion_mask, advantages, m2_threshold)
    return torch.where(keep, -torch.exp(log_ratio) * advantages, torch.zeros_like(advantages)), keep, metrics


def _batches(step: int, micro_batches: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for mb in range(micro_batches):
        generator = torch.Generator().manual_seed(100 * step + mb)
        x = torch.randn(ROWS, WIDTH, FEATURES, generator=generator)
        old = -torch.rand(ROWS, WIDTH, generator=generator) - 0.5 + 0.3 * torch.randn(ROWS, WIDTH, generator=generator)
        sign = torch.where(torch.rand(ROWS, 1, generator=generator) < 0.5, -1.0, 1.0)
        out.append(
            {
                "x": x,
                "old": old,
                "advantages": sign.expand(ROWS, WIDTH).clone(),
                "mask": torch.rand(ROWS, WIDTH, generator=generator) < 0.85,
            }
        )
    return out


class Trainer:
    """Gradient accumulation over MICRO_BATCHES per optimizer step. ``bug``: None (the mask
    selected once per optimizer batch in a no-grad prepass), "per_micro_batch_mask" (the mask
    function called on each micro-batch), "kept_count_denominator" (the loss divided by the
    kept count), "twice_n" (divided by 2 N, as a trainer dividing by N and then by the
    accumulation steps again), "fused" (compute_m2po_loss on each micro-batch: selects per micro-batch)."""

    def __init__(self, bug: str | None = None, micro_batches: int = MICRO_BATCHES) -> None:
        self.micro_batches = micro_batches
        torch.manual_seed(0)
        self.policy = torch.nn.Linear(FEATURES, 1)
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.1)
        self.bug = bug
        self.global_step = 0
        self.losses: list[torch.Tensor] = []
        self.returned: list[object] = []

    def logp(self, batch):
        return torch.nn.functional.logsigmoid(self.policy(batch["x"]).squeeze(-1))

    def train(self, steps: int) -> None:
        module = sys.modules[__name__]  # looked up at call time, as a framework does
        for step in range(steps):
            window = _batches(step, self.micro_batches)
            n = sum(int(b["mask"].sum()) for b in window)
            with torch.no_grad():
                ratio = torch.cat([self.logp(b) - b["old"] for b in window])
                cat = {k: torch.cat([b[k] for b in window]) for k in ("mask", "advantages")}
                window_keep, _ = module.compute_m2po_mask(ratio, cat["mask"], cat["advantages"], TAU)
            for mb, batch in enumerate(window):
                self.batch = batch
                logp = self.current_logp = self.logp(batch)
                if self.bug == "fused":
                    per_token, keep, _ = out = module.compute_m2po_loss(logp - batch["old"], batch["mask"], batch["advantages"], TAU)
                    self.returned.append(out)
                    loss = per_token.sum() / n
                else:
                    keep = window_keep[mb * ROWS : (mb + 1) * ROWS]
                    if self.bug == "per_micro_batch_mask":
                        keep, _ = module.compute_m2po_mask(logp - batch["old"], batch["mask"], batch["advantages"], m2_threshold=TAU)
                    per_token = module.compute_m2po_token_loss(logp, batch["old"], batch["advantages"], batch["mask"], keep)
                    self.returned.append(per_token)
                    loss = per_token.sum() / (keep.sum() if self.bug == "kept_count_denominator" else 2 * n if self.bug == "twice_n" else n)
                self.losses.append(loss.detach())
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.global_step += 1


# ---------------------------------------------------------------------------------------------
# The tests.

FRAMEWORK = sys.modules[__name__]
#: The token loss reads the mask as an argument and has no tau: both said once.
LOSS_READS = {"tau": TAU}
NAMES = ("compute_m2po_mask", "compute_m2po_token_loss")


def _behavior(trainer: Trainer):
    # The fused kernel sees only the log-ratio: the behaviour log-probs come from the trainer's batch.
    return lambda args, kwargs, result: trainer.batch["old"]


def _run(tmp_path: Path, bug: str | None, steps: int = 3, micro_batches: int = MICRO_BATCHES) -> tuple[Trainer, dict, int]:
    trainer = Trainer(bug, micro_batches)
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1,cp=1,tp=1")
    if bug == "fused":
        names, inputs = ("compute_m2po_loss", "compute_m2po_mask"), {"compute_m2po_loss": {"behavior_logp": _behavior(trainer)}}
    else:
        names, inputs = NAMES, {"compute_m2po_token_loss": LOSS_READS}
    with watch(FRAMEWORK, names, recorder, optimizer=trainer.optimizer, inputs=inputs) as watcher:  # the one line
        trainer.train(steps)
    assert watcher.records == steps * micro_batches
    status, report = run_audit(tmp_path / "cap", tmp_path)
    return trainer, report, status


def test_a_correct_framework_watched_in_one_line_audits_equivalent(tmp_path: Path) -> None:
    _, report, status = _run(tmp_path, None)
    assert status == 0 and report["verdict"] == "equivalent", report
    assert report["capture"]["steps"] == [0, 1, 2] and report["capture"]["problems"] == []
    for step in report["steps"]:
        checks = check_statuses(step)
        assert checks["audit.selection"] == checks["audit.loss_sum"] == checks["audit.gradient"] == "pass", checks
        assert step["metrics"]["masked_fraction"] > 0  # the cut is exercised


def test_a_mask_selected_per_micro_batch_is_divergent_on_the_selection(tmp_path: Path) -> None:
    _, report, status = _run(tmp_path, "per_micro_batch_mask")
    assert status == 1 and report["verdict"] == "divergent"
    bad = [s for s in report["steps"] if s["verdict"] == "divergent"]
    assert bad, report
    for step in bad:
        assert check_statuses(step)["audit.selection"] == "fail" and "per_micro_batch_mask" in step["diagnosis"], step
        assert check_statuses(step)["audit.gradient"] == "pass"  # the loss is right for the mask it has


def test_a_loss_divided_by_the_kept_count_is_divergent_on_the_loss(tmp_path: Path) -> None:
    _, report, status = _run(tmp_path, "kept_count_denominator")
    assert status == 1 and report["verdict"] == "divergent"
    for step in report["steps"]:
        checks = check_statuses(step)
        assert checks["audit.selection"] == "pass" and checks["audit.loss_sum"] == "fail" and checks["audit.gradient"] == "fail", checks


def test_a_loss_divided_twice_says_the_divisor_the_recorded_losses_imply(tmp_path: Path) -> None:
    _, report, status = _run(tmp_path, "twice_n")
    assert status == 1 and report["verdict"] == "divergent", report
    for step in report["steps"]:
        assert check_statuses(step)["audit.loss_sum"] == "fail", check_statuses(step)
        implied = [o for o in step["observations"] if "imply a divisor" in o]
        assert len(implied) == 1 and "(2 x N)" in implied[0] and "every micro-batch implies" in implied[0], step["observations"]
        if not step["diagnosis"]:
            assert any(o.startswith("no known deviation explains it") for o in step["observations"]), step["observations"]


def test_an_equivalent_step_has_no_observation(tmp_path: Path) -> None:
    _, report, _ = _run(tmp_path, None)
    assert all(step["observations"] == [] for step in report["steps"]), [s["observations"] for s in report["steps"]]


def test_a_fused_kernel_calling_the_mask_inside_is_one_record_per_call(tmp_path: Path) -> None:
    # Both functions watched in one call; the mask call inside the loss call adds to its record.
    _, report, status = _run(tmp_path, "fused")
    assert status == 1, report  # per call is per micro-batch: two of them per optimizer step
    assert all("per_micro_batch_mask" in s["diagnosis"] for s in report["steps"] if s["verdict"] == "divergent")
    assert any(s["verdict"] == "divergent" for s in report["steps"])


def test_a_mask_function_watched_alone_with_a_step_callable_is_audited(tmp_path: Path) -> None:
    # No loss function watched: the record is written at the backward of logp (the mask's own
    # log-ratio never enters this loss, so logp is read from the trainer), its loss the M2PO
    # objective's sum(d loss / d logp); the step is the trainer's own counter.
    trainer = Trainer("per_micro_batch_mask")
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    with watch(
        FRAMEWORK,
        "compute_m2po_mask",
        recorder,
        step=lambda: trainer.global_step,
        inputs={"behavior_logp": _behavior(trainer), "logp": lambda args, kwargs, result: trainer.current_logp},
    ) as watcher:
        trainer.train(2)
    assert watcher.records == 2 * MICRO_BATCHES  # the no-grad window prepass is not recorded
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 1 and report["capture"]["steps"] == [0, 1]
    for step in report["steps"]:
        assert check_statuses(step)["audit.selection"] == "fail" and "per_micro_batch_mask" in step["diagnosis"], step
        assert check_statuses(step)["audit.gradient"] == check_statuses(step)["audit.loss_sum"] == "pass"


def _run_with_rollout(tmp_path: Path, drift: float) -> dict:
    """A correct framework whose sampler's log-probs are recorded too (``inputs={"rollout_logp": ...}``);
    ``drift``: how far the behaviour log-probs the loss used are from the sampler's."""
    trainer = Trainer(None)
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1,cp=1,tp=1")
    sampler = {"rollout_logp": lambda args, kwargs, result: trainer.batch["old"] + drift}
    with watch(FRAMEWORK, NAMES, recorder, optimizer=trainer.optimizer, inputs={"compute_m2po_token_loss": {**LOSS_READS, **sampler}}):
        trainer.train(2)
    return run_audit(tmp_path / "cap", tmp_path)[1]


def test_the_samplers_log_probs_given_to_the_watch_are_audited(tmp_path: Path) -> None:
    same = _run_with_rollout(tmp_path / "same", 0.0)
    assert same["verdict"] == "equivalent" and all(check_statuses(s)["audit.behavior_logp"] == "pass" for s in same["steps"]), same
    drifted = _run_with_rollout(tmp_path / "drifted", 0.05)
    assert drifted["verdict"] == "divergent", drifted
    assert all(check_statuses(s)["audit.behavior_logp"] == "fail" for s in drifted["steps"]), [check_statuses(s) for s in drifted["steps"]]


def test_a_fused_kernel_on_whole_optimizer_batches_is_equivalent_with_its_metrics(tmp_path: Path) -> None:
    _, report, status = _run(tmp_path, "fused", micro_batches=1)
    assert status == 0 and report["verdict"] == "equivalent", report
    assert all(check_statuses(s)["audit.metrics"] == "pass" for s in report["steps"])  # read from the nested mask call


def test_the_wrapper_changes_nothing_the_framework_computes(tmp_path: Path) -> None:
    plain = Trainer("fused")
    plain.train(2)
    trainer = Trainer("fused")
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    originals = [FRAMEWORK.compute_m2po_loss, FRAMEWORK.compute_m2po_mask]
    with watch(
        FRAMEWORK,
        ("compute_m2po_loss", "compute_m2po_mask"),
        recorder,
        optimizer=trainer.optimizer,
        inputs={"compute_m2po_loss": {"behavior_logp": _behavior(trainer)}},
    ) as watcher:
        assert FRAMEWORK.compute_m2po_loss is not originals[0]
        trainer.train(2)
    assert watcher.records == 2 * MICRO_BATCHES
    assert [FRAMEWORK.compute_m2po_loss, FRAMEWORK.compute_m2po_mask] == originals  # restored
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, trainer.losses))
    for a, b in zip(plain.returned, trainer.returned):
        assert all(torch.equal(x, y) for x, y in zip(a[:2], b[:2])) and a[2] == b[2]
    for (name, a), b in zip(plain.policy.named_parameters(), trainer.policy.parameters()):
        assert torch.equal(a, b), name  # the same gradients, so the same parameters after 2 steps


def test_the_return_value_is_the_originals_object(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    sentinel = (torch.zeros(2, requires_grad=True), torch.ones(2, dtype=torch.bool), {"m2_before": 0.0})

    class Kernel:
        def loss(self, log_ratio, completion_mask, advantages, m2_threshold=0.04):
            return sentinel

        @staticmethod
        def helper(x):
            return x

    kernel = Kernel()
    with watch(kernel, "loss", recorder, step=lambda: 0, inputs={"behavior_logp": lambda a, k, r: torch.zeros(2)}):
        assert "loss" in vars(kernel)  # this object's method only
        assert kernel.loss(torch.zeros(2, requires_grad=True), torch.ones(2), torch.ones(2)) is sentinel
        assert Kernel().loss(None, None, None) is sentinel
    assert "loss" not in vars(kernel)  # restored: the class's method again
    original = vars(Kernel)["helper"]
    with watch(Kernel, "helper", recorder, step=lambda: 0):
        assert isinstance(vars(Kernel)["helper"], staticmethod) and vars(Kernel)["helper"] is not original
        assert Kernel.helper(3) == 3
    assert vars(Kernel)["helper"] is original


def test_a_skipped_step_only_calls_the_original(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1", every=2)
    with watch(FRAMEWORK, "compute_m2po_token_loss", recorder, step=lambda: 1):
        logp = torch.zeros(2, 3, requires_grad=True)
        out = FRAMEWORK.compute_m2po_token_loss(
            logp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
        )  # no tau: never read on a skipped step
        assert logp._backward_hooks is None and out._backward_hooks is None
        out.sum().backward()
    assert capture.load_capture(tmp_path / "cap").steps() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "pass optimizer="),
        ({"step": 3}, "step must be a callable"),
        ({"optimizer": object()}, "optimizer must be a torch.optim.Optimizer"),
        ({"step": lambda: 0, "inputs": {"logprobs": "x"}}, "unknown names ['logprobs']"),
        ({"step": lambda: 0, "inputs": {"logp": "no_such_argument"}}, "'no_such_argument' is not an argument of compute_m2po_token_loss"),
        ({"step": lambda: 0, "inputs": {"tau": [0.04]}}, "inputs['tau'] must be an argument name"),
        ({"step": lambda: 0, "outputs": {"keep": 3}}, "outputs['keep'] must be"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_was_expected(tmp_path: Path, kwargs, message) -> None:
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    with pytest.raises(ValueError) as raised:
        watch(FRAMEWORK, "compute_m2po_token_loss", recorder, **kwargs)
    assert message in str(raised.value), raised.value
    assert FRAMEWORK.compute_m2po_token_loss.__name__ == "compute_m2po_token_loss"
    assert not hasattr(FRAMEWORK.compute_m2po_token_loss, "__wrapped__")  # nothing left wrapped


def test_bad_targets_and_recorders_are_named(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    with pytest.raises(ValueError, match="has no attribute 'compute_nothing'"):
        watch(FRAMEWORK, "compute_nothing", recorder, step=lambda: 0)
    with pytest.raises(ValueError, match="recorder must be an m2po_oracle.capture.recorder.Recorder"):
        watch(FRAMEWORK, "compute_m2po_mask", object(), step=lambda: 0)
    with pytest.raises(ValueError, match="expected a function or method"):
        watch(FRAMEWORK, "TAU", recorder, step=lambda: 0)
    with watch(FRAMEWORK, "compute_m2po_mask", recorder, step=lambda: 0), pytest.raises(ValueError, match="already watched"):
        watch(FRAMEWORK, "compute_m2po_mask", recorder, step=lambda: 0)


def test_a_log_ratio_without_the_log_probs_is_a_clear_error(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "cap", rank=0, world_size=1, topology="dp=1")
    ratio = torch.zeros(2, 3, requires_grad=True)
    expected = r"cannot read \['logp', 'behavior_logp'\].*passes a log-ratio.*inputs=\{'behavior_logp'"
    with watch(FRAMEWORK, "compute_m2po_loss", recorder, step=lambda: 0), pytest.raises(ValueError, match=expected):
        FRAMEWORK.compute_m2po_loss(ratio, torch.ones(2, 3), torch.ones(2, 3))
