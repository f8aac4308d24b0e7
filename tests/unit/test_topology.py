"""The stage's rank map (``plan.topology``): derived from one rank's groups, and what it answers.

Megatron's rank grids are simulated here as its ``RankGenerator`` numbers them (mixed radix, TP
fastest: tp-cp-ep-dp-pp, the expert grid etp-ep-edp-pp): every rank of a stage must derive the same
map from its own DP and TP groups, and that map must be the grid itself. Where the groups are not
translates of one another the ranks' maps differ, which is what the plan digests' check refuses.
Pure: no process group (``stage_topology`` under gloo: tests/dist/test_rank_map.py).
"""

from __future__ import annotations

import itertools

import pytest

from megatron_muon.parallel.step_setup import launcher_ranks_per_node, stage_topology
from megatron_muon.plan.topology import Topology


def _mixed_radix(sizes: dict[str, int]):
    """Megatron's order: global rank = Σ coordinate × stride, the first dim fastest."""
    strides, stride = {}, 1
    for dim, size in sizes.items():
        strides[dim], stride = stride, stride * size
    return lambda **coords: sum(coords.get(dim, 0) * strides[dim] for dim in sizes)


def _stage_maps(rank_of, tp: int, dp: int, **fixed) -> dict[int, Topology]:
    """Global rank → the map it derives from its own DP group (DP coordinate varies) and TP group."""
    maps = {}
    for d, j in itertools.product(range(dp), range(tp)):
        me = rank_of(tp=j, dp=d, **fixed)
        dp_ranks = [rank_of(tp=j, dp=e, **fixed) for e in range(dp)]
        tp_ranks = [rank_of(tp=k, dp=d, **fixed) for k in range(tp)]
        maps[me] = Topology.from_groups(dp_ranks, tp_ranks, me, 8)
    return maps


def test_every_rank_of_a_megatron_stage_derives_the_grid_itself():
    """TP 2 x CP 1 x EP 1 x DP 4 x PP 3, the stage of PP rank 1: global ranks 8-15, TP fastest."""
    rank_of = _mixed_radix(dict(tp=2, dp=4, pp=3))
    maps = _stage_maps(rank_of, 2, 4, pp=1)
    assert set(maps.values()) == {Topology(tuple(range(8, 16)), 2, 8)}


def test_the_expert_dp_group_strides_by_ep():
    """DeepSeek-V3's expert grid at TP 1 x EP 8 x DP 64 x PP 16, nodes of 8: expert-TP 1, expert-DP
    8, EP rank e's expert-DP ranks e, e + 8, ... inside its stage of 64. Every rank of EP rank 3's
    expert-DP group derives one map, each rank on its own node: no two consecutive share one."""
    rank_of = _mixed_radix(dict(tp=1, ep=8, dp=8, pp=16))  # etp-ep-edp-pp (expert-TP 1)
    maps = _stage_maps(rank_of, 1, 8, ep=3, pp=2)
    (topo,) = set(maps.values())
    assert topo.grid == tuple(2 * 64 + 3 + 8 * d for d in range(8))
    assert topo.dp_spans_nodes and not topo.tp_spans_nodes and topo.dp_ranks_per_node == 1


def test_groups_that_are_not_translates_give_different_maps():
    """TP groups {0, 1}, {2, 3}, DP groups {0, 3}, {1, 2}: no grid has these rows and columns,
    and ranks 0 and 1, one TP group, derive different maps (the digest check then refuses)."""
    dp_of = {0: [0, 3], 3: [0, 3], 1: [1, 2], 2: [1, 2]}
    tp_of = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    maps = {r: Topology.from_groups(dp_of[r], tp_of[r], r, 4) for r in range(4)}
    assert maps[0] != maps[1]


def test_what_the_map_answers():
    contiguous = Topology.contiguous(16, 2, 8)  # TP 2 x DP 16 on nodes of 8: 4 DP ranks per node
    assert not contiguous.tp_spans_nodes and contiguous.dp_spans_nodes and contiguous.dp_ranks_per_node == 4
    tp8 = Topology.contiguous(4, 8, 8)  # TP 8 fills a node: consecutive DP ranks a node apart
    assert not tp8.tp_spans_nodes and tp8.dp_ranks_per_node == 1
    across = Topology((0, 4, 1, 5), 2, 4)  # TP groups {0, 4} and {1, 5}: across two nodes of 4
    assert across.tp_spans_nodes and not across.dp_spans_nodes and across.dp_ranks_per_node == 2
    one_node = Topology.contiguous(8, 1, 1024)
    assert not one_node.dp_spans_nodes and one_node.dp_ranks_per_node == 8


def test_a_rank_outside_its_own_groups_is_refused():
    with pytest.raises(ValueError, match=r"^Topology.from_groups: global rank 5 is not in its own DP group"):
        Topology.from_groups([0, 1], [0], 5, 8)


def test_the_launchers_ranks_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert launcher_ranks_per_node() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert launcher_ranks_per_node() == 8
    for bad in ("0", "eight", "-2"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE: expected the launcher's ranks per node"):
            launcher_ranks_per_node()


def test_no_rank_map_without_a_process_group(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert stage_topology(None, None, None) is None  # one process: the plan keeps the contiguous default
