"""The step plan on its own, on one process: its decisions and the errors it raises.

``tests/dist/test_step_plan.py`` checks a plan against the step that executes it on gloo ranks;
here the plan is built for grids no process group could hold (TP8 x DP64) and read directly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.newton_schulz import ns_flops
from megatron_muon.optimizer import step_plans
from megatron_muon.plan.hardware import hardware_profile
from megatron_muon.plan.owners import plan_dp_owners
from megatron_muon.plan.step_plan import build_step_plan
from megatron_muon.plan.units import split_units


def _layer(tp: int, dp_ranges=None) -> list[MatrixLayout]:
    """One Llama-3-8B layer's Muon matrices on a TP rank (QKV per query group, fc1 gate/up)."""
    groups = 8 // tp
    return [
        MatrixLayout("qkv", (groups * 768, 4096), 0, tp, RowSplit(groups, (512, 128, 128)), dp_ranges),
        MatrixLayout("proj", (4096, 4096 // tp), 1, tp, None, dp_ranges),
        MatrixLayout("fc1", (2 * 14336 // tp, 4096), 0, tp, RowSplit(1, (14336 // tp, 14336 // tp)), dp_ranges),
        MatrixLayout("fc2", (4096, 14336 // tp), 1, tp, None, dp_ranges),
    ]


def _settings(tp_mode: str, **fields):
    return MuonConfig(tp_mode=tp_mode, **fields).plan_settings()


def test_a_plan_for_512_ranks_is_built_on_one_process_and_counts_each_ns_once():
    layouts = _layer(8) * 8  # 32 matrices for TP8 x DP64: most DP ranks own nothing
    plan = build_step_plan(layouts, dp_size=64, tp_size=8, settings=_settings("owner"))
    assert len(plan.ns_flops) == len(plan.bytes_sent) == 512
    once = sum(ns_flops(*shape, 5) for lay in layouts for shape in lay.sub_global_shapes())
    assert sum(plan.ns_flops) == once  # owner: each sub-matrix's NS runs on exactly one rank
    units = split_units(layouts)
    # contiguous fused blocks are units: fc1's gate and up, and QKV's q, k, v (one query group per
    # rank at TP8); 8 layers x (3 + 1 + 2 + 1) = 56 units
    assert plan.units == units and len(units) == 56
    assert plan.dp_owners == tuple(plan_dp_owners([u.layout for u in units], 64))
    assert len(plan.idle_dp_ranks()) == 64 - len(set(plan.dp_owners))
    # 56 units for 64 DP ranks: LPT gives each its own TP group, the two halves of an fc1 included
    assert len(set(plan.dp_owners)) == len(units)
    for i in range(len(layouts)):
        assert plan.tp_modes_of(i) == ("owner",) * len(layouts[i].sub_matrices())


def test_without_a_dp_exchange_every_dp_rank_shares_one_piece_of_work():
    plan = build_step_plan(_layer(2), dp_size=4, tp_size=2, settings=_settings("duplicated", dp_mode="redundant"))
    assert plan.dp_owners is None and not plan.exchanges_dp
    assert all(w is plan.work[0] for w in plan.work)
    assert plan.dp_bytes == (0,) * 8  # redundant: no DP byte


def test_auto_decides_per_sub_matrix_once_and_the_report_reads_it():
    hw = hardware_profile("h100-sxm")
    config = MuonConfig(tp_mode="auto", auto_hardware="h100-sxm")
    plans = step_plans(config, _layer(8), 1, 8)
    assert set(plans) == {"muon"}
    modes = [m for i in range(4) for m in plans["muon"].tp_modes_of(i)]
    assert set(modes) <= {"owner", "duplicated", "distributed"} and "auto" not in modes
    assert plans["muon"].settings.hardware == hw


def test_muonbp_plans_a_full_and_a_block_step():
    plans = step_plans(MuonConfig(tp_mode="owner", muonbp_period=4), _layer(2), 1, 2)
    assert set(plans) == {"full", "block"}
    assert plans["block"].tp_bytes == (0, 0)  # a block step never talks over TP
    # block steps scale by the TP shard's shape, full steps by the whole matrix's
    assert plans["block"].scales != plans["full"].scales


def test_empty_matrices_are_in_no_micro_group_and_cost_nothing():
    layouts = [MatrixLayout("empty", (0, 16), None, 1), MatrixLayout("w", (32, 16), None, 1)]
    plan = build_step_plan(layouts, dp_size=1, tp_size=1, settings=_settings("owner"))
    assert plan.micro_groups == ((1,),)
    assert plan.ns_flops == (ns_flops(32, 16, 5),)
    assert plan.tp_modes_of(0) == ()


@pytest.mark.parametrize("change, message", [
    (dict(tp_mode="fast"), r"^--muon-tp-mode: expected one of"),
    (dict(dp_mode="both"), r"^--muon-dp-mode: expected one of"),
    (dict(bucket_bytes=0), r"^--muon-owner-bucket-size-mb: expected a positive size"),
    (dict(tp_mode="auto"), r"^--muon-tp-mode auto: the plan needs the cost model's hardware constants"),
])
def test_bad_settings_are_one_line_naming_the_flag(change, message):
    settings = dataclasses.replace(_settings("owner"), **change)
    with pytest.raises(ValueError, match=message):
        build_step_plan(_layer(2), dp_size=1, tp_size=2, settings=settings)


def test_redundant_with_cut_matrices_is_refused_when_the_plan_is_built():
    ranges = ((0, 100), (100, 4096 * 2048))
    layouts = [MatrixLayout("proj", (4096, 2048), 1, 2, None, ranges)]
    with pytest.raises(ValueError, match=r"^--muon-dp-mode redundant needs every DP rank to hold whole matrices"):
        build_step_plan(layouts, dp_size=2, tp_size=2, settings=_settings("owner", dp_mode="redundant"))


def test_a_layout_for_another_group_size_is_refused():
    with pytest.raises(ValueError, match=r"^qkv: laid out for a TP group of 2, planned for 4$"):
        build_step_plan(_layer(2)[:1], dp_size=1, tp_size=4, settings=_settings("owner"))


def test_the_plan_is_immutable_and_compared_by_identity():
    a = build_step_plan(_layer(2), dp_size=1, tp_size=2, settings=_settings("owner"))
    b = build_step_plan(_layer(2), dp_size=1, tp_size=2, settings=_settings("owner"))
    assert a != b and a == a and hash(a) != hash(b)  # the step caches what it binds on the object
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dp_size = 2
    assert a.ns_flops == b.ns_flops  # and the same inputs give the same decisions
    assert torch.bfloat16 == a.settings.ns.dtype


def test_units_cut_a_weight_into_its_contiguous_blocks_and_clip_its_dp_ranges():
    # fc1 at TP2: gate and up, 4 rows x 3 cols each, DP ranges cutting inside both halves
    fc1 = MatrixLayout("fc1", (8, 3), 0, 2, RowSplit(1, (4, 4)), ((0, 10), (10, 24)))
    qkv = MatrixLayout("qkv", (12, 3), 0, 2, RowSplit(2, (4, 1, 1)), ((0, 20), (20, 36)))
    units = split_units([fc1, qkv])
    assert [(u.weight, u.block, u.start, u.layout.name, u.layout.local_shape) for u in units] == [
        (0, 0, 0, "fc1[0]", (4, 3)), (0, 1, 12, "fc1[1]", (4, 3)), (1, 0, 0, "qkv", (12, 3))]
    assert units[0].layout.dp_ranges == ((0, 10), (10, 12)) and units[1].layout.dp_ranges == ((0, 0), (0, 12))
    assert units[2].layout == qkv  # interleaved query groups: one unit, kept whole
    # a DP rank's piece of the weight is its pieces of the units, in order
    for rank, (a, b) in enumerate(fc1.dp_ranges):
        spans = [units[k].slice_of((a, b)) for k in (0, 1)]
        assert [hi - lo for lo, hi in spans] == [e - s for s, e in (u.layout.dp_ranges[rank] for u in units[:2])]
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == b - a
