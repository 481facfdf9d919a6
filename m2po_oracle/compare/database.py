"""What the search keeps between runs and how Hypothesis is set for it: failing examples in
an example database folder, under a key of the implementation and the options that shape a
call; settings, and a search, that leave the batches to the run's ``--seed``."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.internal.conjecture import providers
from hypothesis.strategies import SearchStrategy

from m2po_oracle.call.runner import Runner
from m2po_oracle.oracle.batch import Batch


def search_settings(examples: int, *, generate_only: bool = False) -> settings:
    # derandomize off whatever the loaded profile says: the run's --seed decides the batches.
    # generate_only: no shrinking (a stratified start records what it draws, finds nothing).
    loaded = settings.default
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate] if generate_only else (loaded.phases if loaded is not None else tuple(Phase)),
    )


Example = TypeVar("Example")


def seeded_find(
    strategy: SearchStrategy[Example], condition: Callable[[Example], bool], examples: settings, seed: random.Random
) -> Example:
    """``hypothesis.find`` as every search of a run calls it: what it draws is a function of
    ``strategy``, ``examples`` and ``seed`` alone (:func:`without_source_constants`)."""
    with without_source_constants():
        return find(strategy, condition, settings=examples, random=seed)


@contextlib.contextmanager
def without_source_constants() -> Iterator[None]:
    """Hypothesis now and then draws a literal it read from the source of a module imported so
    far that it deems local (neither the standard library nor site-packages): this package's
    own modules, the port's. The batches would then hang on which modules the process has
    imported by the time it draws (on import order, and on whether the package is installed or
    checked out), not on the inputs and ``--seed``. Within this block that pool is empty;
    Hypothesis' own constants (NaN, infinities, signed zeros, extremes) are still drawn."""
    pooled = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if pooled is None or cache is None:  # a Hypothesis without the pool
        yield
        return
    empty = providers.Constants()
    # The cache holds, per kind of draw, the constants it permits, taken from the pool as it
    # stood: cleared on the way in, and out, so that neither pool serves the other's draws.
    cache.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = pooled
        cache.cache.clear()


class ExampleDatabase:
    """Failing examples kept between runs in a Hypothesis example database folder, under a
    key of the implementation and the options that shape a call."""

    def __init__(self, folder: str, runner: Runner) -> None:
        import hashlib

        from hypothesis.database import DirectoryBasedExampleDatabase

        self.db = DirectoryBasedExampleDatabase(folder)
        self.runner = runner
        o = runner.options
        shape = [runner.spec, o.dtype, o.compute_dtype, o.adapter, list(o.bind), str(o.topology), o.tau, runner.example_key()]
        self.key = b"m2po-oracle:" + hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest().encode()

    def saved(self) -> list[Any]:
        found = []
        for value in sorted(self.db.fetch(self.key)):
            try:
                found.append(self.runner.parse_example(json.loads(value)))
            except (ValueError, KeyError, TypeError):  # written by another version: forget it
                self.db.delete(self.key, value)
        return found

    def save(self, examples: Any) -> None:
        for example in examples:
            if example is None:
                continue
            text = example.to_json() if isinstance(example, Batch) else json.dumps(example.to_dict())
            self.db.save(self.key, text.encode())
