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
from dataclasses import dataclass, field

from ..core.matrix_layout import MatrixLayout
from .hardware import Hardware

__all__ = ["Cost", "call_latency", "collective_cost", "collective_time", "link_time",
           "memory_time", "ns_time", "split_dim"]

# Kernels one batched NS call launches: 3 GEMMs per iteration plus the norm, the divide, the
# cast and the transpose around the loop.
_NS_KERNELS_PER_STEP = 3
_NS_KERNELS_FIXED = 4


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
    return (call_latency(primitive, calls, group_size, hw, scalars=scalars)
            + link_time(primitive, bytes_sent, group_size, hw, spans_nodes))


def link_time(primitive: str, nbytes: float, group_size: int, hw: Hardware, spans_nodes: bool | None = None) -> float:
    """Seconds a rank's link spends moving ``nbytes`` in one primitive, without call latencies."""
    if group_size <= 1 or not nbytes:
        return 0.0
    # a broadcast is a pipelined ring on NCCL, as its all-gather: the all-gather's efficiency
    efficiency = {"all_gather": hw.all_gather_efficiency, "all_reduce": hw.all_reduce_efficiency,
                  "all_to_all": hw.all_to_all_efficiency, "broadcast": hw.all_gather_efficiency}[primitive]
    return nbytes / (hw.bandwidth(group_size, spans_nodes) * efficiency)


def call_latency(primitive: str, calls: int, group_size: int, hw: Hardware, *, scalars: bool = False) -> float:
    """Fixed seconds of ``calls`` collectives on ``group_size`` ranks (a ring all-reduce with a
    payload: its 2(t − 1) dependent steps where the profile measures them)."""
    if group_size <= 1:
        return 0.0
    latency = hw.collective_latency_s
    if primitive == "all_reduce" and not scalars and hw.all_reduce_step_s is not None:
        latency = 2 * (group_size - 1) * hw.all_reduce_step_s
    return calls * latency


def memory_time(bytes_touched: float, kernels: int, hw: Hardware) -> float:
    """Seconds for elementwise passes touching ``bytes_touched`` in ``kernels`` launches."""
    return bytes_touched / hw.memory_bandwidth + kernels * hw.kernel_overhead_s


def split_dim(m: MatrixLayout) -> int | None:
    """The dim ``m`` is cut along across its TP group; None when every rank holds it whole."""
    return m.partition_dim if m.is_sharded else None


def collective_cost(primitive: str, sent: float, calls: int, group: int, hw: Hardware, spans_nodes, *,
                    scalars: bool = False) -> Cost:
    seconds = collective_time(primitive, sent, calls, group, hw, spans_nodes, scalars=scalars)
    return Cost(comm_s=seconds, bytes_sent_max=sent if group > 1 else 0.0, parts=Counter({primitive: seconds}))
