"""Per-head QKV (``--muon-split-qkv-per-head``) at TP above the query groups: every head of a fused
QKV orthogonalized on its own, whether TP's row cut falls on head boundaries or inside heads.

megatron-core (``Attention.get_query_key_value_tensors``, num_query_groups < TP) gives each TP rank
a contiguous 1/TP of the whole weight's rows, ``[q heads; k; v]`` per query group, and reports one
query group per rank (``num_query_groups_per_partition`` 1, the group's query heads). A rank's
slice then ends on a head boundary when TP divides the head count (query, k and v heads), else
inside a head: 4 query heads in 1 group at TP4 are 6 heads over 4 ranks, 1.5 each.

The reference is one process, as in ``test_per_head.py``: the whole update cut into its heads by
row slices here, each head's NS alone, scaled by the head's shape, cut back to the TP rank's rows
and the DP rank's range. The layouts come from ``param_marks.matrix_layout`` with the marks
``catalogue.tag_qkv`` sets from such a module. TP2 (every cut on a head boundary) and TP4 (one
QKV aligned, two with heads cut), at DP 1 and at DP 2 with ZeRO-1 ranges cutting heads; every
mode. The TP bytes: a head whole on its rank moves nothing, a cut head its other holder's rows.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import grid_groups, run_world
from matrix_harness import local_pieces
from per_head_harness import (NS, flat_ranges, per_head_reference, plan_settings, residual64, residual_tolerance,
                              tp_traffic, whole_reference)
from rounding_bounds import ns_bound, sum_bound, unit_roundoff

from megatron_muon import comm_stats, newton_schulz
from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.core.scaling import muon_scale
from megatron_muon.parallel import comm
from megatron_muon.parallel.orthogonalize import StepGroups, orthogonalize_updates
from megatron_muon.parallel.step_stats import ResidualProbe
from megatron_muon.plan.hardware import hardware_profile
from megatron_muon.plan.param_marks import ParamMarks, RowSplits, matrix_layout
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan

HIDDEN, HEAD_DIM = 16, 4
# name, query heads, query groups: at TP4 "cut" is 6 heads over 4 ranks (1.5 each), "aligned" 12
# heads (3 each), "wide" 10 heads (2.5 each); at TP2 all three are cut on head boundaries
ATTENTIONS = [("cut.linear_qkv", 4, 1), ("aligned.linear_qkv", 8, 2), ("wide.linear_qkv", 8, 1)]
PROJ = ("cut.linear_proj", (HIDDEN, 4 * HEAD_DIM))  # RowParallel, split along dim 1: not per head
MODES = ("owner", "duplicated", "distributed", "auto", "blockwise")
PER_HEAD = RowSplits(qkv_per_head=True)


def heads_total(k: int) -> int:
    _, heads, groups = ATTENTIONS[k]
    return heads + 2 * groups


def marks(k: int, tp: int) -> ParamMarks:
    """A ColumnParallel fused QKV's marks as ``catalogue.tag_qkv`` sets them from megatron-core's
    attention module: below TP query groups one group per rank with all the group's query heads."""
    _, heads, groups = ATTENTIONS[k]
    per_group = heads // groups
    return ParamMarks(tensor_parallel=True, partition_dim=0, qkv_split=(per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM),
                      qkv_heads=(max(groups // tp, 1), per_group, HEAD_DIM), qkv_groups=groups)


def model_layouts(tp: int, dp: int, cut: bool) -> list[MatrixLayout]:
    """The QKV weights and a projection, back to back in one flat buffer; ``cut``: ZeRO-1 cutting
    heads across DP ranks (``per_head_harness.flat_ranges``)."""
    shapes = [(heads_total(k) * HEAD_DIM // tp, HIDDEN) for k in range(len(ATTENTIONS))]
    shapes.append((HIDDEN, PROJ[1][1] // tp))
    ranges = flat_ranges([r * c for r, c in shapes], dp, cut)
    out = [matrix_layout(ATTENTIONS[k][0], shapes[k], marks(k, tp), tp, PER_HEAD, ranges[k])
           for k in range(len(ATTENTIONS))]
    out.append(matrix_layout(PROJ[0], shapes[-1], ParamMarks(tensor_parallel=True, partition_dim=1), tp, PER_HEAD,
                             ranges[-1]))
    return out


def full_update(k: int) -> torch.Tensor:
    """Matrix k's whole update (every TP rank's rows or columns), seeded by index."""
    shape = (heads_total(k) * HEAD_DIM, HIDDEN) if k < len(ATTENTIONS) else PROJ[1]
    return torch.randn(shape, generator=torch.Generator().manual_seed(90 + k))


def reference(k: int, tp: int, tp_rank: int) -> tuple[torch.Tensor, float]:
    """This TP rank's rows of matrix k's update, one process, and how far the step may be from it:
    a QKV per head (``per_head_harness``: each head_dim rows of megatron-core's layout NS'd alone,
    times the head's shape's scale), the projection whole. The step runs the heads batched, a cut
    head reassembled from its rows (which moves values, not roundings). A half head's NS, or two
    heads' together, is off by 1e-1 or more."""
    full = full_update(k)
    return whole_reference(full, tp, tp_rank) if k >= len(ATTENTIONS) else per_head_reference(full, HEAD_DIM, tp,
                                                                                             tp_rank)


def moved_rows(k: int, tp: int, tp_rank: int) -> int:
    """Rows of QKV k this TP rank sends over TP, there and back, counted from the row cut alone:
    a head split between ranks gathers on the one holding most of its rows (the lowest of a tie);
    every other holder sends its rows there, the owner sends them back."""
    per_rank, sent = heads_total(k) * HEAD_DIM // tp, 0
    for h in range(heads_total(k)):
        held = [max(0, min((h + 1) * HEAD_DIM, (r + 1) * per_rank) - max(h * HEAD_DIM, r * per_rank))
                for r in range(tp)]
        owner = held.index(max(held))
        sent += sum(held) - held[owner] if tp_rank == owner else held[tp_rank]
    return sent


def _worker(rank: int, world: int, tp: int) -> dict:
    dp = world // tp
    tp_rank, dp_rank, tp_group, dp_group = grid_groups(rank, world, tp)
    groups = StepGroups(dp_group, tp_group)
    out = {}
    for cut in (True, False):
        lays = model_layouts(tp, dp, cut)
        pieces = local_pieces(lays, full_update, tp, tp_rank, dp_rank)
        for mode in MODES:
            plan = build_step_plan(lays, dp_size=dp, tp_size=tp, settings=plan_settings(mode))
            records = []
            probe = ResidualProbe(frozenset(range(len(ATTENTIONS))), lambda w, x: records.append((w, float(x))))
            got = orthogonalize_updates(pieces, plan, groups, residuals=probe)
            per_qkv = []
            for k in range(len(ATTENTIONS)):  # one QKV at a time: its own TP traffic
                alone = build_step_plan(lays[k:k + 1], dp_size=dp, tp_size=tp, settings=plan_settings(mode))
                orthogonalize_updates(pieces[k:k + 1], alone, groups)  # binds and checks: not counted
                tp_elements, stats = tp_traffic(
                    lambda k=k, alone=alone: orthogonalize_updates(pieces[k:k + 1], alone, groups), groups.tp)
                owner_dp = alone.owner_of[alone.units_of(0)[0]]
                per_qkv.append(dict(tp_elements=tp_elements, flops=stats.ns_flops,
                                    plan_tp_bytes=alone.tp_bytes[rank], plan_flops=alone.ns_flops[rank],
                                    owns=owner_dp == dp_rank, modes=alone.tp_modes_of(0),
                                    per_rank=lays[k].per_rank, tp_blocks=lays[k].tp_blocks is not None))
            out[(cut, mode)] = dict(out=got, per_qkv=per_qkv, residuals=records)
    return {"tp_rank": tp_rank, "dp_rank": dp_rank, "results": out}


@pytest.fixture(scope="module", params=[(2, 2), (4, 4), (4, 2), (8, 4)], ids=lambda p: f"world{p[0]}-tp{p[1]}")
def world(request):
    n, tp = request.param
    # TP4 x DP2 takes 8 processes: a world of its own, not kept in the pool of the 1-4 worlds
    return n, tp, run_world(n, _worker, tp, fresh=n > 4)


def test_layouts_follow_the_row_cut():
    """Below TP query groups: per rank where every TP rank's cut falls on a head boundary, else the
    whole weight's heads, each with the rows every TP rank holds of it."""
    lays = model_layouts(4, 1, cut=False)
    assert [lay.per_rank for lay in lays[:3]] == [False, True, False]
    assert lays[0].tp_blocks == (HEAD_DIM,) * 6 and lays[2].tp_blocks == (HEAD_DIM,) * 10
    # 6 heads of 4 rows over 4 ranks of 6 rows: heads 1 and 4 cut in halves
    assert [sub.tp_rows for sub in lays[0].sub_matrices()][:2] == [((0, 4), (0, 0), (0, 0), (0, 0)),
                                                                   ((0, 2), (2, 4), (0, 0), (0, 0))]
    assert lays[1].sub_global_shapes() == [(HEAD_DIM, HIDDEN)] * 3
    assert all(lay.per_rank for lay in model_layouts(2, 1, cut=False)[:3])


@pytest.mark.parametrize("mode", MODES)
def test_per_head_updates_equal_one_process_ns_of_each_head_alone(world, mode):
    n, tp, ranks = world
    dp = n // tp
    cut_heads = 0
    for cut in (True, False):
        lays = model_layouts(tp, dp, cut)
        for r in ranks:
            got = r["results"][(cut, mode)]["out"]
            for k, lay in enumerate(lays):
                if mode == "blockwise" and k >= len(ATTENTIONS):
                    continue  # the projection's TP shard alone: BlockMuon, by choice; the heads stay exact
                want, bound = reference(k, tp, r["tp_rank"])
                s, e = lay.local_range(r["dp_rank"])
                if e > s:
                    assert (got[k] - want.reshape(-1)[s:e]).abs().max().item() <= bound, (lay.name, mode, cut)
                cut_heads += cut and dp > 1 and k < len(ATTENTIONS) and e % (HEAD_DIM * HIDDEN) != 0 and e > s
    assert dp == 1 or cut_heads, "the cut layout should cut some heads across DP ranks"


@pytest.mark.parametrize("mode", MODES)
def test_tp_bytes_only_for_heads_cut_by_tp(world, mode):
    """The plan prices, and the step's collectives on the TP group carry, exactly the rows of the
    heads TP's cut splits (``moved_rows``): nothing for a QKV cut on head boundaries, in every mode
    (the cut heads run the owner exchange in each); NS runs as planned."""
    n, tp, ranks = world
    for r in ranks:
        for cut in (True, False):
            for k, res in enumerate(r["results"][(cut, mode)]["per_qkv"]):
                rows = moved_rows(k, tp, r["tp_rank"]) if res["owns"] else 0
                assert res["tp_elements"] == rows * HIDDEN, (k, mode, cut, r["tp_rank"])
                assert res["plan_tp_bytes"] == rows * HIDDEN * NS.dtype_bytes
                assert res["flops"] == res["plan_flops"]
                if res["tp_blocks"]:
                    assert set(res["modes"]) == {"owner"} and moved_rows(k, tp, 0) > 0
                else:
                    assert res["per_rank"] and set(res["modes"]) == {"blockwise"} and moved_rows(k, tp, 0) == 0
    if tp == 4:  # two QKVs with heads cut by TP, one without
        assert [res["tp_blocks"] for res in ranks[0]["results"][(False, mode)]["per_qkv"]] == [True, False, True]


@pytest.mark.parametrize("mode", MODES)
def test_residuals_are_each_heads_own(world, mode):
    """``--muon-log-stats``' orthogonality residual of the QKV heads: each head measured once in the
    world (whole on every DP rank, ``cut=False``: its DP owner's TP group), a cut head on its owner
    from the whole result; against float64 on the step's own output of each head (unscaled)."""
    n, tp, ranks = world
    lays = model_layouts(tp, n // tp, cut=False)
    recorded = sorted(x for r in ranks for w, x in r["results"][(False, mode)]["residuals"])
    whole = {r["tp_rank"]: r["results"][(False, mode)]["out"] for r in ranks if r["dp_rank"] == 0}
    heads = []
    for k in range(len(ATTENTIONS)):
        full = torch.cat([whole[j][k].view(lays[k].local_shape) for j in range(tp)])
        heads += [full[h * HEAD_DIM:(h + 1) * HEAD_DIM] / muon_scale(HEAD_DIM, HIDDEN) for h in range(heads_total(k))]
    want = sorted(residual64(h) for h in heads)
    assert len(recorded) == len(want), mode
    # per_head_harness.residual_tolerance: fp32's Gram against float64's, derived there
    assert all(abs(a - b) <= residual_tolerance(HIDDEN, HEAD_DIM) for a, b in zip(recorded, want)), mode
