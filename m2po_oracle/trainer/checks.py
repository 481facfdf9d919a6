"""The checks of a whole training step: the battery's value checks on the batch it produced, and its own."""

from __future__ import annotations

import numpy as np
import torch

from m2po_oracle import oracle
from m2po_oracle.judge.checks import TRAINER_CHECKS, VALUE_CHECKS
from m2po_oracle.judge.equivalence import (
    Mismatch,
    check_selection,
    checks_run_on,
    compare_fields,
    compare_to_oracle,
    compare_values,
    exp_rounding,
    same_up_to_ties,
    tolerance,
    valid_m2,
)
from m2po_oracle.trainer.run import TrainerStep, result_of_step

#: Checks a trainer step runs: the battery's value checks on its batch, then its own (the
#: loss-function behaviour checks, padding probes, determinism and mutation, do not apply).
CHECK_NAMES = ("call", *VALUE_CHECKS, *TRAINER_CHECKS)


#: Rollout engines record log-probs in float32 (``generate`` casts its logits to float32, as
#: vLLM returns float32 log-probs), whatever the model's dtype.
ROLLOUT_LOGP_DTYPE = "float32"


def logp_check(check: str, what: str, reported: np.ndarray, expected: np.ndarray, valid: np.ndarray, dtype: str) -> Mismatch | None:
    # Log-probs are O(1) quantities: scale 1 keeps near-zero log-probs from demanding relative precision.
    mismatch = compare_values(
        check, what, np.where(valid, reported, 0.0), np.where(valid, expected, 0.0), tolerance(dtype, "metric"), scale=1.0
    )
    if mismatch is None:
        return None
    return Mismatch(
        check,
        f"{mismatch.summary} (valid tokens; expected recomputed from the model snapshot)",
        mismatch.field,
        mismatch.index,
        mismatch.actual,
        mismatch.expected,
        mismatch.details,
    )


def compare_params(
    check: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: str, what: str, *, slack: float = 1.0
) -> Mismatch | None:
    """The first parameter of ``actual`` not within the gradient tolerance of ``expected``
    (``slack``: that tolerance times this, for a comparison whose two sides round differently)."""
    tol = tolerance(dtype, "gradient")
    # Entries far below the largest are judged against the largest (as for per-token gradients).
    scale = slack * max((float(t.abs().max()) for t in expected.values() if t.numel()), default=0.0)
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            return Mismatch(check, f"{what}: parameter {name!r} is missing", field=name)
        mismatch = compare_values(check, name, got.to(torch.float64).cpu().numpy(), want.to(torch.float64).cpu().numpy(), tol, scale=scale)
        if mismatch is not None:
            return Mismatch(
                check,
                f"{what}: parameter {name!r}: {mismatch.summary}",
                name,
                mismatch.index,
                mismatch.actual,
                mismatch.expected,
                mismatch.details,
            )
    return None


def check_trainer_step(step: TrainerStep, compute_dtype: str | None = None) -> list[Mismatch]:
    """Every mismatch of one training step (see the module docstring)."""
    record, batch, dtype = step.record, step.batch, step.dtype
    valid = batch.valid
    if step.beta == 0:
        found = compare_to_oracle(batch, result_of_step(record), dtype, compute_dtype)
    else:  # loss and gradient judged with the KL term in both: the record's and the expectation's
        found = check_selection(batch, record.keep.numpy(), compute_dtype or dtype)
        found += compare_fields(batch, step.reported, step.expected_on_mask, dtype, compute_dtype)
    mismatch = logp_check("trainer.behavior_logp", "behavior_logp", batch.behavior_logp, step.sampler_logp, valid, ROLLOUT_LOGP_DTYPE)
    found += [mismatch] if mismatch else []
    mismatch = logp_check("trainer.policy_logp", "logp", batch.logp, step.current_logp, valid, dtype)
    found += [mismatch] if mismatch else []
    mismatch = compare_params(
        "trainer.parameter_gradient",
        record.param_grads,
        step.pulled_back_gradient,
        dtype,
        "the analytic gradient pulled back through the model",
    )
    found += [mismatch] if mismatch else []
    if step.single is not None:
        found += _accumulation(step)
    mismatch = compare_params(
        "trainer.optimizer_step", record.params_after, step.one_optimizer_step, dtype, "one optimizer step with the reported gradient"
    )
    found += [mismatch] if mismatch else []
    if step.beta != 0:
        found += kl_term_mismatches(step)
    return found


def kl_term_mismatches(step: TrainerStep) -> list[Mismatch]:
    """``trainer.kl_term``: the step's loss and d loss / d logp are Algorithm 1's on its mask
    plus ``beta`` times the k3 KL against the reference model (``run.k3_kl``: reference
    log-probs recomputed from the reference snapshot, the loss pass's log-probs, the
    optimizer batch's N), recomputed in float64 and judged at the step's dtype."""
    record, batch, dtype, beta = step.record, step.batch, step.dtype, step.beta
    keep = record.keep.numpy()
    m2po = oracle.evaluate_with_mask(batch, keep)
    assert m2po.grad is not None  # the oracle's result always has its gradient
    kl, kl_grad = step.kl
    n = int(batch.valid.sum())
    how = (
        f"expected Algorithm 1's loss on the step's mask + beta * KL, beta={beta}, KL = sum over the {n} valid tokens of "
        "exp(ref - logp) - (ref - logp) - 1, / N (k3, reference log-probs recomputed from the reference snapshot)"
    )
    found = []
    allowance = exp_rounding(batch, m2po.grad, dtype)
    delta = np.where(batch.valid, step.reference_logp - batch.logp, 0.0)
    # Both terms bound |loss|: the kept M2PO terms and the KL terms, each summed in magnitude.
    scale = float(np.abs(m2po.grad).sum()) + beta * float(np.abs(np.exp(delta) - delta - 1).sum()) / max(n, 1)
    expected_loss = m2po.loss + beta * kl
    mismatch = compare_values(
        "trainer.kl_term", "loss", record.loss, expected_loss, tolerance(dtype, "loss"), scale=scale, allowance=float(allowance.sum())
    )
    if mismatch is not None:
        found.append(
            Mismatch(
                "trainer.kl_term",
                f"loss: reported {record.loss!r}, {how}: {m2po.loss!r} + {beta} * {kl!r} = {expected_loss!r} "
                f"(the reported loss less Algorithm 1's is {record.loss - m2po.loss!r}; beta * KL is {beta * kl!r})",
                "loss",
                None,
                record.loss,
                expected_loss,
                mismatch.details,
            )
        )
    expected_grad = m2po.grad + beta * kl_grad
    tol = tolerance(dtype, "gradient")
    mismatch = compare_values(
        "trainer.kl_term",
        "grad",
        record.token_grad.to(torch.float64).numpy(),
        expected_grad,
        tol,
        scale=float(np.abs(expected_grad).max(initial=0.0)) * tol.rtol,
        allowance=allowance,
    )
    if mismatch is not None:
        index = mismatch.index
        at = (
            ""
            if index is None
            else (
                f" (there: reported {float(record.token_grad[index])!r}, logp {float(batch.logp[index])!r}, reference "
                f"logp {float(step.reference_logp[index])!r}, beta * KL gradient {float(beta * kl_grad[index])!r}, "
                f"Algorithm 1's {float(m2po.grad[index])!r})"
            )
        )
        found.append(
            Mismatch(
                "trainer.kl_term",
                f"d loss / d logp: {mismatch.summary}; expected Algorithm 1's gradient on the step's mask + "
                f"beta * (1 - exp(ref - logp)) / N, beta={beta}, N={n}{at}",
                "grad",
                index,
                mismatch.actual,
                mismatch.expected,
                mismatch.details,
            )
        )
    return found


def _accumulation(step: TrainerStep) -> list[Mismatch]:
    record, single, dtype = step.record, step.single, step.dtype
    assert single is not None  # check_trainer_step calls this for a split step only
    label = f"split {list(record.split)} vs one micro-batch"
    found = []
    keep, one = record.keep.numpy(), single.keep.numpy()
    if not same_up_to_ties(one, keep, valid_m2(step.batch)):
        diff = np.argwhere(keep != one)
        index = tuple(int(i) for i in diff[0])
        found.append(
            Mismatch(
                "trainer.accumulation",
                f"{label}: keep differs at {len(diff)} token(s), first at index {index}: the mask was not selected "
                "once over the optimizer batch",
                "keep",
                index,
                bool(keep[index]),
                bool(one[index]),
            )
        )
    scale = float(np.abs(single.token_grad.to(torch.float64).numpy()).sum())
    mismatch = compare_values("trainer.accumulation", "loss", record.loss, single.loss, tolerance(dtype, "loss"), scale=scale)
    if mismatch:
        found.append(Mismatch(mismatch.check, f"{label}: {mismatch.summary}", "loss", None, record.loss, single.loss, mismatch.details))
    mismatch = compare_params("trainer.accumulation", record.param_grads, single.param_grads, dtype, f"{label}: accumulated gradient")
    found += [mismatch] if mismatch else []
    return found


def trainer_checks_ran(step: TrainerStep) -> tuple[str, ...]:
    """The checks one step ran: the value checks on what the record reports, the trainer's
    own, the accumulation check only when the step had more than one micro-batch, and the
    KL check only when it ran with a KL term (beta != 0)."""
    own = tuple(
        n for n in TRAINER_CHECKS if (n != "trainer.accumulation" or step.single is not None) and (n != "trainer.kl_term" or step.beta)
    )
    return ("call", *checks_run_on(step.m2po_result), *own)
