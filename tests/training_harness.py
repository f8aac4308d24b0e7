"""The Megatron training loop of the optimizer tests, and its one-process reference.

A test module declares its runs as ``Run`` values (typed and frozen, every field with its
default, so a misspelt setting is a TypeError when the module is imported) and asserts on the
``Trace`` each run leaves:

* ``train_all(rank, world, runs)``, for ``dist_harness.run_world``: ``train(run)`` for each run in
  that world: ``start`` (Megatron's parallel state), ``build`` (the tiny GPT of
  ``megatron_harness`` wrapped as ``Run.wrap`` says, ``get_megatron_muon_optimizer``, Megatron's
  LR scheduler), ``steps`` (the one loop: forward/backward, ``optimizer.step``, the scheduler),
  ``trace`` (the gathered full weights, this rank's params, per-step grad norms and bytes, the
  layouts, the parallel ranks). A run that differs (an FSDP wrap, QK-clip, experts, a NaN grad)
  says so in its fields; ``Run.probe`` is the one hook, called after every step.
* ``references(runs)``, in the pytest process: each run's one-process TP1 reference
  (``reference``: the same model with ``megatron_muon.Muon`` on the matrices and
  ``torch.optim.AdamW`` on the rest), computed once per session for each distinct
  ``Run.reference_run``, whichever module asks first.

A flow that is not a plain K-step run (save, rebuild, load, resume) calls ``start`` / ``build`` /
``steps`` itself. The hyper-parameters (``LR``, ``WD``, ``MUON``, ...) and the tolerances the tests
compare with live here, each with its reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from megatron_harness import (
    FFN,
    GLOBAL_BATCH,
    HIDDEN,
    LAYERS,
    MLA,
    SEQ,
    VOCAB,
    build_tiny_gpt,
    destroy_megatron,
    dp_slice,
    forward_backward,
    gather_full_params,
    init_megatron,
    is_expert,
    make_batch,
    reference_param_groups,
)

from megatron_muon.config import MuonConfig

K = 3
LR, WD, BETAS, EPS = 0.02, 0.1, (0.9, 0.95), 1e-8
MUON = dict(momentum=0.9, nesterov=True, scale_mode="spectral", extra_scale_factor=0.2,
            fp32_matmul_prec="highest", coefficient_type="quintic", num_ns_steps=5)
# The fp32 tolerances: a run and the reference compute the same steps in another summation order
# (TP's split GEMMs and all-reduces, the vocab-parallel cross entropy, DP's reductions, another
# batching), never another result. rounding_bounds' model, carried into one training step:
#  * a gradient entry went through reductions of HIDDEN, FFN and SEQ terms per layer and the
#    logits' VOCAB (each forward sum has a backward twin of its length): PATH = 672 terms, so it
#    errs by √PATH·u relative to its terms' magnitude; a weight's gradient then sums one term per
#    token, whose signs follow the backward signal: such terms cancel to 1/√TOKENS of their
#    magnitudes (TOKENS = 64, the largest batch; the output layer's rare-token rows are the case);
#    λ = 4 standard deviations for the largest of ~1e5 entries: GRAD_REL = λ·√TOKENS·√PATH·u
#    = 4.9e-5.
#  * AdamW's update m̂/(√v̂ + ε) moves by at most 2·GRAD_REL: a relative change r of every grad
#    moves m̂ by r·Σ w_k|g_k| and √v̂ by r·√v̂, and Σ w_k|g_k| ≤ √v̂ by Cauchy–Schwarz on the
#    bias-corrected weights of K ≤ 3 steps (Σ w_k² / w'_k = 1.002).
#  * K steps: ATOL = K·LR·2·GRAD_REL = 5.9e-6.
# Not derived: a step's grads also carry the earlier steps' param differences, and for the Muon
# matrices NS meets rounding in their momenta's null space (rank-deficient: σ_min/σ_max ~ 1e-9,
# so NS's slope at zero, 493, applies) — a first-order bound for either needs the gradients'
# magnitudes. Measured with those in, over three instruction sets of MKL's kernels (AVX-512,
# AVX2, SSE4.2: MKL_ENABLE_INSTRUCTIONS), the largest difference at TP1/TP2 x DP1-2 is 1.46e-6
# (output_layer.weight, AdamW) and 7.1e-7 on a Muon matrix: ATOL keeps 4x over both, while a
# wrong update (blockwise, an unsplit QKV) is off by > 1e-3.
# The grad norm Megatron's step returns vs the reference's (before clipping): a sum of squares, so
# it weights entries by their size and the cancelled (small) entries above hardly move it: the
# large ones err by λ·√PATH·u, and the sum of < 1e5 squares in another order by √1e5·u, half of
# that in the norm: NORM_RTOL = 1.6e-5 (measured at most 4.5e-7 over the three instruction sets;
# a norm that missed a shard or counted a TP-duplicated weight twice is off by its share).
# With clipping the grads are scaled by clip / norm, whose relative error is NORM_RTOL's, on top
# of their own: ATOL_CLIP = K·LR·2·(GRAD_REL + NORM_RTOL) = 7.8e-6 (measured at most 2.03e-6, the
# same runs); a skipped clip is off by 1.4e-2, a wrong clip coefficient is caught by NORM_RTOL.
TOKENS = GLOBAL_BATCH * SEQ


def fp32_tolerances(layers: int = LAYERS, steps: int = K) -> tuple[float, float, float]:
    """(ATOL, NORM_RTOL, ATOL_CLIP) of the comment above for a ``layers``-layer tiny GPT trained
    ``steps`` steps (PATH grows with the layers)."""
    u = 2.0 ** -24
    path = layers * (2 * HIDDEN + FFN + SEQ) + VOCAB
    grad_rel = 4 * TOKENS ** 0.5 * path ** 0.5 * u
    norm_rtol = 4 * path ** 0.5 * u + 1e5 ** 0.5 * u / 2
    return steps * LR * 2 * grad_rel, norm_rtol, steps * LR * 2 * (grad_rel + norm_rtol)


ATOL, NORM_RTOL, ATOL_CLIP = fp32_tolerances()
# AdamW params (embedding, output layer, norms): Adam's m / (sqrt(v) + eps) turns a last-bit change
# of a near-zero grad into a visible change of its update, which the model above leaves out (it
# bounds a grad's error relative to its terms, and a grad that cancels far below them is divided
# by its own size). Measured: test_moe.py up to 2.6e-5 (output_layer.weight, TP2 x EP2); the
# per-head TP4 runs with one query group 5.8e-5 (a pre-MLP norm's weight) and the MLA runs 1.0e-5
# (the embedding) on an AMD EPYC's AVX-512 kernels, where an Intel machine's stayed within ATOL.
# 1e-4 is 600x below the most 3 AdamW steps at LR 0.02 can move a weight; the Muon matrices,
# which the tests are about, keep ATOL. Not derived: with a grad that cancels to its rounding the
# only bound on Adam's update error is a whole step (a sign), so this one rests on the
# measurements above and on that margin.
ATOL_ADAMW = 1e-4
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




def _optimizer_config(dist_opt: bool, bf16: bool = False, clip_grad: float = 0.0, loss_scale: float | None = None):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                           adam_beta2=BETAS[1], adam_eps=EPS, bf16=bf16, clip_grad=clip_grad,
                           use_distributed_optimizer=dist_opt, loss_scale=loss_scale)


def _scheduler(optimizer):
    """Megatron's own scheduler with a constant lr: it writes lr and wd × wd_mult per group."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                                   lr_decay_steps=100, lr_decay_style="constant", start_wd=WD, end_wd=WD,
                                   wd_incr_steps=100, wd_incr_style="constant")


# ----------------------------------------------------------------------------- a run

WRAPS = ("ddp", "megatron_fsdp", "fsdp2")
SHARDINGS = ("optim_grads_params", "optim_grads", "optim", "no_shard")
LAYOUTS = ("megatron", "balanced")
MOE_KEYS = ("experts", "topk", "ffn", "shared", "dispatcher")  # build_tiny_gpt's moe
ATTENTION_KEYS = ("heads", "groups", "head_dim")  # build_tiny_gpt's attention
MUON_KEYS = tuple(f.name for f in dataclasses.fields(MuonConfig) if f.name != "tp_mode")

Settings = tuple[tuple[str, object], ...]
"""A mapping kept as sorted (key, value) pairs: hashable, so a ``Run`` is."""


def _settings(value, allowed: tuple[str, ...], what: str) -> Settings | None:
    if value is None:
        return None
    pairs = tuple(sorted(dict(value).items()))
    unknown = [k for k, _ in pairs if k not in allowed]
    if unknown:
        raise TypeError(f"Run.{what}: unknown key(s) {unknown}; expected some of {allowed}")
    return pairs


@dataclass(frozen=True, repr=False)
class Run:
    """One training run's settings. ``muon``, ``moe`` and ``mla`` take a dict (their keys checked
    here) and keep it as ``Settings``; a Run is hashable (the reference cache's key)."""

    tp: int = 1
    """tensor-parallel size; the rest of the world is data parallelism."""
    pp: int = 1
    """pipeline-parallel size."""
    vpp: int | None = None
    """virtual pipeline stages per PP rank (None: none): ``vpp`` model chunks, the interleaved schedule."""
    ep: int = 1
    """expert-parallel size (MoE)."""
    etp: int | None = None
    """expert-TP size (None: Megatron's default, the TP size)."""
    layers: int = LAYERS
    """transformer layers."""
    seed: int = 1234
    """the initial weights' seed (``init_megatron`` and ``build_tiny_gpt``)."""
    steps: int = K
    """training steps."""
    batch: int = 2
    """sequences of ``make_batch`` per step: every DP rank's batch, or the global one (``split_batch``)."""
    split_batch: bool = False
    """each DP rank trains on its own ``dp_slice`` of the batch (False: every rank on all of it)."""
    data_seed: int = 7
    """``make_batch``'s seed."""
    fresh_batches: bool = False
    """step s draws ``make_batch(data_seed + s)`` (False: one batch for every step)."""
    microbatches: int = 1
    """micro-batches per step."""
    schedule: bool | None = None
    """Megatron's ``get_forward_backward_func`` schedule (None: when ``pp > 1`` or ``microbatches > 1``;
    otherwise one direct forward and backward)."""
    clip: float = 0.0
    """Megatron's ``clip_grad`` (0.0: none)."""
    dist_opt: bool = False
    """``--use-distributed-optimizer`` (ZeRO-1; implied by Megatron-FSDP)."""
    tp_mode: str = "owner"
    """``MuonConfig.tp_mode``."""
    bf16: bool = False
    """bf16 params in ``Float16Module``, fp32 main params."""
    loss_scale: float | None = None
    """Megatron's constant ``loss_scale`` (None: none); a scale makes Megatron check grads for inf/NaN."""
    layout: str = "megatron"
    """``--muon-dp-layout`` with the distributed optimizer: ``megatron`` or ``balanced``."""
    layout_bucket_size: int | None = None
    """the distributed optimizer's layout in buckets of about this many elements (``build_tiny_gpt``)."""
    muon: Settings = ()
    """``MuonConfig`` settings over ``MUON``."""
    overlap: bool = False
    """``--overlap-grad-reduce`` and, with the distributed optimizer, ``--overlap-param-gather``."""
    bucket_size: int | None = None
    """DDP's bucket size in elements (honoured with ``overlap``)."""
    wrap: str = "ddp"
    """the data-parallel wrapper: ``ddp`` (Megatron's DDP), ``megatron_fsdp`` or ``fsdp2`` (torch's)."""
    expert_mesh: bool = False
    """with ``wrap="fsdp2"``: each MoE layer's experts sharded over their expert-DP group
    (``TorchFSDP2WithExpertMesh``, what the command line builds); False: megatron-core's wrapper as it is."""
    sharding: str | None = None
    """Megatron-FSDP's ``--data-parallel-sharding-strategy`` (with ``wrap="megatron_fsdp"`` only)."""
    moe: Settings | None = None
    """a mixture of experts in every layer (``build_tiny_gpt``'s ``moe``)."""
    mla: Settings | None = None
    """multi-latent attention in every layer (``build_tiny_gpt``'s ``mla``)."""
    attention: Settings | None = None
    """another self-attention shape (``build_tiny_gpt``'s ``attention``: heads, groups, head_dim)."""
    qk_clip: tuple[float, float] | None = None
    """(τ, α): ``--qk-clip`` with ``--qk-clip-threshold`` τ and ``--qk-clip-alpha`` α."""
    qk_log_only: bool = False
    """with ``qk_clip``: ``--log-max-attention-logit`` instead of ``--qk-clip``: the max logits are
    tracked and reduced (τ only counts the heads over it), nothing is clipped."""
    nan_step: int | None = None
    """at this step rank 1 sets one entry of its first param's local gradient to NaN before DDP's
    reduction (``plant_nan``); the loop then asserts no step's success (the test does)."""
    probe: Callable | None = None
    """``probe(model, optimizer)`` after every step (a module-level function: it travels by name);
    what it returns is that ``Step.probe``."""
    expect_cut: bool = False
    """for the test: some Muon matrix is expected to be cut across DP ranks."""
    resume: bool = False
    """for the test: the run is also saved, rebuilt, loaded and resumed."""
    hybrid: str | None = None
    """a ``HybridModel`` of this layer pattern (``*`` attention, ``-`` MLP, ``E`` MoE) instead of the
    GPT; ``layers`` must be its length (``build_tiny_gpt``'s ``hybrid``)."""
    per_head: bool = False
    """``--muon-split-qkv-per-head``: the run's ``MuonConfig`` and the reference's row split of a
    QKV, every head its own matrix."""
    whole_qkv: bool = False
    """``--muon-no-split-qkv``: the run's ``MuonConfig`` and the reference orthogonalize a fused
    QKV as one matrix."""

    def __post_init__(self):
        object.__setattr__(self, "muon", _settings(self.muon, MUON_KEYS, "muon"))
        object.__setattr__(self, "moe", _settings(self.moe, MOE_KEYS, "moe"))
        object.__setattr__(self, "mla", _settings(self.mla, tuple(MLA), "mla"))
        object.__setattr__(self, "attention", _settings(self.attention, ATTENTION_KEYS, "attention"))
        if self.wrap not in WRAPS:
            raise TypeError(f"Run.wrap: expected one of {WRAPS}, got {self.wrap!r}")
        if (self.wrap == "megatron_fsdp") != (self.sharding is not None) or self.sharding not in (None, *SHARDINGS):
            raise TypeError(f"Run.sharding: one of {SHARDINGS} with wrap='megatron_fsdp' only, got {self.sharding!r}")
        if self.wrap == "megatron_fsdp" and not self.dist_opt:
            raise TypeError("Run: Megatron-FSDP implies dist_opt=True")
        if self.expert_mesh and self.wrap != "fsdp2":
            raise TypeError("Run.expert_mesh: with wrap='fsdp2' only")
        if self.layout not in LAYOUTS:
            raise TypeError(f"Run.layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.nan_step is not None and self.overlap:
            raise TypeError("Run: nan_step plants a NaN before DDP's reduction, which overlap starts in the backward")
        if self.qk_log_only and self.qk_clip is None:
            raise TypeError("Run.qk_log_only: needs qk_clip (its τ counts the heads over it)")
        if self.whole_qkv and self.per_head:
            raise TypeError("Run: whole_qkv and per_head are two different QKV splits")
        if self.hybrid is not None and len(self.hybrid) != self.layers:
            raise TypeError(f"Run.hybrid {self.hybrid!r}: expected layers={len(self.hybrid)}, got {self.layers}")

    def __repr__(self) -> str:  # the settings that differ from the defaults
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Run({', '.join(changed)})"

    @property
    def reference_run(self) -> Run:
        """What the one-process reference depends on: the model, the data, the clip and the steps."""
        return Run(**{name: getattr(self, name) for name in REFERENCE_FIELDS})


REFERENCE_FIELDS = ("layers", "seed", "steps", "batch", "data_seed", "fresh_batches", "microbatches", "clip", "moe",
                    "mla", "attention", "qk_clip", "qk_log_only", "hybrid", "per_head",
                    "whole_qkv")
"""The fields ``reference`` reads; the others describe how a distributed run gets there."""


@dataclass(frozen=True)
class Step:
    """One step of a run."""

    ok: bool = True
    """the step was taken (Megatron's found-inf check)."""
    grad_norm: float | None = None
    """the grad norm ``step`` returned (the reference: before clipping, as ``clip_like_megatron``)."""
    loss: float | None = None
    """the global batch's mean loss of the step's forward (``forward_backward``: what Megatron logs)."""
    sent: int = 0
    """bytes this rank's Muon step sent."""
    by_primitive: dict = field(default_factory=dict)
    """those bytes by collective."""
    logits: torch.Tensor | None = None
    """QK-clip: the max logit per head (a run: this TP rank's heads after the MAX over DP;
    the reference: ``[layers, heads]``)."""
    heads_over: int | None = None
    """QK-clip: heads over τ (this TP rank's)."""
    probe: object = None
    """what ``Run.probe`` returned."""


@dataclass(frozen=True)
class Trace:
    """What a run leaves on one rank (a reference: on its one process)."""

    run: Run
    full: dict | None
    """{global name: full fp32 weight} after the last step (rank 0 and the reference; None elsewhere)."""
    steps: tuple[Step, ...] = ()
    initial: dict | None = None
    """the reference: the full weights before the first step."""
    local: dict = field(default_factory=dict)
    """this rank's params, ``chunk<c>.<name>`` (the local rows of a DTensor)."""
    buckets: int = 0
    """DDP buckets over every chunk's buffers (0 under an FSDP wrap)."""
    layouts: tuple = ()
    """the dense optimizer's Muon matrix layouts, in its order."""
    expert_layouts: tuple = ()
    """the expert optimizer's (MoE)."""
    chained: int = 0
    """optimizers in the chain (2 with expert-parallel params)."""
    loss: float | None = None
    """FSDP wraps: this rank's loss on a batch every rank shares, after the last step."""
    qk_log: tuple | None = None
    """QK-clip: ``log_values()`` (max logit, heads over τ, heads) after the last step."""
    qk_weights: tuple[int, ...] = ()
    """QK-clip: per attention, the weights it clips."""
    world: int = 1
    dp_size: int = 1
    expert_dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0

    @property
    def grad_norms(self) -> list:
        return [s.grad_norm for s in self.steps]

    @property
    def oks(self) -> list[bool]:
        return [s.ok for s in self.steps]

    @property
    def sent(self) -> list[int]:
        return [s.sent for s in self.steps]

    @property
    def by_primitive(self) -> list[dict]:
        return [s.by_primitive for s in self.steps]

    @property
    def logits(self) -> list:
        return [s.logits for s in self.steps]

    @property
    def heads_over(self) -> list:
        return [s.heads_over for s in self.steps]

    @property
    def probes(self) -> list:
        return [s.probe for s in self.steps]

    @property
    def cut(self) -> int:
        """Muon matrices cut across DP ranks (their pieces travel to one owner every step)."""
        return sum(1 for lay in self.layouts if lay.dp_ranges is not None and len(lay.holders(self.dp_size)) > 1)


# ----------------------------------------------------------------------------- the loop


def start(run: Run):
    """Megatron's parallel state for ``run`` (in an initialized default group)."""
    return init_megatron(run.tp, run.pp, seed=run.seed, vpp=run.vpp, ep=run.ep, etp=run.etp)


def worst_param(result, reference) -> tuple[float, str]:
    """The largest absolute difference between a run's full params and the reference's, and the
    param's name."""
    return max(((result.full[n] - reference.full[n]).abs().max().item(), n) for n in reference.full)


def is_muon_param(name: str, tensor: torch.Tensor) -> bool:
    """Whether the one-process reference steps this param with Muon (a 2-D weight that is not the
    embedding or the output layer) rather than AdamW."""
    return tensor.dim() == 2 and "embedding" not in name and "output_layer" not in name


def worst_by_optimizer(result, reference) -> tuple[tuple[float, str], tuple[float, str]]:
    """``worst_param`` of the Muon matrices and of the AdamW params apart: each (|difference|, name)."""
    diffs = [((result.full[n] - want).abs().max().item(), n, is_muon_param(n, want))
             for n, want in reference.full.items()]
    return (max((d, n) for d, n, muon in diffs if muon), max(((d, n) for d, n, muon in diffs if not muon),
                                                              default=(0.0, "")))


def assert_matches_reference(result, want, *, clip: float, adamw_atol: float, label: str) -> None:
    """A trained MoE model against the one-process reference: the largest |difference| of a Muon
    matrix within ``ATOL`` (``ATOL_CLIP`` with clipping), of an AdamW param (embedding, output
    layer, 1-D) within ``adamw_atol`` (the caller's bound, with its reason), and every step's grad
    norm within ``NORM_RTOL`` relative; prints the measured figures under ``label``. With
    clipping every grad norm must exceed ``clip``, so that every step clipped."""

    assert set(result.full) == set(want.full) and any(".local_experts.3." in n for n in want.full)
    muon, adamw = worst_by_optimizer(result, want)
    norms = max(abs(a - b) / b for a, b in zip(result.grad_norms, want.grad_norms))
    print(f"MEASURED {label}: Muon {muon[0]:.3e} ({muon[1]}), AdamW {adamw[0]:.3e} ({adamw[1]}), "
          f"grad norms rel. {norms:.2e}")
    assert muon[0] <= (ATOL_CLIP if clip else ATOL), f"{muon[1]} off by {muon[0]:.2e}"
    assert adamw[0] <= adamw_atol, f"{adamw[1]} off by {adamw[0]:.2e}"
    assert norms <= NORM_RTOL, (result.grad_norms, want.grad_norms)
    if clip:
        assert all(n > clip for n in result.grad_norms), result.grad_norms


def refusal_of(run: Run, module, name: str, planted: Callable) -> str:
    """Builds ``run`` with ``module.name`` replaced by ``planted`` (a planted bug) and puts it back:
    the one-line ``ValueError`` the build raised, or ``"built"`` when nothing refused it."""
    honest = getattr(module, name)
    start(run)
    setattr(module, name, planted)
    try:
        build(run)
    except ValueError as err:
        return str(err)
    finally:
        setattr(module, name, honest)
        destroy_megatron()
    return "built"


def _dict(settings: Settings | None) -> dict | None:
    return None if settings is None else dict(settings)


def build(run: Run):
    """After ``start(run)``: (model chunks, ``get_megatron_muon_optimizer``, scheduler)."""
    from megatron.core.utils import get_model_config

    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    muon_config = MuonConfig(tp_mode=run.tp_mode, **{**MUON, "split_qkv_per_head": run.per_head,
                                                    "split_qkv": not run.whole_qkv, **dict(run.muon)})
    model = build_tiny_gpt(run.tp, run.pp, bf16=run.bf16, use_distributed_optimizer=run.dist_opt,
                           bucket_size=run.bucket_size, seed=run.seed, num_layers=run.layers, dp_layout=run.layout,
                           muon_config=muon_config, vpp=run.vpp, overlap=run.overlap,
                           layout_bucket_size=run.layout_bucket_size, moe=_dict(run.moe), fsdp=run.sharding,
                           mla=_dict(run.mla), fsdp2=run.wrap == "fsdp2", fsdp2_expert_mesh=run.expert_mesh,
                           hybrid=run.hybrid,
                           attention=_dict(run.attention))
    if run.overlap:  # megatron.training hands the schedule no_sync only with --overlap-grad-reduce
        no_sync = [chunk.no_sync for chunk in model]
        get_model_config(model[0]).no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if run.qk_clip is not None:
        config = model[0].config
        config.qk_clip, (config.qk_clip_threshold, config.qk_clip_alpha) = not run.qk_log_only, run.qk_clip
        config.log_max_attention_logit = run.qk_log_only
    optimizer = get_megatron_muon_optimizer(
        _optimizer_config(run.dist_opt, bf16=run.bf16, clip_grad=run.clip, loss_scale=run.loss_scale),
        model, muon_config)
    return model, optimizer, _scheduler(optimizer)


def _batch(run: Run, step: int) -> dict:
    """Step ``step``'s whole batch (``run.batch`` sequences)."""
    return make_batch(run.data_seed + step if run.fresh_batches else run.data_seed, micro_batch_size=run.batch)


def plant_nan(model_chunks) -> None:
    """``forward_backward``'s ``before_reduce`` for ``Run.nan_step``: on rank 1, one NaN in its first
    param's local gradient, before DDP reduces it."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        next(model_chunks[0].parameters()).main_grad.view(-1)[0] = float("nan")


def steps(run: Run, model, optimizer, scheduler, first: int = 0, count: int | None = None) -> list[Step]:
    """The training loop: steps ``first`` .. ``first + count - 1`` (``count``: ``run.steps``), each as
    ``train_step`` runs it: forward/backward, ``optimizer.step()`` (its bytes counted), then the
    scheduler if the step was taken."""
    from megatron.core import parallel_state as ps

    from megatron_muon import comm_stats

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    schedule = run.schedule if run.schedule is not None else run.pp > 1 or run.microbatches > 1
    clip = optimizer.chained_optimizers[0].qk_clip
    out = []
    for step in range(first, first + (run.steps if count is None else count)):
        batch = _batch(run, step)
        if run.split_batch:
            batch = dp_slice(batch, dp_rank, dp)
        loss = forward_backward(model, batch, pp=run.pp, num_microbatches=run.microbatches, optimizer=optimizer,
                                use_schedule=schedule, before_reduce=plant_nan if step == run.nan_step else None)
        with comm_stats() as stats:
            ok, grad_norm, _ = optimizer.step()
        assert ok or run.nan_step is not None, f"{run}: step {step} was skipped"
        if ok:
            scheduler.step(1)
        tracked = clip is not None and clip.last_logits is not None
        out.append(Step(ok=ok, grad_norm=None if grad_norm is None else float(grad_norm), loss=float(loss),
                        sent=stats.bytes_sent,
                        by_primitive=dict(stats.bytes_by_primitive),
                        logits=clip.last_logits.clone() if tracked else None,
                        heads_over=int(clip.last_heads_over) if tracked else None,
                        probe=run.probe(model, optimizer) if run.probe is not None else None))
    return out


def local_params(model) -> dict:
    """This rank's params by ``chunk<c>.<name>``, detached copies (a DTensor's local rows). Under
    Megatron-FSDP its DTensor main weights: the module's own params are unsharded copies whose
    storage it releases between forwards (reading one then faults)."""
    out = {}
    for c, chunk in enumerate(model):
        if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False):
            named = chunk.param_and_grad_buffer.optimizer_named_parameters
        else:
            named = chunk.named_parameters()
        out.update({f"chunk{c}.{n}": getattr(p, "_local_tensor", p).detach().clone() for n, p in named})
    return out


def trace(run: Run, model, optimizer, done: list[Step]) -> Trace:
    """The ``Trace`` of a run trained by ``steps``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    chain = optimizer.chained_optimizers
    clip = chain[0].qk_clip
    qk_log = clip.log_values() if clip is not None else None
    if run.overlap and run.dist_opt and run.wrap == "ddp":
        for chunk in model:  # the last step's param all-gather, which the next forward would start
            chunk.disable_forward_pre_hook(param_sync=True)
    full = gather_full_params(model, ps.get_tensor_model_parallel_group(), run.pp)
    loss = None
    if run.wrap != "ddp":  # the weights an FSDP wrap all-gathers for a forward, on every DP rank
        with torch.no_grad():
            shared = make_batch(11)
            loss = float(model[0](shared["tokens"], shared["position_ids"], None, labels=shared["labels"]).mean())
    rank = dist.get_rank()
    return Trace(
        run=run, full=full if rank == 0 else None, steps=tuple(done), local=local_params(model),
        buckets=sum(len(buffer.buckets) for chunk in model for buffer in chunk.buffers) if run.wrap == "ddp" else 0,
        layouts=chain[0].optimizer.catalogue.layouts,
        expert_layouts=chain[1].optimizer.catalogue.layouts if len(chain) > 1 else (),
        chained=len(chain), loss=loss, qk_log=qk_log,
        qk_weights=tuple(len(a.weights) for a in clip.attentions) if clip is not None else (),
        world=dist.get_world_size(), dp_size=ps.get_data_parallel_world_size(),
        expert_dp=ps.get_expert_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank())


def _train(run: Run) -> Trace:
    model, optimizer, scheduler = build(run)
    return trace(run, model, optimizer, steps(run, model, optimizer, scheduler))


def resumed_params(run: Run, path: str, sharding: str) -> dict:
    """``run`` for ``run.steps - 1`` steps, a torch_dist save (``sharding``: the distributed
    optimizer's format) into ``path``, a rebuild from other initial weights (seed 999), a load and
    the last step: this rank's params (``local_params``), to compare bitwise with the
    uninterrupted run's. In an initialized world, between runs (it starts and destroys Megatron)."""
    from checkpoint_harness import load_torch_dist, save_torch_dist

    os.makedirs(path, exist_ok=True)
    start(run)
    model, optimizer, scheduler = build(run)
    steps(run, model, optimizer, scheduler, count=run.steps - 1)
    save_torch_dist(path, model, optimizer, scheduler, sharding)
    del model, optimizer, scheduler  # their process groups' gloo threads end with them
    destroy_megatron()
    start(run)
    model, optimizer, scheduler = build(dataclasses.replace(run, seed=999))
    load_torch_dist(path, model, optimizer, scheduler)
    steps(run, model, optimizer, scheduler, first=run.steps - 1, count=1)
    params = local_params(model)
    del model, optimizer, scheduler
    destroy_megatron()
    return params


def fsdp_resumed(run: Run, path: str) -> dict:
    """Megatron-FSDP's ``fsdp_dtensor`` round trip of ``run`` (``run.steps`` steps before the save
    and after the load), in an initialized world: ``saved`` (the optimizer state at the save,
    ``checkpoint_harness.fsdp_optimizer_state``), ``straight`` (full weights and state after the
    uninterrupted 2 x ``run.steps``), ``loaded`` (the state of a rebuild from another init seed
    right after the load) and ``resumed`` (full weights and state after its ``run.steps`` more)."""
    from checkpoint_harness import fsdp_optimizer_state, load_fsdp_dtensor, save_fsdp_dtensor
    from megatron.core import parallel_state as ps

    def state(model, optimizer):
        return gather_full_params(model, ps.get_tensor_model_parallel_group(), 1), fsdp_optimizer_state(optimizer)

    out = {}
    start(run)
    model, optimizer, scheduler = build(run)
    steps(run, model, optimizer, scheduler)
    save_fsdp_dtensor(path, model, optimizer)
    out["saved"] = fsdp_optimizer_state(optimizer)
    steps(run, model, optimizer, scheduler, first=run.steps)
    out["straight"] = state(model, optimizer)
    # Groups stay alive: DTensor device meshes are cached by torch and keep naming them
    destroy_megatron(release_groups=False)

    run = dataclasses.replace(run, seed=999)
    start(run)
    model, optimizer, scheduler = build(run)
    load_fsdp_dtensor(path, model, optimizer)
    out["loaded"] = fsdp_optimizer_state(optimizer)
    for _ in range(run.steps):
        scheduler.step(1)  # the scheduler's own state is saved apart (opt_param_scheduler); constant lr here
    steps(run, model, optimizer, scheduler, first=run.steps)
    out["resumed"] = state(model, optimizer)
    destroy_megatron()
    return out


def train(run: Run) -> Trace:
    """``run`` in this (initialized) world, from Megatron's parallel state to its teardown."""
    start(run)
    result = _train(run)  # the model and optimizer end with its frame, before destroy releases their groups
    # FSDP2: the groups stay alive, as torch caches the DeviceMesh it builds from the DP group and a
    # later run's mesh would name a destroyed group
    destroy_megatron(release_groups=run.wrap != "fsdp2")
    return result


def train_all(rank: int, world: int, runs: list[Run]) -> list[Trace]:
    """``train`` for each run, in this world (``run_world(world, train_all, runs)``)."""
    return [train(run) for run in runs]


# ----------------------------------------------------------------------------- the reference


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


def upstream_qkv_clip(weight: torch.Tensor, head_max: torch.Tensor, groups: int, tau: float, alpha: float):
    """megatron-core 0.19.2's ``SelfAttention._clip_linear_qkv`` rule, written out on a copy:
    η per group from the group's largest head, q rows × η^α, k rows × η^(1−α). ``weight``: the
    whole fused QKV, ``head_max`` ``[heads]``: ``rows = (heads + 2·groups) · head_dim``."""
    head_dim = weight.shape[0] // (head_max.numel() + 2 * groups)
    out = weight.clone()
    per_group = out.view(groups, -1, out.shape[1])
    q_rows = per_group.shape[1] - 2 * head_dim
    m = head_max.view(groups, -1).max(dim=1).values
    eta = torch.where(m > tau, tau / m, torch.ones_like(m))
    per_group[:, :q_rows] *= eta.pow(alpha)[:, None, None]
    per_group[:, q_rows:q_rows + head_dim] *= eta.pow(1 - alpha)[:, None, None]
    return out


def _track_logits(core, args) -> None:
    """Forward pre-hook on a local core attention: the max logit per head from q and k themselves."""
    query, key = args[0], args[1]  # [s, b, heads, d], [s, b, groups, d]
    key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * core.softmax_scale
    s = scores.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    head_max = scores.masked_fill(causal, float("-inf")).amax(dim=(0, 2, 3)).detach()
    previous = getattr(core, "reference_max", None)
    core.reference_max = head_max if previous is None else torch.maximum(previous, head_max)


def mla_layers(chunk) -> list:
    """The ``MLASelfAttention`` layers of a model chunk."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return [m for m in chunk.modules() if isinstance(m, MLASelfAttention)]


class _ReferenceClip:
    """QK-clip in the reference, whole matrices, upstream's rule, on this process's own logits:
    GQA (the local ``DotProductAttention`` keeps none): from q and k by a pre-hook, then
    ``upstream_qkv_clip``; MLA: ``MLACoreAttention``'s, then upstream's ``MLASelfAttention.clip_qk``."""

    def __init__(self, chunk, run: Run):
        self.tau, self.alpha = run.qk_clip
        self.mla = run.mla is not None
        self.clip = not run.qk_log_only
        assert self.clip or not self.mla, "the MLA reference clips with upstream's clip_qk"
        if self.mla:
            config = chunk.config
            config.qk_clip, config.qk_clip_threshold, config.qk_clip_alpha = True, self.tau, self.alpha
            self.layers = mla_layers(chunk)
        else:
            self.layers = [m for m in chunk.modules() if getattr(m, "linear_qkv", None) is not None]
            for layer in self.layers:
                layer.core_attention.register_forward_pre_hook(_track_logits)

    @torch.no_grad()
    def after_step(self) -> torch.Tensor:
        """Clip every layer by the max logits of the step's forwards (``qk_log_only``: only read them)
        and reset them: ``[layers, heads]``."""
        step_logits = []
        for layer in self.layers:
            if self.mla:
                step_logits.append(layer.core_attention.current_max_attn_logits)
                layer.clip_qk()  # reads the tracked logits, resets them
                layer.core_attention.current_max_attn_logits = None
            else:
                head_max, layer.core_attention.reference_max = layer.core_attention.reference_max, None
                step_logits.append(head_max)
                weight = layer.linear_qkv.weight
                if self.clip:
                    weight.copy_(upstream_qkv_clip(weight, head_max, layer.num_query_groups_per_partition,
                                                   self.tau, self.alpha))
        return torch.stack(step_logits)


def _reference(run: Run) -> Trace:
    from megatron.core import parallel_state as ps

    from megatron_muon import Muon

    model = build_tiny_gpt(1, 1, seed=run.seed, num_layers=run.layers, moe=_dict(run.moe), mla=_dict(run.mla),
                           hybrid=run.hybrid, attention=_dict(run.attention))
    assert not any(is_expert(p) for p in model[0].parameters())  # one process: every expert is local
    initial = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
    qk_clip = _ReferenceClip(model[0], run) if run.qk_clip is not None else None
    muon_groups, decay, no_decay = reference_param_groups(model[0], per_head=run.per_head,
                                                     whole_qkv=run.whole_qkv)
    muon = Muon(muon_groups, lr=LR, weight_decay=WD, momentum=MUON["momentum"], nesterov=MUON["nesterov"],
                ns_dtype=torch.float32, coefficients=MUON["coefficient_type"], scale_mode=MUON["scale_mode"],
                extra_scale_factor=MUON["extra_scale_factor"])
    adamw = torch.optim.AdamW([dict(params=decay, weight_decay=WD), dict(params=no_decay, weight_decay=0.0)],
                              lr=LR, betas=BETAS, eps=EPS)
    out = []
    for step in range(run.steps):
        forward_backward(model, _batch(run, step), pp=1, num_microbatches=run.microbatches,
                         use_schedule=run.microbatches > 1)
        for p in model[0].parameters():
            p.grad = p.main_grad
        norm = clip_like_megatron(model[0].parameters(), run.clip)
        muon.step()
        adamw.step()
        out.append(Step(grad_norm=norm, logits=qk_clip.after_step() if qk_clip is not None else None))
    full = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
    return Trace(run=run, full=full, steps=tuple(out), initial=initial)


def reference(run: Run) -> Trace:
    """``run.reference_run`` at TP1 on one process, on the whole batch: megatron_muon.Muon on the
    matrices (QKV split per query group, fc1 into gate and up, Megatron's scale rule), torch AdamW
    on the rest, the grads clipped as ``clip_like_megatron``; ``microbatches`` > 1: Megatron's
    no-pipelining schedule over that many slices, accumulating the grads in the order a pipeline
    does; ``qk_clip``: upstream's rule after every step (``_ReferenceClip``)."""
    run = run.reference_run
    start(run)
    result = _reference(run)
    destroy_megatron()
    return result


def reference_all(rank: int, world: int, runs: list[Run]) -> list[Trace]:
    return [reference(run) for run in runs]


_REFERENCES: dict[Run, Trace] = {}
"""This pytest session's references, by ``Run.reference_run``."""


def references(runs, timeout: float = TIMEOUT) -> dict[Run, Trace]:
    """{run: its reference} for each of ``runs``, in the pytest process: the references not yet
    computed in this session are computed in one ``run_world(1, ...)`` job, and kept."""
    from dist_harness import run_world

    runs = list(runs)
    missing = [r for r in dict.fromkeys(run.reference_run for run in runs) if r not in _REFERENCES]
    if missing:
        _REFERENCES.update(zip(missing, run_world(1, reference_all, missing, timeout=timeout)[0]))
    return {run: _REFERENCES[run.reference_run] for run in runs}

