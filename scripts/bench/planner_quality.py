"""Planner quality on Llama-3 8B / 70B / 405B: NS FLOPs per rank and owner-exchange bytes.

    python -m scripts.bench.planner_quality                  # Markdown tables to stdout
    python -m scripts.bench.planner_quality --json out.json  # and every number as JSON

Pure planning arithmetic: no process group, no tensor the size of a model (meta tensors only);
it runs in seconds. Parallelism: TP × DP with PP = 1 (every rank holds all layers), at
TP8 × DP8 (64 ranks) and TP8 × DP64 (512 ranks).

Rows of the FLOPs table (per (dp, tp) rank: the Newton–Schulz FLOPs it runs in one step):

* **ours (ZeRO-1)**: exactly what our code plans with ``--use-distributed-optimizer
  --muon-tp-mode owner``. Megatron's DDP buffer is laid out by megatron-core's own
  ``DistributedOptimizer.compute_full_param_layout`` (params in reverse model order, 64-element
  aligned starts, each bucket padded to a multiple of lcm(DP, 128); embedding, norms and output
  layer included, since they shift the cuts); each DP rank's flat range of every param comes
  from our ``MuonDistributedOptimizer._ranges_on_every_rank`` (Megatron's own range function);
  the ``MatrixLayout`` of each matrix from our ``megatron.catalogue.layout_of`` (QKV split per
  query group, fc1 split into gate / up). Then our ``plan_dp_owners`` gives each matrix its DP
  owner; each DP owner's TP group plans all the sub-matrices it owns at once with
  ``plan_owners`` on ``ns_flops`` of the full sub-matrix shape (the whole list
  ``orthogonalize_updates`` plans before running it micro-group by micro-group). The replay is
  the optimizer's own step plan (``plan.step_plan``), which
  ``scripts/dry_run.py`` checks against the real step to the byte. (Until 2026-11-29 the TP plan was made per
  256 MiB round, from zero load each time, which put the largest sub-matrix of every round on
  TP rank 0: max/mean 3.7–8.5. This table found it.)
* **ours (DDP, dp-mode owner)** and **ours (DDP, dp-mode redundant = TP owner only)**: context,
  without the distributed optimizer (every DP rank holds whole matrices).
* **Megatron layer-wise + duplicated**: megatron-core's ``LayerWiseDistributedOptimizer``
  assignment (``compute_full_param_layout`` on the TP-local shapes: what each TP rank passes)
  over the DP group; then ``TensorParallelMuon`` with ``tp_mode="duplicated"``: every TP rank
  all-gathers and runs NS on the full matrix. It splits QKV per query group
  (``muon_split_qkv`` defaults to True) but not fc1 (it has no fc1 split), so its units are
  Q, K, V, proj, fc1 (2·ffn × hidden, unsplit), fc2.
* **Megatron layer-wise + blockwise**: reference only (not exact Muon): NS on each TP-local
  block (QKV split per local query group).

Bucket size: DDP's default rule, ``max(40M, 1M·DP)`` elements (``DistributedDataParallel``
with ``--overlap-grad-reduce``; without it Megatron uses one bucket: ``--bucket-size 0``), so
40M at DP8 and 64M at DP64, for both ours and Megatron's layer-wise layout.

Bytes: in bf16 (2 bytes per element, the default ``ns_dtype``), sent by each rank per step
(``comm.py``'s convention: what leaves a rank; a rank's piece for itself is not counted).
DP exchange: each piece of ``dp_owned_matrix(layout, owner, DP)`` not on its owner goes there and
its result comes back. TP exchange: ``owner_mode.tp_owned_matrix`` per sub-matrix: t−1 shards
to the owner and t−1 back. Analytic minimum (per rank = total / ranks): TP: every sharded
sub-matrix of S elements must move 2·(t−1)/t·S; DP: every matrix cut across DP ranges must move
all but its largest piece, there and back.

Lower bound on the busiest rank's FLOPs, for any planner that keeps each unit (sub-matrix)
whole: max(total / min(#units, ranks), largest unit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        is_managed_by_layer_wise_optimizer,
    )
    from megatron.core.optimizer.param_layout import FullParamLayout

    from megatron_muon.config import MuonConfig
    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.core.models import LLAMA3
    from megatron_muon.core.newton_schulz import ns_flops
    from megatron_muon.megatron.catalogue import is_muon_matrix, layout_of, ranges_on_every_rank
    from megatron_muon.megatron.layout import balanced_buffer_layouts
    from megatron_muon.plan.owners import plan_dp_owners
    from megatron_muon.plan.step_plan import build_step_plan

MODELS = ("8B", "70B", "405B")
CONFIGS = ((8, 8), (8, 64))  # (TP, DP); PP = 1
STEPS = 5  # Newton–Schulz iterations (--muon-num-ns-steps default)
NS_BYTES = 2  # bf16, the default ns_dtype: the owner exchanges move bf16
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by




def default_bucket_size(dp: int) -> int:
    """``DistributedDataParallel``'s default bucket size (elements) with overlap_grad_reduce."""
    return max(40_000_000, 1_000_000 * dp)


# ---------------------------------------------------------------------------------------------
# The model, as meta parameters with Megatron's attributes


@dataclass
class MatrixSpec:
    """One hidden weight of a toy or real model (full shape, Megatron layout)."""

    name: str
    rows: int
    cols: int
    partition_dim: int
    qkv_split: tuple[int, int, int] | None = None  # (q, k, v) rows per query group
    gated: bool = False  # SwiGLU fc1: [gate; up] on every TP rank (partition_stride 2)


@dataclass
class ModelSpec:
    """A GPT in Megatron's registration order (``named_parameters``): embedding, layers (norm,
    proj, qkv, norm, fc1, fc2), final norm, output layer. ``vocab`` 0 and ``hidden`` 0 leave out
    the non-matrix params."""

    name: str
    matrices: list[MatrixSpec]
    layers: int
    hidden: int = 0
    vocab: int = 0
    per_layer: int = 4
    extra: dict = field(default_factory=dict)


def llama3_spec(model: str) -> ModelSpec:
    """Llama-3 ``model`` from ``core.models`` (QKV fused per Megatron, fc1 gated)."""
    shape = LLAMA3[model]
    # per query group: its query heads, one k head, one v head (as megatron.catalogue.tag_qkv)
    qkv = (shape.num_heads // shape.num_query_groups * shape.head_dim, shape.head_dim, shape.head_dim)
    mats = []
    # Megatron registers a layer's linear_proj before its linear_qkv (SelfAttention builds
    # linear_qkv after Attention's __init__), and its buffers follow named_parameters(): emit them
    # in that order, or the emulated DP ranges cut other matrices than the real ones do.
    registration = {"linear_proj": 0, "linear_qkv": 1, "linear_fc1": 2, "linear_fc2": 3}
    ordered = sorted(shape.matrices(), key=lambda m: (int(m[0].split(".")[1]), registration[m[0].rsplit(".", 1)[1]]))
    for name, rows, cols, pdim in ordered:
        kind = name.rsplit(".", 1)[1]
        mats.append(MatrixSpec(name, rows, cols, pdim, qkv if kind == "linear_qkv" else None,
                               kind == "linear_fc1"))
    return ModelSpec(model, mats, shape.num_layers, shape.hidden, shape.vocab)


def _meta(shape, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(*shape, dtype=torch.bfloat16, device="meta"))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _local(m: MatrixSpec, tp: int) -> tuple[int, int]:
    if (m.rows, m.cols)[m.partition_dim] % tp:
        raise ValueError(f"{m.name}: dim {m.partition_dim} of {(m.rows, m.cols)} not divisible by TP {tp}")
    return (m.rows // tp, m.cols) if m.partition_dim == 0 else (m.rows, m.cols // tp)


def _matrix_param(m: MatrixSpec, tp: int) -> torch.nn.Parameter:
    attrs = dict(tensor_model_parallel=tp > 1, partition_dim=m.partition_dim,
                 partition_stride=2 if m.gated else 1)
    if m.qkv_split is not None:
        attrs.update(is_qkv=True, qkv_split_shapes=list(m.qkv_split))
    return _meta(_local(m, tp), **attrs)


def model_params(spec: ModelSpec, tp: int, *, with_non_matrix: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """Every trainable param of one TP rank, in model-definition order (``named_parameters``)."""
    out: list[tuple[str, torch.nn.Parameter]] = []
    non_matrix = with_non_matrix and spec.hidden > 0
    vocab = 0
    if non_matrix and spec.vocab:
        multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp  # Megatron's _vocab_size_with_padding
        vocab = math.ceil(spec.vocab / multiple) * multiple
        out.append(("embedding.word_embeddings.weight",
                    _meta((vocab // tp, spec.hidden), tensor_model_parallel=tp > 1, partition_dim=0,
                          is_embedding_or_output_parameter=True)))
    for k, m in enumerate(spec.matrices):
        if non_matrix and k % spec.per_layer in (0, 2):  # input_layernorm / pre_mlp_layernorm
            layer = k // spec.per_layer
            norm = "input_layernorm" if k % spec.per_layer == 0 else "pre_mlp_layernorm"
            out.append((f"layers.{layer}.{norm}.weight", _meta((spec.hidden,))))
        out.append((f"{m.name}.weight", _matrix_param(m, tp)))
    if non_matrix:
        out.append(("final_layernorm.weight", _meta((spec.hidden,))))
        if vocab:
            out.append(("output_layer.weight",
                        _meta((vocab // tp, spec.hidden), tensor_model_parallel=tp > 1, partition_dim=0,
                              is_embedding_or_output_parameter=True)))
    return out


def _ddp_config() -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)


# ---------------------------------------------------------------------------------------------
# Ours


def full_layout(named, bucket_size: int | None, dp: int, tp: int, dp_layout: str,
                  muon_config: MuonConfig | None = None) -> FullParamLayout:
    """The DDP buffer layout: megatron-core's (``megatron``), ours (``balanced``,
    ``megatron.layout.balanced_buffer_layouts``) or megatron-core's layer-wise one (``layer-wise``:
    the matrices upstream's layer-wise optimizer manages in a shard-aligned buffer, the rest in a
    DistributedOptimizer buffer beside it)."""
    params = [p for _, p in named]
    if dp_layout == "megatron":
        return DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, _ddp_config())
    if dp_layout == "balanced":
        muon_config = muon_config or MuonConfig(tp_mode="owner")
        laid = balanced_buffer_layouts(named, bucket_size, dp, _ddp_config(), muon_config=muon_config, tp_size=tp)
        return FullParamLayout(layouts={key: full for key, (_, full) in laid.items()})
    if dp_layout == "layer-wise":
        for p in params:
            p.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(p)
        try:
            return LayerWiseDistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, _ddp_config())
        finally:
            for p in params:
                del p.is_managed_by_layer_wise_optimizer
    raise ValueError(dp_layout)


def ours_layouts(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None, *,
                 distributed_optimizer: bool = True, with_non_matrix: bool = True,
                 muon_config: MuonConfig | None = None, dp_layout: str = "megatron") -> list[MatrixLayout]:
    """The ``MatrixLayout`` list our optimizer attaches, in its order.

    ZeRO-1: ``MuonDistributedOptimizer.__init__``: buffers → buckets → ``bucket.params_list``
    (reverse model order), ranges from ``_ranges_on_every_rank``, on the ``dp_layout`` buffer
    layout. DDP: ``catalogue.describe_whole``: model order, no ranges.
    """
    muon_config = muon_config or MuonConfig(tp_mode="owner")
    named = model_params(spec, tp, with_non_matrix=with_non_matrix)
    if not distributed_optimizer:
        return [layout_of(n, p, tp, muon_config) for n, p in named if is_muon_matrix(p)]
    names = {id(p): n for n, p in named}
    params = [p for _, p in named]
    full = full_layout(named, bucket_size, dp, tp, dp_layout, muon_config)
    layouts = []
    for buffer_layout in full.layouts.values():
        buffer = types.SimpleNamespace(param_index_map=buffer_layout.param_index_map)
        in_bucket: dict[int, list] = {}
        for p in params[::-1]:  # _ParamAndGradBuffer adds params to buckets in backprop order
            if p in buffer_layout.param_index_map:
                in_bucket.setdefault(buffer_layout.param_index_map[p][2], []).append(p)
        for bucket_id, (start, end) in enumerate(buffer_layout.bucket_indices):
            bucket = types.SimpleNamespace(
                offset=start, grad_data=torch.empty(end - start, device="meta"),
                params_list=in_bucket.get(bucket_id, []))
            # Our own range code, with Megatron's range function (a classmethod) behind it.
            per_rank = ranges_on_every_rank(buffer, bucket, dp)
            for p in bucket.params_list:
                if is_muon_matrix(p):
                    ranges = tuple(per_rank[r].get(p, (0, 0)) for r in range(dp))
                    layouts.append(layout_of(names[id(p)], p, tp, muon_config, ranges))
    return layouts


def fsdp_layouts(spec: ModelSpec, tp: int, dp: int, strategy: str = "optim_grads_params") -> list[MatrixLayout]:
    """The ``MatrixLayout`` list ``MuonFSDPOptimizer`` attaches under Megatron-FSDP, from
    Megatron-FSDP's own functions on meta params: ``_get_parameter_groups`` (one bucket per
    transformer layer, its FSDP unit; the rest in 40M-element buckets; each split by row size)
    and ``build_data_parallel_buffer_index`` (the flat layout of a bucket, cut into DP equal
    shards), then ``fsdp_item_ranges`` for every DP rank, as the optimizer computes them."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        BucketingPolicy,
        _get_parameter_groups,
        build_data_parallel_buffer_index,
    )

    from megatron_muon.megatron.megatron_fsdp import fsdp_item_ranges

    class Layer(torch.nn.Module):  # a TransformerLayer: Megatron-FSDP's unit under optim_grads_params
        pass

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    names = {}
    for name, param in model_params(spec, tp):
        owner = root
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            while len(root.layers) <= index:
                root.layers.append(Layer())
            owner = root.layers[index]
        owner.register_parameter(name.replace(".", "_"), param)
        names[id(param)] = name
    policy = BucketingPolicy(suggested_bucket_size=40_000_000, fsdp_unit_modules=[Layer],
                             data_parallel_sharding_strategy=strategy)
    groups = _get_parameter_groups(root, policy, {})[0]
    config = types.SimpleNamespace(data_parallel_sharding_strategy=strategy)
    muon_config = MuonConfig(tp_mode="owner")
    layouts = []
    for bucket_id, group in enumerate(groups):
        items, bucket, _ = build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, dp, True, config, bucket_id=bucket_id,
            chunk_size_factor=group.chunk_size_factor)
        for item_id, param in enumerate(group.params):
            if is_muon_matrix(param):
                item = items[item_id]
                ranges = fsdp_item_ranges(bucket.global_data_index, bucket.size, item.global_data_index, item.size, dp)
                layouts.append(layout_of(names[id(param)], param, tp, muon_config, ranges))
    return layouts


@dataclass
class Plan:
    """Per rank (index dp·TP + tp) NS FLOPs and bytes sent, plus the units planned."""

    flops: list[float]
    dp_bytes: list[int]
    tp_bytes: list[int]
    unit_costs: list[int]  # NS FLOPs of every unit of work (sub-matrix), once each
    total: int  # NS FLOPs summed over all ranks
    dp_min_total: int = 0  # analytic minimum bytes, summed over all ranks
    tp_min_total: int = 0


def plan_ours(layouts: list[MatrixLayout], tp: int, dp: int, *, dp_mode: str = "owner") -> Plan:
    """NS FLOPs and bytes per rank of a step in ``tp_mode="owner"``: the optimizer's own step plan
    (``plan.step_plan``, which the step executes and the dry run checks against it), plus the units
    of work and the analytic byte minimums for the table."""
    settings = MuonConfig(tp_mode="owner", dp_mode=dp_mode, num_ns_steps=STEPS).plan_settings()
    step = build_step_plan(layouts, dp_size=dp, tp_size=tp, settings=settings)
    owners = step.dp_owners
    replicas = dp if owners is None else 1  # redundant: every DP replica runs the same TP call
    units: list[int] = []
    dp_min = tp_min = 0
    for layout in layouts:
        for local, full in zip(layout.sub_local_shapes(), layout.sub_global_shapes()):
            units.append(ns_flops(*full, STEPS))
            if layout.partition_dim is not None and tp > 1:
                tp_min += replicas * 2 * (tp - 1) * local[0] * local[1] * NS_BYTES
    for unit in step.units if owners is not None else ():  # the DP exchange moves units (fc1: gate, up)
        holders = unit.layout.holders(dp)
        if unit.layout.dp_ranges is not None and len(holders) > 1:
            dp_min += tp * 2 * (unit.layout.numel - max(holders.values())) * NS_BYTES
        elif unit.layout.dp_ranges is None:  # DDP: the result must leave its owner once (a broadcast)
            dp_min += tp * unit.layout.numel * NS_BYTES
    total = sum(units) * replicas
    return Plan(list(step.ns_flops), list(step.dp_bytes), list(step.tp_bytes), units, total, dp_min, tp_min)


# ---------------------------------------------------------------------------------------------
# Megatron: LayerWiseDistributedOptimizer + TensorParallelMuon


def megatron_dp_assignment(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None) -> list[int]:
    """DP rank of every hidden matrix (model order) under the layer-wise layout, computed on
    the TP-local shapes (the Muon params sit in their own layer-wise buffer)."""
    params = [_matrix_param(m, tp) for m in spec.matrices]
    for p in params:
        p.is_managed_by_layer_wise_optimizer = True
    full = LayerWiseDistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, _ddp_config())
    (buffer_layout,) = full.layouts.values()
    out = []
    for p in params:
        start, end, bucket_id = buffer_layout.param_index_map[p]
        bucket_start, bucket_end = buffer_layout.bucket_indices[bucket_id]
        shard = (bucket_end - bucket_start) // dp
        rank = (start - bucket_start) // shard
        if (end - 1 - bucket_start) // shard != rank:
            raise AssertionError(f"{p}: a layer-wise param straddles two DP shards")
        out.append(rank)
    return out


def plan_megatron(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None, mode: str) -> Plan:
    """NS FLOPs per rank of TensorParallelMuon (``duplicated`` or ``blockwise``) on the
    layer-wise assignment. Its splits: QKV per query group, fc1 not split."""
    cfg = MuonConfig(split_qkv=True, split_fc1=False)
    dp_of = megatron_dp_assignment(spec, tp, dp, bucket_size)
    flops = [0.0] * (tp * dp)
    units = []
    for m, d in zip(spec.matrices, dp_of):
        layout = layout_of(m.name, _matrix_param(m, tp), tp, cfg)
        if mode == "duplicated":  # every TP rank: NS of the full (sub-)matrices
            per_rank = [layout.ns_cost(STEPS)] * tp
            units += [ns_flops(r, c, STEPS) for r, c in layout.sub_global_shapes()]
        elif mode == "blockwise":  # every TP rank: NS of its local block
            per_rank = [sum(ns_flops(r, c, STEPS) for r, c in layout.sub_local_shapes())] * tp
            units += [ns_flops(r, c, STEPS) for r, c in layout.sub_local_shapes()] * tp
        else:
            raise ValueError(mode)
        for j in range(tp):
            flops[d * tp + j] += per_rank[j]
    return Plan(flops, [0] * (tp * dp), [0] * (tp * dp), units, int(sum(flops)))


# ---------------------------------------------------------------------------------------------
# Summaries and tables


def flops_summary(plan: Plan, ranks: int, *, replicas: int = 1) -> dict:
    """max, mean, max/mean and the lower bound of the busiest rank.

    ``replicas``: how many ranks run each unit (Megatron duplicated: TP), so the units spread
    over ranks / replicas slots.
    """
    mean = sum(plan.flops) / ranks
    mx = max(plan.flops)
    slots = ranks // replicas
    work = plan.total / replicas
    lb = max(work / min(len(plan.unit_costs), slots), max(plan.unit_costs))
    return dict(max=mx, mean=mean, max_over_mean=mx / mean, lower_bound=lb, max_over_lb=mx / lb,
                units=len(plan.unit_costs), total=plan.total,
                lb_max_over_mean=lb / mean)


def bytes_summary(plan: Plan, ranks: int) -> dict:
    tot = [a + b for a, b in zip(plan.dp_bytes, plan.tp_bytes)]
    return dict(
        dp_max=max(plan.dp_bytes), dp_mean=sum(plan.dp_bytes) / ranks, dp_min_mean=plan.dp_min_total / ranks,
        tp_max=max(plan.tp_bytes), tp_mean=sum(plan.tp_bytes) / ranks, tp_min_mean=plan.tp_min_total / ranks,
        max=max(tot), mean=sum(tot) / ranks, min_mean=(plan.dp_min_total + plan.tp_min_total) / ranks,
    )


def evaluate(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None, *, with_non_matrix: bool = True) -> dict:
    """Every row for one model at TP × DP."""
    ranks = tp * dp
    out: dict = dict(model=spec.name, tp=tp, dp=dp, ranks=ranks, bucket_size=bucket_size)
    zero1 = ours_layouts(spec, tp, dp, bucket_size, with_non_matrix=with_non_matrix)
    ddp = ours_layouts(spec, tp, dp, bucket_size, distributed_optimizer=False)
    fsdp = fsdp_layouts(spec, tp, dp) if with_non_matrix else []
    plans = {
        "ours (ZeRO-1)": (plan_ours(zero1, tp, dp), 1),
        **({"ours (Megatron-FSDP)": (plan_ours(fsdp, tp, dp), 1)} if fsdp else {}),
        "ours (DDP, dp-mode owner)": (plan_ours(ddp, tp, dp), 1),
        "ours (DDP, TP owner only)": (plan_ours(ddp, tp, dp, dp_mode="redundant"), dp),
        "Megatron layer-wise + duplicated": (plan_megatron(spec, tp, dp, bucket_size, "duplicated"), tp),
        "Megatron layer-wise + blockwise (inexact)": (plan_megatron(spec, tp, dp, bucket_size, "blockwise"), 1),
    }
    out["flops"] = {name: flops_summary(p, ranks, replicas=rep) for name, (p, rep) in plans.items()}
    out["bytes"] = {name: bytes_summary(p, ranks) for name, (p, _) in plans.items() if name.startswith("ours (")
                    and "TP owner only" not in name}
    ours = plans["ours (ZeRO-1)"][0]
    per_dp = [sum(ours.flops[d * tp:(d + 1) * tp]) for d in range(dp)]
    busiest = max(range(ranks), key=lambda r: ours.flops[r])
    out["diagnostics"] = dict(
        dp_level_max_over_mean=max(per_dp) / (sum(per_dp) / dp),  # the DP plan alone
        busiest_rank=dict(dp=busiest // tp, tp=busiest % tp),
        tp_rank0_share=sum(ours.flops[d * tp] for d in range(dp)) / sum(ours.flops),
    )
    out["cut_matrices"] = sum(1 for lay in zero1 if len(lay.holders(dp)) > 1)
    out["cut_matrices_fsdp"] = sum(1 for lay in fsdp if len(lay.holders(dp)) > 1)
    out["layouts"] = layout_rows(spec, tp, dp, bucket_size) if with_non_matrix else {}
    out["matrices"] = len(zero1)
    out["plans"] = plans
    return out


LAYOUTS = ("megatron", "balanced", "layer-wise")
LAYOUT_NAMES = {"megatron": "megatron-core default (--muon-dp-layout megatron)",
                "balanced": "ours balanced (--muon-dp-layout balanced)",
                "layer-wise": "megatron-core layer-wise"}


def layout_rows(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None) -> dict:
    """Per buffer layout, on one TP rank's params: padding, reduce-scatter + all-gather bytes,
    NS FLOPs max/mean over the DP ranks holding the matrices, matrices cut, DP exchange bytes.

    NS FLOPs per matrix: ours (``MatrixLayout.ns_cost``: fc1 split into gate/up, QKV per query
    group) for every layout, so the balance compares the assignments, not TP modes. DP rank of a
    matrix: ours' DP owner (``plan_dp_owners``) on the ``megatron`` and ``balanced`` layouts; the
    shard holding it on the layer-wise layout (upstream's optimizer updates it there).
    """
    named = model_params(spec, tp)
    out = {}
    for name in LAYOUTS:
        full = full_layout(named, bucket_size, dp, tp, name)
        numel = sum(lay.bucket_indices[-1][1] for lay in full.layouts.values())
        unpadded = sum(p.numel() for lay in full.layouts.values() for p in lay.param_index_map)  # params only
        # Megatron's reduce-scatter of the grads and all-gather of the params, both in bf16:
        # each rank sends (DP − 1)/DP of every bucket in each.
        rs_ag = 2 * (dp - 1) / dp * numel * NS_BYTES
        row = dict(padding=1 - unpadded / numel, buffer_numel=numel, rs_ag_bytes=rs_ag)
        if name == "layer-wise":
            dp_of = megatron_dp_assignment(spec, tp, dp, bucket_size)
            costs = [layout_of(m.name, _matrix_param(m, tp), tp, MuonConfig()).ns_cost(STEPS) for m in spec.matrices]
            row.update(cut=0, dp_bytes_max=0, dp_bytes_mean=0.0)
        else:
            layouts = ours_layouts(spec, tp, dp, bucket_size, dp_layout=name)
            dp_of = plan_dp_owners(layouts, dp, STEPS)
            costs = [lay.ns_cost(STEPS) for lay in layouts]
            plan = plan_ours(layouts, tp, dp)
            row.update(cut=sum(1 for lay in layouts if len(lay.holders(dp)) > 1),
                       dp_bytes_max=max(plan.dp_bytes), dp_bytes_mean=sum(plan.dp_bytes) / (tp * dp),
                       ns_all_ranks=flops_summary(plan, tp * dp))
        loads = [0.0] * dp
        for c, d in zip(costs, dp_of):
            loads[d] += c
        row["dp_ns_max_over_mean"] = max(loads) / (sum(loads) / dp)
        out[name] = row
    base = out["megatron"]["rs_ag_bytes"]
    for row in out.values():
        row["rs_ag_vs_megatron"] = row["rs_ag_bytes"] / base
    return out


ALPHAS = (0.0, 0.1, 0.25, 0.5, 1.0)


def alpha_sweep(spec: ModelSpec, tp: int, dp: int, bucket_size: int | None, alphas=ALPHAS) -> list[dict]:
    """The balanced layout at each α: padding, NS max/mean over DP owners and over all ranks."""
    rows = []
    for alpha in alphas:
        cfg = MuonConfig(tp_mode="owner", layout_alpha=alpha)
        named = model_params(spec, tp)
        full = full_layout(named, bucket_size, dp, tp, "balanced", cfg)
        numel = sum(lay.bucket_indices[-1][1] for lay in full.layouts.values())
        unpadded = sum(p.numel() for lay in full.layouts.values() for p in lay.param_index_map)  # params only
        layouts = ours_layouts(spec, tp, dp, bucket_size, dp_layout="balanced", muon_config=cfg)
        owners = plan_dp_owners(layouts, dp, STEPS)
        loads = [0.0] * dp
        for lay, d in zip(layouts, owners):
            loads[d] += lay.ns_cost(STEPS)
        plan = plan_ours(layouts, tp, dp)
        rows.append(dict(model=spec.name, tp=tp, dp=dp, alpha=alpha, padding=1 - unpadded / numel,
                         dp_ns_max_over_mean=max(loads) / (sum(loads) / dp),
                         ns_max_over_mean=flops_summary(plan, tp * dp)["max_over_mean"]))
    return rows


def alpha_markdown(rows: list[dict]) -> str:
    out = ["| model | TP×DP | α | padding | NS max/mean over DP | NS max/mean over all ranks (owner) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['tp']}×{r['dp']} | {r['alpha']} | {100 * r['padding']:.2f}% | "
                   f"{r['dp_ns_max_over_mean']:.3f} | {r['ns_max_over_mean']:.3f} |")
    return "\n".join(out)


def _tf(x: float) -> str:
    return f"{x / 1e12:.3f}"


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def verdicts(results: list[dict]) -> list[str]:
    """Where ours (ZeRO-1) is worse than Megatron layer-wise + duplicated, and why, from the numbers."""
    lines = []
    for r in results:
        o, m = r["flops"]["ours (ZeRO-1)"], r["flops"]["Megatron layer-wise + duplicated"]
        where = f"{r['model']} TP{r['tp']}×DP{r['dp']}"
        if o["max"] > m["max"]:
            lines.append(f"- **{where}: our busiest rank runs more NS FLOPs than Megatron's** "
                         f"({_tf(o['max'])} vs {_tf(m['max'])} TFLOP).")
        if o["max_over_mean"] <= m["max_over_mean"]:
            continue
        largest = max(r["plans"]["ours (ZeRO-1)"][0].unit_costs)
        if o["max_over_lb"] <= 1 + 1e-9 and o["units"] >= r["ranks"]:
            reason = (f"it is at the lower bound: the largest sub-matrix ({_tf(largest)} TFLOP) exceeds the "
                      f"mean per rank, so no planner that keeps sub-matrices whole can do better")
        elif o["units"] < r["ranks"]:
            reason = (f"{o['units']} sub-matrices for {r['ranks']} ranks: no whole-sub-matrix planner can go "
                      f"below {o['lb_max_over_mean']:.3f}" + (" and ours is there" if o["max_over_lb"] <= 1 + 1e-9
                                                              else f"; ours is {o['max_over_lb']:.3f}× the bound"))
        else:
            reason = (f"two-level granularity: a matrix's DP owner is fixed (by NS cost, with the matrices "
                      f"wholly inside one DP range pinned there) before its sub-matrices are placed on that "
                      f"owner's {r['tp']} TP ranks (about {o['units'] / r['dp']:.0f} sub-matrices per TP "
                      f"group, largest {_tf(largest)} TFLOP against a mean of {_tf(o['mean'])})")
        lines.append(f"- {where}: our max/mean {o['max_over_mean']:.3f} is above Megatron's "
                     f"{m['max_over_mean']:.3f} ({o['max_over_lb']:.3f}× the lower bound): {reason}. "
                     f"Megatron's max/mean is over ranks that all repeat the same {r['tp']}× duplicated work, "
                     f"so it only measures its DP split; its busiest rank runs {m['max'] / o['max']:.2f}× "
                     f"our busiest rank's FLOPs.")
    if not lines:
        lines.append("- Nowhere: ours' busiest rank and max/mean are at or below Megatron's in every configuration.")
    return lines


def _cut(result: dict, planner: str):
    if "ZeRO-1" in planner:
        return result["cut_matrices"]
    return result["cut_matrices_fsdp"] if "Megatron-FSDP" in planner else "-"


def markdown(results: list[dict]) -> str:
    out = []
    out.append("### NS FLOPs per rank, one optimizer step (PP = 1; 5 quintic steps; "
               "per rank = one (DP, TP) GPU)\n")
    out.append("| model | TP×DP | ranks | planner | max TFLOP | mean TFLOP | max/mean | lower bound TFLOP | "
               "max / bound | units |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, s in r["flops"].items():
            out.append(f"| {r['model']} | {r['tp']}×{r['dp']} | {r['ranks']} | {name} | {_tf(s['max'])} | "
                       f"{_tf(s['mean'])} | {s['max_over_mean']:.3f} | {_tf(s['lower_bound'])} | "
                       f"{s['max_over_lb']:.3f} | {s['units']} |")
    out.append("")
    out.append("units: the pieces of work a planner places whole (sub-matrices; Megatron: Q/K/V, proj, "
               "unsplit fc1, fc2; blockwise: local blocks). lower bound = max(total / min(units, slots), "
               "largest unit), slots = ranks (duplicated: ranks / TP, since each unit runs on all TP peers). "
               "Totals per step: ours counts fc1 as gate + up (2 NS of ffn × hidden, slightly more FLOPs "
               "than one NS of 2·ffn × hidden); Megatron duplicated's total is TP × its unit total.\n")
    out.append("### Owner-exchange bytes sent per rank, one step (bf16: 2 bytes/element)\n")
    out.append("| model | TP×DP | planner | DP max MiB | DP mean | DP min (mean) | TP max MiB | TP mean | "
               "TP min (mean) | total max MiB | total mean | total min (mean) | cut / matrices |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, b in r["bytes"].items():
            out.append(f"| {r['model']} | {r['tp']}×{r['dp']} | {name} | {_mb(b['dp_max'])} | {_mb(b['dp_mean'])} | "
                       f"{_mb(b['dp_min_mean'])} | {_mb(b['tp_max'])} | {_mb(b['tp_mean'])} | "
                       f"{_mb(b['tp_min_mean'])} | {_mb(b['max'])} | {_mb(b['mean'])} | {_mb(b['min_mean'])} | "
                       f"{_cut(r, name)} / {r['matrices']} |")
    out.append("")
    out.append("min (mean) = the analytic minimum total over all ranks divided by ranks (no plan can send "
               "less on average): TP, 2·(t−1)/t of every sharded sub-matrix; DP (ZeRO-1), twice all but "
               "the largest piece of every matrix cut across DP ranges; DP (DDP, dp-mode owner), the "
               "result to the DP−1 other replicas.\n")
    out.append("### DP buffer layouts (one TP rank's buffer; DDP bucket as above)\n")
    out.append("| model | TP×DP | layout | padding | RS+AG MiB per rank | vs megatron default | "
               "NS max/mean over DP | NS max/mean over all ranks (owner) | cut / matrices | DP exchange MiB max |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, row in r["layouts"].items():
            ns_all = f"{row['ns_all_ranks']['max_over_mean']:.3f}" if "ns_all_ranks" in row else "-"
            out.append(f"| {r['model']} | {r['tp']}×{r['dp']} | {LAYOUT_NAMES[name]} | {100 * row['padding']:.2f}% | "
                       f"{_mb(row['rs_ag_bytes'])} | {row['rs_ag_vs_megatron']:.4f} | "
                       f"{row['dp_ns_max_over_mean']:.3f} | {ns_all} | {row['cut']} / {r['matrices']} | "
                       f"{_mb(row['dp_bytes_max'])} |")
    out.append("")
    out.append("padding: buffer elements that hold no param (alignment included) over all elements; "
               "RS+AG: the distributed optimizer's grad reduce-scatter and param all-gather per step, "
               "bf16, (DP−1)/DP of the buffer each; NS max/mean over DP: Newton–Schulz FLOPs of the "
               "matrices each DP rank owns (ours' per-matrix costs for every layout); over all ranks: "
               "after our TP owner plan; DP exchange: bytes the busiest rank sends in the DP owner "
               "exchange. Layer-wise: upstream's shard-aligned buffer for the matrices (LPT on "
               "elements) plus a DistributedOptimizer buffer for the rest.\n")
    out.append("### Where ours is worse than Megatron\n")
    out.extend(verdicts(results))
    return "\n".join(out)


def run(models=MODELS, configs=CONFIGS, bucket_size: int | None = -1, with_non_matrix: bool = True) -> list[dict]:
    results = []
    for model in models:
        for tp, dp in configs:
            bs = default_bucket_size(dp) if bucket_size == -1 else bucket_size
            results.append(evaluate(llama3_spec(model), tp, dp, bs, with_non_matrix=with_non_matrix))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write every number to this file")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--bucket-size", type=int, default=-1,
                    help="DDP bucket size in elements (default: Megatron's max(40M, 1M·DP); 0: one bucket)")
    ap.add_argument("--alpha-sweep", action="store_true",
                    help=f"only the balanced layout at --muon-layout-alpha in {ALPHAS} (Markdown table)")
    ap.add_argument("--matrices-only", action="store_true",
                    help="leave embedding, norms and output layer out of our DDP buffer")
    args = ap.parse_args(argv)
    bucket = None if args.bucket_size == 0 else args.bucket_size
    if args.alpha_sweep:
        rows = [row for model in args.models for tp, dp in CONFIGS
                for row in alpha_sweep(llama3_spec(model), tp, dp,
                                       default_bucket_size(dp) if bucket == -1 else bucket)]
        print(alpha_markdown(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    results = run(args.models, CONFIGS, bucket, not args.matrices_only)
    print(f"Llama-3 {', '.join(args.models)}; PP = 1; DDP bucket "
          + ("one bucket" if bucket is None else "max(40M, 1M·DP) elements" if bucket == -1 else f"{bucket:,} elements")
          + "; "
          + ("embedding, norms and output layer in our buffer" if not args.matrices_only else "matrices only")
          + "\n")
    print(markdown(results))
    if args.json:
        clean = [{k: v for k, v in r.items() if k != "plans"} for r in results]
        args.json.write_text(json.dumps(clean, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
