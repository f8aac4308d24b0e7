"""The cost model's view of a hybrid model (``ModelShape.matrices`` / ``step_cost.model_weights``):
Nemotron-H-8B's Muon weights layer by layer, its AdamW remainder, its first pipeline stage."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_muon.core.models import HYBRID_MODELS, staged_pattern
from megatron_muon.plan.cost_model import GPU_PROFILES
from megatron_muon.plan.step_cost import _stage_weights, model_params, model_weights, optimizer_step_cost

NEMOTRON = HYBRID_MODELS["nemotron-h-8b"]


def test_every_layer_kind_lists_its_matrices():
    weights = model_weights(NEMOTRON).weights
    pattern = NEMOTRON.hybrid_pattern
    assert len(weights) == 2 * len(pattern) == 104  # in/out_proj, qkv/proj or fc1/fc2: the dry run's count
    by_name = {w.name: w for w in weights}
    in_proj = by_name["layers.0.mixer.in_proj"]
    # [z; x; B; C; dt]: d_inner 8192 twice, 8 groups x state 128 twice, 128 heads; ColumnParallel
    assert (in_proj.rows, in_proj.cols, in_proj.partition_dim) == (18560, 4096, 0)
    assert in_proj.sub_rows == (8192, 8192, 1024, 1024, 128)
    assert model_weights(NEMOTRON, split_in_proj=False).weights[0].sub_rows == ()
    out_proj = by_name["layers.0.mixer.out_proj"]
    assert (out_proj.rows, out_proj.cols, out_proj.partition_dim) == (4096, 8192, 1)
    fc1 = by_name["layers.1.linear_fc1"]  # squared ReLU: one ffn x hidden matrix, nothing to split
    assert (fc1.rows, fc1.sub_rows) == (21504, ())
    attention = pattern.index("*")
    assert by_name[f"layers.{attention}.linear_qkv"].sub_rows == (4096, 1024, 1024)


def test_parameter_count_is_the_published_size():
    # Nemotron-H-8B is published as an 8B model (core/models.py names the source); ours counts
    # every matrix, the untied embedding and output, and each mixer's vectors.
    assert 7.9e9 < model_params(model_weights(NEMOTRON)) < 8.3e9


def test_first_pipeline_stage_is_the_first_segment():
    weights = model_weights(NEMOTRON)
    for pp in (1, 2, 4, 8):
        layers = len(staged_pattern(NEMOTRON.hybrid_pattern, pp).split("|")[0])
        assert [w.name for w in _stage_weights(weights, pp)] == [w.name for w in weights.weights[:2 * layers]]


def test_megatron_layout_replay_is_refused_and_moe_layers_are_not_listed():
    with pytest.raises(NotImplementedError, match="dp_layout='balanced'"):
        optimizer_step_cost(model_weights(NEMOTRON), optimizer="ours", tp=8, dp=8, hw=GPU_PROFILES["h100-sxm"],
                            dp_layout="megatron")
    with pytest.raises(NotImplementedError, match="MoE layers"):
        dataclasses.replace(NEMOTRON, hybrid_pattern="M*E-").matrices()
    with pytest.raises(ValueError, match="expected mamba sizes"):
        dataclasses.replace(NEMOTRON, mamba=None).matrices()
