"""How hard a run looked: per check, the examples that could have failed it, and a bound.

A check *exercises* an example when the example gives it a decision to get wrong: an empty
trust region cannot show a selection that removed too much (``selection.minimal``), a
batch without padding cannot show padding kept. :data:`EXERCISED` is that rule for every
check of the battery, as data: a description and a predicate on :class:`Facts` (the
batch the implementation received and Algorithm 1's result on it, computed once per
example with :func:`m2po_oracle.oracle.m2po` and the selection bounds of the compute
dtype). NumPy only. The selection rules are necessary conditions: no output can fail the
check where its rule does not hold. The others mark where the check is not trivial (a
metric of an empty trust region is 0, a loss without a non-zero term is 0), and a port
can still fail them outside (a wrong trust region reports a non-zero ``m2_before`` on
an empty one): such a failure counts as exercised.

Counting (:class:`CoverageTally`): a check is exercised on an example when it ran there
and its predicate holds, or when it failed there (a failure is evidence that the example
exercised it, whatever the predicate says); a check that did not run is never exercised.
A check without a rule (a distributed or trainer check, run on a costly step) counts
every example it ran on. The features of :data:`FEATURES` (ties at the cut, exact
boundaries, all-masked batches, NaN padding, ...) and the strategy family each example
came from (:func:`m2po_oracle.strategies.family_of`) are counted apart.

With ``f`` failures on ``n`` exercised examples, :func:`failure_rate_upper` is the
one-sided 95% Clopper-Pearson upper bound on the per-example failure rate
(``beta.ppf(0.95, f + 1, n - f)``; for ``f = 0`` that is ``1 - 0.05 ** (1 / n)``, about
3 / n). It treats the exercised examples as independent draws, which Hypothesis's
generated examples only approximate (it starts with the simplest and steers towards
new behaviour), so read it as "how hard it looked", not as a guarantee.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from msgspec import UNSET

from m2po_oracle import oracle
from m2po_oracle.judge.equivalence import selection_bounds
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import M2POResult
from m2po_oracle.records.compare import Coverage

#: The confidence of the reported bound.
CONFIDENCE = 0.95
#: Log ratios below this magnitude are where a port's margin (r > 1 + 1e-12) decides candidacy.
TINY_LOG_RATIO = 1e-10
#: Log ratios beyond this magnitude are where a port's guard (a clamp of d to +-20) acts.
EXTREME_LOG_RATIO = 20.0


@dataclass(frozen=True)
class Facts:
    """What the predicates read about one example: the batch the implementation received
    (padding zeroed, inputs rounded to the dtype) and Algorithm 1 on it."""

    batch: Batch
    expected: M2POResult  # Algorithm 1 (the literal loop) on ``batch``
    trust: np.ndarray  # the trust region (candidates)
    sorted_m2: np.ndarray  # the candidates' M2, ascending
    kept: int  # k*: candidates Algorithm 1 keeps
    k_min: int  # fewest candidates Algorithm 1 may keep in the compute dtype (rounding band)
    k_max: int  # most
    tie_rtol: float  # M2 values this close (relative) count as ties in the compute dtype
    nan_padding: bool = False  # the drawn padding (before the battery zeroed it) holds NaN

    @property
    def candidates(self) -> int:
        return int(self.sorted_m2.size)

    @property
    def padding(self) -> bool:
        return not bool(self.batch.valid.all())

    @property
    def valid_outside_trust(self) -> bool:
        return bool((self.batch.valid & ~self.trust).any())

    @property
    def nonzero_term(self) -> bool:
        return bool((self.batch.valid & (self.batch.advantages != 0)).any())

    @property
    def empty_row(self) -> bool:
        return bool(self.batch.valid.shape[0]) and not bool(self.batch.valid.any(axis=1).all())

    @property
    def tiny_log_ratio(self) -> bool:
        magnitude = np.abs(self._valid_log_ratio())
        return bool(((magnitude > 0) & (magnitude < TINY_LOG_RATIO)).any())

    @property
    def extreme_log_ratio(self) -> bool:
        return bool((np.abs(self._valid_log_ratio()) > EXTREME_LOG_RATIO).any())

    def _valid_log_ratio(self) -> np.ndarray:
        return oracle.log_ratio(self.batch.logp, self.batch.behavior_logp, self.batch.valid)[self.batch.valid]

    @property
    def ties_at_cut(self) -> bool:
        k = self.kept
        return 0 < k < self.candidates and bool(self.sorted_m2[k] <= self.sorted_m2[k - 1] * (1.0 + self.tie_rtol))

    @property
    def exact_boundary(self) -> bool:
        """The mean M2 of the k* kept candidates equals tau exactly (decided by ``<=``).
        Prefix means only grow, so this is the one place a prefix mean can equal tau."""
        k, tau = self.kept, float(self.batch.tau)
        if k == 0:
            return False
        mean = float(self.sorted_m2[:k].sum() / k)
        if not math.isclose(mean, tau, rel_tol=1e-9, abs_tol=0.0):  # cheap filter before the exact sum
            return False
        total = oracle.ExactSum(self.sorted_m2[:k])
        if total.infinite:
            return False
        numerator, denominator = tau.as_integer_ratio()
        return total.scaled * denominator == numerator * k * (1 << oracle.ExactSum.SCALE)


def facts(batch: Batch, compute_dtype: str = "float64", drawn: Any = None) -> Facts:
    """The :class:`Facts` of ``batch`` (as the implementation received it); ``drawn``: the
    example as generated, whose padding the battery replaced by 0."""
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    expected = oracle.m2po(batch)
    bounds = selection_bounds(batch, compute_dtype)
    return Facts(
        batch,
        expected,
        trust,
        bounds.sorted_m2,
        int((expected.keep & trust).sum()),
        bounds.k_min,
        bounds.k_max,
        bounds.tie_rtol,
        nan_padding=_nan_padding(drawn),
    )


def _nan_padding(drawn: Any) -> bool:
    if not isinstance(drawn, Batch):
        return False
    invalid = ~drawn.valid
    return any(bool(np.isnan(a[invalid]).any()) for a in (drawn.logp, drawn.behavior_logp, drawn.advantages))


@dataclass(frozen=True)
class Rule:
    """When an example exercises a check: ``when`` says it in words, ``holds`` decides it."""

    when: str
    holds: Callable[[Facts], bool]


def _every(_: Facts) -> bool:
    return True


def _non_empty_trust_region(f: Facts) -> bool:
    return f.candidates > 0


def _cut(f: Facts) -> bool:
    return f.kept < f.candidates


EVERY = Rule("every example it ran on", _every)
NON_EMPTY_TRUST_REGION = Rule("a non-empty trust region", _non_empty_trust_region)
# A valid token with A != 0 is a term Algorithm 1 keeps or a trust-region token it masks
# (every candidate has A != 0): either a kept token with a non-zero term or a cut.
TERM = Rule("a valid token with A != 0: Algorithm 1 keeps a non-zero term, or masks one (a cut)", lambda f: f.nonzero_term)

#: Per check of the battery, when an example exercises it (could fail it).
EXERCISED: dict[str, Rule] = {
    "call": EVERY,
    "selection.keep_only_valid": Rule("some padding (a token outside the loss mask)", lambda f: f.padding),
    "selection.only_trust_region_masked": Rule("a valid token outside the trust region", lambda f: f.valid_outside_trust),
    # kept > k_max is impossible when k_max is every candidate.
    "selection.budget": Rule(
        "a cut: Algorithm 1 must remove a trust-region token (beyond the rounding band)", lambda f: f.k_max < f.candidates
    ),
    # kept < k_min is impossible when k_min is 0: a cut that removes every candidate does not
    # exercise it, a batch that needs no cut does (removing anything there is not minimal).
    "selection.minimal": Rule(
        "Algorithm 1 must keep a trust-region token (beyond the rounding band): removing one too many fails", lambda f: f.k_min >= 1
    ),
    # Keeping the largest and removing the smallest candidate fails it wherever two M2 differ:
    # also where Algorithm 1 keeps all or none (a port with a wrong count or trust region
    # removes some candidates there, in the wrong order).
    "selection.largest_removed_first": Rule(
        "two trust-region tokens of different M2 (beyond the compute dtype's tie tolerance)",
        lambda f: f.candidates >= 2 and bool(f.sorted_m2[-1] > f.sorted_m2[0] * (1.0 + f.tie_rtol)),
    ),
    "loss": TERM,
    "gradient": TERM,
    "metrics.m2_before": NON_EMPTY_TRUST_REGION,
    "metrics.m2_after": NON_EMPTY_TRUST_REGION,
    "metrics.masked_fraction": Rule("a cut: Algorithm 1 masks a token", _cut),
    "metrics.trust_region_fraction": NON_EMPTY_TRUST_REGION,
    "metrics.valid_count": EVERY,
    "metrics.trust_region_count": NON_EMPTY_TRUST_REGION,
    "metrics.kept_trust_region_count": NON_EMPTY_TRUST_REGION,
    "padding_immunity": Rule("some padding", lambda f: f.padding),
    "determinism": EVERY,
    "inputs_not_mutated": EVERY,
}

#: Features of an example, counted apart (over the examples whose call returned a result).
FEATURES: dict[str, Rule] = {
    "cut": Rule("Algorithm 1 removes at least one trust-region token", lambda f: f.kept < f.candidates),
    "ties_at_cut": Rule(
        "the last kept and the first removed candidate have equal M2 (any choice among them is admissible)", lambda f: f.ties_at_cut
    ),
    "exact_boundary": Rule(
        "the mean M2 of the kept candidates equals tau exactly (dyadic: <= keeps, < would remove one more)", lambda f: f.exact_boundary
    ),
    "empty_trust_region": Rule("no trust-region token", lambda f: f.candidates == 0),
    "all_masked": Rule("no valid token at all", lambda f: not bool(f.batch.valid.any())),
    "nan_padding": Rule("the drawn padding holds NaN (padding_immunity probes it; the other checks see 0)", lambda f: f.nan_padding),
    "empty_row": Rule("a row without any valid token (per-row aggregations count or drop it)", lambda f: f.empty_row),
    "tiny_log_ratio": Rule(
        f"a valid token with 0 < |d| < {TINY_LOG_RATIO:g} (a margin in the candidate test flips it)", lambda f: f.tiny_log_ratio
    ),
    "extreme_log_ratio": Rule(f"a valid token with |d| > {EXTREME_LOG_RATIO:g} (a clamp of d changes it)", lambda f: f.extreme_log_ratio),
}


def exercised_by(f: Facts) -> frozenset[str]:
    """The checks of :data:`EXERCISED` that ``f`` exercises (whether or not they ran)."""
    return frozenset(name for name, rule in EXERCISED.items() if rule.holds(f))


#: A passing check exercised fewer times than this is said to be thinly exercised beside the
#: verdict: its pass rests on a handful of examples (the 95% bound on its failure rate is above 45%).
THINLY_EXERCISED = 5


def thinly_exercised(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    """Of a report's checks (its JSON), the passing ones exercised fewer than THINLY_EXERCISED
    times, as "name (n)"."""
    return [
        f"{c['name']} ({c.get('exercised', 0)})" for c in checks if c.get("status") == "pass" and c.get("exercised", 0) < THINLY_EXERCISED
    ]


def failure_rate_upper(failures: int, exercised: int, confidence: float = CONFIDENCE) -> float | None:
    """One-sided Clopper-Pearson upper bound on the failure rate (None: nothing exercised)."""
    if exercised <= 0:
        return None
    if failures >= exercised:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(confidence, failures + 1, exercised - failures))


def percent(value: float) -> str:
    """A rate as a short percentage: 0.0495 -> "5.0%", 0.006 -> "0.6%", 0.32 -> "32%"."""
    v = 100.0 * value
    if v >= 10 or v == 0:
        return f"{v:.0f}%"
    if v >= 1:
        return f"{v:.1f}%"
    return f"{v:#.2g}%"


def rate_text(failures: int, exercised: int, upper: float | None) -> str:
    """The bound as the report shows it: "< 0.6%" with no failure, "30% (< 42%)" with some,
    "100%" when every exercised example failed (no bound above it to state)."""
    if upper is None or exercised <= 0:
        return "-"
    if not failures:
        return f"< {percent(upper)}"
    if failures >= exercised:
        return percent(1.0)
    return f"{percent(failures / exercised)} (< {percent(upper)})"


def _family(example: Any) -> str:
    from m2po_oracle.strategies import family_of

    if isinstance(example, Batch):
        return family_of(example) or "untagged"
    to_dict = getattr(example, "to_dict", None)  # a trainer case names its kind
    try:
        kind = to_dict().get("kind") if callable(to_dict) else None
    except Exception:
        kind = None
    return str(kind) if kind else type(example).__name__


@dataclass
class CoverageTally:
    """Families and features over a run's examples; :meth:`add` says which checks each one exercised."""

    examples: int = 0
    judged: int = 0  # examples whose call returned a result: the features' denominator
    unmeasured: int = 0  # examples whose facts could not be computed (their checks count only where they failed)
    families: Counter = field(default_factory=Counter)
    features: Counter = field(default_factory=lambda: Counter({name: 0 for name in FEATURES}))

    def add(self, example: Any, outcome: Any, compute_dtype: str = "float64") -> frozenset[str]:
        """Count one example; the checks it exercised: among those that ran, the ones whose
        rule holds (a check without a rule: every run), and every one that failed."""
        self.examples += 1
        self.families[_family(example)] += 1
        ran = tuple(getattr(outcome, "checked", ()))
        failed = frozenset(getattr(outcome, "failed_checks", ()))
        judged = getattr(getattr(outcome, "measurement", None), "result", None) is not None
        batch = getattr(outcome, "batch", None)
        found: Facts | None = None
        if judged and isinstance(batch, Batch):
            try:
                found = facts(batch, compute_dtype, example)
            except Exception:
                found = None
        if judged:
            self.judged += 1
            if found is None:
                self.unmeasured += 1
            else:
                self.features.update(name for name, rule in FEATURES.items() if rule.holds(found))
        exercised = {name for name in ran if name not in EXERCISED} | failed
        if found is not None:
            exercised |= set(ran) & exercised_by(found)
        elif "call" in ran:
            exercised.add("call")
        return frozenset(exercised)

    def record(self, checks: Iterable[str] = ()) -> Coverage:
        return Coverage(
            examples=self.examples,
            judged=self.judged,
            unmeasured=self.unmeasured if self.unmeasured else UNSET,
            families=dict(sorted(self.families.items(), key=lambda item: (-item[1], item[0]))),
            features=dict(self.features),
            feature_descriptions={name: rule.when for name, rule in FEATURES.items()},
            exercised_when={name: (EXERCISED[name].when if name in EXERCISED else EVERY.when) for name in checks},
            confidence=CONFIDENCE,
            bound="one-sided Clopper-Pearson upper bound on the per-example failure rate over the exercised examples",
        )
