"""Every adapter family, against stand-ins of exactly its shape (``fixtures/ports``): a
correct port is equivalent, a planted bug divergent on its check, through the CLI and the
pytest plugin; a check the adapter cannot run is "not run", never "pass"."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from m2po_oracle.adapters import ADAPTERS
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main

PORTS = Path(__file__).resolve().parents[2] / "fixtures" / "ports"
EXIT = {"equivalent": EXIT_EQUIVALENT, "divergent": EXIT_DIVERGENT, "unusable": EXIT_UNUSABLE}
#: Enough generated batches for every planted bug here to show (seed 0), few enough to stay quick.
EXAMPLES = "30"


@dataclass(frozen=True)
class Case:
    adapter: str
    port: str  # file.py:function under fixtures/ports
    verdict: str
    failing: str | None = None  # the check the planted bug must fail
    bind: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()  # metric checks that must have run on what the port returns (mapped names)
    isolated: bool = False  # in the worker process: the bindings must reach it
    topology: str | None = None  # a distributed port: a world of ranks

    @property
    def spec(self) -> str:
        return f"{PORTS / self.port}"

    @property
    def id(self) -> str:
        return f"{self.adapter}-{self.port.partition(':')[2]}" + ("-bound" if self.bind else "")

    def options(self, prefix: str = "--") -> list[str]:
        bindings = [part for binding in self.bind for part in (f"{prefix}bind", binding)]
        # A stand-in's verdict, failing check and replay need no minimal batch, and shrinking
        # (test_cli holds compare's counterexamples minimal) cost up to 40 s a case here: in
        # the worker every call is a round trip, and in process one mask took 226 calls.
        how = [f"{prefix}topology", self.topology] if self.topology else [] if self.isolated else [f"{prefix}in-process"]
        return [f"{prefix}adapter", self.adapter, *bindings, f"{prefix}examples", EXAMPLES, *how, f"{prefix}no-shrink"]


CASES = (
    Case("mask_only", "mask_only.py:select_mask", "equivalent", metrics=("metrics.masked_fraction", "metrics.m2_after")),
    Case("mask_only", "mask_only.py:select_mask_strict_stop", "divergent", "selection.minimal"),
    Case(
        "mask_only",
        "mask_only.py:select_mask_reordered",
        "equivalent",
        bind=("budget=budget", "keep=1", "metrics=0"),
        metrics=("metrics.masked_fraction",),
        isolated=True,
    ),
    Case("mask_function", "mask_function.py:m2po_loss_mask", "equivalent", metrics=("metrics.m2_before", "metrics.trust_region_count")),
    Case("mask_function", "mask_function.py:m2po_loss_mask_without_advantages", "divergent", "selection.only_trust_region_masked"),
    Case("masked_loss", "masked_loss.py:m2po_masked_loss", "equivalent"),
    Case("masked_loss", "masked_loss.py:m2po_masked_loss_kept_denominator", "divergent", "loss"),
    Case("per_token_loss", "per_token_loss.py:m2po_per_token_loss", "equivalent", metrics=("metrics.m2_before",)),
    Case("per_token_loss", "per_token_loss.py:m2po_per_token_loss_per_sequence", "divergent", "selection.minimal"),
    Case(
        "per_token_loss",
        "per_token_loss.py:m2po_per_token_loss_reordered",
        "equivalent",
        bind=("logp=logp", "behavior_logp=old_logp", "keep=0", "per_token_loss=1"),
        isolated=True,
    ),
    # Reads config.policy_loss.get("m2_budget"): runs as is (the config nests policy_loss).
    Case("policy_loss", "policy_loss.py:compute_policy_loss_m2po", "equivalent", metrics=("metrics.masked_fraction", "metrics.m2_before")),
    Case("policy_loss", "policy_loss.py:compute_policy_loss_m2po_kept_denominator", "divergent", "loss"),
    Case(
        "policy_loss",
        "policy_loss.py:compute_policy_loss_m2po_custom_budget",
        "equivalent",
        bind=("budget=config.actor.m2po.budget",),
        isolated=True,
    ),
    # ... and without its binding it cannot find its budget: every call raises.
    Case("policy_loss", "policy_loss.py:compute_policy_loss_m2po_custom_budget", "unusable", "call"),
    Case("verl_release", "verl_release.py:compute_policy_loss", "equivalent", metrics=("metrics.m2_before", "metrics.masked_fraction")),
    Case("verl_release", "verl_release.py:compute_policy_loss_breakpoint_below", "divergent", "selection.minimal"),
    Case(
        "verl_release",
        "verl_release.py:compute_policy_loss_v2",
        "equivalent",
        bind=("clip_ratio_c=3.0", "metrics=1"),
        metrics=("metrics.m2_before",),
        isolated=True,
    ),
    Case(
        "clip_kernel",
        "clip_kernel.py:m2po_clip_loss",
        "equivalent",
        bind=("masked_fraction=1", "m2_before=2", "m2_after=3"),
        metrics=("metrics.masked_fraction", "metrics.m2_before", "metrics.m2_after"),
    ),
    Case("clip_kernel", "clip_kernel.py:m2po_water_filling_clip", "divergent", "loss"),
    Case("packed", "packed.py:packed_m2po", "equivalent", metrics=("metrics.m2_before", "metrics.valid_count")),
    Case("packed", "packed.py:packed_m2po_per_sequence", "divergent", "selection.minimal"),
    Case("group", "group.py:m2po_loss_dp", "equivalent", metrics=("distributed.metrics",), topology="dp=2,tp=2"),
    Case("group", "group.py:m2po_loss_dp_local_denominator", "divergent", "distributed.shard_gradient", topology="dp=2"),
)


def params(cases):
    # Distributed worlds share one xdist group: two gloo worlds at once would oversubscribe two cores.
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xdist_group("distributed")] if c.topology else []) for c in cases]


def test_every_adapter_has_a_correct_and_a_planted_bug_stand_in():
    for name in ADAPTERS:
        verdicts = {c.verdict for c in CASES if c.adapter == name}
        assert {"equivalent", "divergent"} <= verdicts, f"{name}: expected a correct and a planted-bug stand-in, got {verdicts}"


@pytest.mark.parametrize("case", params(CASES))
def test_the_cli_gives_each_stand_in_its_verdict(case, tmp_path):
    report = tmp_path / "report.json"
    assert main(["compare", "--impl", case.spec, *case.options(), "--json", str(report)]) == EXIT[case.verdict]
    data = json.loads(report.read_text())
    status = {c["name"]: c["status"] for c in data["checks"]}
    failed = {name for name, s in status.items() if s == "fail"}
    assert data["verdict"] == case.verdict and (case.failing in failed if case.failing else not failed), failed
    adapter = data["adapter"]
    assert adapter["name"] == case.adapter and adapter["bindings"] == list(case.bind) and adapter["call"]
    # What the adapter builds or decides itself is never reported as a pass.
    for check in ADAPTERS[case.adapter].not_run(case.bind):
        assert status[check] == "not run", f"{check}: {status[check]} although the adapter cannot run it"
    for check in case.metrics:
        assert status[check] == "pass", f"{check}: the port's metric was not read back ({status[check]})"
    if case.verdict == "divergent":  # the replay makes the same call, bindings included, and fails again
        shows = [c for c in data["counterexamples"] if case.failing in (c["check"], *c.get("checks", ()))]
        assert shows, f"no counterexample for {case.failing}"
        replay = shlex.split(shows[0]["replay"])
        assert replay[replay.index("--adapter") + 1] == case.adapter
        assert [replay[i + 1] for i, part in enumerate(replay) if part == "--bind"] == list(case.bind)
        assert main(replay[1:]) == EXIT_DIVERGENT


@pytest.mark.parametrize("case", params(c for c in CASES if c.verdict != "unusable"))
def test_the_pytest_plugin_gives_each_stand_in_its_verdict(case, pytester):
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "-rfs", "--m2po-impl", case.spec, *case.options("--m2po-")
    )
    outcomes = result.parseoutcomes()
    if case.failing:
        result.stdout.fnmatch_lines([f"*FAILED*::{case.failing}*"])
    else:
        assert outcomes.get("failed", 0) == 0, result.stdout.str()[-3000:]
    skipped = [c for c in ADAPTERS[case.adapter].not_run(case.bind) if not c.startswith("metrics.")]
    if skipped:  # a check outside the adapter's reach is skipped, saying why
        result.stdout.fnmatch_lines([f"*SKIPPED*adapter {case.adapter}: *"])
    assert outcomes.get("skipped", 0) >= len(skipped)


def _clip_kernel_reading_the_shape(ppo_kl, advantages, budget, response_mask):
    """A self-written clip kernel that, like many ports, reads ppo_kl's shape before anything."""
    import torch

    _rows, _ = ppo_kl.shape
    ratio = torch.exp(-ppo_kl)
    loss = -(ratio * advantages * response_mask).sum() / response_mask.sum().clamp(min=1)
    return loss, torch.zeros(())


def test_a_port_that_chokes_on_the_adapters_none_is_told_so():
    """On the missing-behaviour probe the clip_kernel adapter can only hand the port
    ppo_kl=None; the crash it causes says that None was the adapter's, not a bug in the
    port's arithmetic (seen on the Relax port: "AttributeError: 'NoneType' object has no
    attribute 'shape'" and nothing else)."""
    from m2po_oracle.adapters import adapt
    from m2po_oracle.judge.validation import run_probe

    result = run_probe(adapt(_clip_kernel_reading_the_shape, "clip_kernel"), "behavior_logp_missing")
    assert result.status == "crashed", result
    assert "AttributeError: 'NoneType' object has no attribute 'shape'" in result.message
    assert "the adapter passed ppo_kl=None: it builds ppo_kl from behavior_logp" in result.message, result.message
    # Any other probe's failure carries no such note.
    assert "the adapter passed" not in run_probe(adapt(_clip_kernel_reading_the_shape, "clip_kernel"), "nan_logp_on_valid_token").message


def _mask_rows_port(behavior_logp, proximal_logp, loss_mask, threshold, advantages):
    """A self-written mask function that, like ports editing per-sequence lists, returns one
    mask per row (and its metrics): Algorithm 1's mask (the core's)."""
    from m2po_oracle.core.loss import select_tokens

    return [row for row in select_tokens(proximal_logp, behavior_logp, advantages, loss_mask.bool(), tau=threshold).keep], {}


def _mask_port_returning_python_lists(behavior_logp, proximal_logp, loss_mask, threshold, advantages):
    """Refuses nothing and returns its mask as nested Python lists, which no adapter reads."""
    return loss_mask.tolist()


def test_a_mask_function_may_return_one_mask_per_row():
    from hypothesis import given, settings

    from m2po_oracle import strategies
    from m2po_oracle.adapters import adapt
    from m2po_oracle.judge.battery import run_battery

    port = adapt(_mask_rows_port, "mask_function")

    @settings(max_examples=25, deadline=None)
    @given(batch=strategies.batches())
    def judged(batch):
        outcome = run_battery(port, batch)
        assert not outcome.mismatches, [m.summary for m in outcome.mismatches]

    judged()


def test_a_probe_whose_return_the_adapter_cannot_read_was_accepted_not_rejected():
    """The port returned (it refused nothing); that its adapter could not read the return
    (a TypeError inside the tool) must not count as the port's deliberate refusal. Seen on
    an untuned port (LoongSage's apply_m2po_masking): four probes read "rejected"."""
    from m2po_oracle.adapters import adapt
    from m2po_oracle.judge.validation import run_probe

    result = run_probe(adapt(_mask_port_returning_python_lists, "mask_function"), "nan_logp_on_valid_token")
    assert result.status == "accepted", result
    assert "could not read" in result.message and "expected a tensor, got list" in result.message, result.message


def _mask_port_without_advantages(behavior_logp, proximal_logp, loss_mask, threshold):
    """Takes no advantages (the family's are optional) and refuses nothing."""
    return loss_mask.bool()


def test_a_probe_whose_input_cannot_reach_the_port_is_not_run():
    """An advantage probe against a port its adapter hands no advantages is neither a
    refusal nor an acceptance (an untuned port was told it "silently accepted" a NaN
    advantage it was never given): it is reported not run, with why; the probes that do
    reach the port still run, including a budget bound inside a config object."""
    from m2po_oracle.adapters import adapt
    from m2po_oracle.judge.validation import PROBES, run_probe

    port = adapt(_mask_port_without_advantages, "mask_function")
    results = {p.name: run_probe(port, p.name) for p in PROBES}
    for name in ("nan_advantage_on_valid_token", "shape_mismatch"):
        assert results[name].status == "not run" and not results[name].ran, results[name]
        assert "the port takes no advantages" in results[name].message
    assert {name for name, r in results.items() if r.ran} == {p.name for p in PROBES} - {"nan_advantage_on_valid_token", "shape_mismatch"}
    assert results["nan_tau"].status == "accepted" and results["nan_logp_on_valid_token"].status == "accepted"

    def with_config(behavior_logp, proximal_logp, loss_mask, config):
        return loss_mask.bool()

    bound = adapt(with_config, "mask_function", ["budget=config.threshold"])
    assert run_probe(bound, "nan_tau").status == "accepted"  # the budget reaches it inside config
