"""Known ways an M2PO port deviates from Algorithm 1, as data (torch-free).

A :class:`Deviation` is a set of knobs whose defaults are Algorithm 1. The same knobs
drive the planted torch controls (``controls``) and the NumPy variants of the oracle that
diagnosis compares an implementation with (``variants``): two independent realisations
of every deviation, which ``m2po-oracle selftest`` checks against each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

CANDIDATE_SETS = (
    "trust_region",
    "all_valid",
    "swapped_quadrants",
    "zero_advantage_included",
    "first_token_sign",
    "column0_sign",
    "none",
)
#: The loss's normaliser. The first four divide the masked sum by one count (N, the kept
#: count, B*T, N + epsilon); the rest are the frameworks' per-row aggregations (spec
#: section 5), with n_i the valid tokens of row i and S_i the masked sum of row i:
#: seq_mean_token_sum: mean over rows with n_i > 0 of S_i (verl; empty rows dropped);
#: seq_mean_token_mean: mean over rows with n_i > 0 of S_i / (n_i + 1e-8) (verl);
#: seq_mean_token_sum_norm: sum over rows of S_i / (rows with n_i > 0 * T) (verl, Dr.GRPO);
#: row_mean_empty_as_one: mean over ALL rows of S_i / max(n_i, 1) (TRL's grpo);
#: valid_empty_rows_as_one: sum(S) / sum_i max(n_i, 1) (an empty row counts as one token).
DENOMINATORS = (
    "valid",
    "kept",
    "padded",
    "valid_epsilon",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "row_mean_empty_as_one",
    "valid_empty_rows_as_one",
)
#: How the budget acts: Algorithm 1's mask, or (algorithm.md §4) a ratio clip range from a
#: cap on d^2 at the breakpoint below the exact cap (the authors' release) or at the exact
#: water-filling cap (the verl pull request).
SELECTION_KINDS = ("mask", "clip_below", "clip_exact")
PRECISIONS = ("float64", "float32")
#: The epsilon verl's token-mean adds to the denominator (algorithm.md §4, fact 6).
DENOMINATOR_EPSILON = 1e-8


def knob(
    default: Any,
    *,
    selection: bool = False,
    objective: bool = False,
    loss_effect: str | None = None,
    shown_by: str | None = None,
    mask_only: bool = False,
    silences_kept: bool = False,
) -> Any:
    """A knob of :class:`Deviation` with its roles, declared once: ``selection`` (it shapes the
    mask), ``objective`` (it shapes loss, gradient and metrics on a given mask), ``loss_effect``
    (what it changes in the loss or gradient beyond which tokens are kept: unobserved where an
    adapter builds the loss), ``shown_by`` (a behavioural deviation: the one check that shows
    it), ``mask_only`` (it belongs to the mask selection and means nothing for a clip range),
    ``silences_kept`` (it zeroes the gradient of some kept tokens: where an adapter reads the
    mask from zero gradients, those tokens read as removed though the selection kept them).
    A knob that is none of selection, objective or behavioural would be judged by a memo that
    ignores it."""
    return field(
        default=default,
        metadata={
            "selection": selection,
            "objective": objective,
            "loss_effect": loss_effect,
            "shown_by": shown_by,
            "mask_only": mask_only,
            "silences_kept": silences_kept,
        },
    )


@dataclass(frozen=True)
class Deviation:
    """Knobs of a deviating M2PO; the defaults are Algorithm 1."""

    candidates: str = knob("trust_region", selection=True)  # see CANDIDATE_SETS (column0_sign: the sign of A[:, 0], padding or not)
    strict_stop: bool = knob(False, selection=True, mask_only=True)  # keep while mean < tau (instead of <=)
    mean_over_valid: bool = knob(False, selection=True, mask_only=True)  # budget mean over remaining valid tokens, non-candidates included
    scope_rows: int | None = knob(
        None, selection=True, mask_only=True
    )  # select within groups of this many rows (1: per sequence; None: whole batch)
    extra_removed: int = knob(0, selection=True, mask_only=True)  # remove this many more than needed whenever any is removed
    min_kept: int = knob(0, selection=True, mask_only=True)  # never remove the last min_kept candidates (AReaL/slime keep the smallest)
    denominator: str = knob(
        "valid", objective=True, loss_effect="the loss's normaliser"
    )  # see DENOMINATORS (valid_epsilon: N + denominator_epsilon)
    denominator_epsilon: float = knob(DENOMINATOR_EPSILON, objective=True)  # the epsilon of valid_epsilon (a port picks its own)
    candidate_margin: float = knob(
        0.0, selection=True, mask_only=True
    )  # candidates need A > m and d > m (or A < -m, d < -m): a port's 1e-12 margin
    noop_margin: float = knob(0.0, selection=True, mask_only=True)  # nothing is removed while the candidates' mean M2 <= tau + this margin
    statistic_over_padding: bool = knob(
        False, selection=True, mask_only=True
    )  # M2 and candidates over every position: a kernel handed no mask
    budget_scale: float = knob(1.0, selection=True, objective=True)  # the budget the selection compares with is tau * this
    clip_bound_float32: bool = knob(
        False, selection=True, objective=True
    )  # clip kinds: the ratio range [exp(-c), exp(c)] computed in float32 from c rounded to float32
    ppo_clip: float | None = knob(
        None, objective=True, loss_effect="PPO's clip on kept tokens", mask_only=True, silences_kept=True
    )  # PPO's epsilon-clip still applied to kept tokens
    ratio_inverted: bool = knob(
        False, selection=True, objective=True, loss_effect="the inverted ratio in the loss"
    )  # d = behavior_logp - logp
    apply_mask: bool = knob(
        True, objective=True, loss_effect="whether the mask reaches the loss", mask_only=True
    )  # False: mask computed, then not applied to the loss
    masked_keep_value: bool = knob(
        False, objective=True, loss_effect="masked tokens keeping their loss value (zero gradient)", mask_only=True
    )  # masked tokens keep their loss value, zero gradient
    zero_padding_by_multiplying: bool = knob(False, shown_by="padding_immunity")  # keep * term instead of where(): 0 * nan = nan
    padding_through_where: bool = knob(
        False, shown_by="padding_immunity"
    )  # raw inputs, padding dropped by where() at the end: 0 * nan in its backward
    clamp_log_ratio: float | None = knob(
        None, selection=True, objective=True, loss_effect="the clamp of d in the loss"
    )  # clamp of d (straight-through unless hard_clamp)
    hard_clamp: bool = knob(
        False, objective=True, loss_effect="the clamp's zero gradient", silences_kept=True
    )  # the clamp is a real clamp: kept tokens beyond it get zero gradient
    clamp_only_in_loss: bool = knob(
        False, selection=True, objective=True
    )  # the clamp acts in the loss only: selection and metrics see the raw d
    selection_kind: str = knob(
        "mask", selection=True, objective=True, loss_effect="clipped tokens keeping their clipped value (zero gradient)"
    )  # see SELECTION_KINDS
    clip_floors: tuple[float, float] | None = knob(
        None, selection=True, objective=True
    )  # clip kinds: the range is never tighter than [1 - low, 1 + high]
    unconstrained_ratio_bound: float = knob(
        math.inf, selection=True, objective=True
    )  # clip kinds: the ratio's upper bound where no cap applies (ports return 1e5)
    selection_dtype: str = knob("float64", selection=True)  # the dtype of the selection arithmetic (d, d^2, prefix means)
    metrics_dtype: str = knob("float64", objective=True)  # the dtype the logged metrics are computed in
    loss_dtype: str = knob(
        "float64", objective=True, loss_effect="the loss and gradient in float32", silences_kept=True
    )  # the dtype of the loss's arithmetic (exp(d) * A, its sum and gradient)
    sanitise_inputs_in_place: bool = knob(False, shown_by="inputs_not_mutated")  # writes 0 into the caller's padding
    m2_after_over_valid: bool = knob(False, objective=True, mask_only=True)  # metric: mean M2 over every kept valid token
    random_tie_break: bool = knob(False, shown_by="determinism", mask_only=True)  # ties at the cut broken by fresh random noise
    fails_at_zero_budget: bool = knob(
        False, shown_by="call"
    )  # raises on tau == 0 (the release unpacks a bare float: algorithm.md §4, fact 3)

    def __post_init__(self) -> None:
        if self.candidates not in CANDIDATE_SETS:
            raise ValueError(f"candidates: expected one of {CANDIDATE_SETS}, got {self.candidates!r}")
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"denominator: expected one of {DENOMINATORS}, got {self.denominator!r}")
        if self.selection_kind not in SELECTION_KINDS:
            raise ValueError(f"selection_kind: expected one of {SELECTION_KINDS}, got {self.selection_kind!r}")
        for name in ("selection_dtype", "metrics_dtype", "loss_dtype"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name}: expected one of {PRECISIONS}, got {getattr(self, name)!r}")
        if self.scope_rows is not None and self.scope_rows < 1:
            raise ValueError(f"scope_rows: expected None or an int >= 1, got {self.scope_rows!r}")
        for name in ("denominator_epsilon", "candidate_margin", "noop_margin"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value == value):
                raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
        if not (isinstance(self.budget_scale, (int, float)) and self.budget_scale > 0):
            raise ValueError(f"budget_scale: expected a number > 0, got {self.budget_scale!r}")
        if not (isinstance(self.unconstrained_ratio_bound, (int, float)) and self.unconstrained_ratio_bound > 1):
            raise ValueError(f"unconstrained_ratio_bound: expected a number > 1 (inf: none), got {self.unconstrained_ratio_bound!r}")
        if self.clip_floors is not None and not (len(self.clip_floors) == 2 and all(f >= 0 for f in self.clip_floors)):
            raise ValueError(f"clip_floors: expected None or a pair (low, high) of numbers >= 0, got {self.clip_floors!r}")


ALGORITHM_1 = Deviation()


def _knobs(role: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(Deviation) if f.metadata[role])


#: The knobs that shape the mask; the rest shape only loss, gradient and metrics.
SELECTION_KNOBS = _knobs("selection")
#: The knobs that shape loss, gradient and metrics on a given mask.
OBJECTIVE_KNOBS = _knobs("objective")
#: Knobs of the mask selection that mean nothing for a clip range (selection_kind != "mask").
MASK_ONLY_KNOBS = _knobs("mask_only")
#: What each knob changes in the loss or its gradient beyond which tokens are kept: a
#: diagnosis of a port whose adapter builds the loss and gradient (mask_only,
#: mask_function) has not observed it, whatever the variant's description says.
LOSS_EFFECTS = {f.name: f.metadata["loss_effect"] for f in fields(Deviation) if f.metadata["loss_effect"]}
#: Knobs that zero some kept tokens' gradient (PPO's clip, a hard clamp, float32 underflow).
SILENCING_KNOBS = _knobs("silences_kept")
#: Deviations visible only in behaviour, not in the values computed, by the check that shows them.
BEHAVIOURAL = {f.name: f.metadata["shown_by"] for f in fields(Deviation) if f.metadata["shown_by"]}


def loss_effects(deviation: Deviation) -> list[str]:
    """The effects on the loss and gradient (``LOSS_EFFECTS``) of the knobs ``deviation`` sets."""
    return list(dict.fromkeys(words for knob, words in LOSS_EFFECTS.items() if getattr(deviation, knob) != getattr(ALGORITHM_1, knob)))


@dataclass(frozen=True)
class Variant:
    """A named deviation the diagnosis can recognise."""

    name: str
    description: str
    source: str
    deviation: Deviation
    behaviour_check: str | None = None  # set for deviations only a behavioural check can see
    parameter: str | None = None  # the knob whose value a port picks itself: fitted from the data, carried in the name
    acts_with: tuple[str, ...] = ()  # variants without which this one changes nothing (floors need a clip kind)

    @property
    def is_behavioural(self) -> bool:
        return self.behaviour_check is not None

    @property
    def base(self) -> str:
        """The name without a fitted value: ``clip_floors(0.2, 0.28)`` -> ``clip_floors``."""
        return self.name.split("(", 1)[0]


def _variant(
    name: str, description: str, source: str, *, parameter: str | None = None, acts_with: tuple[str, ...] = (), **knobs
) -> Variant:
    deviation = replace(ALGORITHM_1, **knobs)
    behavioural = [BEHAVIOURAL[k] for k in knobs if k in BEHAVIOURAL]
    return Variant(name, description, source, deviation, behavioural[0] if behavioural else None, parameter, acts_with)


#: Where a deviation was seen: a section of docs/explanation/algorithm.md, which the
#: report's source column cites.
DOC = "docs/explanation/algorithm.md"
SPEC = f"{DOC} §3"
PLAUSIBLE = "plausible port bug"
CLIP = f"{DOC} §4"
AGG = f"{DOC} §5"

VARIANTS: tuple[Variant, ...] = (
    _variant("algorithm_1", "Algorithm 1 itself", f"{DOC} §1"),
    _variant("all_valid_candidates", "every valid token is a candidate", f"{SPEC} (AReaL, slime)", candidates="all_valid"),
    _variant(
        "swapped_quadrants",
        "candidates are the inactive quadrants (A > 0 & d < 0, A < 0 & d > 0)",
        PLAUSIBLE,
        candidates="swapped_quadrants",
    ),
    _variant("zero_advantage_candidate", "A == 0 with d > 0 counted as a candidate", PLAUSIBLE, candidates="zero_advantage_included"),
    _variant(
        "first_token_advantage_sign",
        "advantage sign taken from each row's first valid token",
        f"{SPEC} (authors' release)",
        candidates="first_token_sign",
    ),
    _variant(
        "never_removes",
        "the selection never removes a token: every valid token is kept (the selection is not run, or finds no candidate)",
        PLAUSIBLE,
        candidates="none",
    ),
    _variant("strict_stop", "stops only when the mean is < tau: equality keeps removing", f"{SPEC} (AReaL, SkyRL fork)", strict_stop=True),
    _variant(
        "mean_over_valid", "budget mean over remaining valid tokens, non-candidates included", f"{SPEC} (SkyRL fork)", mean_over_valid=True
    ),
    _variant("per_sequence_selection", "selection run per sequence instead of per optimizer batch", PLAUSIBLE, scope_rows=1),
    _variant("micro_batch_selection_2", "selection run per micro-batch of 2 rows", f"{SPEC} (micro-batch scope)", scope_rows=2),
    _variant("micro_batch_selection_4", "selection run per micro-batch of 4 rows", f"{SPEC} (micro-batch scope)", scope_rows=4),
    _variant("one_extra_removed", "off by one: removes one more token than needed", PLAUSIBLE, extra_removed=1),
    _variant(
        "keeps_smallest_candidate", "never removes the last (smallest) candidate", f"{SPEC} (AReaL: keeps the smallest token)", min_kept=1
    ),
    _variant(
        "kept_count_denominator", "loss divided by the kept-token count instead of N before masking", f"{SPEC} (AReaL)", denominator="kept"
    ),
    _variant("padded_denominator", "loss divided by B*T, padding included", PLAUSIBLE, denominator="padded"),
    _variant("ppo_clip_still_applied", "PPO epsilon-clip (0.2) still applied to kept tokens", PLAUSIBLE, ppo_clip=0.2),
    _variant("ratio_inverted", "log ratio taken as behavior_logp - logp", PLAUSIBLE, ratio_inverted=True),
    _variant("mask_not_applied", "mask computed but the loss sums every valid token", f"{SPEC} (slime PR)", apply_mask=False),
    _variant(
        "masked_keep_value",
        "masked tokens keep their loss value (zero gradient only)",
        f"{SPEC} (authors' release, verl clip PR)",
        masked_keep_value=True,
    ),
    _variant(
        "clamped_log_ratio",
        "straight-through clamp of d to +-{0}",
        f"{SPEC} (ms-swift, Trinity-RFT guard)",
        clamp_log_ratio=20.0,
        parameter="clamp_log_ratio",
    ),
    _variant(
        "loss_clamped_log_ratio",
        "straight-through clamp of d to +-{0} in the loss only (the selection and metrics see the raw d)",
        f"{SPEC} (ms-swift and Trinity-RFT, as their code does it)",
        clamp_log_ratio=20.0,
        clamp_only_in_loss=True,
        parameter="clamp_log_ratio",
    ),
    _variant("m2_after_over_valid", "m2_after averaged over every kept valid token", PLAUSIBLE, m2_after_over_valid=True),
    _variant(
        "areal",
        "AReaL: all valid tokens, strict stop, keeps the smallest token, kept-count denominator",
        SPEC,
        candidates="all_valid",
        strict_stop=True,
        min_kept=1,
        denominator="kept",
    ),
    _variant("skyrl_fork", "SkyRL fork: strict stop, mean over remaining valid tokens", SPEC, strict_stop=True, mean_over_valid=True),
    _variant(
        "slime_pr",
        "slime PR: all valid tokens, strict stop, keeps one, mask never applied",
        SPEC,
        candidates="all_valid",
        strict_stop=True,
        min_kept=1,
        apply_mask=False,
    ),
    _variant(
        "nan_padding_leak",
        "NaN/inf padding reaches the loss or the gradient: zeroed by multiplying with the mask (0 * nan = nan), "
        "or dropped by torch.where, whose backward multiplies the untaken branch's zero gradient by its NaN/inf derivative",
        PLAUSIBLE,
        zero_padding_by_multiplying=True,
    ),
    _variant("mutates_inputs", "writes into the caller's input tensors", PLAUSIBLE, sanitise_inputs_in_place=True),
    _variant("random_tie_break", "nondeterministic: ties at the cut broken at random on each call", PLAUSIBLE, random_tie_break=True),
    # algorithm.md §4: the clip family and the deviations real ports combine.
    _variant(
        "authors_release_clip",
        "a ratio clip range instead of a mask, capped at the d^2 breakpoint below the budget (tokens beyond it keep "
        "their clipped value, zero gradient)",
        f"{CLIP} (authors' release)",
        selection_kind="clip_below",
    ),
    _variant(
        "water_filling_clip",
        "a ratio clip range instead of a mask, at the exact water-filling cap (capped mean = budget)",
        f"{CLIP} (open verl pull request)",
        selection_kind="clip_exact",
    ),
    _variant(
        "clip_floors",
        "the clip range is never tighter than [1 - {0}, 1 + {1}] (miniclip floors)",
        f"{CLIP} (authors' release)",
        clip_floors=(0.3, 0.5),
        parameter="clip_floors",
        acts_with=("authors_release_clip", "water_filling_clip"),
    ),
    _variant(
        "column0_advantage_sign",
        "candidates take the advantage sign of column 0 of each row, padding or not",
        f"{CLIP} (authors' release)",
        candidates="column0_sign",
    ),
    _variant(
        "denominator_epsilon",
        "loss divided by N + {0} (verl's token-mean)",
        f"{CLIP} (verl token-mean)",
        denominator="valid_epsilon",
        parameter="denominator_epsilon",
    ),
    _variant(
        "hard_clamped_log_ratio",
        "hard clamp of d to +-{0}: kept tokens beyond it get zero gradient",
        CLIP,
        clamp_log_ratio=20.0,
        hard_clamp=True,
        parameter="clamp_log_ratio",
    ),
    _variant(
        "loss_hard_clamped_log_ratio",
        "hard clamp of d to +-{0} in the loss only: kept tokens beyond it get zero gradient (the selection and metrics see the raw d)",
        f"{CLIP} (Trinity-RFT, an early head)",
        clamp_log_ratio=20.0,
        hard_clamp=True,
        clamp_only_in_loss=True,
        parameter="clamp_log_ratio",
    ),
    _variant("float32_selection", "selection arithmetic (d, d^2, prefix means) in float32", CLIP, selection_dtype="float32"),
    _variant("float32_metrics", "logged metrics computed in float32", CLIP, metrics_dtype="float32"),
    _variant(
        "float32_loss",
        "loss and gradient computed in float32 (exp(d) * A, its sum and its gradient; a tiny product underflows to 0)",
        f"{CLIP} (ms-swift, Trinity-RFT: the policy's float32 log-probs)",
        loss_dtype="float32",
    ),
    # algorithm.md §5: the frameworks' loss aggregations, which ports inherit from the trainer's configuration.
    _variant(
        "seq_mean_token_sum",
        "loss = mean over non-empty rows of each row's masked sum (verl seq-mean-token-sum)",
        AGG,
        denominator="seq_mean_token_sum",
    ),
    _variant(
        "seq_mean_token_mean",
        "loss = mean over non-empty rows of each row's masked sum / (n_i + 1e-8) (verl seq-mean-token-mean)",
        AGG,
        denominator="seq_mean_token_mean",
    ),
    _variant(
        "seq_mean_token_sum_norm",
        "loss = the rows' masked sums over (non-empty rows * padded length T) (verl seq-mean-token-sum-norm, Dr.GRPO)",
        AGG,
        denominator="seq_mean_token_sum_norm",
    ),
    _variant(
        "trl_grpo_row_mean",
        "loss = mean over ALL rows of each row's masked sum / max(n_i, 1) (TRL loss_type grpo; an empty row counts as a zero)",
        AGG,
        denominator="row_mean_empty_as_one",
    ),
    _variant(
        "empty_rows_count_one",
        "loss divided by sum_i max(n_i, 1): a row without valid tokens counts as one token",
        AGG,
        denominator="valid_empty_rows_as_one",
    ),
    # algorithm.md §4, facts 1-2, seen in mask ports too: margins and a kernel handed no mask.
    _variant(
        "candidate_margin",
        "candidates need |A| > {0} and |d| > {0} (a margin in the trust-region test)",
        f"{CLIP} (fact 1)",
        candidate_margin=1e-12,
        parameter="candidate_margin",
    ),
    _variant(
        "noop_margin",
        "nothing is removed while the candidates' mean M2 <= tau + {0}",
        f"{CLIP} (fact 2)",
        noop_margin=1e-12,
        parameter="noop_margin",
    ),
    _variant(
        "statistic_over_padding",
        "M2 and the candidates over every position, padding included (the kernel is handed no mask)",
        PLAUSIBLE,
        statistic_over_padding=True,
        acts_with=("all_valid_candidates", "mean_over_valid"),
    ),
    _variant(
        "fails_at_zero_budget",
        "raises on a budget of 0 (the release's cap returns a bare float where a pair is unpacked)",
        f"{CLIP} (authors' release, fact 3)",
        fails_at_zero_budget=True,
    ),
    _variant(
        "clip_bound_float32",
        "the clip range's bounds exp(-c), exp(c) computed in float32 (c rounded to float32, then exp)",
        CLIP,
        clip_bound_float32=True,
        acts_with=("authors_release_clip", "water_filling_clip"),
    ),
    _variant(
        "ratio_bound_when_unconstrained",
        "within the budget (or without candidates) the ratio is still clipped at {0}: a token "
        "with A > 0 and r > {0} keeps the bound's value and gets zero gradient",
        f"{CLIP} (authors' release, verl pull requests: 'no clip' returns the range (0, 100000))",
        unconstrained_ratio_bound=1e5,
        parameter="unconstrained_ratio_bound",
        acts_with=("authors_release_clip", "water_filling_clip"),
    ),
    _variant(
        "scaled_budget", "the selection compares with tau * {0} instead of tau", PLAUSIBLE, budget_scale=0.5, parameter="budget_scale"
    ),
)

#: Variants that are only ever found together: strict stop with keep-one (AReaL, slime), a
#: clip kind with the metrics' precision. The search tries each group as one move.
JOINT_MOVES: tuple[tuple[str, ...], ...] = (
    ("strict_stop", "keeps_smallest_candidate"),
    ("authors_release_clip", "float32_metrics"),
    ("water_filling_clip", "float32_metrics"),
)


_BY_NAME = {v.name: v for v in VARIANTS}


def variant(name: str) -> Variant:
    """A known variant by name; a parametric one may carry its value: ``clip_floors(0.2, 0.28)``."""
    base, _, rest = name.partition("(")
    known = _BY_NAME.get(base.strip())
    if known is None:
        raise ValueError(f"variant: unknown name {name!r}; known: {', '.join(v.name for v in VARIANTS)}")
    if not rest:
        return replace(known, description=_described(known, getattr(known.deviation, known.parameter) if known.parameter else None))
    if known.parameter is None or not rest.endswith(")"):
        raise ValueError(f"variant: {name!r}: only {', '.join(v.name for v in VARIANTS if v.parameter)} take a value, as name(value)")
    try:
        values = tuple(float(part) for part in rest[:-1].split(","))
    except ValueError:
        raise ValueError(f"variant: {name!r}: expected numbers in the parentheses") from None
    default = getattr(known.deviation, known.parameter)
    value: Any = values if isinstance(default, tuple) else values[0]  # the parameter field's value, whichever its type
    if isinstance(default, tuple) and len(values) != len(default):
        raise ValueError(f"variant: {name!r}: {known.parameter} takes {len(default)} values")
    deviation = replace(known.deviation, **{known.parameter: value})
    return replace(
        known,
        name=fitted_name(known.name, value) if value != default else known.name,
        deviation=deviation,
        description=_described(known, value),
    )


def fitted_name(base: str, value: object) -> str:
    """The name that carries a fitted value: ``clip_floors(0.2, 0.28)``, ``clamped_log_ratio(10)``."""
    values = value if isinstance(value, tuple) else (value,)
    return f"{base}({', '.join(f'{float(v):g}' for v in values)})"


def _described(known: Variant, value: object) -> str:
    if value is None:
        return known.description
    values = value if isinstance(value, tuple) else (value,)
    return known.description.format(*(f"{float(v):g}" for v in values))


def combine(names: Iterable[str]) -> Deviation | None:
    """The deviation of several variants at once; None where two set one knob differently."""
    knobs: dict[str, Any] = {}  # Deviation field -> its value (each field its own type)
    for name in names:
        dev = variant(name).deviation
        for f in fields(Deviation):
            value = getattr(dev, f.name)
            if value == getattr(ALGORITHM_1, f.name):
                continue
            if f.name in knobs and knobs[f.name] != value:
                return None
            knobs[f.name] = value
    return replace(ALGORITHM_1, **knobs)


@dataclass(frozen=True)
class Accepted:
    """A deviation a project accepts (``[tool.m2po-oracle] accept``, ``--accept``), and why."""

    deviation: str
    reason: str
    link: str = ""
