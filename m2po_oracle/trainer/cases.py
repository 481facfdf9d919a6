"""The input a trainer run explores: one training step, and the strategy that draws it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hypothesis import strategies as st


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
            raise ValueError(f"prompt_len + max_new_tokens: expected at most 64 (the model's positions), got {self.prompt_len + self.max_new_tokens}")
        rows = self.prompts * self.group_size
        if not self.split or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.split) or sum(self.split) != rows:
            raise ValueError(f"split: expected non-negative row counts summing to prompts * group_size = {rows}, got {list(self.split)}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "trainer_case", **asdict(self), "lags": list(self.lags), "split": list(self.split)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerCase":
        if not isinstance(data, dict) or data.get("kind") != "trainer_case":
            raise ValueError(f"trainer case: expected a JSON object with \"kind\": \"trainer_case\", got {str(data)[:80]!r}")
        fields_ = {k: v for k, v in data.items() if k != "kind"}
        try:
            return cls(**{**fields_, "lags": tuple(fields_.get("lags", ())), "split": tuple(fields_.get("split", ()))})
        except TypeError as error:
            raise ValueError(f"trainer case: {error}") from None


@st.composite
def trainer_cases(draw: st.DrawFn, tau: float | None = None) -> TrainerCase:
    """Small steps first (Hypothesis shrinks towards one prompt, two rows, one token)."""
    prompts = draw(st.integers(1, 3))
    group_size = draw(st.integers(2, 4))
    rows = prompts * group_size
    k = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=k - 1, max_size=k - 1)))
    split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))
    return TrainerCase(
        seed=draw(st.integers(0, 2**16)), prompts=prompts, group_size=group_size, prompt_len=draw(st.integers(1, 4)),
        max_new_tokens=draw(st.integers(1, 8)), lags=tuple(draw(st.lists(st.integers(0, 3), min_size=prompts, max_size=prompts))),
        staleness_lr=draw(st.sampled_from([0.02, 0.01, 0.005])),
        tau=tau if tau is not None else draw(st.sampled_from([0.02, 0.04, 0.01, 0.1, 0.0])), split=split)
