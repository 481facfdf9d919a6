"""What the search keeps between runs and how Hypothesis is set for it: failing examples in
an example database folder, under a key of the implementation and the options that shape a
call; settings that leave the batches to the run's ``--seed``."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, Phase, settings

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
