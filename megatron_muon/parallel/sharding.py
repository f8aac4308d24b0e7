"""How a TP shard relates to its full matrix: shapes, layouts and batching keys.

Megatron splits a weight evenly in rank order of the TP group along ``partition_dim``
(ColumnParallelLinear: 0, RowParallelLinear: 1); the shape arithmetic itself is
``core.shapes``. Here: how the TP modes and the owner mode batch, stack and unstack shards.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..core.shapes import full_shape

__all__ = [
    "ShardSpec",
    "group_by",
    "join_shards",
    "matrix_to_owner_buffer",
    "owner_buffer_to_matrix",
    "split_full",
]


@dataclass(frozen=True)
class ShardSpec:
    """One matrix as this rank sees it."""

    index: int
    """position in the caller's list (used in error messages and to put results back)."""
    local_shape: tuple[int, int]
    """shape of this rank's shard."""
    partition_dim: int | None
    """0 (row shards), 1 (column shards) or None (every rank holds the whole matrix)."""
    group_size: int
    """number of shards the full matrix is split into."""

    @property
    def full_shape(self) -> tuple[int, int]:
        return full_shape(self.local_shape, self.partition_dim, self.group_size)

    @property
    def is_sharded(self) -> bool:
        return self.partition_dim is not None and self.group_size > 1

    def describe(self) -> str:
        return f"matrix {self.index} (local shape {self.local_shape}, partition_dim {self.partition_dim})"


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


def owner_buffer_to_matrix(buf: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Flat owner buffer (the shards' flat copies concatenated in rank order) → full matrix.

    Row shards concatenate into the row-major full matrix directly; column shards form a
    ``(t, m, n/t)`` block that must be permuted into ``(m, t·n/t)``.
    """
    m, n = spec.local_shape
    if spec.partition_dim == 1 and spec.group_size > 1:
        return buf.view(spec.group_size, m, n).permute(1, 0, 2).reshape(spec.full_shape)
    return buf.view(spec.full_shape)


def matrix_to_owner_buffer(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Full matrix → flat owner buffer; the inverse of ``owner_buffer_to_matrix``."""
    m, n = spec.local_shape
    if spec.partition_dim == 1 and spec.group_size > 1:
        return full.reshape(m, spec.group_size, n).permute(1, 0, 2).reshape(-1)
    return full.reshape(-1)
