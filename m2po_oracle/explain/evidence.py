"""The evidence a diagnosis weighs: each failing (or passing) example as an ``Observation``,
and the ``Judge`` that says which fields a set of deviations reproduces on it."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, overload

import numpy as np

from m2po_oracle.explain import variants
from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
    OBJECTIVE_KNOBS,
    SELECTION_KNOBS,
    SILENCING_KNOBS,
    VARIANTS,
    Deviation,
    combine,
    variant,
)
from m2po_oracle.judge.checks import result_field
from m2po_oracle.judge.equivalence import (
    check_selection,
    coarser,
    compare_fields,
    same_up_to_ties,
)
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import (
    COUNT_FIELDS,
    METRIC_FIELDS,
    M2POResult,
    PaddingProbe,
)


@dataclass(frozen=True)
class Observation:
    """One call's evidence: the batch as the implementation received it, its result, and
    the checks that failed on it."""

    batch: Batch
    result: M2POResult
    failed: frozenset[str] = frozenset()
    padding_probes: tuple[PaddingProbe, ...] = ()  # the probes whose result differed
    example: Any = None  # the runner's input that produced it (its replay command), when it is not the batch


@dataclass(frozen=True)
class Examples:
    """What a run observed, as a diagnosis weighs it: the search's ``sample``, the examples
    ``held_out`` beyond it (the shares count them: failing ones a name must reproduce, passing
    ones it must not contradict), the checks that failed, and the budget of each call that
    raised or returned nothing."""

    sample: tuple[Observation, ...]
    failed_checks: tuple[str, ...]
    held_out: tuple[Observation, ...] = ()
    call_failure_taus: tuple[float, ...] = ()


@dataclass(frozen=True)
class Reading:
    """How the port's results are read: the dtypes it was judged at, the fields it computes
    itself (None: every field it returns; an adapter builds the rest), and whether its mask
    was inferred from its zero gradients."""

    dtype: str
    compute_dtype: str | None = None
    supplied: frozenset[str] | None = None
    keep_inferred: bool = False


@dataclass(frozen=True)
class RunnerFacts:
    """What the runner knows beyond single examples: the step-level variants (distributed,
    trainer) that reproduce every failing step of a check, with their descriptions and source;
    the command that replays an example; and, for batches, whether a batch padded in one input
    alone makes the port's result NaN/inf (:func:`~m2po_oracle.explain.padding.padding_leak`)."""

    step_explanations: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    step_descriptions: dict[str, str] = dataclasses.field(default_factory=dict)
    step_source: str = ""
    replay: Any = None
    leaks_alone: Any = None


def merge(names: Iterable[str]) -> Deviation | None:
    """The deviation of several variants at once (None: two set one knob differently)."""
    return _merged(frozenset(names))


@functools.lru_cache(maxsize=4096)
def _merged(names: frozenset[str]) -> Deviation | None:
    # Two names that set one knob (even to one value) answer the same question twice: an
    # explanation names each knob once, so the pair is no explanation.
    set_knobs = [knobs_of(n) for n in names]
    if sum(len(k) for k in set_knobs) != len(frozenset().union(*set_knobs)):
        return None
    return combine(names)


@functools.lru_cache(maxsize=1024)
def knobs_of(name: str) -> frozenset[str]:
    dev = variant(name).deviation
    return frozenset(f.name for f in fields(Deviation) if getattr(dev, f.name) != getattr(ALGORITHM_1, f.name))


_ORDER = {v.name: i for i, v in enumerate(VARIANTS)}


def in_order(name: str) -> int:
    return _ORDER[variant(name).base]


class Judge:
    """Which fields of which observation a deviation reproduces (memoised)."""

    def __init__(
        self,
        observations: Sequence[Observation],
        *,
        dtype: str,
        compute_dtype: str | None,
        supplied: frozenset[str] | None,
        sample: int | None = None,
        keep_inferred: bool = False,
    ) -> None:
        self.observations = list(observations)
        #: The port's mask was read from its zero gradients (the adapter): a token whose gradient
        #: the deviation's own loss zeroes reads as removed, which is not the selection's doing.
        self.keep_inferred = keep_inferred
        self._unreadable: dict[tuple[tuple, int], np.ndarray] = {}
        self.dtype, self.compute_dtype, self.supplied = dtype, compute_dtype or dtype, supplied
        self.fields = [self._fields(o.result, supplied) for o in self.observations]
        #: The search scores the first ``sample`` observations (and those :meth:`widened` adds); shares count every one.
        self.sample: Sequence[int] = range(len(self.observations) if sample is None else min(sample, len(self.observations)))
        self.total = sum(len(self.fields[i]) for i in self.sample)
        self._order = list(self.sample)  # the order ``score`` asks the sample in
        self._differences: dict[tuple[Deviation, int], dict[str, str]] = {}
        self._keeps: dict[tuple[tuple, int], tuple[np.ndarray, np.ndarray]] = {}
        self._values: dict[tuple[tuple, int], dict[str, str]] = {}
        self._judged_values: dict[tuple, dict[str, str]] = {}
        self._keep_differences: dict[tuple, tuple[M2POResult, str | None]] = {}

    @staticmethod
    def _fields(result: M2POResult, supplied: frozenset[str] | None) -> frozenset[str]:
        present = {"keep", "loss"} | ({"grad"} if result.grad is not None else set())
        present |= {n for n in METRIC_FIELDS + COUNT_FIELDS if getattr(result, n) is not None}
        return frozenset(present if supplied is None else present & supplied)

    def held_out(self, i: int) -> bool:
        """Whether observation ``i`` lies beyond the search's sample."""
        return i not in self._in_sample

    @functools.cached_property
    def _in_sample(self) -> frozenset[int]:
        return frozenset(self.sample)

    def widened(self, more: Sequence[int]) -> Judge:
        """The same observations with ``more`` of the held-out ones in the search's sample
        (appended: the sample keeps its order). What is memoised per observation is shared:
        an observation keeps its index."""
        wider = copy.copy(self)
        wider.__dict__.pop("_in_sample", None)
        wider.sample = (*self.sample, *(i for i in more if self.held_out(i)))
        wider.total = sum(len(self.fields[i]) for i in wider.sample)
        wider._order = list(wider.sample)
        return wider

    def differences(self, dev: Deviation, i: int) -> dict[str, str]:
        """Field -> what differs first, for the fields ``dev`` does not reproduce on observation ``i``."""
        key = (dev, i)
        if key not in self._differences:
            self._differences[key] = self._compute(dev, i)
        return self._differences[key]

    @overload
    def score(self, dev: Deviation, at_least: None = None) -> int: ...
    @overload
    def score(self, dev: Deviation, at_least: int | None = None) -> int | None: ...

    def score(self, dev: Deviation, at_least: int | None = None) -> int | None:
        """(observation, field) pairs of the sample that ``dev`` reproduces; None as soon as it
        is clear that they are fewer than ``at_least`` (most moves of a search fail fast)."""
        missing, allowed = 0, (self.total - at_least if at_least is not None else None)
        for k, i in enumerate(self._order):
            missing += len(self.differences(dev, i))
            if allowed is not None and missing > allowed:
                # The examples that sink one move tend to sink the next: asking them first
                # fails most moves after an example or two (the total does not depend on the order).
                self._order.insert(0, self._order.pop(k))
                return None
        return self.total - missing

    @overload
    def score_all(self, dev: Deviation, at_least: None = None) -> int: ...
    @overload
    def score_all(self, dev: Deviation, at_least: int | None = None) -> int | None: ...

    def score_all(self, dev: Deviation, at_least: int | None = None) -> int | None:
        """(observation, field) pairs of every observation that ``dev`` reproduces (None: fewer than ``at_least``)."""
        every = sum(len(f) for f in self.fields)
        missing, allowed = 0, (every - at_least if at_least is not None else None)
        for i in range(len(self.observations)):
            missing += len(self.differences(dev, i))
            if allowed is not None and missing > allowed:
                return None
        return every - missing

    def reproduces(self, dev: Deviation, field_name: str, indices: Iterable[int] | None = None) -> bool:
        indices = range(len(self.observations)) if indices is None else indices
        return all(field_name not in self.differences(dev, i) for i in indices if field_name in self.fields[i])

    def reproduced(self, dev: Deviation, field_name: str, indices: Iterable[int]) -> list[int]:
        """Of ``indices``, the observations whose ``field_name`` ``dev`` reproduces."""
        return [i for i in indices if field_name in self.fields[i] and field_name not in self.differences(dev, i)]

    def _judged_keep(self, dev: Deviation, i: int) -> tuple[M2POResult, str | None]:
        """The port's result with the mask judged against ``dev`` (see :meth:`unreadable`), and
        what differs in it first (None: ``dev`` reproduces the mask)."""
        actual = self.observations[i].result
        unreadable = self.unreadable(dev, i)
        key: tuple = (tuple(getattr(dev, k) for k in SELECTION_KNOBS), i)
        if unreadable is not None and unreadable.any():
            # There the inferred mask shows the gradient, not the selection: the selection is
            # judged on the rest, the deviation's own choice taken there (and the values on that
            # mask). Many selections agree on those few tokens: the mask itself keys the values.
            actual = dataclasses.replace(actual, keep=np.where(unreadable, self._selection(dev, i)[0], actual.keep))
            key += (actual.keep.tobytes(),)
        if key not in self._keep_differences:
            self._keep_differences[key] = (actual, self._keep_difference(dev, i, actual) if "keep" in self.fields[i] else None)
        return self._keep_differences[key]

    def _compute(self, dev: Deviation, i: int) -> dict[str, str]:
        observation, judged = self.observations[i], self.fields[i]
        batch = observation.batch
        actual, difference = self._judged_keep(dev, i)
        value_key: tuple = tuple(getattr(dev, k) for k in OBJECTIVE_KNOBS) + ((dev.candidates,) if dev.selection_kind != "mask" else ())
        if actual is not observation.result:
            value_key += (actual.keep.tobytes(),)
        found: dict[str, str] = {}
        if difference:
            found["keep"] = difference
        # Loss, gradient and metrics depend on the objective's knobs only: many combinations share them.
        if (value_key, i) not in self._values:
            expected = variants.evaluate_with_mask(batch, actual.keep, dev)
            # Most deviations compute the very same values as another on a given example (a
            # clamp that does not bind, a denominator equal on it): each distinct set is judged once.
            # The port's own values are fixed per example (its mask is not compared here).
            outcome = (i, dev.metrics_dtype, dev.loss_dtype, *_values_of(expected))
            if outcome in self._judged_values:
                self._values[(value_key, i)] = self._judged_values[outcome]
                return {**self._values[(value_key, i)], **found}
            values: dict[str, str] = {}
            if dev.loss_dtype == "float32" and not _float32_numbers(actual):
                # A port that computes its loss in float32 returns float32 numbers: only that
                # precision, not float32's looser tolerance, is what the name claims.
                values.update({f: f"{f}: the port's values are not float32 numbers" for f in ("loss", "grad") if f in judged})
            for mismatch in compare_fields(
                batch, actual, expected, self.dtype, self.compute_dtype, metrics_dtype=dev.metrics_dtype, loss_dtype=dev.loss_dtype
            ):
                name = result_field(mismatch.check)
                if name in judged and name not in values:
                    at = f" at {mismatch.index}" if mismatch.index is not None else ""
                    values[name] = f"{name}{at}: variant {_plain(mismatch.expected)}, implementation {_plain(mismatch.actual)}"
            self._values[(value_key, i)] = self._judged_values[outcome] = values
        return {**self._values[(value_key, i)], **found}

    def predicted_keep(self, dev: Deviation, i: int) -> np.ndarray:
        """``dev``'s mask on observation ``i`` (for a clip kind: the tokens with a gradient), memoised."""
        return self._selection(dev, i)[0]

    def _selection(self, dev: Deviation, i: int) -> tuple[np.ndarray, np.ndarray]:
        batch = self.observations[i].batch
        selection_key = (tuple(getattr(dev, k) for k in SELECTION_KNOBS), i)
        if selection_key not in self._keeps:  # the mask and its M2 levels depend on the selection's knobs only
            d = variants.selection_log_ratio(variants.log_ratio(batch, dev), dev)
            self._keeps[selection_key] = (variants.select(batch, dev), np.where(batch.valid, variants.selection_m2(d, dev), np.nan))
        return self._keeps[selection_key]

    def unreadable(self, dev: Deviation, i: int) -> np.ndarray | None:
        """Where the port's mask was inferred from zero gradients, the valid tokens whose
        choice the gradient cannot show: a kept token's gradient exp(d) * A / N is zero when
        A == 0 or it underflows (the adapter completes those with the core's choice), and
        ``dev``'s own loss zeroes some kept tokens' gradient (PPO's clip, a hard clamp,
        float32 underflow). None where the mask is the port's own."""
        if not self.keep_inferred:
            return None
        silencing = dev.selection_kind == "mask" and any(getattr(dev, k) != getattr(ALGORITHM_1, k) for k in SILENCING_KNOBS)
        key = (tuple(getattr(dev, k) for k in OBJECTIVE_KNOBS) if silencing else (), i)
        if key not in self._unreadable:
            batch = self.observations[i].batch
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                kept_gradient = np.exp(variants.log_ratio(batch, ALGORITHM_1)) * np.where(batch.valid, batch.advantages, 0.0)
            blind = batch.valid & (kept_gradient == 0)
            if silencing:
                blind |= batch.valid & (variants.evaluate_with_mask(batch, batch.valid, dev).grad == 0)
            self._unreadable[key] = blind
        return self._unreadable[key]

    def _keep_difference(self, dev: Deviation, i: int, actual: M2POResult) -> str | None:
        batch = self.observations[i].batch
        if dev.selection_kind == "mask" and all(
            getattr(dev, k) == getattr(ALGORITHM_1, k) for k in SELECTION_KNOBS if k != "selection_dtype"
        ):
            # Algorithm 1's own selection: any admissible outcome (ties, rounding near tau) reproduces it.
            wrong = check_selection(batch, actual.keep, coarser(self.compute_dtype, dev.selection_dtype))
            return f"keep: {wrong[0].summary}" if wrong else None
        keep, levels = self._selection(dev, i)
        if same_up_to_ties(keep, actual.keep, levels):
            return None
        index = tuple(int(j) for j in np.argwhere(keep != actual.keep)[0])
        return f"keep differs at {index}: variant {'keeps' if keep[index] else 'removes'} it, implementation {'keeps' if actual.keep[index] else 'removes'} it"


def _values_of(result: M2POResult) -> tuple:
    """What the values of a result are, as a key (arrays by their bytes)."""
    return (
        result.keep.tobytes(),
        result.loss,
        result.grad.tobytes() if result.grad is not None else None,
        *(getattr(result, n) for n in METRIC_FIELDS + COUNT_FIELDS),
    )


def _float32_numbers(result: M2POResult) -> bool:
    """Whether the port's loss and gradient are float32 numbers (exactly representable)."""
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.append(np.ravel(result.grad) if result.grad is not None else np.array([]), result.loss)
        finite = values[np.isfinite(values)]
        return bool(np.all(finite.astype(np.float32).astype(np.float64) == finite))


def _plain(value: object) -> str:
    if isinstance(value, float):
        return repr(0.0 if value == 0 else value)  # never "-0.0"
    return repr(value)
