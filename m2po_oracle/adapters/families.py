"""The signature families public M2PO code uses, as data: one :class:`Adapter` record each.

An adapter turns a port of its family into a contract implementation
(``fn(logp, behavior_logp, advantages, mask, *, tau) -> {loss, keep, metrics}``). It says
what the port is called with (:class:`~m2po_oracle.adapters.binding.Param`), where its
results are (:class:`~m2po_oracle.adapters.binding.Output`), which result fields the port
itself computes (``supplies``) and which the adapter builds (``builds``). A check on a
field the adapter builds, or one the adapter's own construction makes unfalsifiable
(``unobservable``), is "not run", never "pass".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from m2po_oracle.adapters.binding import METRIC_NAMES, PORT_DEFAULT, BoundCall, Config, Output, Param, bound_metric_names
from m2po_oracle.capture.watch_reading import ALIASES
from m2po_oracle.core.loss import loss_from_selection, select_tokens
from m2po_oracle.errors import UnreadableReturn
from m2po_oracle.judge.checks import CHECKS, DISTRIBUTED_CHECKS, result_field
from m2po_oracle.judge.contract import Implementation

#: The budget's names, as ``capture.watch`` reads them: a port reads the one it knows.
BUDGET_NAMES: tuple[str, ...] = ALIASES["tau"]


@dataclass(frozen=True)
class Adapter:
    name: str
    signature: str
    checked: tuple[str, ...]  # what of the port's results is checked, in words
    wrap: Callable[[BoundCall], Implementation]
    #: The result fields (``M2POResult`` names) the port itself computes; the diagnosis
    #: compares a variant with the port on these only (the adapter built the rest).
    supplies: frozenset[str] = frozenset({"keep"})
    params: tuple[Param, ...] = ()
    outputs: tuple[Output, ...] = ()
    #: Fields the adapter computes itself, with how: their checks are not run.
    builds: Mapping[str, str] = field(default_factory=dict)
    #: Checks the adapter's own construction decides (they could not fail), with why.
    unobservable: Mapping[str, str] = field(default_factory=dict)
    #: How the port's metrics reach ours (for the listing).
    maps: str = "none (the family returns no metrics)"
    #: The family as seen in public code (for the listing).
    seen_in: str = ""
    #: The port returns no mask: the adapter reads it from the port's zero gradients, so a
    #: kept token whose gradient the port's own loss zeroes reads as removed.
    keep_inferred: bool = False
    #: A distributed port: it runs under ``--topology`` (its wrap takes ``parallel=``) and
    #: is judged by the distributed checks.
    distributed: bool = False

    @property
    def judged_by(self) -> tuple[str, ...]:
        """The checks of the runner this adapter's ports run under."""
        return ("call", *DISTRIBUTED_CHECKS) if self.distributed else tuple(CHECKS)

    def supplies_with(self, bindings: tuple[str, ...] = ()) -> frozenset[str]:
        """``supplies`` plus the metrics ``bindings`` read back from a place of their own."""
        return self.supplies | bound_metric_names(bindings)

    def not_run(self, bindings: tuple[str, ...] = ()) -> dict[str, str]:
        """The battery's checks this adapter cannot run on a port, each with why."""
        supplied = self.supplies_with(bindings)
        skipped: dict[str, str] = {}
        for check in self.judged_by:
            judged = result_field(check)
            if check in self.unobservable:
                skipped[check] = self.unobservable[check]
            elif judged is not None and judged not in supplied:
                skipped[check] = (
                    f"the adapter builds {judged}: {self.builds[judged]}"
                    if judged in self.builds
                    else f"the port returns no {judged} here (bind it: --bind {judged}=INDEX)"
                )
        return skipped

    def runs(self, bindings: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The checks this adapter can run (a metric only when the port returns it)."""
        skipped = self.not_run(bindings)
        return tuple(check for check in self.judged_by if check not in skipped)


# --- helpers: translating the contract's tensors, reading results back ------------------


def _condition(mask: torch.Tensor) -> torch.Tensor:
    """The mask as a condition even when a probe hands over a float mask: the port, not
    the adapter, is the one to refuse it."""
    return mask if mask.dtype == torch.bool else mask != 0


def _as_keep(value: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if isinstance(value, (list, tuple)) and value and all(isinstance(row, torch.Tensor) for row in value):
        # One mask per row (ports that edit per-sequence lists return them so).
        if len(shape) != 2 or len(value) != shape[0] or any(tuple(row.shape) != tuple(shape[1:]) for row in value):
            raise UnreadableReturn(
                f"{what}: expected a tensor of shape {tuple(shape)} or {shape[0] if shape else 0} rows of shape "
                f"{tuple(shape[1:])}, got a {type(value).__name__} of {len(value)} tensors of shapes "
                f"{sorted({tuple(row.shape) for row in value})}"
            )
        value = torch.stack(list(value))
    if not isinstance(value, torch.Tensor):
        raise UnreadableReturn(f"{what}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise UnreadableReturn(f"{what}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    # Masks are often float 0/1 in these ports; a value other than 0/1 is not a mask.
    if value.dtype != torch.bool:
        if not bool(((value == 0) | (value == 1)).all()):
            raise UnreadableReturn(f"{what}: expected a bool or 0/1 mask, got values other than 0 and 1")
        value = value != 0
    # Not and-ed with the loss mask: a port that keeps padding is caught by keep_only_valid.
    return value.detach()


def _reference_keep(logp: torch.Tensor, behavior_logp: Any, advantages: Any, mask: torch.Tensor, tau: Any) -> torch.Tensor:
    """Algorithm 1's mask (the core's); on input the core refuses (a validation probe), the
    loss mask, so that the port still meets the invalid input and its own answer counts."""
    try:
        return select_tokens(logp.detach(), behavior_logp, advantages, mask, tau=tau).keep
    except (ValueError, TypeError):
        return _condition(mask)


def _objective(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    condition = _condition(mask)
    try:
        return loss_from_selection(logp, behavior_logp, advantages, keep & condition, condition.sum())
    except (TypeError, RuntimeError, AttributeError):
        # Only a validation probe the port accepted gets here (no behavior_logp, a wrong
        # shape): the port answered, so the probe must see a result, not the adapter's error.
        return logp.new_zeros(())


def _differentiable_loss(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise UnreadableReturn(
            f"{what}: expected a differentiable 0-d tensor, got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    return value.reshape(())


def _keep_from_gradient(
    loss: torch.Tensor, logp: torch.Tensor, behavior_logp: Any, advantages: Any, mask: torch.Tensor, tau: Any
) -> torch.Tensor:
    """The mask of a port that returns only a loss: a valid token with exactly zero gradient
    was masked. A kept token's gradient -exp(d) * A / N is zero too when A == 0 or the
    product underflows: the port's choice for such a token is unobservable (it changes
    neither loss nor gradient), so it is completed with the core's choice and not judged."""
    (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
    grad = torch.zeros_like(logp) if grad is None else grad
    condition = _condition(mask)
    with torch.no_grad():
        try:
            valid_count = condition.sum().clamp(min=1)
            kept_gradient = (
                torch.where(condition, torch.exp(logp.detach() - behavior_logp) * advantages, torch.zeros_like(logp)) / valid_count
            )
        except (TypeError, RuntimeError):  # only a validation probe the port accepted (no behavior_logp, a wrong shape)
            return condition & (grad != 0)
        observable = kept_gradient != 0
        completion = condition if bool(observable[condition].all()) else _reference_keep(logp, behavior_logp, advantages, mask, tau)
    return condition & torch.where(observable, grad != 0, completion)


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # verl-style losses multiply by the response mask: it is a float tensor there.
    return mask.to(like.dtype) if mask.dtype == torch.bool else mask


# --- the families --------------------------------------------------------------------------


def _noting_missing_behavior(call: BoundCall, derived: str, behavior_missing: bool, **values: Any) -> Any:
    """Call the port; when behavior_logp is missing (the fail-closed probe) and the port
    takes ``derived`` (built from it) instead, an exception it raises says that the None it
    choked on was the adapter's, so that a crash is not read as the port's own arithmetic."""
    try:
        return call(**values)
    except Exception as error:
        receiver = call.receiving(derived)
        if behavior_missing and receiver is not None and call.receiving("behavior_logp") is None:
            note = (
                f"the adapter passed {receiver}=None: it builds {derived} from behavior_logp, which this call lacks "
                "(the port cannot tell a missing behavior_logp from a missing argument)"
            )
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(note)
        raise


def _mask_only(call: BoundCall) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        condition = _condition(mask)
        log_ratio = None if behavior_logp is None else torch.where(condition, logp.detach() - behavior_logp, torch.zeros_like(logp))
        returned = _noting_missing_behavior(
            call, "log_ratio", behavior_logp is None, log_ratio=log_ratio, advantages=advantages, mask=mask, budget=tau
        )
        keep = _as_keep(call.read(returned, "keep"), tuple(logp.shape), "keep returned by the mask-only function")
        return {"loss": _objective(logp, behavior_logp, advantages, mask, keep), "keep": keep, **call.metrics(returned)}

    return implementation


def _mask_function(call: BoundCall) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        returned = call(behavior_logp=behavior_logp, logp=logp.detach(), mask=mask, budget=tau, advantages=advantages)
        keep = _as_keep(call.read(returned, "keep"), tuple(logp.shape), "loss_mask returned by the mask function")
        return {"loss": _objective(logp, behavior_logp, advantages, mask, keep), "keep": keep, **call.metrics(returned)}

    return implementation


def _masked_loss(call: BoundCall) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        keep = _reference_keep(logp, behavior_logp, advantages, mask, tau)
        returned = call(behavior_logp=behavior_logp, logp=logp, advantages=advantages, mask=mask, m2po_mask=keep, budget=tau)
        loss = _differentiable_loss(call.read(returned, "loss"), "the loss returned by the masked loss")
        return {"loss": loss, "keep": keep, **call.metrics(returned)}

    return implementation


def _per_token_loss(call: BoundCall) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        returned = call(logp=logp, behavior_logp=behavior_logp, advantages=advantages, mask=mask, budget=tau)
        per_token = call.read(returned, "per_token_loss")
        if not isinstance(per_token, torch.Tensor) or tuple(per_token.shape) != tuple(logp.shape):
            raise UnreadableReturn(
                f"per_token_loss: expected a tensor of shape {tuple(logp.shape)}, got "
                + (f"shape {tuple(per_token.shape)}" if isinstance(per_token, torch.Tensor) else type(per_token).__name__)
            )
        keep = _as_keep(call.read(returned, "keep"), tuple(logp.shape), "keep returned by the per-token loss")
        condition = _condition(mask)
        # The caller's reduction, Algorithm 1's: the sum over valid tokens over N before masking.
        loss = torch.where(condition, per_token, per_token.new_zeros(())).sum() / condition.sum().clamp(min=1)
        return {"loss": loss, "keep": keep, **call.metrics(returned)}

    return implementation


def policy_loss_config(tau: float) -> Config:
    """The config object handed to a policy-loss function: the budget under the names ports
    use, at the top level and in a nested ``policy_loss`` (verl's ``config.policy_loss``),
    both readable as attributes, with ``.get`` and with ``[]``."""
    budget = dict.fromkeys(BUDGET_NAMES, tau)
    return Config(
        **budget,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        # verl 0.9.1's registered losses aggregate with agg_loss(**config.global_batch_info); empty
        # (ActorConfig's default) it divides by the call's own valid tokens: one call, one batch.
        global_batch_info={},
        policy_loss=Config(loss_mode="m2po", **budget),
    )


def _loss_only() -> Callable[[BoundCall], Implementation]:
    """A family whose port returns the loss only: the mask is read from its gradient."""

    def wrap(call: BoundCall) -> Implementation:
        def implementation(logp, behavior_logp, advantages, mask, *, tau):
            ppo_kl = None if behavior_logp is None else behavior_logp - logp  # old - new, differentiable through logp
            returned = _noting_missing_behavior(
                call,
                "ppo_kl",
                behavior_logp is None,
                behavior_logp=behavior_logp,
                logp=logp,
                advantages=advantages,
                mask=_float_mask(mask, logp),
                budget=tau,
                config=policy_loss_config(tau),
                ppo_kl=ppo_kl,
            )
            loss = _differentiable_loss(call.read(returned, "loss"), "the loss returned by the port")
            keep = _keep_from_gradient(loss, logp, behavior_logp, advantages, mask, tau)
            return {"loss": loss, "keep": keep, **call.metrics(returned)}

        return implementation

    return wrap


def _pack(x: Any, valid: torch.Tensor) -> Any:
    """The valid tokens of ``x`` in row order (x passed as is if it cannot be packed: a
    probe's wrong shape then reaches the port, whose refusal is what counts)."""
    if not isinstance(x, torch.Tensor) or x.shape != valid.shape:
        return x
    return x[valid]


def _packed(call: BoundCall) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        valid = _condition(mask)
        lengths = valid.sum(dim=1)
        cu_seqlens = torch.zeros(valid.shape[0] + 1, dtype=torch.int32, device=valid.device)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        returned = call(
            logp=_pack(logp, valid),
            behavior_logp=_pack(behavior_logp, valid),
            advantages=_pack(advantages, valid),
            mask=_pack(mask, valid),
            cu_seqlens=cu_seqlens,
            lengths=[int(n) for n in lengths],
            budget=tau,
        )
        loss = _differentiable_loss(call.read(returned, "loss"), "the loss returned by the packed port")
        packed_keep = _as_keep(
            call.read(returned, "keep"), (int(valid.sum()),), "keep returned by the packed port (one value per packed token)"
        )
        keep = torch.zeros_like(valid)
        keep[valid] = packed_keep
        return {"loss": loss, "keep": keep, **call.metrics(returned)}

    return implementation


def _group(call: BoundCall) -> Implementation:
    """A port that takes the pure data-parallel process group (``group=``): called in every
    rank of a ``--topology`` world with that rank's rows and ``parallel.dp_group``."""

    def implementation(logp, behavior_logp, advantages, mask, *, tau, parallel):
        returned = call(logp=logp, behavior_logp=behavior_logp, advantages=advantages, mask=mask, budget=tau, group=parallel.dp_group)
        return {"loss": call.read(returned, "loss"), "keep": call.read(returned, "keep"), **call.metrics(returned)}

    return implementation


_METRICS = frozenset(METRIC_NAMES)
_ALGORITHM_1_OBJECTIVE = {"loss": "Algorithm 1's objective on the port's mask", "grad": "autograd of that objective"}
_MAPPED = "the keys of the returned metrics mapping that name ours (mapped as listed below)"
_INFERRED = {
    "selection.keep_only_valid": "the mask is inferred from the gradient on valid tokens only (padding's gradient is judged by 'gradient')"
}

ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter(
            "mask_only",
            "fn(log_ratio, advantages, mask, tau) -> keep | (keep, metrics)",
            ("selection", "metrics it returns"),
            _mask_only,
            frozenset({"keep"}) | _METRICS,
            params=(Param("log_ratio", "log_ratio"), Param("advantages", "advantages"), Param("mask", "mask"), Param("budget", "tau")),
            outputs=(Output("keep", (0,)), Output("metrics", (1,), optional=True)),
            builds=_ALGORITHM_1_OBJECTIVE,
            maps=_MAPPED,
            seen_in="selection helpers; mask functions returning (mask, metrics)",
        ),
        Adapter(
            "mask_function",
            "fn(behavior_logp, proximal_logp, loss_mask, threshold[, advantages]) -> loss_mask | (loss_mask, metrics)",
            ("selection", "metrics it returns"),
            _mask_function,
            frozenset({"keep"}) | _METRICS,
            params=(
                Param("behavior_logp", "behavior_logp"),
                Param("logp", "proximal_logp"),
                Param("mask", "loss_mask"),
                Param("budget", "threshold"),
                Param("advantages", "advantages", optional=True),
            ),
            outputs=(Output("keep", (0,)), Output("metrics", (1,), optional=True)),
            builds=_ALGORITHM_1_OBJECTIVE,
            maps=_MAPPED,
            seen_in="AReaL-style mask functions (without advantages every valid token is a candidate: expect selection.only_trust_region_masked)",
        ),
        Adapter(
            "masked_loss",
            "fn(old_log_prob, log_prob, advantages, response_mask, m2po_mask[, loss_agg_mode='token-mean']) -> loss | (loss, metrics)",
            ("loss and gradient on Algorithm 1's mask", "metrics it returns"),
            _masked_loss,
            frozenset({"loss", "grad"}) | _METRICS,
            params=(
                Param("behavior_logp", "old_log_prob"),
                Param("logp", "log_prob"),
                Param("advantages", "advantages"),
                Param("mask", "response_mask"),
                Param("m2po_mask", "m2po_mask"),
                Param("loss_agg_mode", "loss_agg_mode", optional=True, value="token-mean"),
                Param("budget", "tau", optional=True),
            ),
            outputs=(Output("loss", (0,)), Output("metrics", (1,), optional=True)),
            builds={"keep": "Algorithm 1's mask (the core's), handed to the port as m2po_mask"},
            maps=_MAPPED,
            seen_in="losses that take a precomputed M2PO mask next to the log-probs",
        ),
        Adapter(
            "per_token_loss",
            "fn(log_prob, old_log_prob, advantages, response_mask, m2_budget) -> (per_token_loss, keep[, metrics])",
            ("selection", "loss (reduced by the adapter: sum over valid tokens / N)", "gradient", "metrics it returns"),
            _per_token_loss,
            frozenset({"keep", "loss", "grad"}) | _METRICS,
            params=(
                Param("logp", "log_prob"),
                Param("behavior_logp", "old_log_prob"),
                Param("advantages", "advantages"),
                Param("mask", "response_mask"),
                Param("budget", "m2_budget"),
            ),
            outputs=(Output("per_token_loss", (0,)), Output("keep", (1,)), Output("metrics", (2,), optional=True)),
            maps=_MAPPED,
            seen_in="per-token losses the trainer reduces itself",
        ),
        Adapter(
            "policy_loss",
            "fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) -> loss | (loss, metrics, ...)",
            ("selection (inferred from zero gradients)", "loss", "gradient", "metrics it returns"),
            _loss_only(),
            frozenset({"keep", "loss", "grad"}) | _METRICS,
            params=(
                Param("behavior_logp", "old_log_prob"),
                Param("logp", "log_prob"),
                Param("advantages", "advantages"),
                Param("mask", "response_mask"),
                Param("loss_agg_mode", "loss_agg_mode", value="token-mean"),
                Param("config", "config"),
                Param("budget", "config.policy_loss.m2_budget"),
            ),
            outputs=(Output("loss", (0,)), Output("metrics", (1,), optional=True)),
            unobservable=_INFERRED,
            keep_inferred=True,
            maps=_MAPPED,
            seen_in=f"verl's policy-loss registry; config carries the budget as {', '.join(BUDGET_NAMES)}, at the top and in config.policy_loss",
        ),
        Adapter(
            "verl_release",
            "fn(old_log_prob, log_prob, advantages, response_mask, M2_budget, miniclip_low=None, miniclip_high=None, "
            "loss_agg_mode='token-mean') -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower, stats)",
            ("selection (inferred from zero gradients)", "loss", "gradient", "metrics in stats"),
            _loss_only(),
            frozenset({"keep", "loss", "grad"}) | _METRICS,
            params=(
                Param("behavior_logp", "old_log_prob"),
                Param("logp", "log_prob"),
                Param("advantages", "advantages"),
                Param("mask", "response_mask"),
                Param("budget", "M2_budget"),
                Param("miniclip_low", "miniclip_low", optional=True, value=PORT_DEFAULT),
                Param("miniclip_high", "miniclip_high", optional=True, value=PORT_DEFAULT),
                Param("loss_agg_mode", "loss_agg_mode", optional=True, value="token-mean"),
            ),
            outputs=(Output("loss", (0,)), Output("metrics", (4,), optional=True)),
            unobservable=_INFERRED,
            keep_inferred=True,
            maps="the keys of stats that name ours (mapped as listed below); the release's M2_after is its capped mean, not ours, and is not mapped",
            seen_in="the authors' release on a verl 0.4 fork (its minimum clip floors are passed only where bound: the port's own defaults apply, "
            "as shipped; --bind miniclip_low=None --bind miniclip_high=None turns them off)",
        ),
        Adapter(
            "clip_kernel",
            "fn(ppo_kl, advantages, budget, response_mask[, loss_agg_mode='token-mean']) -> (pg_loss, clipfrac, *scalars)",
            ("selection (inferred from zero gradients)", "loss", "gradient", "scalars bound to a metric (--bind m2_before=2)"),
            _loss_only(),
            frozenset({"keep", "loss", "grad"}),
            params=(
                Param("ppo_kl", "ppo_kl"),
                Param("advantages", "advantages"),
                Param("budget", "budget"),
                Param("mask", "response_mask"),
                Param("loss_agg_mode", "loss_agg_mode", optional=True, value="token-mean"),
            ),
            outputs=(Output("loss", (0,)),),
            unobservable=_INFERRED,
            keep_inferred=True,
            maps="none by default: bind a returned scalar to a metric, e.g. --bind m2_before=2 --bind masked_fraction=1",
            seen_in="clip kernels ported from the release that take ppo_kl = old - new (differentiable) first",
        ),
        Adapter(
            "packed",
            "fn(log_probs, old_log_probs, advantages, loss_mask, [cu_seqlens | response_lengths], tau) -> (loss, keep[, metrics]) | mapping",
            ("selection (unpacked)", "loss", "gradient", "metrics it returns"),
            _packed,
            frozenset({"keep", "loss", "grad"}) | _METRICS,
            params=(
                Param("logp", "log_probs"),
                Param("behavior_logp", "old_log_probs"),
                Param("advantages", "advantages"),
                Param("mask", "loss_mask"),
                Param("cu_seqlens", "cu_seqlens", optional=True),
                Param("lengths", "response_lengths", optional=True),
                Param("budget", "tau"),
            ),
            outputs=(Output("loss", (0,)), Output("keep", (1,)), Output("metrics", (2,), optional=True)),
            unobservable={
                "padding_immunity": "the adapter packs valid tokens only: padding never reaches the port",
                "selection.keep_only_valid": "the adapter unpacks the port's mask onto valid tokens only",
            },
            maps=_MAPPED,
            seen_in="Megatron/slime-style trainers: 1-D tokens of all sequences concatenated, with cu_seqlens (int32, B+1) or per-sample lengths",
        ),
        Adapter(
            "group",
            "fn(logp, behavior_logp, advantages, mask, *, tau, group) -> {loss, keep, metrics...} (with --topology dp=N[,tp=N]; cp=1)",
            ("keep", "loss share", "gradient", "metrics it returns, on every rank"),
            _group,
            frozenset({"keep", "loss", "grad"}) | _METRICS,
            params=(
                Param("logp", "logp"),
                Param("behavior_logp", "behavior_logp"),
                Param("advantages", "advantages"),
                Param("mask", "mask"),
                Param("budget", "tau"),
                Param("group", "group"),
            ),
            outputs=(Output("loss", (0,)), Output("keep", (1,)), Output("metrics", (2,), optional=True)),
            maps=_MAPPED,
            distributed=True,
            seen_in="distributed ports that take a torch.distributed process group (the pure data-parallel one) instead of parallel=; "
            "each rank's loss is over its whole rows, so context parallelism (cp > 1, where a rank's share is its CP shard) is refused",
        ),
    )
}
