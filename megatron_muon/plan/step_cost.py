"""Predicted time of one whole optimizer step on a TP × DP × PP layout, ours against the others.

Ours is read from its step plan (``step_plan.build_step_plan`` on the stage's matrices: the DP
owners, each DP owner's TP modes, ``auto``'s choice included), timed with the primitives of
``cost_model``; megatron-core's Muon, its layer-wise optimizer and Adam are modelled from their
own rules. ``docs/performance.md`` has the numbers; ``scripts/bench/validate_cost_model.py``
checks the model against measured steps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.matrix_layout import MatrixLayout, RowSplit
from ..core.models import ModelShape, staged_pattern
from ..core.newton_schulz import NSOptions, ns_flops
from ..core.shapes import shard_shape
from . import exchange
from .cost_model import Cost, Hardware, collective_cost, memory_time, tp_mode_cost
from .owners import plan_owners
from .step_plan import PlanSettings, build_step_plan

__all__ = ["OPTIMIZERS", "ModelWeights", "Weight", "dp_cut_elements", "model_params", "model_weights",
           "optimizer_step_cost"]


@dataclass(frozen=True)
class Weight:
    """One Muon-managed weight as Megatron stores it: possibly several matrices fused by rows."""

    name: str
    rows: int
    cols: int
    partition_dim: int | None
    sub_rows: tuple[int, ...] = ()
    """global rows of each fused sub-matrix that NS treats separately (QKV: q, k, v summed over
    query groups; SwiGLU fc1: gate, up); empty = one matrix."""
    row_groups: int = 1
    """repeats of the fused row pattern (QKV: the query groups, ``[q; k; v]`` per group; fc1: 1,
    gate then up, which the step plan places as two units)."""

    def sub_shapes(self) -> list[tuple[int, int]]:
        """the global shape of each fused sub-matrix NS treats separately."""
        return [(r, self.cols) for r in (self.sub_rows or (self.rows,))]

    @property
    def numel(self) -> int:
        return self.rows * self.cols


OPTIMIZERS = ("ours", "megatron-muon", "megatron-layerwise", "adam")
"""ours: MuonDistributedOptimizer (ZeRO-1 ranges, DP owner exchange around the TP mode);
megatron-muon: megatron-core's TensorParallelMuon under plain DDP (every DP rank computes every
matrix, one NS call per matrix); megatron-layerwise: its LayerWiseDistributedOptimizer (whole
matrices on DP ranks, updated params all-gathered); adam: Megatron's Adam distributed optimizer."""

# Elementwise bytes per element (fp32 state, ``ns`` = NS dtype bytes) and kernels per tensor.
# Muon: momentum lerp (read g, read+write m), cast to the NS dtype, scale back to fp32, update
# with weight decay (read+write p twice, read u). Adam: torch's single-tensor AdamW (grad,
# exp_avg, exp_avg_sq read+write, param read+write, two temporaries). Grad norm: one read,
# clipping: one read+write.
_MUON_BYTES = lambda ns: 3 * 4 + (4 + ns) + (ns + 8) + 5 * 4  # noqa: E731
_MUON_KERNELS = 8
_ADAM_BYTES = 10 * 4
_ADAM_KERNELS = 12
_NORM_BYTES, _NORM_KERNELS = 4 + 8, 4


@dataclass(frozen=True)
class ModelWeights:
    """A model's parameters as the optimizer step sees them: its Muon weights and the rest."""

    name: str
    weights: tuple[Weight, ...]
    """Muon-managed weights, full shapes, in model-definition order (all pipeline stages)."""
    adam_sharded_numel: int
    """elements of the other parameters that TP splits (vocab-parallel embedding and output)."""
    adam_replicated_numel: int
    """elements of the other parameters every TP rank holds whole (norms)."""
    adam_tensors: int
    """how many other parameter tensors (each costs kernels in a per-tensor step)."""
    num_layers: int
    """transformer layers, for splitting over pipeline stages."""
    hybrid_pattern: str | None = None
    """a hybrid model's layer pattern (``ModelShape.hybrid_pattern``): its stages are the ones
    ``core.models.staged_pattern`` cuts, its layers hold different weights."""


def model_weights(model: ModelShape, *, split_fc1: bool = True, split_in_proj: bool = True) -> ModelWeights:
    """``model``'s weights as the optimizer sees them: QKV split into q, k, v (all groups of each
    together, as the optimizer batches them), fc1 into gate and up when ``split_fc1`` (ours;
    megatron-core 0.19.2 orthogonalizes fc1 whole); untied embedding and output, two norms per
    layer and the final norm to AdamW. Dense GQA models and hybrid ones without MoE layers (a
    Mamba ``in_proj`` split into z, x, B, C and dt when ``split_in_proj``, ours' default; its
    conv1d, A_log, D, dt_bias and gated norm to AdamW, TP-sharded; one norm per layer): experts
    (EP, expert-DP) and MLA are not modeled (``scripts/dry_run.py`` measures MoE layouts instead)."""
    if model.num_experts or model.mla is not None:
        raise NotImplementedError(f"model_weights: {model.name}: the cost model covers dense models with "
                                  "grouped-query attention; MoE / MLA layouts: scripts/dry_run.py")
    mamba = model.mamba
    sub_rows = {"linear_qkv": model.qkv_sub_rows,
                "linear_fc1": (model.ffn_hidden, model.ffn_hidden) if split_fc1 and model.gated_mlp else (),
                "in_proj": mamba.in_proj_sub_rows if mamba is not None and split_in_proj else ()}
    weights = tuple(
        Weight(name, rows, cols, pdim, sub_rows.get(name.rsplit(".", 1)[-1], ()),
               model.num_query_groups if name.endswith("linear_qkv") else 1)
        for name, rows, cols, pdim in model.matrices()
    )
    if model.hybrid_pattern is None:
        return ModelWeights(model.name, weights, adam_sharded_numel=2 * model.vocab * model.hidden,
                            adam_replicated_numel=(2 * model.num_layers + 1) * model.hidden,
                            adam_tensors=2 * model.num_layers + 3, num_layers=model.num_layers)
    # A hybrid layer has one norm; each Mamba mixer adds TP-sharded vectors: conv1d weight and
    # bias, A_log, D, dt_bias and its gated norm (6 tensors).
    mambas = model.hybrid_pattern.count("M")
    mixer_vectors = 0
    if mamba is not None:
        conv_dim = mamba.d_inner + 2 * mamba.num_groups * mamba.state_dim
        mixer_vectors = conv_dim * (_MAMBA_CONV + 1) + 3 * mamba.num_heads + mamba.d_inner
    return ModelWeights(model.name, weights, adam_sharded_numel=2 * model.vocab * model.hidden + mambas * mixer_vectors,
                        adam_replicated_numel=(model.num_layers + 1) * model.hidden,
                        adam_tensors=model.num_layers + 6 * mambas + 3, num_layers=model.num_layers,
                        hybrid_pattern=model.hybrid_pattern)


_MAMBA_CONV = 4  # megatron-core's MambaMixer d_conv


def model_params(model: ModelWeights) -> int:
    """Total parameter count (what 6·params·tokens uses)."""
    return sum(w.numel for w in model.weights) + model.adam_sharded_numel + model.adam_replicated_numel


def _local_numel(w: Weight, tp: int) -> int:
    return w.numel // tp if w.partition_dim is not None else w.numel


def _stage_weights(model: ModelWeights, pp: int) -> list[Weight]:
    """The weights of the first pipeline stage (stages hold equal layer counts; it also holds
    the embedding, so it is the busiest stage for the optimizer). A hybrid model's first stage:
    the first segment ``staged_pattern`` cuts, its weights by their layer index."""
    if model.hybrid_pattern is not None:
        layers = len(staged_pattern(model.hybrid_pattern, pp).split("|")[0])
        return [w for w in model.weights if int(w.name.split(".")[1]) < layers]
    per_layer = len(model.weights) // model.num_layers
    return list(model.weights[: per_layer * (model.num_layers // pp)])


def optimizer_step_cost(
    model: ModelWeights,
    *,
    optimizer: str,
    tp: int,
    dp: int,
    hw: Hardware,
    pp: int = 1,
    tp_mode: str = "owner",
    steps: int = 5,
    ns_bytes: int = 2,
    clip_grad: bool = True,
    dp_layout: str = "megatron",
    bucket_numel: int | None = None,
    ns_method: str = "standard",
) -> Cost:
    """Predicted ``optimizer.step()`` time on the busiest rank of a TP × DP × PP layout.

    ``tp_mode`` is the Muon TP mode (ignored for adam; ``auto`` chooses per matrix class on ``hw``,
    as the optimizer does). Stage 0 is modelled (the busiest: its layers plus the embedding). DP
    homes and TP modes are the step plan's for the stage's matrices held whole on every DP rank
    (LPT on NS FLOPs, as megatron-core's layer-wise optimizer assigns whole matrices);
    the real plan additionally pins matrices to the DP range holding them, which the model ignores.
    Ours' DP owner exchange moves what ``dp_cut_elements`` finds off its owner in the ``dp_layout`` buffer layout
    (``bucket_numel``: DDP's bucket size, None = one bucket). ``ns_method``: ``--muon-ns-method``
    (ours; megatron-core's Muon runs the standard iteration).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer_step_cost: optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    weights = _stage_weights(model, pp)
    muon_local = sum(_local_numel(w, tp) for w in weights)
    adam_local = model.adam_sharded_numel // tp // (2 if pp > 1 else 1) + model.adam_replicated_numel // pp
    adam_tensors = max(1, model.adam_tensors // pp)
    dp_spans_nodes = tp * dp > hw.ranks_per_node
    cost = Cost()

    def elementwise(label: str, nbytes: float, kernels: int) -> None:
        nonlocal cost
        seconds = memory_time(nbytes, kernels, hw)
        cost += Cost(memory_s=seconds, parts=Counter({label: seconds}))

    if optimizer == "adam":
        elementwise("adam", (muon_local + adam_local) / dp * _ADAM_BYTES, (len(weights) + adam_tensors) * _ADAM_KERNELS)
    else:
        sharded_state = optimizer != "megatron-muon"  # DDP Muon: every DP rank updates everything
        shard = dp if sharded_state else 1
        elementwise("muon elementwise", muon_local / shard * _MUON_BYTES(ns_bytes), len(weights) * _MUON_KERNELS)
        elementwise("adam", adam_local / shard * _ADAM_BYTES, adam_tensors * _ADAM_KERNELS)
        moved = 0
        if optimizer == "ours" and dp > 1 and dp_layout == "megatron" and model.hybrid_pattern is not None:
            raise NotImplementedError(f"optimizer_step_cost: {model.name}: the replay of megatron-core's buffer "
                                      "layout knows GPT layers only; dp_layout='balanced' for a hybrid model")
        if optimizer == "ours" and dp > 1:
            norm = model.adam_replicated_numel // (2 * model.num_layers + 1)
            moved = dp_cut_elements(weights, tp, dp, dp_layout=dp_layout, bucket_numel=bucket_numel,
                                    adam_numel=model.adam_sharded_numel // tp, norm_numel=norm)[1]
        ns = NSOptions(steps, dtype=_NS_DTYPES[ns_bytes], method=ns_method if optimizer == "ours" else "standard")
        cost += _muon_orthogonalize(weights, optimizer, tp_mode, tp, dp if sharded_state else 1, hw, ns,
                                    dp_spans_nodes, moved)
    if clip_grad:
        shard = 1 if optimizer == "megatron-muon" else dp
        elementwise("grad norm + clip", (muon_local + adam_local) / shard * _NORM_BYTES,
                    (len(weights) + adam_tensors) * _NORM_KERNELS)
        cost += collective_cost("all_reduce", 0.0, 1, tp * dp * pp, hw, None, scalars=True)
    if dp > 1 and optimizer in ("ours", "adam"):
        # ZeRO-1: the updated fp32 shard is all-gathered into every replica's params
        cost += collective_cost("all_gather", (muon_local + adam_local) / dp * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
    if dp > 1 and optimizer == "megatron-layerwise":
        # Adam params through a distributed optimizer, Muon params gathered from their DP homes
        # (padded to the largest home's size)
        cost += collective_cost("all_gather", adam_local / dp * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
        homes = _dp_homes(weights, dp, steps)
        largest = max(sum(_local_numel(weights[i], tp) for i in home) for home in homes)
        cost += collective_cost("all_gather", largest * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
    return cost


def _dp_homes(weights: Sequence[Weight], dp: int, steps: int) -> list[list[int]]:
    costs = [sum(ns_flops(r, c, steps) for r, c in w.sub_shapes()) for w in weights]
    homes: list[list[int]] = [[] for _ in range(dp)]
    for i, r in enumerate(plan_owners(costs, dp)):
        homes[r].append(i)
    return homes


def dp_cut_elements(weights: Sequence[Weight], tp: int, dp: int, *, dp_layout: str = "megatron",
                    bucket_numel: int | None = None, adam_numel: int = 0, norm_numel: int = 0) -> tuple[int, int]:
    """(matrices cut across DP ranks, their elements not on the rank holding the largest piece of
    their unit) in one TP rank's grad buffer; ours' DP owner exchange moves those elements there
    and back (a unit: the weight, or each of fc1's gate and up, ``units.split_units``).

    ``balanced`` (``--muon-dp-layout balanced``): nothing is cut. ``megatron``: megatron-core's
    default layout, replayed on sizes — params in backprop order (the reverse of registration:
    the output layer first, the embedding last, ``adam_numel`` split between them; per layer
    fc2, fc1, its norm, qkv, proj, its norm, each norm ``norm_numel`` elements, and the final norm
    after the output layer), 64-element aligned, a bucket closed once it holds ``bucket_numel``
    elements and padded to a multiple of lcm(DP, 128), each bucket cut into DP equal shards.
    """
    if dp_layout == "balanced" or dp == 1:
        return 0, 0
    if dp_layout != "megatron":
        raise ValueError(f"dp_cut_elements: dp_layout {dp_layout!r}; expected 'balanced' or 'megatron'")
    sizes = [(adam_numel // 2, ()), (norm_numel, ())] + _backprop_matrices(weights, tp, norm_numel)
    sizes.append((adam_numel - adam_numel // 2, ()))
    divisor = math.lcm(dp, 128)
    cut = moved = 0
    bucket: list[tuple[int, int, tuple[int, ...]]] = []  # (start, numel, unit sizes) relative to the bucket
    cursor = 0

    def close() -> None:
        nonlocal cut, moved, cursor
        shard = -(-cursor // divisor) * divisor // dp
        for start, numel, units in bucket:
            if units and numel and start // shard != (start + numel - 1) // shard:
                cut += 1
                for n in units:
                    first, last = start // shard, (start + n - 1) // shard
                    moved += n - max(min(start + n, (r + 1) * shard) - max(start, r * shard)
                                     for r in range(first, last + 1))
                    start += n
        bucket.clear()
        cursor = 0

    for numel, units in sizes:
        start = -(-cursor // 64) * 64
        bucket.append((start, numel, units))
        cursor = start + numel
        if bucket_numel is not None and cursor >= bucket_numel:
            close()
    if bucket:
        close()
    return cut, moved


_BACKPROP_RANK = {"linear_fc2": 0, "linear_fc1": 1, "linear_qkv": 2, "linear_proj": 3}


def _backprop_matrices(weights: Sequence[Weight], tp: int, norm_numel: int) -> list[tuple[int, tuple[int, ...]]]:
    """(numel, unit sizes) of the weights and the norms between them, last layer first; a norm has
    no units. Megatron registers a layer as norm, proj, qkv, norm, fc1, fc2 (``weights`` lists it
    as qkv, proj, fc1, fc2), and its buffers hold params in reverse registration order."""
    layers: dict[str, list[Weight]] = {}
    for w in weights:
        layers.setdefault(w.name.rsplit(".", 1)[0], []).append(w)
    kind = lambda w: _BACKPROP_RANK.get(w.name.rsplit(".", 1)[-1], -1)  # noqa: E731
    out: list[tuple[int, tuple[int, ...]]] = []
    for layer in reversed(layers.values()):
        for w in sorted(layer, key=kind):
            out.append((_local_numel(w, tp), _unit_sizes(w, tp)))
            if kind(w) in (1, 3):  # pre_mlp_layernorm before fc1, input_layernorm before proj
                out.append((norm_numel, ()))
    return out


def _unit_sizes(w: Weight, tp: int) -> tuple[int, ...]:
    """Elements of each unit of ``w`` on one TP rank: the fused blocks apart where they are
    contiguous (fc1's gate and up; QKV's q, k, v when the rank holds one query group), else the weight."""
    rows_div = tp if w.partition_dim == 0 else 1
    if max(1, w.row_groups // rows_div) == 1 and len(w.sub_rows) > 1:
        cols = w.cols // tp if w.partition_dim == 1 else w.cols
        return tuple(r // rows_div * cols for r in w.sub_rows)
    return (_local_numel(w, tp),)


_NS_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _stage_layouts(weights: Sequence[Weight], tp: int) -> list[MatrixLayout]:
    """The weights as the optimizer's catalogue describes them on one TP rank (every DP rank
    holding them whole: the DP exchange of a cut layout is costed apart, ``dp_cut_elements``)."""
    out = []
    for w in weights:
        pdim = w.partition_dim if tp > 1 else None
        local = shard_shape((w.rows, w.cols), pdim, tp)
        rows_div = tp if pdim == 0 else 1
        # TP gives each rank whole query groups: G/t of them, each with its share of q, k and v
        groups = max(1, w.row_groups // rows_div)
        sizes = tuple(r // w.row_groups if w.row_groups > 1 else r // rows_div for r in w.sub_rows)
        split = RowSplit(groups, sizes) if w.sub_rows else None
        out.append(MatrixLayout(w.name, local, pdim, tp, split))
    return out


def _muon_orthogonalize(weights, optimizer, tp_mode, tp, dp, hw, ns: NSOptions, dp_spans_nodes,
                        moved: int = 0) -> Cost:
    """NS plus its collectives on the busiest DP home, plus our DP owner exchange.

    The DP homes and each home's TP modes are the step plan's (``build_step_plan``: LPT on NS
    FLOPs, and ``auto``'s per-class choice over everything a home holds), not derived again here."""
    batched = optimizer == "ours"
    steps, ns_bytes = ns.steps, ns.dtype_bytes
    settings = PlanSettings(tp_mode, ns, hardware=hw if tp_mode == "auto" else None)
    plan = build_step_plan(_stage_layouts(weights, tp), dp_size=dp, tp_size=tp, settings=settings)
    busiest = Cost()
    for work in {id(w): w for w in plan.work}.values():  # without a DP exchange every DP rank shares one
        cost = Cost()
        for mode in ("owner", "duplicated", "distributed", "blockwise"):
            # owner's pipeline is costed over all its micro-groups at once (its all-to-alls per
            # group); a blocking mode runs once per micro-group, batching same shapes within it
            for group in ([None] if mode == "owner" else plan.micro_groups):
                subset = [work.subs[p] for u in (work.matrices if group is None else group)
                          for p in work.sub_positions.get(u, ()) if work.modes[p] == mode]
                if subset:
                    cost += tp_mode_cost(subset, mode, tp, hw, steps=steps, dtype_bytes=ns_bytes, batched=batched,
                                         method=ns.method)
        if cost.total_s >= busiest.total_s:
            busiest = cost
    if moved:
        # the elements off their owner travel there and back; per rank, 1/DP of them each way
        sent = 2 * moved * ns_bytes / dp
        busiest += collective_cost("all_to_all", sent, 2 * exchange.MIN_MICRO_GROUPS, dp, hw, dp_spans_nodes)
        busiest += Cost(memory_s=memory_time(2 * sent, 4, hw))
    if optimizer == "ours" and tp_mode in ("owner", "auto") and hw.comm_overlap > 0:
        # the micro-group pipeline runs the all-to-alls of some groups during the NS of others
        hidden = hw.comm_overlap * min(busiest.compute_s, busiest.comm_s)
        busiest.comm_s -= hidden
        busiest.parts["all_to_all hidden under NS (pipeline)"] -= hidden
    return busiest
