"""``open_runner(spec, options)``: the one place that decides how an implementation runs.

The CLI, the pytest plugin and torchrun all open their runner here:

* ``--topology``: a :class:`~m2po_oracle.distributed.runner.DistributedRunner` (a warm world);
* ``trainer``, ``trainer:CONTROL``, ``trainer:module:Class``: a
  :class:`~m2po_oracle.trainer.runner.TrainerRunner` (a whole training step);
* anything else is a loss function: called in an isolated worker, or with
  ``--in-process`` in this process (:class:`~m2po_oracle.call.loss_function.LossFunctionRunner`).

Each runner refuses the options it cannot honour (:class:`~m2po_oracle.call.runner.UsageError`).
"""

from __future__ import annotations

from typing import Any

from m2po_oracle.adapters import ADAPTERS, adapt
from m2po_oracle.call.isolation import EAGER_ENV, FIRST_COMPILED_CALL_S, InProcess, Isolated, compiled
from m2po_oracle.call.loss_function import LossFunctionRunner
from m2po_oracle.call.resolve import load_attribute, load_implementation
from m2po_oracle.call.runner import RunOptions, check_device
from m2po_oracle.cli.console import say_note
from m2po_oracle.cli.options import COMPARE_OPTIONS, Option
from m2po_oracle.distributed.implementations import load_distributed_implementation
from m2po_oracle.distributed.runner import DistributedRunner
from m2po_oracle.distributed.torchrun_runner import TorchrunRunner
from m2po_oracle.errors import LoadError, UsageError, closest
from m2po_oracle.judge.contract import parse_impl
from m2po_oracle.trainer.controls import TRAINER_IMPLEMENTATIONS
from m2po_oracle.trainer.runner import TrainerRunner

#: Production trainers behind the trainer contract, by name (``trainer:NAME[:CONTROL]``): a
#: factory taking the control's name. Named as strings: the integrations room sits above.
INTEGRATED_TRAINERS = {
    "trl": "m2po_oracle.integrations.trl_step:trl_trainer",
    "swift": "m2po_oracle.integrations.swift_step:swift_trainer",
    "verl": "m2po_oracle.integrations.verl_step:verl_trainer",
}
#: What each needs installed: (the distribution, what it is, how to install it).
INTEGRATED_REQUIRES = {
    "trl": ("trl", "the trl package", "pip install -c constraints.txt -e '.[trl]'"),
    "swift": (
        "ms-swift",
        "ms-swift 4.6, which is not installed in this environment (it needs trl<1 and transformers<5.20, so it lives "
        "in an environment of its own)",
        "python3 -m venv .venv-swift && .venv-swift/bin/pip install -e '.[swift]' -c constraints-swift.txt",
    ),
    "verl": (
        "verl",
        "verl 0.9.1, which is not installed in this environment (it needs transformers<5.11, so it lives in an environment of its own)",
        "python3 -m venv .venv-verl && .venv-verl/bin/pip install -e '.[verl]' -c constraints-verl.txt",
    ),
}


def is_installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def run_options(values: dict[str, Any]) -> RunOptions:
    """``runner.RunOptions`` from parsed values keyed by option name (unset: None/False):
    what :func:`open_runner` takes."""
    return RunOptions.from_values({o.name: _value(o, values.get(o.name)) for o in COMPARE_OPTIONS})


def _value(option: Option, value: Any) -> Any:
    # A repeatable option arrives as a list (None when never given): a tuple keeps the
    # options hashable and comparable.
    if option.repeat:
        return tuple(value) if value else None
    return value


def open_runner(spec: str, options: RunOptions, *, torchrun: Any = None) -> LossFunctionRunner | DistributedRunner | TrainerRunner:
    """The runner for ``spec`` under ``options`` (not started: ``start()`` or use ``with``).

    Under torchrun, ``torchrun`` is this process's rank context (rank 0's): the runner
    serves steps to torchrun's ranks instead of starting a world.

    Raises :class:`~m2po_oracle.call.resolve.LoadError` when ``spec`` cannot be loaded and
    :class:`UsageError` for an option the runner cannot honour."""
    check_device(options.device)
    if options.adapter is not None and options.adapter not in ADAPTERS:
        hint = closest(options.adapter, ADAPTERS)
        raise UsageError(f"adapter: expected one of {', '.join(ADAPTERS)} (m2po-oracle adapters lists them), got {options.adapter!r}{hint}")
    if options.topology is not None:
        # A fast error with closest matches, and a wrong binding refused, before any rank starts.
        distributed_adapter = options.adapter is not None and ADAPTERS[options.adapter].distributed
        load_distributed_implementation(spec, (options.adapter, tuple(options.bind)) if distributed_adapter else None)
        if torchrun is not None:
            return TorchrunRunner(torchrun, spec, options)
        return DistributedRunner(spec, options.topology, backend=options.backend, timeout_s=options.timeout, options=options)
    parsed = parse_impl(spec)
    if parsed.kind == "trainer":
        rest = parsed.rest
        integration, _, control = rest.partition(":")
        if integration in INTEGRATED_TRAINERS:  # trainer:trl, trainer:trl:CONTROL: a production trainer behind the contract
            distribution, what, install = INTEGRATED_REQUIRES[integration]
            if not is_installed(distribution):
                raise LoadError(f"impl: {spec} needs {what}: {install}")
            factory = load_attribute(INTEGRATED_TRAINERS[integration])
            try:
                trainer = factory(control or None)
            except ValueError as error:
                raise LoadError(f"impl: {error}") from None
            return TrainerRunner(trainer=trainer, spec=spec, options=options)
        if ":" in rest:  # trainer:module:Class or trainer:file.py:Class
            return TrainerRunner(trainer=load_attribute(rest), spec=spec, options=options)
        return TrainerRunner(rest or None, spec=spec, options=options)
    if options.adapter is not None and ADAPTERS[options.adapter].distributed:
        raise UsageError(f"adapter {options.adapter}: adapts a distributed port (it takes group=); give --topology dp=N too")
    rejecting = options.rejecting
    capture = not options.show_output
    # Here first, also for an isolated run: a fast error with closest matches, and a wrong
    # binding refused before any worker starts (naming the port's signature).

    fn = adapt(load_implementation(spec, also_known=list(TRAINER_IMPLEMENTATIONS)), options.adapter, options.bind)
    if compiled(fn):
        say_note(
            f"{spec} is compiled with torch.compile: it compiles on its first call in each worker (tens of seconds on a CPU), "
            f"which may take up to {max(options.timeout, FIRST_COMPILED_CALL_S):g} s; {EAGER_ENV}=1 runs it eagerly, and faster here"
        )
    call = getattr(fn, "bound_call", None)
    described = call.describe_call() if call is not None else None
    if options.in_process:
        return LossFunctionRunner(spec, InProcess(fn, capture=capture, rejecting=rejecting), options, call=described)
    isolated = Isolated(
        spec, timeout_s=options.timeout, adapter=options.adapter, bindings=options.bind, capture=capture, rejecting=rejecting
    )
    return LossFunctionRunner(spec, isolated, options, call=described)
