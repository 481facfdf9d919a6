"""Logged metrics averaged with equal weight per micro-batch (as verl 0.9.1 averages what a policy
loss returns): the pure rule, and a training step that logs so, reported as a finding beside
the weighted value and never named as a selection or mask deviation. No verl needed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from m2po_oracle.compare.search import run_compare
from m2po_oracle.judge.metric_averaging import NAME, unweighted_mean_reproduces, weighted_and_unweighted
from m2po_oracle.trainer.grpo import GRPOTrainer, micro_batch_metrics


def _close(name, actual, expected):
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12)


#: Two micro-batches: 10 valid tokens of which 5 masked, 40 of which 8 masked (20 and 8 in the trust region).
VALUES = [
    {"masked_fraction": 0.5, "trust_region_fraction": 0.4, "m2_before": 0.01, "m2_after": 0.004},
    {"masked_fraction": 0.2, "trust_region_fraction": 0.4, "m2_before": 0.03, "m2_after": 0.002},
]
COUNTS = [
    {"valid_count": 10, "trust_region_count": 4, "kept_trust_region_count": 1},
    {"valid_count": 40, "trust_region_count": 16, "kept_trust_region_count": 12},
]


def test_the_weighted_mean_is_the_batchs_and_the_unweighted_one_gives_each_micro_batch_one_weight():
    assert weighted_and_unweighted([0.5, 0.2], [10, 40]) == (pytest.approx(13 / 50), pytest.approx(0.35))
    assert weighted_and_unweighted([0.0, 0.0], [0, 0]) == (0.0, 0.0)  # an empty mean is 0, as Algorithm 1 writes it
    with pytest.raises(ValueError, match="one of each per micro-batch"):
        weighted_and_unweighted([0.5], [10, 40])


def test_a_logged_unweighted_mean_is_reproduced_with_the_weighted_value_beside_it():
    logged = {"masked_fraction": 0.35, "trust_region_fraction": 0.4, "m2/other": 1.0}
    found = unweighted_mean_reproduces(logged, VALUES, COUNTS, _close)
    assert found is not None and found.micro_batches == 2
    (masked,) = found.differing
    assert (masked.name, masked.logged, masked.unweighted) == ("masked_fraction", 0.35, pytest.approx(0.35))
    assert masked.weighted == pytest.approx(0.26) and masked.counts == (10, 40) and masked.values == (0.5, 0.2)
    # Equal fractions average alike either way: the logged value is the weighted one too.
    assert [m.name for m in found.agreeing] == ["trust_region_fraction"]
    summary = found.summary()
    assert "masked_fraction logged 0.35, token-weighted 0.26" in summary, summary
    assert "0.5 over 10, 0.2 over 40" in summary and "verl 0.9.1 averages" in summary and "The selection is right" in summary


def test_m2_before_is_weighted_by_its_trust_region_tokens():
    # (0.01 * 4 + 0.03 * 16) / 20 = 0.026 weighted; (0.01 + 0.03) / 2 = 0.02 unweighted.
    found = unweighted_mean_reproduces({"m2_before": 0.02}, VALUES, COUNTS, _close)
    assert found is not None and found.differing[0].weighted == pytest.approx(0.026)
    assert unweighted_mean_reproduces({"m2_before": 0.026}, VALUES, COUNTS, _close) is None


@pytest.mark.parametrize(
    "logged",
    [
        {"masked_fraction": 0.3},  # neither mean
        {"masked_fraction": 0.26},  # the weighted value: nothing to explain
        {"masked_fraction": 0.35, "m2_before": 0.05},  # one right, another neither: the log is not explained
        {},
    ],
)
def test_a_logged_value_that_is_not_the_unweighted_mean_gets_no_such_finding(logged):
    assert unweighted_mean_reproduces(logged, VALUES, COUNTS, _close) is None


# --- a whole training step, through compare --impl trainer:MODULE:CLASS ---------------------------


class MicroBatchMetricsTrainer(GRPOTrainer):
    """A stand-in port with the right selection, loss and gradient that logs each micro-batch's own
    metrics and their mean with equal weight per micro-batch (what verl 0.9.1 logs for such a port)."""

    offset = 0.0  # added to the logged masked fraction: a log that matches neither mean

    def step(self, rollout, split=None, **options):
        record = super().step(rollout, split, **options)
        own, start = [], 0
        for rows in record.split:
            r = slice(start, start + rows)
            start += rows
            own.append(micro_batch_metrics(record.logp[r], record.behavior_logp[r], record.advantages[r], record.valid[r], record.keep[r]))
        logged = {name: math.fsum(o[name] for o in own) / len(own) for name in own[0]}
        logged["masked_fraction"] += self.offset
        return replace(record, metrics=logged)


class NeitherMeanTrainer(MicroBatchMetricsTrainer):
    offset = 0.05


def _run(cls, examples, accept=()):
    from m2po_oracle.call.runner import RunOptions
    from m2po_oracle.cli.launch import open_runner
    from m2po_oracle.compare.explore import Exploration
    from m2po_oracle.explain.deviations import Accepted

    spec = f"trainer:property_tests.explain.test_metric_averaging:{cls.__name__}"
    runner = open_runner(spec, RunOptions.from_values({}))
    exploration = Exploration(shrink=False, skip_validation=True, accept=tuple(Accepted(name, "the trainer logs so") for name in accept))
    return run_compare(runner, examples=examples, seed=0, exploration=exploration)


def test_a_step_logging_the_unweighted_micro_batch_mean_is_a_finding_named_for_the_averaging():
    report = run_compare_cached(MicroBatchMetricsTrainer)
    failed = {name for name, t in report.tallies.items() if t.failures}
    assert report.verdict == "divergent" and failed and all(name.startswith("metrics.") for name in failed), failed
    assert "metrics.masked_fraction" in failed, failed
    diagnosis = report.diagnosis
    # The name describes the averaging, for every failing metric check; no selection or mask name.
    assert diagnosis.components == (NAME,), diagnosis.components
    assert all(names == (NAME,) for names in diagnosis.by_check.values()), diagnosis.by_check
    (finding,) = [f for f in diagnosis.findings if f.kind == NAME]
    assert set(finding.checks) == failed, (finding.checks, failed)
    assert "logged" in finding.summary and "token-weighted" in finding.summary and "verl 0.9.1" in finding.summary, finding.summary


def test_a_project_that_logs_so_knowingly_can_accept_the_averaging():
    report = _run(MicroBatchMetricsTrainer, 6, accept=[NAME])
    assert report.tallies["metrics.masked_fraction"].failures, "no step showed the averaging"
    assert report.verdict == "equivalent-with-accepted", (report.verdict, report.diagnosis.by_check)


def test_a_logged_metric_that_matches_neither_mean_is_not_given_the_averaging_name():
    report = run_compare_cached(NeitherMeanTrainer)
    assert report.verdict == "divergent" and report.tallies["metrics.masked_fraction"].failures
    assert NAME not in report.diagnosis.components and not any(f.kind == NAME for f in report.diagnosis.findings), report.diagnosis


_REPORTS: dict[str, object] = {}


def run_compare_cached(cls):
    """One run per trainer (12 steps: a few split into micro-batches of unequal counts)."""
    if cls.__name__ not in _REPORTS:
        _REPORTS[cls.__name__] = _run(cls, 12)
    return _REPORTS[cls.__name__]


def test_the_micro_batch_metrics_are_the_oracles_on_the_micro_batch_alone():
    from m2po_oracle import oracle
    from m2po_oracle.oracle.batch import Batch

    g = torch.Generator().manual_seed(0)
    logp, behaviour = -torch.rand(3, 5, generator=g, dtype=torch.float64), -torch.rand(3, 5, generator=g, dtype=torch.float64)
    advantages = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    keep = mask & (torch.rand(3, 5, generator=g) > 0.3)
    ours = micro_batch_metrics(logp, behaviour, advantages, mask, keep)
    expected = oracle.evaluate_with_mask(Batch(logp.numpy(), behaviour.numpy(), advantages.numpy(), mask.numpy(), 0.04), keep.numpy())
    for name, value in ours.items():
        assert value == pytest.approx(getattr(expected, name), rel=1e-12), name
