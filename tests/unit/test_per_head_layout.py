"""``--muon-split-qkv-per-head`` on the planning floor: the heads as a ``MatrixLayout`` splits them,
the refusal of head counts that do not describe the local shard (taken before TP sharding:
DeepSpeed #8384), and a Llama-3 70B stage planned per head (zero TP bytes for the QKV heads in every
exact mode). The exactness of the step is checked in ``tests/dist/test_per_head.py`` and on the
tiny GPT in ``tests/megatron/test_per_head_training.py``."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_muon.config import MuonConfig
from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.param_marks import ParamMarks, RowSplits, matrix_layout
from megatron_muon.plan.stage_layouts import BufferSettings, stage_layouts
from megatron_muon.plan.stage_params import StageGrid
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan
from megatron_muon.plan.units import split_units

PER_HEAD = RowSplits(qkv_per_head=True)
HIDDEN, HEAD_DIM = 64, 8


def _marks(groups: int, per_group: int, tp: int, head_dim: int = HEAD_DIM) -> ParamMarks:
    return ParamMarks(tensor_parallel=True, partition_dim=0, qkv_split=(per_group * head_dim, head_dim, head_dim),
                      qkv_heads=(groups // tp, per_group, head_dim))


def _qkv(groups: int, per_group: int, tp: int, marks: ParamMarks | None = None, splits: RowSplits = PER_HEAD):
    rows = groups * (per_group + 2) * HEAD_DIM // tp
    return matrix_layout("layers.0.linear_qkv.weight", (rows, HIDDEN), marks or _marks(groups, per_group, tp), tp,
                         splits)


@pytest.mark.parametrize("groups, per_group, tp", [(4, 1, 2), (4, 2, 2), (8, 8, 8), (2, 4, 1)])
def test_every_head_is_its_own_matrix_of_head_dim_rows(groups, per_group, tp):
    lay = _qkv(groups, per_group, tp)
    heads = groups // tp * (per_group + 2)  # the rank's query heads and its groups' k and v heads
    assert lay.split.sizes == (HEAD_DIM,) * heads and lay.split.groups == 1
    assert lay.sub_global_shapes() == [(HEAD_DIM, HIDDEN)] * heads  # the head's own shape, scaled by it
    assert lay.per_rank == (tp > 1)
    for sub in lay.sub_matrices():  # whole on its TP rank: not a shard of anything
        assert (sub.partition_dim, sub.full_shape, sub.per_rank) == (None, (HEAD_DIM, HIDDEN), tp > 1)
    units = split_units([lay])
    assert len(units) == heads and all(u.layout.sub_global_shapes() == [(HEAD_DIM, HIDDEN)] for u in units)
    assert lay.group_flops(lambda r, c: 1) == heads * (tp if tp > 1 else 1)  # balancing: once per TP rank


def test_per_group_split_is_unchanged_without_the_flag():
    lay = _qkv(4, 2, 2, splits=RowSplits())
    assert (lay.split.groups, lay.split.sizes, lay.per_rank) == (2, (2 * HEAD_DIM, HEAD_DIM, HEAD_DIM), False)


@pytest.mark.parametrize("bug", ["groups before sharding", "head dim before sharding", "no counts"])
def test_head_counts_that_do_not_describe_the_shard_are_refused(bug):
    """The planted bug: the head counts of the whole model on a TP2 shard. The whole model's query
    groups give twice the local rows; the whole model's heads cut into the local rows give half
    heads of head_dim / 2 rows (which do fit the rows: the per-group split catches them)."""
    groups, per_group, tp = 4, 2, 2
    marks = {"groups before sharding": _marks(groups, per_group, 1),
             "head dim before sharding": _marks(groups, per_group, 1, HEAD_DIM // tp),
             "no counts": dataclasses.replace(_marks(groups, per_group, tp), qkv_heads=None)}[bug]
    marks = dataclasses.replace(marks, qkv_split=(per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM))
    with pytest.raises(ValueError) as err:
        _qkv(groups, per_group, tp, marks)
    message = str(err.value)
    assert message.startswith("layers.0.linear_qkv.weight: --muon-split-qkv-per-head:") and "\n" not in message


def test_the_flag_needs_the_per_group_split():
    with pytest.raises(ValueError, match="--muon-split-qkv-per-head: expected the per-group QKV split"):
        MuonConfig(split_qkv=False, split_qkv_per_head=True)
    assert MuonConfig().split_qkv_per_head is False


@pytest.mark.parametrize("mode", ["owner", "duplicated", "distributed", "auto"])
def test_llama3_70b_heads_send_no_tp_byte(mode):
    """Llama-3 70B at TP8 x DP8 (8 query groups: one per TP rank, 8 query heads and a k and a v head
    of 128 x 8192), two layers, megatron-core's buffer layout (heads cut across DP ranks): every QKV
    sub-matrix runs on its TP rank, priced at no TP byte; the other matrices keep their mode."""
    model = dataclasses.replace(LLAMA3["70B"], num_layers=2)
    grid = StageGrid(tp=8, dp=8)
    laid = stage_layouts(model, grid, BufferSettings("megatron", splits=PER_HEAD))
    qkv = [lay for lay in laid.matrices if "linear_qkv" in lay.name]
    assert qkv and all(lay.sub_global_shapes() == [(128, 8192)] * 10 and lay.per_rank for lay in qkv)
    settings = PlanSettings(mode, NSOptions(), hardware=GPU_PROFILES["h100-sxm"])
    heads_only = build_step_plan(qkv, dp_size=8, tp_size=8, settings=settings)
    assert set(heads_only.tp_bytes) == {0} and sum(heads_only.ns_flops) > 0
    assert {m for w in heads_only.work for m in w.modes} == {"blockwise"}
    whole = build_step_plan(laid.matrices, dp_size=8, tp_size=8, settings=settings)
    others = {m for w in whole.work for sub, m in zip(w.subs, w.modes) if not sub.per_rank}
    assert others and "blockwise" not in others


def test_the_startup_report_says_heads_per_tp_rank():
    import torch

    from megatron_muon.megatron.report import startup_report
    from megatron_muon.optimizer import step_plans

    muon_config = MuonConfig(tp_mode="owner", split_qkv_per_head=True)
    lay = dataclasses.replace(_qkv(4, 2, 2), name="chunk0.decoder.layers.0.self_attention.linear_qkv.weight")
    chunk = torch.nn.Module()
    chunk.linear_qkv = torch.nn.Linear(HIDDEN, lay.local_shape[0], bias=False)
    report = startup_report(step_plans(muon_config, [lay], 1, 2), [chunk], muon_config)
    (line,) = [ln for ln in report.splitlines() if "linear_qkv" in ln]
    assert f"NS on 8 heads of {HEAD_DIM}x{HIDDEN} per TP rank" in line
    assert "tp mode on its TP rank (per head, no TP traffic)" in line


# ---- MLA: the q and kv up-projections' heads -------------------------------------------------

MLA_HEADS, NOPE, ROPE, V, Q_LORA, KV_LORA = 4, 16, 8, 12, 24, 32


def _mla(tp: int, heads: int | None = None, splits: RowSplits = PER_HEAD):
    """A q up-projection and a kv up-projection of ``MLA_HEADS`` heads, TP-local (ColumnParallel),
    marked as ``catalogue.tag_qkv`` marks them: ``heads`` per TP rank (default: after sharding)."""
    heads = MLA_HEADS // tp if heads is None else heads
    q = matrix_layout("layers.0.self_attention.linear_q_up_proj.weight", (MLA_HEADS * (NOPE + ROPE) // tp, Q_LORA),
                      ParamMarks(tensor_parallel=True, partition_dim=0, mla_heads=(heads, (NOPE + ROPE,))), tp, splits)
    kv = matrix_layout("layers.0.self_attention.linear_kv_up_proj.weight", (MLA_HEADS * (NOPE + V) // tp, KV_LORA),
                       ParamMarks(tensor_parallel=True, partition_dim=0, mla_heads=(heads, (NOPE, V))), tp, splits)
    return q, kv


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_heads_are_q_rows_and_k_nope_and_v_apart(tp):
    """Per head of this TP rank: its q rows (nope and rope together) one matrix, its k-nope rows one
    and its v rows one, in megatron-core's row order; whole on their TP rank."""
    q, kv = _mla(tp)
    local = MLA_HEADS // tp
    assert q.sub_global_shapes() == [(NOPE + ROPE, Q_LORA)] * local
    assert kv.sub_global_shapes() == [(NOPE, KV_LORA), (V, KV_LORA)] * local
    assert kv.split.sizes == (NOPE, V) * local and kv.split.groups == 1  # head h: rows h(NOPE+V) .. (h+1)(NOPE+V)
    for lay in (q, kv):
        assert lay.per_head and lay.per_rank == (tp > 1)
        assert all((s.partition_dim, s.per_rank) == (None, tp > 1) for s in lay.sub_matrices())
        assert len(split_units([lay])) == len(lay.sub_global_shapes())  # every head block its own unit


def test_mla_is_whole_without_the_flag():
    q, kv = _mla(2, splits=RowSplits())
    assert q.split is None and kv.split is None and not (q.per_head or kv.per_head or q.per_rank)


@pytest.mark.parametrize("heads", [MLA_HEADS, MLA_HEADS // 4, 0])
def test_mla_head_counts_that_do_not_describe_the_shard_are_refused(heads):
    """The planted bug: the whole model's head count on a TP2 shard (and a count too small, and none)."""
    with pytest.raises(ValueError) as err:
        _mla(2, heads=heads)
    message = str(err.value)
    assert message.startswith("layers.0.self_attention.linear_q_up_proj.weight: --muon-split-qkv-per-head:")
    assert "after TP sharding" in message and "\n" not in message


@pytest.mark.parametrize("mode", ["owner", "duplicated", "distributed", "auto"])
def test_mla_heads_send_no_tp_byte(mode):
    """At TP2 x DP2 every up-projection's head block runs on its TP rank, priced at no TP byte."""
    laid = [dataclasses.replace(lay, dp_ranges=((0, lay.numel // 2 + 5), (lay.numel // 2 + 5, lay.numel)))
            for lay in _mla(2)]
    plan = build_step_plan(laid, dp_size=2, tp_size=2,
                           settings=PlanSettings(mode, NSOptions(), hardware=GPU_PROFILES["h100-sxm"]))
    assert set(plan.tp_bytes) == {0} and sum(plan.ns_flops) > 0
    assert {m for w in plan.work for m in w.modes} == {"blockwise"}


@pytest.mark.parametrize("tp, groups, layout", [(16, 8, "per_rank"), (8, 2, "tp_blocks"), (32, 8, "tp_blocks")])
def test_llama3_8b_below_tp_query_groups_on_the_planning_road(tp, groups, layout):
    """Fewer query groups than TP ranks on the road from a model's shape (``stage_params`` gives
    megatron-core's per-partition counts and the model's query groups): 48 heads of 128 rows over
    TP16, 3 whole heads a rank (per rank, no TP byte); 36 heads over TP8 (4.5 a rank) and 48 over
    TP32 (1.5 a rank) cut heads, whose owner exchange moves the cut heads' rows only."""
    model = dataclasses.replace(LLAMA3["8B"], num_layers=1, num_query_groups=groups)
    laid = stage_layouts(model, StageGrid(tp=tp, dp=2), BufferSettings(splits=PER_HEAD))
    (qkv,) = [lay for lay in laid.matrices if "linear_qkv" in lay.name]
    heads = (model.num_heads + 2 * groups)
    assert qkv.per_rank == (layout == "per_rank") and (qkv.tp_blocks is not None) == (layout == "tp_blocks")
    assert qkv.sub_global_shapes() == [(128, model.hidden)] * (heads // tp if qkv.per_rank else heads)
    plan = build_step_plan([qkv], dp_size=2, tp_size=tp, settings=PlanSettings("owner", NSOptions()))
    rows = qkv.local_shape[0]
    cut = sum(1 for h in range(heads) if (h * 128) // rows != ((h + 1) * 128 - 1) // rows)
    assert (cut > 0) == (layout == "tp_blocks")
    # every cut head's rows other than its owner's move there and back: in all, twice the rows
    # its other holders hold
    moved = sum(2 * (128 - max(hi - lo for lo, hi in sub.tp_rows)) for sub in qkv.sub_matrices()) if cut else 0
    assert sum(plan.tp_bytes) == moved * model.hidden * NSOptions().dtype_bytes
