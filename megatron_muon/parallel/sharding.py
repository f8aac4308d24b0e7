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
    """``(t, B, m, n)`` stacked shards → ``(B, M, N)`` full matrices (concat along partition_dim)."""
    return torch.cat(list(shards.unbind(0)), dim=partition_dim + 1)


def split_full(full: torch.Tensor, partition_dim: int, group_size: int, rank: int) -> torch.Tensor:
    """``(B, M, N)`` full matrices → rank's ``(B, m, n)`` shards; the inverse of ``join_shards``."""
    return full.chunk(group_size, dim=partition_dim + 1)[rank]
