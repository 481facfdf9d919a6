"""Public Hypothesis strategies for M2PO batches (reusable in users' own test suites).

Positional arguments say what is drawn, keyword-only arguments shape how. Every strategy
yields a :class:`m2po_oracle.oracle.batch.Batch` in float64; padding positions hold a drawn fill
(0, NaN, +-inf, huge or random values) that an implementation must never read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from m2po_oracle.oracle.batch import Batch

#: Scales of |log r| from a fresh rollout to an extremely stale one.
STALENESS = (0.02, 0.1, 0.2, 0.3, 1.0, 3.0, 8.0)
TAUS = (0.04, 0.04, 0.0, 0.01, 0.1, 0.5, 2.0)
PADDING_FILLS = (0.0, float("nan"), float("inf"), float("-inf"), 1e30, -1e30, "random")
#: Dyadic log ratios and budgets: every M2, sum and mean is exact in float64 and float32.
DYADIC_LOG_RATIOS = (0.0, 0.125, -0.125, 0.25, -0.25, 0.375, -0.375, 0.5, -0.5, 0.75, -0.75)
DYADIC_TAUS = (0.015625, 0.0625, 0.140625, 0.25, 0.0)


#: The attribute that names the family a generated batch was drawn from. It is not a field
#: of the dataclass: the batch's JSON, replay, repr and equality are what they were.
_FAMILY = "_m2po_family"


def family_of(batch: Batch) -> str | None:
    """The strategy family that drew ``batch`` ("grpo", "token_advantage", "dyadic", "ties",
    "extreme", "degenerate", "scope"), or None for a batch built any other way (by hand,
    parsed from JSON, or derived from another batch)."""
    return getattr(batch, "__dict__", {}).get(_FAMILY)


def with_family(batch: Batch, family: str | None) -> Batch:
    """``batch``, tagged as drawn by ``family`` (None: left as it is)."""
    if family is not None:
        object.__setattr__(batch, _FAMILY, family)  # Batch is frozen; the tag is no field
    return batch


def _check_range(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def _incidental(draw, label: str) -> np.random.Generator:
    """Values whose exact digits never decide a check (behaviour log-probs, padding noise)
    come from one drawn seed: cheap to draw, and they shrink with it."""
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1), label=label))


@st.composite
def _valid_mask(draw, rows: int, max_len: int) -> np.ndarray:
    """Right-padded rows of drawn lengths (0 gives an all-padding row), sometimes ragged."""
    lengths = draw(st.lists(st.integers(0, max_len), min_size=rows, max_size=rows), label="lengths")
    width = max(1, max(lengths))
    valid = np.arange(width)[None, :] < np.array(lengths)[:, None]
    if draw(st.booleans(), label="interior holes") and valid.any():
        holes = draw(hnp.arrays(np.bool_, valid.shape), label="holes")
        valid &= ~holes
    return valid


@st.composite
def _fill_padding(draw, values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    fill = draw(st.sampled_from(PADDING_FILLS), label="padding fill")
    if fill == "random":
        noise = _incidental(draw, "padding noise seed").uniform(-1e6, 1e6, size=values.shape)
        return np.where(valid, values, noise)
    return np.where(valid, values, fill)


@st.composite
def _log_ratios(draw, shape: tuple[int, int], staleness: float | None) -> np.ndarray:
    scale: float | np.ndarray  # one staleness for the batch, or a column of one per sequence
    if staleness is not None:
        scale = staleness
    elif draw(st.booleans(), label="staleness per sequence"):
        # Sequences from rollouts of different ages (partial rollouts) in one batch.
        scale = np.array(draw(st.lists(st.sampled_from(STALENESS), min_size=shape[0], max_size=shape[0]), label="row staleness"))[:, None]
    else:
        scale = draw(st.sampled_from(STALENESS), label="staleness")
    # tan of a uniform draw is Cauchy-like: mostly |log r| below the scale and a few
    # outliers up to ~6x it, the regime M2PO targets; it also shrinks towards 0.
    u = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1, 1) | st.just(0.0)), label="log ratio draw")
    return scale * np.tan(u * 0.45 * np.pi)


@st.composite
def _assemble(draw, d: np.ndarray, advantages: np.ndarray, valid: np.ndarray, tau: float | None, dyadic: bool = False) -> Batch:
    rng = _incidental(draw, "behavior_logp seed")
    if dyadic:
        behavior = rng.choice((-0.5, -1.0, -2.0, -4.0, -0.25), size=d.shape)
    else:
        behavior = -rng.exponential(2.0, size=d.shape)
    logp = behavior + d
    if tau is None:
        tau = draw(st.sampled_from(DYADIC_TAUS if dyadic else TAUS) | (st.nothing() if dyadic else st.floats(0.0, 1.0)), label="tau")
    return Batch(
        logp=draw(_fill_padding(logp, valid)),
        behavior_logp=draw(_fill_padding(behavior, valid)),
        advantages=draw(_fill_padding(advantages, valid)),
        valid=valid,
        tau=float(tau),
    )


def _group_normalised(rewards: np.ndarray, group_size: int) -> np.ndarray:
    grouped = rewards.reshape(-1, group_size)
    std = grouped.std(axis=1, keepdims=True)
    return ((grouped - grouped.mean(axis=1, keepdims=True)) / (std + 1e-6)).reshape(-1)


def _check_shape_args(**limits: int) -> None:
    for name, value in limits.items():
        _check_range(name, value, 1)


def _check_optional_scale(name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0):
        raise ValueError(f"{name}: expected None or a finite number >= 0, got {value!r}")


def grpo_batches(
    *, max_groups: int = 3, max_group_size: int = 4, max_len: int = 12, staleness: float | None = None, tau: float | None = None
) -> st.SearchStrategy[Batch]:
    """Realistic GRPO batches: groups of completions of one prompt with binary or graded
    rewards, group-normalised sequence-constant advantages (a group with equal rewards has
    A == 0), variable lengths, and staleness from mild to extreme (or ``staleness``)."""
    _check_shape_args(max_groups=max_groups, max_group_size=max_group_size, max_len=max_len)
    _check_optional_scale("staleness", staleness)
    _check_optional_scale("tau", tau)
    return _grpo_batches(max_groups, max_group_size, max_len, staleness, tau)


@st.composite
def _grpo_batches(draw, max_groups: int, max_group_size: int, max_len: int, staleness: float | None, tau: float | None) -> Batch:
    groups = draw(st.integers(1, max_groups), label="groups")
    group_size = draw(st.integers(1, max_group_size), label="group size")
    reward = st.sampled_from((0.0, 1.0)) | st.floats(0.0, 1.0)
    rewards = np.array(draw(st.lists(reward, min_size=groups * group_size, max_size=groups * group_size), label="rewards"))
    valid = draw(_valid_mask(groups * group_size, max_len))
    advantages = np.repeat(_group_normalised(rewards, group_size)[:, None], valid.shape[1], axis=1)
    d = draw(_log_ratios(valid.shape, staleness))
    return with_family(draw(_assemble(d, advantages, valid, tau)), "grpo")


def token_advantage_batches(
    *, max_rows: int = 6, max_len: int = 12, staleness: float | None = None, tau: float | None = None
) -> st.SearchStrategy[Batch]:
    """Per-token advantages (GAE-style), with exact zeros and both signs within a row."""
    _check_shape_args(max_rows=max_rows, max_len=max_len)
    _check_optional_scale("staleness", staleness)
    _check_optional_scale("tau", tau)
    return _token_advantage_batches(max_rows, max_len, staleness, tau)


@st.composite
def _token_advantage_batches(
    draw, max_rows: int, max_len: int, staleness: float | None, tau: float | None, family: str = "token_advantage"
) -> Batch:
    rows = draw(st.integers(1, max_rows), label="rows")
    valid = draw(_valid_mask(rows, max_len))
    advantages = draw(hnp.arrays(np.float64, valid.shape, elements=st.just(0.0) | st.floats(-3.0, 3.0)), label="advantages")
    d = draw(_log_ratios(valid.shape, staleness))
    return with_family(draw(_assemble(d, advantages, valid, tau)), family)


def dyadic_batches(*, max_rows: int = 4, max_len: int = 8) -> st.SearchStrategy[Batch]:
    """Exactly representable log ratios, advantages and budgets: many exact ties and prefix
    means exactly equal to tau, which must be decided exactly (``<=`` keeps)."""
    _check_shape_args(max_rows=max_rows, max_len=max_len)
    return _dyadic_batches(max_rows, max_len)


@st.composite
def _dyadic_batches(draw, max_rows: int, max_len: int) -> Batch:
    rows = draw(st.integers(1, max_rows), label="rows")
    valid = draw(_valid_mask(rows, max_len))
    d = draw(hnp.arrays(np.float64, valid.shape, elements=st.sampled_from(DYADIC_LOG_RATIOS)), label="dyadic log ratios")
    advantages = draw(hnp.arrays(np.float64, valid.shape, elements=st.sampled_from((1.0, -1.0, 0.5, -2.0, 0.0))), label="advantages")
    return with_family(draw(_assemble(d, advantages, valid, None, dyadic=True)), "dyadic")


def tie_batches(*, max_rows: int = 4, max_len: int = 10) -> st.SearchStrategy[Batch]:
    """Few distinct |log r| values, so many candidates share the M2 at the cut."""
    _check_shape_args(max_rows=max_rows, max_len=max_len)
    return _tie_batches(max_rows, max_len)


@st.composite
def _tie_batches(draw, max_rows: int, max_len: int) -> Batch:
    rows = draw(st.integers(1, max_rows), label="rows")
    valid = draw(_valid_mask(rows, max_len))
    magnitudes = draw(st.lists(st.sampled_from((0.125, 0.25, 0.5, 1.0)), min_size=1, max_size=2, unique=True), label="magnitudes")
    d = draw(
        hnp.arrays(np.float64, valid.shape, elements=st.sampled_from(tuple(magnitudes) + tuple(-m for m in magnitudes))),
        label="tied log ratios",
    )
    advantages = np.sign(d) * draw(st.sampled_from((1.0, 0.5)), label="advantage size")
    return with_family(draw(_assemble(d, advantages, valid, None, dyadic=True)), "ties")


def extreme_batches(*, max_rows: int = 4, max_len: int = 10) -> st.SearchStrategy[Batch]:
    """|log r| up to 50 (exp(d) up to 5e21), well past any +-20 clamp."""
    # _log_ratios scales tan(0.45 pi u), at most ~6.3: this scale reaches |d| = 50.
    _check_shape_args(max_rows=max_rows, max_len=max_len)
    return _token_advantage_batches(max_rows, max_len, 50.0 / np.tan(0.45 * np.pi), None, family="extreme")


def degenerate_batches() -> st.SearchStrategy[Batch]:
    """Everything masked, an empty trust region, a single token, all-padding rows."""
    return _degenerate_batches().map(lambda batch: with_family(batch, "degenerate"))


@st.composite
def _degenerate_batches(draw) -> Batch:
    kind = draw(st.sampled_from(("everything masked", "empty trust region", "single token", "all-padding rows")), label="degenerate kind")
    if kind == "single token":
        return draw(token_advantage_batches(max_rows=1, max_len=1))
    batch = draw(token_advantage_batches(max_rows=4, max_len=6))
    if kind == "everything masked":
        valid = np.zeros_like(batch.valid)
        return Batch(batch.logp, batch.behavior_logp, batch.advantages, valid, batch.tau)
    if kind == "all-padding rows":
        valid = batch.valid.copy()
        valid[::2] = False
        return Batch(batch.logp, batch.behavior_logp, batch.advantages, valid, batch.tau)
    # Empty trust region: every advantage opposes its log ratio (or is zero).
    with np.errstate(invalid="ignore"):
        d = batch.logp - batch.behavior_logp
    advantages = np.where(batch.valid, -np.sign(d) * np.abs(np.nan_to_num(batch.advantages, posinf=1.0, neginf=1.0)), batch.advantages)
    return Batch(batch.logp, batch.behavior_logp, advantages, batch.valid, batch.tau)


def adversarial_batches() -> st.SearchStrategy[Batch]:
    """Ties, exact boundaries, extreme ratios and degenerate shapes."""
    return st.one_of(dyadic_batches(), tie_batches(), extreme_batches(), degenerate_batches())


#: Staleness of a shard that split-scope bugs hide behind: one fresh, one heavy-tailed.
FRESH_SHARD, HEAVY_SHARDS = 0.02, (1.0, 3.0)


def scope_batches(*, max_shards: int = 4, max_len: int = 12) -> st.SearchStrategy[Batch]:
    """Batches on which splitting the optimizer batch changes the selection.

    Rows come in shards (1 or 2 consecutive rows, as micro-batches and data-parallel ranks
    split them) of different staleness: one fresh shard, one heavy-tailed, the rest drawn.
    Optionally staleness also grows along the sequence, so that context-parallel chunks
    differ too. The budget is set between two prefix means of the whole batch's trust
    region, so that Algorithm 1 removes a drawn number of tokens, cutting inside the heavy
    shard, while that shard selecting alone (without the fresh one's small M2 lowering
    the mean) would remove more."""
    _check_shape_args(max_shards=max_shards, max_len=max_len)
    if max_shards < 2:
        raise ValueError(f"max_shards: expected an int >= 2 (a split needs two shards), got {max_shards!r}")
    return _scope_batches(max_shards, max_len)


@st.composite
def _scope_batches(draw, max_shards: int, max_len: int) -> Batch:
    shards = draw(st.integers(2, max_shards), label="shards")
    rows_per_shard = draw(st.sampled_from((2, 1)), label="rows per shard")
    rows = shards * rows_per_shard
    lengths = draw(st.lists(st.integers(2, max_len), min_size=rows, max_size=rows), label="lengths")
    width = max(lengths)
    valid = np.arange(width)[None, :] < np.array(lengths)[:, None]
    scales = [FRESH_SHARD, draw(st.sampled_from(HEAVY_SHARDS), label="heavy shard")]
    scales += draw(st.lists(st.sampled_from(STALENESS), min_size=shards - 2, max_size=shards - 2), label="other shards")
    # Fresh first and heavy last puts them on different sides of any split into halves
    # (two DP ranks, two micro-batches); otherwise any order.
    order = list(range(shards))
    if draw(st.booleans(), label="shards in any order"):
        order = draw(st.permutations(range(shards)), label="shard order")
    else:
        order = [0, *range(2, shards), 1]
    row_scale = np.repeat(np.array(scales)[list(order)], rows_per_shard)[:, None]
    if draw(st.booleans(), label="staleness grows along the sequence"):
        row_scale = row_scale * (1.0 + 3.0 * np.arange(width)[None, :] / width)  # later tokens drift more: CP chunks differ
    # |u| >= 0.1 keeps every token off d = 0 even in Hypothesis's simplest draws: a cut
    # needs a trust region, and a split only shows where there is a cut.
    u = draw(hnp.arrays(np.float64, valid.shape, elements=st.floats(0.1, 1)), label="log ratio draw")
    u = u * np.where(draw(hnp.arrays(np.bool_, valid.shape), label="log ratio signs"), -1.0, 1.0)
    d = row_scale * np.tan(u * 0.45 * np.pi)
    exact = draw(st.booleans(), label="exact boundary")
    if exact:  # multiples of 1/8: every M2 and sum exact, so a prefix mean can equal tau exactly
        d = np.where(np.round(d * 8) == 0, np.sign(d) / 8, np.round(d * 8) / 8)
    # Mostly aligned signs put most tokens in the trust region, where the cut is decided.
    signs = np.where(draw(hnp.arrays(np.bool_, (rows, 1)), label="advantage signs"), -1.0, 1.0)
    advantages = np.where(np.sign(d) == 0, signs, np.sign(d)) * np.abs(signs) * draw(st.sampled_from((1.0, 0.5)), label="advantage size")
    flip = draw(hnp.arrays(np.bool_, valid.shape), label="opposed tokens")  # of every third column
    advantages = np.where(flip & (np.arange(width)[None, :] % 3 == 0), -advantages, advantages)
    # Dyadic behaviour log-probs too when exact: logp - behavior_logp is then d itself.
    return with_family(draw(_assemble(d, advantages, valid, _cut_inside(draw, d, advantages, valid, exact), dyadic=exact)), "scope")


def _sorted_trust_m2(d: np.ndarray, advantages: np.ndarray, valid: np.ndarray) -> np.ndarray:
    trust = valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    return np.sort((d * d)[trust])[::-1]


def _mean_after(m2: np.ndarray, removed: int) -> float:
    """The mean M2 of the trust region without its ``removed`` largest (``m2`` descending)."""
    return float(m2[removed:].sum() / (m2.size - removed))


def cut_budget(d: np.ndarray, advantages: np.ndarray, valid: np.ndarray, removed: int) -> float | None:
    """A tau at which Algorithm 1 removes exactly ``removed`` trust-region tokens (clamped to
    1 .. |T|-1; up to ties): midway between the mean M2 after removing ``removed`` - 1 and
    ``removed`` of the largest, so that no rounding decides the cut. None if |T| < 2."""
    m2 = _sorted_trust_m2(d, advantages, valid)
    if m2.size < 2:
        return None
    k = min(max(removed, 1), m2.size - 1)
    return (_mean_after(m2, k) + _mean_after(m2, k - 1)) / 2


def _cut_inside(draw, d: np.ndarray, advantages: np.ndarray, valid: np.ndarray, exact: bool = False) -> float:
    """A budget that cuts inside the batch (:func:`cut_budget`, the number removed drawn).
    With ``exact`` (dyadic d), tau is a prefix mean itself where one is exactly
    representable: the stop test decides it (``<=`` keeps it, ``<`` removes one more)."""
    from fractions import Fraction

    m2 = _sorted_trust_m2(d, advantages, valid)
    if m2.size < 2:
        return float(draw(st.sampled_from(TAUS), label="tau"))
    if exact:
        boundaries = [k for k in range(1, m2.size) if Fraction(_mean_after(m2, k)) == Fraction(float(m2[k:].sum())) / (m2.size - k)]
        if boundaries:
            return _mean_after(m2, draw(st.sampled_from(boundaries), label="tokens removed at an exact boundary"))
    tau = cut_budget(d, advantages, valid, draw(st.integers(1, m2.size - 1), label="tokens removed at the cut"))
    assert tau is not None  # m2.size >= 2 here, so cut_budget finds a tau
    return tau


#: The families of :func:`batches`, in the order a run's stratified start rotates through
#: them (split-scope first: scope bugs show on little else).
FAMILIES = ("scope", "grpo", "token_advantage", "dyadic", "ties", "extreme", "degenerate")


def family(name: str) -> st.SearchStrategy[Batch]:
    """The strategy of one family of :data:`FAMILIES`."""
    makers: dict[str, Callable[[], st.SearchStrategy[Batch]]] = {
        "scope": scope_batches,
        "grpo": grpo_batches,
        "token_advantage": token_advantage_batches,
        "dyadic": dyadic_batches,
        "ties": tie_batches,
        "extreme": extreme_batches,
        "degenerate": degenerate_batches,
    }
    if name not in makers:
        raise ValueError(f"family: expected one of {FAMILIES}, got {name!r}")
    return makers[name]()


def batches() -> st.SearchStrategy[Batch]:
    """Every family: realistic GRPO, per-token advantages, split-scope and the adversarial ones."""
    # Split-scope batches: scope bugs (per rank, per micro-batch, per CP chunk) only show
    # where sub-batches would select differently, which the other families rarely make.
    # Adversarial before split-scope: a failure found on a scope batch can still shrink into
    # the adversarial families (one_of shrinks towards its first branches).
    return st.one_of(grpo_batches(), token_advantage_batches(), adversarial_batches(), scope_batches(), scope_batches())


def scope_first_batches() -> st.SearchStrategy[Batch]:
    """The default mix with split-scope batches first: Hypothesis's earliest (simplest)
    draws are then split-sensitive. For runners whose bugs are mostly scope bugs (a
    distributed world); a loss function keeps :func:`batches`, whose failures shrink
    into the adversarial families (one_of shrinks towards its first branches)."""
    return st.one_of(scope_batches(), batches())


def random_grpo_batch(
    rng: np.random.Generator, rows: int, length: int, *, staleness: float = 0.3, group_size: int = 8, tau: float = 0.04
) -> Batch:
    """A large realistic batch from a NumPy generator (for sizes Hypothesis cannot draw,
    e.g. 1M tokens): binary rewards, group-normalised advantages, heavy-tailed log ratios,
    right padding filled with NaN."""
    if rows % group_size:
        raise ValueError(f"rows: expected a multiple of group_size={group_size}, got {rows}")
    lengths = rng.integers(1, length + 1, size=rows)
    valid = np.arange(length)[None, :] < lengths[:, None]
    advantages = np.repeat(_group_normalised(rng.integers(0, 2, size=rows).astype(np.float64), group_size)[:, None], length, axis=1)
    behavior = -rng.exponential(2.0, size=(rows, length))
    d = staleness * rng.standard_t(3, size=(rows, length))
    nan = np.float64("nan")
    return Batch(np.where(valid, behavior + d, nan), np.where(valid, behavior, nan), np.where(valid, advantages, nan), valid, tau)
