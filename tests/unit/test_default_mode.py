"""The default flags are the plan that wins (issue 42 item 6), checked on the cost model.

The cost model prices the plan the optimizer builds (``step_cost.optimizer_step_cost``: the
stage's real layouts from ``plan.stage_layouts``, ``build_step_plan``, ``pricing.plan_cost``), so
these are the figures a job with default flags plans on, on the h100-sxm constants. The default
(``MuonConfig()``: ``auto`` on the ``priced`` layout, chosen on a 4M-token job's price, or whole
matrices where no price is formed) must never predict a slower optimizer step than
``--muon-dp-layout megatron --muon-tp-mode owner`` on the same model and layout, and at
Llama-3 405B TP8 × PP16 × DP64 its first stage's NS must be balanced (max/mean ≤ 2.5, owner's is
19.24).
"""

from __future__ import annotations

import pytest

from megatron_muon.config import MuonConfig
from megatron_muon.core.models import LLAMA3
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.layout_choice import job_price
from megatron_muon.plan.stage_layouts import BufferSettings
from megatron_muon.plan.stage_params import StageGrid
from megatron_muon.plan.step_cost import optimizer_step_cost, stage_plan

H100 = GPU_PROFILES["h100-sxm"]
DEFAULT = MuonConfig()
LAYOUTS = [("8B", 8, 1, 8), ("70B", 8, 1, 8), ("405B", 8, 16, 64)]


def _bucket(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)  # DDP's default bucket with --overlap-grad-reduce


@pytest.mark.parametrize("priced", [True, False], ids=["job-price", "no-price"])
@pytest.mark.parametrize(("model", "tp", "pp", "dp"), LAYOUTS, ids=[m for m, *_ in LAYOUTS])
def test_the_default_never_predicts_slower_than_megatron_layout_and_owner(model, tp, pp, dp, priced):
    # with the price (what a Megatron job gets) the layout is the cheapest candidate on the step plan's
    # own price, megatron-core's packing among them; without it (a Python API user's DDP), whole matrices
    price = job_price(LLAMA3[model], tp, dp, H100, tp_mode=DEFAULT.tp_mode) if priced else None

    def step(tp_mode: str, dp_layout: str) -> float:
        return optimizer_step_cost(LLAMA3[model], optimizer="ours", tp=tp, dp=dp, pp=pp, hw=H100, tp_mode=tp_mode,
                                   dp_layout=dp_layout, bucket_numel=_bucket(dp), layout_price=price).total_s

    default, baseline = step(DEFAULT.tp_mode, DEFAULT.dp_layout), step("owner", "megatron")
    # both are sums of the same kinds of float terms, each a few ulps off: 1e-9 is far above that
    # and far below any difference of plans (a matrix moved is microseconds of a 0.1-1 s step)
    assert default <= baseline * (1 + 1e-9), (default, baseline)


def test_the_default_balances_405b_at_pp16_dp64():
    plan = stage_plan(LLAMA3["405B"], StageGrid(tp=8, dp=64, pp=16), DEFAULT.plan_settings(hardware=H100),
                      BufferSettings(DEFAULT.dp_layout, _bucket(64)))
    flops = plan.ns_flops
    assert max(flops) / (sum(flops) / len(flops)) <= 2.5
