"""The check battery: every property an implementation must satisfy on one batch.

Checks are data (:data:`m2po_oracle.judge.checks.CHECKS`); :func:`run_battery` runs all of them on one batch and
returns the mismatches, each naming its check. :func:`assert_battery_passes` turns them
into one self-sufficient failure message (the one formatter in ``equivalence``).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.judge.contract import Implementation, Measurement, measure, parse_impl, with_printed
from m2po_oracle.judge.equivalence import (
    Mismatch,
    Tolerance,
    checks_run_on,
    compare_to_oracle,
    compare_values,
    format_mismatches,
    same_up_to_ties,
    tolerance,
    valid_m2,
)
from m2po_oracle.judge.metric_averaging import UnweightedMean
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import PaddingProbe

PADDING_PROBES = (float("nan"), float("inf"), float("-inf"))
#: The probe of the padding the batch was drawn with, by its label.
DRAWN_PADDING = "the drawn padding"
#: The finite padding probe (Batch.with_trust_region_padding), by its label.
TRUST_REGION_PADDING = "small trust-region tokens (d = 2**-6, A = 1)"


@dataclass(frozen=True)
class BatteryOutcome:
    batch: Batch  # the values the implementation received
    measurement: Measurement
    mismatches: tuple[Mismatch, ...] = field(default_factory=tuple)
    ranks: tuple[dict, ...] = ()  # per-rank results and collectives of a distributed step
    explained_by: tuple[str, ...] | None = None  # step-level variants (distributed, trainer) reproducing a failing step
    evidenced: tuple[str, ...] | None = None  # those of them that differ from Algorithm 1 on it (None: all of them)
    case: dict | None = None  # the input of a step runner that is not a batch (a trainer case), as JSON
    #: The checks that actually ran on this example (a failed call runs nothing else;
    #: a metric the implementation does not report is not checked).
    checked: tuple[str, ...] = ("call",)
    #: The padding probes the result changed under, for the diagnosis to tell a deviation
    #: that reads padding from a leak.
    padding_probes: tuple[PaddingProbe, ...] = ()
    #: A step whose logged metrics are its micro-batches' own values averaged unweighted (a
    #: finding beside its failing metric checks: the selection is right, the log is not Algorithm 1's).
    metric_averaging: UnweightedMean | None = None

    @property
    def passed(self) -> bool:
        return not self.mismatches

    @property
    def failed_checks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.check for m in self.mismatches))


def _failed_call(check: str, label: str, other: Measurement) -> list[Mismatch]:
    assert other.finding is not None
    return [Mismatch(check, f"{label}: the call failed ({other.finding.kind}): {other.finding.message.splitlines()[-1]}")]


def _keep_mismatch(check: str, label: str, expected: np.ndarray, actual: np.ndarray, how: str) -> Mismatch:
    diff = np.flatnonzero(expected.ravel() != actual.ravel())
    index = tuple(int(i) for i in np.unravel_index(diff[0], expected.shape))
    return Mismatch(
        check,
        f"{label}: keep differs {how} at {diff.size} token(s), first at index {index}",
        field="keep",
        index=index,
        actual=bool(actual[index]),
        expected=bool(expected[index]),
    )


def _relabel(check: str, label: str, mismatch: Mismatch | None) -> list[Mismatch]:
    if mismatch is None:
        return []
    return [
        Mismatch(
            check, f"{label}: {mismatch.summary}", mismatch.field, mismatch.index, mismatch.actual, mismatch.expected, mismatch.details
        )
    ]


def _determinism(first: Measurement, again: Measurement) -> list[Mismatch]:
    """Bit-for-bit the same outputs (NaN equal to NaN: a NaN is reported by other checks)."""
    label = "second call on the same input"
    if again.finding is not None:
        return _failed_call("determinism", label, again)
    ref, res = first.result, again.result
    assert ref is not None and res is not None
    found = []
    if not np.array_equal(ref.keep, res.keep):
        found.append(_keep_mismatch("determinism", label, ref.keep, res.keep, "bit for bit"))
    for name, a, b in (("loss", res.loss, ref.loss), ("grad", res.grad, ref.grad)):
        if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True):
            # Differing values, or a NaN on one side only: compare_values reports either.
            found.extend(_relabel("determinism", label, compare_values("determinism", name, a, b, Tolerance(0.0, 0.0))))
    return found


def _padding_differs(drawn: Batch, zeroed: Batch) -> bool:
    invalid = ~drawn.valid
    return any(
        not np.array_equal(a[invalid], b[invalid])
        for a, b in ((drawn.logp, zeroed.logp), (drawn.behavior_logp, zeroed.behavior_logp), (drawn.advantages, zeroed.advantages))
    )


#: Padding positions listed at most in a drawn-padding failure's details.
_PADDING_LISTED = 6


def _drawn_padding(drawn: Batch) -> tuple[str, ...]:
    """The drawn padding's non-zero values, which the printed minimal batch (judged with
    zero padding) does not show: the values the failing probe ran with."""
    lines = []
    for name in ("logp", "behavior_logp", "advantages"):
        values = getattr(drawn, name)
        at = [tuple(int(i) for i in index) for index in np.argwhere(~drawn.valid & (values != 0.0))]
        if at:
            shown = ", ".join(f"{index}: {float(values[index])!r}" for index in at[:_PADDING_LISTED])
            lines.append(
                f"the probe's padding {name}: {shown}" + (f", and {len(at) - _PADDING_LISTED} more" if len(at) > _PADDING_LISTED else "")
            )
    return tuple(lines)


def _padding_immunity(first: Measurement, probe: Measurement, fill: str, dtype: str, drawn: Batch | None = None) -> list[Mismatch]:
    """With other padding the result is the clean run's, up to a tie choice at the cut
    (whose loss and gradient are then judged on the probe's own mask). With ``drawn``
    (the drawn padding's batch), each mismatch lists that padding's values."""
    label = f"with padding set to {fill}" if fill != DRAWN_PADDING else "with the drawn padding (instead of 0)"
    found = _padding_mismatches(first, probe, label, dtype)
    if drawn is None:
        return found
    listed = _drawn_padding(drawn)
    return [replace(m, details=m.details + listed) for m in found]


def _padding_mismatches(first: Measurement, probe: Measurement, label: str, dtype: str) -> list[Mismatch]:
    if probe.finding is not None:
        return _failed_call("padding_immunity", label, probe)
    ref, res, seen = first.result, probe.result, first.batch
    assert ref is not None and res is not None
    if not same_up_to_ties(ref.keep, res.keep, valid_m2(seen)):
        return [_keep_mismatch("padding_immunity", label, ref.keep, res.keep, "beyond a tie choice")]
    expected = ref if np.array_equal(ref.keep, res.keep) else oracle.evaluate_with_mask(seen, res.keep)
    found = _relabel(
        "padding_immunity", label, compare_values("padding_immunity", "loss", res.loss, expected.loss, tolerance(dtype, "loss"))
    )
    found += _relabel(
        "padding_immunity", label, compare_values("padding_immunity", "grad", res.grad, expected.grad, tolerance(dtype, "gradient"))
    )
    return found


def _finite(result) -> bool:
    return bool(np.isfinite(result.loss)) and (result.grad is None or bool(np.all(np.isfinite(result.grad))))


@runtime_checkable
class Caller(Protocol):
    """How a loss function is called: in this process or in a worker (``isolation``)."""

    def measure(self, batch: Batch, *, dtype: str = "float64", device: str = "cpu") -> Measurement: ...


class _InThisProcess:
    def __init__(self, fn: Implementation) -> None:
        self.fn = fn

    def measure(self, batch: Batch, *, dtype: str = "float64", device: str = "cpu") -> Measurement:
        return measure(self.fn, batch, dtype=dtype, device=device)


def run_battery(
    fn: Implementation | Caller, batch: Batch, *, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu"
) -> BatteryOutcome:
    """Run every check on one batch. Never raises because of the implementation.

    ``fn`` is an implementation callable (called in this process) or a caller such as
    :class:`m2po_oracle.call.isolation.Isolated` (called in a worker process with a timeout)."""
    caller = fn if isinstance(fn, Caller) else _InThisProcess(fn)
    # Selection, loss, gradient and metrics are judged with zero padding; the drawn padding
    # (NaN, inf, 1e30, noise) is the padding probes' alone, so a padding leak never hides or
    # "explains" another deviation.
    drawn, batch = batch, batch.with_padding(0.0)
    first = caller.measure(batch, dtype=dtype, device=device)
    if first.finding is not None:
        return BatteryOutcome(first.batch, first, (Mismatch("call", f"{first.finding.kind}: {first.finding.message}"),))
    assert first.result is not None
    found: list[Mismatch] = []
    checked = ["call", "inputs_not_mutated", *checks_run_on(first.result), "determinism"]
    found.extend(compare_to_oracle(first.batch, first.result, dtype, compute_dtype))
    again = caller.measure(batch, dtype=dtype, device=device)
    nondeterministic = _determinism(first, again)
    found.extend(nondeterministic)
    probes = [again]
    probe_labels: list[tuple[str, Measurement]] = [(" on the second call", again)]
    changed: list[PaddingProbe] = []
    # A nondeterministic implementation would also differ under the padding probes;
    # comparing them would blame padding for what determinism already reports.
    # A result that is already NaN/inf on finite data is reported by the value checks;
    # comparing the probes with it would blame padding for it.
    if not nondeterministic and not batch.valid.all() and _finite(first.result):
        checked.append("padding_immunity")
        variants = [(DRAWN_PADDING, drawn)] if _padding_differs(drawn, batch) else []
        fills = [(f"{fill}", batch.with_padding(fill)) for fill in PADDING_PROBES] + [
            (TRUST_REGION_PADDING, batch.with_trust_region_padding())
        ]
        for label, probed in variants + fills:
            probe = caller.measure(probed, dtype=dtype, device=device)
            probes.append(probe)
            probe_labels.append((f" {'with the drawn padding' if label == DRAWN_PADDING else f'with padding set to {label}'}", probe))
            differs = _padding_immunity(first, probe, label, dtype, drawn=probed if label == DRAWN_PADDING else None)
            found.extend(differs)
            if differs and probe.result is not None:
                changed.append(PaddingProbe(label, probe.batch, probe.result))
    mutated = [(label, call.mutated_inputs) for label, call in [("", first), *probe_labels] if call.mutated_inputs]
    if mutated:
        label, names = mutated[0]
        found.insert(0, Mismatch("inputs_not_mutated", f"the implementation modified its input tensor(s){label}: {', '.join(names)}"))
    for call in probes:  # the report counts what every call of the battery printed
        first = with_printed(first, call.output, call.output_lines)
    return BatteryOutcome(first.batch, first, tuple(found), checked=tuple(checked), padding_probes=tuple(changed))


def replay_command(
    impl: str,
    example_json: str,
    *,
    dtype: str = "float64",
    compute_dtype: str | None = None,
    adapter: str | None = None,
    extra: tuple[str, ...] = (),
) -> str:
    """The one ``m2po-oracle replay`` command for an example (its JSON: a batch or a trainer
    case) under the options that shape a call; ``extra`` (e.g. the topology) follows the spec."""
    parts = ["m2po-oracle", "replay", "--impl", _portable(impl), *extra]
    if adapter:
        parts += ["--adapter", adapter]
    parts += ["--dtype", dtype]
    if compute_dtype and compute_dtype != dtype:
        parts += ["--compute-dtype", compute_dtype]
    return shlex.join([*parts, "--batch", example_json])


def _portable(impl: str) -> str:
    """``file.py:function`` with the file made absolute, so that the replay runs from any
    directory (a report is read, and its command pasted, elsewhere than the run's)."""
    spec = parse_impl(impl)
    if spec.kind == "attribute" and spec.target.endswith(".py") and not os.path.isabs(spec.target) and os.path.isfile(spec.target):
        return f"{os.path.abspath(spec.target)}:{spec.attribute}"
    return impl


def assert_battery_passes(
    fn: Implementation, batch: Batch, *, impl: str, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu"
) -> BatteryOutcome:
    """Run the battery and raise AssertionError with the full failure message if any check fails."""
    outcome = run_battery(fn, batch, dtype=dtype, compute_dtype=compute_dtype, device=device)
    if outcome.mismatches:
        raise AssertionError(
            format_mismatches(
                list(outcome.mismatches),
                batch=batch,
                where=f"for implementation {impl!r} ({dtype})",
                replay=replay_command(impl, batch.to_json(), dtype=dtype, compute_dtype=compute_dtype),
            )
        )
    return outcome
