"""Planner quality on Llama-3 8B / 70B / 405B: NS FLOPs per rank and owner-exchange bytes.

    python -m scripts.bench.planner_quality                  # Markdown tables to stdout
    python -m scripts.bench.planner_quality --json out.json  # and every number as JSON

Pure planning arithmetic: no process group, no tensor the size of a model (meta tensors only);
it runs in seconds. Parallelism: TP × DP with PP = 1 (every rank holds all layers), at
TP8 × DP8 (64 ranks) and TP8 × DP64 (512 ranks).

Rows of the FLOPs table (per (dp, tp) rank: the Newton–Schulz FLOPs it runs in one step):

* **ours (ZeRO-1)**: exactly what our code plans with ``--use-distributed-optimizer
  --muon-tp-mode owner``. The stage is the one road from a model to its layouts the cost model
  and the dry run's figures share (``plan.stage_params``: every param as megatron-core registers
  it, embedding, norms and output layer included, since they shift the cuts;
  ``plan.stage_layouts``: the DDP buffer on megatron-core's packing — params in backprop order,
  64-element aligned starts, each bucket padded to a multiple of lcm(DP, 128) — or on ours, each
  DP rank's flat range of every param, the ``MatrixLayout`` of each matrix by
  ``plan.param_marks.matrix_layout``, the function ``megatron.catalogue.layout_of`` calls: QKV
  split per query group, fc1 into gate / up), checked param by param against the real DDP and
  catalogue (``tests/megatron/test_stage_layouts.py``). Then our ``plan_dp_owners`` gives each matrix its DP
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
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        is_managed_by_layer_wise_optimizer,
    )

    from megatron_muon.config import MuonConfig
    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.core.models import LLAMA3, ModelShape
    from megatron_muon.core.newton_schulz import NSOptions, ns_flops
    from megatron_muon.megatron.catalogue import is_muon_matrix, layout_of, row_splits
    from megatron_muon.plan.balanced_layout import BufferLayout
    from megatron_muon.plan.layout_choice import LayoutPrice
    from megatron_muon.plan.owners import plan_dp_owners
    from megatron_muon.plan.stage_layouts import BufferSettings, buffer_layout, whole_layouts, zero1_layouts
    from megatron_muon.plan.stage_params import StageGrid, StageParam, stage_params
    from megatron_muon.plan.step_cost import MEGATRON_SPLITS
    from megatron_muon.plan.step_plan import build_step_plan

MODELS = ("8B", "70B", "405B")
CONFIGS = ((8, 8), (8, 64))  # (TP, DP); PP = 1
STEPS = 5  # Newton–Schulz iterations (--muon-num-ns-steps default)
NS_BYTES = 2  # bf16, the default ns_dtype: the owner exchanges move bf16


def default_bucket_size(dp: int) -> int:
    """``DistributedDataParallel``'s default bucket size (elements) with overlap_grad_reduce."""
    return max(40_000_000, 1_000_000 * dp)


# ---------------------------------------------------------------------------------------------
# The model: a stage's params on the planning road, and as meta parameters for megatron-core


Stage = ModelShape | Sequence[StageParam]
"""A model (its one stage at PP = 1, ``plan.stage_params``) or a stage's params given directly (a
toy: any matrices, TP-local shapes for the TP size asked)."""


def llama3_spec(model: str) -> ModelShape:
    """Llama-3 ``model`` (``8B``, ``70B``, ``405B``) from ``core.models``."""
    return LLAMA3[model]


def stage_of(stage: Stage, tp: int) -> tuple[StageParam, ...]:
    """The params of one TP rank, in registration order."""
    return stage_params(stage, StageGrid(tp=tp)) if isinstance(stage, ModelShape) else tuple(stage)


def meta_params(params: Sequence[StageParam]) -> list[tuple[str, torch.nn.Parameter]]:
    """``params`` as meta tensors carrying megatron-core's attributes (what its layer-wise and
    Megatron-FSDP layouts read): the torch side of the same road."""
    out = []
    for p in params:
        param = torch.nn.Parameter(torch.empty(*p.shape, dtype=torch.bfloat16, device="meta"))
        marks = p.marks
        if marks.tensor_parallel:
            param.tensor_model_parallel, param.partition_dim = True, marks.partition_dim
            param.partition_stride = 2 if marks.gated else 1
        if marks.qkv_split is not None:
            param.is_qkv, param.qkv_split_shapes = True, list(marks.qkv_split)
        if marks.partition_sizes is not None:
            param.partition_sizes = list(marks.partition_sizes)
        if marks.embedding_or_output:
            param.is_embedding_or_output_parameter = True
        out.append((p.name, param))
    return out


def _ddp_config() -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)


# ---------------------------------------------------------------------------------------------
# Ours


def _buffer_settings(dp_layout: str, bucket_size: int | None, muon_config: MuonConfig,
                     price: LayoutPrice | None = None) -> BufferSettings:
    return BufferSettings(dp_layout, bucket_size, row_splits(muon_config), muon_config.ns, muon_config.layout_alpha,
                          price=price)


def ours_layouts(stage: Stage, tp: int, dp: int, bucket_size: int | None, *,
                 distributed_optimizer: bool = True, with_non_matrix: bool = True,
                 muon_config: MuonConfig | None = None, dp_layout: str = "megatron",
                 price: LayoutPrice | None = None) -> list[MatrixLayout]:
    """The ``MatrixLayout`` list our optimizer attaches, in its order.

    ZeRO-1: ``catalogue.describe_zero1``'s, on the ``dp_layout`` buffer layout (bucket by bucket,
    backprop order, every DP rank's range: ``plan.stage_layouts.zero1_layouts``). DDP:
    ``catalogue.describe_whole``'s: model order, no ranges. ``price``: the balanced layout as
    ``plan.layout_choice`` chooses it on the job's price (None: whole matrices).
    """
    muon_config = muon_config or MuonConfig(tp_mode="owner")
    params = stage_of(stage, tp)
    if not distributed_optimizer:
        return list(whole_layouts(params, tp, row_splits(muon_config)))
    if not with_non_matrix:
        params = tuple(p for p in params if p.is_muon)
    buffer = buffer_layout(params, StageGrid(tp=tp, dp=dp), _buffer_settings(dp_layout, bucket_size, muon_config,
                                                                             price))
    return list(zero1_layouts(params, buffer, tp, row_splits(muon_config)))


def layer_wise_layout(params: Sequence[StageParam], bucket_size: int | None, dp: int):
    """megatron-core's ``LayerWiseDistributedOptimizer.compute_full_param_layout`` on ``params``
    (meta tensors; upstream's routing marks which are layer-wise): the matrices it manages in a
    shard-aligned buffer, the rest in a DistributedOptimizer buffer beside it. Returns the meta
    params (in ``params``' order) and the ``FullParamLayout``."""
    metas = [param for _, param in meta_params(params)]
    for param in metas:
        param.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(param)
    return metas, LayerWiseDistributedOptimizer.compute_full_param_layout(metas, bucket_size, dp, _ddp_config())


def buffer_rows(stage: Stage, tp: int, dp: int, bucket_size: int | None, dp_layout: str,
                muon_config: MuonConfig | None = None) -> tuple[int, int]:
    """(buffer elements with padding, param elements) of one TP rank's DDP buffers on ``dp_layout``:
    ``megatron`` or ``balanced`` (the road's buffer), or ``layer-wise`` (``layer_wise_layout``)."""
    params = stage_of(stage, tp)
    if dp_layout == "layer-wise":
        _, full = layer_wise_layout(params, bucket_size, dp)
        return sum(lay.bucket_indices[-1][1] for lay in full.layouts.values()), sum(p.numel for p in params)
    settings = _buffer_settings(dp_layout, bucket_size, muon_config or MuonConfig(tp_mode="owner"))
    laid: BufferLayout = buffer_layout(params, StageGrid(tp=tp, dp=dp), settings)
    return laid.numel, sum(laid.numel_params)


def fsdp_layouts(stage: Stage, tp: int, dp: int, strategy: str = "optim_grads_params") -> list[MatrixLayout]:
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
    for name, param in meta_params(stage_of(stage, tp)):
        owner = root
        parts = name.split(".")
        if "layers" in parts:
            index = int(parts[parts.index("layers") + 1])
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


def megatron_dp_assignment(stage: Stage, tp: int, dp: int, bucket_size: int | None) -> list[int]:
    """DP rank of every hidden matrix (model order) under the layer-wise layout, computed on
    the TP-local shapes (the Muon params sit in their own layer-wise buffer)."""
    params, full = layer_wise_layout([p for p in stage_of(stage, tp) if p.is_muon], bucket_size, dp)
    (layer_wise,) = full.layouts.values()
    out = []
    for p in params:
        start, end, bucket_id = layer_wise.param_index_map[p]
        bucket_start, bucket_end = layer_wise.bucket_indices[bucket_id]
        shard = (bucket_end - bucket_start) // dp
        rank = (start - bucket_start) // shard
        if (end - 1 - bucket_start) // shard != rank:
            raise AssertionError(f"{p}: a layer-wise param straddles two DP shards")
        out.append(rank)
    return out


def plan_megatron(stage: Stage, tp: int, dp: int, bucket_size: int | None, mode: str) -> Plan:
    """NS FLOPs per rank of TensorParallelMuon (``duplicated`` or ``blockwise``) on the
    layer-wise assignment. Its splits: QKV per query group, fc1 not split."""
    dp_of = megatron_dp_assignment(stage, tp, dp, bucket_size)
    flops = [0.0] * (tp * dp)
    units = []
    for layout, d in zip(whole_layouts(stage_of(stage, tp), tp, MEGATRON_SPLITS), dp_of):
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


def evaluate(model: str, tp: int, dp: int, bucket_size: int | None, *, with_non_matrix: bool = True) -> dict:
    """Every row for Llama-3 ``model`` at TP × DP."""
    ranks = tp * dp
    spec = llama3_spec(model)
    out: dict = dict(model=model, tp=tp, dp=dp, ranks=ranks, bucket_size=bucket_size)
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


def layout_rows(spec: Stage, tp: int, dp: int, bucket_size: int | None) -> dict:
    """Per buffer layout, on one TP rank's params: padding, reduce-scatter + all-gather bytes,
    NS FLOPs max/mean over the DP ranks holding the matrices, matrices cut, DP exchange bytes.

    NS FLOPs per matrix: ours (``MatrixLayout.ns_cost``: fc1 split into gate/up, QKV per query
    group) for every layout, so the balance compares the assignments, not TP modes. DP rank of a
    matrix: ours' DP owner (``plan_dp_owners``) on the ``megatron`` and ``balanced`` layouts; the
    shard holding it on the layer-wise layout (upstream's optimizer updates it there).
    """
    out = {}
    for name in LAYOUTS:
        numel, unpadded = buffer_rows(spec, tp, dp, bucket_size, name)  # unpadded: params only
        # Megatron's reduce-scatter of the grads and all-gather of the params, both in bf16:
        # each rank sends (DP − 1)/DP of every bucket in each.
        rs_ag = 2 * (dp - 1) / dp * numel * NS_BYTES
        row = dict(padding=1 - unpadded / numel, buffer_numel=numel, rs_ag_bytes=rs_ag)
        if name == "layer-wise":
            dp_of = megatron_dp_assignment(spec, tp, dp, bucket_size)
            costs = [lay.ns_cost(STEPS) for lay in whole_layouts(stage_of(spec, tp), tp)]
            row.update(cut=0, dp_bytes_max=0, dp_bytes_mean=0.0)
        else:
            layouts = ours_layouts(spec, tp, dp, bucket_size, dp_layout=name)
            dp_of = plan_dp_owners(layouts, dp, NSOptions(STEPS))
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


def alpha_sweep(model: str, tp: int, dp: int, bucket_size: int | None, alphas=ALPHAS) -> list[dict]:
    """Llama-3 ``model``'s balanced layout at each α: padding, NS max/mean over DP owners and over all ranks."""
    spec = llama3_spec(model)
    rows = []
    for alpha in alphas:
        cfg = MuonConfig(tp_mode="owner", layout_alpha=alpha)
        numel, unpadded = buffer_rows(spec, tp, dp, bucket_size, "balanced", cfg)  # unpadded: params only
        layouts = ours_layouts(spec, tp, dp, bucket_size, dp_layout="balanced", muon_config=cfg)
        owners = plan_dp_owners(layouts, dp, NSOptions(STEPS))
        loads = [0.0] * dp
        for lay, d in zip(layouts, owners):
            loads[d] += lay.ns_cost(STEPS)
        plan = plan_ours(layouts, tp, dp)
        rows.append(dict(model=model, tp=tp, dp=dp, alpha=alpha, padding=1 - unpadded / numel,
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
            results.append(evaluate(model, tp, dp, bs, with_non_matrix=with_non_matrix))
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
                for row in alpha_sweep(model, tp, dp,
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
