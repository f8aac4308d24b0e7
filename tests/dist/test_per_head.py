"""Per-head QKV (``--muon-split-qkv-per-head``): every head of a fused QKV orthogonalized on its own,
on the TP rank that holds it whole, with no TP traffic in any mode.

The reference is one process: the whole (all TP ranks) fused QKV of megatron-core's layout,
``[q heads; k; v]`` per query group, cut into its heads by row slices here (not by
``MatrixLayout``), each head's Newton–Schulz run alone and scaled by the head's own shape, then cut
back to the TP rank's rows and the DP rank's flat range. The layouts come from
``param_marks.matrix_layout``, the adapter's own road, with the per-rank head counts a
megatron-core attention module reports after TP sharding. TP 1, 2, 4 at DP 1 and at DP 2 (TP 4 x
DP 2 in a fresh world of 8 processes); every TP size is at most the 4 query groups, so every TP
rank holds whole heads.
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

HIDDEN, HEAD_DIM, GROUPS = 16, 4, 4
# name, query heads (MHA: one per group; GQA: two per group)
ATTENTIONS = [("mha.linear_qkv", 4), ("gqa.linear_qkv", 8)]
PROJ = ("gqa.linear_proj", (HIDDEN, 8 * HEAD_DIM))  # RowParallel, split along dim 1: not per head
MODES = ("owner", "duplicated", "distributed", "auto", "blockwise")
PER_HEAD = RowSplits(qkv_per_head=True)


def qkv_rows(heads: int) -> int:
    return GROUPS * (heads // GROUPS + 2) * HEAD_DIM


def marks(heads: int, tp: int) -> ParamMarks:
    """A ColumnParallel fused QKV's marks as ``catalogue.tag_qkv`` sets them: the per-group split and
    the head counts after TP sharding (query groups on this rank)."""
    per_group = heads // GROUPS
    return ParamMarks(tensor_parallel=True, partition_dim=0, qkv_split=(per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM),
                      qkv_heads=(GROUPS // tp, per_group, HEAD_DIM))


def model_layouts(tp: int, dp: int, cut: bool) -> list[MatrixLayout]:
    """The two QKV weights and a projection, back to back in one flat buffer; ``cut``: ZeRO-1
    cutting heads across DP ranks (``per_head_harness.flat_ranges``)."""
    shapes = [(qkv_rows(h) // tp, HIDDEN) for _, h in ATTENTIONS] + [(HIDDEN, PROJ[1][1] // tp)]
    ranges = flat_ranges([r * c for r, c in shapes], dp, cut)
    out = [matrix_layout(name, shape, marks(heads, tp), tp, PER_HEAD, rng)
           for (name, heads), shape, rng in zip(ATTENTIONS, shapes, ranges)]
    out.append(matrix_layout(PROJ[0], shapes[-1], ParamMarks(tensor_parallel=True, partition_dim=1), tp, PER_HEAD,
                             ranges[-1]))
    return out


def full_update(k: int) -> torch.Tensor:
    """Matrix k's whole update (every TP rank's rows or columns), seeded by index."""
    shape = (qkv_rows(ATTENTIONS[k][1]), HIDDEN) if k < len(ATTENTIONS) else PROJ[1]
    return torch.randn(shape, generator=torch.Generator().manual_seed(70 + k))


def heads_of(k: int) -> list[slice]:
    """The row slices of QKV k's heads, from megatron-core's layout: per query group its query
    heads, then its k head and its v head, head_dim rows each."""
    per_group = ATTENTIONS[k][1] // GROUPS + 2
    return [slice(r * HEAD_DIM, (r + 1) * HEAD_DIM) for r in range(GROUPS * per_group)]


def reference(k: int, tp: int, tp_rank: int) -> tuple[torch.Tensor, float]:
    """This TP rank's block of matrix k's update, one process, and how far the step may be from it:
    a QKV per head (``per_head_harness``: each head's NS alone, times its own shape's scale), the
    projection whole. A head's NS taken over two heads, or a half head, or the TP stack of heads,
    or scaled by the weight's shape, is off by 1e-1 or more."""
    full = full_update(k)
    return whole_reference(full, tp, tp_rank) if k >= len(ATTENTIONS) else per_head_reference(full, HEAD_DIM, tp,
                                                                                             tp_rank)


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
            qkv_only = build_step_plan(lays[: len(ATTENTIONS)], dp_size=dp, tp_size=tp, settings=plan_settings(mode))
            records = []
            probe = ResidualProbe(frozenset(range(len(lays))), lambda w, x: records.append((w, float(x))))
            got = orthogonalize_updates(pieces, plan, groups, residuals=probe)
            orthogonalize_updates(pieces[: len(ATTENTIONS)], qkv_only, groups)  # binds and checks: not counted
            tp_elements, stats = tp_traffic(lambda: orthogonalize_updates(pieces[: len(ATTENTIONS)], qkv_only, groups),
                                            groups.tp)
            out[(cut, mode)] = dict(out=got, tp_elements=tp_elements, bytes=stats.bytes_sent,
                                    flops=stats.ns_flops, plan_tp_bytes=qkv_only.tp_bytes[rank],
                                    plan_flops=qkv_only.ns_flops[rank],
                                    modes={m for w in qkv_only.work for m in w.modes},
                                    residuals=[x for w, x in records if w < len(ATTENTIONS)])
    return {"tp_rank": tp_rank, "dp_rank": dp_rank, "results": out}


@pytest.fixture(scope="module", params=[(1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (8, 4)],
                ids=lambda p: f"world{p[0]}-tp{p[1]}")
def world(request):
    n, tp = request.param
    # TP4 x DP2 takes 8 processes: a world of its own, not kept in the pool of the 1-4 worlds
    return n, tp, run_world(n, _worker, tp, fresh=n > 4)


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
                if mode == "blockwise" and k >= len(ATTENTIONS) and tp > 1:
                    continue  # the projection's TP shard alone: BlockMuon, by choice; its heads stay exact
                want, bound = reference(k, tp, r["tp_rank"])
                s, e = lay.local_range(r["dp_rank"])
                assert (got[k] - want.reshape(-1)[s:e]).abs().max().item() <= bound if e > s else True, \
                    (lay.name, mode, cut)
                # a DP range ending inside a head: that head is reassembled on its DP owner
                cut_heads += cut and dp > 1 and k < len(ATTENTIONS) and e % (HEAD_DIM * HIDDEN) != 0 and e > s
    assert dp == 1 or cut_heads, "the cut layout should cut some heads across DP ranks"


@pytest.mark.parametrize("mode", MODES)
def test_per_head_sends_nothing_over_tp_in_every_mode(world, mode):
    """Every TP rank holds whole heads (TP <= query groups): the plan prices no TP byte, and the
    step's collectives on the TP group carry no element (owner mode still posts its micro-group's
    all-to-alls, empty; every rank issues every collective), while NS runs on every TP rank."""
    n, tp, ranks = world
    for r in ranks:
        for cut in (True, False):
            res = r["results"][(cut, mode)]
            # blockwise's kernel (NS of what the rank holds) on every TP rank; at TP 1 a head is
            # an ordinary whole matrix, run in the plan's mode
            assert res["modes"] == {"blockwise"} or tp == 1
            assert res["plan_tp_bytes"] == 0 and res["tp_elements"] == 0
            if n == tp:  # no DP dim: nothing at all moves
                assert res["bytes"] == 0
            assert res["flops"] == res["plan_flops"]
    assert all(sum(r["results"][(cut, mode)]["flops"] for r in ranks if r["dp_rank"] == d) > 0
               for cut in (True, False) for d in range(n // tp) if n == tp)


@pytest.mark.parametrize("mode", MODES)
def test_per_head_residuals_are_each_heads_own(world, mode):
    """``--muon-log-stats``' orthogonality residual of the QKV heads (every weight sampled): each
    head measured once per DP group, on its TP rank, from its own NS output. Over a TP rank's DP
    owners the residuals are its heads' (sorted: the order is the plan's), against float64 on the
    step's own output of each head (unscaled)."""
    n, tp, ranks = world
    lays = model_layouts(tp, n // tp, cut=False)
    for tp_rank in range(tp):
        recorded = sorted(x for r in ranks if r["tp_rank"] == tp_rank for x in r["results"][(False, mode)]["residuals"])
        got = next(r["results"][(False, mode)]["out"] for r in ranks if r["tp_rank"] == tp_rank)
        heads = [(got[k].view(lays[k].local_shape)[rows] / muon_scale(HEAD_DIM, HIDDEN))
                 for k in range(len(ATTENTIONS)) for rows in heads_of(k)[: len(heads_of(k)) // tp]]
        want = sorted(residual64(h) for h in heads)
        if tp == 1 and mode == "blockwise":  # blockwise at TP 1: heads are no per-rank matrices, MuonBP's block
            assert not recorded  # steps run there and hold no whole NS: never measured
            continue
        assert len(recorded) == len(want), (mode, tp_rank)
        # per_head_harness.residual_tolerance: fp32's Gram against float64's, derived there
        assert all(abs(a - b) <= residual_tolerance(HIDDEN, HEAD_DIM) for a, b in zip(recorded, want)), (mode, tp_rank)
