"""The Megatron training loop of the optimizer tests, and its one-process reference.

``train_runs(rank, world, runs)`` trains each run (a dict: ``tp``, ``pp``, ``dist_opt``,
``tp_mode``, ``bf16``, ``layout``, ``clip``, ...; see its docstring) in a ``dist_harness`` world
with ``get_megatron_muon_optimizer`` and returns the gathered full weights;
``train_reference(rank, world, configs)`` trains the same model at TP1 on one process with
``megatron_muon.Muon`` and ``torch.optim.AdamW``. The hyper-parameters (``LR``, ``WD``,
``MUON``, ...) and the tolerances the tests compare with live here, each with its reason.
"""

from __future__ import annotations

import torch
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

# Every run twice, in the same world: without grad clipping and with clip_grad = CLIP, which is
# below every grad norm of these runs (measured 2.49, 4.33 and 2.85-3.10 over the K = 3 steps),
# so Megatron clips every step (asserted from the norm its step returns); the reference clips
# with Megatron's rule (``clip_like_megatron``). In a world already started a run costs 1-3 s
# at DP4 on 2 cores (measured; the world's start-up, about 1 minute, is paid once).
CLIP = 1.0
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

MOE = dict(experts=4, topk=2)
"""The MoE runs' experts: 4 experts, top-2 routing (``build_tiny_gpt(moe=...)``)."""


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


def build_moe(run: dict, seed: int = 1234):
    """The tiny GPT with ``run["moe"]`` experts at ``run["tp"]`` (EP and expert-TP come from the
    parallel state), its Muon optimizer (``tp_mode``: owner unless given; ``clip``; ``dist_opt``)
    and scheduler."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    muon_config = MuonConfig(**dict(MUON, tp_mode=run.get("tp_mode", "owner")))
    model = build_tiny_gpt(run["tp"], use_distributed_optimizer=run["dist_opt"], moe=run["moe"], seed=seed,
                           num_layers=run.get("layers", 2))
    optimizer = get_megatron_muon_optimizer(_optimizer_config(run["dist_opt"], clip_grad=run.get("clip", 0.0)),
                                            model, muon_config)
    return model, optimizer, _scheduler(optimizer)
