"""DP teams at TP 1: ``auto`` runs a unit's Newton–Schulz on a team of DP ranks, exactly.

A tall and a wide matrix (row blocks and column blocks), a fused fc1 (its gate and up are
units of their own) and a small matrix laid out flat and cut into DP ranges at positions that
fall inside rows, as Megatron's distributed optimizer cuts its buckets. Under a compute-bound
hardware profile the joint schedule gives the large units to teams; every rank's scaled piece
must equal the same piece of NS of the whole matrix on one process, and the bytes and FLOPs each
rank spends must be the plan's. Teams of the whole DP group (DP 2, 3, 4) and two teams of two
(DP 4 with two ranks per node).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from rounding_bounds import ns_bound
from step_harness import payload_bytes, run_step, step_plan

from megatron_muon import comm_stats
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.core.scaling import muon_scale
from megatron_muon.plan.hardware import CPU_GLOO
from megatron_muon.plan.teams import team_layout

# Compute-bound (slow GEMMs, free collectives): a team's share of NS is then cheaper than a whole
# NS on one rank, so the schedule gives the large units to teams.
TEAM_HARDWARE = dataclasses.replace(CPU_GLOO, name="compute-bound", matmul_flops=1e6, collective_latency_s=0.0,
                                    kernel_overhead_s=0.0)
# (name, full shape, row split): long dims divisible by 12, so teams of 2, 3 and 4 divide them.
SHAPES = [("tall", (48, 12), None), ("wide", (12, 60), None), ("fc1", (72, 12), RowSplit(1, (36, 36))),
          ("small", (6, 10), None)]
NS = NSOptions(5, "jordan", dtype=torch.float32)


def _layouts(dp: int) -> list[MatrixLayout]:
    """The matrices packed in one flat buffer cut into ``dp`` equal ranges (cuts inside rows)."""
    total = sum(r * c for _, (r, c), _ in SHAPES)
    per = -(-total // dp)
    out, offset = [], 0
    for name, (rows, cols), split in SHAPES:
        ranges = []
        for d in range(dp):
            lo, hi = max(offset, d * per), min(offset + rows * cols, (d + 1) * per)
            ranges.append((lo - offset, hi - offset) if hi > lo else (0, 0))
        out.append(MatrixLayout(name, (rows, cols), None, 1, split, tuple(ranges)))
        offset += rows * cols
    return out


def _matrix(i: int) -> torch.Tensor:
    rows, cols = SHAPES[i][1]
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float32)


def _expected(i: int) -> torch.Tensor:
    """The scaled update of matrix i on one process: NS of each whole sub-matrix, fc1's apart."""
    full = _matrix(i)
    parts = full.split(SHAPES[i][2].sizes, dim=0) if SHAPES[i][2] else [full]
    return torch.cat([NS(p[None])[0] * muon_scale(*p.shape, "spectral", 1.0) for p in parts])


def _bound(i: int) -> float:
    """fp32 NS: the team sums the Gram over its members and (B split) gathers B's row blocks, so
    only the summation order differs from one-process NS: two fp32 NS roundings of each sub-matrix
    (rounding_bounds.ns_bound, as tests/dist/test_tp_modes.py's fp32_bound) times its scale."""
    full = _matrix(i)
    parts = full.split(SHAPES[i][2].sizes, dim=0) if SHAPES[i][2] else [full]
    return max(ns_bound(torch.float32, p, "jordan") * muon_scale(*p.shape, "spectral", 1.0) for p in parts)


def _worker(rank: int, world: int, ranks_per_node: int) -> dict:
    hardware = dataclasses.replace(TEAM_HARDWARE, ranks_per_node=ranks_per_node)
    tp_group = [dist.new_group([r]) for r in range(world)][rank]  # TP 1: each rank its own group
    lays = _layouts(world)
    pieces = [_matrix(i).reshape(-1)[slice(*lay.local_range(rank))].clone() for i, lay in enumerate(lays)]
    with comm_stats() as stats:
        out = run_step(pieces, lays, tp_mode="auto", dp_group=None, tp_group=tp_group, ns_dtype=torch.float32,
                       coefficients="jordan", hardware=hardware)
    with comm_stats() as again:  # the second step reuses the bound exchanges and the team's group
        run_step(pieces, lays, tp_mode="auto", dp_group=None, tp_group=tp_group, ns_dtype=torch.float32,
                 coefficients="jordan", hardware=hardware)
    return {"out": out, "bytes": payload_bytes(stats), "flops": stats.ns_flops, "again": payload_bytes(again)}


@pytest.fixture(scope="module", params=[(2, 1024), (3, 1024), (4, 1024), (4, 2)],
                ids=lambda p: f"dp{p[0]}-node{p[1]}")
def world(request):
    dp, per_node = request.param
    return dp, per_node, run_world(dp, _worker, per_node)


def _plan(dp: int, per_node: int):
    return step_plan(_layouts(dp), tp_mode="auto", dp_size=dp, tp_size=1, ns_dtype=torch.float32,
                     coefficients="jordan", hardware=dataclasses.replace(TEAM_HARDWARE, ranks_per_node=per_node))


def test_the_schedule_uses_teams_of_both_cuts(world):
    """The runs below are not vacuous: teams take a row-blocked and a column-blocked unit."""
    dp, per_node, _ = world
    plan = _plan(dp, per_node)
    assert plan.team_size == min(dp, per_node)
    cuts = {team_layout(plan.units[u].layout, plan.team_size).partition_dim
            for u in range(len(plan.units)) if plan.team_of(u) is not None}
    assert cuts == {0, 1}, cuts


def test_team_units_equal_one_process_newton_schulz(world):
    dp, _, ranks = world
    lays = _layouts(dp)
    for rank, r in enumerate(ranks):
        for i, lay in enumerate(lays):
            want = _expected(i).reshape(-1)[slice(*lay.local_range(rank))]
            assert r["out"][i].shape == want.shape
            err = (r["out"][i] - want).abs().max().item() if want.numel() else 0.0
            assert err <= _bound(i), f"rank {rank} {lay.name}: {err:.2e}"


def test_bytes_and_flops_are_the_plans(world):
    """What each rank sends (the exchange's pieces, the team's all-reduces and gathers) and the NS
    FLOPs it runs are the plan's figures for it, on the first step and the next."""
    dp, per_node, ranks = world
    plan = _plan(dp, per_node)
    # comm floors each all-reduce's 2(t−1)/t share to whole bytes and the plan rounds the sum:
    # under one byte per all-reduce, steps + 2 of them per team unit
    slack = (NS.steps + 2) * sum(1 for u in range(len(plan.units)) if plan.team_of(u) is not None)
    for rank, r in enumerate(ranks):
        assert abs(r["bytes"] - plan.bytes_sent[rank]) < slack and r["again"] == r["bytes"], rank
        assert r["flops"] == plan.ns_flops[rank], rank
