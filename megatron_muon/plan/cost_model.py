"""Predicted time of one optimizer step, per TP mode, from shapes, parallel sizes and hardware.

Pure functions on shapes (no torch, no Megatron): the same model drives ``--muon-tp-mode auto``
(``auto_mode.py``), the validation against measured steps (``scripts/bench/validate_cost_model.py``)
and the GPU projections (``scripts/bench/project_performance.py``). ``docs/performance.md`` has the
numbers.

What the model counts, on the slowest rank, with no overlap (our step runs its phases in
order, and so does Megatron's):

    compute   Newton–Schulz FLOPs / ``matmul_flops`` + kernels × ``kernel_overhead_s``
    comm      per collective: ``collective_latency_s`` + bytes sent / (bandwidth × efficiency),
              with bytes by ``comm.py``'s convention (what leaves a rank); the bandwidth is the
              intra-node one when the group fits in a node, the inter-node one otherwise
    memory    elementwise passes (momentum, scaling, update, Adam, grad norm, copies):
              bytes touched / ``memory_bandwidth`` + kernels × ``kernel_overhead_s``

Nothing here is fitted to optimizer-step times: ``Hardware`` constants come from
micro-measurements (``scripts/bench/calibrate_hardware.py``) or from vendor figures (``GPU_PROFILES``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..core.models import ModelShape
from ..core.newton_schulz import ns_flops
from ..core.shapes import shard_shape
from . import exchange
from .owners import plan_owners, rank_loads

__all__ = [
    "GPU_PROFILES",
    "OPTIMIZERS",
    "Cost",
    "Hardware",
    "Matrix",
    "ModelWeights",
    "Weight",
    "collective_time",
    "model_weights",
    "memory_time",
    "model_params",
    "ns_time",
    "optimizer_step_cost",
    "tp_mode_cost",
]

# Kernels one batched NS call launches: 3 GEMMs per iteration plus the norm, the divide, the
# cast and the transpose around the loop.
_NS_KERNELS_PER_STEP = 3
_NS_KERNELS_FIXED = 4


@dataclass(frozen=True)
class Hardware:
    """Per-rank constants of one machine type; every field is measured or quoted, never fitted."""

    name: str
    """short label, e.g. ``h100-sxm`` or ``cpu-gloo-2proc``."""
    source: str
    """where the numbers come from (a datasheet, or the calibration command and date)."""
    matmul_flops: float
    """FLOP/s one rank sustains on Newton–Schulz GEMMs at the NS dtype."""
    memory_bandwidth: float
    """bytes/s one rank sustains on elementwise passes (read + write counted separately)."""
    intra_node_bandwidth: float
    """bytes/s one rank sends to peers in its node (bus bandwidth, NVLink on GPUs)."""
    inter_node_bandwidth: float
    """bytes/s one rank sends to peers in other nodes (its NIC share, InfiniBand on GPUs)."""
    collective_latency_s: float
    """fixed seconds per collective call (synchronisation, protocol, launch)."""
    kernel_overhead_s: float
    """fixed seconds per compute kernel (launch latency on GPUs, dispatch on CPUs)."""
    ranks_per_node: int
    """ranks sharing one node's fast interconnect."""
    all_gather_efficiency: float = 1.0
    """achieved fraction of the bandwidth above for all-gather."""
    all_reduce_efficiency: float = 1.0
    """achieved fraction for all-reduce (by the ring convention of ``comm.py``)."""
    all_to_all_efficiency: float = 1.0
    """achieved fraction for all-to-all (the slowest rank's max of sent and received)."""
    comm_overlap: float = 0.0
    """fraction of the owner pipeline's all-to-all time hidden under Newton–Schulz (the
    micro-group pipeline, ``comm.pipelined``). 0 on the CPU: measured on the 2-core benchmark,
    where gloo's transport threads take the cores the GEMMs need, so the pipeline gains nothing;
    the GPU profiles assume 0.8 (NCCL runs on its own SMs beside cuBLAS; not measured here)."""

    def bandwidth(self, group_size: int, spans_nodes: bool | None = None) -> float:
        """Per-rank bandwidth of a group: intra-node unless it cannot fit in one node."""
        if spans_nodes is None:
            spans_nodes = group_size > self.ranks_per_node
        return self.inter_node_bandwidth if spans_nodes else self.intra_node_bandwidth


# Vendor figures; docs/performance.md explains each. NS GEMMs at 4096-wide shapes reach about
# 70% of the dense bf16 peak on Hopper (cuBLAS), which is the sustained rate used here.
_H100_SXM = Hardware(
    name="h100-sxm",
    source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16 (x0.7 sustained), 3.35 TB/s HBM3 "
    "(x0.8), NVLink 4 450 GB/s per direction (NCCL bus bw ~360 GB/s), ConnectX-7 400 Gb/s per GPU "
    "(~40 GB/s achieved), 8 GPUs per node",
    matmul_flops=0.7 * 989e12,
    memory_bandwidth=0.8 * 3.35e12,
    intra_node_bandwidth=360e9,
    inter_node_bandwidth=40e9,
    collective_latency_s=20e-6,
    kernel_overhead_s=5e-6,
    ranks_per_node=8,
    comm_overlap=0.8,
)
GPU_PROFILES: dict[str, Hardware] = {
    "h100-sxm": _H100_SXM,
    # the H200 differs only in its memory: same dies' compute, same NVLink and NICs
    "h200": replace(
        _H100_SXM,
        name="h200",
        source="NVIDIA H200 SXM datasheet: same compute and interconnect as H100 SXM, 4.8 TB/s HBM3e (x0.8)",
        memory_bandwidth=0.8 * 4.8e12,
    ),
}


@dataclass(frozen=True)
class Matrix:
    """One matrix Newton–Schulz runs on, as TP holds it: full shape plus its split."""

    rows: int
    cols: int
    partition_dim: int | None
    """0 or 1: split evenly over the TP group along that dim; None: every TP rank holds it."""

    def local_shape(self, tp: int) -> tuple[int, int]:
        return shard_shape((self.rows, self.cols), self.partition_dim, tp)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


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

    def matrices(self) -> list[Matrix]:
        return [Matrix(r, self.cols, self.partition_dim) for r in (self.sub_rows or (self.rows,))]

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass
class Cost:
    """Seconds on the slowest rank, by phase, with the counts behind them."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_s: float = 0.0
    bytes_sent_max: float = 0.0
    """bytes the busiest rank sends (``comm.py`` convention)."""
    ns_flops_max: float = 0.0
    """NS FLOPs of the busiest rank."""
    parts: Counter = field(default_factory=Counter)
    """phase label → seconds, for the breakdown tables."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.memory_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.compute_s + other.compute_s,
            self.comm_s + other.comm_s,
            self.memory_s + other.memory_s,
            self.bytes_sent_max + other.bytes_sent_max,
            self.ns_flops_max + other.ns_flops_max,
            self.parts + other.parts,
        )

    def scaled(self, factor: float) -> Cost:
        return Cost(self.compute_s * factor, self.comm_s * factor, self.memory_s * factor,
                    self.bytes_sent_max * factor, self.ns_flops_max * factor,
                    Counter({k: v * factor for k, v in self.parts.items()}))


# ---- primitives ---------------------------------------------------------------------------


def ns_time(flops: float, batches: int, hw: Hardware, steps: int = 5) -> float:
    """Seconds for ``batches`` batched NS calls totalling ``flops``."""
    kernels = batches * (_NS_KERNELS_PER_STEP * steps + _NS_KERNELS_FIXED)
    return flops / hw.matmul_flops + kernels * hw.kernel_overhead_s


def collective_time(primitive: str, bytes_sent: float, calls: int, group_size: int, hw: Hardware,
                    spans_nodes: bool | None = None) -> float:
    """Seconds for ``calls`` collectives of one primitive moving ``bytes_sent`` from the busiest rank."""
    if group_size <= 1 or calls == 0:
        return 0.0
    efficiency = {"all_gather": hw.all_gather_efficiency, "all_reduce": hw.all_reduce_efficiency,
                  "all_to_all": hw.all_to_all_efficiency}[primitive]
    return calls * hw.collective_latency_s + bytes_sent / (hw.bandwidth(group_size, spans_nodes) * efficiency)


def memory_time(bytes_touched: float, kernels: int, hw: Hardware) -> float:
    """Seconds for elementwise passes touching ``bytes_touched`` in ``kernels`` launches."""
    return bytes_touched / hw.memory_bandwidth + kernels * hw.kernel_overhead_s


def _shape_groups(matrices: Sequence[Matrix], tp: int) -> dict[tuple, list[int]]:
    """Matrices that one batched call handles together (same shape and split), as the modes batch."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((m.rows, m.cols, m.partition_dim), []).append(i)
    return groups


# ---- one orthogonalize_sharded call ---------------------------------------------------------


def tp_mode_cost(matrices: Sequence[Matrix], mode: str, tp: int, hw: Hardware, *, steps: int = 5,
                 dtype_bytes: int = 2, spans_nodes: bool | None = None, batched: bool = True) -> Cost:
    """Cost of ``orthogonalize_sharded(mode=...)`` over ``matrices`` on a TP group of ``tp`` ranks.

    ``batched=False`` models an implementation that calls NS and its collective once per matrix
    (megatron-core's ``TensorParallelMuon``) instead of once per same-shape group.
    """
    if not matrices:
        return Cost()
    if mode == "owner":
        return _owner_cost(matrices, tp, hw, steps, dtype_bytes, spans_nodes)
    cost = Cost()
    for (rows, cols, pdim), members in _shape_groups(matrices, tp).items():
        n = len(members)
        calls = 1 if batched else n
        m = matrices[members[0]]
        local_rows, local_cols = m.local_shape(tp)
        sharded = pdim is not None and tp > 1
        if mode == "blockwise" or not sharded:
            flops = (n * ns_flops(local_rows, local_cols, steps) if mode == "blockwise"
                     else n * ns_flops(rows, cols, steps))
            cost += _compute(flops, calls, hw, steps)
        elif mode == "duplicated":
            sent = n * local_rows * local_cols * dtype_bytes * (tp - 1)
            # join the gathered shards and cut the result back: two copies of the full batch
            copies = memory_time(2 * 2 * n * rows * cols * dtype_bytes, 2 * calls, hw)
            cost += _comm("all_gather", sent, calls, tp, hw, spans_nodes) + Cost(memory_s=copies)
            cost += _compute(n * ns_flops(rows, cols, steps), calls, hw, steps)
        elif mode == "distributed":
            k = cols if pdim == 0 else rows  # the unsharded dim spans the Gram matrix
            local = local_rows * local_cols
            # per matrix: the power-of-two scale, the squared norm and `steps` k×k Grams
            sent = 2 * (tp - 1) / tp * n * (steps * k * k + 2) * dtype_bytes
            cost += _comm("all_reduce", sent, calls * (steps + 2), tp, hw, spans_nodes)
            flops = n * steps * (4 * k * k * (local // k) + 2 * k ** 3)
            cost += _compute(flops, calls, hw, steps)
        else:
            raise ValueError(f"tp_mode_cost: unknown mode {mode!r}; expected duplicated, distributed, "
                             f"blockwise or owner")
    return cost


def _compute(flops: float, batches: int, hw: Hardware, steps: int) -> Cost:
    seconds = ns_time(flops, batches, hw, steps)
    return Cost(compute_s=seconds, ns_flops_max=flops, parts=Counter({"ns": seconds}))


def _comm(primitive: str, sent: float, calls: int, group: int, hw: Hardware, spans_nodes) -> Cost:
    seconds = collective_time(primitive, sent, calls, group, hw, spans_nodes)
    return Cost(comm_s=seconds, bytes_sent_max=sent if group > 1 else 0.0, parts=Counter({primitive: seconds}))


def _owner_cost(matrices, tp, hw, steps, dtype_bytes, spans_nodes) -> Cost:
    """Owner mode: LPT owners (the real ``plan_owners``), two all-to-alls per micro-group
    (``exchange.MIN_MICRO_GROUPS`` of them: the count the pipeline uses below its byte cap),
    NS on the owners.

    The all-to-all's time is the busiest rank's max of bytes sent and received: an owner
    receives (t−1) shards of each matrix it owns and sends (t−1) slices back.
    """
    costs = [ns_flops(m.rows, m.cols, steps) for m in matrices]
    owners = plan_owners(costs, tp)
    loads = rank_loads(costs, owners, tp)
    sent, received = [0.0] * tp, [0.0] * tp
    batches = [set() for _ in range(tp)]
    for m, owner in zip(matrices, owners):
        batches[owner].add((m.rows, m.cols))
        if tp == 1:
            continue
        if m.partition_dim is None:  # the owner computes, every other rank receives the result
            received_back = m.numel * dtype_bytes
            sent[owner] += (tp - 1) * received_back
            for r in range(tp):
                if r != owner:
                    received[r] += received_back
            continue
        shard = m.numel // tp * dtype_bytes
        for r in range(tp):
            if r != owner:
                sent[r] += shard  # there
                received[r] += shard  # and back
        sent[owner] += (tp - 1) * shard
        received[owner] += (tp - 1) * shard
    busiest = max(range(tp), key=lambda r: ns_time(loads[r], len(batches[r]), hw, steps))
    cost = _compute(loads[busiest], len(batches[busiest]), hw, steps)
    if tp > 1:
        # each direction moves half of a rank's total traffic; two calls per micro-group
        traffic = max(max(s, r) for s, r in zip(sent, received))
        calls = 2 * min(exchange.MIN_MICRO_GROUPS, len(matrices))
        cost += _comm("all_to_all", traffic, calls, tp, hw, spans_nodes)
        cost.bytes_sent_max = max(sent)
        # pack the send buffer and unpack the receive buffer, both ways
        cost += Cost(memory_s=memory_time(2 * 2 * traffic, 4, hw))
    return cost


# ---- one optimizer step ---------------------------------------------------------------------

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


def model_weights(model: ModelShape, *, split_fc1: bool = True) -> ModelWeights:
    """``model``'s weights as the optimizer sees them: QKV split into q, k, v (all groups of each
    together, as the optimizer batches them), fc1 into gate and up when ``split_fc1`` (ours;
    megatron-core 0.19.2 orthogonalizes fc1 whole); untied embedding and output, two norms per
    layer and the final norm to AdamW. Dense GQA models only: experts (EP, expert-DP) and MLA
    are not modeled (``scripts/dry_run.py`` measures MoE layouts instead)."""
    if model.num_experts or model.mla is not None:
        raise NotImplementedError(f"model_weights: {model.name}: the cost model covers dense models with "
                                  "grouped-query attention; MoE / MLA layouts: scripts/dry_run.py")
    sub_rows = {"linear_qkv": model.qkv_sub_rows,
                "linear_fc1": (model.ffn_hidden, model.ffn_hidden) if split_fc1 else ()}
    weights = tuple(
        Weight(name, rows, cols, pdim, sub_rows.get(name.rsplit(".", 1)[-1], ()))
        for name, rows, cols, pdim in model.matrices()
    )
    return ModelWeights(model.name, weights, adam_sharded_numel=2 * model.vocab * model.hidden,
                        adam_replicated_numel=(2 * model.num_layers + 1) * model.hidden,
                        adam_tensors=2 * model.num_layers + 3, num_layers=model.num_layers)


def model_params(model: ModelWeights) -> int:
    """Total parameter count (what 6·params·tokens uses)."""
    return sum(w.numel for w in model.weights) + model.adam_sharded_numel + model.adam_replicated_numel


def _local_numel(w: Weight, tp: int) -> int:
    return w.numel // tp if w.partition_dim is not None else w.numel


def _stage_weights(model: ModelWeights, pp: int) -> list[Weight]:
    """The weights of the first pipeline stage (stages hold equal layer counts; it also holds
    the embedding, so it is the busiest stage for the optimizer)."""
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
    mode_chooser=None,
    dp_layout: str = "megatron",
    bucket_numel: int | None = None,
) -> Cost:
    """Predicted ``optimizer.step()`` time on the busiest rank of a TP × DP × PP layout.

    ``tp_mode`` is the Muon TP mode (ignored for adam); ``"auto"`` needs ``mode_chooser``
    (``auto_mode.choose_tp_modes``) to split the matrices by mode. Stage 0 is modelled (the
    busiest: its layers plus the embedding). DP assignment of whole matrices (our DP owner plan,
    Megatron's layer-wise one) is modelled by LPT on NS FLOPs; our plan additionally pins
    matrices to the DP range holding them, which the model ignores. Ours' DP owner exchange
    moves what ``dp_cut_elements`` finds off its owner in the ``dp_layout`` buffer layout
    (``bucket_numel``: DDP's bucket size, None = one bucket).
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
        if optimizer == "ours" and dp > 1:
            moved = dp_cut_elements(weights, tp, dp, dp_layout=dp_layout, bucket_numel=bucket_numel,
                                    adam_numel=model.adam_sharded_numel // tp)[1]
        cost += _muon_orthogonalize(weights, optimizer, tp_mode, tp, dp if sharded_state else 1, hw, steps,
                                    ns_bytes, dp_spans_nodes, mode_chooser, moved)
    if clip_grad:
        shard = 1 if optimizer == "megatron-muon" else dp
        elementwise("grad norm + clip", (muon_local + adam_local) / shard * _NORM_BYTES,
                    (len(weights) + adam_tensors) * _NORM_KERNELS)
        cost += _comm("all_reduce", 0.0, 1, tp * dp * pp, hw, None)
    if dp > 1 and optimizer in ("ours", "adam"):
        # ZeRO-1: the updated fp32 shard is all-gathered into every replica's params
        cost += _comm("all_gather", (muon_local + adam_local) / dp * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
    if dp > 1 and optimizer == "megatron-layerwise":
        # Adam params through a distributed optimizer, Muon params gathered from their DP homes
        # (padded to the largest home's size)
        cost += _comm("all_gather", adam_local / dp * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
        homes = _dp_homes(weights, dp, steps)
        largest = max(sum(_local_numel(weights[i], tp) for i in home) for home in homes)
        cost += _comm("all_gather", largest * 4 * (dp - 1), 1, dp, hw, dp_spans_nodes)
    return cost


def _dp_homes(weights: Sequence[Weight], dp: int, steps: int) -> list[list[int]]:
    costs = [sum(ns_flops(m.rows, m.cols, steps) for m in w.matrices()) for w in weights]
    homes: list[list[int]] = [[] for _ in range(dp)]
    for i, r in enumerate(plan_owners(costs, dp)):
        homes[r].append(i)
    return homes


def dp_cut_elements(weights: Sequence[Weight], tp: int, dp: int, *, dp_layout: str = "megatron",
                    bucket_numel: int | None = None, adam_numel: int = 0) -> tuple[int, int]:
    """(matrices cut across DP ranks, their elements not on the rank holding the largest piece)
    in one TP rank's grad buffer; ours' DP owner exchange moves those elements there and back.

    ``balanced`` (``--muon-dp-layout balanced``): nothing is cut. ``megatron``: megatron-core's
    default layout, replayed on sizes — params in backprop order (the output layer first, the
    embedding last: ``adam_numel`` split between them; norms left out), 64-element aligned,
    a bucket closed once it holds ``bucket_numel`` elements and padded to a multiple of
    lcm(DP, 128), each bucket cut into DP equal shards.
    """
    if dp_layout == "balanced" or dp == 1:
        return 0, 0
    if dp_layout != "megatron":
        raise ValueError(f"dp_cut_elements: dp_layout {dp_layout!r}; expected 'balanced' or 'megatron'")
    sizes = [(adam_numel // 2, False)] + [(_local_numel(w, tp), True) for w in reversed(weights)]
    sizes.append((adam_numel - adam_numel // 2, False))
    divisor = math.lcm(dp, 128)
    cut = moved = 0
    bucket: list[tuple[int, int, bool]] = []  # (start, numel, is matrix) relative to the bucket
    cursor = 0

    def close() -> None:
        nonlocal cut, moved, cursor
        shard = -(-cursor // divisor) * divisor // dp
        for start, numel, is_matrix in bucket:
            first, last = start // shard, (start + numel - 1) // shard
            if is_matrix and numel and first != last:
                pieces = [min(start + numel, (r + 1) * shard) - max(start, r * shard) for r in range(first, last + 1)]
                cut += 1
                moved += numel - max(pieces)
        bucket.clear()
        cursor = 0

    for numel, is_matrix in sizes:
        start = -(-cursor // 64) * 64
        bucket.append((start, numel, is_matrix))
        cursor = start + numel
        if bucket_numel is not None and cursor >= bucket_numel:
            close()
    if bucket:
        close()
    return cut, moved


def _muon_orthogonalize(weights, optimizer, tp_mode, tp, dp, hw, steps, ns_bytes, dp_spans_nodes,
                        mode_chooser, moved: int = 0) -> Cost:
    """NS plus its collectives on the busiest DP home, plus our DP owner exchange."""
    batched = optimizer == "ours"
    busiest = Cost()
    for home in _dp_homes(weights, dp, steps):
        matrices = [m for i in home for m in weights[i].matrices()]
        if tp_mode == "auto":
            if mode_chooser is None:
                raise ValueError("optimizer_step_cost: tp_mode 'auto' needs mode_chooser")
            modes = mode_chooser(matrices, tp, hw, steps=steps, dtype_bytes=ns_bytes)
            cost = Cost()
            for mode in ("owner", "duplicated", "distributed"):
                subset = [m for m, chosen in zip(matrices, modes) if chosen == mode]
                cost += tp_mode_cost(subset, mode, tp, hw, steps=steps, dtype_bytes=ns_bytes, batched=batched)
        else:
            cost = tp_mode_cost(matrices, tp_mode, tp, hw, steps=steps, dtype_bytes=ns_bytes, batched=batched)
        if cost.total_s >= busiest.total_s:
            busiest = cost
    if moved:
        # the elements off their owner travel there and back; per rank, 1/DP of them each way
        sent = 2 * moved * ns_bytes / dp
        busiest += _comm("all_to_all", sent, 2 * exchange.MIN_MICRO_GROUPS, dp, hw, dp_spans_nodes)
        busiest += Cost(memory_s=memory_time(2 * sent, 4, hw))
    if optimizer == "ours" and tp_mode in ("owner", "auto") and hw.comm_overlap > 0:
        # the micro-group pipeline runs the all-to-alls of some groups during the NS of others
        hidden = hw.comm_overlap * min(busiest.compute_s, busiest.comm_s)
        busiest.comm_s -= hidden
        busiest.parts["all_to_all hidden under NS (pipeline)"] -= hidden
    return busiest
