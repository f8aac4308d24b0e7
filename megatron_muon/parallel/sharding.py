"""How a TP shard relates to its full matrix: shapes, layouts and batching keys.

Megatron splits a weight evenly in rank order of the TP group along ``partition_dim``
(ColumnParallelLinear: 0, RowParallelLinear: 1); the shape arithmetic itself is
``core.shapes``. Here: how the TP modes and the owner mode batch, stack and unstack shards.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["group_by", "join_shards", "split_full"]


def group_by(items: Sequence, key) -> dict[Hashable, list]:
    """Bucket ``items`` by ``key(item)``, keeping first-seen key order and item order.

    Same-key matrices are orthogonalized as one stacked batch: fewer collectives and kernel
    launches (the batching idea of microsoft/dion's megabatch_base.py).
    """
    groups: dict[Hashable, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def join_shards(shards: torch.Tensor, partition_dim: int) -> torch.Tensor:
    """``(t, B, m, n)`` stacked shards (rank-major, as an all-gather into one tensor lays them out)
    → ``(B, M, N)`` full matrices, the t shards of each side by side along ``partition_dim``. A
    view where the memory already is in that order (one matrix split by rows), else one copy."""
    t, n, rows, cols = shards.shape
    if partition_dim == 0:
        return shards.transpose(0, 1).reshape(n, t * rows, cols)
    return shards.permute(1, 2, 0, 3).reshape(n, rows, t * cols)


def split_full(full: torch.Tensor, partition_dim: int, group_size: int, rank: int) -> torch.Tensor:
    """``(B, M, N)`` full matrices → rank's ``(B, m, n)`` shards; the inverse of ``join_shards``."""
    return full.chunk(group_size, dim=partition_dim + 1)[rank]
