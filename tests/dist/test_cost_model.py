"""The cost model counts what the code does: bytes and FLOPs against a real run, and sane trends.

Times cannot be tested (they depend on the machine); what the model *counts* can: for every
mode, the bytes the busiest rank sends and the NS FLOPs it runs must equal what
``comm_stats`` records when ``orthogonalize_sharded`` really runs those matrices.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import run_world

from megatron_muon import comm_stats, ns_flops, orthogonalize_sharded
from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.hardware import GPU_PROFILES, Hardware
from megatron_muon.plan.mode_cost import tp_mode_cost
from megatron_muon.plan.stage_params import StageGrid, model_numel, stage_params
from megatron_muon.plan.step_cost import optimizer_step_cost

H100 = GPU_PROFILES["h100-sxm"]
# A mixed call: two same-shape row-split, one column-split, one replicated, one odd shape.
SHAPES = [((48, 16), 0), ((48, 16), 0), ((16, 40), 1), ((12, 20), None), ((24, 8), 0)]


def sub(rows: int, cols: int, pdim: int | None, tp: int) -> MatrixLayout:
    """A whole ``rows x cols`` matrix split along ``pdim`` over ``tp`` ranks, as a plan holds it."""
    return MatrixLayout.from_full_shape(f"{rows}x{cols}", (rows, cols), pdim, tp)


def matrices(tp: int) -> list[MatrixLayout]:
    return [sub(*shape, pdim, tp) for shape, pdim in SHAPES]
MODES = ("duplicated", "distributed", "blockwise", "owner")


def _measured(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(*shape, generator=gen) for shape, _ in SHAPES]
    shards = [f if pdim is None else f.chunk(world, dim=pdim)[rank].contiguous() for f, (_, pdim) in zip(full, SHAPES)]
    pdims = [pdim for _, pdim in SHAPES]
    out = {}
    for mode in MODES:
        with comm_stats() as stats:
            orthogonalize_sharded(shards, pdims, mode=mode, validate=False)
        out[mode] = (stats.bytes_sent, stats.ns_flops)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_and_flops_match_a_real_run(world):
    per_rank = run_world(world, _measured)
    for mode in MODES:
        predicted = tp_mode_cost(matrices(world), mode, world, H100, NSOptions(dtype=torch.float32))
        sent = [r[mode][0] for r in per_rank]
        flops = [r[mode][1] for r in per_rank]
        # Exact integers: both sides count the same collectives and the same GEMMs. The model's
        # all-reduce volume is 2(t−1)/t·bytes unrounded; comm.py rounds down per call (≤ 1 byte
        # per call, 6 calls per shape group) — hence the small absolute slack.
        assert predicted.bytes_sent_max == pytest.approx(max(sent), abs=32), mode
        if mode == "owner":
            # the model reports the rank that is busiest by predicted time (kernel overheads
            # count, so with tiny matrices it need not be the one with most FLOPs); it must be
            # one of the real ranks' loads, and the loads must cover every matrix exactly once
            assert predicted.ns_flops_max in flops, mode
            assert sum(flops) == sum(ns_flops(*shape) for shape, _ in SHAPES), mode
        elif mode == "blockwise":  # symmetric: every rank does the same work
            assert len(set(flops)) == 1 and predicted.ns_flops_max == flops[0], mode
        else:  # symmetric but for the replicated matrix, which one rank runs (and broadcasts)
            assert predicted.ns_flops_max == max(flops), mode
            assert len(set(flops)) == 2 and max(flops) - min(flops) == ns_flops(12, 20), mode


def test_owner_beats_duplicated_with_many_matrices_and_not_with_one():
    many = [sub(4096, 4096, 1, 8)] * 32
    assert tp_mode_cost(many, "owner", 8, H100).total_s < tp_mode_cost(many, "duplicated", 8, H100).total_s / 3
    one = [sub(4096, 4096, 1, 8)]
    # one matrix: a single owner does the whole NS, exactly as every duplicated rank does, and
    # the exchange goes there and back, so owner cannot win
    assert tp_mode_cost(one, "owner", 8, H100).total_s >= tp_mode_cost(one, "duplicated", 8, H100).total_s


def test_distributed_wins_when_the_unsharded_dim_is_small():
    tall = [sub(28672, 512, 0, 8)]  # unsharded dim 512: an all-reduced Gram of 512², NS split 8 ways
    costs = {m: tp_mode_cost(tall, m, 8, H100).total_s for m in ("duplicated", "distributed", "owner")}
    assert min(costs, key=costs.get) == "distributed"


def test_faster_links_and_gemms_mean_less_time():
    ms = [sub(4096, 4096, 1, 8)] * 32 + [sub(14336, 4096, 0, 8)] * 32
    # No pipeline overlap (the owner pipeline hides up to min(NS, comm), which would cap slower
    # links' comm at the NS time) and no call latency (the plan cuts 32 layers into ~20 owner
    # micro-groups, whose 40 all-to-all latencies are a fifth of the comm): comm is then bytes
    # over bandwidth in every mode, and ten times slower links make it ten times longer.
    serial = dataclasses.replace(H100, comm_overlap=0.0, collective_latency_s=0.0)
    slow_links = dataclasses.replace(serial, intra_node_bandwidth=H100.intra_node_bandwidth / 10)
    slow_gemm = dataclasses.replace(serial, matmul_flops=H100.matmul_flops / 10)
    for mode in ("duplicated", "distributed", "owner"):
        base = tp_mode_cost(ms, mode, 8, serial)
        assert tp_mode_cost(ms, mode, 8, slow_links).comm_s == pytest.approx(
            base.comm_s * 10, rel=1e-9), mode  # float sums of the same terms
        assert tp_mode_cost(ms, mode, 8, slow_gemm).compute_s > 5 * base.compute_s, mode


def test_group_beyond_a_node_uses_inter_node_bandwidth():
    inside = tp_mode_cost([sub(4096, 4096, 1, 8)] * 16, "duplicated", 8, H100)
    across = tp_mode_cost([sub(4096, 4096, 1, 16)] * 16, "duplicated", 16, H100)
    per_byte_inside = inside.comm_s / inside.bytes_sent_max
    per_byte_across = across.comm_s / across.bytes_sent_max
    assert per_byte_across / per_byte_inside == pytest.approx(
        H100.intra_node_bandwidth / H100.inter_node_bandwidth, rel=0.05)  # latency terms < 5%


def test_llama_parameter_counts():
    # Meta's published sizes: 8.03B, 70.55B, 405.85B (untied embeddings, vocab 128256)
    assert model_numel(LLAMA3["8B"]) == pytest.approx(8.03e9, rel=1e-3)
    assert model_numel(LLAMA3["70B"]) == pytest.approx(70.55e9, rel=1e-3)
    assert model_numel(LLAMA3["405B"]) == pytest.approx(405.85e9, rel=1e-3)


def test_optimizer_step_orderings():
    model = LLAMA3["8B"]
    cost = lambda o, m="owner", dp=8: optimizer_step_cost(model, optimizer=o, tp=8, dp=dp, hw=H100, tp_mode=m).total_s  # noqa: E731
    assert cost("adam") < cost("ours", "blockwise") < cost("ours", "owner") < cost("ours", "duplicated")
    # plain DDP: every DP rank orthogonalizes everything, so DP does not divide the NS work
    assert cost("megatron-muon", "duplicated") > 3 * cost("ours", "duplicated")
    assert cost("megatron-muon", "duplicated", dp=8) == pytest.approx(
        cost("megatron-muon", "duplicated", dp=1), rel=0.05)


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        optimizer_step_cost(LLAMA3["8B"], optimizer="sgd", tp=8, dp=1, hw=H100)
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        tp_mode_cost([sub(8, 8, 0, 2)], "fast", 2, H100)
    with pytest.raises(ValueError, match="--muon-tp-mode: expected one of"):
        optimizer_step_cost(LLAMA3["8B"], optimizer="ours", tp=8, dp=1, hw=H100, tp_mode="fast")
    with pytest.raises(TypeError):
        Hardware(name="x")  # every constant must be given: nothing defaults silently


def test_pipeline_overlap_hides_owner_all_to_alls_only():
    """``Hardware.comm_overlap``: the owner pipeline's all-to-alls hide under NS (never more than
    the smaller of the two); the blocking modes and a zero overlap are unchanged."""
    from dataclasses import replace

    from megatron_muon.core.models import LLAMA3
    from megatron_muon.plan.hardware import GPU_PROFILES
    from megatron_muon.plan.step_cost import optimizer_step_cost

    model = LLAMA3["8B"]
    gpu = GPU_PROFILES["h100-sxm"]
    none = replace(gpu, comm_overlap=0.0)

    def step(hw, mode):
        return optimizer_step_cost(model, optimizer="ours", tp=8, dp=8, hw=hw, tp_mode=mode,
                                   dp_layout="megatron", bucket_numel=40_000_000)

    with_overlap, without = step(gpu, "owner"), step(none, "owner")
    hidden = without.total_s - with_overlap.total_s
    assert 0 < hidden <= gpu.comm_overlap * min(without.compute_s, without.comm_s) * (1 + 1e-9)
    assert step(gpu, "duplicated").total_s == step(none, "duplicated").total_s


def test_layer_wise_sends_its_results_once_through_the_param_all_gather():
    """megatron-core's layer-wise optimizer: DDP's all-reduce leaves every grad on every DP rank,
    each home orthogonalizes its whole matrices, and the param all-gather returns them. At TP 1 its
    plan sends nothing (no DP owner exchange, no broadcast of results beside the all-gather); at
    TP 8 only the TP mode's bytes, the same as megatron-core's Muon under plain DDP sends."""
    model = LLAMA3["8B"]
    lw = lambda tp: optimizer_step_cost(model, optimizer="megatron-layerwise", tp=tp, dp=8, hw=H100,  # noqa: E731
                                        tp_mode="owner")
    assert lw(1).bytes_sent_max == 0 and lw(1).param_gather_bytes > 0
    ddp = optimizer_step_cost(model, optimizer="megatron-muon", tp=8, dp=8, hw=H100, tp_mode="owner")
    # the busiest home's TP traffic is at most the whole stage's, which DDP's Muon sends on every rank
    assert 0 < lw(8).bytes_sent_max <= ddp.bytes_sent_max


def test_the_param_all_gather_moves_the_params_dtype():
    """Megatron's ZeRO-1 all-gather moves the model's params: half the bytes in bf16 of fp32's."""
    model = LLAMA3["8B"]
    gather = lambda b: optimizer_step_cost(model, optimizer="adam", tp=8, dp=8, hw=H100,  # noqa: E731
                                           param_bytes=b).param_gather_bytes
    assert gather(4) == 2 * gather(2) > 0
    with pytest.raises(ValueError, match="param_bytes 3; expected 1, 2 or 4"):
        gather(3)


def test_the_param_all_gather_at_dp_1_costs_what_the_backend_copies():
    """At DP 1 Megatron's distributed optimizer still all-gathers its param buffer, over a group of
    one: gloo copies it (``solo_gather_bandwidth``, measured), NCCL does nothing in place (None).
    Ours and Adam copy their buffer, the layer-wise optimizer both of its buffers, and
    megatron-core's Muon under plain DDP gathers nothing; at DP > 1 the real all-gather stands."""
    model = LLAMA3["8B"].scaled(16, num_layers=4, vocab=1024, num_heads=8, num_query_groups=2)
    gloo = dataclasses.replace(H100, solo_gather_bandwidth=1e9)

    def part(optimizer: str, hw: Hardware, dp: int = 1) -> float:
        cost = optimizer_step_cost(model, optimizer=optimizer, tp=2, dp=dp, hw=hw, tp_mode="owner",
                                   dp_layout="megatron", param_bytes=4)
        return cost.parts.get("param all-gather, DP 1", 0.0)

    local = sum(p.numel for p in stage_params(model, StageGrid(tp=2)))  # one TP rank's params
    for optimizer in ("ours", "adam", "megatron-layerwise"):
        # the buffer holds the TP rank's params, fp32, and megatron-core's bucket padding (none
        # at DP 1 for this model; 2 % allows for it)
        assert local * 4 / 1e9 <= part(optimizer, gloo) <= 1.02 * local * 4 / 1e9, optimizer
        assert part(optimizer, H100) == 0 and part(optimizer, gloo, dp=2) == 0
    assert part("megatron-muon", gloo) == 0


def _megatron_core_distributed(rank: int, world: int) -> list:
    """megatron-core 0.19.2's distributed mode on each sharded shape of ``SHAPES``: emerging-
    optimizers' ``newton_schulz_tp``, which ``TensorParallelMuon`` calls, with every all-reduce
    and every GEMM's FLOPs counted."""
    import torch.distributed as dist
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(7)
    out = []
    for (rows, cols), pdim in SHAPES:
        full = torch.randn(rows, cols, generator=gen)
        if pdim is None:
            continue
        shard = full.chunk(world, dim=pdim)[rank].contiguous()
        reduced = []
        real = dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (reduced.append(t.numel() * t.element_size()), real(t, *a, **k))[1]
        try:
            with FlopCounterMode(display=False) as flops:
                newton_schulz_tp(shard, 5, "quintic", dist.group.WORLD, pdim, "distributed")
        finally:
            dist.all_reduce = real
        out.append((len(reduced), sum(reduced), flops.get_total_flops()))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_cores_distributed_mode_is_priced_as_it_runs(world):
    """megatron-core's distributed mode (the ``megatron-muon`` and layer-wise rows of
    ``step_cost``) is priced from its own algorithm, counted on the real call: one norm
    all-reduce and one Gram all-reduce per step (no split products, no all-gather), and A·A
    formed whole on every rank. Exact integers: both sides count the same calls, bytes and GEMMs
    (the price's ring volume is 2(t−1)/t of the bytes all-reduced)."""
    from megatron_muon.plan.pricing import PRIMITIVES, sub_price

    ns = NSOptions(dtype=torch.float32)
    measured = run_world(world, _megatron_core_distributed)
    sharded = [(shape, pdim) for shape, pdim in SHAPES if pdim is not None]
    for rank_counts in measured:
        for (shape, pdim), (calls, nbytes, flops) in zip(sharded, rank_counts):
            price = sub_price(sub(*shape, pdim, world), "distributed", ns, tp=world, rank=0, megatron_core=True)
            assert calls == price.calls[PRIMITIVES.index("all_reduce")] + price.scalar_calls, shape
            assert price.sent == pytest.approx(2 * (world - 1) / world * nbytes), shape
            assert price.flops == flops, shape
            assert price.calls[PRIMITIVES.index("all_gather")] == 0 and price.scalar_calls == 1, shape
