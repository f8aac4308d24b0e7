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

``hardware.hardware_profile`` turns ``--muon-auto-hardware`` into the ``Hardware`` constants the
model uses.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions
from .cost_model import split_dim
from .grid_schedule import schedule_grid
from .hardware import Hardware
from .mode_cost import tp_mode_cost

__all__ = ["choose_tp_modes", "predicted_time"]

_DEFAULT_NS = NSOptions()


def choose_tp_modes(matrices: Sequence[MatrixLayout], tp: int, hw: Hardware, ns: NSOptions = _DEFAULT_NS) -> list[str]:
    """Per matrix, the exact TP mode ``auto`` runs it in on one TP group (no DP).

    Args:
        matrices: every sub-matrix of one TP group's list (``MatrixLayout``s split over ``tp``
            ranks or held whole), in call order; only their full shape and split matter.
        tp: TP group size.
        hw: the hardware constants of the cost model.
        ns: the Newton–Schulz settings (iterations, method, element size of the shards).

    Returns:
        one of ``AUTO_CANDIDATES`` per matrix: ``grid_schedule.schedule_grid`` on one DP group.
        Deterministic: a pure function of the arguments; cached.
    """
    if tp < 1:
        raise ValueError(f"choose_tp_modes: tp must be >= 1, got {tp}")
    key = tuple((*m.full_shape, split_dim(m)) for m in matrices)
    return list(_choose(key, int(tp), hw, ns))


def predicted_time(matrices: Sequence[MatrixLayout], modes: Sequence[str], tp: int, hw: Hardware,
                   ns: NSOptions = _DEFAULT_NS) -> float:
    """Predicted seconds of running ``matrices[i]`` in ``modes[i]``: the sum of the sub-calls."""
    total = 0.0
    for mode in dict.fromkeys(modes):  # first-seen order; the sum does not depend on it
        subset = [m for m, x in zip(matrices, modes, strict=True) if x == mode]
        total += tp_mode_cost(subset, mode, tp, hw, ns).total_s
    return total


@functools.lru_cache(maxsize=256)
def _choose(key: tuple, tp: int, hw: Hardware, ns: NSOptions) -> tuple[str, ...]:
    matrices = [MatrixLayout.from_full_shape(f"{r}x{c}", (r, c), p, tp if p is not None else 1) for r, c, p in key]
    schedule = schedule_grid(matrices, 1, tp, hw, ns)
    return tuple(modes[0] for modes in schedule.modes)
