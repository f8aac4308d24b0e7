"""The matrix catalogue: which of a Megatron model's parameters are Muon matrices, and where each lies.

One module for every question about a model's matrices:

* **routing**: a 2-D weight that is not ``is_embedding_or_output_parameter`` is a Muon matrix,
  everything else AdamW (upstream's rule; an MoE router's weight is a Muon matrix too), unless
  it carries ``use_muon=False`` (upstream's mark, megatron-core's main branch after 0.19.2), which
  ``tag_routing`` sets from the config: a Mamba ``in_proj`` with ``--muon-mamba-in-proj adamw``,
  a router with ``--moe-router-skip-muon``;
* **tags**: fused QKV weights (``is_qkv``, ``qkv_split_shapes``, set here by module as upstream's
  emerging-optimizer path does) split per query group, or per head (``qkv_heads``; MLA's
  up-projections ``mla_heads``) with ``--muon-split-qkv-per-head``; a gated fc1 (``partition_stride == 2``,
  or ``gated_fc1`` on Transformer Engine's grouped experts) splits into gate and up; a Mamba
  ``in_proj`` (megatron-core's ``partition_sizes``) into z, x, B, C and dt;
* **the layout** of each matrix (``layout_of``: TP shard, split dim, fused rows, DP ranges);
* **one describe per backend**, each returning the ``MatrixCatalogue`` the inner optimizer is
  built from (every matrix, the tensor this rank updates, the DP and TP groups) and the map from
  a model param to its matrix (what QK-clip scales):
    ``describe_zero1``           Megatron's distributed optimizer: every DP rank's range of each
                                 matrix, with Megatron's own range function;
    ``describe_megatron_fsdp``   Megatron-FSDP: every DP rank's rows, with its shard arithmetic;
    ``describe_whole``           DDP without the distributed optimizer (whole matrices on every DP
                                 rank), and torch FSDP2 (rows over its DP mesh).

Nothing here changes Megatron's objects except the tags above, which mark parameters the way
upstream marks them.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron.core.utils import get_pg_size

from ..config import MuonConfig
from ..core.matrix_layout import MatrixLayout
from ..optimizer import MatrixCatalogue
from ..plan.param_marks import ParamMarks, RowSplits, matrix_layout
from .megatron_fsdp import check_own_range, fsdp_item_ranges, optimizer_buffer
from .torch_fsdp2 import fsdp2_mesh_refusal, torch_fsdp2_ranges

__all__ = ["MatrixOf", "describe_megatron_fsdp", "describe_whole", "describe_zero1", "is_expert_parallel",
           "is_muon_matrix", "layout_of", "marks_of", "mla_heads_of", "packed_in_backprop_order", "param_names",
           "ranges_on_every_rank", "qkv_heads_of", "row_splits", "tag_grouped_experts", "tag_qkv", "tag_routing"]

MatrixOf = dict[int, tuple[MatrixLayout, torch.Tensor | None]]
"""id(model param) → (its layout, the tensor this rank updates for it, or None)."""


# ---- routing and tags ------------------------------------------------------------------------


def is_muon_matrix(param: torch.nn.Parameter) -> bool:
    """Hidden 2-D weights get Muon; embeddings, the output layer, norms, biases and a weight marked
    ``use_muon=False`` (``tag_routing``) get AdamW."""
    return (param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            and getattr(param, "use_muon", True))


def tag_routing(model_chunks, muon_config: MuonConfig) -> None:
    """Set ``use_muon`` on the weights whose algorithm is a choice, from ``muon_config``: a Mamba
    ``in_proj`` (the 2-D weight megatron-core marks with ``partition_sizes``) is AdamW's with
    ``mamba_in_proj="adamw"``, an MoE router's weight (and bias) with ``router_skip_muon`` (or the
    model config's ``moe_router_skip_muon``, upstream's field). The
    mark is written either way, so that the config decides over a mark megatron-core's main branch
    sets itself (it sends in_proj to AdamW, where ``split`` and ``whole`` keep it on Muon)."""
    from megatron.core.transformer.moe.router import Router

    in_proj = muon_config.mamba_in_proj != "adamw"
    for chunk in model_chunks:
        # the model's own setting counts too (megatron-core's main branch: TransformerConfig.moe_router_skip_muon)
        skip = muon_config.router_skip_muon or getattr(getattr(chunk, "config", None), "moe_router_skip_muon", False)
        for module in chunk.modules():
            if isinstance(module, Router):
                for param in module.parameters(recurse=False):
                    param.use_muon = not skip
        for param in chunk.parameters():
            if param.dim() == 2 and getattr(param, "partition_sizes", None) is not None:
                param.use_muon = in_proj


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """Megatron's mark of an expert-parallel param (grads reduced over the expert-DP group)."""
    return not getattr(param, "allreduce", True)


def tag_fsdp_experts(model_chunks) -> None:
    """Under Megatron-FSDP, mark the params it shards over the expert-DP group as Megatron marks
    expert-parallel params (``allreduce = False``).

    Megatron-FSDP puts every param under ``.experts.`` in buckets of its own, sharded over the
    expert-DP group, while Megatron marks an expert's param only when it uses the expert groups
    (not at EP1 with the dense TP size), and its DTensor params carry no mark at all: it copies a
    fixed list of attributes (``reset_attribute``), ``allreduce`` not among them. Megatron's
    ``_get_param_groups_and_buffers`` reads the mark to split dense from expert params; without
    it an expert would join the dense optimizer, whose DP group is not the one sharding it."""
    for chunk in model_chunks:
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        if buffer is None or not hasattr(buffer, "parameter_groups"):  # not Megatron-FSDP
            continue
        sharded_as_experts = {id(p) for group in buffer.parameter_groups if group.is_expert_param for p in group.params}
        for p in chunk.parameters():
            if id(getattr(p, "orig_param", None)) in sharded_as_experts:
                p.allreduce = False


def tag_qkv(model_chunks) -> None:
    """Mark fused QKV weights the way upstream's emerging-optimizer path does (by module, since
    Megatron's layers set no QKV attribute themselves), and with ``qkv_heads`` (query groups on
    this TP rank, query heads per group, head dim) from the attention module's own per-partition
    counts, i.e. after TP sharding, and ``qkv_groups`` (the model's query groups: with fewer than
    TP ranks a rank's shard is a 1/TP row slice of the whole weight, not its reported group); and
    an MLA attention's up-projections with ``mla_heads`` (``mla_heads_of``): both for
    ``--muon-split-qkv-per-head`` (``param_marks.per_head_split`` checks them against the local shard)."""
    for chunk in model_chunks:
        cfg = chunk.config
        q = cfg.num_attention_heads // cfg.num_query_groups * cfg.kv_channels
        for module in chunk.modules():
            linear_qkv = getattr(module, "linear_qkv", None)
            weight = getattr(linear_qkv, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
                weight.is_qkv = True
                weight.qkv_split_shapes = [q, cfg.kv_channels, cfg.kv_channels]
                weight.qkv_groups = int(cfg.num_query_groups)
                heads = qkv_heads_of(module)
                if heads is not None:
                    weight.qkv_heads = heads
            for projection, heads in mla_heads_of(module).items():
                weight = getattr(getattr(module, projection, None), "weight", None)
                if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
                    weight.mla_heads = heads


def qkv_heads_of(attention) -> tuple[int, int, int] | None:
    """(query groups, query heads per group, head dim) on this TP rank of a megatron-core
    attention module (its ``num_query_groups_per_partition``, ``num_attention_heads_per_partition``,
    ``hidden_size_per_attention_head``: counted after TP sharding); None if it has none of them."""
    groups = getattr(attention, "num_query_groups_per_partition", None)
    heads = getattr(attention, "num_attention_heads_per_partition", None)
    head_dim = getattr(attention, "hidden_size_per_attention_head", None)
    if groups is None or heads is None or head_dim is None or not groups or heads % groups:
        return None
    return int(groups), int(heads) // int(groups), int(head_dim)


def mla_heads_of(attention) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per up-projection of a megatron-core MLA attention module (one with a
    ``linear_kv_up_proj``), (heads on this TP rank, one head's row blocks): the head count is the
    module's ``num_attention_heads_per_partition`` (counted after TP sharding), the widths its
    config's ``qk_head_dim``, ``qk_pos_emb_head_dim`` and ``v_head_dim`` (which TP does not cut).
    The q projection (``linear_q_proj``, or ``linear_q_up_proj`` with a q LoRA rank) holds per head
    ``[nope; rope]`` query rows, one block; ``linear_kv_up_proj`` per head ``[k nope; v]``, two
    blocks (docs/per_head.md). {} for any other module."""
    heads = getattr(attention, "num_attention_heads_per_partition", None)
    if not isinstance(attention, torch.nn.Module) or not hasattr(attention, "linear_kv_up_proj") or not heads:
        return {}
    cfg = attention.config
    nope, rope, v = int(cfg.qk_head_dim), int(cfg.qk_pos_emb_head_dim), int(cfg.v_head_dim)
    q_proj = "linear_q_proj" if cfg.q_lora_rank is None else "linear_q_up_proj"
    return {q_proj: (int(heads), (nope + rope,)), "linear_kv_up_proj": (int(heads), (nope, v))}


def tag_grouped_experts(model_chunks) -> None:
    """``TEGroupedMLP`` (``--moe-grouped-gemm``): its fc1 ``weight0 .. weight{E-1}`` are one expert's
    ``[gate; up]`` each (per TP rank ``[gate_r; up_r]``, as a dense fc1), but Megatron marks them
    ``partition_stride`` 1; tag them ``gated_fc1`` so ``layout_of`` splits them
    (``core/expert_layout.py``). TE's single grouped weight (every expert in one tensor) is refused."""
    for chunk in model_chunks:
        gated = getattr(chunk.config, "gated_linear_unit", False)
        for name, module in chunk.named_modules():
            if getattr(module, "num_gemms", None) is None:  # TE GroupedLinear only
                continue
            if getattr(module, "single_grouped_weight", False):
                raise ValueError(
                    f"moe_single_grouped_weight ({name}): every local expert in one tensor is not supported with "
                    "Muon (each expert must be orthogonalized on its own); set it False for per-expert weights")
            if gated and name.endswith("linear_fc1"):
                for pname, param in module.named_parameters(recurse=False):
                    if pname.startswith("weight"):
                        param.gated_fc1 = True


def layout_of(name: str, param: torch.nn.Parameter, tp_size: int, muon_config: MuonConfig,
              dp_ranges=None, local_shape: tuple[int, int] | None = None) -> MatrixLayout:
    """The layout of one Muon matrix (``plan.param_marks.matrix_layout`` on the param's
    attributes). ``local_shape``: this TP rank's shape of the weight when ``param.shape`` is not
    it (a Megatron-FSDP DTensor reports its global shape)."""
    rows, cols = local_shape if local_shape is not None else param.shape
    return matrix_layout(name, (rows, cols), marks_of(param), tp_size, row_splits(muon_config), dp_ranges)


def marks_of(param: torch.nn.Parameter) -> ParamMarks:
    """The attributes megatron-core (and ``tag_qkv`` / ``tag_grouped_experts``) set on ``param``."""
    sizes = getattr(param, "partition_sizes", None)
    return ParamMarks(
        tensor_parallel=bool(getattr(param, "tensor_model_parallel", False)),
        partition_dim=getattr(param, "partition_dim", -1),
        qkv_split=tuple(param.qkv_split_shapes) if getattr(param, "is_qkv", False) else None,
        qkv_heads=tuple(param.qkv_heads) if getattr(param, "qkv_heads", None) is not None else None,
        qkv_groups=getattr(param, "qkv_groups", None),
        mla_heads=_mla_heads(getattr(param, "mla_heads", None)),
        gated=getattr(param, "partition_stride", 1) == 2 or getattr(param, "gated_fc1", False),
        partition_sizes=tuple(int(n) for n in sizes) if sizes is not None else None,
        embedding_or_output=getattr(param, "is_embedding_or_output_parameter", False),
    )


def _mla_heads(mark) -> tuple[int, tuple[int, ...]] | None:
    return None if mark is None else (int(mark[0]), tuple(int(b) for b in mark[1]))


def row_splits(muon_config: MuonConfig) -> RowSplits:
    """The fused weights ``muon_config`` splits (``--muon-split-qkv`` and its siblings)."""
    return RowSplits(qkv=muon_config.split_qkv, fc1=muon_config.split_fc1,
                     in_proj=muon_config.mamba_in_proj == "split", qkv_per_head=muon_config.split_qkv_per_head)


def param_names(model_chunks) -> dict[int, str]:
    """id(param) → ``chunk{c}.{name}``, the names the report and the errors use."""
    return {id(p): f"chunk{c}.{n}" for c, chunk in enumerate(model_chunks) for n, p in chunk.named_parameters()}


def packed_in_backprop_order(buffer) -> bool:
    """True when every bucket holds its params back to back in backprop order, padding only at
    its end (megatron-core's own layout): what the ``dp_reshardable`` checkpoint format assumes."""
    for bucket in buffer.buckets:
        cursor = bucket.offset
        for param in bucket.params_list:  # the buffer lists a bucket's params in backprop order
            start, end, _ = buffer.param_index_map[param]
            if not 0 <= start - cursor < 64:  # megatron-core aligns starts to 64 elements
                return False
            cursor = end
    return True


def _tp_size(tp_group) -> int:
    return get_pg_size(tp_group) if tp_group is not None else 1


# ---- one describe per backend ----------------------------------------------------------------


def describe_zero1(optimizer: DistributedOptimizer, tp_group, muon_config: MuonConfig
                   ) -> tuple[MatrixCatalogue, MatrixOf]:
    """Megatron's ZeRO-1 ``DistributedOptimizer`` (built, so its main shards exist): every Muon
    matrix of its buffers, in buffer order (the same on every DP and TP rank), with every DP
    rank's range of it from Megatron's own range function."""
    dp_size = get_pg_size(optimizer.data_parallel_group)
    tp_size = _tp_size(tp_group)
    main_of = {}
    for model_groups, main_groups in (
        (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
        (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
    ):
        for models, mains in zip(model_groups, main_groups):
            main_of.update({id(m): s for m, s in zip(models, mains)})
    names = param_names(optimizer.model_chunks)
    layouts, params, matrix_of = [], [], {}
    for buffer in optimizer.buffers:  # same buffers, same order, on every DP (and TP) rank
        for bucket in buffer.buckets:
            per_rank = ranges_on_every_rank(buffer, bucket, dp_size)
            for param in bucket.params_list:
                if not is_muon_matrix(param):
                    continue
                ranges = tuple(per_rank[r].get(param, (0, 0)) for r in range(dp_size))
                layouts.append(layout_of(names.get(id(param), "param"), param, tp_size, muon_config, ranges))
                params.append(main_of.get(id(param)))
                matrix_of[id(param)] = (layouts[-1], params[-1])
    return MatrixCatalogue(tuple(layouts), tuple(params), optimizer.data_parallel_group, tp_group), matrix_of


def ranges_on_every_rank(buffer, bucket, dp_size: int) -> list[dict]:
    """For each DP rank, param → [start, end) of the param it holds in this bucket."""
    size = bucket.grad_data.numel() // dp_size
    out = []
    for r in range(dp_size):
        start = bucket.offset + r * size
        rng = Range(start, min(bucket.offset + bucket.grad_data.numel(), start + size))
        params = {p: buffer.param_index_map[p] for p in bucket.params_list}
        mapping = DistributedOptimizer._build_model_gbuf_param_range_map(params, rng, bucket.offset)
        out.append({p: (m["param"].start, m["param"].end) for p, m in mapping.items()})
    return out


def describe_megatron_fsdp(optimizer, tp_group, muon_config: MuonConfig) -> tuple[MatrixCatalogue, MatrixOf]:
    """Megatron-FSDP's ``DistributedOptimizer`` (built): every Muon matrix of its parameter groups
    (the same buckets, same order, on every DP rank), each DP rank's range of it by Megatron-FSDP's
    own shard arithmetic (no ranges under ``no_shard``: whole matrices everywhere)."""
    tp_size = _tp_size(tp_group)
    muon_params = {id(p) for g in optimizer.optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    layouts, params, matrix_of, dp_group = [], [], {}, None
    for c, chunk in enumerate(optimizer.model_chunks):
        buffers = chunk.param_and_grad_buffer
        dist_param_of = {id(p.orig_param): (name, p) for name, p in chunk.named_parameters()
                         if hasattr(p, "orig_param")}
        for group in buffers.parameter_groups:
            buffer = optimizer_buffer(group)
            for item_id, orig in enumerate(group.params):
                name, param = dist_param_of[id(orig)]
                if id(param) not in muon_params:
                    continue
                item = buffer.item_index_map[item_id]
                # The DP group under every strategy, no_shard included: None would make the
                # inner step plan and exchange over the default (world) group, TP peers too
                # (found by scripts/dry_run.py --fsdp no_shard at TP8: owners up to 63 for 8 DP ranks).
                if dp_group is None:
                    dp_group = buffer.data_parallel_group
                elif dp_group is not buffer.data_parallel_group:
                    raise ValueError(f"--use-megatron-fsdp: {name} is sharded over another DP group than "
                                     "the other Muon matrices (hybrid FSDP is not supported with Muon)")
                ranges = None
                if buffers.bucketing_policy.data_parallel_sharding_strategy != "no_shard":
                    ranges = fsdp_item_ranges(buffer.bucket_index.global_data_index, buffer.bucket_index.size,
                                              item.global_data_index, item.size, buffer.dp_world_size)
                    check_own_range(buffer, item_id, ranges[buffer.dp_rank], name)
                layouts.append(layout_of(f"chunk{c}.{name}", param, tp_size, muon_config, ranges, tuple(item.shape)))
                params.append(param)
                matrix_of[id(param)] = (layouts[-1], param)
    return MatrixCatalogue(tuple(layouts), tuple(params), dp_group, tp_group), matrix_of


def describe_whole(model_chunks, dp_group, tp_group, muon_config: MuonConfig, *, expert: bool = False
                   ) -> tuple[MatrixCatalogue, MatrixOf]:
    """Without the distributed optimizer every DP rank holds every matrix whole (of the dense
    params, or of the expert-parallel ones), except under ``--use-torch-fsdp2``: there every
    matrix is a DTensor cut by rows over FSDP2's DP mesh (``torch_fsdp2.py``), described by each
    DP rank's range and exchanged over the mesh's group, which must hold the ranks of ``dp_group``
    (the expert-DP group for experts: ``fsdp2_mesh_refusal``). The tensor updated is the param's fp32
    ``main_param`` when Megatron's wrapper made one (bf16), else the param itself."""
    tp_size = _tp_size(tp_group)
    names = param_names(model_chunks)
    layouts, params, matrix_of = [], [], {}
    fsdp2_group = None
    for chunk in model_chunks:
        for _, p in chunk.named_parameters():
            if not (p.requires_grad and is_muon_matrix(p) and is_expert_parallel(p) == expert):
                continue
            main = getattr(p, "main_param", None)
            ranges = None
            if getattr(p, "is_torch_fsdp2_param", False):  # --use-torch-fsdp2: rows cut over DP
                ranges, group = torch_fsdp2_ranges(names[id(p)], p)
                if group is not fsdp2_group and (refusal := fsdp2_mesh_refusal(names[id(p)], group, dp_group, expert)):
                    raise ValueError(refusal)
                if fsdp2_group is not None and group is not fsdp2_group:
                    raise ValueError(f"--use-torch-fsdp2: {names[id(p)]} is sharded over another mesh than "
                                     "the other Muon matrices (HSDP is not supported with Muon)")
                fsdp2_group = group
            layouts.append(layout_of(names[id(p)], p, tp_size, muon_config, ranges))
            params.append(main if main is not None else p)
            matrix_of[id(p)] = (layouts[-1], params[-1])
    group = dp_group if fsdp2_group is None else fsdp2_group
    return MatrixCatalogue(tuple(layouts), tuple(params), group, tp_group), matrix_of
