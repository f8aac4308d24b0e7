"""Shard ↔ full shape arithmetic: the one place that knows how Megatron cuts a weight over TP.

Megatron splits a 2-D weight evenly, in rank order of the TP group, along ``partition_dim``
(ColumnParallelLinear: 0, RowParallelLinear: 1; None: every TP rank holds it whole). Every
other module (the TP modes, the matrix layouts, the cost model, the benchmarks) asks here.
"""

from __future__ import annotations

__all__ = ["full_shape", "shard_shape"]


def full_shape(local_shape: tuple[int, int], partition_dim: int | None, tp_size: int) -> tuple[int, int]:
    """The whole matrix's ``(rows, cols)`` from one TP rank's ``local_shape``."""
    rows, cols = local_shape
    if partition_dim == 0:
        return (rows * tp_size, cols)
    if partition_dim == 1:
        return (rows, cols * tp_size)
    return (rows, cols)


def shard_shape(global_shape: tuple[int, int], partition_dim: int | None, tp_size: int) -> tuple[int, int]:
    """One TP rank's ``(rows, cols)`` of a whole ``global_shape`` matrix; the inverse of ``full_shape``.

    Raises ``ValueError`` when the split dimension is not a multiple of ``tp_size`` (Megatron
    refuses such a layout too).
    """
    rows, cols = global_shape
    if partition_dim is None or tp_size == 1:
        return (rows, cols)
    if partition_dim not in (0, 1):
        raise ValueError(f"shard_shape: partition_dim must be 0, 1 or None, got {partition_dim!r}")
    split = global_shape[partition_dim]
    if split % tp_size:
        raise ValueError(
            f"shard_shape: dimension {partition_dim} of shape {tuple(global_shape)} ({split}) is not "
            f"divisible by the TP size {tp_size}"
        )
    return (rows // tp_size, cols) if partition_dim == 0 else (rows, cols // tp_size)
