"""The rank map a plan carries when the optimizer is built on real groups (``step_setup.stage_topology``).

A gloo world of 8 with ``LOCAL_WORLD_SIZE`` 4 stands for two nodes of 4 (ranks 0-3, 4-7). Every
rank builds three optimizers, in one order, on groups made with ``torch.distributed.new_group``:

    dense     TP 2 x DP 4 in Megatron's order (TP groups {0, 1}, ...; DP groups {0, 2, 4, 6},
              {1, 3, 5, 7}), ``owner``: the map is the stage's grid, 0-7, TP inside a node, DP
              across both, two consecutive DP ranks per node
    EP 4      TP 1, expert-DP groups {e, e + 4} (Megatron's expert-DP at EP 4), ``auto``: each
              member on its own node, so no team, where the group's size alone (2 of a node of 4)
              gave teams of 2
    EP 2      TP 1, expert-DP groups {e, e + 2, e + 4, e + 6}, ``auto``: teams of the two members
              that share a node ({e, e + 2}, {e + 4, e + 6}), and those are the groups made for them

Then groups that are no grid's rows and columns (TP {0, 1}, {2, 3}; DP {0, 3}, {1, 2}): the ranks
derive different maps, and the construction refuses them on every rank, naming the rank map.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from matrix_harness import packed_layouts

from megatron_muon.config import MuonConfig
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW, step_plans
from megatron_muon.parallel.team_groups import made_groups
from megatron_muon.plan.hardware import CPU_GLOO
from megatron_muon.plan.topology import Topology

# Compute-bound (slow GEMMs, free collectives), as tests/dist/test_step_setup.py: auto gives the
# large units to teams wherever it may form them. Its own ranks per node (1024) are overridden by
# LOCAL_WORLD_SIZE.
TEAM_HARDWARE = dataclasses.replace(CPU_GLOO, name="compute-bound", matmul_flops=1e6, collective_latency_s=0.0,
                                    kernel_overhead_s=0.0)
SHAPES = [("tall", (48, 12)), ("wide", (12, 60)), ("small", (6, 10))]
PER_NODE = 4


def _optimizer(dp_group, tp_group, tp_mode: str) -> MuonWithAdamW:
    """Muon on ``SHAPES`` cut over the DP group (every TP rank holds its DP range whole)."""
    lays = packed_layouts(SHAPES, dist.get_world_size(dp_group), dist.get_world_size(tp_group))
    params = []
    for lay in lays:
        lo, hi = lay.local_range(dist.get_rank(dp_group))
        params.append(torch.nn.Parameter(torch.zeros(hi - lo)) if hi > lo else None)
    return MuonWithAdamW([dict(params=[p for p in params if p is not None], algorithm="muon")], lr=0.1,
                         config=MuonConfig(tp_mode=tp_mode, fp32_matmul_prec="highest"),
                         catalogue=MatrixCatalogue(tuple(lays), tuple(params), dp_group, tp_group),
                         hardware=TEAM_HARDWARE)


def _mine(groups: list[list[int]], rank: int):
    """Every rank makes every group, in one order; this rank's."""
    made = [dist.new_group(g) for g in groups]
    return next(g for g, ranks in zip(made, groups) if rank in ranks)


def _worker(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # the harness puts the rank's environment back
    out = {}
    dense = _optimizer(_mine([[0, 2, 4, 6], [1, 3, 5, 7]], rank), _mine([[r, r + 1] for r in range(0, 8, 2)], rank),
                       "owner")
    tp1 = _mine([[r] for r in range(world)], rank)
    ep4 = _optimizer(_mine([[e, e + 4] for e in range(4)], rank), tp1, "auto")
    before = {tuple(sorted(dist.get_process_group_ranks(g))) for g in made_groups()}
    ep2 = _optimizer(_mine([[e, e + 2, e + 4, e + 6] for e in range(2)], rank), tp1, "auto")
    teams = {tuple(sorted(dist.get_process_group_ranks(g))) for g in made_groups()} - before
    for name, opt in (("dense", dense), ("ep4", ep4), ("ep2", ep2)):
        out[name] = {kind: (plan.settings.topology, plan.team_size, plan.teams is not None)
                     for kind, plan in opt.plans.items()}
    out["ep2_teams"] = teams
    dp_of = {0: [0, 3], 3: [0, 3], 1: [1, 2], 2: [1, 2]}
    dp_bad = [dist.new_group(g) for g in ([0, 3], [1, 2])]
    tp_bad = [dist.new_group(g) for g in ([0, 1], [2, 3])]
    out["refusal"] = None
    if rank < 4:
        try:
            _optimizer(dp_bad[0 if dp_of[rank] == [0, 3] else 1], tp_bad[rank // 2], "owner")
        except ValueError as e:
            out["refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(8, _worker, timeout=300)


def test_plans_built_on_real_groups_carry_the_stages_rank_map(world):
    for rank, r in enumerate(world):
        (dense_map, dense_team, _), = r["dense"].values()
        assert dense_map == Topology(tuple(range(8)), 2, PER_NODE), (rank, dense_map)
        assert not dense_map.tp_spans_nodes and dense_map.dp_spans_nodes and dense_map.dp_ranks_per_node == 2
        e = rank % 4
        (ep4_map, ep4_team, ep4_teams), = r["ep4"].values()
        assert ep4_map == Topology((e, e + 4), 1, PER_NODE) and ep4_map.dp_ranks_per_node == 1, (rank, ep4_map)
        assert ep4_team == 1 and not ep4_teams, rank
        e = rank % 2
        (ep2_map, ep2_team, ep2_teams), = r["ep2"].values()
        assert ep2_map == Topology((e, e + 2, e + 4, e + 6), 1, PER_NODE), (rank, ep2_map)
        assert ep2_team == 2 and ep2_teams, rank
        # the team group made for EP 2 that this rank is in: its DP group's members on its node
        assert r["ep2_teams"] == {t for t in ((0, 2), (4, 6), (1, 3), (5, 7)) if rank in t}, (rank, r["ep2_teams"])


def test_the_size_of_a_group_alone_would_have_teamed_across_nodes():
    """Not vacuous: EP 4's plan on the contiguous default (its DP 2 read as two consecutive ranks of
    one node) gives teams of 2, each pair on two nodes."""
    config = MuonConfig(tp_mode="auto", fp32_matmul_prec="highest")
    hardware = dataclasses.replace(TEAM_HARDWARE, ranks_per_node=PER_NODE)
    plan = step_plans(config, packed_layouts(SHAPES, 2), 2, 1, hardware)["muon"]
    assert plan.team_size == 2 and plan.teams is not None


def test_groups_that_are_no_grid_are_refused_on_every_rank(world):
    for rank, r in enumerate(world[:4]):
        assert r["refusal"] is not None and "the first difference is in the rank map" in r["refusal"], \
            (rank, r["refusal"])
