"""The optimizer's orthogonalize step across TP × DP, without Megatron.

Parameters shaped like a transformer's (fused QKV split per query group, fused gate/up fc1,
a row-parallel weight, a weight that is not TP-split) are laid out in a flat buffer and cut into
equal contiguous DP ranges as Megatron's distributed optimizer cuts its grad buckets, so some
matrices are cut across DP ranks and some are not. Every rank's scaled piece must equal the
same piece of NS of the *global* sub-matrices, computed here on one process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import grid_groups, run_world
from matrix_harness import expected_bound, expected_local, global_matrix, layouts, local_pieces, tp_local
from step_harness import run_step

from megatron_muon import comm_stats, ns_flops
from megatron_muon.plan.hardware import CPU_GLOO
from megatron_muon.plan.owners import plan_unit_owners
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan
from megatron_muon.plan.units import split_units

# auto on a compute-bound machine (the CPU profile with slow GEMMs and no per-call latencies): the
# split sub-matrices then cost the same rank-seconds wide as narrow and run distributed, the
# replicated router another way; so one step mixes modes across DP groups
# (test_auto_mixes_modes_across_the_grid).
# NS at 1 MFLOP/s, communication and memory passes free (the distributed mode's own passes,
# ``core.ns_traffic``, would otherwise tip the tie to narrow): the grid widens what NS alone
# decides, and its plan is priced no higher than owner's (auto runs owner's plan where owner's
# prices lower), so the auto runs below execute the mixed plan
AUTO_HARDWARE = dataclasses.replace(CPU_GLOO, name="compute-bound", matmul_flops=1e6, collective_latency_s=0.0,
                                    kernel_overhead_s=0.0, intra_node_bandwidth=1e18, inter_node_bandwidth=1e18,
                                    memory_bandwidth=1e18, all_reduce_step_s=None)


def _worker(rank: int, world: int, tp: int) -> dict:
    dp = world // tp
    tp_rank, dp_rank, tp_group, dp_group = grid_groups(rank, world, tp)
    results = {}
    for cut in (True, False):
        lays = layouts(tp, dp, cut)
        pieces = local_pieces(lays, lambda i: global_matrix(i, tp), tp, tp_rank, dp_rank)
        for tp_mode in ("duplicated", "distributed", "owner", "blockwise", "auto"):
            dp_modes = ("owner", "redundant") if not cut else ("owner",)
            for dp_mode in dp_modes:
                hardware = {"hardware": AUTO_HARDWARE} if tp_mode == "auto" else {}
                with comm_stats() as stats:
                    out = run_step(
                        pieces, lays, tp_mode=tp_mode, dp_group=dp_group, tp_group=tp_group,
                        dp_mode=dp_mode, ns_dtype=torch.float32, coefficients="jordan", **hardware,
                    )
                results[(cut, tp_mode, dp_mode)] = {
                    "out": out, "bytes": dict(stats.bytes_by_primitive), "flops": stats.ns_flops,
                }
    return {"tp_rank": tp_rank, "dp_rank": dp_rank, "results": results}


@pytest.fixture(scope="module", params=[(2, 1), (2, 2), (4, 2), (4, 1), (3, 1)], ids=lambda p: f"world{p[0]}-tp{p[1]}")
def world(request):
    n, tp = request.param
    return n, tp, run_world(n, _worker, tp)


@pytest.mark.parametrize("cut", [True, False], ids=["dp_cut", "dp_whole"])
@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed", "owner", "auto"])
def test_exact_modes_equal_global_newton_schulz(world, cut, tp_mode):
    n, tp, ranks = world
    dp = n // tp
    lays = layouts(tp, dp, cut)
    for r in ranks:
        for dp_mode in ("owner",) + (("redundant",) if not cut else ()):
            out = r["results"][(cut, tp_mode, dp_mode)]["out"]
            for i, lay in enumerate(lays):
                s, e = lay.local_range(r["dp_rank"])
                want = expected_local(i, lay, tp, r["tp_rank"]).reshape(-1)[s:e]
                err = (out[i] - want).abs().max().item() if e > s else 0.0
                assert out[i].shape == want.shape
                assert err <= expected_bound(i, lay, tp), f"{lay.name} {tp_mode}/{dp_mode} cut={cut}: {err:.2e}"


def test_results_held_on_every_dp_rank_return_by_one_broadcast(world):
    """Plain DDP (no DP ranges): nothing travels to the owner, and each result leaves it once, by a
    broadcast of its own size, never as dp - 1 copies in one all-to-all send buffer (blockwise has
    no TP traffic, so its bytes are the DP exchange's)."""
    n, tp, ranks = world
    dp = n // tp
    if dp == 1:
        return
    lays = layouts(tp, dp, False)
    units = split_units(lays)
    owners = plan_unit_owners(lays, units, dp)
    for r in ranks:
        got = r["results"][(False, "blockwise", "owner")]["bytes"]
        assert got.get("all_to_all", 0) == 0
        assert got.get("broadcast", 0) == sum(u.layout.numel * 4 for u, o in zip(units, owners) if o == r["dp_rank"])


def test_auto_mixes_modes_across_the_grid():
    """The auto runs above are exact with several modes in one step: at TP2 x DP2 on the cut layout
    the joint schedule gives the split sub-matrices distributed and the replicated router another
    mode, on both DP groups. (tests/dist/test_auto_mode.py runs narrow and wide in one call.)"""
    lays = layouts(2, 2, True)
    plan = build_step_plan(lays, dp_size=2, tp_size=2, settings=PlanSettings("auto", hardware=AUTO_HARDWARE))
    modes = {m for w in plan.work for m in w.modes}
    assert "distributed" in modes and len(modes) >= 2, modes
    assert len(set(plan.dp_owners)) == 2  # both DP groups work


def test_blockwise_differs_from_exact_only_when_tp_splits(world):
    """With TP > 1 blockwise is a different algorithm; with TP = 1 the block is the whole matrix,
    so it must equal the exact result."""
    n, tp, ranks = world
    lays = layouts(tp, n // tp, False)
    r = ranks[0]
    got = r["results"][(False, "blockwise", "owner")]["out"][2]  # fc1
    want = expected_local(2, lays[2], tp, r["tp_rank"]).reshape(-1)
    gap = (got - want).abs().max().item()
    if tp > 1:  # 10× the exactness bound: the exact-mode check above tells the two apart
        assert gap > 10 * expected_bound(2, lays[2], tp), f"blockwise matched exact NS at TP={tp} (gap {gap:.2e})"
    else:
        assert gap <= expected_bound(2, lays[2], tp), f"blockwise at TP=1 should be exact NS (gap {gap:.2e})"


def test_dp_replicas_agree_bitwise(world):
    """Plain DDP: every DP replica must end with the very same update (upstream's bug)."""
    n, tp, ranks = world
    for key in [(False, m, d) for m in ("duplicated", "distributed", "owner") for d in ("owner", "redundant")]:
        for r in ranks:
            twin = [q for q in ranks if q["tp_rank"] == r["tp_rank"]]
            for q in twin:
                for a, b in zip(r["results"][key]["out"], q["results"][key]["out"]):
                    assert torch.equal(a, b), f"DP replicas differ for {key}"


def test_only_cut_or_moved_matrices_travel_across_dp(world):
    n, tp, ranks = world
    dp = n // tp
    if dp == 1:  # no DP group: nothing may travel across DP (blockwise has no TP traffic either)
        assert all(r["results"][(True, "blockwise", "owner")]["bytes"].get("all_to_all", 0) == 0 for r in ranks)
        return
    lays = layouts(tp, dp, True)
    # The exchange moves units (fc1's gate and up apart), a unit pinned only where its weight is whole
    units = split_units(lays)
    owners = plan_unit_owners(lays, units, dp)
    # Bytes of pieces not already on their owner, there and back, fp32, summed over the DP
    # group — once per TP rank (each TP rank runs its own DP exchange).
    moved = sum(
        2 * (e - s) * 4
        for unit, o in zip(units, owners)
        for d, (s, e) in enumerate(unit.layout.dp_ranges)
        if d != o
    )
    # blockwise has no TP traffic, so all its all-to-all bytes are the DP exchange.
    total = sum(r["results"][(True, "blockwise", "owner")]["bytes"].get("all_to_all", 0) for r in ranks)
    assert total == moved * tp
    whole = [lay.name for lay in lays if len(lay.holders(dp)) == 1]
    assert whole, "the layout should leave some matrices uncut"
    for unit, o in zip(units, owners):
        lay = lays[unit.weight]
        if len(lay.holders(dp)) == 1:
            assert o == next(iter(lay.holders(dp))), f"{lay.name} lies on one rank but is owned elsewhere"


def test_plain_ddp_owner_runs_each_matrix_once(world):
    n, tp, ranks = world
    lays = layouts(tp, n // tp, False)
    total_owner = sum(r["results"][(False, "owner", "owner")]["flops"] for r in ranks)
    total_redundant = sum(r["results"][(False, "owner", "redundant")]["flops"] for r in ranks)
    once = sum(lay.ns_cost(5) for lay in lays)
    assert total_owner == once
    assert total_redundant == once * (n // tp)


def _rounds_worker(rank: int, world: int, tp: int) -> dict:
    dp = world // tp
    tp_rank, dp_rank, tp_group, dp_group = grid_groups(rank, world, tp)
    lays = layouts(tp, dp, cut=True)
    pieces = local_pieces(lays, lambda i: global_matrix(i, tp), tp, tp_rank, dp_rank)
    out = {}
    for bucket_bytes in (1, 2**30):  # one matrix per exchange round, or a single round
        with comm_stats() as stats:
            result = run_step(pieces, lays, tp_mode="owner", dp_group=dp_group,
                                           tp_group=tp_group, ns_dtype=torch.float32,
                                           coefficients="jordan", bucket_bytes=bucket_bytes)
        out[bucket_bytes] = (result, stats.ns_flops)
    return out


def test_exchange_rounds_do_not_change_the_tp_plan():
    # The step runs in bucket-sized micro-groups, but the TP owner plan must balance over all a
    # DP owner's matrices at once: planning per round (from zero load each time) put the largest
    # sub-matrix of every round on TP rank 0. The per-rank NS FLOPs and the results must not
    # depend on the bucket size. The owners are the same and each matrix goes through the same
    # ops; only which matrices share a stacked NS batch changes. A batched GEMM of another batch
    # count need not block each entry alike (nothing in MKL or oneDNN promises it, on another CPU
    # or thread count), so the bound is the exact modes' (matrix_harness.expected_bound; measured
    # 0 here); a matrix's update in another's place is off by its entries' size, ~0.3·scale.
    ranks = run_world(4, _rounds_worker, 2)
    lays = layouts(2, 2, cut=True)
    for r in ranks:
        (one_per_round, flops_small), (single, flops_big) = r[1], r[2**30]
        assert flops_small == flops_big
        for i, (a, b) in enumerate(zip(one_per_round, single, strict=True)):
            assert (a - b).abs().max().item() <= expected_bound(i, lays[i], 2) if a.numel() else True
    # The planner's own guarantee, per TP group: the DP owner d of a set of matrices spreads their
    # sub-matrices over its TP group by LPT, so (Graham's list-scheduling bound) no TP rank gets
    # more than the group's mean plus (1 - 1/t) of its largest sub-matrix; and the group does the
    # owned sub-matrices' NS exactly once (the sum is conserved).
    tp, dp = 2, 2
    lays = layouts(tp, dp, cut=True)
    units = split_units(lays)
    owners = plan_unit_owners(lays, units, dp)
    for d in range(dp):
        costs = [ns_flops(*shape, 5) for u, unit in enumerate(units) if owners[u] == d
                 for shape in unit.layout.sub_global_shapes()]
        group = [ranks[d * tp + j][2**30][1] for j in range(tp)]
        assert sum(group) == sum(costs), f"DP owner {d}: NS FLOPs {group} do not add up to {sum(costs)}"
        assert max(group) <= sum(costs) / tp + (1 - 1 / tp) * max(costs), f"DP owner {d}: {group} unbalanced"
