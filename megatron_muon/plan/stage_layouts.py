"""A stage's DDP buffer and the ``MatrixLayout``s the optimizer plans with, from its parameters.

The road from a model to its plan, without building the model (``stage_params`` → here →
``step_plan.build_step_plan``), taking every step the real job takes with the same rules:

1. the buffer layout, as ``--muon-dp-layout`` gives it to megatron-core's DDP:
   ``balanced`` — ``plan.balanced_layout.balanced_layout`` on the ``LayoutItem``s the adapter
   builds (``megatron.layout.balanced_buffer_layouts``: a Muon matrix whole, costed by its NS
   FLOPs, its rows as long as its TP-local columns); ``megatron`` — megatron-core 0.19.2's own
   packing, replayed (``megatron_packing``: ``DistributedOptimizer._compute_per_buffer_param_layout``);
2. every DP rank's range of each param, as the distributed optimizer cuts each bucket into DP
   equal shards (``dp_ranges``: ``DistributedOptimizer._build_model_gbuf_param_range_map``, which
   ``megatron.catalogue.ranges_on_every_rank`` calls);
3. the Muon matrices in the catalogue's order (``megatron.catalogue.describe_zero1``: bucket by
   bucket, each bucket's params in backprop order — the reverse of registration), each laid out
   by ``param_marks.matrix_layout``, the function ``catalogue.layout_of`` calls.

The bucket size follows DDP's own rule: the given size on the first pipeline stage, one bucket on
the others. A stage's dense params share one buffer (one dtype); its experts' weights, where
megatron-core gives them their own (``StageParam.expert_parallel``), share a second, laid out the
same way over the expert-DP group with the expert TP size (``StageLayouts.experts``). As the
Megatron adapter, ``priced`` prices each buffer on its own: the experts' on
``LayoutPrice.for_experts`` (the tokens one expert sees, the expert grid's links).
``tests/megatron/test_stage_layouts.py`` compares every step with the real DDP's and the real
catalogue's on models megatron-core builds. Pure: no torch, no Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.matrix_layout import MatrixLayout
from ..core.models import ModelShape
from ..core.newton_schulz import NSOptions
from .balanced_layout import (
    DEFAULT_ALPHA,
    MAX_PADDING,
    PARAM_ALIGN,
    BufferLayout,
    LayoutItem,
    balanced_layout,
    layout_item,
)
from .layout_choice import ExpertRouting, LayoutPrice, choose_layout, forward_flops, step_seconds
from .megatron_packing import megatron_packing
from .param_marks import DEFAULT_SPLITS, RowSplits, matrix_layout
from .stage_params import StageGrid, StageParam, group_topology, stage_params

__all__ = ["DEFAULT_DP_LAYOUT", "DP_LAYOUTS", "BufferSettings", "StageLayouts", "buffer_items", "buffer_layout",
           "dp_ranges", "megatron_packing", "shard_divisor", "stage_layouts", "whole_layouts", "zero1_layouts"]

DP_LAYOUTS = ("balanced", "megatron", "priced")
"""``--muon-dp-layout``'s choices."""
DEFAULT_DP_LAYOUT = "priced"
"""``--muon-dp-layout``'s default, everywhere (the optimizer's ``MuonConfig``, the dry run, the cost
model): the layout the iteration's price chooses, whole matrices where no price can be formed."""


@dataclass(frozen=True)
class BufferSettings:
    """How the stage's DDP buffer is laid out and its matrices split (the optimizer's flags)."""

    dp_layout: str = DEFAULT_DP_LAYOUT
    """``--muon-dp-layout``: ``priced`` (the default: ``layout_choice.choose_layout`` on ``price``;
    balanced without one), ``balanced`` (whole matrices) or ``megatron`` (megatron-core's packing)."""
    bucket_numel: int | None = None
    """DDP's bucket size in elements (``--ddp-bucket-size``, or its default with
    ``--overlap-grad-reduce``: max(40M, 1M·DP)); None: one bucket. The first stage only (DDP's rule)."""
    splits: RowSplits = DEFAULT_SPLITS
    """the fused weights split into their parts (``--muon-split-qkv`` and its siblings)."""
    ns: NSOptions = NSOptions()
    """the NS settings whose FLOPs the balanced layout balances (steps, method)."""
    alpha: float = DEFAULT_ALPHA
    """``--muon-layout-alpha``."""
    max_padding: float = MAX_PADDING
    """``balanced_layout``'s fallback threshold (a bucket padding more is packed as megatron-core packs it)."""
    price: LayoutPrice | None = None
    """the job's price inputs, read by ``priced`` only: the buffer laid out as
    ``layout_choice.choose_layout`` chooses (whole matrices or megatron-core's buckets cut at
    rows), as the Megatron adapter does with Megatron's args; None: whole matrices, as without them."""

    def __post_init__(self) -> None:
        if self.dp_layout not in DP_LAYOUTS:
            raise ValueError(f"--muon-dp-layout: expected one of {DP_LAYOUTS}, got {self.dp_layout!r}")
        if self.bucket_numel is not None and self.bucket_numel < 1:
            raise ValueError(f"BufferSettings: bucket_numel must be None (one bucket) or >= 1, got {self.bucket_numel}")


@dataclass(frozen=True)
class StageLayouts:
    """A stage on one TP rank: its params, its buffer and the matrices its optimizer plans."""

    params: tuple[StageParam, ...]
    """registration order."""
    buffer: BufferLayout
    """where each param lies (``ranges`` in the order of ``params``), the buckets."""
    matrices: tuple[MatrixLayout, ...]
    """the Muon matrices with every DP rank's range, in the catalogue's order."""
    experts: StageLayouts | None = None
    """the expert-parallel buffer's params, buffer and matrices (over the expert-DP group, TP-cut
    over expert TP: ``StageGrid.expert_grid``); None where the stage has none."""


def shard_divisor(dp: int) -> int:
    """Every DP shard of a bucket is a multiple of this: 64-aligned shard starts, and DP × shard a
    multiple of megatron-core's bucket-end divisor lcm(DP, 128) (``megatron.layout.shard_divisor``
    without ``--ddp-pad-buckets-for-high-nccl-busbw``)."""
    return math.lcm(PARAM_ALIGN, math.lcm(dp, 128) // dp)


def dp_ranges(buffer: BufferLayout, i: int) -> tuple[tuple[int, int], ...]:
    """Per DP rank, the ``[start, end)`` of param ``i`` (its own flat indices) that the rank's
    shard of its bucket holds; ``(0, 0)`` where it holds none."""
    start, end, b = buffer.ranges[i]
    bucket_start, bucket_end = buffer.buckets[b]
    size = (bucket_end - bucket_start) // buffer.dp_size
    out = []
    for r in range(buffer.dp_size):
        shard_start = bucket_start + r * size
        shard_end = min(bucket_end, shard_start + size)
        local_start, local_end = max(0, start - shard_start), min(shard_end - shard_start, end - shard_start)
        if local_end > local_start:
            first = max(0, shard_start - start)
            out.append((first, first + local_end - local_start))
        else:
            out.append((0, 0))
    return tuple(out)


def buffer_items(params: Sequence[StageParam], tp: int, settings: BufferSettings) -> list[LayoutItem]:
    """The ``LayoutItem``s the adapter builds for these params (``megatron.layout.balanced_buffer_layouts``):
    a Muon matrix whole, costed by its NS FLOPs, its rows as long as its TP-local columns."""
    return [layout_item(p.numel, _layout(p, tp, settings.splits) if p.is_muon else None, settings.ns, row=p.shape[-1])
            for p in params]


def buffer_layout(params: Sequence[StageParam], grid: StageGrid, settings: BufferSettings) -> BufferLayout:
    """The stage's DDP buffer on the ``settings.dp_layout`` layout (the module docstring, step 1)."""
    bucket = settings.bucket_numel if grid.first else None  # DDP buckets the first stage only
    if settings.dp_layout == "megatron":
        return megatron_packing([p.numel for p in params], [False] * len(params), grid.dp, bucket)
    items = buffer_items(params, grid.tp, settings)
    if settings.dp_layout == "priced" and settings.price is not None:
        price = settings.price
        flops = [forward_flops(p.name, p.numel, len(p.shape), price) for p in params]

        def step_s(candidate: BufferLayout) -> float:
            return step_seconds(zero1_layouts(params, candidate, grid.tp, settings.splits), grid.dp, price, settings.ns)

        return choose_layout(items, flops, grid.dp, bucket, price, alpha=settings.alpha,
                             shard_divisor=shard_divisor(grid.dp), max_padding=settings.max_padding,
                             step_s=step_s if price.tp_mode is not None else None).layout
    return balanced_layout(items, grid.dp, bucket, alpha=settings.alpha, shard_divisor=shard_divisor(grid.dp),
                           max_padding=settings.max_padding)


def zero1_layouts(params: Sequence[StageParam], buffer: BufferLayout, tp: int,
                  splits: RowSplits = DEFAULT_SPLITS) -> tuple[MatrixLayout, ...]:
    """The Muon matrices as ``catalogue.describe_zero1`` describes them (step 3): in buffer order,
    bucket by bucket, each bucket's params in backprop order, with every DP rank's range."""
    order = sorted(reversed(range(len(params))), key=lambda i: buffer.ranges[i][2])  # stable: backprop within
    return tuple(_layout(params[i], tp, splits, dp_ranges(buffer, i)) for i in order if params[i].is_muon)


def whole_layouts(params: Sequence[StageParam], tp: int,
                  splits: RowSplits = DEFAULT_SPLITS) -> tuple[MatrixLayout, ...]:
    """The Muon matrices as ``catalogue.describe_whole`` describes them without the distributed
    optimizer: registration order, whole on every DP rank (no DP ranges)."""
    return tuple(_layout(p, tp, splits) for p in params if p.is_muon)


def stage_layouts(model: ModelShape, grid: StageGrid, settings: BufferSettings = BufferSettings()) -> StageLayouts:
    """``model``'s stage ``grid.stage`` on one TP rank, laid out as the optimizer finds it: its dense
    buffer, and its expert-parallel buffer in ``experts``."""
    every = stage_params(model, grid)
    params = tuple(p for p in every if not p.expert_parallel)
    buffer = buffer_layout(params, grid, settings)
    experts = None
    if len(params) < len(every):
        expert_params = tuple(p for p in every if p.expert_parallel)
        expert_grid = grid.expert_grid
        price = settings.price
        if price is not None:  # as the adapter prices the experts' buffer (megatron.layout.balanced_buffer_layouts)
            spans = group_topology(grid, experts=True, ranks_per_node=price.hardware.ranks_per_node).dp_spans_nodes
            routing = ExpertRouting(model.num_experts, model.moe_topk, grid.ep)
            price = price.for_experts(routing, expert_tp=expert_grid.tp, dp_spans_nodes=spans)
        expert_buffer = buffer_layout(expert_params, expert_grid, replace(settings, price=price))
        experts = StageLayouts(expert_params, expert_buffer,
                               zero1_layouts(expert_params, expert_buffer, expert_grid.tp, settings.splits))
    return StageLayouts(params, buffer, zero1_layouts(params, buffer, grid.tp, settings.splits), experts)


def _layout(p: StageParam, tp: int, splits: RowSplits, ranges=None) -> MatrixLayout:
    return matrix_layout(p.name, (p.shape[0], p.shape[1]), p.marks, tp, splits, ranges)
