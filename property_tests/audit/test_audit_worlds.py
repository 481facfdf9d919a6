"""m2po-oracle audit on DP x CP x TP worlds and on the trainer-level records: CP shards are put
back into sequences in the Megatron layout, TP replicas are checked identical, and every
planted scope, denominator, behaviour, forward and parameter bug is caught by its check and
named by the diagnosis, from the files alone.

The worlds are simulated in one process with the torch core (``select_tokens``,
``loss_from_selection``), independently of the audit's NumPy oracle: each rank records what a
Megatron rank holds (its CP shard of its DP rank's micro-batch rows, its loss share with the
global N, the shard's gradient)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from m2po_oracle.audit import DESCRIPTIONS, audit_capture
from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.core.loss import loss_from_selection, select_tokens
from m2po_oracle.distributed.topology import Topology, cp_token_indices, dp_row_slices
from m2po_oracle.oracle.encoding import to_builtins

TAU = 0.04


@dataclass(frozen=True)
class World:
    topology: str
    micro_batches: int = 1
    rows_per_mb: int = 2
    width: int = 8  # a multiple of 2 * cp
    length: int | None = None  # every row's valid tokens (None: drawn per row), e.g. equal micro-batch counts


def _batch(step: int, rows: int, width: int, length: int | None = None) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7919 * step + 17)
    logp = -torch.rand(rows, width, generator=generator, dtype=torch.float64) - 0.1
    behavior = logp + 0.35 * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    sign = torch.where(torch.rand(rows, 1, generator=generator) < 0.5, -1.0, 1.0).double()
    advantages = sign.expand(rows, width).clone()
    lengths = torch.randint(width // 2, width + 1, (rows, 1), generator=generator)
    if length is not None:
        lengths = torch.full((rows, 1), length)
    mask = torch.arange(width)[None, :] < lengths  # right padding
    return logp, behavior, advantages, mask


def _rows(t: tuple[torch.Tensor, ...], rows: slice | torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x[rows] for x in t)


def simulate(
    directory: Path,
    world: World,
    *,
    bug: str | None = None,
    steps: tuple[int, ...] = (0, 1),
    bug_step: int | None = 1,
    selection_logp: bool = True,
    rollout_logp: bool = True,
    parameters: bool = True,
    grads: bool = True,
) -> None:
    topology = Topology.parse(world.topology)
    recorders = [Recorder(directory, rank=r, world_size=topology.world_size, topology=world.topology) for r in range(topology.world_size)]
    cp, k = topology.cp, world.micro_batches
    for step in steps:
        planted = bug if bug_step is None or step == bug_step else None  # None: every step
        rows = topology.dp * k * world.rows_per_mb
        logp, behavior, advantages, mask = _batch(step, rows, world.width, world.length)
        rollout = behavior.clone()
        if planted == "current_policy_as_behavior":
            behavior = logp.clone()
        whole = select_tokens(logp, behavior, advantages, mask, tau=TAU)
        keep, n = whole.keep.clone(), whole.valid_count
        valid_count = int(n)
        dp_rows = dp_row_slices(rows, topology.dp)
        blocks = {
            (dp, mb): torch.arange(dp_rows[dp].start + mb * world.rows_per_mb, dp_rows[dp].start + (mb + 1) * world.rows_per_mb)
            for dp in range(topology.dp)
            for mb in range(k)
        }
        shard = lambda c: torch.from_numpy(cp_token_indices(world.width, cp, c))  # noqa: E731
        if planted in ("per_micro_batch_mask", "per_micro_batch_core", "per_micro_batch_core_rank_count", "per_micro_batch_own_n"):
            for index in blocks.values():
                keep[index] = select_tokens(*_rows((logp, behavior, advantages, mask), index), tau=TAU).keep
        if planted in ("per_rank_selection_global_n", "per_rank_selection_local_n", "per_rank_selection_kept_count"):
            for s in dp_rows:
                keep[s] = select_tokens(*_rows((logp, behavior, advantages, mask), s), tau=TAU).keep
        if planted in ("local_shard_selection", "per_cp_chunk_selection_global_n", "per_cp_chunk_selection_shard_counts"):
            for index in blocks.values():
                for c in range(cp):
                    cols = shard(c)
                    part = tuple(x[index][:, cols] for x in (logp, behavior, advantages, mask))
                    sub = keep[index]
                    sub[:, cols] = select_tokens(*part, tau=TAU).keep
                    keep[index] = sub
        if planted == "dp_cp_group_double_count":
            doubled = select_tokens(*(torch.cat([x] * cp) for x in (logp, behavior, advantages, mask)), tau=TAU)
            keep = doubled.keep[:rows].clone()
            valid_count = int(doubled.valid_count)
        metrics = {
            "m2_before": float(whole.m2_before),
            "m2_after": float(whole.m2_after),
            "masked_fraction": float(whole.masked_fraction),
            "valid_count": valid_count,
        }
        kept = keep.sum()
        own_metrics = {}
        if planted == "per_micro_batch_metrics":  # the global mask, but each micro-batch logs its own M2
            for key, index in blocks.items():
                alone = select_tokens(*_rows((logp, behavior, advantages, mask), index), tau=TAU)
                own_metrics[key] = {
                    **metrics,
                    "m2_before": float(alone.m2_before),
                    "m2_after": float(alone.m2_after),
                    "masked_fraction": float(alone.masked_fraction),
                }
        if planted == "local_shard_selection":  # as the distributed control: each shard logs its own selection's metrics
            for (dp, mb), index in blocks.items():
                for c in range(cp):
                    alone = select_tokens(*(x[index][:, shard(c)] for x in (logp, behavior, advantages, mask)), tau=TAU)
                    own_metrics[(dp, c, mb)] = {name: float(getattr(alone, name)) for name in ("m2_before", "m2_after", "masked_fraction")}
                    own_metrics[(dp, c, mb)]["valid_count"] = int(alone.valid_count)
        if planted in ("per_micro_batch_core", "per_micro_batch_core_rank_count"):
            # The natural port: the core called per micro-batch, each logging its own metrics
            # (valid_count its own, or its DP rank's window), the window's N in the loss.
            for (dp, mb), index in blocks.items():
                alone = select_tokens(*_rows((logp, behavior, advantages, mask), index), tau=TAU)
                own_metrics[(dp, mb)] = {name: float(getattr(alone, name)) for name in ("m2_before", "m2_after", "masked_fraction")}
                own_metrics[(dp, mb)]["valid_count"] = int(
                    alone.valid_count if planted == "per_micro_batch_core" else mask[dp_rows[dp]].sum()
                )
        for rank in range(topology.world_size):
            coords = topology.coords(rank)
            for mb in range(k):
                index, cols = blocks[(coords.dp, mb)], shard(coords.cp)
                cut = lambda x: x[index][:, cols].clone()  # noqa: E731, B023 - called within this iteration
                sel_logp, beh, adv, msk, kp = cut(logp), cut(behavior), cut(advantages), cut(mask), cut(keep)
                loss_logp = sel_logp.clone()
                if planted == "stochastic_forward":
                    loss_logp = loss_logp + 0.05 * torch.randn(
                        loss_logp.shape, generator=torch.Generator().manual_seed(rank * 10 + mb), dtype=torch.float64
                    )
                if planted == "optimizer_step_per_micro_batch" and mb > 0:
                    loss_logp = loss_logp + 0.03
                denominator = n
                if planted in ("local_shard_selection", "local_denominator"):
                    denominator = msk.sum()
                elif planted == "per_rank_selection_local_n":  # the DP rank's own rows: every micro-batch, every CP shard
                    denominator = mask[dp_rows[coords.dp]].sum()
                elif planted in ("kept_count_denominator", "per_rank_selection_kept_count"):
                    denominator = kept
                elif planted == "per_micro_batch_own_n":  # the core called per micro-batch, its loss as is
                    denominator = mask[index].sum()
                elif planted == "per_micro_batch_denominator":
                    denominator = k * mask[index].sum()
                elif planted in ("cp_shard_counts", "per_cp_chunk_selection_shard_counts"):
                    denominator = mask[:, shard(coords.cp)].sum()
                elif planted == "dp_cp_group_double_count":
                    denominator = cp * n
                if planted == "tp_replica_differs" and coords.tp == 1 and mb == 0:
                    first = torch.nonzero(msk)[0]
                    kp[first[0], first[1]] = ~kp[first[0], first[1]]
                leaf = loss_logp.clone().requires_grad_()
                loss = loss_from_selection(leaf, beh, adv, kp, denominator)
                loss.backward()
                logged = own_metrics.get(
                    (coords.dp, coords.cp, mb), own_metrics.get((coords.dp, mb), metrics)
                )  # a shard's, a micro-batch's
                recorders[rank].record(
                    step=step,
                    micro_batch=mb,
                    logp=loss_logp,
                    behavior_logp=beh,
                    advantages=adv,
                    mask=msk,
                    keep=kp,
                    loss=loss,
                    tau=TAU,
                    metrics=logged,
                    grad=leaf.grad if grads else None,
                    selection_logp=sel_logp if selection_logp else None,
                    rollout_logp=cut(rollout) if rollout_logp else None,
                )
            if parameters:
                # A freeze is permanent: planted at every step. "zero_at_one_step" is legitimate.
                frozen = bug == "parameters_without_gradient" or planted == "zero_at_one_step"
                norm = 0.0 if frozen else 1.5
                weight, embedding = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
                weight.grad, embedding.grad = torch.full((3,), 0.5), torch.full((4,), norm)
                recorders[rank].record_parameter_gradients(
                    step=step, named_parameters={"layer.weight": weight, "embed_tokens.weight": embedding}
                )


def _statuses(step) -> dict[str, str]:
    return {c.name: c.status for c in step.checks}


WORLDS = {
    "dp=2,cp=2,tp=1": World("dp=2,cp=2,tp=1"),
    "dp=1,cp=2,tp=2": World("dp=1,cp=2,tp=2"),
    "dp=2,cp=1,tp=2,k=2": World("dp=2,cp=1,tp=2", micro_batches=2),
    "dp=1,cp=4,tp=1": World("dp=1,cp=4,tp=1", width=16),
}


@pytest.mark.parametrize("name", WORLDS)
def test_a_correct_world_is_equivalent_with_every_check_run(tmp_path: Path, name: str) -> None:
    world = WORLDS[name]
    simulate(tmp_path, world)
    report = audit_capture(tmp_path)
    assert report.verdict == "equivalent", json.dumps(report.to_json(), indent=1)[:3000]
    for step in report.steps:
        statuses = _statuses(step)
        tp = Topology.parse(world.topology).tp
        assert statuses.pop("audit.replicas_identical") == ("pass" if tp > 1 else "not run")
        assert set(statuses.values()) == {"pass"}, statuses
        assert step.metrics is not None and step.metrics.masked_fraction > 0, "the cut is exercised"


#: (planted bug, world, the check that must fail, the diagnosis that must be named)
PLANTED = [
    ("per_micro_batch_mask", World("dp=1,cp=2,tp=1", micro_batches=3), "audit.selection", ["per_micro_batch_mask"]),
    ("per_rank_selection_global_n", World("dp=2,cp=1,tp=2"), "audit.selection", ["per_rank_selection_global_n"]),
    ("local_shard_selection", World("dp=2,cp=2,tp=1"), "audit.selection", ["local_shard_selection"]),
    ("per_cp_chunk_selection_global_n", World("dp=1,cp=2,tp=1", rows_per_mb=6), "audit.selection", ["per_cp_chunk_selection_global_n"]),
    ("local_denominator", World("dp=1,cp=2,tp=2"), "audit.gradient", ["local_denominator"]),
    ("per_micro_batch_denominator", World("dp=2,cp=1,tp=1", micro_batches=2), "audit.loss_sum", ["per_micro_batch_denominator"]),
    ("kept_count_denominator", World("dp=2,cp=1,tp=1"), "audit.gradient", ["kept_count_denominator"]),
    ("cp_shard_counts", World("dp=2,cp=2,tp=1"), "audit.gradient", ["cp_shard_counts"]),
    ("dp_cp_group_double_count", World("dp=2,cp=2,tp=1"), "audit.metrics", ["dp_cp_group_double_count"]),
    ("tp_replica_differs", World("dp=1,cp=2,tp=2"), "audit.replicas_identical", []),
    ("current_policy_as_behavior", World("dp=2,cp=1,tp=1"), "audit.behavior_logp", ["current_policy_as_behavior"]),
    ("stochastic_forward", World("dp=1,cp=1,tp=1", micro_batches=2), "audit.policy_logp", ["stochastic_forward"]),
    ("optimizer_step_per_micro_batch", World("dp=1,cp=1,tp=1", micro_batches=3), "audit.policy_logp", ["optimizer_step_per_micro_batch"]),
]


@pytest.mark.parametrize("bug, world, check, diagnosis", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_bug_is_caught_by_its_check_and_named(tmp_path: Path, bug: str, world: World, check: str, diagnosis: list[str]) -> None:
    simulate(tmp_path, world, bug=bug)
    report = audit_capture(tmp_path)
    good, bad = report.steps
    assert good.verdict == "equivalent", [to_builtins(c) for c in good.checks if c.status == "fail"]
    assert bad.verdict == "divergent" and check in bad.failing, [to_builtins(c) for c in bad.checks]
    assert bad.diagnosis == diagnosis, (bad.diagnosis, [to_builtins(c) for c in bad.checks if c.status == "fail"])
    table = report.to_json()["steps"][1]["counterexample"]
    from m2po_oracle.audit import TABLE_ORDER

    assert table["check"] == next(c for c in TABLE_ORDER if c in bad.failing) and table["replay"].endswith("--step 1")
    assert 0 < table["shown"] <= table["of"] or table["check"] == "audit.replicas_identical", table
    if table["check"] in ("audit.metrics", "audit.parameter_gradient"):
        assert table["values"] and not table["tokens"]
    elif table["check"] != "audit.replicas_identical":
        assert table["tokens"] and not table["values"]
    if table["check"] in ("audit.behavior_logp", "audit.policy_logp"):
        first = table["tokens"][0]["compared"]
        assert first["captured"] != first["expected"], first


def test_a_parameter_silent_at_every_step_is_caught_one_silent_at_one_step_is_not(tmp_path: Path) -> None:
    simulate(tmp_path / "frozen", World("dp=2,cp=1,tp=1"), bug="parameters_without_gradient", steps=(0, 1, 2))
    report = audit_capture(tmp_path / "frozen")
    for step in report.steps:
        assert step.failing == ["audit.parameter_gradient"] and step.diagnosis == ["parameters_without_gradient"]
        summary = next(c.summary for c in step.checks if c.name == "audit.parameter_gradient")
        assert "embed_tokens.weight (all zero)" in summary and "every one of the 3 recorded step(s)" in summary
    simulate(tmp_path / "once", World("dp=2,cp=1,tp=1"), bug="zero_at_one_step", steps=(0, 1, 2))
    report = audit_capture(tmp_path / "once")
    assert report.verdict == "equivalent"
    summary = next(c.summary for c in report.steps[1].checks if c.name == "audit.parameter_gradient")
    assert "embed_tokens.weight are all zero at this step but not at every step" in summary


def test_the_selection_counterexample_lists_the_tokens_that_differ_with_their_rank(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=2,cp=2,tp=1"), bug="local_shard_selection")
    table = audit_capture(tmp_path).to_json()["steps"][1]["counterexample"]
    assert table["check"] == "audit.selection" and table["tokens"]
    for token in table["tokens"]:
        assert token["keep"] != token["algorithm_1_keeps"] and token["rank"] in range(4) and token["micro_batch"] == 0
        assert token["m2"] == pytest.approx(token["d"] ** 2)


def test_without_the_optional_records_their_checks_are_not_run_never_pass(tmp_path: Path) -> None:
    simulate(
        tmp_path, World("dp=2,cp=1,tp=1"), bug="current_policy_as_behavior", selection_logp=False, rollout_logp=False, parameters=False
    )
    bad = audit_capture(tmp_path).steps[1]
    statuses = _statuses(bad)
    assert statuses["audit.behavior_logp"] == statuses["audit.policy_logp"] == statuses["audit.parameter_gradient"] == "not run"
    # d = 0 everywhere: the selection keeps everything, which Algorithm 1 does too. Without the
    # sampler's log-probs this bug is invisible, and the audit must not pretend otherwise.
    assert bad.verdict == "equivalent"


# ---------------------------------------------------------------------------------------------
# Bad captures: a named reason, the other steps still audited.


def _edit_record(directory: Path, step: int, rank: int, mb: int, change) -> None:
    """Rewrite one record through a fresh Recorder state: the manifest stays consistent (size, CRC)."""
    from safetensors.torch import load_file

    from m2po_oracle.capture import recorder

    manifest_path = directory / f"manifest.rank-{rank:03d}.json"
    manifest = json.loads(manifest_path.read_text())
    entry = next(e for e in manifest["records"] if e["step"] == step and e["micro_batch"] == mb)
    path = directory / entry["file"]
    tensors = change(load_file(path))
    metadata = {"schema": recorder.SCHEMA, "rank": str(rank), "step": str(step), "micro_batch": str(mb)}
    entry["crc32"] = recorder.write_tensors(path, tensors, metadata)
    entry["tensors"] = {name: recorder.describe_tensor(t) for name, t in tensors.items()}
    manifest_path.write_text(json.dumps(manifest))


def test_cp_shards_that_disagree_in_shape_make_that_step_unusable(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=1,cp=2,tp=1"), grads=False)
    _edit_record(tmp_path, 1, 1, 0, lambda t: {name: x[:, :-2].contiguous() for name, x in t.items()})
    report = audit_capture(tmp_path)
    assert [s.verdict for s in report.steps] == ["equivalent", "unusable"]
    assert (
        "the CP shards of DP rank 0 micro-batch 0 disagree in shape (rank 0: [2, 4], rank 1: [2, 2])" in report.steps[1].checks[0].summary
    )


def test_nan_on_a_valid_token_makes_that_step_unusable_and_names_the_token(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=2,cp=1,tp=1"))

    def poison(t):
        t["logp"][1, 0] = float("nan")
        t["mask"][1, 0] = True
        return t

    _edit_record(tmp_path, 1, 1, 0, poison)
    report = audit_capture(tmp_path)
    assert [s.verdict for s in report.steps] == ["equivalent", "unusable"]
    assert (
        "non-finite input: rank 1 (dp=1, cp=0, tp=0) micro-batch 0: logp is nan on a valid token at [1, 0]"
        in report.steps[1].checks[0].summary
    )


def test_a_tp_rank_missing_a_micro_batch_makes_that_step_unusable(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=1,cp=1,tp=2", micro_batches=2))
    manifest_path = tmp_path / "manifest.rank-001.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["records"] = [e for e in manifest["records"] if not (e["step"] == 1 and e["micro_batch"] == 1)]
    manifest_path.write_text(json.dumps(manifest))
    report = audit_capture(tmp_path)
    assert [s.verdict for s in report.steps] == ["equivalent", "unusable"]
    assert "recorded different numbers of micro-batches (rank 0: 2, rank 1: 1)" in report.steps[1].checks[0].summary


def test_a_topology_that_does_not_fit_the_world_is_refused(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=2,cp=1,tp=1"), steps=(0,))
    for rank in range(2):
        path = tmp_path / f"manifest.rank-{rank:03d}.json"
        path.write_text(path.read_text().replace('"dp=2,cp=1,tp=1"', '"dp=2,cp=2,tp=1"'))
    report = audit_capture(tmp_path)
    assert report.verdict == "unusable" and "it has 4 ranks, the manifests say world_size = 2" in report.refused


def test_reassembly_puts_every_cp_shard_back_where_megatron_took_it() -> None:
    # The layout itself, independently of any capture: chunks i and 2cp-1-i.
    width, cp = 16, 4
    full = np.arange(width)
    back = np.empty(width, dtype=int)
    for c in range(cp):
        back[cp_token_indices(width, cp, c)] = full[cp_token_indices(width, cp, c)]
    assert np.array_equal(back, full)
    assert list(cp_token_indices(width, cp, 1)) == [2, 3, 12, 13]


def test_the_html_shows_the_worst_step_as_a_token_table_with_its_explanation(tmp_path: Path) -> None:
    import re

    from m2po_oracle.report.audit_html import render_audit_html

    simulate(tmp_path / "cap", World("dp=2,cp=2,tp=1"), bug="local_shard_selection")
    report = audit_capture(tmp_path / "cap").to_json()
    html = render_audit_html(report)
    table = report["steps"][1]["counterexample"]
    assert html.index('id="worst"') < html.index('id="counterexample"') < html.index('id="timeline"')
    body = html[html.index('<table class="tokens">') :]
    body = body[: body.index("</table>")]
    assert len(re.findall(r"<tr class=\"divergent\">", body)) == table["shown"] > 0
    assert "each rank selects over its own CP shard without communication" in html
    assert "-0.0" not in html


def test_tp_replicas_of_another_shape_fail_the_replica_check_naming_both_shapes(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=1,cp=1,tp=2"), grads=False)
    _edit_record(tmp_path, 1, 1, 0, lambda t: {name: x[:, :-1].contiguous() for name, x in t.items()})
    bad = audit_capture(tmp_path).steps[1]
    assert bad.verdict == "divergent" and bad.failing[0] == "audit.replicas_identical"
    summary = next(c.summary for c in bad.checks if c.name == "audit.replicas_identical")
    assert "rank 1 (dp=0, cp=0, tp=1) micro-batch 0: logp has shape [2, 7], its TP rank 0 (rank 0) [2, 8]" in summary


def test_denominators_the_files_cannot_tell_apart_are_named_as_alternatives(tmp_path: Path) -> None:
    # dp = 1: N counted on the CP shard and summed over DP is the shard's own count. On this
    # step each shard's own selection is also the global one, so a shard selecting alone with
    # its own count reproduces the mask, the loss and the gradient too; the logged M2 are the
    # optimizer batch's, which names the global selection.
    simulate(tmp_path / "dp1", World("dp=1,cp=2,tp=1"), bug="local_denominator")
    bad = audit_capture(tmp_path / "dp1").steps[1]
    assert bad.diagnosis == ["local_denominator"] and bad.alternatives == {
        "local_denominator": ["cp_shard_counts", "local_shard_selection"]
    }
    # dp = 2: they differ, and only the planted one is named.
    simulate(tmp_path / "dp2", World("dp=2,cp=2,tp=1"), bug="local_denominator")
    bad = audit_capture(tmp_path / "dp2").steps[1]
    assert bad.diagnosis == ["local_denominator"] and bad.alternatives == {}


def test_per_micro_batch_metrics_over_a_global_mask_are_not_called_a_per_micro_batch_mask(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=1,cp=1,tp=1", micro_batches=3), bug="per_micro_batch_metrics")
    bad = audit_capture(tmp_path).steps[1]
    assert bad.failing == ["audit.metrics"] and bad.diagnosis == [], (bad.diagnosis, bad.failing)
    # The same metrics over masks each micro-batch selected alone: that is the scope deviation.
    simulate(tmp_path / "scoped", World("dp=1,cp=1,tp=1", micro_batches=3), bug="per_micro_batch_mask")
    assert audit_capture(tmp_path / "scoped").steps[1].diagnosis == ["per_micro_batch_mask"]


#: A port that calls the core per micro-batch (selection and metrics per micro-batch) and
#: divides by the window's N: each micro-batch logs its own valid_count (or its DP rank's).
NATURAL_PORTS = {
    "own count, GA=2": ("per_micro_batch_core", World("dp=1,cp=1,tp=1", micro_batches=2, rows_per_mb=2), "its record's own valid count"),
    "own count, dp=2 x GA=2": ("per_micro_batch_core", World("dp=2,cp=1,tp=1", micro_batches=2), "its record's own valid count"),
    "own count, equal micro-batch counts": (
        "per_micro_batch_core",
        World("dp=1,cp=1,tp=1", micro_batches=2, length=6),
        "its record's own valid count",
    ),
    "rank's count, equal micro-batch counts": (
        "per_micro_batch_core_rank_count",
        World("dp=2,cp=1,tp=1", micro_batches=2, length=6),
        "its DP rank's valid count",
    ),
}
DENOMINATORS = {
    "per_micro_batch_denominator",
    "local_denominator",
    "kept_count_denominator",
    "cp_shard_counts",
    "dp_cp_group_double_count",
    "local_shard_selection",
}


@pytest.mark.parametrize("port", NATURAL_PORTS)
def test_a_logged_count_never_names_a_denominator_the_loss_and_gradient_contradict(tmp_path: Path, port: str) -> None:
    bug, world, logged_as = NATURAL_PORTS[port]
    simulate(tmp_path, world, bug=bug, steps=tuple(range(8)), bug_step=None)
    report = audit_capture(tmp_path)
    scoped = 0
    for step in report.steps:
        statuses = _statuses(step)
        assert statuses["audit.loss_sum"] == statuses["audit.gradient"] == "pass", statuses  # the window's N: the loss is right
        assert not DENOMINATORS & set(step.diagnosis), (step.step, step.diagnosis, "named from a logged count alone")
        # The scope is named where the mask shows it, and only there; where the per-micro-batch
        # masks are the global one, what is left is that each record logs its own micro-batch's
        # metrics on that mask: named as the logs' averaging, never as a mask or a denominator.
        expected = ["per_micro_batch_mask"] if statuses["audit.selection"] == "fail" else ["unweighted_micro_batch_metric_mean"]
        assert step.diagnosis == expected, (
            step.step,
            step.diagnosis,
            statuses,
        )
        scoped += statuses["audit.selection"] == "fail"
        # What was logged is said as what it is, under audit.metrics.
        metrics = next(c for c in step.checks if c.name == "audit.metrics")
        assert metrics.status == "fail" and f"every logged valid_count is {logged_as}" in metrics.summary, metrics.summary
    assert scoped, "no step where the scope shows in the mask"
    if Topology.parse(world.topology).dp == 1:  # two micro-batches of two rows: some steps' masks agree with the global one
        assert scoped < len(report.steps), "no step where the per-micro-batch masks are a global outcome"


def test_rollout_atol_lets_a_recomputation_differ_by_what_the_user_states(tmp_path: Path) -> None:
    from m2po_oracle.cli.main import main

    simulate(tmp_path, World("dp=2,cp=1,tp=1"), steps=(0,))
    # An inference engine's numbers: the sampler's log-probs off by up to 2e-3 from the trainer's.
    for rank in range(2):

        def jitter(t):
            t["rollout_logp"] = (
                t["rollout_logp"]
                + 2e-3 * torch.sin(torch.arange(t["rollout_logp"].numel(), dtype=torch.float64)).reshape(t["rollout_logp"].shape)
            ).contiguous()
            return t

        _edit_record(tmp_path, 0, rank, 0, jitter)
    strict = audit_capture(tmp_path).steps[0]
    assert strict.failing == ["audit.behavior_logp"], strict.failing
    assert "float32 precision; largest |difference| 0.00199" in next(c.summary for c in strict.checks if c.name == "audit.behavior_logp")
    loose = audit_capture(tmp_path, rollout_atol=5e-3).steps[0]
    assert loose.verdict == "equivalent"
    assert "|difference| <= --rollout-atol 0.005" in next(c.summary for c in loose.checks if c.name == "audit.behavior_logp")
    assert audit_capture(tmp_path, rollout_atol=1e-3).steps[0].failing == ["audit.behavior_logp"]
    assert main(["audit", str(tmp_path), "--rollout-atol", "5e-3"]) == 0
    with pytest.raises(SystemExit):
        main(["audit", str(tmp_path), "--rollout-atol", "-1"])
    with pytest.raises(ValueError, match="rollout_atol must be None or a finite number >= 0, got nan"):
        audit_capture(tmp_path, rollout_atol=float("nan"))


def test_policy_atol_lets_a_nondeterministic_loss_pass_differ_by_what_the_user_states(tmp_path: Path) -> None:
    simulate(tmp_path, World("dp=1,cp=1,tp=1", micro_batches=2), bug="stochastic_forward", steps=(0, 1))
    strict = audit_capture(tmp_path).steps[1]
    assert strict.failing == ["audit.policy_logp"] and strict.diagnosis == ["stochastic_forward"]
    summary = next(c.summary for c in strict.checks if c.name == "audit.policy_logp")
    largest = float(summary.split("largest |difference| ")[1].split(")")[0])
    assert 0.05 < largest < 0.5, summary  # the planted noise is 0.05 * N(0, 1)
    assert audit_capture(tmp_path, policy_atol=largest).steps[1].verdict == "equivalent"
    tight = audit_capture(tmp_path, policy_atol=largest / 2).steps[1]
    assert tight.failing == ["audit.policy_logp"] and "differs by up to" in next(
        c.summary for c in tight.checks if c.name == "audit.policy_logp"
    )
    with pytest.raises(ValueError, match="policy_atol must be None or a finite number >= 0, got -1"):
        audit_capture(tmp_path, policy_atol=-1)


#: A scope's name says what the loss divides by: ``*_global_n`` the global N, its ``_local_n``
#: (or ``local_shard_selection``) the region's own count; a bare scope name says nothing of N
#: and stands beside the denominator the loss reproduces. planted -> world, the names where the
#: mask shows the scope.
SCOPE_WITH_DENOMINATOR = {
    "rank's own N": ("per_rank_selection_local_n", World("dp=2,cp=1,tp=1"), ["per_rank_selection_local_n"]),
    "rank's own N, GA=2": ("per_rank_selection_local_n", World("dp=2,cp=1,tp=1", micro_batches=2), ["per_rank_selection_local_n"]),
    "rank's own N, cp=2": ("per_rank_selection_local_n", World("dp=2,cp=2,tp=1"), ["per_rank_selection_local_n"]),
    "micro-batch's own N": (
        "per_micro_batch_own_n",
        World("dp=1,cp=1,tp=1", micro_batches=2),
        ["per_micro_batch_mask", "local_denominator"],
    ),
    "rank's selection, kept count": (
        "per_rank_selection_kept_count",
        World("dp=2,cp=1,tp=1"),
        ["per_rank_selection", "kept_count_denominator"],
    ),
    "shard's selection, N per CP shard": (
        "per_cp_chunk_selection_shard_counts",
        World("dp=2,cp=2,tp=1"),
        ["per_cp_chunk_selection", "cp_shard_counts"],
    ),
}
GLOBAL_N_SCOPES = {"per_rank_selection_global_n", "per_cp_chunk_selection_global_n"}
LOSS_DENOMINATORS = {
    "per_micro_batch_denominator",
    "local_denominator",
    "kept_count_denominator",
    "cp_shard_counts",
    "dp_cp_group_double_count",
}


def _consistent(step) -> None:
    """No name the loss contradicts: a ``*_global_n`` scope only where the loss and the gradient
    are the global N's, never beside a denominator."""
    statuses = _statuses(step)
    if set(step.diagnosis) - LOSS_DENOMINATORS:  # a scope (or another deviation) beside: no denominator's words claim the mask
        for name in LOSS_DENOMINATORS & set(step.diagnosis):
            assert "mask" not in DESCRIPTIONS[name], (step.step, step.diagnosis, name, DESCRIPTIONS[name])
    if GLOBAL_N_SCOPES & set(step.diagnosis):
        assert not LOSS_DENOMINATORS & set(step.diagnosis), (step.step, step.diagnosis, "a global N beside another denominator")
        assert statuses["audit.loss_sum"] == statuses["audit.gradient"] == "pass", (step.step, step.diagnosis, statuses)


@pytest.mark.parametrize("case", SCOPE_WITH_DENOMINATOR)
def test_a_scope_is_named_with_the_denominator_the_loss_reproduces_never_a_contradicting_global_n(tmp_path: Path, case: str) -> None:
    bug, world, names = SCOPE_WITH_DENOMINATOR[case]
    simulate(tmp_path, world, bug=bug, steps=tuple(range(8)), bug_step=None)
    report = audit_capture(tmp_path)
    shown = 0
    for step in report.steps:
        _consistent(step)
        statuses = _statuses(step)
        assert statuses["audit.loss_sum"] == "fail" or statuses["audit.gradient"] == "fail", (step.step, statuses)
        if statuses["audit.selection"] == "fail":
            # Several scopes can reproduce one small step's mask: the planted one is named or listed as identical.
            same = {name for names_ in step.alternatives.values() for name in names_}
            assert step.diagnosis == names or (len(step.diagnosis) == len(names) and names[0] in same), (
                step.step,
                step.diagnosis,
                step.alternatives,
            )
            shown += step.diagnosis == names
    assert shown, [(s.step, s.diagnosis) for s in report.steps]


@pytest.mark.parametrize("topology", ["dp=2,cp=2,tp=1", "dp=1,cp=2,tp=1"])
def test_shards_selecting_alone_are_named_so_where_their_masks_happen_to_be_global(tmp_path: Path, topology: str) -> None:
    # Each CP shard selects alone and divides by its own count, logging its own M2 (as the
    # distributed control does). Where every shard's own selection is also an outcome of the
    # global one, the mask cannot tell the two apart and the loss is the shard count's either
    # way; the logged M2, each shard's own, choose: never local_denominator beside them.
    simulate(tmp_path, World(topology), bug="local_shard_selection", steps=tuple(range(12)), bug_step=None)
    report = audit_capture(tmp_path)
    tied = 0
    for step in report.steps:
        statuses = _statuses(step)
        _consistent(step)
        metrics = next(c.summary for c in step.checks if c.name == "audit.metrics")
        if statuses["audit.selection"] == "fail" or "each CP shard's own" in metrics:
            assert step.diagnosis == ["local_shard_selection"], (step.step, step.diagnosis, statuses, metrics)
        if statuses["audit.selection"] == "pass" and statuses["audit.loss_sum"] == "fail":
            # Both reproduce this step: the other is listed as identical on it.
            other = {"local_shard_selection": "local_denominator", "local_denominator": "local_shard_selection"}[step.diagnosis[0]]
            assert other in step.alternatives[step.diagnosis[0]], (step.step, step.diagnosis, step.alternatives)
            tied += step.diagnosis == ["local_shard_selection"]
    assert tied, "no step where every shard's own selection is a global outcome"
