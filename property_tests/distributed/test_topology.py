"""Rank and shard arithmetic of m2po_oracle.topology against hand-checked tables, properties
over every small world, and (when megatron-core is installed) Megatron itself."""

from __future__ import annotations

import importlib.util
import itertools
import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m2po_oracle.distributed.topology import (
    GROUP_KINDS,
    RankCoords,
    Topology,
    cp_chunk_ids,
    cp_reconstruct,
    cp_shard,
    cp_token_indices,
    dp_row_slices,
)

# Written out by hand from rank = tp_rank + tp * (cp_rank + cp * dp_rank); never computed.
# Each entry: coords of ranks 0.. as (dp, cp, tp), then every group of every kind.
TABLE = {
    "dp=2,cp=2,tp=2": (
        [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)],
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    "dp=1,cp=2,tp=1": (
        [(0, 0, 0), (0, 1, 0)],
        {"tp": [[0], [1]], "cp": [[0, 1]], "dp": [[0], [1]], "dp_cp": [[0, 1]]},
    ),
    "dp=2,cp=1,tp=2": (
        [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)],
        {"tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]], "dp_cp": [[0, 2], [1, 3]]},
    ),
}

# (seq_len, cp) -> positions held by CP ranks 0, 1, ...
CP_LAYOUT = {
    (8, 2): [[0, 1, 6, 7], [2, 3, 4, 5]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    (8, 1): [[0, 1, 2, 3, 4, 5, 6, 7]],
    (5, 1): [[0, 1, 2, 3, 4]],
}

SMALL_WORLDS = [Topology(dp=d, cp=c, tp=t) for d in range(1, 5) for c in range(1, 5) for t in range(1, 5) if d * c * t <= 8]
worlds = st.sampled_from(SMALL_WORLDS)


# --- hand-checked tables ------------------------------------------------------------------


@pytest.mark.parametrize("text", sorted(TABLE))
def test_table_coords_and_rank(text):
    topo = Topology.parse(text)
    coords, _ = TABLE[text]
    assert topo.world_size == len(coords)
    for rank, (dp, cp, tp) in enumerate(coords):
        assert topo.coords(rank) == RankCoords(dp=dp, cp=cp, tp=tp)
        assert topo.rank(dp=dp, cp=cp, tp=tp) == rank


@pytest.mark.parametrize("text", sorted(TABLE))
def test_table_groups(text):
    topo = Topology.parse(text)
    _, groups = TABLE[text]
    assert set(groups) == set(GROUP_KINDS)
    for kind, expected in groups.items():
        assert topo.groups(kind) == expected, kind
        for group in expected:
            for rank in group:
                assert topo.group_of(rank, kind) == group, (kind, rank)


@pytest.mark.parametrize(("seq_len", "cp"), sorted(CP_LAYOUT))
def test_table_cp_layout(seq_len, cp):
    for cp_rank, expected in enumerate(CP_LAYOUT[(seq_len, cp)]):
        held = cp_token_indices(seq_len, cp, cp_rank)
        assert held.dtype == np.int64
        assert held.tolist() == expected
        x = np.arange(3 * seq_len).reshape(3, seq_len)
        assert cp_shard(x, cp, cp_rank).tolist() == [[row * seq_len + i for i in expected] for row in range(3)]


def test_table_cp_chunk_ids():
    assert [cp_chunk_ids(1, 0)] == [(0, 1)]
    assert [cp_chunk_ids(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [cp_chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_table_dp_row_slices():
    assert dp_row_slices(7, 3) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert dp_row_slices(2, 4) == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    assert dp_row_slices(0, 2) == [slice(0, 0), slice(0, 0)]
    assert dp_row_slices(8, 1) == [slice(0, 8)]


def test_parse_and_str():
    assert Topology.parse("dp=2,cp=2,tp=1") == Topology(dp=2, cp=2, tp=1)
    assert Topology.parse(" tp=2 , dp=3 ") == Topology(dp=3, cp=1, tp=2)
    assert Topology.parse("cp=4") == Topology(dp=1, cp=4, tp=1)
    assert str(Topology(dp=2, cp=2, tp=1)) == "dp=2,cp=2,tp=1"
    assert Topology(dp=np.int64(2), cp=1, tp=1) == Topology(dp=2, cp=1, tp=1)


# --- properties over every world with dp, cp, tp in 1..4 and at most 8 ranks ---------------


@given(worlds)
def test_coords_rank_round_trip(topo):
    assert Topology.parse(str(topo)) == topo
    seen = set()
    for rank in range(topo.world_size):
        at = topo.coords(rank)
        assert 0 <= at.dp < topo.dp and 0 <= at.cp < topo.cp and 0 <= at.tp < topo.tp
        assert topo.rank(dp=at.dp, cp=at.cp, tp=at.tp) == rank
        seen.add(at)
    assert len(seen) == topo.world_size


@given(worlds)
def test_groups_partition_the_ranks(topo):
    sizes = {"tp": topo.tp, "cp": topo.cp, "dp": topo.dp, "dp_cp": topo.dp * topo.cp}
    for kind in GROUP_KINDS:
        groups = topo.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size)), kind
        assert all(g == sorted(g) and len(g) == sizes[kind] for g in groups), kind
        assert [g[0] for g in groups] == sorted(g[0] for g in groups), kind
        for rank in range(topo.world_size):
            assert topo.group_of(rank, kind) == next(g for g in groups if rank in g)
    # Megatron keeps a TP group on consecutive ranks (one node's NVLink domain).
    assert all(g == list(range(g[0], g[0] + topo.tp)) for g in topo.groups("tp"))


@given(worlds)
def test_group_members_share_the_right_coordinates(topo):
    shared = {"tp": ("dp", "cp"), "cp": ("dp", "tp"), "dp": ("cp", "tp"), "dp_cp": ("tp",)}
    for kind, axes in shared.items():
        for rank in range(topo.world_size):
            at = topo.coords(rank)
            members = [r for r in range(topo.world_size) if all(getattr(topo.coords(r), a) == getattr(at, a) for a in axes)]
            assert topo.group_of(rank, kind) == members


@given(worlds)
def test_dp_cp_group_is_union_of_dp_groups_and_of_cp_groups(topo):
    # For every rank r: the dp_cp group of r is the disjoint union of the cp dp-groups of its
    # members (one per CP rank) and also of the dp cp-groups of its members (one per DP
    # rank); r's dp group and cp group lie in it and meet only in r.
    for rank in range(topo.world_size):
        dp_cp = topo.group_of(rank, "dp_cp")
        dp_groups = {tuple(topo.group_of(r, "dp")) for r in dp_cp}
        cp_groups = {tuple(topo.group_of(r, "cp")) for r in dp_cp}
        assert len(dp_groups) == topo.cp and sorted(r for g in dp_groups for r in g) == dp_cp
        assert len(cp_groups) == topo.dp and sorted(r for g in cp_groups for r in g) == dp_cp
        dp, cp = set(topo.group_of(rank, "dp")), set(topo.group_of(rank, "cp"))
        assert dp <= set(dp_cp) and cp <= set(dp_cp) and dp & cp == {rank}
        assert set(dp_cp) & set(topo.group_of(rank, "tp")) == {rank}


@given(
    cp=st.integers(1, 4),
    batch=st.integers(1, 3),
    chunk=st.integers(1, 5),
    dtype=st.sampled_from([np.float64, np.float32, np.int64, np.bool_]),
    seed=st.integers(0, 2**32 - 1),
)
def test_cp_shard_reconstruct_round_trip(cp, batch, chunk, dtype, seed):
    seq_len = 2 * cp * chunk
    x = (np.random.default_rng(seed).standard_normal((batch, seq_len)) * 10).astype(dtype)
    shards = [cp_shard(x, cp, r) for r in range(cp)]
    assert all(s.shape == (batch, seq_len // cp) and s.dtype == x.dtype for s in shards)
    back = cp_reconstruct(shards, cp)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)
    held = [cp_token_indices(seq_len, cp, r) for r in range(cp)]
    assert sorted(np.concatenate(held).tolist()) == list(range(seq_len))


@given(rows=st.integers(0, 40), dp_size=st.integers(1, 8))
def test_dp_row_slices_cover_rows_contiguously(rows, dp_size):
    slices = dp_row_slices(rows, dp_size)
    assert len(slices) == dp_size
    assert slices[0].start == 0 and slices[-1].stop == rows
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert sizes == [len(part) for part in np.array_split(np.arange(rows), dp_size)]


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("dp=0", "'dp=0'"),
        ("dp=2,dp=2", "duplicate topology key 'dp'"),
        ("xp=2", "unknown topology key 'xp'"),
        ("dp=two", "'dp=two'"),
        ("dp=-1", "'dp=-1'"),
        ("dp=2,", "''"),
        ("", "empty"),
    ],
)
def test_parse_rejects(text, names):
    with pytest.raises(ValueError, match="expected 'KEY=N'") as info:
        Topology.parse(text)
    assert names in str(info.value)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: Topology(dp=0, cp=1, tp=1), "dp must be an integer >= 1"),
        (lambda: Topology(dp=1, cp=True, tp=1), "cp must be an integer >= 1"),
        (lambda: Topology(dp=1, cp=1, tp=1.5), "tp must be an integer >= 1"),
        (lambda: Topology(2, 2, 2).coords(8), "rank must be in 0..7"),
        (lambda: Topology(2, 2, 2).coords(-1), "rank must be an integer >= 0"),
        (lambda: Topology(2, 2, 2).rank(dp=0, cp=2, tp=0), "cp must be in 0..1"),
        (lambda: Topology(2, 2, 2).group_of(9, "tp"), "rank must be in 0..7"),
        (lambda: cp_token_indices(6, 2, 0), "seq_len = 6"),
        (lambda: cp_token_indices(8, 2, 2), "cp_rank must be in 0..1"),
        (lambda: cp_chunk_ids(0, 0), "cp_size must be an integer >= 1"),
        (lambda: cp_shard(np.zeros((2, 6)), 2, 0), "seq_len"),
        (lambda: cp_reconstruct([np.zeros((1, 4))], 2), "one array per CP rank"),
        (lambda: cp_reconstruct([np.zeros((1, 4)), np.zeros((1, 2))], 2), "one shape"),
        (lambda: cp_reconstruct([np.zeros((1, 3)), np.zeros((1, 3))], 2), "even"),
        (lambda: dp_row_slices(-1, 2), "rows must be an integer >= 0"),
        (lambda: dp_row_slices(3, 0), "dp_size must be an integer >= 1"),
    ],
)
def test_bad_arguments_raise_naming_them(make, names):
    with pytest.raises(ValueError) as info:
        make()
    assert names in str(info.value)


@pytest.mark.parametrize("call", ["groups", "group_of"])
def test_unknown_group_kind_lists_known_kinds(call):
    topo = Topology(2, 2, 2)
    with pytest.raises(ValueError, match="'pp'") as info:
        topo.groups("pp") if call == "groups" else topo.group_of(0, "pp")
    assert str(GROUP_KINDS) in str(info.value)


# --- megatron-core cross-check ------------------------------------------------------------


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


MEGATRON_WORLDS = ("dp=2,cp=2,tp=1", "dp=1,cp=2,tp=2")
MEGATRON_BATCH = (2, 16)  # B, T: T a multiple of 2 * cp
WORLD_DEADLINE_S = 45.0


def _megatron_rank(rank: int, text: str, store_path: str, out_path: str) -> None:
    """One rank of a gloo world: writes the groups and CP slice Megatron gives this rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    topo = Topology.parse(text)
    store = dist.FileStore(store_path, topo.world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=topo.world_size, timeout=timedelta(seconds=30))
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=topo.tp,
            context_parallel_size=topo.cp,
            distributed_timeout_minutes=1,
            create_gloo_process_groups=False,
        )
        groups = {
            "tp": parallel_state.get_tensor_model_parallel_group(),
            "cp": parallel_state.get_context_parallel_group(),
            "dp": parallel_state.get_data_parallel_group(with_context_parallel=False),
            "dp_cp": parallel_state.get_data_parallel_group(with_context_parallel=True),
        }
        b, t = MEGATRON_BATCH
        tokens = get_batch_on_this_cp_rank({"tokens": torch.arange(b * t).reshape(b, t)})["tokens"]
        result = {
            "groups": {kind: dist.get_process_group_ranks(group) for kind, group in groups.items()},
            "coords": {
                "dp": parallel_state.get_data_parallel_rank(),
                "cp": parallel_state.get_context_parallel_rank(),
                "tp": parallel_state.get_tensor_model_parallel_rank(),
            },
            "tokens": tokens.tolist(),
        }
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)


def _megatron_launcher(tmp: str) -> None:
    """Runs every world in MEGATRON_WORLDS; also dumps Megatron's RankGenerator for SMALL_WORLDS."""
    # Own process group, so the test can kill this launcher and its ranks in one call.
    os.setsid()
    # Importing megatron.core takes seconds; paying it once here and forking the ranks
    # keeps the test short where spawning every rank would pay it per rank.
    from megatron.core.parallel_state import RankGenerator

    tokens = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp"}
    generated = {
        str(topo): {
            kind: RankGenerator(tp=topo.tp, ep=1, dp=topo.dp, pp=1, cp=topo.cp, order="tp-cp-ep-dp-pp").get_ranks(token)
            for kind, token in tokens.items()
        }
        for topo in SMALL_WORLDS
    }
    with open(os.path.join(tmp, "rank_generator.json"), "w") as f:
        json.dump(generated, f)

    fork = multiprocessing.get_context("fork")
    for index, text in enumerate(MEGATRON_WORLDS):
        store = os.path.join(tmp, f"store{index}")
        procs = [
            fork.Process(target=_megatron_rank, args=(rank, text, store, os.path.join(tmp, f"world{index}_rank{rank}.json")))
            for rank in range(Topology.parse(text).world_size)
        ]
        for proc in procs:
            proc.start()
        end = time.monotonic() + WORLD_DEADLINE_S
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _run_megatron(tmp: str) -> None:
    launcher = multiprocessing.get_context("spawn").Process(target=_megatron_launcher, args=(tmp,))
    launcher.start()
    launcher.join(30 + WORLD_DEADLINE_S * len(MEGATRON_WORLDS))
    if launcher.is_alive():
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            launcher.kill()
        launcher.join()
        pytest.fail("the megatron-core worlds did not finish within their deadline")


def _read(path: str) -> object:
    if not os.path.exists(path):
        pytest.fail(f"megatron-core run left no result at {path}: that rank failed or timed out")
    with open(path) as f:
        return json.load(f)


# One test rather than several sharing a fixture: under pytest-xdist each worker would
# otherwise start its own megatron worlds.
@pytest.mark.skipif(not _have_megatron(), reason="megatron-core is not installed")
def test_megatron_agrees(tmp_path):
    """Megatron's process groups, rank getters and CP batch slicing in real gloo worlds, and
    its RankGenerator over every small world, against Topology and cp_shard."""
    _run_megatron(str(tmp_path))
    generated = _read(os.path.join(tmp_path, "rank_generator.json"))
    for topo in SMALL_WORLDS:
        for kind in GROUP_KINDS:
            assert generated[str(topo)][kind] == topo.groups(kind), (str(topo), kind)

    b, t = MEGATRON_BATCH
    tokens = np.arange(b * t).reshape(b, t)
    for index, text in enumerate(MEGATRON_WORLDS):
        topo = Topology.parse(text)
        for rank in range(topo.world_size):
            got = _read(os.path.join(tmp_path, f"world{index}_rank{rank}.json"))
            for kind in GROUP_KINDS:
                assert got["groups"][kind] == topo.group_of(rank, kind), (text, rank, kind)
            assert RankCoords(**got["coords"]) == topo.coords(rank), (text, rank)
            assert got["tokens"] == cp_shard(tokens, topo.cp, topo.coords(rank).cp).tolist(), (text, rank)
