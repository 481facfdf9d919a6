"""m2po-oracle audit: a correct pure-DP capture is equivalent, planted bugs are caught by their
named check and diagnosed, a damaged file is listed while the other steps are still audited.
CP/TP worlds and the trainer-level checks are in test_audit_worlds.py."""

from __future__ import annotations

from pathlib import Path

import torch
from audit_run import check_statuses, run_audit

from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.cli.main import main
from m2po_oracle.core.loss import loss_from_selection, select_tokens

WORLD, MICRO_BATCHES, TAU = 2, 2, 0.04
#: What a pure-DP capture without the optional tensors and parameter norms cannot judge.
NOT_RECORDED = {
    "audit.replicas_identical": "not run",
    "audit.policy_logp": "not run",
    "audit.behavior_logp": "not run",
    "audit.parameter_gradient": "not run",
}


def _tensors(step: int, rank: int, mb: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + mb)
    rows, width = 2, 5 + rank + 2 * mb  # different T per micro-batch: the audit pads
    logp = -torch.rand(rows, width, generator=generator, dtype=torch.float64)
    behavior = logp + 0.3 * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    sign = torch.where(torch.rand(rows, 1, generator=generator) < 0.5, -1.0, 1.0).double()
    advantages = sign.expand(rows, width).clone()
    mask = torch.rand(rows, width, generator=generator) < 0.85
    return logp.float(), behavior.float(), advantages.float(), mask


def _pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    out = torch.full((tensor.shape[0], width), value, dtype=tensor.dtype)
    out[:, : tensor.shape[1]] = tensor
    return out


def _simulate(
    directory: Path,
    *,
    steps=(0, 1, 2),
    bug: str | None = None,
    bug_step: int = 1,
    topology: str = "dp=2,cp=1,tp=1",
    watch: bool = True,
    metrics: bool = True,
    logged_as: dict[str, str] | None = None,
    logged_wrong: str | None = None,
) -> None:
    """A pure-DP optimizer step per ``steps`` in one process: the global selection over the
    assembled batch, each micro-batch's loss with the global N, its gradient watched."""
    recorders = [Recorder(directory, rank=r, world_size=WORLD, topology=topology) for r in range(WORLD)]
    for step in steps:
        parts = {(r, mb): _tensors(step, r, mb) for r in range(WORLD) for mb in range(MICRO_BATCHES)}
        width = max(p[0].shape[1] for p in parts.values())
        order = sorted(parts)
        cat = [torch.cat([_pad(parts[k][i], width, value) for k in order]) for i, value in enumerate((0.0, 0.0, 0.0, False))]
        whole = select_tokens(*cat, tau=TAU)
        start = 0
        for key in order:
            rank, mb = key
            logp0, behavior, advantages, mask = parts[key]
            rows, t = mask.shape
            keep, n = whole.keep[start : start + rows, :t], whole.valid_count
            start += rows
            logged = (
                {name: getattr(whole, name) for name in ("m2_before", "m2_after", "masked_fraction", "valid_count")}
                if metrics
                else {"lr": 1e-6}
            )
            if logged_wrong is not None and step == bug_step:
                logged[logged_wrong] = logged[logged_wrong] * 0.5 + 0.01
            logged = {(logged_as or {}).get(k, k): v for k, v in logged.items()}
            if step == bug_step and bug == "per_micro_batch_mask":
                own = select_tokens(logp0, behavior, advantages, mask, tau=TAU)
                keep = own.keep
            if step == bug_step and bug == "per_micro_batch_denominator":  # own N, then by k (gradient accumulation)
                n = mask.sum() * MICRO_BATCHES
            if step == bug_step and bug == "local_denominator":  # own N, no factor
                n = mask.sum()
            logp = logp0.clone().requires_grad_()
            loss = loss_from_selection(logp, behavior, advantages, keep, n)
            recorders[rank].record(
                step=step,
                micro_batch=mb,
                logp=logp,
                behavior_logp=behavior,
                advantages=advantages,
                mask=mask,
                keep=keep,
                loss=loss,
                tau=TAU,
                metrics=logged,
            )
            if watch:
                recorders[rank].watch_gradient(logp)
            loss.backward()


def test_a_correct_pure_dp_capture_is_equivalent(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap")
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 0 and report["schema"] == "m2po-oracle/audit/1"
    assert report["verdict"] == "equivalent" and report["worst_step"] is None
    assert report["capture"]["world_size"] == WORLD and report["capture"]["steps"] == [0, 1, 2]
    assert report["capture"]["problems"] == []
    for step in report["steps"]:
        assert step["verdict"] == "equivalent" and step["diagnosis"] == []
        assert check_statuses(step) == {
            "audit.selection": "pass",
            "audit.loss_sum": "pass",
            "audit.gradient": "pass",
            "audit.metrics": "pass",
            **NOT_RECORDED,
        }
        assert step["metrics"]["tau"] == TAU and step["metrics"]["masked_fraction"] > 0  # the cut is exercised


def test_selection_per_micro_batch_is_caught_and_diagnosed(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", bug="per_micro_batch_mask")
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 1 and report["verdict"] == "divergent" and report["worst_step"] == 1
    bad = report["steps"][1]
    assert bad["verdict"] == "divergent" and check_statuses(bad)["audit.selection"] == "fail"
    assert "per_micro_batch_mask" in bad["diagnosis"] and "per_micro_batch_denominator" not in bad["diagnosis"]
    assert check_statuses(bad)["audit.loss_sum"] == "pass"  # judged on the run's own mask
    assert [s["verdict"] for s in report["steps"]] == ["equivalent", "divergent", "equivalent"]


def test_per_micro_batch_denominator_is_caught_and_diagnosed(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", bug="per_micro_batch_denominator")
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 1 and report["verdict"] == "divergent"
    bad = report["steps"][1]
    checks = check_statuses(bad)
    assert checks["audit.loss_sum"] == "fail" and checks["audit.gradient"] == "fail" and checks["audit.selection"] == "pass"
    assert bad["diagnosis"] == ["per_micro_batch_denominator"]


def test_a_corrupted_file_is_listed_and_the_other_steps_are_audited(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap")
    damaged = tmp_path / "cap" / "step-000001" / "rank-001.mb-000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:40])
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert any("rank-001.mb-000.safetensors" in p for p in report["capture"]["problems"])
    verdicts = [s["verdict"] for s in report["steps"]]
    assert verdicts == ["equivalent", "unusable", "equivalent"]
    assert set(check_statuses(report["steps"][1]).values()) == {"not run"}
    assert status == 0 and report["verdict"] == "equivalent"


def test_nothing_auditable_is_unusable(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", steps=(0,))
    damaged = tmp_path / "cap" / "step-000000" / "rank-000.mb-001.safetensors"
    damaged.write_bytes(b"garbage")
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 2 and report["verdict"] == "unusable" and report["capture"]["problems"]
    status, report = run_audit(tmp_path / "missing", tmp_path)
    assert status == 2 and report["verdict"] == "unusable" and report["capture"]["problems"]


def test_own_valid_count_without_the_factor_k_is_the_local_denominator(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", steps=(0, 1), bug="local_denominator")
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 1 and report["steps"][1]["diagnosis"] == ["local_denominator"]
    assert report["descriptions"]["local_denominator"].startswith("each record's loss divided by its own valid count")


def test_uncaptured_gradient_and_metrics_are_not_run_never_pass(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", steps=(0,), watch=False, metrics=False)
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 0 and report["verdict"] == "equivalent"
    checks = check_statuses(report["steps"][0])
    assert checks == {
        "audit.selection": "pass",
        "audit.loss_sum": "pass",
        "audit.gradient": "not run",
        "audit.metrics": "not run",
        **NOT_RECORDED,
    }


def test_the_denominator_bug_is_caught_by_the_loss_alone_without_gradients(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", steps=(0, 1), bug="per_micro_batch_denominator", watch=False)
    status, report = run_audit(tmp_path / "cap", tmp_path)
    bad = report["steps"][1]
    assert status == 1 and check_statuses(bad)["audit.loss_sum"] == "fail" and check_statuses(bad)["audit.gradient"] == "not run"
    assert bad["diagnosis"] == ["per_micro_batch_denominator"]
    assert "expected" in next(c["summary"] for c in bad["checks"] if c["name"] == "audit.loss_sum")


def test_a_divergent_step_prints_the_command_that_replays_it(tmp_path: Path, capsys) -> None:
    capture = tmp_path / "capture"
    _simulate(capture, bug="per_micro_batch_denominator", bug_step=1)
    assert main(["audit", str(capture)]) == 1
    out = capsys.readouterr().out
    replay = f"m2po-oracle audit {capture} --step 1"
    assert f"replay: {replay}" in out, out
    assert main(["audit", str(capture), "--step", "1"]) == 1 and "step 0" not in capsys.readouterr().out
    assert main(["audit", str(capture), "--step", "0"]) == 0
    assert main(["audit", str(capture), "--step", "9"]) == 2 and "no step 9" in capsys.readouterr().err


def test_the_html_report_has_a_timeline_of_every_step_and_the_worst_step_first(tmp_path: Path) -> None:
    import re

    capture = tmp_path / "capture"
    _simulate(capture, bug="per_micro_batch_mask", bug_step=1)
    page = tmp_path / "audit.html"
    assert main(["audit", str(capture), "--html", str(page)]) == 1
    html = page.read_text()
    rows = re.findall(r'<tr class="(equivalent|divergent|unusable)"><td>(\d+)</td>', html[html.index('id="steps"') :])
    assert rows == [("equivalent", "0"), ("divergent", "1"), ("equivalent", "2")], rows
    for series in ("m2_before", "m2_after", "tau", "masked_fraction"):
        points = re.search(rf'<polyline class="{series}" points="([^"]*)"', html).group(1).split()
        assert len(points) == 3, (series, points)
    assert html.index('id="worst"') < html.index('id="timeline"') < html.index('id="steps"')
    assert f"m2po-oracle audit {capture} --step 1" in html and "per_micro_batch_mask" in html and "-0.0" not in html


def test_the_html_report_escapes_what_the_capture_says() -> None:
    from m2po_oracle.report.audit_html import render_audit_html

    hostile = "<script>alert(1)</script>"
    report = {
        "schema": "m2po-oracle/audit/1",
        "verdict": "unusable",
        "worst_step": None,
        "capture": {
            "directory": hostile,
            "world_size": 1,
            "topology": "dp=1,cp=1,tp=1",
            "steps": [0],
            "problems": [hostile],
            "refused": None,
        },
        "steps": [
            {
                "step": 0,
                "verdict": "unusable",
                "checks": [{"name": "audit.selection", "status": "not run", "summary": hostile}],
                "diagnosis": [],
                "metrics": {},
            }
        ],
    }
    html = render_audit_html(report)
    assert "<script>" not in html and "&lt;script&gt;" in html


#: How real ports log our metrics (the key names their trainers use).
PORT_NAMES = {"masked_fraction": "m2po/masked_fraction", "m2_before": "actor/m2po_M2", "m2_after": "m2po/m2_after"}


def test_metrics_logged_under_a_port_s_own_names_are_judged_as_compare_judges_them(tmp_path: Path) -> None:
    _simulate(tmp_path / "cap", logged_as=PORT_NAMES)
    status, report = run_audit(tmp_path / "cap", tmp_path)
    assert status == 0, report
    for step in report["steps"]:
        (metrics,) = [c for c in step["checks"] if c["name"] == "audit.metrics"]
        assert metrics["status"] == "pass", metrics
        assert "read m2_after as m2po/m2_after, m2_before as actor/m2po_M2, masked_fraction as m2po/masked_fraction" in metrics["summary"]
    # A wrong value under a port's name fails, and says which key it was read from.
    _simulate(tmp_path / "bad", logged_as=PORT_NAMES, logged_wrong="masked_fraction")
    status, report = run_audit(tmp_path / "bad", tmp_path / "bad-report")
    (metrics,) = [c for c in report["steps"][1]["checks"] if c["name"] == "audit.metrics"]
    assert metrics["status"] == "fail" and "masked_fraction (logged as m2po/masked_fraction) of rank" in metrics["summary"], metrics
