"""Diagnosis: the smallest set of known deviations that explains what a port computed.

Each known deviation (:data:`~m2po_oracle.explain.deviations.VARIANTS`) is a set of knobs; any
set of them composes into one deviating M2PO (:mod:`~m2po_oracle.explain.variants`), which
computes its own mask, loss, gradient and metrics from the batch alone. A combination
*reproduces* a field of an observation when its mask equals the port's up to a choice
among equal M2 values (the mask of a port whose selection is Algorithm 1's may be any
admissible outcome), or when its objective evaluated on the port's own mask matches the
port's loss, gradient or metric within the tolerance policy. Only the fields the port
itself supplied are compared (an adapter may build the rest).

The search (on a sample of the observations) grows combinations one move at a time: a
known deviation, or a group whose members only act together (:data:`JOINT_MOVES`, a
variant's ``acts_with``); a deviation whose value a port picks itself (floors, clamp bound,
epsilon, budget scale, margins) is fitted to the data and named with its value. It keeps
the few combinations that reproduce the most (observation, field) pairs, until one
reproduces every pair or nothing grows; deviations whose removal loses nothing are dropped.
Where that explanation leaves held-out failing examples unreproduced (what the sample never
showed), half of them join the sample for a second search, whose explanation stands only
if it reproduces more of the examples still held out (:func:`second_search`).

Coverage, not unanimity: real ports carry quirks on a few examples (a margin at an exact
tie), so for every failing check the report states the share of its failing examples the
explanation reproduces and the examples it contradicts. A check is named by the deviations
without which fewer of its failing examples are reproduced, when the explanation is
net-supported (:func:`net_supported`: a clear majority reproduced, few contradicted); the rest
is its *residual*: how many, the batch features they share, and one of them as a
counterexample of its own. Otherwise the check is unexplained and the combination only its
closest lead. Behavioural deviations (input mutation, nondeterminism, padding leaks) are
recognised by the check that shows them alone; a padding leak only where some padding made
the loss, or the gradient at any position, NaN/inf (:func:`padding_leak`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace

from msgspec import UNSET

from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
    LOSS_EFFECTS,
    VARIANTS,
    Deviation,
    loss_effects,
    variant,
)
from m2po_oracle.explain.evidence import Examples, Judge, Reading, RunnerFacts, in_order, merge
from m2po_oracle.explain.explanation import Explanation, search
from m2po_oracle.explain.padding import (
    PaddingLeak,
    padding_leak,
    padding_reader,
    reads_padding,
)
from m2po_oracle.explain.record import Diagnosis, Finding, Hint, Lead, Match, Share
from m2po_oracle.explain.shares import (
    CONTRADICTION_BOUND,
    NAMED_SHARE,
    Left,
    Measured,
    held_out_text,
    named,
    net_supported,
    residuals_of,
    share_of,
    share_text,
)
from m2po_oracle.judge.checks import result_field

#: The deviations whose every failure is the rounding of a narrower dtype, and the option that accepts it.
PRECISION_OPTIONS = {"float32_selection": "--compute-dtype float32", "float32_metrics": "--compute-dtype float32"}


#: Held-out failing examples the sample's explanation leaves unreproduced before half of them
#: join the sample for a second search (two: one moved in, one left to judge it on).
WIDEN_AT_LEAST = 2


#: A runner that knows nothing beyond its single examples.
RUNNER_FACTS = RunnerFacts()


def diagnose(
    examples: Examples,
    reading: Reading,
    *,
    divergent: bool,
    runner: RunnerFacts = RUNNER_FACTS,
    findings: Sequence[Finding] = (),
    prefer: frozenset[str] = frozenset(),
) -> Diagnosis:
    """The diagnosis of a run (its JSON schema in ``report``): the search runs on
    ``examples.sample``, the shares count it and ``examples.held_out``; ``runner``'s step
    variants explain a check ahead of a single-batch deviation; ``prefer``: the deviations
    the user accepts, listed first among explanations the examples cannot tell apart."""
    dtype, compute_dtype, supplied = reading.dtype, reading.compute_dtype, reading.supplied
    step_explanations, step_descriptions, step_source = runner.step_explanations, runner.step_descriptions, runner.step_source
    replay, leaks_alone, call_failure_taus = runner.replay, runner.leaks_alone, examples.call_failure_taus
    observations = list(examples.sample) + list(examples.held_out)
    sample = len(examples.sample)
    failed = list(dict.fromkeys(examples.failed_checks))
    # examples_searched: the sample the search and the leads ran on; examples_compared: every
    # observation the shares count (the sample and the failing examples beyond it).
    if not divergent:
        return Diagnosis("not_needed", examples_compared=len(observations), examples_searched=sample, findings=tuple(findings))
    judge = Judge(
        observations, dtype=dtype, compute_dtype=compute_dtype, supplied=supplied, sample=sample, keep_inferred=reading.keep_inferred
    )
    output_variants = [v.name for v in VARIANTS if v.name != "algorithm_1" and not v.is_behavioural]
    explanation = search(judge, output_variants) if observations else Explanation((), 0, 0)
    judge, explanation = second_search(judge, explanation, output_variants)
    sample = len(judge.sample)
    if explanation.alternatives:
        # Of equally small explanations: one that also reproduces the port under the padding
        # probes (it reads padding, e.g. column 0's advantage) explains more than a leak; then
        # the one naming the deviations the project accepts (the examples cannot tell them apart).
        # Then, of those still tied, the one that reproduces more of every example: the search
        # chose their size and values on its sample alone, which cannot tell them apart.
        pads = "padding_immunity" in failed
        overall = {names: judge.score_all(merge(names) or ALGORITHM_1) for names in [explanation.components, *explanation.alternatives]}
        ranked = sorted(
            overall,
            key=lambda names: (pads and not reads_padding(judge, names), -len({variant(n).base for n in names} & prefer), -overall[names]),
        )
        # Alternatives the examples tell apart (another overall score) are no alternatives.
        ranked = [ranked[0]] + [r for r in ranked[1:] if overall[r] == overall[ranked[0]]]
        explanation = replace(explanation, components=ranked[0], alternatives=ranked[1:])
    dev = merge(explanation.components) or ALGORITHM_1

    by_check: dict[str, list[str]] = {}
    shares: dict[str, Share] = {}
    left: dict[str, Left] = {}  # a named check's residual: what its explanation does not reproduce
    unexplained: list[str] = []
    step_explanations = step_explanations or {}
    step_choice, step_alternatives = _cover(step_explanations, list(step_descriptions or {}))
    closest_by_check: dict[str, Share] = {}
    unexplained_left: dict[str, Left] = {}
    leak: PaddingLeak | None = None
    measured: dict[str, Measured | None] = {}
    for check in failed:
        if check in step_choice:
            by_check[check] = [step_choice[check]]
            continue
        behavioural = [v.name for v in VARIANTS if v.behaviour_check == check and v.behaviour_check != "call"]
        if check == "call" and call_failure_taus and all(t == 0 for t in call_failure_taus):
            behavioural = ["fails_at_zero_budget"]  # every call that raised had tau == 0, and only such calls raised
        name = result_field(check)
        if check == "padding_immunity":
            reads = padding_reader(judge, explanation.components)
            if reads:  # the explanation reproduces the port under every padding it changed with
                by_check[check] = reads
                continue
            leak = padding_leak(judge.observations, leaks_alone)
            if leak is None:
                behavioural = []  # a NaN leak is named only where some padding made the result NaN/inf
        if behavioural:
            by_check[check] = behavioural
            continue
        # Without an explanation every failing example is the residual (Algorithm 1 reproduces none).
        measured[check] = share_of(judge, dev, name, check) if name is not None else None
    # A check too rare to hold any failing example out takes only deviations a name already
    # holds on held-out examples of another check: no name rests on in-sample evidence alone.
    validated: set[str] = set()
    for check, m in measured.items():
        if m is not None and named(m):
            by_check[check] = _responsible(judge, explanation.components, m.field_name, m.reproduced)
            validated.update(by_check[check])
    for check, m in measured.items():
        if check not in by_check and m is not None and m.held_out is None and net_supported(m):
            responsible = _responsible(judge, explanation.components, m.field_name, m.reproduced)
            if set(responsible) <= validated:
                by_check[check] = responsible
        if check in by_check and m is not None:
            shares[check] = m.share(tuple(by_check[check]))
            if m.residual:
                left[check] = Left(m.residual, tuple(by_check[check]))
            continue
        unexplained.append(check)
        if m is not None and m.explained:
            closest_by_check[check] = m.share(explanation.components)
        if m is not None and m.residual:  # what its failing examples share, though nothing known explains them
            unexplained_left[check] = Left(m.residual, explanation.components)
    by_check = {check: by_check[check] for check in failed if check in by_check}  # in the order of the failing checks

    residuals = residuals_of(judge, left, compute_dtype or dtype, replay) + residuals_of(
        judge, unexplained_left, compute_dtype or dtype, replay, unexplained=True
    )
    components = list(dict.fromkeys(n for names in by_check.values() for n in names))
    # An adapter that builds the loss and gradient itself leaves what a deviation does to
    # them unobserved: the evidence says so rather than let its description claim it.
    unseen_loss = supplied is not None and not ({"loss", "grad"} & supplied)
    matches = []
    for name in components:
        explained = tuple(c for c, names in by_check.items() if name in names)
        known = _known(name)
        if known is not None:
            counted = [shares[c] for c in explained if c in shares]
            evidence = (
                f"every one of the {len(call_failure_taus)} calls that raised had tau == 0"
                if known.behaviour_check == "call"
                else (
                    leak.text if leak is not None else "NaN/inf padding made the loss or gradient NaN/inf (check padding_immunity failed)"
                )
                if known.behaviour_check == "padding_immunity"
                else f"check {known.behaviour_check} failed"
                if known.is_behavioural
                else "reproduces "
                + "; ".join(f"{c}{_together(name, shares[c])} on {share_text(shares[c])}" for c in explained if c in shares)
                if counted
                else f"reproduces the port under the padding probes ({', '.join(explained)})"
            )
            unobserved = loss_effects(known.deviation) if unseen_loss and not known.is_behavioural else []
            if unobserved:
                evidence += f"; not observed: {', '.join(unobserved)} (the adapter builds the loss and gradient)"
            matches.append(Match(name, known.description, known.source, evidence, explained, tuple(unobserved)))
        else:
            matches.append(Match(name, (step_descriptions or {}).get(name, ""), step_source, "reproduces every failing step", explained))
    partial = any(share.share < 1 for share in shares.values())
    alternatives = explanation.alternatives + step_alternatives
    status = "no_known_variant" if not by_check else "partly_explained" if unexplained else "mostly_explained" if partial else "matched"
    return Diagnosis(
        status,
        examples_compared=len(observations),
        examples_searched=sample,
        components=tuple(components),
        by_check={check: tuple(names) for check, names in by_check.items()},
        shares=shares,
        residuals=tuple(residuals),
        unexplained=tuple(unexplained),
        matches=tuple(matches),
        alternatives=tuple(tuple(a) for a in alternatives),
        # Why equally small explanations stand side by side: only where some do.
        alternatives_reason=_why_alike(explanation, unseen_loss) if alternatives else UNSET,
        # Leads only where a check is unexplained: beside a full or majority explanation, single
        # variants that each reproduce a few examples only distract from it and its residual.
        closest=tuple(_closest(judge, output_variants, set(components), closest_by_check)) if unexplained else (),
        findings=tuple(findings),
        hints=tuple(_hints(by_check)),
        summary=summary(status, by_check, unexplained, shares),
        padding_leak=leak if leak is not None and "nan_padding_leak" in components else None,
    )


#: Why equally small explanations stand side by side, unless something more precise holds.
ALIKE = "the examples do not tell them apart"


def _together(name: str, share: Share) -> str:
    """A share counts what the check's whole explanation reproduces: where that is more than
    this one deviation, its evidence says with which others, not as its own figure."""
    others = [c for c in share.components if c != name]
    return f" (together with {' + '.join(others)})" if others else ""


def _why_alike(explanation: Explanation, unseen_loss: bool) -> str:
    """Equally small explanations that differ only in what they do to a loss and gradient
    the adapter built cannot be told apart by any example: say so."""
    chosen = merge(explanation.components)
    if not unseen_loss or chosen is None or not explanation.alternatives:
        return ALIKE
    for alternative in explanation.alternatives:
        other = merge(alternative)
        if other is None:
            return ALIKE
        differing = {f.name for f in fields(Deviation) if getattr(chosen, f.name) != getattr(other, f.name)}
        if not differing <= set(LOSS_EFFECTS):
            return ALIKE
    return "they differ only in the loss and gradient, which the adapter builds"


def _known(name: str):
    try:
        return variant(name)
    except ValueError:  # a step-level variant (distributed, trainer)
        return None


def _cover(explanations: dict[str, set[str]], order: list[str]) -> tuple[dict[str, str], list[tuple[str, ...]]]:
    """Each step variant reproduces the failing steps of some checks by itself: the fewest
    of them that cover every check (greedily, most checks first, then the runner's order),
    each check -> its variant, and the variants that cover exactly as much as a chosen one."""
    rank = {name: i for i, name in enumerate(order)}
    remaining = {check: names for check, names in explanations.items() if names}
    everyone = sorted(set().union(*remaining.values()), key=lambda n: (rank.get(n, len(rank)), n)) if remaining else []
    covers = {name: {c for c, names in remaining.items() if name in names} for name in everyone}
    choice: dict[str, str] = {}
    chosen: list[str] = []
    while len(choice) < len(remaining):
        best = max(everyone, key=lambda n: (len(covers[n] - set(choice)), -everyone.index(n)))
        chosen.append(best)
        for check in covers[best] - set(choice):
            choice[check] = best
    alternatives: list[tuple[str, ...]] = [
        (n,) for n in everyone if n not in chosen and any(covers[n] == {c for c, v in choice.items() if v == m} for m in chosen)
    ]
    return choice, alternatives


def unreproduced_held_out(judge: Judge, dev: Deviation) -> list[int]:
    """The held-out examples (beyond the search's sample) with a failing check whose field
    ``dev`` does not reproduce, in the order the run met them."""
    left = []
    for i in range(len(judge.observations)):
        checked = {result_field(c) for c in judge.observations[i].failed} & judge.fields[i]
        if judge.held_out(i) and checked & set(judge.differences(dev, i)):
            left.append(i)
    return left


def _held_out_score(judge: Judge, dev: Deviation) -> int:
    """The (observation, field) pairs beyond the search's sample that ``dev`` reproduces."""
    held = [i for i in range(len(judge.observations)) if judge.held_out(i)]
    return sum(len(judge.fields[i]) - len(judge.differences(dev, i)) for i in held)


def second_search(judge: Judge, explanation: Explanation, candidates: Sequence[str]) -> tuple[Judge, Explanation]:
    """A second search where the sample missed what the held-out examples show.

    The sample holds the run's first failing examples; a deviation that acts only on inputs
    met later (a float32 clip bound at a dyadic breakpoint) leaves held-out failing examples
    unreproduced that no sample example resembles, and no search on the sample can name it.
    Then every other such example (the first, third, ...) joins the sample and the search
    runs again; the rest stay held out. The second explanation replaces the first only when
    it reproduces more of the examples still held out, where neither was chosen: a deviation
    fitted to the examples moved in, and to nothing beyond them, leaves the first standing."""
    left = unreproduced_held_out(judge, merge(explanation.components) or ALGORITHM_1)
    if len(left) < WIDEN_AT_LEAST:
        return judge, explanation
    wider = judge.widened(left[::2])
    second = search(wider, candidates)
    before = _held_out_score(wider, merge(explanation.components) or ALGORITHM_1)
    if _held_out_score(wider, merge(second.components) or ALGORITHM_1) > before:
        return wider, second
    return judge, explanation


def _responsible(judge: Judge, components: tuple[str, ...], field_name: str, reproduced: list[int]) -> list[str]:
    """The fewest of ``components`` that still reproduce the check's reproduced failing
    examples, each of them necessary (without it fewer are reproduced)."""
    needed = list(components)
    changed = True
    while changed:
        changed = False
        for name in sorted(needed, key=lambda n: -in_order(n)):
            rest = [n for n in needed if n != name]
            dev = merge(rest) if rest else ALGORITHM_1
            if dev is not None and len(judge.reproduced(dev, field_name, reproduced)) == len(reproduced):
                needed, changed = rest, True
                break
    return needed or list(components)


def _closest(judge: Judge, names: Sequence[str], exclude: set[str], by_check: dict[str, Share]) -> list[Lead]:
    """Leads for what is unexplained: the explanation's share on each check below the
    threshold, then the single variants that agree on the most divergent examples."""
    rows = [
        Lead(
            " + ".join(c.components),
            f"reproduces {check} on {c.explained} of {c.failing} failing examples"
            + (f" and contradicts {c.contradicted}" if c.contradicted else "")
            + f" ({held_out_text(c.held_out)})"
            + f": short of the naming rule (at least {NAMED_SHARE:.0%} "
            f"of the failing examples, at most {CONTRADICTION_BOUND:g} contradicted per reproduced one, "
            "on every example and on the held-out ones alone)",
            "",
            c.explained,
            c.of,
            "",
            check=check,
        )
        for check, c in by_check.items()
    ]
    divergent = [i for i in judge.sample if judge.differences(ALGORITHM_1, i)]
    singles: list[Lead] = []
    for name in names:
        if name in exclude:
            continue
        known = variant(name)
        agreed = [i for i in divergent if not judge.differences(known.deviation, i)]
        if not agreed:
            continue
        first = next((judge.differences(known.deviation, i) for i in divergent if judge.differences(known.deviation, i)), {})
        singles.append(Lead(name, known.description, known.source, len(agreed), len(divergent), next(iter(first.values()), "")))
    singles.sort(key=lambda r: -r.agreed)
    return rows + singles[:3]


def _hints(by_check: dict[str, list[str]]) -> list[Hint]:
    hints = []
    precision = [c for c, names in by_check.items() if names and set(names) <= set(PRECISION_OPTIONS)]
    if precision:
        hints.append(
            Hint(
                tuple(precision),
                f"every failure of {', '.join(precision)} fits the rounding of float32 arithmetic",
                "--compute-dtype float32",
            )
        )
    epsilon = [c for c, names in by_check.items() if names == ["denominator_epsilon"]]
    if epsilon:
        hints.append(
            Hint(
                tuple(epsilon),
                f"every failure of {', '.join(epsilon)} fits an epsilon of 1e-8 in the denominator "
                "(N + 1e-8: a relative change of 1e-8 / N, below float32's tolerance)",
                "--dtype float32",
            )
        )
    return hints


def summary(status: str, by_check: dict[str, list[str]], unexplained: list[str], shares: dict[str, Share] | None = None) -> str:
    """One line: "mostly explained: loss, gradient by clamped_log_ratio (281 of 300); metrics.m2_after unexplained"."""
    shares = shares or {}
    groups: dict[tuple[str, ...], list[str]] = {}
    names: Sequence[str]  # a check's variants, then a group's
    for check, names in by_check.items():
        groups.setdefault(tuple(names), []).append(check)
    parts = []
    for names, checks in groups.items():
        partial = [c for c in checks if c in shares and shares[c].share < 1]
        counts = [f"{shares[c].explained} of {shares[c].of}" + (f" for {c}" if len(checks) > 1 else "") for c in partial]
        parts.append(f"{', '.join(checks)} by {' + '.join(names)}" + (f" ({', '.join(counts)})" if counts else ""))
    if unexplained:
        parts.append(f"{', '.join(unexplained)} unexplained")
    lead = {
        "matched": "explained",
        "mostly_explained": "mostly explained",
        "partly_explained": "partly explained",
        "no_known_variant": "no known deviation explains it",
    }.get(status, status)
    return f"{lead}: {'; '.join(parts)}" if parts else lead
