"""The input a trainer run explores: one training step, and the strategy that draws it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from m2po_oracle.oracle.encoding import to_builtins


@dataclass(frozen=True)
class TrainerCase:
    """One training step to run: everything that determines it."""

    seed: int
    prompts: int
    group_size: int
    prompt_len: int
    max_new_tokens: int
    lags: tuple[int, ...]  # per prompt: optimizer steps its rollout worker is behind the current policy
    staleness_lr: float
    tau: float
    split: tuple[int, ...]  # rows per micro-batch; sums to prompts * group_size
    # When set, tau is not ``tau`` but derived from the step itself: the budget at which
    # Algorithm 1 removes this many of the step's trust-region tokens (clamped to leave one),
    # so that the cut falls inside the batch, where micro-batches selecting alone disagree.
    cut: int | None = None

    def __post_init__(self) -> None:
        for name in ("seed", "prompts", "group_size", "prompt_len", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"{name}: expected a {'non-negative' if name == 'seed' else 'positive'} integer, got {value!r}")
        if len(self.lags) != self.prompts or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 8 for n in self.lags):
            raise ValueError(f"lags: expected one integer in 0..8 per prompt ({self.prompts}), got {list(self.lags)}")
        if isinstance(self.staleness_lr, bool) or not isinstance(self.staleness_lr, (int, float)) or not 0 < self.staleness_lr <= 1:
            raise ValueError(f"staleness_lr: expected a number in (0, 1], got {self.staleness_lr!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0 <= self.tau < float("inf"):
            raise ValueError(f"tau: expected a finite number >= 0, got {self.tau!r}")
        if self.prompt_len + self.max_new_tokens > 64:
            raise ValueError(
                f"prompt_len + max_new_tokens: expected at most 64 (the model's positions), got {self.prompt_len + self.max_new_tokens}"
            )
        if self.cut is not None and (isinstance(self.cut, bool) or not isinstance(self.cut, int) or self.cut < 1):
            raise ValueError(f"cut: expected None or a positive integer (trust-region tokens to remove), got {self.cut!r}")
        rows = self.prompts * self.group_size
        if not self.split or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.split) or sum(self.split) != rows:
            raise ValueError(f"split: expected non-negative row counts summing to prompts * group_size = {rows}, got {list(self.split)}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "trainer_case", **to_builtins(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerCase:
        if not isinstance(data, dict) or data.get("kind") != "trainer_case":
            raise ValueError(f'trainer case: expected a JSON object with "kind": "trainer_case", got {str(data)[:80]!r}')
        fields_ = {k: v for k, v in data.items() if k != "kind"}
        try:
            return cls(**{**fields_, "lags": tuple(fields_.get("lags", ())), "split": tuple(fields_.get("split", ()))})
        except TypeError as error:
            raise ValueError(f"trainer case: {error}") from None


@st.composite
def trainer_cases(draw: st.DrawFn, tau: float | None = None) -> TrainerCase:
    """Small steps first (Hypothesis shrinks towards one prompt, two rows, one token).

    Half the steps split into one micro-batch per prompt (whose workers lag by different
    steps) and cut inside the step (``cut``), so that selecting per micro-batch would keep
    another mask: the scope bugs of gradient accumulation show within a few steps."""
    # Both kinds draw the same choices, so shrinking (shorter, then smaller choices first)
    # moves a scoped step back to a plain one instead of preferring the shorter draw.
    scoped = tau is None and not draw(st.booleans())  # the simplest steps are scoped: caught first
    prompts = draw(st.integers(1, 3))
    group_size = draw(st.integers(2, 4))
    rows = prompts * group_size
    k = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=k - 1, max_size=k - 1)))
    split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))
    lags = draw(st.lists(st.integers(0, 3), min_size=prompts, max_size=prompts))
    seed, prompt_len, max_new_tokens = draw(st.integers(0, 2**16)), draw(st.integers(1, 4)), draw(st.integers(1, 8))
    staleness_lr = draw(st.sampled_from([0.02, 0.01, 0.005]))
    drawn_tau = tau if tau is not None else draw(st.sampled_from([0.02, 0.04, 0.01, 0.1, 0.0]))
    cut = draw(st.integers(1, 6))
    if scoped and prompts > 1:  # one micro-batch per prompt, a fresh worker and a stale one
        split, lags = (group_size,) * prompts, [0, 3, *lags[2:]]
    return TrainerCase(
        seed=seed,
        prompts=prompts,
        group_size=group_size,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        lags=tuple(lags),
        staleness_lr=staleness_lr,
        tau=drawn_tau,
        split=split,
        cut=cut if scoped else None,
    )
