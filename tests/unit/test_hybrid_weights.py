"""A hybrid model on the planning road (``plan.stage_params`` → ``plan.stage_layouts``):
Nemotron-H-8B's parameters layer by layer, its size, its pipeline stages, and its layouts on both
buffer layouts. ``tests/megatron/test_stage_layouts.py`` checks the same road against the
``HybridModel`` megatron-core builds."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_muon.core.matrix_layout import RowSplit
from megatron_muon.core.models import HYBRID_MODELS, staged_pattern
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.param_marks import RowSplits
from megatron_muon.plan.stage_layouts import BufferSettings, stage_layouts, whole_layouts
from megatron_muon.plan.stage_params import StageGrid, model_numel, stage_params
from megatron_muon.plan.step_cost import optimizer_step_cost

NEMOTRON = HYBRID_MODELS["nemotron-h-8b"]


def test_every_layer_kind_lists_its_matrices():
    params = stage_params(NEMOTRON, StageGrid(tp=1))
    matrices = {p.name: p for p in params if p.is_muon}
    pattern = NEMOTRON.hybrid_pattern
    assert len(matrices) == 2 * len(pattern) == 104  # in/out_proj, qkv/proj or fc1/fc2: the dry run's count
    in_proj = matrices["decoder.layers.0.mixer.in_proj.weight"]
    # [z; x; B; C; dt]: d_inner 8192 twice, 8 groups x state 128 twice, 128 heads; ColumnParallel
    assert (in_proj.shape, in_proj.marks.partition_dim) == ((18560, 4096), 0)
    assert in_proj.marks.partition_sizes == (8192, 8192, 1024, 1024, 128)
    out_proj = matrices["decoder.layers.0.mixer.out_proj.weight"]
    assert (out_proj.shape, out_proj.marks.partition_dim) == ((4096, 8192), 1)
    fc1 = matrices["decoder.layers.1.mlp.linear_fc1.weight"]  # squared ReLU: one ffn x hidden matrix
    assert (fc1.shape, fc1.marks.gated) == ((21504, 4096), False)
    attention = pattern.index("*")
    # per query group: 4 query heads of 128, one k and one v head
    assert matrices[f"decoder.layers.{attention}.self_attention.linear_qkv.weight"].marks.qkv_split == (512, 128, 128)
    # conv1d (3-D), A_log, D, dt_bias and the norms go to AdamW
    assert {p.name.rsplit(".", 1)[-1] for p in params if not p.is_muon} >= {"conv1d_weight", "A_log", "D", "dt_bias"}


def test_in_proj_splits_by_role_unless_asked_not_to():
    at_tp8 = stage_params(NEMOTRON, StageGrid(tp=8))
    (split,) = {lay.split for lay in whole_layouts(at_tp8, 8) if lay.name.endswith("in_proj.weight")}
    assert split == RowSplit(1, (1024, 1024, 128, 128, 16))  # each role TP-sharded on its own
    whole = whole_layouts(at_tp8, 8, RowSplits(in_proj=False))
    assert {lay.split for lay in whole if lay.name.endswith("in_proj.weight")} == {None}


def test_parameter_count_is_the_published_size():
    # Nemotron-H-8B is published as an 8B model (core/models.py names the source): every matrix,
    # the untied embedding and output, each mixer's vectors and the norms.
    assert 7.9e9 < model_numel(NEMOTRON) < 8.3e9


def test_pipeline_stages_are_the_patterns_segments():
    for pp in (1, 2, 4, 8):
        segments = staged_pattern(NEMOTRON.hybrid_pattern, pp).split("|")
        for stage, segment in enumerate(segments):
            params = stage_params(NEMOTRON, StageGrid(tp=8, pp=pp, stage=stage))
            assert sum(p.is_muon for p in params) == 2 * len(segment), (pp, stage)
            assert (params[0].name == "embedding.word_embeddings.weight") == (stage == 0)
            assert (params[-1].name == "output_layer.weight") == (stage == pp - 1)


def test_both_buffer_layouts_describe_every_matrix():
    """Both layouts hold every matrix whole across the DP ranges; the balanced one cuts fewer
    (5 at TP8 x DP8, as the recorded dry run: a bucket whose whole-matrix shards would pad too much
    is packed as megatron-core packs it) than megatron-core's packing (replayed, for hybrid layers
    too), and the cost model prices either."""
    grid = StageGrid(tp=8, dp=8)
    balanced = stage_layouts(NEMOTRON, grid, BufferSettings("balanced", 40_000_000))
    packed = stage_layouts(NEMOTRON, grid, BufferSettings("megatron", 40_000_000))
    for laid in (balanced, packed):
        assert len(laid.matrices) == 104
        assert all(sum(e - s for s, e in lay.dp_ranges) == lay.numel for lay in laid.matrices)
    cut = [sum(len(lay.holders(8)) > 1 for lay in laid.matrices) for laid in (balanced, packed)]
    assert cut[0] == 5 < cut[1], cut
    cost = optimizer_step_cost(NEMOTRON, optimizer="ours", tp=8, dp=8, hw=GPU_PROFILES["h100-sxm"], tp_mode="owner",
                               dp_layout="megatron", bucket_numel=40_000_000)
    assert cost.ns_flops_max > 0 and cost.total_s > 0


def test_moe_layers_and_missing_mamba_sizes_are_refused():
    with pytest.raises(NotImplementedError, match="MoE layers"):
        stage_params(dataclasses.replace(NEMOTRON, hybrid_pattern="M*E-"), StageGrid(tp=1))
    with pytest.raises(ValueError, match="expected mamba sizes"):
        stage_params(dataclasses.replace(NEMOTRON, mamba=None), StageGrid(tp=1))
