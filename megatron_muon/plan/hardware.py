"""The cost model's hardware constants: one ``Hardware`` per machine type, the shipped profiles, and
``--muon-auto-hardware``'s reading of them.

Every field is measured or quoted, never fitted: vendor figures for the GPU profiles (each
``source`` says which), an order-of-magnitude default for CPU ranks over gloo, or a JSON file of
the fields that ``scripts/bench/calibrate_hardware.py`` writes. The pricing
(``pricing.seconds``) and the step model (``step_cost``) read them; ``auto`` plans on them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["CPU_GLOO", "GPU_PROFILES", "Hardware", "hardware_profile"]


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
    """fixed seconds per collective call (synchronisation, protocol, launch), as a step pays it:
    after compute, where the ranks arrive apart (``calibrate_hardware`` times each call after a
    GEMM)."""
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
    fused_adam: bool = True
    """Adam runs as a fused multi-tensor kernel (Transformer Engine's or apex's ``FusedAdam``, what
    Megatron picks wherever they are installed: every GPU profile), and the grad clip's scale as
    their multi-tensor scale; False: torch's single-tensor ``AdamW`` and megatron-core's
    ``local_multi_tensor_scale`` (a product into a temporary, copied back), its fallbacks without
    them (a CPU rank: ``CPU_GLOO``, and what ``calibrate_hardware`` writes on gloo). ``step_cost``
    counts each one's passes."""
    solo_gather_bandwidth: float | None = None
    """bytes/s of an all-gather over a group of one rank, in place: Megatron's param all-gather
    at DP 1, which its distributed optimizer still calls. Gloo copies the buffer through its own
    (about 2 ms for 8 MiB per rank with two ranks on the 2-core benchmark machine); None: free,
    as NCCL copies nothing for an in-place all-gather on one rank (every vendor profile)."""

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


# An order-of-magnitude default for CPU ranks talking over gloo (a few cores per rank, loopback
# or Ethernet), not a measurement of any one machine: it makes ``auto`` runnable on CPU (tests,
# laptops). For choices that matter, calibrate the machine and pass the JSON file with
# ``--muon-auto-hardware PATH`` (``scripts/bench/calibrate_hardware.py``).
CPU_GLOO = Hardware(
    name="cpu-gloo",
    source="megatron_muon.plan.hardware.CPU_GLOO: order-of-magnitude default for CPU ranks over gloo "
    "(not measured); pass a calibrated JSON with --muon-auto-hardware",
    matmul_flops=50e9,
    memory_bandwidth=5e9,
    intra_node_bandwidth=2e9,
    inter_node_bandwidth=2e9,
    collective_latency_s=50e-6,
    kernel_overhead_s=10e-6,
    ranks_per_node=1024,
    fused_adam=False,
)

_FLAG = "--muon-auto-hardware"


# ---- --muon-auto-hardware --------------------------------------------------------------------


def hardware_profile(name: str) -> Hardware:
    """The ``Hardware`` that ``--muon-auto-hardware NAME`` names.

    ``detect``: this process's device — a CUDA GPU whose name contains "H200" →
    ``GPU_PROFILES["h200"]``; any other CUDA GPU → ``GPU_PROFILES["h100-sxm"]`` (the only other
    profile shipped: on a different GPU pass a calibrated JSON for good choices); no CUDA →
    ``CPU_GLOO``. A key of ``GPU_PROFILES`` (``h100-sxm``, ``h200``) or ``cpu-gloo``: that profile.
    Anything else is read as the path of a JSON object holding the ``Hardware`` fields (what
    ``scripts/bench/calibrate_hardware.py`` writes: ``dataclasses.asdict(hw)``).

    Raises:
        ValueError naming ``--muon-auto-hardware`` and the accepted values.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{_FLAG}: expected {_expected()}, got {name!r}")
    if name == "detect":
        return _detected()
    profiles = _profiles()
    if name in profiles:
        return profiles[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"{_FLAG}: expected {_expected()}, got {name!r} (no such profile or file)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{_FLAG} {name}: not a readable JSON file of Hardware fields: {e}") from None
    return _hardware_from_dict(data, name)


def _profiles() -> dict[str, Hardware]:
    return {**GPU_PROFILES, CPU_GLOO.name: CPU_GLOO}


def _expected() -> str:
    return (f"detect, one of {sorted(_profiles())}, or the path of a JSON file of Hardware fields "
            f"(scripts/bench/calibrate_hardware.py)")


@functools.lru_cache(maxsize=1)
def _detected() -> Hardware:
    import torch

    if not torch.cuda.is_available():
        return CPU_GLOO
    if "H200" in torch.cuda.get_device_name().upper():
        return GPU_PROFILES["h200"]
    return GPU_PROFILES["h100-sxm"]


def _hardware_from_dict(data, where: str) -> Hardware:
    prefix = f"{_FLAG} {where}"
    if not isinstance(data, dict):
        raise ValueError(f"{prefix}: expected a JSON object of Hardware fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}: unknown Hardware fields {unknown}; expected {sorted(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{prefix}: missing Hardware fields {missing}")
    for n, value in data.items():
        if n in ("name", "source"):
            ok, want = isinstance(value, str), "a string"
        elif n == "ranks_per_node":
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
        elif n in ("collective_latency_s", "kernel_overhead_s"):
            ok, want = _number(value) and value >= 0, "a number >= 0"
        elif n == "all_reduce_step_s":
            ok, want = value is None or (_number(value) and value >= 0), "a number >= 0 or null"
        elif n == "solo_gather_bandwidth":
            ok, want = value is None or (_number(value) and value > 0), "a number > 0 or null"
        elif n == "comm_overlap":
            ok, want = _number(value) and 0 <= value <= 1, "a number in [0, 1]"
        elif n == "fused_adam":
            ok, want = isinstance(value, bool), "true or false"
        else:
            ok, want = _number(value) and value > 0, "a number > 0"
        if not ok:
            raise ValueError(f"{prefix}: field {n} must be {want}, got {value!r}")
    return Hardware(**{n: float(v) if _number(v) and n != "ranks_per_node" else v for n, v in data.items()})


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value != float("inf")
