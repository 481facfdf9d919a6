"""The check battery: every property an implementation must satisfy on one batch.

Checks are data (:data:`CHECKS`); :func:`run_battery` runs all of them on one batch and
returns the mismatches, each naming its check. :func:`assert_battery_passes` turns them
into one self-sufficient failure message (the one formatter in ``equivalence``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import numpy as np

from m2po_oracle.batch import Batch
from m2po_oracle.contract import Implementation, Measurement, as_runner
from m2po_oracle import oracle
from m2po_oracle.equivalence import Mismatch, Tolerance, compare_to_oracle, compare_values, format_mismatches, same_up_to_ties, tolerance, valid_m2

#: Every check the battery runs, by the name failures carry, with what it asserts.
CHECKS: dict[str, str] = {
    "call": "the implementation returns a result under the contract (no exception, right types and shapes)",
    "selection.keep_only_valid": "padding tokens are never kept",
    "selection.only_trust_region_masked": "only trust-region tokens (A > 0 & d > 0 or A < 0 & d < 0) are ever masked",
    "selection.budget": "after masking, the mean M2 of the kept trust-region tokens is <= tau",
    "selection.minimal": "the mask is minimal: keeping the next removed token would break the budget",
    "selection.largest_removed_first": "removed tokens have the largest M2 (any choice among ties)",
    "loss": "loss equals -(1/N) sum keep * exp(d) * A on the implementation's own mask",
    "gradient": "autograd d loss / d logp equals -(1/N) * keep * exp(d) * A",
    "metrics.m2_before": "m2_before equals the mean M2 over the trust region",
    "metrics.m2_after": "m2_after equals the mean M2 over the kept trust-region tokens",
    "metrics.masked_fraction": "masked_fraction equals masked / N",
    "metrics.trust_region_fraction": "trust_region_fraction equals |T| / N",
    "metrics.valid_count": "valid_count equals N",
    "metrics.trust_region_count": "trust_region_count equals |T|",
    "metrics.kept_trust_region_count": "kept_trust_region_count equals the kept trust-region tokens",
    "padding_immunity": "NaN/inf padding changes neither the mask, the loss nor the gradient",
    "determinism": "the same input gives the same mask, loss and gradient",
    "inputs_not_mutated": "the implementation does not modify its input tensors",
}
# A distributed step (compare --topology) adds its per-rank checks.
from m2po_oracle.distributed_checks_names import DISTRIBUTED_CHECKS  # noqa: E402

CHECKS.update(DISTRIBUTED_CHECKS)
# A whole training step (compare --impl trainer) adds its model-level checks.
from m2po_oracle.trainer_checks_names import TRAINER_CHECKS  # noqa: E402

CHECKS.update(TRAINER_CHECKS)

PADDING_PROBES = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class BatteryOutcome:
    batch: Batch  # the values the implementation received
    measurement: Measurement
    mismatches: tuple[Mismatch, ...] = field(default_factory=tuple)
    ranks: tuple[dict, ...] = ()  # per-rank results and collectives of a distributed step
    explained_by: tuple[str, ...] | None = None  # step-level variants (distributed, trainer) reproducing a failing step
    evidenced: tuple[str, ...] | None = None  # those of them that differ from Algorithm 1 on it (None: all of them)
    case: dict | None = None  # the input of a step runner that is not a batch (a trainer case), as JSON

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
    return Mismatch(check, f"{label}: keep differs {how} at {diff.size} token(s), first at index {index}", field="keep", index=index,
                    actual=bool(actual[index]), expected=bool(expected[index]))


def _relabel(check: str, label: str, mismatch: Mismatch | None) -> list[Mismatch]:
    if mismatch is None:
        return []
    return [Mismatch(check, f"{label}: {mismatch.summary}", mismatch.field, mismatch.index, mismatch.actual, mismatch.expected, mismatch.details)]


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


def _padding_immunity(first: Measurement, probe: Measurement, fill: float, dtype: str) -> list[Mismatch]:
    """With other padding the result is the clean run's, up to a tie choice at the cut
    (whose loss and gradient are then judged on the probe's own mask)."""
    label = f"with padding set to {fill}"
    if probe.finding is not None:
        return _failed_call("padding_immunity", label, probe)
    ref, res, seen = first.result, probe.result, first.batch
    assert ref is not None and res is not None
    if not same_up_to_ties(ref.keep, res.keep, valid_m2(seen)):
        return [_keep_mismatch("padding_immunity", label, ref.keep, res.keep, "beyond a tie choice")]
    expected = ref if np.array_equal(ref.keep, res.keep) else oracle.evaluate_with_mask(seen, res.keep)
    found = _relabel("padding_immunity", label, compare_values("padding_immunity", "loss", res.loss, expected.loss, tolerance(dtype, "loss")))
    found += _relabel("padding_immunity", label, compare_values("padding_immunity", "grad", res.grad, expected.grad, tolerance(dtype, "gradient")))
    return found


def run_battery(fn: Implementation, batch: Batch, *, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu") -> BatteryOutcome:
    """Run every check on one batch. Never raises because of the implementation.

    ``fn`` is an implementation callable (called in this process) or a runner such as
    :class:`m2po_oracle.isolation.Isolated` (called in a worker process with a timeout)."""
    if hasattr(fn, "step_battery"):  # a runner that owns the whole step (a distributed world, a trainer)
        return fn.step_battery(batch, dtype=dtype, compute_dtype=compute_dtype, device=device)
    runner = as_runner(fn)
    first = runner.measure(batch, dtype=dtype, device=device)
    if first.finding is not None:
        return BatteryOutcome(first.batch, first, (Mismatch("call", f"{first.finding.kind}: {first.finding.message}"),))
    assert first.result is not None
    found: list[Mismatch] = []
    if first.mutated_inputs:
        found.append(Mismatch("inputs_not_mutated", f"the implementation modified its input tensor(s): {', '.join(first.mutated_inputs)}"))
    found.extend(compare_to_oracle(first.batch, first.result, dtype, compute_dtype))
    again = runner.measure(batch, dtype=dtype, device=device)
    nondeterministic = _determinism(first, again)
    found.extend(nondeterministic)
    # A nondeterministic implementation would also differ under the padding probes;
    # comparing them would blame padding for what determinism already reports.
    if not nondeterministic and not batch.valid.all():
        for fill in PADDING_PROBES:
            found.extend(_padding_immunity(first, runner.measure(batch.with_padding(fill), dtype=dtype, device=device), fill, dtype))
    return BatteryOutcome(first.batch, first, tuple(found))


def replay_command(impl: str, batch: Batch, *, dtype: str = "float64", compute_dtype: str | None = None) -> str:
    parts = ["m2po-oracle", "replay", "--impl", impl, "--dtype", dtype]
    if compute_dtype and compute_dtype != dtype:
        parts += ["--compute-dtype", compute_dtype]
    parts += ["--batch", batch.to_json()]
    return shlex.join(parts)


def assert_battery_passes(fn: Implementation, batch: Batch, *, impl: str, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu") -> BatteryOutcome:
    """Run the battery and raise AssertionError with the full failure message if any check fails."""
    outcome = run_battery(fn, batch, dtype=dtype, compute_dtype=compute_dtype, device=device)
    if outcome.mismatches:
        raise AssertionError(format_mismatches(list(outcome.mismatches), batch=batch, where=f"for implementation {impl!r} ({dtype})",
                                               replay=replay_command(impl, batch, dtype=dtype, compute_dtype=compute_dtype)))
    return outcome
