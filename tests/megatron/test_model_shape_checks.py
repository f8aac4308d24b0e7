"""The preflight's local matrices (``model_shape_checks.local_matrices``) are the optimizer's own.

``--muonbp-block-grid RxC`` is checked before launch on the local shapes the flags give; the
optimizer checks the same grid at build on its catalogue (``catalogue.layout_of`` of every
parameter of the built model). Here both come from one model, built by megatron-core at TP2 in a
gloo world of 2 (``training_harness.build``): a GQA SwiGLU GPT, one with experts (and a shared
expert) at expert-TP 1, and a hybrid ``M*-`` (the Mamba mixer built without its kernels), each
with the fused-row splits on and off, and with the routing of megatron-core's main branch
(``--muon-mamba-in-proj adamw``, ``--moe-router-skip-muon``). The flags are the model config's
values under their argparse names. Equal sets of sub-matrix shapes mean equal answers for any
grid, since ``check_grid`` sees nothing else (names aside, which only say where).

The same builds check the routing itself: which params the optimizer puts in its Muon and its
AdamW groups (the router and the Mamba in_proj move with the two flags, nothing else does), and
the startup report's note on each, naming megatron-core 0.19.2's routing and its main branch's.
"""

from __future__ import annotations

import types

import pytest
import torch
from dist_harness import run_world
from megatron_harness import destroy_megatron
from training_harness import Run, build, start

VARIANTS = {
    "split": dict(split_qkv=True, split_fc1=True, mamba_in_proj="split"),
    "whole": dict(split_qkv=False, split_fc1=False, mamba_in_proj="whole"),
    "adamw": dict(mamba_in_proj="adamw", router_skip_muon=True),  # megatron-core main's routing, by flag
    "per_head": dict(split_qkv_per_head=True),  # QKV per head (--muon-split-qkv-per-head)
}
"""The ``MuonConfig`` settings of each build: the fused-row splits on, off, and the two routings to AdamW."""

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
        muon_mamba_in_proj=muon_config.mamba_in_proj, moe_router_skip_muon=muon_config.router_skip_muon,
        muon_split_qkv_per_head=muon_config.split_qkv_per_head)


def _both(rank: int, world: int, case: str, variant: str) -> tuple[list, list, dict, list[str]]:
    """(the catalogue's sub-matrix shapes, those derived from the flags, each param's algorithm by
    name, the startup report's lines)."""
    from megatron_muon.megatron.hybrid import mamba_mixer_without_kernels
    from megatron_muon.megatron.model_shape_checks import local_matrices
    from megatron_muon.megatron.report import name_pattern, startup_report

    muon = VARIANTS[variant]
    run = Run(tp=2, muon=muon, **CASES[case])
    start(run)
    with mamba_mixer_without_kernels(torch.device("cpu")):
        model, optimizer, _ = build(run)
    built = sorted({tuple(lay.sub_local_shapes()) for part in optimizer.chained_optimizers
                    for lay in part.optimizer.catalogue.layouts})
    from megatron_muon.config import MuonConfig

    flags = _flags(model[0].config, run, MuonConfig(**muon))
    derived = sorted({tuple(lay.sub_local_shapes()) for lay in local_matrices(flags)})
    # without the distributed optimizer the inner optimizer's groups hold the model params themselves
    group_of = {id(p): g["algorithm"] for part in optimizer.chained_optimizers
                for g in part.optimizer.param_groups for p in g["params"]}
    algorithms = {name_pattern(n): group_of[id(p)] for n, p in model[0].named_parameters()}
    report = startup_report(optimizer.chained_optimizers[0].optimizer.plans, model, MuonConfig(**muon)).splitlines()
    del model, optimizer
    destroy_megatron()
    return built, derived, algorithms, report


_BUILT: dict = {}


def _built(case: str, variant: str):
    """One world per (case, variant), shared by the tests below."""
    if (case, variant) not in _BUILT:
        _BUILT[case, variant] = run_world(2, _both, case, variant)[0]
    return _BUILT[case, variant]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_local_matrices_are_the_optimizer_catalogue(case, variant):
    built, derived, _, _ = _built(case, variant)
    assert derived == built, f"{case}: derived from the flags {derived}, built {built}"


ROUTER = "decoder.layers.*.mlp.router.weight"
IN_PROJ = "decoder.layers.*.mixer.in_proj.weight"


@pytest.mark.parametrize("case, pattern", [("moe", ROUTER), ("hybrid", IN_PROJ)])
def test_the_flags_move_the_router_and_in_proj_to_adamw_and_nothing_else(case, pattern):
    _, _, split, _ = _built(case, "split")
    _, _, whole, _ = _built(case, "whole")
    _, _, adamw, _ = _built(case, "adamw")
    assert split[pattern] == whole[pattern] == "muon" and adamw[pattern] == "adamw"
    assert {k: v for k, v in adamw.items() if k != pattern} == {k: v for k, v in split.items() if k != pattern}
    assert any(v == "muon" for v in adamw.values())  # the other hidden matrices stay on Muon


def _line(report: list[str], pattern: str) -> str:
    (line,) = [row for row in report if f" {pattern} " in row]
    return line


def test_the_report_names_the_routing_against_both_upstreams():
    from megatron_muon.megatron.report import IN_PROJ_RULES, ROUTER_RULES

    router = _line(_built("moe", "split")[3], ROUTER)
    assert router.startswith(f"  muon   {ROUTER}") and router.endswith(ROUTER_RULES[False])
    assert "megatron-core 0.19.2" in ROUTER_RULES[False] and "upstream main with --moe-router-skip-muon: AdamW" in \
        ROUTER_RULES[False]
    router = _line(_built("moe", "adamw")[3], ROUTER)
    assert router.startswith(f"  adamw  {ROUTER}") and router.endswith(ROUTER_RULES[True])
    for variant, algorithm in (("split", "muon"), ("whole", "muon"), ("adamw", "adamw")):
        line = _line(_built("hybrid", variant)[3], IN_PROJ)
        assert line.startswith(f"  {algorithm:<6} {IN_PROJ}") and line.endswith(IN_PROJ_RULES[variant]), line
    assert IN_PROJ_RULES["split"].startswith("Mamba in_proj: split by role") and \
        "(megatron-core 0.19.2: whole; upstream main: AdamW; --muon-mamba-in-proj)" in IN_PROJ_RULES["split"]
    shapes = {v: _line(_built("hybrid", v)[3], IN_PROJ).split("NS on ")[1].split(" (")[0] for v in ("split", "whole")}
    assert (shapes["split"].count(" + "), shapes["whole"].count(" + ")) == (4, 0), shapes  # z, x, B, C, dt; one
