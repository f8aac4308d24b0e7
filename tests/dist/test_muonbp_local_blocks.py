"""MuonBP's local blocks (``--muonbp-block local``): each DP rank orthogonalizes the blocks of its own
pieces, and a block step sends nothing.

The reference is built here in 2-D, independently of ``plan.local_blocks``: the TP-local weight's
sub-matrices come from ``MatrixLayout.split_rows`` of an index matrix; a block is a sub-matrix's rows
lying wholly in the rank's flat range (gathered), or one row the range cuts (the elements held); its
update is ``newton_schulz`` of the block times ``muon_scale`` of the block's shape.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import grid_groups, run_world
from matrix_harness import PARAMS, global_matrix, layouts, local_pieces, tp_local
from rounding_bounds import ns_bound

from megatron_muon import comm_stats, newton_schulz
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.core.scaling import muon_scale
from megatron_muon.parallel.orthogonalize import StepGroups, orthogonalize_updates
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan

NS = NSOptions(5, "jordan", dtype=torch.float32)


def _odd_cut_layouts(tp: int, dp: int) -> list[MatrixLayout]:
    """matrix_harness's params back to back, cut into DP ranges 3 elements longer than an even
    share: the cuts fall inside rows, so ranges start and end with partial rows."""
    sizes = [r * c for _, (r, c), *_ in PARAMS]
    shard = -(-sum(sizes) // dp) + 3
    out, offset = [], 0
    for (name, shape, pdim, split), n in zip(PARAMS, sizes):
        spans = [(max(offset, d * shard), min(offset + n, (d + 1) * shard)) for d in range(dp)]
        ranges = tuple((lo - offset, hi - offset) if hi > lo else (0, 0) for lo, hi in spans)
        out.append(MatrixLayout(name, shape, pdim, tp, RowSplit(*split) if split else None, ranges))
        offset += n
    return out


def _settings(local: bool) -> PlanSettings:
    return PlanSettings("blockwise", NS, local_blocks=local)


def _worker(rank: int, world: int, tp: int) -> dict:
    dp = world // tp
    tp_rank, dp_rank, tp_group, dp_group = grid_groups(rank, world, tp)
    groups = StepGroups(dp_group, tp_group)
    out = {}
    for cut in (True, False):
        lays = _odd_cut_layouts(tp, dp) if cut else layouts(tp, dp, False)
        pieces = local_pieces(lays, lambda i: global_matrix(i, tp), tp, tp_rank, dp_rank)
        for local in (True, False):
            plan = build_step_plan(lays, dp_size=dp, tp_size=tp, settings=_settings(local))
            with comm_stats() as stats:
                got = orthogonalize_updates(pieces, plan, groups)
            out[(cut, local)] = dict(out=got, bytes=stats.bytes_sent, calls=sum(stats.calls.values()),
                                     flops=stats.ns_flops, plan_flops=plan.ns_flops[rank])
    return {"tp_rank": tp_rank, "dp_rank": dp_rank, "results": out}


@pytest.fixture(scope="module", params=[(2, 1), (4, 2), (4, 1)], ids=lambda p: f"world{p[0]}-tp{p[1]}")
def world(request):
    n, tp = request.param
    return n, tp, run_world(n, _worker, tp)


def _reference(i: int, lay, tp: int, tp_rank: int, dp_rank: int) -> tuple[torch.Tensor, float]:
    """The rank's update and how far a batched computation of it may be: the blocks' fp32 NS
    run stacked in the step and one at a time here, so the GEMMs may sum in another order; two
    fp32 NS roundings of each block (rounding_bounds.ns_bound) times its scale."""
    s, e = lay.local_range(dp_rank)
    bound = 0.0
    values = tp_local(global_matrix(i, tp), lay.partition_dim, tp, tp_rank).reshape(-1)
    want = torch.zeros(e - s)
    rows, cols = lay.local_shape
    index = torch.arange(rows * cols).view(rows, cols)
    for sub in lay.split_rows(index):  # each sub-matrix's rows, as indices into the flat weight
        whole = [r for r in sub if s <= int(r[0]) and int(r[-1]) < e]
        if whole:
            idx = torch.cat(whole)
            block = values[idx].view(len(whole), cols)
            want[idx - s] = newton_schulz(block, 5, "jordan").reshape(-1) * muon_scale(len(whole), cols)
            bound = max(bound, ns_bound(torch.float32, block, "jordan") * muon_scale(len(whole), cols))
    for row in index:  # the rows the range cuts: a block each
        held = row[(row >= s) & (row < e)]
        if 0 < len(held) < cols:
            want[held - s] = newton_schulz(values[held].view(1, -1), 5, "jordan").reshape(-1) * muon_scale(1, len(held))
            bound = max(bound, ns_bound(torch.float32, values[held].view(1, -1), "jordan") * muon_scale(1, len(held)))
    return want, bound


def test_local_blocks_equal_one_process_ns_of_the_same_blocks_and_send_nothing(world):
    n, tp, ranks = world
    dp = n // tp
    lays = _odd_cut_layouts(tp, dp)
    partial = 0
    for r in ranks:
        res = r["results"][(True, True)]
        assert res["bytes"] == 0 and res["calls"] == 0  # no collective of any kind
        assert res["flops"] == res["plan_flops"]
        for i, lay in enumerate(lays):
            want, bound = _reference(i, lay, tp, r["tp_rank"], r["dp_rank"])
            # fp32 NS of the same blocks; only batching differs (_reference's bound: 1e-4 … 2e-3;
            # a block cut elsewhere or scaled by another shape is off by 1e-2 … 1)
            assert (res["out"][i] - want).abs().max().item() <= bound if want.numel() else True, lay.name
            s, e = lay.local_range(r["dp_rank"])
            partial += e > s and (s % lay.local_shape[1] or e % lay.local_shape[1])
    assert partial, "the layout should cut some rows, so that partial-row blocks are checked"


def test_where_every_dp_rank_holds_whole_shards_local_is_the_tp_shard_block(world):
    n, tp, ranks = world
    for r in ranks:
        local, shard = r["results"][(False, True)], r["results"][(False, False)]
        assert local["bytes"] == 0
        lays = layouts(tp, n // tp, False)
        for i, (a, b) in enumerate(zip(local["out"], shard["out"], strict=True)):
            # the same blocks (the TP shard's sub-matrices, every DP rank holding them whole), in
            # other batches: _reference's bound, which for whole shards is that of their blocks
            bound = _reference(i, lays[i], tp, r["tp_rank"], r["dp_rank"])[1]
            assert (a - b).abs().max().item() <= bound if a.numel() else True


def test_cut_matrices_move_under_tp_shard_and_not_under_local(world):
    """The point of the option: at DP >= 2 with cut matrices, tp_shard's block step reassembles
    them on their DP owners (bytes > 0); local sends nothing."""
    n, tp, ranks = world
    assert sum(r["results"][(True, False)]["bytes"] for r in ranks) > 0
    assert all(r["results"][(True, True)]["bytes"] == 0 for r in ranks)
