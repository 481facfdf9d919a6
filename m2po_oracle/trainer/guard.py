"""The trainer options under which a framework's step would not compute Algorithm 1's
objective, declared once as :class:`Refusal` records; an integration lists the ones its
framework has (:func:`refuse` checks them in order, naming the first it meets).

A refusal reads the framework's arguments object by attribute (an option this framework
version lacks reads as its default) and says, in one message, the option, why it changes
the objective and what to set. The rules that several frameworks share are built here with
the framework's own words (its name, how its users set an option).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def option(args: Any, name: str, default: Any = None) -> Any:
    """A trainer option by name, ``default`` where this framework version has none."""
    return getattr(args, name, default)


@dataclass(frozen=True)
class Refusal:
    """One option (or a few that mean one thing) that would change M2PO's objective:
    ``refuses(args)`` says whether the run's settings do, ``says(args)`` the error."""

    option: str  # the option the message names first
    refuses: Callable[[Any], bool]
    says: Callable[[Any], str]


def refuse(args: Any, refusals: Sequence[Refusal]) -> None:
    """Raise a ValueError naming the first option of ``refusals`` that ``args`` sets to a
    value changing the objective."""
    for refusal in refusals:
        if refusal.refuses(args):
            raise ValueError(refusal.says(args))


# --- the rules several frameworks share ----------------------------------------------------


def dapo_normaliser(whose: str, fix: str) -> Refusal:
    """M2PO divides by N; another loss_type asks for another normaliser. ``whose``: what
    'dapo' is in this framework; ``fix``: how its users set it."""
    return Refusal(
        "loss_type",
        lambda a: option(a, "loss_type", "dapo") != "dapo",
        lambda a: (
            f"loss_type: M2PO divides the masked sum by N, the optimizer batch's valid tokens before masking ({whose}); "
            f"loss_type={option(a, 'loss_type', 'dapo')!r} asks for another normaliser that M2PO would ignore ({fix})"
        ),
    )


TOKEN_LEVEL_RATIOS = Refusal(
    "importance_sampling_level",
    lambda a: option(a, "importance_sampling_level", "token") != "token",
    lambda a: (
        f"importance_sampling_level: M2PO is defined on token-level ratios; got "
        f"{option(a, 'importance_sampling_level')!r} (sequence-level IS would change the objective)"
    ),
)


NO_ENTROPY_MASK = Refusal(
    "top_entropy_quantile",
    lambda a: option(a, "top_entropy_quantile", 1.0) < 1.0,
    lambda a: (
        f"top_entropy_quantile: an entropy mask (got {option(a, 'top_entropy_quantile')}) drops tokens Algorithm 1 keeps; "
        "M2PO's mask is its only mask (set it to 1.0)"
    ),
)


def no_liger(framework: str, options: tuple[str, ...] = ("use_liger_kernel",)) -> Refusal:
    """Liger's fused loss computes the framework's clipped objective and bypasses M2PO's."""
    return Refusal(
        "use_liger_kernel",
        lambda a: any(option(a, name, False) for name in options),
        lambda a: (
            f"use_liger_kernel: Liger's fused GRPO loss computes {framework}'s clipped objective, not M2PO's; it would bypass "
            "the M2PO loss (set it to False)"
        ),
    )


def full_distribution(name: str, neutral: Any, framework: str, *, also_neutral: tuple[Any, ...] = (), fix: str = "") -> Refusal:
    """A sampler setting that truncates the distribution: the recomputed behaviour log-probs
    apply only the temperature, so they would not be the sampler's."""

    def refuses(a: Any) -> bool:
        value = option(a, name, neutral)
        return value is not None and value != neutral and value not in also_neutral

    return Refusal(
        name,
        refuses,
        lambda a: (
            f"{name}: the sampler must draw from the full distribution (got {name}={option(a, name, neutral)!r}); {framework}'s "
            f"recomputed behaviour log-probs apply only the temperature, so they would not be the sampler's{fix}"
        ),
    )
