"""The preflight's local matrices (``model_shape_checks.local_matrices``) are the optimizer's own.

``--muonbp-block-grid RxC`` is checked before launch on the local shapes the flags give; the
optimizer checks the same grid at build on its catalogue (``catalogue.layout_of`` of every
parameter of the built model). Here both come from one model, built by megatron-core at TP2 in a
gloo world of 2 (``training_harness.build``): a GQA SwiGLU GPT, one with experts (and a shared
expert) at expert-TP 1, and a hybrid ``M*-`` (the Mamba mixer built without its kernels), each
with the fused-row splits on and off. The flags are the model config's values under their
argparse names. Equal sets of sub-matrix shapes mean equal answers for any grid, since
``check_grid`` sees nothing else (names aside, which only say where).
"""

from __future__ import annotations

import types

import pytest
import torch
from dist_harness import run_world
from megatron_harness import destroy_megatron
from training_harness import Run, build, start

CASES = {
    "gpt": dict(),
    "moe": dict(moe=dict(experts=4, ffn=32, shared=64), etp=1),
    "hybrid": dict(hybrid="M*-", layers=3),  # no E: MoE at TP2 needs sequence parallelism, which the local norm refuses
}


def _flags(config, run: Run, muon_config) -> types.SimpleNamespace:
    """The validated args that describe ``config`` (megatron-core's TransformerConfig of the model)."""
    return types.SimpleNamespace(
        tensor_model_parallel_size=config.tensor_model_parallel_size, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.kv_channels,
        group_query_attention=True, num_query_groups=config.num_query_groups, num_layers=config.num_layers,
        swiglu=config.gated_linear_unit, ffn_hidden_size=config.ffn_hidden_size,
        num_experts=config.num_moe_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_layer_freq=config.moe_layer_freq, expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        hybrid_layer_pattern=run.hybrid, mamba_head_dim=config.mamba_head_dim, mamba_state_dim=config.mamba_state_dim,
        mamba_num_groups=config.mamba_num_groups, mamba_num_heads=config.mamba_num_heads,
        muon_split_qkv=muon_config.split_qkv, muon_split_fc1=muon_config.split_fc1,
        muon_split_mamba_in_proj=muon_config.split_in_proj)


def _both(rank: int, world: int, case: str, split: bool) -> tuple[list, list]:
    from megatron_muon.megatron.hybrid import mamba_mixer_without_kernels
    from megatron_muon.megatron.model_shape_checks import local_matrices

    muon = dict(split_qkv=split, split_fc1=split, split_in_proj=split)
    run = Run(tp=2, muon=muon, **CASES[case])
    start(run)
    with mamba_mixer_without_kernels(torch.device("cpu")):
        model, optimizer, _ = build(run)
    built = sorted({tuple(lay.sub_local_shapes()) for part in optimizer.chained_optimizers
                    for lay in part.optimizer.catalogue.layouts})
    from megatron_muon.config import MuonConfig

    flags = _flags(model[0].config, run, MuonConfig(**muon))
    derived = sorted({tuple(lay.sub_local_shapes()) for lay in local_matrices(flags)})
    del model, optimizer
    destroy_megatron()
    return built, derived


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_local_matrices_are_the_optimizer_catalogue(case, split):
    built, derived = run_world(2, _both, case, split)[0]
    assert derived == built, f"{case}: derived from the flags {derived}, built {built}"
