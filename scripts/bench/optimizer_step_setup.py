"""Helpers of ``bench_optimizer_step.py``: the model, the optimizers it compares, and the meters.

Nothing here times anything. ``build_row`` builds one row's model copy and optimizer exactly as
a Megatron run would; ``fill_main_grads`` writes the deterministic gradient into its DDP grad
buffer; ``NsFlopCounter`` / ``peak_step_bytes`` / ``optimizer_state_bytes``
measure one untimed step.
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_muon.core.models import LLAMA3, ModelShape
from megatron_muon.core.shapes import full_shape

SEED = 1234
GRAD_STD = 1e-3
LR, WEIGHT_DECAY = 1e-3, 0.01
# Llama-3-8B has 32 heads / 8 query groups (4 query heads per group). Scaled down we keep 8 heads
# / 2 groups, so QKV stays 1.5 × hidden rows and TP=2 splits whole groups.
HEADS, QUERY_GROUPS = 8, 2


def scaled_llama3_8b(scale: int, layers: int, vocab: int, flag: str = "--scale") -> ModelShape:
    """Llama-3-8B with hidden and ffn divided by ``scale`` (the command-line ``flag`` that set it):
    the benchmark's model."""
    try:
        return LLAMA3["8B"].scaled(scale, num_layers=layers, vocab=vocab, num_heads=HEADS,
                                   num_query_groups=QUERY_GROUPS)
    except ValueError as e:
        raise SystemExit(f"error: {flag} {scale}: {e}") from None


# ---- model ---------------------------------------------------------------------------------


def build_gpt(shape: ModelShape, tp: int, device: torch.device):
    """A Megatron ``GPTModel`` (local spec, RoPE, RMSNorm, SwiGLU, GQA, untied, no biases), fp32.

    Weights are drawn whole from the CPU generator (``use_cpu_initialization``) and each TP rank
    keeps its shard, so reseeding before every build gives every row identical weights.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn_hidden,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=shape.vocab, max_sequence_length=64, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    return model.to(device), config


def wrap_ddp(model, config, *, distributed_optimizer: bool, layer_wise: bool = False, balanced=None,
             bucket_size: int | None = None):
    """Megatron's DDP, as ``megatron.training.get_model`` wraps it for each optimizer.

    ``balanced``: a ``MuonConfig``: our ``--muon-dp-layout balanced`` buffer layout
    (``megatron_muon.megatron.layout``) instead of megatron-core's. ``bucket_size``: elements per
    bucket for every distributed-optimizer layout (None: one bucket, as DDP without
    ``--overlap-grad-reduce``); small buckets cut many matrices under megatron-core's layout.

    ``layer_wise``: what ``wrap_model_chunks_with_ddp`` does for ``--optimizer muon
    --use-distributed-optimizer`` in 0.19.2: tag Muon matrices so DDP puts them in their own
    buffer, lay that buffer out with whole params per DP shard
    (``LayerWiseDistributedOptimizer.compute_full_param_layout``), and reduce-scatter
    (``use_distributed_optimizer=True`` in the DDP config).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import DistributedOptimizer, LayerWiseDistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import tag_params_for_buffer_routing

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer or layer_wise)
    params = [p for p in model.parameters() if p.requires_grad]
    dp = ps.get_data_parallel_world_size()
    if layer_wise:
        tag_params_for_buffer_routing([model])
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, ddp_config)
    elif distributed_optimizer and balanced is not None:
        from megatron_muon.megatron.layout import balanced_full_param_layout

        layout = balanced_full_param_layout(model, bucket_size, dp, ddp_config, muon_config=balanced,
                                            tp_size=ps.get_tensor_model_parallel_world_size())
    elif distributed_optimizer:
        layout = DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, ddp_config)
    else:
        layout = None
    kwargs = {"full_param_layout": layout} if layout is not None else {}
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, **kwargs)


# ---- rows ----------------------------------------------------------------------------------


@dataclass
class Row:
    impl: str  # "ours" | "megatron"
    optimizer_kind: str  # "muon-distopt" | "muon-ddp" | "layerwise" | "adam-distopt"
    mode: str
    label: str
    muonbp_period: int | None = None
    dp_layout: str = "megatron"  # ours: --muon-dp-layout
    ns_method: str = "standard"  # ours: --muon-ns-method


def optimizer_config(row: Row, ns_precision: str):
    from megatron.core.optimizer import OptimizerConfig

    common = dict(lr=LR, min_lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=1.0, bf16=False, fp16=False)
    muon = dict(muon_momentum=0.95, muon_nesterov=False, muon_split_qkv=True, muon_scale_mode="spectral",
                muon_extra_scale_factor=1.0, muon_coefficient_type="quintic", muon_num_ns_steps=5,
                muon_fp32_matmul_prec=ns_precision)
    if row.optimizer_kind == "adam-distopt":
        return OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, **common)
    if row.impl == "ours":  # what megatron/hooks.py's dispatcher receives for --optimizer muon
        return OptimizerConfig(optimizer="muon", use_distributed_optimizer=True, **common, **muon)
    if row.optimizer_kind == "layerwise":  # validate_args: muon + --use-distributed-optimizer
        return OptimizerConfig(optimizer="muon", use_distributed_optimizer=False,
                               use_layer_wise_distributed_optimizer=True, muon_tp_mode=row.mode, **common, **muon)
    return OptimizerConfig(optimizer="muon", use_distributed_optimizer=False, muon_tp_mode=row.mode, **common, **muon)


def build_row(row: Row, shape: ModelShape, tp: int, device, ns_precision: str, ours_precision: str,
              bucket_size: int | None = None):
    """(DDP-wrapped model, optimizer) of one row, each row its own copy with identical weights."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    model, config = build_gpt(shape, tp, device)
    muon_config = MuonConfig(tp_mode=row.mode if row.impl == "ours" else "owner", muonbp_period=row.muonbp_period,
                             fp32_matmul_prec=ours_precision, momentum=0.95, nesterov=False,
                             coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral",
                             dp_layout=row.dp_layout, ns_method=row.ns_method)
    ddp = wrap_ddp(model, config, distributed_optimizer=row.optimizer_kind in ("muon-distopt", "adam-distopt"),
                   layer_wise=row.optimizer_kind == "layerwise",
                   balanced=muon_config if row.dp_layout == "balanced" else None, bucket_size=bucket_size)
    opt_config = optimizer_config(row, ns_precision)
    if row.impl == "ours":
        optimizer = get_megatron_muon_optimizer(opt_config, [ddp], muon_config)
        # a training step that no log reads (megatron.log_stats.plan_next_step): without the norms,
        # per-class RMS and sampled residuals a logged step adds (the residuals' TP collectives too)
        muon_inner(optimizer).record_norms = False
    else:
        with fp32_layer_wise_workaround() if row.optimizer_kind == "layerwise" else contextlib.nullcontext():
            optimizer = get_megatron_optimizer(opt_config, [ddp])
    # Megatron's scheduler writes lr and weight decay (× wd_mult) into every group, as in training.
    OptimizerParamScheduler(optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
                            lr_decay_style="constant", start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY,
                            wd_incr_steps=100, wd_incr_style="constant")
    return ddp, optimizer


@contextlib.contextmanager
def fp32_layer_wise_workaround():
    """megatron-core 0.19.2's layer-wise optimizer wraps its torch optimizers only under bf16
    (``Float16OptimizerWithFloat16Params``); with fp32 params it chains the raw torch optimizers,
    whose ``config`` is None, so the outer ``ChainedOptimizer([layer_wise, adam_distopt])`` fails
    its config assertion (and a raw torch optimizer has no ``prepare_grads``). The fp32
    counterpart of that wrapper is ``FP32Optimizer``: while building, it is applied here."""
    from megatron.core.optimizer import FP32Optimizer, LayerWiseDistributedOptimizer

    original = LayerWiseDistributedOptimizer.__init__

    def init(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None):
        if not config.bf16:
            fns = init_state_fn_list or [None] * len(optimizers)
            optimizers = [FP32Optimizer(opt, config, fn) for opt, fn in zip(optimizers, fns)]
        original(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)

    LayerWiseDistributedOptimizer.__init__ = init
    try:
        yield
    finally:
        LayerWiseDistributedOptimizer.__init__ = original


def apply_layer_wise_cpu_patch() -> None:
    """``LayerWiseDistributedOptimizer.has_grad_norm_group`` all-reduces a flag made with
    ``device='cuda'``; ``megatron_muon.megatron.cpu_patches`` (for the paths the plugin uses) leaves the
    layer-wise optimizer alone, so its one CUDA literal is retargeted here the same way.
    Once per process, only without CUDA."""
    from megatron.core.optimizer import layer_wise_optimizer as m

    from megatron_muon.megatron.cpu_patches import retarget

    retarget(m.LayerWiseDistributedOptimizer, "has_grad_norm_group", consts=("cuda",))


def torch_optimizers(optimizer):
    """The torch optimizers inside Megatron's wrappers (chained, layer-wise, mixed precision)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
    elif hasattr(optimizer, "chained_optimizers"):
        for child in optimizer.chained_optimizers:
            yield from torch_optimizers(child)
    else:
        yield from torch_optimizers(optimizer.optimizer)


def muon_inner(optimizer):
    """Our ``MuonWithAdamW`` inside the chain (None for Megatron's rows)."""
    from megatron_muon.optimizer import MuonWithAdamW

    return next((o for o in torch_optimizers(optimizer) if isinstance(o, MuonWithAdamW)), None)


# ---- gradients -----------------------------------------------------------------------------


def tp_shard(full: torch.Tensor, param, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's piece of ``full`` as Megatron lays out ``param`` (a strided fc1 with
    ``partition_stride`` 2 holds chunks r and r + tp of 2·tp: [gate_r; up_r])."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    return torch.cat(torch.chunk(full, stride * tp, dim=dim)[tp_rank::tp], dim=dim)


def global_shape(param, tp: int) -> tuple[int, ...]:
    """The whole parameter's shape (1-D params are never TP-split here: norms)."""
    if param.ndim != 2:
        return tuple(param.shape)
    pdim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    return full_shape(tuple(param.shape), pdim, tp)


def make_grads(model, tp_rank: int, tp: int, device) -> dict[str, torch.Tensor]:
    """name → this TP rank's shard of a full gradient drawn from (seed, name): the same math for
    every implementation and layout, and the same on every DP rank (as after the all-reduce)."""
    grads = {}
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(global_shape(p, tp), generator=gen) * GRAD_STD
        grads[name] = tp_shard(full, p, tp_rank, tp).contiguous().to(device)
    return grads


def fill_main_grads(ddp, grads: dict[str, torch.Tensor]) -> None:
    for name, p in ddp.module.named_parameters():
        p.main_grad.copy_(grads[name])


# ---- meters --------------------------------------------------------------------------------

class NsFlopCounter:
    """Counts the Newton–Schulz FLOPs emerging_optimizers runs on this rank, from the shapes its
    ``newton_schulz`` receives (every Megatron TP mode calls it through its module global).

    After its own transpose rule X is (m × n) with the m × m Gram (all-reduced when
    ``tp_group`` is given, so m spans the whole unsharded dim); one quintic step costs
    X·Xᵀ 2m²n + A·A 2m³ + B·X 2m²n — ``ns_flops`` when m ≤ n; Megatron forms A² whatever the
    shard's width (it never reassociates, unlike ``newton_schulz.quintic_iteration``).
    """

    def __init__(self) -> None:
        self.flops = 0

    def __enter__(self) -> NsFlopCounter:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils

        self._module, self._original = muon_utils, muon_utils.newton_schulz
        signature = inspect.signature(self._original)

        def counting(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            x, steps, transpose = bound.arguments["x"], bound.arguments["steps"], bound.arguments["transpose"]
            m, n = x.shape[-2:]
            if transpose if transpose is not None else m > n:
                m, n = n, m
            batch = x.shape[0] if x.dim() == 3 else 1
            self.flops += batch * steps * (4 * m * m * n + 2 * m * m * m)
            return self._original(*args, **kwargs)

        muon_utils.newton_schulz = counting
        return self

    def __exit__(self, *exc) -> None:
        self._module.newton_schulz = self._original


def peak_step_bytes(step, device) -> int:
    """Peak bytes allocated above the start during ``step()``.

    CUDA: ``max_memory_allocated`` after a reset, minus what was allocated before. CPU: one
    step under ``torch.profiler`` with ``profile_memory``; its allocation events (+bytes) and
    frees (−bytes), in time order, summed cumulatively; the maximum of that sum.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # The kineto events hold every allocation and free; prof.events() files most under the op.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def optimizer_state_bytes(optimizer, ddp) -> int:
    """Bytes of optimizer state on this rank: every tensor in the torch optimizers' state
    (momentum, exp_avg, exp_avg_sq, step), plus main params that are copies rather than views
    of the model's own params (none in fp32; the fp32 masters under bf16)."""
    model_storages = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
    total, seen = 0, set()
    for opt in torch_optimizers(optimizer):
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
        for group in opt.param_groups:
            for p in group["params"]:
                storage = p.untyped_storage()
                if storage.data_ptr() not in model_storages and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


@contextlib.contextmanager
def nothing():
    yield
