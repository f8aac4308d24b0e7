"""Mixture-of-experts and MLA models on the planning road (``plan.stage_params`` →
``plan.stage_layouts`` → ``step_cost``), without Megatron.

``tests/megatron/test_stage_layouts.py`` compares the road with megatron-core's own model, buffer
by buffer, on small shapes; here the production shapes: the parameter counts the model cards
publish, how EP and expert TP cut the experts, and which params get the experts' own buffer.
"""

from __future__ import annotations

import pytest

from megatron_muon.core.models import LLAMA3, MOE_MODELS
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.stage_layouts import BufferSettings, stage_layouts
from megatron_muon.plan.stage_params import StageGrid, model_numel, stage_params
from megatron_muon.plan.step_cost import optimizer_step_cost

DSV3, MIXTRAL = MOE_MODELS["deepseek-v3"], MOE_MODELS["mixtral-8x7b"]


@pytest.mark.parametrize(("model", "published"), [(MIXTRAL, 46.7e9), (DSV3, 671e9)])
def test_parameter_counts_are_the_model_cards(model, published):
    """Mixtral-8x7B: 46.7B parameters; DeepSeek-V3: 671B without its multi-token-prediction module
    (the model cards). 0.1 %: the cards round to 0.1B and 1B, and the road, as the dry run's
    megatron-core model, has no q / kv layernorms in MLA (2 × 1024 elements a layer) and no router
    score bias (a buffer): far below either rounding."""
    assert model_numel(model) == pytest.approx(published, rel=1e-3)


def test_ep_holds_each_expert_once_and_expert_tp_cuts_its_rows():
    every = stage_params(DSV3, StageGrid(tp=1, dp=64, pp=16, stage=2, ep=8))
    experts = [p for p in every if p.expert_parallel]
    # stage 2 of 16 holds layers 6-9, all MoE (61 = 2 + 14 x 4 + 3; the first three layers are dense)
    assert len(experts) == 4 * (256 // 8) * 2
    assert {p.shape for p in experts} == {(2 * 2048, 7168), (7168, 2048)}
    cut = stage_params(MIXTRAL, StageGrid(tp=2, dp=64, ep=8, etp=2))
    assert {p.shape for p in cut if p.expert_parallel} == {(14336, 4096), (4096, 7168)}
    routers = [p for p in every if p.name.endswith("router.weight")]
    assert {p.shape for p in routers} == {(256, 7168)} and not any(p.expert_parallel for p in routers)


@pytest.mark.parametrize(("ep", "etp", "own"), [(1, None, False), (1, 1, True), (8, None, True), (8, 1, True)])
def test_experts_get_their_own_buffer_as_megatron_core_gives_it(ep, etp, own):
    """megatron-core's ``use_expert_pgs``: EP > 1 or expert TP != TP; else the experts are dense params."""
    laid = stage_layouts(MIXTRAL, StageGrid(tp=2, dp=8, ep=ep, etp=etp), BufferSettings(dp_layout="megatron"))
    assert (laid.experts is not None) == own
    experts_in_dense = any(".experts." in p.name for p in laid.params)
    assert experts_in_dense == (not own)
    if own:
        assert laid.experts.buffer.dp_size == 2 * 8 // (ep * (etp or 2))


def test_an_expert_grid_that_does_not_divide_the_stage_is_refused():
    with pytest.raises(ValueError, match="EP 3 x expert TP 1 must divide TP x DP = 16"):
        StageGrid(tp=2, dp=8, ep=3, etp=1)
    with pytest.raises(ValueError, match="EP 3 must divide its 256 experts"):
        stage_params(DSV3, StageGrid(tp=1, dp=6, ep=3, etp=1))


def test_the_cost_model_prices_both_optimizers_of_an_moe_stage():
    """The dense and the expert plans add up: a stage with experts costs more than the same stage's
    dense optimizer alone would, and the expert figures are the expert plan's (owner at expert
    TP 1: NS on every whole expert matrix, nothing sent)."""
    hw = GPU_PROFILES["h100-sxm"]
    cost = optimizer_step_cost(DSV3, optimizer="ours", tp=1, dp=64, pp=16, stage=2, ep=8, etp=1, hw=hw,
                               tp_mode="owner", bucket_numel=64_000_000)
    # 4 MoE layers x 32 local experts x (gate, up: 2048 x 7168; fc2: 7168 x 2048), all of one NS cost
    # (NS5 on a x b: 20·a²·b + 10·a³, a = 2048, b = 7168), owners by LPT over expert DP 8: 48 each
    per_matrix = 20 * 2048**2 * 7168 + 10 * 2048**3
    assert cost.expert_ns_flops_max == 4 * 96 // 8 * per_matrix
    assert cost.expert_bytes_sent_max == 0
    adam = optimizer_step_cost(DSV3, optimizer="adam", tp=1, dp=64, pp=16, stage=2, ep=8, etp=1, hw=hw)
    assert cost.total_s > adam.total_s > 0
    dense = optimizer_step_cost(LLAMA3["8B"], optimizer="ours", tp=8, dp=8, hw=hw, tp_mode="owner")
    assert dense.expert_ns_flops_max == dense.expert_bytes_sent_max == 0
