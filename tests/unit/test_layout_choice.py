"""``plan.layout_choice``: the buffer layout chosen on its price (issue 42, item 4).

A hand case whose prices follow from the iteration model in closed form, and the Llama-3
layouts of the issue: 405B TP8 × PP16 × DP64 stage 0 (one whole-matrix bucket against
megatron-core's 22) and 8B TP8 × DP8, on h100-sxm with the iteration tables' 4M-token batch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_muon.core.models import LLAMA3, MOE_MODELS
from megatron_muon.plan.balanced_layout import LayoutItem, row_aligned_layout
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.layout_choice import ExpertRouting, LayoutPrice, choose_layout, forward_flops, job_price
from megatron_muon.plan.megatron_packing import megatron_packing
from megatron_muon.plan.stage_layouts import BufferSettings, buffer_items, shard_divisor, stage_layouts
from megatron_muon.plan.stage_params import StageGrid, group_topology, stage_params

H100 = GPU_PROFILES["h100-sxm"]
BUCKET = lambda dp: max(40_000_000, 1_000_000 * dp)  # noqa: E731  megatron-core's default bucket size

# The hand case: four 1024 x 1024 matrices (N elements each) at DP 2, megatron-core's bucket N.
# Whole matrices: one bucket of 4N (it stays open to 2 x DP x N), two matrices per shard, no
# padding. Row-aligned: four buckets of N, each matrix cut in two halves at row 512.
N = 1024 * 1024
BANDWIDTH = 1e9
# no latency, no efficiency loss, nothing hidden under NS: every price is bytes / BANDWIDTH
FLAT = replace(H100, inter_node_bandwidth=BANDWIDTH, collective_latency_s=0.0, all_gather_efficiency=1.0,
               all_to_all_efficiency=1.0, comm_overlap=0.0)
# each matrix's forward is 10 x its bucket's all-gather (N bytes / BANDWIDTH), so a later bucket's
# collectives hide entirely under the compute that follows them
FORWARD = 10 * N / BANDWIDTH * FLAT.matmul_flops
HAND = [LayoutItem(N, 1.0, whole=True, row=1024) for _ in range(4)]


def _hand_price(overlap: bool) -> LayoutPrice:
    return LayoutPrice(4, 1, True, FLAT, overlap_grad_reduce=overlap, overlap_param_gather=overlap)


def test_hand_case_overlap_chooses_megatron_buckets():
    c = choose_layout(HAND, [FORWARD] * 4, 2, N, _hand_price(True))
    # bytes per rank of a bucket of n elements at DP 2: reduce-scatter n x 4 B x 1/2, all-gather n x 2 B x 1/2.
    # Whole: the one bucket's both exposed: 8N + 4N. Row-aligned: only the last reduce-scatter (2N) and the
    # first all-gather (N); its exchange: each rank sends and receives N/2 per matrix, 2N elements of 2 B.
    assert (c.whole.buckets, c.row_aligned.buckets) == (1, 4)
    assert c.whole.exposed_ddp_s == pytest.approx(12 * N / BANDWIDTH, rel=1e-9)  # float sums of a few terms
    assert c.whole.exchange_s == 0.0
    assert c.row_aligned.exposed_ddp_s == pytest.approx(3 * N / BANDWIDTH, rel=1e-9)
    assert c.row_aligned.exchange_s == pytest.approx(4 * N / BANDWIDTH, rel=1e-9)
    # megatron-core's own packing cuts each matrix at the same row 512 (one matrix per bucket, shard N/2):
    # the same layout, the same price, and a tie goes to megatron-core's own
    assert c.layout == row_aligned_layout(HAND, 2, N) == megatron_packing([N] * 4, [False] * 4, 2, N)
    assert c.megatron.total_s == c.row_aligned.total_s and c.chosen == "megatron"


def test_hand_case_without_overlap_keeps_whole_matrices():
    c = choose_layout(HAND, [FORWARD] * 4, 2, N, _hand_price(False))
    # nothing overlaps: both expose all 12N bytes, and the cuts add their exchange
    assert c.whole.exposed_ddp_s == pytest.approx(c.row_aligned.exposed_ddp_s, rel=1e-9)
    assert c.chosen == "whole" and c.layout.buckets == ((0, 4 * N),)


def _choice(name: str, tp: int, pp: int, dp: int, stage: int):
    shape = next(s for s in LLAMA3.values() if s.name == name)
    grid = StageGrid(tp, dp, pp, stage)
    params = stage_params(shape, grid)
    price = job_price(shape, tp, dp, H100)
    flops = [forward_flops(p.name, p.numel, len(p.shape), price) for p in params]
    bucket = BUCKET(dp) if grid.first else None
    choice = choose_layout(buffer_items(params, tp, BufferSettings()), flops, dp, bucket, price,
                           shard_divisor=shard_divisor(dp))
    return choice, megatron_packing([p.numel for p in params], [False] * len(params), dp, bucket)


def test_405b_stage0_chooses_megatron_sized_buckets():
    c, packed = _choice("llama3-405b", 8, 16, 64, 0)
    # M = 4M tokens / 8192 / 64 = 8; the whole layout is one bucket of 3.07 B elements, whose 12 GB
    # reduce-scatter and 6 GB all-gather nothing hides on the first stage
    assert c.price.micro_batches == 8
    # megatron-core's own packing: 253.2 ms exposed + 2.6 ms exchange, 0.4 ms under the row-aligned cuts'
    # (their 0.4 % padding); Newton-Schulz 119 ms on the busiest DP rank in all three
    assert c.chosen == "megatron" and c.layout == packed
    assert len(c.layout.buckets) == 22 and c.whole.buckets == 1
    assert c.megatron.total_s < 0.8 * c.whole.total_s  # predicted 375 ms against 574 ms


def test_405b_later_stage_has_one_bucket_whatever_it_chooses():
    # DDP buckets the first stage only: one bucket in every candidate (28 matrices cannot lie whole on 64
    # ranks, so the whole layout falls back to cuts too), priced within 0.1 % of each other
    c, _ = _choice("llama3-405b", 8, 16, 64, 1)
    assert c.whole.buckets == c.megatron.buckets == c.row_aligned.buckets == len(c.layout.buckets) == 1
    assert c.priced.total_s == min(p.total_s for p in (c.whole, c.megatron, c.row_aligned))


def test_8b_tp8_dp8_what_the_price_says():
    c, packed = _choice("llama3-8b", 8, 1, 8, 0)
    # 4 whole-matrix buckets expose 79 ms; megatron-core's 18 expose 61 ms, and the cut matrices'
    # exchange costs about 2 ms of it after NS hides 80 %: the price picks megatron-sized buckets (the
    # row-aligned cuts by 0.1 ms of Newton-Schulz balance, 15.1 ms against 15.4 on the busiest DP rank)
    assert c.chosen == "row-aligned"
    assert (c.whole.buckets, c.row_aligned.buckets, len(packed.buckets)) == (4, 18, 18)
    assert c.row_aligned.total_s < c.megatron.total_s < c.whole.total_s


def test_every_rank_gets_the_same_answer():
    # a pure function of its inputs: two calls (two DP ranks) agree bucket for bucket
    first, _ = _choice("llama3-8b", 8, 1, 8, 0)
    again, _ = _choice("llama3-8b", 8, 1, 8, 0)
    assert first == again


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="one per item"):
        choose_layout(HAND, [0.0], 2, N, _hand_price(True))
    with pytest.raises(ValueError, match="micro_batches"):
        LayoutPrice(0, 1, True, FLAT)


def test_priced_applies_the_price_and_balanced_ignores_it():
    # --muon-dp-layout priced lays the buffer out as the price chooses; balanced keeps whole matrices
    shape, grid = LLAMA3["8B"], StageGrid(8, 8)
    price = job_price(shape, 8, 8, H100)
    priced = stage_layouts(shape, grid, BufferSettings("priced", BUCKET(8), price=price)).buffer
    balanced = stage_layouts(shape, grid, BufferSettings("balanced", BUCKET(8), price=price)).buffer
    assert (len(priced.buckets), len(balanced.buckets)) == (18, 4)
    # without a price (a Python API user's own DDP), priced is balanced
    assert stage_layouts(shape, grid, BufferSettings("priced", BUCKET(8))).buffer == balanced


def test_without_megatrons_args_the_adapter_prices_nothing(monkeypatch):
    # a Python API user's own DDP: no args parsed, so no batch or sequence to price; whole matrices
    from megatron.training import global_vars

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.layout import megatron_layout_price

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    assert megatron_layout_price(None, None, MuonConfig(dp_layout="priced"), None, None) is None


def test_muonbp_local_blocks_keep_every_cut_between_rows():
    # --muonbp-block local orthogonalizes each DP rank's own rows: at 405B stage 0 megatron-core's packing
    # and the row-aligned one (22 buckets too small to round every shard to the rows) both cut rows, so
    # whole matrices stay, as they did before the price (one bucket, the row-aligned fallback packing)
    shape = next(s for s in LLAMA3.values() if s.name == "llama3-405b")
    grid = StageGrid(8, 64, 16, 0)
    params = stage_params(shape, grid)
    items = buffer_items(params, 8, BufferSettings())
    price = replace(job_price(shape, 8, 64, H100, tp_mode="owner"), whole_rows=True)
    flops = [forward_flops(p.name, p.numel, len(p.shape), price) for p in params]
    c = choose_layout(items, flops, 64, BUCKET(64), price, shard_divisor=shard_divisor(64))
    assert c.chosen == "whole" and c.megatron.total_s < c.whole.total_s  # priced, not chosen
    for i, it in enumerate(items):
        start, end, b = c.layout.ranges[i]
        lo, hi = c.layout.buckets[b]
        shard = (hi - lo) // 64
        cuts = range(lo + ((start - lo) // shard + 1) * shard, end, shard)
        assert not it.whole or all((cut - start) % it.row == 0 for cut in cuts), i


def test_the_experts_see_the_tokens_routed_to_them():
    # one expert's share of EP x tokens x topk routed assignments: DeepSeek-V3 at EP8 (256 experts,
    # top-8) sees 2048 of an 8192-token micro-batch per expert, Mixtral (8 experts, top-2) 16384
    assert ExpertRouting(256, 8, 8).tokens_per_expert(8192) == 2048
    assert ExpertRouting(8, 2, 8).tokens_per_expert(8192) == 16384
    assert ExpertRouting(256, 1, 1).tokens_per_expert(1) == 1  # never below one token
    price = job_price(LLAMA3["8B"], 2, 8, H100, tp_mode="owner")
    # TP2 with expert TP2: an EP rank routes its TP pair's 8192 tokens; with expert TP1 its own
    # sequence-parallel half of them, 4096, so one expert sees 8 x 4096 x 2 / 8
    assert price.for_experts(ExpertRouting(8, 2, 8), expert_tp=2, dp_spans_nodes=True).tokens == 16384
    experts = price.for_experts(ExpertRouting(8, 2, 8), expert_tp=1, dp_spans_nodes=True)
    assert (experts.tokens, experts.tp, experts.dp_spans_nodes, experts.attention_flops) == (8192, 1, True, 0.0)
    assert (experts.micro_batches, experts.hardware, experts.tp_mode) == (price.micro_batches, H100, "owner")
    with pytest.raises(ValueError, match="ExpertRouting: num_experts 8, topk 9"):
        ExpertRouting(8, 9, 1)


def test_mixtral_experts_get_megatron_sized_buckets():
    """Mixtral 8x7B TP1 x EP8 x DP64: whole experts leave two buckets on the expert-DP group (it
    strides by EP, so it crosses nodes), whose reduce-scatter and all-gather wait for the whole
    backward and forward; megatron-core's 32 overlap them. The price cuts the experts at
    megatron-core's buckets: its exchange costs a fraction of the overlap it buys."""
    shape, grid = MOE_MODELS["mixtral-8x7b"], StageGrid(1, 64, 1, 0, 8, 1)
    price = job_price(shape, 1, 64, H100, tp_mode="owner")
    laid = stage_layouts(shape, grid, BufferSettings("priced", BUCKET(64), price=price))
    expert_grid = grid.expert_grid
    experts = price.for_experts(ExpertRouting(8, 2, 8), expert_tp=1,
                                dp_spans_nodes=group_topology(grid, experts=True, ranks_per_node=8).dp_spans_nodes)
    assert experts.dp_spans_nodes  # expert-DP peers stand EP x expert TP = 8 ranks apart: one per node
    params = laid.experts.params
    c = choose_layout(buffer_items(params, 1, BufferSettings()),
                      [forward_flops(p.name, p.numel, len(p.shape), experts) for p in params], expert_grid.dp,
                      BUCKET(64), experts, shard_divisor=shard_divisor(expert_grid.dp))
    assert (c.whole.buckets, c.megatron.buckets) == (2, 32)
    assert c.whole.exposed_ddp_s > 10 * c.megatron.exposed_ddp_s
    assert c.megatron.total_s < c.whole.total_s
    # the road lays the experts out as priced: megatron-core's 32 buckets, every expert matrix cut
    assert len(laid.experts.buffer.buckets) == 32
    assert all(sum(e > s for s, e in m.dp_ranges) > 1 for m in laid.experts.matrices)
