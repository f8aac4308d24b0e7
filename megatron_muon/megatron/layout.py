"""``--muon-dp-layout balanced``: our buffer layout for megatron-core's DDP.

megatron-core 0.19.2's ``DistributedDataParallel`` takes a ``full_param_layout`` (a
``FullParamLayout``: per buffer, every param's ``(start, end, bucket_id)`` and the bucket
bounds); ``megatron.training.training.wrap_model_chunks_with_ddp`` computes one per model chunk
(``DistributedOptimizer.compute_full_param_layout``, or the layer-wise optimizer's) and passes
it in. ``balanced_full_param_layout`` computes ours instead, with the same buffer grouping
(``group_params_for_buffers``), the same bucket size and the same alignment rules, from
``plan.balanced_layout``: every Muon matrix whole inside one DP shard.

The hooks (``hooks.py``) hand Megatron's two DDP wrappers (``wrap_model_chunks_with_ddp`` of
``get_model``, ``models.dist_utils._ddp_wrap`` of the ``ModelConfig`` builders) a DDP factory
(``ddp_with_balanced_layout``) that builds this layout for its chunk; Megatron's distributed
optimizer then shards the buffer as always and ``MuonDistributedOptimizer`` finds every matrix
on one DP rank, so ``plan_dp_owners`` pins each to the rank that holds it and the DP exchange
sends nothing. Python API users wrapping DDP themselves pass
``full_param_layout=balanced_full_param_layout(...)``.

Under ``--muon-dp-layout priced``, with Megatron's args (``get_args()``: sequence, micro-batch and
global batch sizes) each buffer's layout is the one ``plan.layout_choice.choose_layout``
prices cheaper: whole matrices, or megatron-core's buckets cut at rows where Megatron's overlap
is worth more than the DP exchange the cuts cost (``megatron_layout_price``; an expert-parallel
buffer on ``megatron_expert_price``: the tokens one expert sees, over expert TP and expert DP);
without them (a Python API user's own DDP), whole matrices as before.
"""

from __future__ import annotations

import math

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout, bucket_end_divisor
from megatron.core.utils import get_pg_size

from ..config import MuonConfig
from ..plan.balanced_layout import MAX_PADDING, PARAM_ALIGN, balanced_layout, layout_item
from ..plan.iteration import attention_flops
from ..plan.layout_choice import ExpertRouting, LayoutPrice, choose_layout, forward_flops, step_seconds
from ..plan.stage_layouts import dp_ranges
from .catalogue import is_muon_matrix, layout_of, tag_grouped_experts, tag_qkv
from .checkpoint import BALANCED_MARK, check_saved_extents
from .report import CHOICE_MARK

__all__ = ["BALANCED_MARK", "balanced_buffer_layouts", "balanced_full_param_layout",
           "ddp_with_balanced_layout", "megatron_expert_price", "megatron_layout_price"]


def shard_divisor(dp_size: int, ddp_config) -> int:
    """Every shard size is a multiple of this: 64-aligned shard starts, and DP × shard meets
    megatron-core's bucket-end padding rule (lcm(DP, 128), or its NCCL-busbw variant)."""
    return math.lcm(PARAM_ALIGN, bucket_end_divisor(dp_size, ddp_config.pad_buckets_for_high_nccl_busbw) // dp_size)


def balanced_full_param_layout(
    model_chunk: torch.nn.Module,
    bucket_size: int | None,
    dp_size: int,
    ddp_config,
    *,
    muon_config: MuonConfig,
    tp_size: int,
    expert_dp_size: int | None = None,
    max_padding: float = MAX_PADDING,
    price: LayoutPrice | None = None,
    expert_price: LayoutPrice | None = None,
) -> FullParamLayout:
    """The balanced ``FullParamLayout`` of one (un-wrapped) model chunk.

    Marks ``model_chunk`` with ``BALANCED_MARK`` (what the training hooks check before the optimizer
    is built).

    Args:
        model_chunk: the chunk DDP will wrap (its ``config`` names the attention shape, for the
            QKV split that sets each matrix's NS FLOPs).
        bucket_size: DDP's bucket size in elements for this chunk (None: one bucket).
        dp_size: the intra-instance DP group size the distributed optimizer shards over.
        ddp_config: the ``DistributedDataParallelConfig`` (grad dtype grouping, bucket padding).
        muon_config: the split rules (QKV, fc1) and ``layout_alpha``.
        tp_size: tensor-parallel size (NS FLOPs are of the full matrices).
        expert_dp_size: DP size of expert-parallel buffers (default ``dp_size``).
        max_padding: a bucket padding more than this with whole matrices is packed as
            megatron-core packs it (``balanced_layout``); 1.0 keeps every bucket whole-matrix.
        price: the job's price inputs under ``--muon-dp-layout priced`` (``megatron_layout_price``,
            or ``layout_choice.job_price`` for a planned job): each dense buffer laid out as
            ``choose_layout`` chooses, the choices recorded on the chunk as ``CHOICE_MARK``;
            None: whole matrices.
        expert_price: the same for the expert-parallel buffer (``megatron_expert_price``);
            None: whole experts.
    """
    tag_qkv([model_chunk])
    tag_grouped_experts([model_chunk])  # TE's grouped fc1 costs as its gate and up halves, as the optimizer splits it
    named = [(n, p) for n, p in model_chunk.named_parameters() if p.requires_grad]
    choices: dict = {}
    layouts = balanced_buffer_layouts(named, bucket_size, dp_size, ddp_config, muon_config=muon_config,
                                      tp_size=tp_size, expert_dp_size=expert_dp_size, max_padding=max_padding,
                                      price=price, expert_price=expert_price, choices=choices)
    setattr(model_chunk, BALANCED_MARK, True)
    setattr(model_chunk, CHOICE_MARK, choices)
    return FullParamLayout(layouts={key: full for key, (_, full) in layouts.items()})


def balanced_buffer_layouts(
    named_params, bucket_size: int | None, dp_size: int, ddp_config, *, muon_config: MuonConfig, tp_size: int,
    expert_dp_size: int | None = None, max_padding: float = MAX_PADDING, price: LayoutPrice | None = None,
    expert_price: LayoutPrice | None = None, choices: dict | None = None,
) -> dict:
    """Per buffer (megatron-core's ``BufferKey``): ``(BufferLayout, PerBufferParamLayout)``.

    ``named_params``: ``(name, param)`` in model order, QKV and grouped experts already tagged
    (``catalogue.tag_qkv``, ``catalogue.tag_grouped_experts``); the
    arguments are ``balanced_full_param_layout``'s. Planning tools call this on meta params.
    ``choices``: when given, filled with each priced buffer's ``LayoutChoice`` (by ``BufferKey``).
    """
    names = {p: n for n, p in named_params}
    params = [p for _, p in named_params]
    ns = muon_config.ns
    out = {}
    for key, (group, indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        dp = (expert_dp_size or dp_size) if key.is_expert_parallel else dp_size
        items = [layout_item(p.numel(), layout_of(names[p], p, tp_size, muon_config) if is_muon_matrix(p) else None,
                             ns, row=p.shape[-1], own_bucket=getattr(p, "shared_embedding", False))
                 for p in group]
        choice = None
        key_price = expert_price if key.is_expert_parallel else price
        if key_price is not None:
            flops = [forward_flops(names[p], p.numel(), p.dim(), key_price) for p in group]

            def step_s(candidate, group=group, dp=dp, key_price=key_price) -> float:
                # the matrices as catalogue.describe_zero1 will find them: bucket by bucket, backprop within
                order = sorted(reversed(range(len(group))), key=lambda k: candidate.ranges[k][2])
                matrices = [layout_of(names[group[k]], group[k], key_price.tp, muon_config,
                                      dp_ranges=dp_ranges(candidate, k)) for k in order if is_muon_matrix(group[k])]
                return step_seconds(matrices, dp, key_price, ns)

            choice = choose_layout(items, flops, dp, bucket_size, key_price, alpha=muon_config.layout_alpha,
                                   shard_divisor=shard_divisor(dp, ddp_config), max_padding=max_padding,
                                   bucket_divisor=bucket_end_divisor(dp, ddp_config.pad_buckets_for_high_nccl_busbw),
                                   step_s=step_s)
            laid = choice.layout
            if choices is not None:
                choices[key] = choice
        else:
            laid = balanced_layout(items, dp, bucket_size, alpha=muon_config.layout_alpha,
                                   shard_divisor=shard_divisor(dp, ddp_config), max_padding=max_padding)
        # megatron-core's own map lists params in buffer order (backprop), and its DP-reshardable
        # checkpoint pads the gaps between consecutive entries of a shard, which must not run
        # backwards: the row-aligned layout packs in backprop order, so its map goes in that order
        # (the whole-matrix layout keeps its registration-order map, as its checkpoints were saved)
        order = range(len(group)) if choice is None or choice.chosen == "whole" else reversed(range(len(group)))
        out[key] = (laid, PerBufferParamLayout(
            param_index_map={group[k]: laid.ranges[k] for k in order},
            bucket_indices=list(laid.buckets),
            per_bucket_numel_unpadded=list(laid.numel_unpadded),
            param_indices=list(indices),
            num_optimizer_shards=dp,
        ))
    return out


def ddp_with_balanced_layout(muon_config: MuonConfig):
    """A drop-in for the ``DP`` class Megatron's DDP wrappers construct
    (``training.wrap_model_chunks_with_ddp``, and ``models.dist_utils._ddp_wrap`` of the
    ``ModelConfig`` builders): megatron-core's ``DistributedDataParallel`` given
    ``balanced_full_param_layout`` for its chunk (which marks the chunk with ``BALANCED_MARK``).

    A ``full_param_layout`` passed in is megatron-core's (``_ddp_wrap`` computes one for any
    class it takes for plain DDP); with the distributed optimizer it is replaced by ours, which
    is what this factory is for. The bucket size and DP size follow
    ``DistributedDataParallel.__init__``'s own rules (its default bucket size, none without
    ``overlap_grad_reduce``, none on a pipeline stage after the first or with
    ``disable_bucketing``), so the layout's buckets are the ones DDP would form.
    """

    def build(*, config, ddp_config, module, disable_bucketing=False, pg_collection=None, full_param_layout=None):
        from megatron.core.process_groups_config import ProcessGroupCollection

        if ddp_config.use_distributed_optimizer:
            groups = ProcessGroupCollection.setup_process_groups_for_ddp(pg_collection, config, ddp_config)
            dp_size = get_pg_size(groups["intra_dp_cp_group"])
            bucket_size = ddp_config.bucket_size
            if bucket_size is None:
                bucket_size = max(40_000_000, 1_000_000 * get_pg_size(groups["dp_group"]))
            pp_group = groups["pp_group"]
            pp_rank = (pp_group[0] if isinstance(pp_group, list) else pp_group).rank()
            if not ddp_config.overlap_grad_reduce or disable_bucketing or pp_rank > 0:
                bucket_size = None
            tp_size = get_pg_size(groups["tp_group"])
            price = (megatron_layout_price(ddp_config, config, muon_config, groups["intra_dp_cp_group"],
                                           groups["tp_group"]) if muon_config.dp_layout == "priced" else None)
            full_param_layout = balanced_full_param_layout(
                module, bucket_size, dp_size, ddp_config, muon_config=muon_config, tp_size=tp_size,
                expert_dp_size=get_pg_size(groups["intra_expt_dp_group"]), price=price,
                expert_price=megatron_expert_price(price, config, groups["intra_expt_dp_group"]),
            )
        kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                      disable_bucketing=disable_bucketing,
                                      full_param_layout=full_param_layout, **kwargs)
        if ddp_config.use_distributed_optimizer:  # our layout and megatron-core's buffers agree
            names = {id(p): n for n, p in module.named_parameters()}
            check_saved_extents(ddp.buffers + ddp.expert_parallel_buffers, names, exact=True)
        return ddp

    return build


def megatron_layout_price(ddp_config, config, muon_config: MuonConfig, dp_group, tp_group) -> LayoutPrice | None:
    """The ``LayoutPrice`` of this job, from Megatron's args at DDP-wrap time: M = global batch /
    (micro-batch × DP), tokens = sequence × micro-batch, the hardware profile
    ``--muon-auto-hardware`` names (``detect``: this device), the DP group's node span from its
    global ranks and ``LOCAL_WORLD_SIZE`` (``step_setup.stage_topology``), the DDP overlap flags and
    dtypes. ``config``: the model's ``TransformerConfig`` (attention shape). None without
    Megatron's args (DDP wrapped from Python: the caller keeps whole matrices).

    Every DP rank reads the same args, flags and (on a job of one GPU kind) the same detected
    profile, so every rank chooses the same layout; ``check_saved_extents`` and the plan digest
    compared across DP ranks at construction would catch a rank that did not."""
    from ..parallel.step_setup import stage_topology
    from ..plan.hardware import hardware_profile

    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):  # megatron-core alone, or args not parsed: not Megatron's training
        return None
    if args is None or not getattr(args, "global_batch_size", None) or not getattr(args, "seq_length", None):
        return None
    hw = hardware_profile(muon_config.auto_hardware)
    dp = getattr(args, "data_parallel_size", None) or get_pg_size(dp_group)
    tp = get_pg_size(tp_group)
    topology = stage_topology(dp_group, tp_group, hw)
    spans = topology.dp_spans_nodes if topology is not None else tp * dp > hw.ranks_per_node
    micro = args.micro_batch_size
    heads, head_dim = config.num_attention_heads, config.kv_channels or config.hidden_size // config.num_attention_heads
    value_dim = None
    if getattr(config, "multi_latent_attention", False):  # QKᵀ over no-RoPE and RoPE channels, AV over values
        head_dim, value_dim = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    return LayoutPrice(
        max(1, args.global_batch_size // (micro * dp)), args.seq_length * micro, spans, hw,
        attention_flops(args.seq_length, micro, heads, head_dim, tp, value_dim=value_dim),
        grad_bytes=4 if ddp_config.grad_reduce_in_fp32 else 2,
        param_bytes=2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4,
        exchange_bytes=muon_config.ns_dtype.itemsize, tp=tp, tp_mode=muon_config.tp_mode,
        whole_rows=muon_config.muonbp_period is not None and muon_config.muonbp_block == "local",
        overlap_grad_reduce=ddp_config.overlap_grad_reduce, overlap_param_gather=ddp_config.overlap_param_gather)


def megatron_expert_price(price: LayoutPrice | None, config, expert_dp_group) -> LayoutPrice | None:
    """The ``LayoutPrice`` of the expert-parallel buffer (``LayoutPrice.for_experts``): the job's
    ``price`` at the tokens one expert sees (``config``'s ``num_moe_experts``, ``moe_router_topk``,
    ``expert_model_parallel_size``), over expert TP (``expert_tensor_parallel_size``), its links over
    the expert-DP group's node span (from its global ranks, as ``megatron_layout_price`` reads the
    DP group's). None without a price or without experts."""
    from ..parallel.step_setup import stage_topology

    if price is None or not getattr(config, "num_moe_experts", None):
        return None
    routing = ExpertRouting(config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size)
    topology = stage_topology(expert_dp_group, None, price.hardware)
    spans = topology.dp_spans_nodes if topology is not None else price.dp_spans_nodes
    return price.for_experts(routing, expert_tp=config.expert_tensor_parallel_size or price.tp, dp_spans_nodes=spans)
