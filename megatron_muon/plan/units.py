"""Units: the pieces of a step that are placed on a DP owner independently.

A weight is one parameter, but it may fuse independent matrices by rows (``RowSplit``). When
the fused blocks are contiguous in the TP-local shard (SwiGLU fc1 ``[gate; up]``: one group),
each block is its own unit: the plan may give gate and up different DP owners, so the largest
matrices of a deep pipeline stage (405B: 53248 × 16384 each) no longer have to share a TP
group. Interleaved blocks (QKV: ``[q; k; v]`` repeated per query group) stay one unit, since the
q of every group forms one matrix and a unit must hold whole matrices.

A unit is a contiguous flat range ``[start, start + numel)`` of its weight's TP-local shard,
described by its own ``MatrixLayout`` (rows of that range, no row split, DP ranges clipped to
the range and shifted to it), so every part of the plan and the exchange handles it like a
weight. Pure: no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.matrix_layout import MatrixLayout

__all__ = ["Unit", "split_units"]


@dataclass(frozen=True)
class Unit:
    """One independently placed piece of a weight."""

    weight: int
    """index of its weight in the plan's ``matrices``."""
    block: int
    """which of the weight's units it is (0 for a weight that is one unit)."""
    start: int
    """offset of its first element in the weight's TP-local flat shard."""
    layout: MatrixLayout
    """the unit as a matrix: its TP-local rows, its split (QKV's, kept whole) and its DP ranges
    relative to ``start``."""

    def slice_of(self, weight_range: tuple[int, int]) -> tuple[int, int]:
        """``[lo, hi)`` of a DP rank's piece of the weight (its flat ``weight_range``) that lies in
        this unit, relative to the piece: empty (lo == hi) when they do not overlap."""
        a, b = weight_range
        lo = min(max(self.start, a), b) - a
        hi = max(min(self.start + self.layout.numel, b), a) - a
        return lo, max(lo, hi)


def split_units(weights: Sequence[MatrixLayout]) -> tuple[Unit, ...]:
    """The units of ``weights``, weight by weight, blocks in row order (so a rank's pieces of a
    weight's units, concatenated in this order, are its piece of the weight)."""
    units: list[Unit] = []
    for i, layout in enumerate(weights):
        split = layout.split
        if split is None or split.groups != 1 or len(split.sizes) == 1:
            units.append(Unit(i, 0, 0, layout))
            continue
        cols = layout.local_shape[1]
        start = 0
        for k, rows in enumerate(split.sizes):
            numel = rows * cols
            units.append(Unit(i, k, start, replace(layout, name=f"{layout.name}[{k}]", local_shape=(rows, cols),
                                                   split=None, dp_ranges=_clip(layout.dp_ranges, start, numel))))
            start += numel
    return tuple(units)


def _clip(ranges: tuple[tuple[int, int], ...] | None, start: int, numel: int):
    """DP ranges of a weight restricted to ``[start, start + numel)`` and shifted to it."""
    if ranges is None:
        return None
    out = []
    for a, b in ranges:
        lo, hi = max(a, start), min(b, start + numel)
        out.append((lo - start, hi - start) if hi > lo else (0, 0))
    return tuple(out)
