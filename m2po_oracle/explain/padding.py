"""NaN and inf padding: which explanation reads padding, and where a leak through padding
comes in (``PaddingLeak``), measured from the padding probes alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
)
from m2po_oracle.explain.evidence import Judge, Observation, merge
from m2po_oracle.oracle.batch import PADDED_INPUTS, Batch
from m2po_oracle.oracle.record import (
    PaddingProbe,
)


def padding_reader(judge: Judge, components: tuple[str, ...]) -> list[str]:
    """The deviations that reproduce the port under every padding probe it changed with: the
    explanation's own (column 0's advantage), else with a statistic over every position (a
    kernel handed no mask: finite padding competes in the selection); [] if neither does."""
    reading = reads_padding(judge, components) if components else []
    if reading:
        return reading
    return reads_padding(judge, (*components, "statistic_over_padding"))


@dataclass(frozen=True)
class PaddingLeak:
    """The evidence of a padding leak: padding alone made the loss, or the gradient at some
    position (a valid token or a padding position), NaN/inf, on a batch whose zero-padded
    result is finite. A NaN gradient at a padding position is a leak too: the log-probs are
    gathered from the model's log-softmax at every position, so it reaches every weight."""

    fill: str  # the padding probe that showed it first on the smallest such batch
    where: str  # "loss", "valid token" or "padding position"
    index: tuple[int, ...] | None
    value: str  # the non-finite value, as Python writes it ("nan", "inf")
    examples: int  # the observations on which some padding probe made the result NaN/inf
    inputs: tuple[str, ...] | None  # the inputs whose padding alone does it (None: not probed)
    text: str = field(init=False)  # the finding in one sentence

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", self._sentence())

    def _sentence(self) -> str:
        what = "the loss" if self.where == "loss" else f"the gradient at {self.where} {self.index}"
        padding = f"with {self.fill}" if " " in self.fill else f"with padding set to {self.fill}"
        text = f"{padding}, {what} is {self.value} where the zero-padded run is finite (on {self.examples} example(s))"
        if self.inputs is not None:
            text += "; " + (
                f"NaN padding in {self.inputs[0]} alone does it"
                if len(self.inputs) == 1
                else f"NaN padding in any one of {', '.join(self.inputs)} alone does it"
                if self.inputs
                else "no one input's NaN padding alone does it"
            )
        return text


def padding_leak(observations: Sequence[Observation], leaks_alone: Callable[[Batch], bool | None] | None = None) -> PaddingLeak | None:
    """The padding leak the observations show, or None. ``leaks_alone(batch)`` runs the port
    on a batch padded in one input only and says whether that padding makes its result
    NaN/inf (None: it could not tell); it attributes the leak to the inputs it comes through."""
    leaking: list[tuple[Observation, PaddingProbe, tuple[str, tuple[int, ...] | None, float]]] = []
    for o in observations:
        for probe in o.padding_probes:
            found = probe.non_finite()
            if found is not None:
                leaking.append((o, probe, found))
                break
    if not leaking:
        return None
    o, probe, (where, index, value) = min(leaking, key=lambda t: (int(t[0].batch.valid.size), t[0].batch.valid.sum()))
    inputs: tuple[str, ...] | None = None
    if leaks_alone is not None:
        # Each input is asked with NaN padding in it alone, on the smallest leaking batch: the
        # drawn padding may be finite or an infinity that a port's exp absorbs (exp(-inf) = 0)
        # in one input on that batch, which says nothing of the input.
        answers = {name: leaks_alone(nan_padding_only_in(probe.batch, name)) for name in PADDED_INPUTS}
        if None not in answers.values():
            inputs = tuple(name for name, leaks in answers.items() if leaks)
    return PaddingLeak(probe.fill, where, index, repr(value), len(leaking), inputs)


def nan_padding_only_in(batch: Batch, name: str) -> Batch:
    """``batch`` with NaN padding in the input ``name`` and zero padding in the others."""
    values = {n: getattr(batch.with_padding(0.0), n).copy() for n in PADDED_INPUTS}
    values[name][~batch.valid] = np.nan
    return Batch(values["logp"], values["behavior_logp"], values["advantages"], batch.valid.copy(), batch.tau)


def reads_padding(judge: Judge, components: tuple[str, ...]) -> list[str]:
    """The deviations that read padding (e.g. the advantage of column 0), if together they
    reproduce every padding probe the port's result changed under; else [] (a leak)."""
    probes = [Observation(p.batch, p.result) for o in judge.observations if "padding_immunity" in o.failed for p in o.padding_probes]
    if not probes:
        return []
    probe_judge = Judge(
        probes, dtype=judge.dtype, compute_dtype=judge.compute_dtype, supplied=judge.supplied, keep_inferred=judge.keep_inferred
    )
    dev = merge(components) or ALGORITHM_1
    if any(probe_judge.differences(dev, i) for i in range(len(probes))):
        return []
    return [
        n
        for n in components
        if any(probe_judge.differences(merge(c for c in components if c != n) or ALGORITHM_1, i) for i in range(len(probes)))
    ]
