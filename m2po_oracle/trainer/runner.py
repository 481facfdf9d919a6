"""The battery on a whole GRPO training step (``compare --impl trainer``).

The explored input is a :class:`TrainerCase` (seed, rollout shape, staleness, tau and the
micro-batch split), not a batch: the trainer samples its own rollout and computes its own
log-probs. The oracle then judges the batch the trainer produced:

* every single-process value check (selection, loss, per-token gradient, metrics) on the
  trainer's own log-probs, behaviour log-probs, advantages and mask;
* ``trainer.behavior_logp`` / ``trainer.policy_logp``: the log-probs are those of the
  right model, recomputed here deterministically from snapshots taken before the step;
* ``trainer.parameter_gradient``: the analytic per-token gradient pulled back through the
  model (a vector-Jacobian product) equals each parameter's gradient;
* ``trainer.accumulation``: with k > 1 micro-batches, the same step run as one
  micro-batch gives the same mask, loss and gradient;
* ``trainer.optimizer_step``: the update is one optimizer step with the reported gradient.

A failing step is matched against :data:`TRAINER_VARIANTS`, each reproduced from the
step's own data, so the report names the trainer-level deviation.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import numpy as np
from hypothesis import strategies as st

from m2po_oracle.call.runner import (
    CallHealth,
    CapturedOutput,
    CaptureFailed,
    CaptureTarget,
    ChosenDtype,
    RunDescription,
    RunOptions,
    refuse_unhonoured,
)
from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.errors import LoadError, UsageError
from m2po_oracle.judge.battery import BatteryOutcome, replay_command
from m2po_oracle.judge.contract import Finding, Measurement
from m2po_oracle.judge.equivalence import Mismatch
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.trainer.cases import TrainerCase, trainer_cases
from m2po_oracle.trainer.checks import CHECK_NAMES, check_trainer_step, trainer_checks_ran
from m2po_oracle.trainer.controls import CONTROLS_BY_NAME
from m2po_oracle.trainer.diagnosis import VARIANT_DESCRIPTIONS, explain, metric_averaging
from m2po_oracle.trainer.probes import TRAINER_PROBES, run_trainer_probe
from m2po_oracle.trainer.run import TRAINER_DTYPES, TrainerFactory, TrainerStep, run_case

#: Options a trainer run honours (it runs in this process: no per-call timeout).
TRAINER_HONOURS = frozenset({"dtype", "compute_dtype", "device", "capture"})
#: The world of a trainer run, as a capture's manifest names it.
TRAINER_TOPOLOGY = "dp=1,cp=1,tp=1"


class TrainerRunner:
    """``compare --impl trainer`` (or ``trainer:CONTROL``): runs cases through the trainer."""

    checks = CHECK_NAMES
    example_unit = "steps"
    costly_examples = True
    variant_descriptions = VARIANT_DESCRIPTIONS
    variant_source = "trainer-level deviation (the production PR's support boundary, or a plausible port bug)"

    def __init__(
        self,
        control: str | None = None,
        *,
        trainer: TrainerFactory | None = None,
        spec: str | None = None,
        options: RunOptions | None = None,
        beta: float | None = None,
    ) -> None:
        """Our trainer, one of its controls, or ``trainer``: a factory (e.g. a class) building
        the trainer under test as ``trainer(policy, config, *, behaviour, reference)``.

        ``beta``: the KL coefficient every step runs with (default: the control's, else the
        factory's ``kl_coefficient``, else 0); with beta != 0 ``trainer.kl_term`` judges the term."""
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise LoadError("impl: the trainer needs the transformers package: pip install -c constraints.txt -e '.[trainer]'")
        if control is not None and control not in CONTROLS_BY_NAME:
            raise LoadError(f"impl: unknown trainer control {control!r}; known: {', '.join(CONTROLS_BY_NAME)}")
        if control is not None and trainer is not None:
            raise LoadError("impl: a trainer control plants its bug in the built-in trainer; give a control or a trainer, not both")
        if trainer is not None and not callable(trainer):
            raise LoadError(f"impl: the trainer must be a callable (a class or factory), got {type(trainer).__name__}")
        self.options = options or RunOptions()
        # The built-in trainer records through the capture; a trainer under test is not ours to instrument.
        honours = TRAINER_HONOURS if trainer is None else TRAINER_HONOURS - {"capture"}
        refuse_unhonoured(
            "a training step (--impl trainer)",
            honours,
            self.options,
            {
                "timeout": "the trainer runs in this process; no timeout can stop a step",
                "capture": "a custom trainer records through m2po_oracle.capture itself",
                "adapter": "a training step is not a loss function; adapters do not apply",
                "topology": "the trainer runs one process",
                "backend": "the trainer runs one process",
                "in_process": "the trainer always runs in this process",
                "show_output": "the trainer's output is not captured",
            },
        )
        self.spec = spec or (f"trainer:{control}" if control else "trainer")
        self.dtype_chosen = self._one_dtype(trainer)
        if self.options.dtype not in TRAINER_DTYPES:
            raise UsageError(f"dtype: the trainer runs its model in one of {sorted(TRAINER_DTYPES)}, got {self.options.dtype!r}")
        self.control = CONTROLS_BY_NAME[control] if control else None
        self.make_trainer = trainer
        if beta is None:
            beta = self.control.beta if self.control else getattr(trainer, "kl_coefficient", 0.0)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < float("inf"):
            raise LoadError(f"impl: the KL coefficient (beta, or the trainer's kl_coefficient) must be a finite number >= 0, got {beta!r}")
        self.beta = float(beta)
        # Without a KL term there is nothing for trainer.kl_term to judge: the run does not claim it.
        self.checks = CHECK_NAMES if self.beta else tuple(n for n in CHECK_NAMES if n != "trainer.kl_term")
        self.health = CallHealth()
        self.output = CapturedOutput()
        # Last, so that a refused run leaves no directory behind; the recorder itself is made
        # at the first step, so that opening a runner (the pytest plugin opens two) writes nothing.
        self.capture = CaptureTarget.prepare(self.options.capture) if self.options.capture else None
        self._recorder: _Recording | None = None

    def _one_dtype(self, trainer: TrainerFactory | None) -> str | None:
        """A trainer that computes in one dtype declares it (``computes_in``, with
        ``computes_in_why``): without ``--dtype`` the run takes it (the reason, returned, goes
        into the report); any other ``--dtype`` would judge its values at the wrong tolerance."""
        computes_in = getattr(trainer, "computes_in", None)
        if computes_in is None:
            return None
        why = getattr(trainer, "computes_in_why", "")
        if "dtype" not in self.options.given:
            self.options = self.options.but(dtype=computes_in)
            return f"the dtype {self.spec} computes in; --dtype not given"
        if self.options.dtype != computes_in:
            raise UsageError(
                f"dtype: {self.spec} computes in {computes_in}{': ' + why if why else ''}; --dtype {self.options.dtype} would judge "
                f"{computes_in} values at {self.options.dtype} tolerance. Leave --dtype out (the run takes {computes_in}) "
                f"or give --dtype {computes_in}"
            )
        return None

    def _recording(self) -> _Recording | None:
        if self.capture is None:
            return None
        if self._recorder is None:
            try:
                self._recorder = _Recording(Recorder(self.capture.directory, rank=0, world_size=1, topology=TRAINER_TOPOLOGY))
            except (OSError, ValueError) as error:
                raise CaptureFailed(f"capture: cannot start recording in {self.capture.directory}: {error}") from error
        return self._recorder

    def strategy(self) -> st.SearchStrategy[TrainerCase]:
        return trainer_cases(self.options.tau)

    def run_battery(self, case: TrainerCase) -> Any:
        dtype = self.options.dtype
        recorder = self._recording()
        step_index = self.capture.next_step() if self.capture is not None else None
        try:
            step = run_case(
                case,
                dtype=dtype,
                control=self.control,
                device=self.options.device,
                make_trainer=self.make_trainer,
                recorder=recorder,
                step_index=step_index,
                beta=self.beta,
            )
        except Exception as error:  # not CaptureFailed, a BaseException: a lost record stops the run
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-4)).rstrip()
            empty = Batch(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1), dtype=bool), case.tau)
            return BatteryOutcome(
                empty,
                Measurement(empty, dtype, None, Finding("raised", text)),
                (Mismatch("call", f"raised: {text.splitlines()[-1]}", details=(text,)),),
                case=case.to_dict(),
            )
        try:
            mismatches = tuple(check_trainer_step(step, self.options.compute_dtype))
        except Exception as error:  # a record that passed check_record but still cannot be judged
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-4)).rstrip()
            return BatteryOutcome(
                step.batch,
                Measurement(step.batch, dtype, None, Finding("wrong_result", text)),
                (Mismatch("call", f"the step record could not be checked: {text.splitlines()[-1]}", details=(text,)),),
                case=case.to_dict(),
            )
        consistent, evidenced = explain(step) if mismatches else (None, None)
        # A logged metric that is not Algorithm 1's may be the micro-batches' own values averaged
        # unweighted: a finding beside the failing metric checks, with the weighted value.
        averaged = metric_averaging(step) if any(m.check.startswith("metrics.") for m in mismatches) else None
        return BatteryOutcome(
            step.batch,
            Measurement(step.batch, dtype, step.m2po_result),
            mismatches,
            explained_by=consistent,
            evidenced=evidenced,
            case={**case.to_dict(), "trainer": _step_summary(step)},
            checked=trainer_checks_ran(step),
            metric_averaging=averaged,
        )

    def replay_command(self, case: TrainerCase) -> str:
        return replay_command(self.spec, json.dumps(case.to_dict()), dtype=self.options.dtype, compute_dtype=self.options.compute_dtype)

    def validation(self) -> list[Any]:
        return [
            run_trainer_probe(
                p,
                dtype=self.options.dtype,
                faults=self.control.faults if self.control else None,
                device=self.options.device,
                make_trainer=self.make_trainer,
            )
            for p in TRAINER_PROBES
        ]

    def parse_example(self, data: dict[str, Any]) -> TrainerCase:
        return TrainerCase.from_dict({k: v for k, v in data.items() if k != "trainer"})

    def example_key(self) -> str:
        return "trainer_case"

    def describe(self) -> RunDescription:
        # A dtype the runner, not the user, picked: the report says which and why.
        chosen = ChosenDtype(self.options.dtype, self.dtype_chosen) if self.dtype_chosen else None
        return RunDescription(capture=self.capture.use() if self.capture is not None else None, dtype=chosen)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> TrainerRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Recording:
    """The run's :class:`~m2po_oracle.capture.Recorder`, whose failures stop the run
    (:class:`CaptureFailed`) instead of reading as the trainer's step raising."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder

    def record(self, **record: Any) -> Any:
        return self._call(self.recorder.record, record)

    def record_parameter_gradients(self, **noted: Any) -> Any:
        return self._call(self.recorder.record_parameter_gradients, noted)

    def _call(self, write: Any, arguments: dict[str, Any]) -> Any:
        try:
            return write(**arguments)
        except Exception as error:
            where = f"step {arguments.get('step')}" + (f", micro-batch {arguments['micro_batch']}" if "micro_batch" in arguments else "")
            raise CaptureFailed(
                f"capture: recording {where} in {self.recorder.directory} failed: {type(error).__name__}: {error}"
            ) from error


def _step_summary(step: TrainerStep) -> dict[str, Any]:
    r = step.record
    return {
        "split": list(r.split),
        "loss": r.loss,
        "rows": step.rollout.rows,
        "tokens": int(r.valid.sum()),
        "rewards": [float(x) for x in step.rollout.rewards],
        "parameters": sum(p.numel() for p in r.params_before.values()),
    }
