"""A misbehaving implementation is a finding, never a crash; loading errors are clear."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from m2po_oracle.call.resolve import load_implementation
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.errors import LoadError
from m2po_oracle.judge.battery import run_battery
from m2po_oracle.judge.contract import measure, parse_impl
from m2po_oracle.oracle.batch import Batch

BATCH = Batch(
    np.array([[0.1, 0.3, np.nan], [0.2, 0.4, 0.0]]),
    np.zeros((2, 3)),
    np.ones((2, 3)),
    np.array([[True, True, False], [True, True, True]]),
    0.04,
)


def _core_then(change):
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        return change(m2po_loss(logp, behavior_logp, advantages, mask, tau=tau), logp)

    return implementation


def _raises(*args, **kwargs):
    raise RuntimeError("CUDA out of memory <script>alert(1)</script>")


MISBEHAVIOURS = {
    "raises": (_raises, "call", "raised"),
    "calls sys.exit": (lambda *a, **k: sys.exit(3), "call", "SystemExit"),
    "returns None": (_core_then(lambda r, x: None), "call", "expected a mapping or object with 'loss' and 'keep'"),
    "returns a tuple": (_core_then(lambda r, x: (r.loss, r.keep)), "call", "expected a mapping or object"),
    "keep as float": (_core_then(lambda r, x: {"loss": r.loss, "keep": r.keep.float()}), "call", "keep: expected dtype torch.bool"),
    "keep wrong shape": (_core_then(lambda r, x: {"loss": r.loss, "keep": r.keep[:, :2]}), "call", "keep: expected shape (2, 3)"),
    "loss not 0-d": (_core_then(lambda r, x: {"loss": r.loss.expand(3), "keep": r.keep}), "call", "loss: expected a 0-d torch.Tensor"),
    "loss a float": (_core_then(lambda r, x: {"loss": r.loss.item(), "keep": r.keep}), "call", "loss: expected a 0-d torch.Tensor"),
    "metric a string": (
        _core_then(lambda r, x: {"loss": r.loss, "keep": r.keep, "m2_after": "0.1"}),
        "call",
        "m2_after: expected a number",
    ),
    "count not an integer": (
        _core_then(lambda r, x: {"loss": r.loss, "keep": r.keep, "valid_count": 4.5}),
        "call",
        "valid_count: expected an integer",
    ),
    "loss NaN": (_core_then(lambda r, x: {"loss": r.loss * float("nan"), "keep": r.keep}), "loss", "loss is not close"),
    "loss detached": (_core_then(lambda r, x: {"loss": r.loss.detach(), "keep": r.keep}), "gradient", "grad is not close"),
    "backward raises": (_core_then(lambda r, x: {"loss": _BreakBackward.apply(r.loss), "keep": r.keep}), "call", "raised_in_backward"),
    "mutates logp": (_core_then(lambda r, x: (x.data.mul_(2), {"loss": r.loss, "keep": r.keep})[1]), "inputs_not_mutated", "logp"),
}


class _BreakBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward exploded")


@pytest.mark.parametrize("case", MISBEHAVIOURS)
def test_misbehaviour_is_a_finding_not_a_crash(case):
    fn, check, text = MISBEHAVIOURS[case]
    outcome = run_battery(fn, BATCH)
    matching = [m for m in outcome.mismatches if m.check == check]
    assert matching, f"{case}: expected a {check!r} finding, got {[(m.check, m.summary) for m in outcome.mismatches]}"
    assert any(text in m.summary for m in matching), f"{case}: {text!r} not in {[m.summary for m in matching]}"


def test_the_core_meets_the_contract_and_reports_every_metric():
    measurement = measure(m2po_loss, BATCH)
    assert measurement.finding is None and not measurement.mutated_inputs
    assert set(measurement.result.reported()) == {
        "m2_before",
        "m2_after",
        "masked_fraction",
        "trust_region_fraction",
        "valid_count",
        "trust_region_count",
        "kept_trust_region_count",
    }


def test_measure_rejects_an_unknown_dtype_by_name():
    with pytest.raises(ValueError, match="dtype: expected one of"):
        measure(m2po_loss, BATCH, dtype="float8")


def test_load_builtin_module_and_file(tmp_path):
    assert load_implementation("core") is m2po_loss
    assert load_implementation("m2po_oracle.core.loss:m2po_loss") is m2po_loss
    source = tmp_path / "my_port.py"
    source.write_text(
        textwrap.dedent("""
        from m2po_oracle.core.loss import m2po_loss
        def port(*args, **kwargs):
            return m2po_loss(*args, **kwargs)
    """)
    )
    assert run_battery(load_implementation(f"{source}:port"), BATCH).passed


def test_a_wrapper_file_imports_the_port_file_beside_it(tmp_path, monkeypatch):
    """A wrapper next to the port it adapts imports it by name, as a script would, from
    any working directory (an untuned port's wrapper failed with "No module named 'port'")."""
    (tmp_path / "sibling_port_for_wrapper.py").write_text("from m2po_oracle.core.loss import m2po_loss as loss\n")
    (tmp_path / "wrapper.py").write_text(
        "from sibling_port_for_wrapper import loss\n\ndef port(*args, **kwargs):\n    return loss(*args, **kwargs)\n"
    )
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path.resolve())])
    assert run_battery(load_implementation(f"{tmp_path / 'wrapper.py'}:port"), BATCH).passed


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cor", "closest matches: core"),
        ("control:strict_stp", "closest matches: control:strict_stop"),
        ("m2po_oracle.core.loss:m2po_los", "has no attribute 'm2po_los'; closest matches: m2po_loss"),
        ("no_such_module_xyz:f", "importing module 'no_such_module_xyz' failed"),
        ("/nonexistent/port.py:f", "file '/nonexistent/port.py' does not exist"),
        ("m2po_oracle.core.loss:math", "is a module, not a callable"),
        ("", "impl: expected a non-empty string"),
    ],
)
def test_load_errors_name_the_argument_and_what_was_expected(spec, message):
    with pytest.raises(ValueError, match="impl: ") as info:
        load_implementation(spec)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "spec, kind, parts",
    [
        ("core", "name", ("", "", "")),
        ("control:strict_stop", "name", ("", "", "")),
        ("trainer", "trainer", ("", "", "")),
        ("trainer:trl:kl_k1_estimator", "trainer", ("", "", "trl:kl_k1_estimator")),
        ("trainer:pkg.mod:Step", "trainer", ("", "", "pkg.mod:Step")),
        ("pkg.losses:m2po", "attribute", ("pkg.losses", "m2po", "")),
        ("C:/ports/port.py:m2po", "attribute", ("C:/ports/port.py", "m2po", "")),
    ],
)
def test_an_impl_spec_is_read_once_into_its_kind_and_parts(spec, kind, parts):
    parsed = parse_impl(spec)
    assert (parsed.kind, (parsed.target, parsed.attribute, parsed.rest)) == (kind, parts)


def test_an_impl_spec_that_is_no_string_is_refused():
    with pytest.raises(LoadError, match="impl: expected a non-empty string"):
        parse_impl("")
