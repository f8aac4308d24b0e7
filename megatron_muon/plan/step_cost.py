"""Predicted time of one whole optimizer step on a TP × DP × PP layout, ours against the others.

Ours prices the plan the optimizer would build, never a second model of it: the stage's
parameters and DDP buffer come from the one road from a model to its layouts
(``plan.stage_layouts``: the balanced layout with its DP homes, or megatron-core's packing
replayed, as ``--muon-dp-layout`` gives it), the step plan is ``step_plan.build_step_plan`` on
the catalogue's ``MatrixLayout``s with the optimizer's settings, and its seconds are
``pricing.plan_cost``'s, so the cost's NS FLOPs and exchange bytes are the plan's per-rank
figures. megatron-core's Muon, its layer-wise optimizer and Adam are modelled from their own rules
on the same stage's parameters. ``docs/performance.md`` has the numbers;
``scripts/bench/validate_cost_model.py`` checks the model against measured steps, and
``tests/unit/test_dry_run_cost_model.py`` against every recorded dry run's plan.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout
from ..core.models import ModelShape
from ..core.newton_schulz import NSOptions
from .cost_model import Cost, collective_cost, memory_time
from .hardware import Hardware
from .layout_choice import LayoutPrice
from .owners import plan_owners
from .param_marks import DEFAULT_SPLITS, RowSplits
from .pricing import plan_cost
from .stage_layouts import DEFAULT_DP_LAYOUT, BufferSettings, StageLayouts, buffer_layout, stage_layouts, whole_layouts
from .stage_params import StageGrid, StageParam, group_topology, stage_params
from .step_plan import PlanSettings, StepPlan, build_step_plan

__all__ = ["MEGATRON_SPLITS", "OPTIMIZERS", "StepCost", "optimizer_step_cost", "stage_plan"]


OPTIMIZERS = ("ours", "megatron-muon", "megatron-layerwise", "adam")
"""ours: MuonDistributedOptimizer (ZeRO-1 ranges, DP owner exchange around the TP mode);
megatron-muon: megatron-core's TensorParallelMuon under plain DDP (every DP rank computes every
matrix, one NS call per matrix); megatron-layerwise: its LayerWiseDistributedOptimizer (whole
matrices on DP ranks, updated params all-gathered); adam: Megatron's Adam distributed optimizer."""

MEGATRON_SPLITS = RowSplits(qkv=True, fc1=False, in_proj=False)
"""megatron-core 0.19.2's Muon: QKV per query group (``muon_split_qkv``), fc1 and a Mamba in_proj whole."""

# Elementwise bytes per element (fp32 state, ``ns`` = NS dtype bytes) and kernels per tensor.
# Muon: momentum lerp (read g, read+write m), cast to the NS dtype, scale back to fp32, update
# with weight decay (read+write p twice, read u). Grad norm: one read; clipping: one read+write with
# Megatron's fused multi-tensor scale (apex / Transformer Engine, installed wherever the fused Adam
# is: ``Hardware.fused_adam``), else megatron-core's ``local_multi_tensor_scale``, a product into a
# temporary copied back (r, w, r, w). Megatron's distributed optimizer then copies each updated
# main-param shard into the param buffer it all-gathers (r fp32, w the param dtype).
# Adam as Megatron runs it (``Hardware.fused_adam``): fused, one kernel reads grad, param,
# exp_avg and exp_avg_sq and writes the last three; torch's single-tensor AdamW, one kernel per
# op: weight decay (r+w p), lerp (r g, r+w m), mul and addcmul (r+w v, then r v, r g, w v), sqrt
# and the bias-correction division (each a temporary: r, w), add eps (r+w), addcdiv (r p, m and
# the temporary, w p).
_MUON_BYTES = lambda ns: 3 * 4 + (4 + ns) + (ns + 8) + 5 * 4  # noqa: E731
_MUON_KERNELS = 8
_FUSED_ADAM = (7 * 4, 1)
_TORCH_ADAM = (20 * 4, 8)
_NORM = {True: (4 + 8, 4), False: (4 + 16, 5)}  # by Hardware.fused_adam: (bytes, kernels) per element, tensor
_DEFAULT_NS = NSOptions()


@dataclass
class StepCost(Cost):
    """A whole step's ``Cost``, with Muon's own exchanges and Megatron's param all-gather apart.

    ``bytes_sent_max`` is Muon's exchange only (the busiest rank's ``plan.bytes_sent``: DP owner
    exchange and TP mode, what the dry run and the startup report print); ``ns_flops_max`` is
    ``max(plan.ns_flops)``."""

    param_gather_bytes: float = 0.0
    """bytes the busiest rank sends in Megatron's param all-gather after the step (ZeRO-1's, or
    the layer-wise optimizer's), in none of the figures above."""
    param_gather_s: float = 0.0
    """seconds of that all-gather over DP > 1 (each buffer's on its own DP group), in ``comm_s``:
    what ``plan.iteration`` prices bucket by bucket instead."""
    expert_ns_flops_max: float = 0.0
    """the expert optimizer's plan's ``max(ns_flops)`` (0 without an expert-parallel buffer)."""
    expert_bytes_sent_max: float = 0.0
    """the expert optimizer's plan's ``max(bytes_sent)``: its expert-DP owner exchange and expert-TP mode."""


def stage_plan(model: ModelShape, grid: StageGrid, settings: PlanSettings,
               buffer: BufferSettings | None = None, *, experts: bool = False) -> StepPlan | None:
    """The plan ``MuonDistributedOptimizer`` builds for stage ``grid.stage`` (``stage_layouts``
    on ``buffer``'s layout, default ``BufferSettings()``, then ``build_step_plan``): the dense
    optimizer's, or with ``experts`` the expert optimizer's (None where the stage has no
    expert-parallel buffer)."""
    laid = stage_layouts(model, grid, buffer or BufferSettings())
    if experts:
        if laid.experts is None:
            return None
        if settings.topology is None and settings.hardware is not None:  # the expert grid's rank map, as priced
            topology = group_topology(grid, experts=True, ranks_per_node=settings.hardware.ranks_per_node)
            settings = dataclasses.replace(settings, topology=topology)
        grid, laid = grid.expert_grid, laid.experts
    return build_step_plan(laid.matrices, dp_size=grid.dp, tp_size=grid.tp, settings=settings)


@dataclass(frozen=True)
class _Group:
    """One of the stage's optimizers' params: the dense ones, or the expert-parallel ones (their own
    DDP buffer and optimizer, over expert TP × expert DP)."""

    params: tuple[StageParam, ...]
    grid: StageGrid
    """its own grid: the stage's, or the stage's ``expert_grid``."""
    laid: StageLayouts | None
    """ours: the group as the optimizer finds it; None for the other optimizers."""
    experts: bool = False
    """the expert-parallel params (their ranks stand where ``group_topology(experts=True)`` says)."""


def optimizer_step_cost(
    model: ModelShape,
    *,
    optimizer: str,
    tp: int,
    dp: int,
    hw: Hardware,
    pp: int = 1,
    tp_mode: str | None = None,
    ns: NSOptions = _DEFAULT_NS,
    clip_grad: bool = True,
    dp_layout: str = DEFAULT_DP_LAYOUT,
    bucket_numel: int | None = None,
    stage: int = 0,
    layout_price: LayoutPrice | None = None,
    ep: int = 1,
    etp: int | None = None,
    splits: RowSplits = DEFAULT_SPLITS,
    param_bytes: int = 2,
) -> StepCost:
    """Predicted ``optimizer.step()`` time on the busiest rank of pipeline stage ``stage`` of a
    TP × DP × PP layout of ``model`` (with experts: EP × expert TP ``etp``, default ``tp``).

    ``tp_mode`` is the Muon TP mode (``--muon-tp-mode``, one of ``step_plan.TP_MODES``; required for
    the Muon optimizers, unused for adam; ``auto`` plans on ``hw``, as the optimizer does). Ours:
    the plan of the stage's real layouts on ``dp_layout`` (``--muon-dp-layout``; DDP's
    ``bucket_numel`` on the first stage, None = one bucket), its matrices pinned to the DP ranges
    holding them, priced by ``pricing.plan_cost``. ``ns``: the Newton–Schulz settings (ours;
    megatron-core's Muon runs the standard iteration and splits QKV only, ``MEGATRON_SPLITS``).
    ``layout_price``: the job's price inputs, with which ``dp_layout`` ``priced`` is the layout
    ``layout_choice.choose_layout`` chooses, as the Megatron adapter lays it out under Megatron's
    args (``layout_choice.job_price``); None: whole matrices. ``splits``: the fused weights ours
    splits (``--muon-split-qkv`` and its siblings, ``--muon-split-qkv-per-head``). ``param_bytes``:
    bytes per element of the model's params, which Megatron's param all-gather moves (2: bf16, as
    ``plan.iteration.Stage`` prices the same all-gather; 4: fp32 params).

    A stage with an expert-parallel buffer steps two optimizers, one after the other (Megatron's
    ``ChainedOptimizer``): the dense one over TP × DP, the experts' over expert TP × expert DP.
    Their seconds add; ``ns_flops_max`` / ``bytes_sent_max`` are the dense plan's and
    ``expert_ns_flops_max`` / ``expert_bytes_sent_max`` the expert plan's, each the busiest rank
    of its own group (what the dry run's ``summary.dense`` and ``summary.experts`` report).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer_step_cost: optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    if param_bytes not in (1, 2, 4):
        raise ValueError(f"optimizer_step_cost: param_bytes {param_bytes}; expected 1, 2 or 4 (fp8, bf16, fp32)")
    if optimizer != "adam" and tp_mode is None:
        raise ValueError(f"optimizer_step_cost: optimizer {optimizer!r} needs a tp_mode (--muon-tp-mode)")
    grid = StageGrid(tp, dp, pp, stage, ep, etp)
    ours = optimizer == "ours"
    ns = ns if ours else dataclasses.replace(ns, method="standard", gram_dtype=None)
    settings = BufferSettings(dp_layout if ours else "megatron", bucket_numel,
                              splits if ours else MEGATRON_SPLITS, ns, price=layout_price if ours else None)
    # ours: the stage as the optimizer finds it; the others: its params (Adam's buffer: megatron-core's)
    if ours:
        laid = stage_layouts(model, grid, settings)
        groups = [_Group(laid.params, grid, laid)]
        if laid.experts is not None:
            groups.append(_Group(laid.experts.params, grid.expert_grid, laid.experts, experts=True))
    else:
        every = stage_params(model, grid)
        groups = [_Group(tuple(p for p in every if not p.expert_parallel), grid, None)]
        if any(p.expert_parallel for p in every):
            if optimizer == "megatron-layerwise":
                raise NotImplementedError("optimizer_step_cost: megatron-layerwise with an expert-parallel buffer "
                                          "is not modelled")
            groups.append(_Group(tuple(p for p in every if p.expert_parallel), grid.expert_grid, None, experts=True))
    cost = Cost()

    def elementwise(label: str, nbytes: float, kernels: int) -> None:
        nonlocal cost
        seconds = memory_time(nbytes, kernels, hw)
        cost += Cost(memory_s=seconds, parts=Counter({label: seconds}))

    adam_bytes, adam_kernels = _FUSED_ADAM if hw.fused_adam else _TORCH_ADAM
    plans: list[StepPlan | None] = []
    gather = gather_s = 0.0
    for group in groups:
        params, g = group.params, group.grid
        muon = [p for p in params if p.is_muon]
        muon_local, adam_local = sum(p.numel for p in muon), sum(p.numel for p in params if not p.is_muon)
        plan = None
        if optimizer in ("ours", "adam"):  # megatron-core's distributed optimizer, every param through it
            elementwise("param copy", (muon_local + adam_local) / g.dp * (4 + param_bytes), len(params))
        elif optimizer == "megatron-layerwise":  # its Adam params only
            elementwise("param copy", adam_local / g.dp * (4 + param_bytes), len(params) - len(muon))
        if optimizer == "adam":
            elementwise("adam", (muon_local + adam_local) / g.dp * adam_bytes, len(params) * adam_kernels)
        else:
            shard = 1 if optimizer == "megatron-muon" else g.dp  # DDP Muon: every DP rank updates everything
            elementwise("muon elementwise", muon_local / shard * _MUON_BYTES(ns.dtype_bytes),
                        len(muon) * _MUON_KERNELS)
            elementwise("adam", adam_local / shard * adam_bytes, (len(params) - len(muon)) * adam_kernels)
            # ours on the buffer's DP ranges; megatron-core's Muon under plain DDP on whole matrices, every
            # DP rank alike (DP 1); its layer-wise optimizer on whole matrices, each on one DP home
            matrices = group.laid.matrices if ours else whole_layouts(params, g.tp, settings.splits)
            plan_dp = 1 if optimizer == "megatron-muon" else g.dp
            if optimizer == "megatron-layerwise":  # each matrix whole on its home: the all-gather below returns it
                matrices = _on_homes(matrices, g.dp, ns)
            # the profile's ranks per node in every mode
            topology = group_topology(grid, experts=group.experts, ranks_per_node=hw.ranks_per_node)
            plan = build_step_plan(matrices, dp_size=plan_dp, tp_size=g.tp,
                                   settings=PlanSettings(tp_mode, ns, hardware=hw,
                                                         topology=topology if plan_dp == g.dp else None))
            cost += plan_cost(plan, hw, megatron_core=not ours)  # one NS call per matrix, its distributed mode
        plans.append(plan)
        if clip_grad:
            shard = 1 if optimizer == "megatron-muon" else g.dp
            norm_bytes, norm_kernels = _NORM[hw.fused_adam]
            elementwise("grad norm + clip", (muon_local + adam_local) / shard * norm_bytes, len(params) * norm_kernels)
        group_gather = 0.0
        if g.dp > 1 and optimizer in ("ours", "adam"):
            # ZeRO-1: every rank's shard of the updated params (padding included) is all-gathered
            buffer = group.laid.buffer if ours else buffer_layout(params, g, settings)
            group_gather = buffer.numel / g.dp * param_bytes * (g.dp - 1)
        if g.dp > 1 and optimizer == "megatron-layerwise":
            # Adam params through a distributed optimizer, Muon params gathered from their DP homes
            # (padded to the largest home's size)
            layouts = whole_layouts(params, g.tp, MEGATRON_SPLITS)
            largest = max(sum(layouts[i].numel for i in home) for home in _dp_homes(layouts, g.dp, ns))
            group_gather = (adam_local / g.dp + largest) * param_bytes * (g.dp - 1)
        if g.dp == 1 and optimizer != "megatron-muon" and hw.solo_gather_bandwidth:
            # Megatron's param all-gather still runs at DP 1, over a group of one: a copy of each
            # buffer through the backend (free on NCCL, in place; gloo copies). Layer-wise: both buffers.
            numel = (group.laid.buffer.numel if ours else buffer_layout(params, g, settings).numel
                     if optimizer == "adam" else muon_local + adam_local)
            seconds = numel * param_bytes / hw.solo_gather_bandwidth
            cost += Cost(comm_s=seconds, parts=Counter({"param all-gather, DP 1": seconds}))
        if group_gather:  # over the group's DP ranks, where Megatron's grid puts them
            spans = group_topology(grid, experts=group.experts, ranks_per_node=hw.ranks_per_node).dp_spans_nodes
            gathered = collective_cost("all_gather", group_gather, 1, g.dp, hw, spans)
            cost += gathered
            gather += group_gather
            gather_s += gathered.comm_s
    if clip_grad:  # one scalar all-reduce for the grad norm, whatever the groups
        cost += collective_cost("all_reduce", 0.0, 1, tp * dp * pp, hw, None, scalars=True)
    dense = plans[0]
    expert = plans[1] if len(plans) > 1 else None
    return StepCost(cost.compute_s, cost.comm_s, cost.memory_s,
                    max(dense.bytes_sent, default=0) if dense is not None else 0.0,
                    max(dense.ns_flops, default=0) if dense is not None else 0.0, cost.parts,
                    param_gather_bytes=gather, param_gather_s=gather_s,
                    expert_ns_flops_max=max(expert.ns_flops, default=0) if expert is not None else 0.0,
                    expert_bytes_sent_max=max(expert.bytes_sent, default=0) if expert is not None else 0.0)


def _on_homes(layouts: Sequence[MatrixLayout], dp: int, ns: NSOptions) -> tuple[MatrixLayout, ...]:
    """The layer-wise optimizer's matrices, each whole on its ``_dp_homes`` rank (a DP range of all
    of it there, empty elsewhere): its plan owns each on its home and sends nothing over DP, since
    DDP's all-reduce already put the grads there and the param all-gather returns the result."""
    home_of = {i: r for r, home in enumerate(_dp_homes(layouts, dp, ns)) for i in home}
    return tuple(dataclasses.replace(lay, dp_ranges=tuple((0, lay.numel) if r == home_of[i] else (0, 0)
                                                          for r in range(dp)))
                 for i, lay in enumerate(layouts))


def _dp_homes(layouts: Sequence[MatrixLayout], dp: int, ns: NSOptions) -> list[list[int]]:
    """megatron-core's layer-wise homes, modelled: whole matrices by LPT on NS FLOPs."""
    homes: list[list[int]] = [[] for _ in range(dp)]
    costs = [lay.group_flops(ns.flops) for lay in layouts]
    for i, r in enumerate(plan_owners(costs, dp)):
        homes[r].append(i)
    return homes
