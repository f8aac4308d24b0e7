"""The real optimizer step at production scale, on the meta device, under torch's fake process group.

    python scripts/dry_run.py --model llama3-405b --tp 8 --pp 16 --dp 64
    python scripts/dry_run.py --model llama3-8b --tp 8 --dp 64 --ranks first,no-first-piece,idle-dp-owner
    python scripts/dry_run.py --model llama3-70b --tp 8 --dp 8 --json out.json
    python scripts/dry_run.py --model mixtral-8x7b --tp 2 --ep 8 --dp 64 --tp-mode duplicated
    python scripts/dry_run.py --model deepseek-v3 --tp 1 --ep 8 --pp 16 --dp 64
    python scripts/dry_run.py --model llama3-70b --tp 8 --dp 8 --fsdp optim_grads_params
    python scripts/dry_run.py --model mixtral-8x7b --tp 1 --ep 8 --dp 64 --fsdp optim_grads_params
    python scripts/dry_run.py --model nemotron-h-8b --tp 8 --dp 64 --tp-mode auto

For each chosen rank it builds what a Megatron job builds on that rank — the real megatron-core
``GPTModel`` (local spec, bf16) with meta parameters, Megatron's DDP buffers and ZeRO-1 ranges,
and our optimizer (``get_megatron_muon_optimizer``) — under ``dist.init_process_group("fake")``
with the layout's world size, then runs our inner optimizer step (momentum, the DP owner
exchange, the TP mode, Newton–Schulz, the update) on meta tensors. Nothing is computed and no
data moves; shapes propagate, and:

* a tensor on another device fails the step (meta mixed with CPU raises), and every collective's
  buffers must be on the step's device (``comm.observe_collectives``);
* every collective's sizes are checked against the plan: split sizes add up to the buffers, and
  for each pair of simulated ranks in one group the collectives line up in order and kind, and
  what one sends the other expects (``all_to_all`` splits, ``all_gather`` sizes).

Hybrid models (``--model nemotron-h-8b``; issue 28): megatron-core's ``HybridModel`` with the
entry's local hybrid stack spec (``megatron_muon.megatron.hybrid``), its pattern cut into ``--pp``
stages with ``|`` (``staged_pattern``); its Mamba mixers are built without mamba_ssm's kernels
(``mamba_mixer_without_kernels``: their parameters only, which is all the step needs). The cost
model's prediction is printed (``plan.stage_params`` lists the hybrid layers' params), no
planner-table row (GPT shapes only).

MoE models (``--ep``, ``--etp``; issue 14): megatron-core's MoE layers (local spec,
``SequentialMLP``) on Megatron's expert-parallel groups; both optimizers of the chain (dense, and
experts over the expert-DP and expert-TP groups) step, and each is measured and checked apart.
The cost model prices both plans (``plan.stage_params`` lists the experts and MLA's projections;
``plan.stage_layouts`` lays out the experts' own buffer).

Megatron-FSDP (``--fsdp STRATEGY``, issue 15; PP1): Megatron-FSDP's
``FullyShardedDataParallel`` (its own buckets and equal DP shards, device meta) wraps the model
instead of DDP, and our ``MuonFSDPOptimizer`` steps its DTensor shards; the same checks, next to
the planner table's "ours (Megatron-FSDP)" row for a dense GQA model
(``planner_quality.fsdp_layouts``). With experts (``--ep``; issue 44) the chain is Megatron-FSDP's
too: a dense ``MuonFSDPOptimizer`` over the DP group and an expert one over Megatron-FSDP's
expert-DP group (its expert mesh, EP x expert-TP x expert-DP, is Megatron's expert grid), both
stepped and measured apart as under DDP; the expert one, last in the chain, is the one that
installs the model's weights (``installs_model_weights``, reported per optimizer). Three
Megatron-FSDP steps need the meta device / fake backend let through
(``cpu_patches.patch_megatron_fsdp_dry_run``). No cost-model row: it knows DDP's layouts only.

Rank kinds (``--ranks``, comma-separated): ``first``, ``last``, ``no-first-piece`` (a DP rank
holding no piece of the first Muon matrix), ``idle-dp-owner`` (a DP rank that owns no matrix, so
its TP group has nothing to orthogonalize), ``pp-stages`` (the first rank of every pipeline
stage), ``expert-dp-group`` / ``expert-tp-group`` (every member of that group of the first rank of
the first stage with experts), ``busiest`` (the ranks of the first stage with the most NS FLOPs
and the most bytes sent, by the plan), or a number. Prints per rank: matrices owned, NS FLOPs,
bytes per collective, the optimizer state (momentum, Adam's moments: created before the step, as
Megatron's checkpointing creates it) and the step's transient peak (live meta tensors created
during the step, the state excluded),
next to what the optimizer's step plan says for that rank (``optimizer.plan``, the plan the step
executed), the planner table's figures (``scripts.bench.planner_quality``, PP = 1) and the cost
model's for the busiest rank.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # No device is used: hide any GPU before torch looks, so Megatron's CUDA-isms take the patched
    # path (cpu_patches, viewing the meta device) on a GPU machine too, instead of allocating real
    # buffers. Only when run as the dry run: scripts/gpu_check.py imports ``time_rank`` to run the
    # same step on a GPU's real tensors.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import json
import sys
import time
import warnings
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_muon.config import DP_LAYOUTS, MUONBP_BLOCKS, MuonConfig  # noqa: E402
from megatron_muon.core.models import HYBRID_MODELS, LLAMA3, MOE_MODELS, ModelShape, staged_pattern  # noqa: E402
from megatron_muon.plan.stage_layouts import DEFAULT_DP_LAYOUT  # noqa: E402
from megatron_muon.plan.step_plan import TP_MODES  # noqa: E402

MODELS = {**{f"llama3-{k.lower()}": v for k, v in LLAMA3.items()}, **MOE_MODELS, **HYBRID_MODELS}
RANK_KINDS = ("first", "last", "no-first-piece", "idle-dp-owner", "pp-stages", "busiest", "tp-group", "team",
              "expert-dp-group", "expert-tp-group")
"""``tp-group`` and ``team``: every member of rank 0's TP group and of its DP team (when the plan
forms teams). Only simulated ranks that share a group are compared, so a collective that two members
of one TP group or team order differently is seen only when both are simulated."""


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created (and still alive) inside the block; views are free. A
    DTensor (Megatron-FSDP's params, and the optimizer state made like them) counts its local
    shard, what the rank holds: the mode sees it before DTensor unwraps it, and its ``numel()``
    is the global one."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in seen and not t._is_view():
                local = t._local_tensor if isinstance(t, DTensor) else t
                nbytes = local.numel() * local.element_size()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out


class NoCoreAttention(torch.nn.Module):
    """A stand-in for MLA's core attention (softmax(QK^T)V: no parameter, nothing the optimizer
    sees). megatron-core 0.19.2's local ``DotProductAttention`` cannot be built for MLA (it takes
    no ``k_channels``; MLA runs on Transformer Engine's attention), so the dry run, which never
    runs a forward pass, builds MLA's projections around this instead."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


def _layer_split(shape: ModelShape, pp: int, vpp: int = 1) -> dict:
    """Megatron's uneven-pipeline flags when the layers do not split evenly: middle stages of
    ceil(layers / pp), the rest on the first and last (405B: 126 = 7 + 14·8 + 7; DeepSeek-V3 at
    PP16: 61 = 2 + 14·4 + 3). With virtual stages, the embedding and the loss each count as a
    layer where that evens the split (405B at PP16 x VPP2: 126 + 2 = 32 virtual stages of 4)."""
    if vpp > 1:
        if shape.num_layers % (pp * vpp) == 0:
            return {}
        if (shape.num_layers + 2) % (pp * vpp) == 0:
            return dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        raise SystemExit(f"error: --vpp {vpp}: {shape.num_layers} layers (or {shape.num_layers + 2} with the "
                         f"embedding and the loss) do not split into {pp} x {vpp} virtual stages")
    if shape.num_layers % pp == 0:
        return {}
    middle = -(-shape.num_layers // pp)
    rest = shape.num_layers - middle * (pp - 2)
    first, last = rest // 2, rest - rest // 2
    if pp < 3 or first < 1:
        raise SystemExit(f"error: {shape.num_layers} layers do not split over --pp {pp}")
    return dict(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)


def _moe_fields(shape: ModelShape, ep: int, etp: int) -> dict:
    """``TransformerConfig`` fields of the experts (local spec: ``SequentialMLP``, one 2-D weight
    per expert) and of MLA; none for a dense GQA model."""
    fields = {}
    if shape.mla is not None:
        m = shape.mla
        fields.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                      qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                      # DeepSeek's YaRN RoPE calls torch.cuda.current_device() when built; plain RoPE
                      # has the same (no) parameters and takes cpu_patches' path.
                      rope_type="rope")
    if shape.num_experts:
        # No grouped GEMM: the optimizer sees one weight per expert, as with TEGroupedMLP's
        # weight0..weight{E-1}. The allgather token dispatcher: the alltoall one (what EP runs
        # use) creates a CUDA stream when built; the dispatcher owns no parameter. Sequence parallelism,
        # which Megatron asks for with TP x EP, only changes how the norms' grads are reduced
        # (finalize_model_grads), not the optimizer step: left off (WrappedTorchNorm refuses it).
        fields.update(num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
                      moe_ffn_hidden_size=shape.moe_ffn_hidden, moe_layer_freq=shape.moe_layer_pattern,
                      moe_shared_expert_intermediate_size=shape.shared_expert_ffn or None,
                      moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                      expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return fields


def _hybrid_fields(shape: ModelShape) -> dict:
    """``TransformerConfig`` fields of a hybrid model: its Mamba mixers' sizes, a non-gated MLP's
    activation (squared ReLU), ``is_hybrid_model`` (as ``--hybrid-layer-pattern`` sets it)."""
    if shape.hybrid_pattern is None:
        return {}
    fields = dict(is_hybrid_model=True)
    if shape.mamba is not None:
        m = shape.mamba
        fields.update(mamba_num_heads=m.num_heads, mamba_head_dim=m.head_dim, mamba_state_dim=m.state_dim,
                      mamba_num_groups=m.num_groups)
    if not shape.gated_mlp:
        from megatron.core.activations import squared_relu

        fields.update(activation_func=squared_relu)
    return fields


def _hybrid_model(shape: ModelShape, config, vocab: int, device: torch.device, vp_stage: int | None):
    """This (virtual) pipeline stage of megatron-core's ``HybridModel`` (the pattern cut into
    PP x VPP segments by ``staged_pattern``; megatron-core gives rank r's chunk v segment v x PP + r)
    with the entry's local hybrid stack spec, its Mamba mixers built without mamba_ssm's kernels
    (``mamba_mixer_without_kernels``: parameters only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.hybrid import local_hybrid_stack_spec, mamba_mixer_without_kernels

    model_parallel_cuda_manual_seed(0)  # the mixer draws conv1d and dt under the model-parallel RNG tracker
    stages = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
    pattern = staged_pattern(shape.hybrid_pattern, stages)
    with mamba_mixer_without_kernels(device), device:
        return HybridModel(config=config, hybrid_stack_spec=local_hybrid_stack_spec(None, "RMSNorm"),
                           vocab_size=vocab, max_sequence_length=8192, hybrid_layer_pattern=pattern,
                           share_embeddings_and_output_weights=False, position_embedding_type="rope",
                           pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                           post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                           vp_stage=vp_stage,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def build_rank(shape: ModelShape, tp: int, pp: int, dp: int, rank: int, tp_mode: str,
               dp_layout: str = DEFAULT_DP_LAYOUT, ep: int = 1, etp: int | None = None, fsdp: str | None = None,
               muonbp: tuple | None = None, vpp: int = 1, device: torch.device | None = None, *,
               per_head: bool = False):
    """Megatron's state, model, DDP (on the ``dp_layout`` buffer layout, as ``--muon-dp-layout``
    gives it) and our optimizer for ``rank``, all on ``device`` (meta; a real device for ``time_rank``:
    the parameters, and Megatron's buffers where it allocates them; None: meta); with ``vpp`` > 1 one model chunk per
    virtual stage, each in its own DDP, one optimizer over them (as ``get_model`` builds them). With ``fsdp`` (a
    ``--data-parallel-sharding-strategy``) Megatron-FSDP's ``FullyShardedDataParallel`` wraps the
    model instead of DDP (``--use-megatron-fsdp``: its own layout; ``dp_layout`` is unused).
    Returns the inner optimizers (the dense one, then the expert one for a model with experts)
    and the rank's coordinates."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    etp = tp if etp is None else etp  # Megatron's default expert-TP size
    device = torch.device("meta") if device is None else device
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp * dp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 create_gloo_process_groups=False)
    config = (MLATransformerConfig if shape.mla is not None else TransformerConfig)(
        num_layers=shape.num_layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn_hidden,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        gated_linear_unit=shape.gated_mlp, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **({} if shape.hybrid_pattern else _layer_split(shape, pp, vpp)),
        **_moe_fields(shape, ep, etp),
        **_hybrid_fields(shape), **({} if not shape.gated_mlp else dict(activation_func=F.silu)),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (128) x TP.
    vocab = -(-shape.vocab // (128 * tp)) * 128 * tp
    # Megatron's defaults for a large run: fp32 grad reduction, overlapped reduce-scatter buckets.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True)
    # auto plans for the GPUs the layout is meant for, not the meta device's CPU default
    muon_config = MuonConfig(tp_mode=tp_mode, fp32_matmul_prec="medium", dp_layout=dp_layout,
                             auto_hardware="h100-sxm" if tp_mode == "auto" else "detect",
                             split_qkv_per_head=per_head,
                             **(dict(muonbp_period=muonbp[0], muonbp_block=muonbp[1]) if muonbp else {}))
    chunks = []
    for vp_stage in (range(vpp) if vpp > 1 else [None]):
        if shape.hybrid_pattern is not None:
            model = _hybrid_model(shape, config, vocab, device, vp_stage)
        else:
            if shape.num_experts or shape.mla is not None:  # per-layer specs (first dense layers), this stage's
                spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                  vp_stage=vp_stage)
                if shape.mla is not None:
                    for layer in spec.layer_specs:
                        layer.submodules.self_attention.submodules.core_attention = NoCoreAttention
            else:
                spec = get_gpt_layer_local_spec(normalization="RMSNorm")
            with device:  # the layers allocate on the default device under use_cpu_initialization
                model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                                 max_sequence_length=8192, share_embeddings_and_output_weights=False,
                                 position_embedding_type="rope",
                                 pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None,
                                                                        vp_stage=vp_stage),
                                 post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None,
                                                                        vp_stage=vp_stage),
                                 vp_stage=vp_stage)
        module = Float16Module(config, model)
        layout = None
        if fsdp is not None:
            model = _megatron_fsdp(config, module, fsdp)
        elif dp_layout in ("balanced", "priced"):  # the hook's DDP factory's layout (megatron/layout.py), same buckets
            from megatron_muon.megatron.layout import balanced_full_param_layout, megatron_expert_price

            # get_model: buckets for the first chunk of the first stage only
            first = ps.get_pipeline_model_parallel_rank() == 0 and not vp_stage
            bucket = max(40_000_000, 1_000_000 * dp) if first else None
            local = muonbp is not None and muonbp[1] == "local"
            price = layout_price(shape, tp, dp, tp_mode, local) if dp_layout == "priced" else None
            expert_price = megatron_expert_price(price, config, ps.get_expert_data_parallel_group())
            layout = balanced_full_param_layout(module, bucket, dp, ddp_config, muon_config=muon_config, tp_size=tp,
                                                expert_dp_size=ps.get_expert_data_parallel_world_size(), price=price,
                                                expert_price=expert_price)
        if fsdp is None:
            model = DistributedDataParallel(config, ddp_config, module, full_param_layout=layout)
        chunks.append(model)
    optimizer = get_megatron_muon_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, clip_grad=1.0),
        chunks, muon_config, use_gloo_process_groups=False)
    group_ranks = lambda g: list(dist.get_process_group_ranks(g))  # noqa: E731
    slot = dict(tp=ps.get_tensor_model_parallel_rank(), dp=ps.get_data_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank())
    parts = [dict(part="dense", outer=optimizer.chained_optimizers[0], tp=tp,
                  dp=ps.get_data_parallel_world_size(), tp_rank=slot["tp"], dp_rank=slot["dp"])]
    if shape.num_experts:
        slot.update(ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
                    edp=ps.get_expert_data_parallel_rank(),
                    expert_dp_group=group_ranks(ps.get_expert_data_parallel_group()),
                    expert_tp_group=group_ranks(ps.get_expert_tensor_parallel_group()))
        experts = optimizer.chained_optimizers[1:]
        if experts:  # a stage of dense layers only has no expert optimizer
            parts.append(dict(part="experts", outer=experts[0], tp=etp, dp=ps.get_expert_data_parallel_world_size(),
                              tp_rank=slot["etp"], dp_rank=slot["edp"]))
    for part in parts:  # the Megatron optimizer of the chain, and our MuonWithAdamW inside it
        part["inner"] = part["outer"].optimizer
    return parts, slot


def _megatron_fsdp(config, module, strategy: str):
    """Megatron-FSDP around ``module`` on meta, as ``get_model`` builds it under
    ``--use-megatron-fsdp``: Megatron's DDP config for a large run with that sharding strategy,
    the model-parallel groups of parallel_state; bucket size unset, so each transformer layer is
    one FSDP unit (its bucket) and the rest (embedding, output, final norm: no Muon matrix)
    groups by dtype."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy, gradient_reduce_div_fusion=False,
        overlap_grad_reduce=True, overlap_param_gather=True)
    return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module, device=torch.device("meta"),
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def teardown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


class Recorder:
    """Checks each collective's buffers (device, split sums) and keeps a per-group trace."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.trace, self.errors = device, [], []
        self.largest_send = 0
        """bytes of the largest buffer one collective sent from this rank (a send buffer's bound)."""

    def __call__(self, c) -> None:
        ranks = tuple(dist.get_process_group_ranks(c.group)) if c.group is not None else None
        for t in (*c.inputs, *c.outputs):
            if t.device != self.device:  # stop here: the rest would run on real CPU memory
                raise RuntimeError(f"{c.primitive} on a group of {len(ranks)}: a buffer on {t.device}, the "
                                   f"step's device is {self.device}")
        if c.primitive == "all_to_all":
            for splits, t, side in ((c.input_split_sizes, c.inputs[0], "send"), (c.output_split_sizes, c.outputs[0],
                                                                                 "receive")):
                if len(splits) != len(ranks) or sum(splits) != t.numel():
                    self.errors.append(f"all_to_all on {ranks}: {side} splits {sum(splits)} over {len(splits)} "
                                       f"ranks for a buffer of {t.numel()}")
        elif c.primitive != "all_reduce" and any(o.shape != c.inputs[0].shape for o in c.outputs):
            self.errors.append(f"{c.primitive} on {ranks}: outputs shaped unlike the input {tuple(c.inputs[0].shape)}")
        sizes = (c.inputs[0].numel(),) if c.input_split_sizes is None else (c.input_split_sizes, c.output_split_sizes)
        self.trace.append((ranks, c.primitive, sizes))
        self.largest_send = max(self.largest_send, c.inputs[0].numel() * c.inputs[0].element_size())


def cross_rank_errors(traces: dict[int, list]) -> list[str]:
    """For every pair of simulated ranks sharing a group: the same collectives, in the same order,
    with matching sizes (what one sends to the other is what the other expects from it)."""
    errors = []
    per_group: dict[tuple, dict[int, list]] = {}
    for rank, trace in traces.items():
        for ranks, primitive, sizes in trace:
            per_group.setdefault(ranks, {}).setdefault(rank, []).append((primitive, sizes))
    for ranks, by_rank in per_group.items():
        members = sorted(by_rank)
        for a in members:
            for b in members:
                if a >= b:
                    continue
                ca, cb = by_rank[a], by_rank[b]
                if [p for p, _ in ca] != [p for p, _ in cb]:
                    errors.append(f"group {ranks[:4]}...: ranks {a} and {b} issue different collectives")
                    continue
                ia, ib = ranks.index(a), ranks.index(b)
                for k, ((prim, sa), (_, sb)) in enumerate(zip(ca, cb)):
                    if prim == "all_to_all" and (sa[0][ib] != sb[1][ia] or sb[0][ia] != sa[1][ib]):
                        errors.append(f"all_to_all #{k} on group of {len(ranks)}: rank {a} sends {sa[0][ib]} to "
                                      f"{b}, which expects {sb[1][ia]} (or the reverse)")
                    elif prim != "all_to_all" and sa != sb:
                        errors.append(f"{prim} #{k} on group of {len(ranks)}: ranks {a} and {b} sizes {sa} vs {sb}")
    return errors


def _step_part(part: dict, recorder: Recorder) -> dict:
    """One inner optimizer's step on meta (the dense one or the expert one), measured, next to
    its plan for this rank and for every rank of its (expert-)TP x (expert-)DP grid."""
    from megatron_muon.parallel.comm import comm_stats, observe_collectives

    inner, tp, dp = part["inner"], part["tp"], part["dp"]
    for group in inner.param_groups:  # the reduce-scattered grads of this rank's ranges
        for p in group["params"]:
            p.grad = torch.empty_like(p)
    # The state first (momentum, Adam's moments): Megatron's checkpointing creates it before step 1
    # as well, and it outlives the step, so it is reported apart from the step's transient peak.
    state = LiveBytes()
    with state:
        inner.init_state()
    meter = LiveBytes()
    with observe_collectives(recorder), comm_stats() as stats, meter:
        try:
            inner.step()
        except (RuntimeError, ValueError) as e:  # a wrong device, or meta mixed with CPU
            recorder.errors.append(f"the {part['part']} step failed: {type(e).__name__}: {str(e).splitlines()[0]}")
    plan = inner.plan  # the step just run executed this plan (a full step: the first MuonBP step is one)
    layouts = plan.matrices
    here = part["dp_rank"] * tp + part["tp_rank"]
    block = None
    if "block" in inner.plans:  # MuonBP: the second step is a block step; measured on its own
        block_meter = LiveBytes()
        with observe_collectives(recorder), comm_stats() as block_stats, block_meter:
            inner.step()
        block_plan = inner.plans["block"]
        rounds = block_plan.local_blocks[part["dp_rank"]] if block_plan.local_blocks is not None else ()
        block = dict(bytes_sent=block_stats.bytes_sent, ns_flops=block_stats.ns_flops,
                     peak_extra_bytes=block_meter.peak,
                     # local blocks that are part of one row (a DP range cutting a row): none where
                     # the layout cuts matrices between rows
                     partial_row_blocks=sum(1 for rnd in rounds for _, items in rnd.batches for i, b, _ in items
                                            if b.cols < block_plan.matrices[i].local_shape[1]),
                     local_blocks=sum(len(items) for rnd in rounds for _, items in rnd.batches),
                     plan_bytes_sent=block_plan.bytes_sent[here], plan_bytes_max=max(block_plan.bytes_sent),
                     plan_ns_flops=block_plan.ns_flops[here])
    return dict(block_step=block,matrices=len(layouts), dp_owned=sum(1 for o in plan.owner_of if o == part["dp_rank"]),
                cut_across_dp=sum(1 for lay in layouts if lay.dp_ranges and len(lay.holders(dp)) > 1),
                ns_flops=stats.ns_flops, bytes_by_collective=dict(stats.bytes_by_primitive),
                largest_send_bytes=recorder.largest_send,
                bytes_sent=stats.bytes_sent, peak_extra_bytes=meter.peak, state_bytes=state.live,
                device=str(inner.device),
                # Megatron-FSDP: whether this optimizer of the chain installs and gathers the model's
                # weights (the chain's last only); None under DDP
                installs_model_weights=getattr(part["outer"], "installs_model_weights", None),
                plan_ns_flops=plan.ns_flops[here], plan_bytes_sent=plan.bytes_sent[here],
                plan_grid=dict(ranks=tp * dp, ns_flops_max=max(plan.ns_flops),
                               ns_flops_mean=sum(plan.ns_flops) / (tp * dp), bytes_sent_max=max(plan.bytes_sent),
                               bytes_sent_mean=sum(plan.bytes_sent) / (tp * dp)),
                first_matrix_holders=sorted(layouts[0].holders(dp)) if layouts else [],
                team_size=plan.team_size if plan.teams is not None else 1,
                idle_dp_ranks=plan.idle_dp_ranks(),
                # the (dp, tp) of the grid's busiest ranks by the plan: NS FLOPs, then bytes sent
                plan_busiest=[divmod(max(range(tp * dp), key=f.__getitem__), tp)
                              for f in (plan.ns_flops, plan.bytes_sent)],
                names=sorted({_pattern(lay.name) for lay in layouts}))


def _pattern(name: str) -> str:
    """``chunk0.module.module.decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`` →
    ``decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight``."""
    from megatron_muon.megatron.report import name_pattern

    return name_pattern(name)


def run_rank(shape, tp, pp, dp, rank, tp_mode, dp_layout: str = DEFAULT_DP_LAYOUT, ep: int = 1, etp: int | None = None,
             fsdp: str | None = None, muonbp: tuple | None = None, vpp: int = 1, *, per_head: bool = False) -> dict:
    """Build ``rank`` and run its step(s): the dense optimizer's figures at the top level (as
    for a dense model), the expert optimizer's under ``experts`` (None without experts on the stage)."""
    parts, slot = build_rank(shape, tp, pp, dp, rank, tp_mode, dp_layout, ep, etp, fsdp, muonbp, vpp,
                             per_head=per_head)
    try:
        recorder = Recorder(parts[0]["inner"].device)
        results = {part["part"]: _step_part(part, recorder) for part in parts}
        dense = results["dense"]
        return dict(rank=rank, **slot, **dense, experts=results.get("experts"),
                    peak_extra_bytes_all=max(r["peak_extra_bytes"] for r in results.values()),
                    groups=sorted({ranks for ranks, _, _ in recorder.trace if ranks is not None}),
                    errors=recorder.errors, trace=recorder.trace)
    finally:
        teardown()


def busiest_rank(shape, tp: int, pp: int, dp: int, tp_mode: str, ep: int = 1) -> int:
    """The first stage's rank with the most NS FLOPs by the plan (rank 0's build, on the meta
    device: the plan depends on the shapes alone, and a real build would hold a whole rank's
    model and state while the timed build of that rank allocates another)."""
    parts, slot = build_rank(shape, tp, pp, dp, 0, tp_mode, ep=ep)
    try:
        flops = parts[0]["inner"].plan.ns_flops  # per (dp, tp) of the stage's grid
        dp_rank, tp_rank = divmod(max(range(len(flops)), key=flops.__getitem__), tp)
        return tp_rank + tp * dp_rank  # stage 0: Megatron's order, TP fastest, then DP
    finally:
        teardown()


def time_rank(shape, tp: int, pp: int, dp: int, rank: int, tp_mode: str, device: torch.device,
              repeats: int, ep: int = 1) -> dict:
    """The dense optimizer's step of ``rank`` on real tensors on ``device``, under the fake process
    group: the collectives move no data, but their buffers, the Newton–Schulz kernels and the
    update are real. Gradients are random (their values do not change the step's work); one step
    first (the one-time shape check and allocations), then the median of ``repeats`` steps, timed
    with CUDA events on a GPU (the host clock on the CPU). With the plan's NS FLOPs and bytes of
    this rank. The CPU rehearsal applies cpu_patches first (``gpu_check``)."""
    import statistics

    from megatron_muon.optimizer import StepTimer

    parts, slot = build_rank(shape, tp, pp, dp, rank, tp_mode, ep=ep, device=device)
    try:
        part = parts[0]
        inner = part["inner"]
        for group in inner.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        cuda = device.type == "cuda"
        if cuda:  # what the state and the step add on top of the model and Megatron's buffers
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        inner.init_state()
        inner.step()
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        timer = StepTimer(device)
        times = [timer.measure(inner.step) for _ in range(repeats)]
        plan = inner.plan
        here = part["dp_rank"] * part["tp"] + part["tp_rank"]
        modes = Counter(plan.work[part["dp_rank"]].modes)
        return dict(rank=rank, **slot, step_s=statistics.median(times), repeats=repeats, device=str(inner.device),
                    matrices=len(plan.matrices), plan_ns_flops=plan.ns_flops[here],
                    plan_ns_flops_max=max(plan.ns_flops), plan_bytes_sent=plan.bytes_sent[here],
                    modes=dict(sorted(modes.items())),
                    device_bytes_before_state=before if cuda else None,
                    device_peak_bytes=peak if cuda else None)
    finally:
        teardown()


def first_moe_stage(shape: ModelShape, pp: int) -> int:
    """The first pipeline stage holding an MoE layer (DeepSeek-V3 at PP16: stage 1)."""
    split = _layer_split(shape, pp)
    first = split.get("num_layers_in_first_pipeline_stage", shape.num_layers // pp)
    middle = (shape.num_layers - first - split.get("num_layers_in_last_pipeline_stage", first)) // max(pp - 2, 1)
    ends = [first + middle * k for k in range(pp - 1)] + [shape.num_layers]
    return next(p for p, end in enumerate(ends) if shape.first_dense_layers < end)


def choose_ranks(kinds: list[str], tp: int, pp: int, dp: int, probe: dict, moe_stage: int = 0
                 ) -> dict[int, list[str]]:
    """Global rank → the kinds it stands for (Megatron's default order: TP fastest, then DP, then PP;
    the expert grid ETP, EP, expert-DP inside each stage). ``expert-dp-group`` / ``expert-tp-group``:
    every member of the group of the first rank of ``moe_stage`` (the first stage with experts)."""
    at = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731
    chosen: dict[int, list[str]] = {}
    for kind in kinds:
        if kind == "first":
            ranks = [0]
        elif kind == "last":
            ranks = [tp * pp * dp - 1]
        elif kind == "no-first-piece":
            ranks = [at(0, d, 0) for d in range(dp) if d not in probe["first_matrix_holders"]][-1:]
        elif kind == "idle-dp-owner":
            ranks = [at(0, d, 0) for d in probe["idle_dp_ranks"]][:1]
        elif kind == "pp-stages":
            ranks = [at(0, 0, p) for p in range(pp)]
        elif kind == "busiest":  # of the first stage, by its plan
            ranks = sorted({at(t, d, 0) for d, t in probe["plan_busiest"]})
        elif kind == "tp-group":  # rank 0's TP group
            ranks = [at(t, 0, 0) for t in range(tp)]
        elif kind == "team":  # rank 0's DP team (teams are DP ranks of one TP rank), if its plan forms teams
            ranks = [at(0, d, 0) for d in range(probe["team_size"])] if probe["team_size"] > 1 else []
        elif kind in ("expert-dp-group", "expert-tp-group"):  # stage 0's groups, moved to moe_stage
            ranks = [r + at(0, 0, moe_stage) for r in probe.get(kind.replace("-", "_"), [])]
        elif kind.isdigit():
            ranks = [int(kind)]
        else:
            raise SystemExit(f"error: --ranks: unknown kind {kind!r}; expected a number or one of {RANK_KINDS}")
        if not ranks:
            print(f"note: no rank of kind {kind!r} at this layout", file=sys.stderr)
        for r in ranks:
            chosen.setdefault(r, []).append(kind)
    return chosen


def layout_price(shape: ModelShape, tp: int, dp: int, tp_mode: str, whole_rows: bool = False):
    """The price inputs ``--muon-dp-layout priced`` chooses on (``plan.layout_choice``), as the
    Megatron adapter reads them from a training job's args: the iteration tables' job (4M-token
    global batch of 8192-token sequences, micro-batch 1, ``--overlap-grad-reduce
    --overlap-param-gather``), h100-sxm, 8 ranks per node, each candidate's step planned in
    ``tp_mode`` (``whole_rows``: ``--muonbp-block local``'s cuts between rows). The meta DDP
    built here does not run, so its own overlap flags do not matter; the layout is the one such a
    job gets."""
    from megatron_muon.plan.hardware import GPU_PROFILES
    from megatron_muon.plan.layout_choice import job_price

    return job_price(shape, tp, dp, GPU_PROFILES["h100-sxm"], tp_mode=tp_mode, whole_rows=whole_rows)


def cost_model_row(shape: ModelShape, tp: int, pp: int, dp: int, tp_mode: str,
                   dp_layout: str = DEFAULT_DP_LAYOUT, whole_rows: bool = False, ep: int = 1,
                   etp: int | None = None, per_head: bool = False) -> dict:
    """The cost model on the same layout, every pipeline stage priced (``step_cost.optimizer_step_cost``:
    the plan of the stage's real layouts, the road ``plan.stage_layouts`` shares with this run, with
    DDP's default bucket on the first stage), h100-sxm constants: the busiest stage's NS FLOPs and
    Muon exchange bytes (the plans' own figures; the expert optimizer's apart), Megatron's param
    all-gather apart, and the predicted step of the slowest stage for ours and for Adam's
    distributed optimizer."""
    from megatron_muon.plan.hardware import GPU_PROFILES
    from megatron_muon.plan.param_marks import RowSplits
    from megatron_muon.plan.step_cost import optimizer_step_cost

    hw = GPU_PROFILES["h100-sxm"]
    grid = dict(tp=tp, dp=dp, pp=pp, hw=hw, ep=ep, etp=etp)
    splits = RowSplits(qkv_per_head=per_head)  # the optimizer's defaults, QKV per head where asked
    ours, adam = [], []
    for stage in range(pp):
        ours.append(optimizer_step_cost(shape, optimizer="ours", tp_mode=tp_mode, dp_layout=dp_layout,
                                        bucket_numel=max(40_000_000, 1_000_000 * dp), stage=stage,
                                        layout_price=layout_price(shape, tp, dp, tp_mode, whole_rows), splits=splits,
                                        **grid))
        adam.append(optimizer_step_cost(shape, optimizer="adam", stage=stage, **grid))
    row = dict(ns_flops_max=max(c.ns_flops_max for c in ours), bytes_sent_max=max(c.bytes_sent_max for c in ours),
               param_gather_bytes=max(c.param_gather_bytes for c in ours),
               step_ms_h100=max(c.total_s for c in ours) * 1e3, adam_step_ms_h100=max(c.total_s for c in adam) * 1e3)
    if shape.num_experts:
        row.update(expert_ns_flops_max=max(c.expert_ns_flops_max for c in ours),
                   expert_bytes_sent_max=max(c.expert_bytes_sent_max for c in ours))
    return row


def planner_rows(model: str, tp: int, pp: int, dp: int, dp_layout: str, fsdp: str | None, tp_mode: str
                 ) -> dict[int, tuple[float, float]] | None:
    """Per global rank (PP = 1 only), the planner table's NS FLOPs and bytes sent for the same
    layout (``scripts.bench.planner_quality``: the same plans, computed without running a step;
    under ``fsdp`` its "ours (Megatron-FSDP)" row, ``fsdp_layouts``, which emulates
    ``optim_grads_params`` only: one bucket per transformer layer)."""
    if pp != 1 or fsdp not in (None, "optim_grads_params"):
        return None
    from scripts.bench import planner_quality as pq

    spec = pq.llama3_spec(model.removeprefix("llama3-").upper())
    layouts = (pq.fsdp_layouts(spec, tp, dp, fsdp) if fsdp is not None
               else pq.ours_layouts(spec, tp, dp, pq.default_bucket_size(dp), dp_layout=dp_layout,
                                    price=layout_price(spec, tp, dp, tp_mode)))
    plan = pq.plan_ours(layouts, tp, dp)
    return {r: (plan.flops[r], plan.dp_bytes[r] + plan.tp_bytes[r]) for r in range(tp * dp)}


def _row(rank: int, kinds: list[str], coords: str, res: dict) -> str:
    b = Counter(res["bytes_by_collective"])
    sent = " / ".join(f"{b[k] / 2**20:.1f}" for k in ("all_to_all", "all_gather", "all_reduce", "broadcast",
                                                        "shape_check"))
    plan_flops = f" ({res['plan_ns_flops'] / 1e12:.2f})"
    plan_mib = f"{res['plan_bytes_sent'] / 2**20:.1f}"
    if "planner_ns_flops" in res:
        plan_flops += f" [{res['planner_ns_flops'] / 1e12:.2f}]"
        plan_mib += f" [{res['planner_bytes_sent'] / 2**20:.1f}]"
    return (f"| {rank} | {', '.join(kinds)} | {coords} | {res['matrices']} | {res['cut_across_dp']} | "
            f"{res['dp_owned']} | {res['ns_flops'] / 1e12:.2f}{plan_flops} | {sent} | {plan_mib} | "
            f"{res['state_bytes'] / 2**30:.2f} | {res['peak_extra_bytes'] / 2**30:.2f} |")


def summary(parts: dict[int, dict], stage_of: dict[int, int]) -> dict:
    """NS FLOPs and bytes sent of one optimizer (dense or experts): max and mean over the simulated
    ranks (measured), and over every rank of the pipeline stages simulated (the plans of their
    layouts, which the measured ranks match): the max of the stages' maxima, the mean of their means
    (every stage has the same number of ranks)."""
    flops, sent = [r["ns_flops"] for r in parts.values()], [r["bytes_sent"] for r in parts.values()]
    grids = {stage_of[rank]: r["plan_grid"] for rank, r in sorted(parts.items(), reverse=True)}
    plan = dict(stages=sorted(grids), ranks_per_stage=next(iter(grids.values()))["ranks"],
                **{f"{k}_max": max(g[f"{k}_max"] for g in grids.values()) for k in ("ns_flops", "bytes_sent")},
                **{f"{k}_mean": sum(g[f"{k}_mean"] for g in grids.values()) / len(grids)
                   for k in ("ns_flops", "bytes_sent")})
    return dict(ranks=len(parts), ns_flops_max=max(flops), ns_flops_mean=sum(flops) / len(flops),
                bytes_sent_max=max(sent), bytes_sent_mean=sum(sent) / len(sent), plan=plan)


def _summary_line(what: str, s: dict, grid: str) -> str:
    g = s["plan"]
    stages = f"stage {g['stages'][0]}" if len(g["stages"]) == 1 else f"{len(g['stages'])} stages"
    return (f"{what}: over the {s['ranks']} simulated ranks NS max {s['ns_flops_max'] / 1e12:.2f} / mean "
            f"{s['ns_flops_mean'] / 1e12:.2f} TFLOP, sent max {s['bytes_sent_max'] / 2**20:.1f} / mean "
            f"{s['bytes_sent_mean'] / 2**20:.1f} MiB; plan over every {grid} rank of the simulated {stages} "
            f"({g['ranks_per_stage']} per stage): NS max {g['ns_flops_max'] / 1e12:.2f} / mean "
            f"{g['ns_flops_mean'] / 1e12:.2f} TFLOP, sent max {g['bytes_sent_max'] / 2**20:.1f} / mean "
            f"{g['bytes_sent_mean'] / 2**20:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=1,
                        help="virtual pipeline stages per PP rank (--virtual-pipeline-model-parallel-size; "
                             "dense models)")
    parser.add_argument("--ep", type=int, default=1, help="expert model parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor parallel size (default: --tp, as Megatron)")
    parser.add_argument("--tp-mode", default=MuonConfig().tp_mode, choices=TP_MODES,
                        help=f"--muon-tp-mode (default {MuonConfig().tp_mode}, as in training); auto plans on the "
                             "h100-sxm constants")
    wrap = parser.add_mutually_exclusive_group()
    wrap.add_argument("--dp-layout", default=None, choices=DP_LAYOUTS,
                      help=f"the DDP buffer layout (--muon-dp-layout); default {MuonConfig().dp_layout}, as in "
                           "training (priced on the h100-sxm profile)")
    wrap.add_argument("--fsdp", default=None, choices=("optim_grads_params", "optim_grads", "optim", "no_shard"),
                      help="Megatron-FSDP (--use-megatron-fsdp) with this --data-parallel-sharding-strategy "
                           "instead of DDP (PP1; with experts, Megatron-FSDP's expert-DP group for them)")
    parser.add_argument("--ranks", default=None,
                        help=f"comma-separated rank numbers or kinds {RANK_KINDS}; default first,last,no-first-piece,"
                             "idle-dp-owner,pp-stages,tp-group,team (and expert-dp-group,expert-tp-group for an MoE "
                             "model)")
    parser.add_argument("--muonbp-period", type=int, default=None,
                        help="MuonBP: the measured step is a full step, and a second, block, step is measured too")
    parser.add_argument("--muonbp-block", default="tp_shard", choices=MUONBP_BLOCKS,
                        help="with --muonbp-period: what the block step orthogonalizes (--muonbp-block)")
    parser.add_argument("--split-qkv-per-head", action="store_true",
                        help="--muon-split-qkv-per-head: Q, K and V orthogonalized per head (docs/per_head.md); "
                             "the cost model prices the per-head plan, the planner table is not printed (it splits "
                             "per query group)")
    parser.add_argument("--ranks-per-node", type=int, default=8,
                        help="ranks per node, as the launcher's LOCAL_WORLD_SIZE gives it (node = global rank // "
                             "this): the plans' rank map, which decides auto's DP teams (default 8)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    if args.muonbp_period is not None and args.muonbp_period < 2:
        parser.error(f"--muonbp-period {args.muonbp_period}: the dry run measures a full step, then a block "
                     "step; expected a period >= 2")
    muonbp = (args.muonbp_period, args.muonbp_block) if args.muonbp_period is not None else None
    for flag in ("tp", "pp", "vpp", "dp", "ep", "etp", "ranks_per_node"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    args.dp_layout = args.dp_layout or MuonConfig().dp_layout
    shape = MODELS[args.model]
    if args.vpp > 1 and (shape.num_experts or args.pp < 2 or args.fsdp is not None):
        parser.error(f"--vpp {args.vpp}: virtual stages need --pp >= 2, DDP and a dense model here")
    if args.fsdp is not None and args.pp > 1:
        # mcore_fsdp_adapter._get_dp_tp_mesh rearranges torch.arange(world_size) as (dp_cp ep tp):
        # at TP8 x PP16 x DP64 einops raises "Shape mismatch, 8192 != 512" (a real job too).
        parser.error(f"--fsdp with --pp {args.pp}: megatron-core 0.19.2's Megatron-FSDP builds its DP x TP mesh "
                     "from every rank of the job (world size = DP x TP x EP), so it cannot be built with pipeline "
                     "parallelism")
    if shape.hybrid_pattern is not None:
        try:
            staged_pattern(shape.hybrid_pattern, args.pp * args.vpp)
        except ValueError as e:
            parser.error(f"--pp {args.pp} --vpp {args.vpp}: {e}")
    etp = args.tp if args.etp is None else args.etp
    if not shape.num_experts and (args.ep > 1 or etp != args.tp):
        parser.error(f"--ep / --etp: {args.model} has no experts")
    if shape.num_experts and (shape.num_experts % args.ep or (args.tp * args.dp) % (args.ep * etp)):
        parser.error(f"--ep {args.ep} --etp {etp}: EP must divide the {shape.num_experts} experts and EP x expert-TP "
                     f"must divide TP x DP = {args.tp * args.dp} (Megatron's expert grid)")
    ranks = args.ranks or ("first,last,no-first-piece,idle-dp-owner,pp-stages,tp-group,team"
                           + (",expert-dp-group,expert-tp-group" if shape.num_experts else ""))
    warnings.filterwarnings("ignore")  # Megatron: no TE / Apex on this machine; GPTModel deprecation
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # what torchrun sets on every rank: the optimizer reads the nodes of its groups' ranks from it
    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches, view_device

    apply_cpu_patches()
    if args.fsdp is not None:
        from megatron_muon.megatron.cpu_patches import patch_megatron_fsdp_dry_run

        patch_megatron_fsdp_dry_run()
    started = time.perf_counter()
    layout = (shape, args.tp, args.pp, args.dp)
    with view_device(torch.device("meta")):  # Megatron's buffers: allocated on meta, not the CPU
        probe = run_rank(*layout, 0, args.tp_mode, args.dp_layout, args.ep, etp, args.fsdp, muonbp, args.vpp,
                         per_head=args.split_qkv_per_head)
        moe_stage = first_moe_stage(shape, args.pp) if shape.num_experts else 0
        chosen = choose_ranks(ranks.split(","), args.tp, args.pp, args.dp, probe, moe_stage)
        if not chosen:
            raise SystemExit(f"error: --ranks {ranks}: no such rank at this layout")
        results = {0: probe} if 0 in chosen else {}
        for rank in sorted(set(chosen) - set(results)):
            results[rank] = run_rank(*layout, rank, args.tp_mode, args.dp_layout, args.ep, etp, args.fsdp, muonbp,
                                     args.vpp, per_head=args.split_qkv_per_head)
    errors = [f"rank {r}: {e}" for r, res in results.items() for e in res["errors"]]
    errors += cross_rank_errors({r: res["trace"] for r, res in results.items()})
    # the cost model: what plan.stage_params lists (GPTs with GQA or MLA, dense or MoE; hybrid
    # models without MoE layers) on DDP's buffer layouts, the experts' buffer apart; with a virtual
    # pipeline it prices the stage's layers as one chunk (the same matrices, one buffer instead of
    # one per chunk). The planner table: dense GQA GPTs.
    moe = bool(shape.num_experts) or shape.mla is not None or shape.hybrid_pattern is not None
    # (the planner's stage replay splits QKV per query group, not per head)
    modeled = not (args.fsdp or (shape.hybrid_pattern is not None and "E" in shape.hybrid_pattern))
    predicted = (cost_model_row(shape, args.tp, args.pp, args.dp, args.tp_mode, args.dp_layout,
                                muonbp is not None and muonbp[1] == "local", args.ep, etp,
                                args.split_qkv_per_head) if modeled else None)
    planned = (planner_rows(args.model, args.tp, args.pp, args.dp, args.dp_layout, args.fsdp, args.tp_mode)
               if args.tp_mode == "owner" and not moe and not args.split_qkv_per_head else None)
    for rank, res in results.items():
        if planned is not None:
            res["planner_ns_flops"], res["planner_bytes_sent"] = planned[rank]

    world = args.tp * args.pp * args.dp
    experts = (f", EP{args.ep} x expert-TP{etp} x expert-DP{args.tp * args.dp // (args.ep * etp)}"
               if shape.num_experts else "")
    wrapper = f"Megatron-FSDP {args.fsdp}" if args.fsdp else f"--muon-dp-layout {args.dp_layout}"
    vpp = f" x VPP{args.vpp}" if args.vpp > 1 else ""
    print(f"Dry run: {args.model}, TP{args.tp} x PP{args.pp}{vpp} x DP{args.dp} ({world} ranks){experts}, "
          f"tp_mode {args.tp_mode}, {wrapper}{', QKV per head' if args.split_qkv_per_head else ''}, bf16 NS, "
          "meta device, fake process group, "
          f"{args.ranks_per_node} ranks per node\n")
    print("| rank | kinds | TP/DP/PP rank | Muon matrices | cut across DP | DP-owned units "
          "| NS TFLOP (plan) [planner table] "
          "| MiB sent (all_to_all / all_gather / all_reduce / broadcast / shape check) "
          "| plan MiB [planner table] | state GiB | transient peak GiB |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for rank, res in sorted(results.items()):
        print(_row(rank, chosen.get(rank, ["probe"]), f"{res['tp']}/{res['dp']}/{res['pp']}", res))
    with_experts = {r: res for r, res in sorted(results.items()) if res["experts"] is not None}
    if with_experts:
        print("\nExpert optimizer (this EP rank's local experts; DP = expert-DP, TP = expert-TP):\n")
        print("| rank | kinds | EP/expert-TP/expert-DP/PP rank | Muon matrices | cut across expert-DP | "
              "expert-DP-owned | NS TFLOP (plan) "
              "| MiB sent (all_to_all / all_gather / all_reduce / broadcast / shape check) | "
              "plan MiB | state GiB | transient peak GiB |")
        print("|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
        for rank, res in with_experts.items():
            print(_row(rank, chosen.get(rank, ["probe"]), f"{res['ep']}/{res['etp']}/{res['edp']}/{res['pp']}",
                       res["experts"]))
    stage_of = {rank: res["pp"] for rank, res in results.items()}
    sums = dict(dense=summary(results, stage_of))
    print()
    print(_summary_line("Dense optimizer", sums["dense"], "TP x DP"))
    blocks = {r: res["block_step"] for r, res in sorted(results.items()) if res.get("block_step")}
    if blocks:
        sent = max(b["bytes_sent"] for b in blocks.values())
        planned = max(b["plan_bytes_max"] for b in blocks.values())
        peak = max(b["peak_extra_bytes"] for b in blocks.values())
        print(f"MuonBP block step (--muonbp-block {args.muonbp_block}): sent max {sent / 2**20:.1f} MiB over the "
              f"simulated ranks, transient peak {peak / 2**30:.2f} GiB; plan over the stage's grid: max "
              f"{planned / 2**20:.1f} MiB")
    if with_experts:
        sums["experts"] = summary({r: res["experts"] for r, res in with_experts.items()}, stage_of)
        print(_summary_line("Expert optimizer", sums["experts"], "expert-TP x expert-DP (of one EP rank)"))
    if predicted is not None:
        busiest = max(res["ns_flops"] for res in results.values())
        print(f"Cost model, same layout (busiest rank of the job; h100-sxm constants): NS "
              f"{predicted['ns_flops_max'] / 1e12:.2f} TFLOP (busiest simulated rank here: {busiest / 1e12:.2f}), "
              f"{predicted['bytes_sent_max'] / 2**20:.1f} MiB sent by Muon (Megatron's param all-gather: "
              f"{predicted['param_gather_bytes'] / 2**20:.1f} MiB), step {predicted['step_ms_h100']:.1f} ms; Adam's "
              f"distributed optimizer on the same layout {predicted['adam_step_ms_h100']:.1f} ms (Muon adds "
              f"{predicted['step_ms_h100'] - predicted['adam_step_ms_h100']:.1f} ms)"
              + (f"; the experts' plan: NS {predicted['expert_ns_flops_max'] / 1e12:.2f} TFLOP, "
                 f"{predicted['expert_bytes_sent_max'] / 2**20:.1f} MiB sent"
                 if "expert_ns_flops_max" in predicted else "") + ".")
    print(f"Checked {sum(len(r['trace']) for r in results.values())} collectives on {len(results)} ranks: "
          f"{'all on the step device, sizes consistent' if not errors else f'{len(errors)} problems'}; "
          f"{time.perf_counter() - started:.1f} s.")
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    if args.json:
        for res in results.values():
            res["trace"] = len(res["trace"])
        args.json.write_text(json.dumps(dict(model=args.model, tp=args.tp, pp=args.pp, vpp=args.vpp, dp=args.dp,
                                             split_qkv_per_head=args.split_qkv_per_head,
                                             ep=args.ep, ranks_per_node=args.ranks_per_node,
                                             etp=etp, tp_mode=args.tp_mode, fsdp=args.fsdp,
                                             dp_layout=None if args.fsdp else args.dp_layout,
                                             ranks={str(r): dict(res, kinds=chosen.get(r, []))
                                                    for r, res in results.items()},
                                             summary=sums, cost_model=predicted, errors=errors), indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
