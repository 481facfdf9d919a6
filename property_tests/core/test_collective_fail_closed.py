"""Collective fail-closed: one rank's invalid input makes every rank refuse the step.

Each probe breaks one rank's input (m2po_oracle.distributed.validation); with the core every
rank of the data-parallel group must raise the same ValueError, naming the failing rank and
the argument, promptly, and no rank may hang. The negative control (each rank validating
alone, the core's old order) must hang or crash, or the probes test nothing.

One warm world per size is shared by the probes; the file shares the distributed xdist
group with test_distributed.py so that worlds do not compete for the two cores.
"""

from __future__ import annotations

import multiprocessing
import re

import pytest

from m2po_oracle.distributed.topology import Topology
from m2po_oracle.distributed.validation import COLLECTIVE_PROBES, collective_probe, probe_seconds, rank_probe, run_collective_probes
from m2po_oracle.distributed.world import World

pytestmark = pytest.mark.xdist_group("distributed")

SIZES = [2, 4]
#: Every rank must have refused within this long of its call.
PROMPT_S = 5.0
FAIL_CLOSED = ["core", "core:micro_batches"]


def _leftover_ranks() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("m2po-rank:")]


@pytest.fixture(scope="module")
def worlds():
    """One warm world per size, closed (and checked for leftover ranks) at the end."""
    opened: dict[int, World] = {}
    already = {p.pid for p in _leftover_ranks()}  # another module's worlds, not ours

    def get(size: int) -> World:
        if size not in opened:
            opened[size] = World(Topology.parse(f"dp={size}"), backend="gloo", timeout_s=30)
        return opened[size]

    yield get
    for world in opened.values():
        world.close()
    left = [p for p in _leftover_ranks() if p.pid not in already]
    assert not left, f"rank processes left alive after closing the worlds: {left}"


def _every_rank_refuses(world: World, spec: str, name: str, ranks: list[int] | None = None) -> str:
    """Runs one probe; asserts every rank raised the same ValueError promptly; returns it."""
    payload = {"spec": spec, "probe": name, **({"ranks": ranks} if ranks else {})}
    outcomes = world.run(rank_probe, payload)  # a hang or a dead rank raises WorldError here
    values = [o.value for o in outcomes]
    assert [v["status"] for v in values] == ["rejected"] * len(values), f"{spec}/{name}: not every rank refused: {values}"
    assert {(v["type"], v["message"]) for v in values} == {("ValueError", values[0]["message"])}, (
        f"{spec}/{name}: ranks raised different errors: {values}"
    )
    seconds = probe_seconds(outcomes)
    assert max(seconds) < PROMPT_S, f"{spec}/{name}: the slowest rank took {max(seconds):.2f} s to refuse (limit {PROMPT_S} s): {seconds}"
    return values[0]["message"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("spec", FAIL_CLOSED)
@pytest.mark.parametrize("name", [p.name for p in COLLECTIVE_PROBES])
def test_every_rank_raises_the_same_error_naming_the_failing_rank_and_argument(name, spec, size, worlds):
    p = collective_probe(name)
    message = _every_rank_refuses(worlds(size), spec, name)
    assert message.startswith(f"{p.argument}: "), f"{name}: the error must name {p.argument!r} first, got {message!r}"
    assert re.search(rf"\brank {p.rank}\b", message), f"{name}: the error must name the failing rank {p.rank}, got {message!r}"
    if name == "tau_differs":
        assert message == "tau: the ranks disagree (rank 0: 0.04, rank 1: 0.0); every rank must pass the same budget", message
    else:
        assert f"on rank {p.rank} of the group's {size} (1 of {size} ranks failed validation; every rank refuses the step): " in message, (
            message
        )


def test_the_missing_behaviour_logprobs_message_carries_the_rank_own_reason(worlds):
    message = _every_rank_refuses(worlds(2), "core", "behavior_logp_missing")
    assert message == (
        "behavior_logp: missing on rank 1 of the group's 2 (1 of 2 ranks failed validation; every rank refuses the step): "
        "required (the rollout engine's log-probs of the sampled tokens); M2PO fails closed rather than fall back to a recomputed policy"
    )


def test_several_failing_ranks_are_all_counted_and_the_lowest_is_named(worlds):
    message = _every_rank_refuses(worlds(4), "core", "nan_logp_on_valid_token", ranks=[3, 1])
    assert message.startswith(
        "logp: invalid on rank 1 of the group's 4 (2 of 4 ranks failed validation; ranks 1, 3; every rank refuses the step): "
        "expected finite values on valid tokens (mask True), got nan at index (0, 1)"
    ), message


@pytest.mark.parametrize("size", SIZES)
def test_the_agreement_is_one_small_collective_before_any_selection_round(size, worlds):
    """On refusal nothing but the agreement ran; on valid input it adds one 256-byte all-gather."""
    outcomes = worlds(size).run(rank_probe, {"spec": "core", "probe": "behavior_logp_missing"})
    for o in outcomes:
        assert o.value["collectives"] == {"all_gather": {"calls": 1, "bytes": 256}}, f"rank {o.rank}: {o.value['collectives']}"


@pytest.mark.parametrize("size", SIZES)
def test_valid_input_costs_exactly_one_all_gather_of_256_bytes_more_than_validating_alone(size, worlds):
    world = worlds(size)
    clean = {"probe": "behavior_logp_missing", "ranks": []}  # no rank corrupted
    agreed = world.run(rank_probe, {"spec": "core", **clean})
    alone = world.run(rank_probe, {"spec": "control:locally_validated_core", **clean})
    for with_agreement, without in zip(agreed, alone):
        assert with_agreement.value["status"] == without.value["status"] == "accepted", (with_agreement.value, without.value)
        before, after = without.value["collectives"], with_agreement.value["collectives"]
        expected = {
            **before,
            "all_gather": {
                "calls": before.get("all_gather", {}).get("calls", 0) + 1,
                "bytes": before.get("all_gather", {}).get("bytes", 0) + 256,
            },
        }
        assert after == expected, f"rank {with_agreement.rank}: the agreement should add one 256-byte all_gather: {before} -> {after}"


@pytest.mark.parametrize("size", SIZES)
def test_the_battery_reduces_the_core_to_rejected(size, worlds):
    results = run_collective_probes(worlds(size), "core")
    assert [r.status for r in results] == ["rejected"] * len(COLLECTIVE_PROBES), results
    assert all(f"every rank ({size}) raised within" in r.message for r in results), [r.message for r in results]


def test_the_negative_control_validating_alone_hangs_or_crashes():
    """Each rank validating alone, then entering the selection (the core's old order): the
    bad rank refuses while its peers wait in the first all-reduce (or gloo aborts them). A
    tau that differs between ranks passes every rank's own check; since the selection's
    rounds read nothing on the host, the ranks no longer fall out of step over it: each
    returns a result computed with its own tau, which is accepted, never rejected."""
    already = {p.pid for p in _leftover_ranks()}  # the warm worlds of the other tests
    world = World(Topology.parse("dp=2"), backend="gloo", timeout_s=5)
    try:
        results = run_collective_probes(world, "control:locally_validated_core")
    finally:
        world.close()
    statuses = {r.probe: r.status for r in results}
    assert set(statuses.values()) <= {"hung", "crashed", "accepted"}, results
    assert statuses["tau_differs"] == "accepted", statuses
    assert {status for probe, status in statuses.items() if probe != "tau_differs"} <= {"hung", "crashed"}, statuses
    left = [p for p in _leftover_ranks() if p.pid not in already]
    assert not left, f"rank processes left alive after the control's world was closed: {left}"
