"""Muon on a real megatron-core GPT under TP × DP, against a single-process reference.

Every run trains the tiny GPT of ``megatron_harness`` (local spec, RoPE, SwiGLU, GQA) for K
steps on one fixed batch with ``get_megatron_muon_optimizer`` — Megatron's own DDP, buffers,
optimizer wrappers and LR scheduler — then gathers every parameter into its full TP=1 shape.
The reference is the same model at TP=1 on one process, trained with ``megatron_muon.Muon`` on
the matrices (QKV split per query group, fc1 into gate/up, Megatron's scale rule) and
``torch.optim.AdamW`` on the rest, with the same hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from megatron_harness import (
    LAYERS,
    build_tiny_gpt,
    destroy_megatron,
    forward_backward,
    gather_full_params,
    init_megatron,
    make_batch,
    reference_param_groups,
)

K = 3
LR, WD, BETAS, EPS = 0.02, 0.1, (0.9, 0.95), 1e-8
MUON = dict(momentum=0.9, nesterov=True, scale_mode="spectral", extra_scale_factor=0.2,
            fp32_matmul_prec="highest", coefficient_type="quintic", num_ns_steps=5)
# fp32 everywhere. At TP=1 every layout and TP mode gives the same weights, off the reference by
# a measured 3.25e-7 after K = 3 steps (on linear_proj; the same value for all, so it comes from
# the update's arithmetic, not from the layout). At TP=2 the vocab-parallel cross entropy and
# RowParallel all-reduces sum in another order, so gradients differ in the last bits; AdamW's
# 1/sqrt(v) on the output layer amplifies that most (measured max 1.13e-6, on
# output_layer.weight). 2e-6 leaves 1.8x margin, while a wrong update (blockwise, an unsplit QKV)
# is off by > 1e-3.
ATOL = 2e-6
# With clipping the grads are scaled by clip / norm, where the norm carries the layout's summation
# order too (see NORM_RTOL), and the smaller grads of the output layer's rare-token rows sit
# nearer AdamW's eps, where a relative change in the grad moves the update most: measured max
# 2.21e-6 at TP=2 (output_layer.weight), 5.6e-7 at TP=1. 4e-6 leaves 1.8x margin; a skipped
# clip is off by 1.4e-2, and a wrong clip coefficient is caught sharper by NORM_RTOL.
ATOL_CLIP = 4e-6
# The grad norm Megatron's step returns vs the reference's (before clipping): fp32 sums of
# squares in the layout's order (per shard, all-reduced) of grads that differ in the last bits
# after the first step; measured max relative difference 1.5e-7 without clipping, 4.1e-7 with.
# 1e-6 leaves 2.4x margin.
NORM_RTOL = 1e-6
# run_world's wait for a world's results: 36 runs at DP4 take about 3 minutes on 2 cores, many
# times that when other jobs share them
TIMEOUT = 1800


def _optimizer_config(dist_opt: bool, bf16: bool = False, clip_grad: float = 0.0):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                           adam_beta2=BETAS[1], adam_eps=EPS, bf16=bf16, clip_grad=clip_grad,
                           use_distributed_optimizer=dist_opt)


def _scheduler(optimizer):
    """Megatron's own scheduler with a constant lr: it writes lr and wd × wd_mult per group."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                                   lr_decay_steps=100, lr_decay_style="constant", start_wd=WD, end_wd=WD,
                                   wd_incr_steps=100, wd_incr_style="constant")


def train_runs(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Train each run in this world (re-initializing Megatron's parallel state per run).

    A run: ``tp``, ``pp`` (1), ``vpp`` (None: no virtual stages), ``layers`` (``LAYERS``),
    ``microbatches`` (1), ``clip`` (0.0: Megatron's ``clip_grad``), ``dist_opt``, ``tp_mode``,
    ``bf16``, ``layout``, ``muon`` (MuonConfig overrides), ``overlap`` (``--overlap-grad-reduce``
    and ``--overlap-param-gather``) and ``bucket_size`` (DDP's, in elements). Returns, per run, the full weights
    (rank 0), this rank's params, the bytes sent and the grad norm ``step`` returned, per step.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_muon import comm_stats
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    out = []
    for run in runs:
        tp, pp, vpp = run["tp"], run.get("pp", 1), run.get("vpp")
        init_megatron(tp, pp, vpp=vpp)
        muon_config = MuonConfig(tp_mode=run["tp_mode"], **dict(MUON, **run.get("muon", {})))
        model = build_tiny_gpt(tp, pp, use_distributed_optimizer=run["dist_opt"], bf16=run.get("bf16", False),
                               dp_layout=run.get("layout", "megatron"), muon_config=muon_config,
                               num_layers=run.get("layers", LAYERS), vpp=vpp, overlap=run.get("overlap", False),
                               bucket_size=run.get("bucket_size"))
        optimizer = get_megatron_muon_optimizer(
            _optimizer_config(run["dist_opt"], bf16=run.get("bf16", False), clip_grad=run.get("clip", 0.0)),
            model, muon_config,
        )
        scheduler = _scheduler(optimizer)
        inner = optimizer.chained_optimizers[0].optimizer
        layouts = [m.layout for m in inner.matrices()]
        batch = make_batch(7)
        stats_per_step, grad_norms = [], []
        for _ in range(K):
            microbatches = run.get("microbatches", 1)
            forward_backward(model, batch, pp=pp, num_microbatches=microbatches, optimizer=optimizer,
                             use_schedule=pp > 1 or microbatches > 1)
            with comm_stats() as stats:
                ok, grad_norm, _ = optimizer.step()
            assert ok
            scheduler.step(1)
            stats_per_step.append(dict(stats.bytes_by_primitive))
            grad_norms.append(grad_norm)
        if run.get("overlap") and run["dist_opt"]:
            for chunk in model:  # the last step's param all-gather, which the next forward would start
                chunk.disable_forward_pre_hook(param_sync=True)
        full = gather_full_params(model, ps.get_tensor_model_parallel_group(), pp)
        local = {f"chunk{c}.{n}": p.detach().clone() for c, chunk in enumerate(model)
                 for n, p in chunk.named_parameters()}
        buckets = sum(len(buffer.buckets) for chunk in model for buffer in chunk.buffers)
        out.append(dict(run=run, full=full if rank == 0 else None, local=local, stats=stats_per_step, buckets=buckets,
                        grad_norms=grad_norms, layouts=layouts, dp_size=ps.get_data_parallel_world_size(),
                        tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                        pp_rank=ps.get_pipeline_model_parallel_rank(), world=dist.get_world_size()))
        destroy_megatron()
    return out


def clip_like_megatron(params, clip_grad: float) -> float:
    """Megatron's ``clip_grad_norm`` (``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32``)
    on one process, over ``p.grad``: the global L2 norm as its no-apex ``local_multi_tensor_l2_norm``
    computes it (the norm of the per-tensor norms, through a Python float), then every grad
    scaled by ``clip / (norm + 1e-6)`` if that is below 1 (``clip_grad`` 0: no clipping, as
    Megatron's ``step`` skips it). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm_of_norms = torch.norm(torch.tensor([torch.norm(g) for g in grads]))
    total_norm = (torch.tensor([float(norm_of_norms)]) ** 2).item() ** 0.5  # Megatron sums norm², then **0.5
    coefficient = clip_grad / (total_norm + 1.0e-6)
    if clip_grad > 0.0 and coefficient < 1.0:
        for g in grads:
            g.copy_(g * coefficient)
    return total_norm


def train_reference(rank: int, world: int, configs: list[dict]) -> list[tuple]:
    """TP=1, one process: megatron_muon.Muon on the matrices, torch AdamW on the rest.

    One reference per config: ``batch`` (2: the sequences of ``make_batch(7)``, the global batch),
    ``clip`` (0.0: none; else as ``clip_like_megatron``), ``layers``
    (``LAYERS``), ``microbatches`` (1: one direct call; more: Megatron's no-pipelining schedule
    over that many slices, accumulating the grads in the order a pipeline does). Returns, per
    config, (full weights after K steps, initial weights, the grad norm before clipping per step).
    """
    from megatron.core import parallel_state as ps

    from megatron_muon import Muon

    out = []
    for config in configs:
        init_megatron(1, 1)
        model = build_tiny_gpt(1, 1, num_layers=config.get("layers", LAYERS))
        initial = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
        muon_groups, decay, no_decay = reference_param_groups(model[0])
        muon = Muon(muon_groups, lr=LR, weight_decay=WD, momentum=MUON["momentum"], nesterov=MUON["nesterov"],
                    ns_dtype=torch.float32, coefficients=MUON["coefficient_type"], scale_mode=MUON["scale_mode"],
                    extra_scale_factor=MUON["extra_scale_factor"])
        adamw = torch.optim.AdamW([dict(params=decay, weight_decay=WD), dict(params=no_decay, weight_decay=0.0)],
                                  lr=LR, betas=BETAS, eps=EPS)
        batch = make_batch(7, micro_batch_size=config.get("batch", 2))
        microbatches = config.get("microbatches", 1)
        grad_norms = []
        for _ in range(K):
            forward_backward(model, batch, pp=1, num_microbatches=microbatches, use_schedule=microbatches > 1)
            for p in model[0].parameters():
                p.grad = p.main_grad
            grad_norms.append(clip_like_megatron(model[0].parameters(), config.get("clip", 0.0)))
            muon.step()
            adamw.step()
        full = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
        destroy_megatron()
        out.append((full, initial, grad_norms))
    return out


# bf16 params with fp32 main params, NS in bf16 (upstream's "medium"): Megatron's usual path.
BF16 = dict(bf16=True, muon=dict(fp32_matmul_prec="medium"))
RUNS_1 = [dict(tp=1, dist_opt=d, tp_mode="owner") for d in (False, True)]
RUNS_1 += [dict(tp=1, dist_opt=True, tp_mode="owner", **BF16)]
RUNS_2 = [dict(tp=t, dist_opt=d, tp_mode=m)
          for t in (1, 2) for d in (False, True) for m in ("duplicated", "distributed", "owner")]
RUNS_2 += [dict(tp=1, dist_opt=False, tp_mode="owner", muon=dict(dp_mode="redundant"))]  # plain DDP, no DP owner
RUNS_2 += [dict(tp=1, pp=2, dist_opt=d, tp_mode="owner") for d in (False, True)]  # TP1 x PP2 x DP1
RUNS_4 = [dict(tp=2, dist_opt=d, tp_mode=m)
          for d in (False, True) for m in ("duplicated", "distributed", "owner", "blockwise")]
# Fragments: Megatron's DDP ignores bucket_size without overlap_grad_reduce (one bucket per
# buffer), so cuts come from where the 1/dp boundaries fall: at DP4, and per stage at PP2 x DP2,
# they fall inside fc1 matrices (checked below).
RUNS_4 += [dict(tp=1, dist_opt=True, tp_mode="owner", expect_cut=True)]
RUNS_4 += [dict(tp=1, pp=2, dist_opt=d, tp_mode="owner", expect_cut=d) for d in (False, True)]  # x DP2
RUNS_4 += [dict(tp=2, dist_opt=True, tp_mode="owner", **BF16)]
# --muon-dp-layout balanced: every matrix whole on one DP rank (no DP exchange), all exact modes
# at TP1 × DP2 and TP2 × DP2, the owner mode at TP1 × DP4 and PP2 × DP{1, 2}, and bf16.
BALANCED = dict(dist_opt=True, layout="balanced")
RUNS_2 += [dict(tp=1, tp_mode=m, **BALANCED) for m in ("duplicated", "distributed", "owner")]
RUNS_2 += [dict(tp=1, pp=2, tp_mode="owner", **BALANCED)]
RUNS_4 += [dict(tp=2, tp_mode=m, **BALANCED) for m in ("duplicated", "distributed", "owner")]
RUNS_4 += [dict(tp=1, tp_mode="owner", **BALANCED), dict(tp=1, pp=2, tp_mode="owner", **BALANCED)]
RUNS_4 += [dict(tp=2, tp_mode="owner", **BALANCED, **BF16)]
# --overlap-grad-reduce with several buckets (DDP honours bucket_size only with it), and
# --overlap-param-gather with the distributed optimizer: grads reduce-scattered bucket by bucket
# from backward hooks, the param all-gather left to the next forward's pre-hooks. At 20,000
# elements the tiny model's buffer splits into several buckets (asserted), each sharded over DP
# on its own, so matrices are cut at bucket and shard boundaries alike.
OVERLAP = dict(overlap=True, bucket_size=20_000)
RUNS_4 += [dict(tp=t, dist_opt=True, tp_mode="owner", expect_cut=True, **OVERLAP) for t in (1, 2)]
RUNS_4 += [dict(tp=2, dist_opt=False, tp_mode="owner", **OVERLAP)]
RUNS_4 += [dict(tp=2, tp_mode="owner", **BALANCED, **OVERLAP)]
# Every run twice, in the same world: without grad clipping and with clip_grad = CLIP, which is
# below every grad norm of these runs (measured 2.49, 4.33 and 2.85-3.10 over the K = 3 steps),
# so Megatron clips every step (asserted from the norm its step returns); the reference clips
# with Megatron's rule (``clip_like_megatron``). In a world already started a run costs 1-3 s
# at DP4 on 2 cores (measured; the world's start-up, about 1 minute, is paid once).
CLIP = 1.0
RUNS = {world: [dict(run, clip=clip) for run in runs for clip in (0.0, CLIP)]
        for world, runs in ((1, RUNS_1), (2, RUNS_2), (4, RUNS_4))}
# The bf16 runs against the fp32 reference, per Muon matrix, the update delta = params after K
# steps - initial params. Measured over 4 batch seeds (7, 1, 2, 3) x 8 matrices x both bf16 runs
# (TP1 and TP2 x DP2), 64 values: relative distance |d_bf16 - d_ref| / |d_ref| 0.063-0.132,
# norm ratio |d_bf16| / |d_ref| 0.9985-1.0071, cosine 0.9913-0.9980. bf16 noise moves the
# update's small directions (NS maps every singular value to ~1) but neither its size nor its
# overall direction, so the norm ratio and the cosine are the sharp checks: a 2% scale error or a
# different update breaks them, while the distance alone would pass a 20% scale error.
# With clipping (batch seed 7, the same runs): norm ratio within 0.0061 of 1, cosine >= 0.9918,
# distance <= 0.128: clipping scales each step's grad, which NS and Adam's ratio mostly undo.
BF16_NORM_RATIO = 0.02  # |ratio - 1|; measured max 0.0073 (2.7x margin)
BF16_MIN_COSINE = 0.98  # measured min 0.9913 (1 - cos: 0.0087 vs 0.02, 2.3x margin)
BF16_DISTANCE = 0.2  # measured max 0.132 (1.5x margin)


@pytest.fixture(scope="module")
def references():
    """{clip: (full weights after K steps, initial weights, grad norm per step)}."""
    clips = (0.0, CLIP)
    return dict(zip(clips, run_world(1, train_reference, [dict(clip=c) for c in clips])[0]))


@pytest.fixture(scope="module")
def trained():
    return {world: run_world(world, train_runs, runs, timeout=TIMEOUT) for world, runs in RUNS.items()}


def _run_id(world: int, run: dict) -> str:
    tags = [f"w{world}", f"tp{run['tp']}", f"pp{run.get('pp', 1)}", "distopt" if run["dist_opt"] else "ddp",
            run["tp_mode"]]
    tags += ["bf16"] * bool(run.get("bf16"))
    tags += [run["layout"]] if run.get("layout") else []
    tags += [run.get("muon", {}).get("dp_mode", "")] if run.get("muon", {}).get("dp_mode") else []
    tags += ["overlap"] if run.get("overlap") else []
    tags += [f"clip{run['clip']:g}"] if run.get("clip") else []
    return "-".join(tags)


def _cases():
    for world, runs in RUNS.items():
        for i, run in enumerate(runs):
            yield pytest.param(world, i, id=_run_id(world, run))


@pytest.mark.parametrize("world, index", list(_cases()))
def test_matches_single_process_reference(trained, references, world, index):
    result = trained[world][0][index]
    run = result["run"]
    reference, initial, reference_norms = references[run["clip"]]
    assert set(result["full"]) == set(reference)
    if run["clip"]:
        # Clipping must have happened: Megatron clips when the norm its step returns exceeds clip_grad.
        assert all(n > run["clip"] for n in result["grad_norms"]), f"{run}: no clipping, norms {result['grad_norms']}"
    if not run.get("bf16") and run["tp_mode"] != "blockwise":
        # Megatron's norm over the layout's shards is the full model's: nothing missed, nothing
        # counted twice (TP-duplicated norm weights, DP shards, PP stages).
        for step, (got, want) in enumerate(zip(result["grad_norms"], reference_norms)):
            assert abs(got - want) <= NORM_RTOL * want, f"{run} step {step}: grad norm {got} vs {want}"
    worst = max(((result["full"][n] - reference[n]).abs().max().item(), n) for n in reference)
    if run.get("bf16"):
        # bf16 activations change the gradient in its 3rd significant digit, and NS maps every
        # singular value to ~1, so the small (noisy) directions of the gradient change the
        # update visibly; an entry-wise bound would be meaningless. The bf16 update must still
        # be the same update: the same size, the same direction (bounds measured, see above).
        for n in reference:
            if reference[n].dim() != 2 or "embedding" in n or "output_layer" in n:
                continue  # AdamW moves entries by ~±lr whatever the gradient's size
            want = (reference[n] - initial[n]).flatten()
            got = (result["full"][n].float() - initial[n]).flatten()
            ratio = (got.norm() / want.norm()).item()
            cosine = (torch.dot(got, want) / (got.norm() * want.norm())).item()
            distance = ((got - want).norm() / want.norm()).item()
            assert abs(ratio - 1) <= BF16_NORM_RATIO, f"{run}: {n} update's size is {ratio:.4f}x the reference's"
            assert cosine >= BF16_MIN_COSINE, f"{run}: {n} update's cosine to the reference is {cosine:.4f}"
            assert distance <= BF16_DISTANCE, f"{run}: {n} update off by {distance:.3f} of its size"
    elif run["tp_mode"] == "blockwise":
        # BlockMuon is a different algorithm: the matrices must NOT match the reference.
        assert worst[0] > 1e-3, f"blockwise unexpectedly matched the reference (max diff {worst[0]:.2e})"
    else:
        atol = ATOL_CLIP if run["clip"] else ATOL
        assert worst[0] <= atol, f"{run}: {worst[1]} off by {worst[0]:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_dp_replicas_bitwise_identical(trained, world):
    """Upstream 0.19.2's muon + distributed optimizer let DP replicas diverge; ours must not."""
    for index in range(len(trained[world][0])):
        ranks = [r[index] for r in trained[world]]
        for r in ranks:
            for q in ranks:
                if (q["tp_rank"], q["pp_rank"]) == (r["tp_rank"], r["pp_rank"]):
                    for name, t in r["local"].items():
                        assert torch.equal(t, q["local"][name]), f"{r['run']}: {name} differs across DP"


def test_only_cut_or_moved_matrices_travel_across_dp(trained):
    """TP=1 runs with the distributed optimizer: the DP owner exchange moves exactly the pieces
    not already on their owner (there and back), and nothing else."""
    from megatron_muon.parallel.orthogonalize import plan_dp_owners

    checked = 0
    for world, runs in RUNS.items():
        for index, run in enumerate(runs):
            if not run["dist_opt"] or run["tp"] != 1 or run.get("bf16") or world == 1:
                continue
            ranks = [r[index] for r in trained[world]]
            cut = []
            for pp_rank in {r["pp_rank"] for r in ranks}:
                stage = [r for r in ranks if r["pp_rank"] == pp_rank]
                layouts, dp = stage[0]["layouts"], stage[0]["dp_size"]
                if dp == 1:
                    continue
                owners = plan_dp_owners(layouts, dp)
                moved = sum(2 * (e - s) * 4 for lay, o in zip(layouts, owners)
                            for d, (s, e) in enumerate(lay.dp_ranges) if d != o)
                for step in range(K):
                    sent = sum(r["stats"][step].get("all_to_all", 0) for r in stage)
                    assert sent == moved, f"{_run_id(world, run)} step {step}: {sent} bytes, expected {moved}"
                cut += [lay.name for lay in layouts if len(lay.holders(dp)) > 1]
            if run.get("expect_cut"):
                assert cut, f"{_run_id(world, run)}: some matrix should be cut across DP ranks"
            checked += 1
    assert checked >= 3


def test_overlap_runs_have_several_buckets(trained):
    """The overlap runs exercise what they are for: more than one bucket per buffer, where
    megatron-core lays the buffer out. (The balanced layout keeps a bucket open until it holds
    a few times DP x its largest matrix, which is this whole tiny model: one bucket, by design;
    that run checks the overlapped grad reduce and param gather on our layout.)"""
    overlap = [i for i, run in enumerate(RUNS[4]) if run.get("overlap")]
    assert len(overlap) == 8  # 4 layouts, with and without clipping
    for index in overlap:
        if RUNS[4][index].get("layout") != "balanced":
            assert trained[4][0][index]["buckets"] >= 3, (RUNS[4][index], trained[4][0][index]["buckets"])
    plain = next(i for i, run in enumerate(RUNS[4]) if run["dist_opt"] and not run.get("overlap"))
    assert trained[4][0][plain]["buckets"] == 1  # without overlap DDP ignores bucket_size


def test_redundant_dp_mode_moves_nothing_across_dp(trained):
    indices = [i for i, r in enumerate(RUNS[2]) if r.get("muon", {}).get("dp_mode") == "redundant"]
    assert len(indices) == 2  # with and without clipping
    for r in trained[2]:
        for index in indices:
            assert all(step.get("all_to_all", 0) == 0 for step in r[index]["stats"])


def test_balanced_layout_cuts_no_matrix_and_moves_nothing_across_dp(trained):
    """--muon-dp-layout balanced: every Muon matrix lies in one DP rank's range, so the DP plan
    pins it there; at TP1 (where every all-to-all is the DP exchange) no byte moves."""
    checked = 0
    for world, runs in RUNS.items():
        for index, run in enumerate(runs):
            if run.get("layout") != "balanced":
                continue
            for r in trained[world]:
                result = r[index]
                dp = result["dp_size"]
                assert all(len(lay.holders(dp)) == 1 for lay in result["layouts"]), \
                    f"{_run_id(world, run)}: a matrix is cut across DP ranks"
                if run["tp"] == 1:
                    assert all(step.get("all_to_all", 0) == 0 for step in result["stats"]), _run_id(world, run)
            checked += 1
    assert checked >= 9
