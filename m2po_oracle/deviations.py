"""Known ways an M2PO port deviates from Algorithm 1, as data (torch-free).

A :class:`Deviation` is a set of knobs whose defaults are Algorithm 1. The same knobs
drive the planted torch controls (``controls``) and the NumPy variants of the oracle that
diagnosis compares an implementation with (``variants``): two independent realisations
of every deviation, which ``m2po-oracle selftest`` checks against each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

CANDIDATE_SETS = ("trust_region", "all_valid", "swapped_quadrants", "zero_advantage_included", "first_token_sign", "column0_sign")
DENOMINATORS = ("valid", "kept", "padded", "valid_epsilon")
#: How the budget acts: Algorithm 1's mask, or (spec section 4) a ratio clip range from a
#: cap on d^2 at the breakpoint below the exact cap (the authors' release) or at the exact
#: water-filling cap (the verl pull request).
SELECTION_KINDS = ("mask", "clip_below", "clip_exact")
PRECISIONS = ("float64", "float32")
#: The epsilon verl's token-mean adds to the denominator (spec section 4, fact 6).
DENOMINATOR_EPSILON = 1e-8


@dataclass(frozen=True)
class Deviation:
    """Knobs of a deviating M2PO; the defaults are Algorithm 1."""

    candidates: str = "trust_region"  # see CANDIDATE_SETS (column0_sign: the sign of A[:, 0], padding or not)
    strict_stop: bool = False  # keep while mean < tau (instead of <=)
    mean_over_valid: bool = False  # budget mean over remaining valid tokens, non-candidates included
    scope_rows: int | None = None  # select within groups of this many rows (1: per sequence; None: whole batch)
    extra_removed: int = 0  # remove this many more than needed whenever any is removed
    min_kept: int = 0  # never remove the last min_kept candidates (AReaL/slime keep the smallest)
    denominator: str = "valid"  # see DENOMINATORS (valid_epsilon: N + DENOMINATOR_EPSILON)
    ppo_clip: float | None = None  # PPO's epsilon-clip still applied to kept tokens
    ratio_inverted: bool = False  # d = behavior_logp - logp
    apply_mask: bool = True  # False: mask computed, then not applied to the loss
    masked_keep_value: bool = False  # masked tokens keep their loss value, zero gradient
    zero_padding_by_multiplying: bool = False  # keep * term instead of where(): 0 * nan = nan
    clamp_log_ratio: float | None = None  # clamp of d (straight-through unless hard_clamp)
    hard_clamp: bool = False  # the clamp is a real clamp: kept tokens beyond it get zero gradient
    selection_kind: str = "mask"  # see SELECTION_KINDS
    clip_floors: tuple[float, float] | None = None  # clip kinds: the range is never tighter than [1 - low, 1 + high]
    selection_dtype: str = "float64"  # the dtype of the selection arithmetic (d, d^2, prefix means)
    metrics_dtype: str = "float64"  # the dtype the logged metrics are computed in
    sanitise_inputs_in_place: bool = False  # writes 0 into the caller's padding
    m2_after_over_valid: bool = False  # metric: mean M2 over every kept valid token
    random_tie_break: bool = False  # ties at the cut broken by fresh random noise

    def __post_init__(self) -> None:
        if self.candidates not in CANDIDATE_SETS:
            raise ValueError(f"candidates: expected one of {CANDIDATE_SETS}, got {self.candidates!r}")
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"denominator: expected one of {DENOMINATORS}, got {self.denominator!r}")
        if self.selection_kind not in SELECTION_KINDS:
            raise ValueError(f"selection_kind: expected one of {SELECTION_KINDS}, got {self.selection_kind!r}")
        for name in ("selection_dtype", "metrics_dtype"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name}: expected one of {PRECISIONS}, got {getattr(self, name)!r}")
        if self.scope_rows is not None and self.scope_rows < 1:
            raise ValueError(f"scope_rows: expected None or an int >= 1, got {self.scope_rows!r}")


ALGORITHM_1 = Deviation()

#: Deviations visible only in behaviour, not in the values computed, by the check that shows them.
BEHAVIOURAL = {
    "zero_padding_by_multiplying": "padding_immunity",
    "sanitise_inputs_in_place": "inputs_not_mutated",
    "random_tie_break": "determinism",
}


@dataclass(frozen=True)
class Variant:
    """A named deviation the diagnosis can recognise."""

    name: str
    description: str
    source: str
    deviation: Deviation
    behaviour_check: str | None = None  # set for deviations only a behavioural check can see

    @property
    def is_behavioural(self) -> bool:
        return self.behaviour_check is not None


def _variant(name: str, description: str, source: str, **knobs) -> Variant:
    deviation = replace(ALGORITHM_1, **knobs)
    behavioural = [BEHAVIOURAL[k] for k in knobs if k in BEHAVIOURAL]
    return Variant(name, description, source, deviation, behavioural[0] if behavioural else None)


SPEC = "spec section 3"
PLAUSIBLE = "plausible port bug"
CLIP = "spec section 4"

VARIANTS: tuple[Variant, ...] = (
    _variant("algorithm_1", "Algorithm 1 itself", "spec section 1"),
    _variant("all_valid_candidates", "every valid token is a candidate", f"{SPEC} (AReaL, slime)", candidates="all_valid"),
    _variant("swapped_quadrants", "candidates are the inactive quadrants (A > 0 & d < 0, A < 0 & d > 0)", PLAUSIBLE, candidates="swapped_quadrants"),
    _variant("zero_advantage_candidate", "A == 0 with d > 0 counted as a candidate", PLAUSIBLE, candidates="zero_advantage_included"),
    _variant("first_token_advantage_sign", "advantage sign taken from each row's first valid token", f"{SPEC} (authors' release)", candidates="first_token_sign"),
    _variant("strict_stop", "stops only when the mean is < tau: equality keeps removing", f"{SPEC} (AReaL, SkyRL fork)", strict_stop=True),
    _variant("mean_over_valid", "budget mean over remaining valid tokens, non-candidates included", f"{SPEC} (SkyRL fork)", mean_over_valid=True),
    _variant("per_sequence_selection", "selection run per sequence instead of per optimizer batch", PLAUSIBLE, scope_rows=1),
    _variant("micro_batch_selection_2", "selection run per micro-batch of 2 rows", f"{SPEC} (micro-batch scope)", scope_rows=2),
    _variant("micro_batch_selection_4", "selection run per micro-batch of 4 rows", f"{SPEC} (micro-batch scope)", scope_rows=4),
    _variant("one_extra_removed", "off by one: removes one more token than needed", PLAUSIBLE, extra_removed=1),
    _variant("keeps_smallest_candidate", "never removes the last (smallest) candidate", f"{SPEC} (AReaL: keeps the smallest token)", min_kept=1),
    _variant("kept_count_denominator", "loss divided by the kept-token count instead of N before masking", f"{SPEC} (AReaL)", denominator="kept"),
    _variant("padded_denominator", "loss divided by B*T, padding included", PLAUSIBLE, denominator="padded"),
    _variant("ppo_clip_still_applied", "PPO epsilon-clip (0.2) still applied to kept tokens", PLAUSIBLE, ppo_clip=0.2),
    _variant("ratio_inverted", "log ratio taken as behavior_logp - logp", PLAUSIBLE, ratio_inverted=True),
    _variant("mask_not_applied", "mask computed but the loss sums every valid token", f"{SPEC} (slime PR)", apply_mask=False),
    _variant("masked_keep_value", "masked tokens keep their loss value (zero gradient only)", f"{SPEC} (authors' release, verl clip PR)", masked_keep_value=True),
    _variant("clamped_log_ratio", "straight-through clamp of d to +-20", f"{SPEC} (ms-swift, Trinity-RFT guard)", clamp_log_ratio=20.0),
    _variant("m2_after_over_valid", "m2_after averaged over every kept valid token", PLAUSIBLE, m2_after_over_valid=True),
    _variant("areal", "AReaL: all valid tokens, strict stop, keeps the smallest token, kept-count denominator", SPEC,
             candidates="all_valid", strict_stop=True, min_kept=1, denominator="kept"),
    _variant("skyrl_fork", "SkyRL fork: strict stop, mean over remaining valid tokens", SPEC, strict_stop=True, mean_over_valid=True),
    _variant("slime_pr", "slime PR: all valid tokens, strict stop, keeps one, mask never applied", SPEC,
             candidates="all_valid", strict_stop=True, min_kept=1, apply_mask=False),
    _variant("nan_padding_leak", "padding zeroed by multiplying with the mask: 0 * nan = nan", PLAUSIBLE, zero_padding_by_multiplying=True),
    _variant("mutates_inputs", "writes into the caller's input tensors", PLAUSIBLE, sanitise_inputs_in_place=True),
    _variant("random_tie_break", "nondeterministic: ties at the cut broken at random on each call", PLAUSIBLE, random_tie_break=True),
    # Spec section 4: the clip family and the deviations real ports combine.
    _variant("authors_release_clip", "a ratio clip range instead of a mask, capped at the d^2 breakpoint below the budget (tokens beyond it keep "
             "their clipped value, zero gradient)", f"{CLIP} (authors' release)", selection_kind="clip_below"),
    _variant("water_filling_clip", "a ratio clip range instead of a mask, at the exact water-filling cap (capped mean = budget)",
             f"{CLIP} (open verl pull request)", selection_kind="clip_exact"),
    _variant("clip_floors", "the clip range is never tighter than [1 - 0.3, 1 + 0.5] (miniclip floors)", f"{CLIP} (authors' release)",
             clip_floors=(0.3, 0.5)),
    _variant("column0_advantage_sign", "candidates take the advantage sign of column 0 of each row, padding or not", f"{CLIP} (authors' release)",
             candidates="column0_sign"),
    _variant("denominator_epsilon", "loss divided by N + 1e-8 (verl's token-mean)", f"{CLIP} (verl token-mean)", denominator="valid_epsilon"),
    _variant("hard_clamped_log_ratio", "hard clamp of d to +-20: kept tokens beyond it get zero gradient", CLIP, clamp_log_ratio=20.0, hard_clamp=True),
    _variant("float32_selection", "selection arithmetic (d, d^2, prefix means) in float32", CLIP, selection_dtype="float32"),
    _variant("float32_metrics", "logged metrics computed in float32", CLIP, metrics_dtype="float32"),
)


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"variant: unknown name {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def combine(names: Iterable[str]) -> Deviation | None:
    """The deviation of several variants at once; None where two set one knob differently."""
    knobs: dict[str, object] = {}
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

    def to_json(self) -> dict[str, str]:
        return {"deviation": self.deviation, "reason": self.reason, "link": self.link}
