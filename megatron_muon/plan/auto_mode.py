"""``--muon-tp-mode auto``: the cheapest exact plan by the cost model, and its hardware constants.

Pure (no Megatron, no torch.distributed): every rank computes the same choice from the same
shapes without communicating, which is what lets the sub-modes' collectives line up.

Only exact modes are candidates — owner, duplicated and distributed — so ``auto`` is exact Muon,
whatever it picks; blockwise is never chosen. The step plan (``step_plan.build_step_plan``) asks
``grid_schedule.schedule_grid`` for the whole stage's TP × DP grid at once: which DP group runs
each unit and, per sub-matrix, whether it runs narrow (``owner``: on one TP rank) or wide
(``distributed`` or ``duplicated``: on the whole TP group), minimizing the busiest rank's predicted
seconds. ``choose_tp_modes`` is its one-TP-group case, for a call without DP
(``orthogonalize_sharded``, the benchmarks).

A replicated matrix (partition_dim None, or any matrix when tp = 1) has no distributed form. At
tp > 1 it runs on one TP rank, in duplicated mode (its result broadcast from there), never on every
rank: the copies must stay bitwise equal, and each rank's GEMMs may pick other kernels.

``hardware_profile`` turns ``--muon-auto-hardware`` into the ``Hardware`` constants the model uses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path

from ..core.matrix_layout import MatrixLayout
from .cost_model import GPU_PROFILES, Hardware, split_dim, tp_mode_cost
from .grid_schedule import schedule_grid

__all__ = ["AUTO_CANDIDATES", "CPU_GLOO", "choose_tp_modes", "hardware_profile", "predicted_time"]

AUTO_CANDIDATES = ("owner", "duplicated", "distributed")
"""the modes ``auto`` chooses among."""

# An order-of-magnitude default for CPU ranks talking over gloo (a few cores per rank, loopback
# or Ethernet), not a measurement of any one machine: it makes ``auto`` runnable on CPU (tests,
# laptops). For choices that matter, calibrate the machine and pass the JSON file with
# ``--muon-auto-hardware PATH`` (``scripts/bench/calibrate_hardware.py``).
CPU_GLOO = Hardware(
    name="cpu-gloo",
    source="megatron_muon.plan.auto_mode.CPU_GLOO: order-of-magnitude default for CPU ranks over gloo "
    "(not measured); pass a calibrated JSON with --muon-auto-hardware",
    matmul_flops=50e9,
    memory_bandwidth=5e9,
    intra_node_bandwidth=2e9,
    inter_node_bandwidth=2e9,
    collective_latency_s=50e-6,
    kernel_overhead_s=10e-6,
    ranks_per_node=1024,
)

_FLAG = "--muon-auto-hardware"


# ---- the choice ------------------------------------------------------------------------------


def choose_tp_modes(
    matrices: Sequence[MatrixLayout], tp: int, hw: Hardware, *, steps: int = 5, dtype_bytes: int = 2
) -> list[str]:
    """Per matrix, the exact TP mode ``auto`` runs it in on one TP group (no DP).

    Args:
        matrices: every sub-matrix of one TP group's list (``MatrixLayout``s split over ``tp``
            ranks or held whole), in call order; only their full shape and split matter.
        tp: TP group size.
        hw: the hardware constants of the cost model.
        steps: Newton–Schulz steps.
        dtype_bytes: element size of the shards (2 for bf16).

    Returns:
        one of ``AUTO_CANDIDATES`` per matrix: ``grid_schedule.schedule_grid`` on one DP group.
        Deterministic: a pure function of the arguments; cached.
    """
    if tp < 1:
        raise ValueError(f"choose_tp_modes: tp must be >= 1, got {tp}")
    key = tuple((*m.full_shape, split_dim(m)) for m in matrices)
    return list(_choose(key, int(tp), hw, int(steps), int(dtype_bytes)))


def predicted_time(
    matrices: Sequence[MatrixLayout], modes: Sequence[str], tp: int, hw: Hardware, *, steps: int = 5,
    dtype_bytes: int = 2,
) -> float:
    """Predicted seconds of running ``matrices[i]`` in ``modes[i]``: the sum of the sub-calls."""
    total = 0.0
    for mode in dict.fromkeys(modes):  # first-seen order; the sum does not depend on it
        subset = [m for m, x in zip(matrices, modes, strict=True) if x == mode]
        total += tp_mode_cost(subset, mode, tp, hw, steps=steps, dtype_bytes=dtype_bytes).total_s
    return total


@functools.lru_cache(maxsize=256)
def _choose(key: tuple, tp: int, hw: Hardware, steps: int, dtype_bytes: int) -> tuple[str, ...]:
    matrices = [MatrixLayout.from_full_shape(f"{r}x{c}", (r, c), p, tp if p is not None else 1) for r, c, p in key]
    schedule = schedule_grid(matrices, 1, tp, hw, steps=steps, dtype_bytes=dtype_bytes)
    return tuple(modes[0] for modes in schedule.modes)


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
        elif n == "comm_overlap":
            ok, want = _number(value) and 0 <= value <= 1, "a number in [0, 1]"
        else:
            ok, want = _number(value) and value > 0, "a number > 0"
        if not ok:
            raise ValueError(f"{prefix}: field {n} must be {want}, got {value!r}")
    return Hardware(**{n: float(v) if _number(v) and n != "ranks_per_node" else v for n, v in data.items()})


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value != float("inf")
