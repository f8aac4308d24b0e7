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

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    gram_block_rows,
    gram_blocks,
    method_flops,
    sharded_gram_flops,
    sharded_ns_flops,
    sharded_runs_gram,
    splits_gram,
)
from . import exchange
from .owners import plan_owners, rank_loads

__all__ = ["DISTRIBUTED_SUM_BYTES", "GPU_PROFILES", "Cost", "Hardware", "collective_cost", "collective_time",
           "distributed_cost", "memory_time", "ns_time", "split_dim", "tp_mode_cost"]

# Kernels one batched NS call launches: 3 GEMMs per iteration plus the norm, the divide, the
# cast and the transpose around the loop.
_NS_KERNELS_PER_STEP = 3
_NS_KERNELS_FIXED = 4

DISTRIBUTED_SUM_BYTES = 4
"""bytes per element of the distributed mode's all-reduces (its Grams, scale and norm): they run
in fp32 whatever the NS dtype (``parallel.tp_modes.REDUCE_DTYPE``); B's row gathers stay in it."""


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
    all_reduce_step_s: float | None = None
    """fixed seconds of one step of a ring all-reduce that carries a payload (a Gram matrix, not a
    scalar): a call on t ranks runs 2(t − 1) dependent steps, so on gloo a 256 KiB all-reduce
    costs several times a 4-byte one, and more on more ranks; None: ``collective_latency_s`` per
    call (NCCL's, and every vendor profile's)."""
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
                    spans_nodes: bool | None = None, *, scalars: bool = False) -> float:
    """Seconds for ``calls`` collectives of one primitive moving ``bytes_sent`` from the busiest rank
    (``scalars``: each call moves a few numbers, as the distributed mode's norm all-reduces)."""
    if group_size <= 1 or calls == 0:
        return 0.0
    # a broadcast is a pipelined ring on NCCL, as its all-gather: the all-gather's efficiency
    efficiency = {"all_gather": hw.all_gather_efficiency, "all_reduce": hw.all_reduce_efficiency,
                  "all_to_all": hw.all_to_all_efficiency, "broadcast": hw.all_gather_efficiency}[primitive]
    latency = hw.collective_latency_s
    if primitive == "all_reduce" and not scalars and hw.all_reduce_step_s is not None:
        latency = 2 * (group_size - 1) * hw.all_reduce_step_s
    return calls * latency + bytes_sent / (hw.bandwidth(group_size, spans_nodes) * efficiency)


def memory_time(bytes_touched: float, kernels: int, hw: Hardware) -> float:
    """Seconds for elementwise passes touching ``bytes_touched`` in ``kernels`` launches."""
    return bytes_touched / hw.memory_bandwidth + kernels * hw.kernel_overhead_s


def split_dim(m: MatrixLayout) -> int | None:
    """The dim ``m`` is cut along across its TP group; None when every rank holds it whole."""
    return m.partition_dim if m.is_sharded else None


def _shape_groups(matrices: Sequence[MatrixLayout], tp: int) -> dict[tuple, list[int]]:
    """Matrices that one batched call handles together (same shape and split), as the modes batch."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        if m.is_sharded and m.tp_size != tp:
            raise ValueError(f"tp_mode_cost: {m.name} is split over {m.tp_size} ranks, costed for {tp}")
        groups.setdefault((*m.full_shape, split_dim(m)), []).append(i)
    return groups


# ---- one orthogonalize_sharded call ---------------------------------------------------------


def tp_mode_cost(matrices: Sequence[MatrixLayout], mode: str, tp: int, hw: Hardware, *, steps: int = 5,
                 dtype_bytes: int = 2, spans_nodes: bool | None = None, batched: bool = True,
                 method: str = "standard") -> Cost:
    """Cost of ``orthogonalize_sharded(mode=...)`` over ``matrices`` on a TP group of ``tp`` ranks.

    ``matrices``: the sub-matrices Newton–Schulz runs on (``MatrixLayout.sub_matrices``), each
    split over ``tp`` ranks or held whole.

    ``batched=False`` models an implementation that calls NS and its collective once per matrix
    (megatron-core's ``TensorParallelMuon``) instead of once per same-shape group. ``method``:
    ``NSOptions.method`` (Gram Newton–Schulz's FLOPs where it runs, and in distributed mode its
    one Gram all-reduce per restart block).
    """
    if not matrices:
        return Cost()
    groups = _shape_groups(matrices, tp)
    if mode == "owner":
        return _owner_cost(matrices, tp, hw, steps, dtype_bytes, spans_nodes, method)
    cost = Cost()
    replicated: list[MatrixLayout] = []
    for (rows, cols, pdim), members in groups.items():
        n = len(members)
        calls = 1 if batched else n
        local_rows, local_cols = matrices[members[0]].local_shape
        sharded = pdim is not None and tp > 1
        if mode in ("duplicated", "distributed") and tp > 1 and not sharded:
            replicated += [matrices[i] for i in members]
        elif mode == "blockwise" or not sharded:
            flops = (n * method_flops(method, local_rows, local_cols, steps) if mode == "blockwise"
                     else n * method_flops(method, rows, cols, steps))
            cost += _compute(flops, calls, hw, steps)
        elif mode == "duplicated":
            sent = n * local_rows * local_cols * dtype_bytes * (tp - 1)
            # join the gathered shards and cut the result back: two copies of the full batch
            copies = memory_time(2 * 2 * n * rows * cols * dtype_bytes, 2 * calls, hw)
            cost += collective_cost("all_gather", sent, calls, tp, hw, spans_nodes) + Cost(memory_s=copies)
            cost += _compute(n * method_flops(method, rows, cols, steps), calls, hw, steps)
        elif mode == "distributed":
            k = cols if pdim == 0 else rows  # the unsharded dim spans the Gram matrix
            cost += distributed_cost(k, local_rows * local_cols // k, tp, hw, n=n, calls=calls, steps=steps,
                                     dtype_bytes=dtype_bytes, spans_nodes=spans_nodes, method=method)
        else:
            raise ValueError(f"tp_mode_cost: unknown mode {mode!r}; expected duplicated, distributed, "
                             f"blockwise or owner")
    if replicated:
        cost += _replicated_cost(replicated, tp, hw, steps, dtype_bytes, spans_nodes, method, batched)
    return cost


def _replicated_cost(matrices: Sequence[MatrixLayout], tp: int, hw: Hardware, steps: int, dtype_bytes: int,
                     spans_nodes, method: str, batched: bool) -> Cost:
    """Replicated matrices in the duplicated and distributed modes: each computed on one TP rank
    (the plan's LPT over them, ``plan_owners``) and broadcast from it, one broadcast per owner
    (per matrix unbatched). The busiest rank computes its load; every rank takes part in every
    broadcast (a ring forwards each result through all of them), while only the source counts the
    bytes (``comm.py``)."""
    costs = [method_flops(method, *m.full_shape, steps) for m in matrices]
    owners = plan_owners(costs, tp)
    loads = rank_loads(costs, owners, tp)
    sent = [0.0] * tp
    batches: list[set] = [set() for _ in range(tp)]
    for m, owner in zip(matrices, owners):
        sent[owner] += m.numel * dtype_bytes
        batches[owner].add(m.full_shape)
    busiest = max(range(tp), key=lambda r: ns_time(loads[r], len(batches[r]), hw, steps))
    calls = sum(1 for b in sent if b) if batched else len(matrices)
    cost = _compute(loads[busiest], len(batches[busiest]) if batched else owners.count(busiest), hw, steps)
    cast = collective_cost("broadcast", sum(sent), calls, tp, hw, spans_nodes)
    cast.bytes_sent_max = max(sent)
    return cost + cast


def distributed_cost(k: int, cols: int, tp: int, hw: Hardware, *, n: int = 1, calls: int = 1, steps: int = 5,
                     dtype_bytes: int = 2, spans_nodes: bool | None = None, method: str = "standard") -> Cost:
    """The distributed mode on ``n`` same-shape matrices in ``calls`` batched calls, each rank
    holding a ``k × cols`` column shard whose Gram (k × k) spans the whole matrix: its share of
    NS, the Gram all-reduces and, where B's rows are split, their all-gathers (the Gram form of
    ``method="gram"``: one Gram per restart block and one scalar, the k × k iteration whole). The
    all-reduces move fp32 (``DISTRIBUTED_SUM_BYTES``), B's rows ``dtype_bytes``."""
    ring = 2 * (tp - 1) / tp * n * DISTRIBUTED_SUM_BYTES
    cost = Cost()
    if sharded_runs_gram(method, k, cols, tp):
        grams = len(gram_blocks([None] * steps, DEFAULT_GRAM_RESTARTS))
        cost += collective_cost("all_reduce", ring * grams * k * k, calls * grams, tp, hw, spans_nodes)
        cost += collective_cost("all_reduce", ring, calls, tp, hw, spans_nodes, scalars=True)
        return cost + _compute(n * sharded_gram_flops(k, cols, steps), calls, hw, steps)
    # per matrix: `steps` k×k Grams, and two scalars (the power-of-two scale, the squared norm)
    cost += collective_cost("all_reduce", ring * steps * k * k, calls * steps, tp, hw, spans_nodes)
    cost += collective_cost("all_reduce", ring * 2, calls * 2, tp, hw, spans_nodes, scalars=True)
    if splits_gram(k, cols, tp):  # B's row blocks, all-gathered every step
        gathered = n * steps * (tp - 1) * gram_block_rows(k, tp) * k * dtype_bytes
        cost += collective_cost("all_gather", gathered, calls * steps, tp, hw, spans_nodes)
    return cost + _compute(n * sharded_ns_flops(k, cols, steps, tp), calls, hw, steps)


def _compute(flops: float, batches: int, hw: Hardware, steps: int) -> Cost:
    seconds = ns_time(flops, batches, hw, steps)
    return Cost(compute_s=seconds, ns_flops_max=flops, parts=Counter({"ns": seconds}))


def collective_cost(primitive: str, sent: float, calls: int, group: int, hw: Hardware, spans_nodes, *,
                    scalars: bool = False) -> Cost:
    seconds = collective_time(primitive, sent, calls, group, hw, spans_nodes, scalars=scalars)
    return Cost(comm_s=seconds, bytes_sent_max=sent if group > 1 else 0.0, parts=Counter({primitive: seconds}))


def _owner_cost(matrices, tp, hw, steps, dtype_bytes, spans_nodes, method: str = "standard") -> Cost:
    """Owner mode: LPT owners (the real ``plan_owners``), two all-to-alls per micro-group
    (``exchange.MIN_MICRO_GROUPS`` of them: the count the pipeline uses below its byte cap),
    NS on the owners.

    The all-to-all's time is the busiest rank's max of bytes sent and received: an owner
    receives (t−1) shards of each matrix it owns and sends (t−1) slices back.
    """
    costs = [method_flops(method, *m.full_shape, steps) for m in matrices]
    owners = plan_owners(costs, tp)
    loads = rank_loads(costs, owners, tp)
    sent, received = [0.0] * tp, [0.0] * tp
    batches = [set() for _ in range(tp)]
    for m, owner in zip(matrices, owners):
        batches[owner].add(m.full_shape)
        if tp == 1:
            continue
        if not m.is_sharded:  # the owner computes, every other rank receives the result
            received_back = m.numel * dtype_bytes
            sent[owner] += (tp - 1) * received_back
            for r in range(tp):
                if r != owner:
                    received[r] += received_back
            continue
        shard = m.numel * dtype_bytes  # the TP-local shard
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
        cost += collective_cost("all_to_all", traffic, calls, tp, hw, spans_nodes)
        cost.bytes_sent_max = max(sent)
        # pack the send buffer and unpack the receive buffer, both ways
        cost += Cost(memory_s=memory_time(2 * 2 * traffic, 4, hw))
    return cost
