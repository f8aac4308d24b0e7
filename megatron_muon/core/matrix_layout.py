"""Where the pieces of one Muon matrix live across tensor and data parallelism.

A Megatron weight reaches the optimizer cut twice:
  * TP: each tensor-parallel rank holds a ``local_shape`` shard, split evenly along
    ``partition_dim`` (0 for ColumnParallel, 1 for RowParallel, None when not TP-split);
  * DP: with the distributed optimizer each data-parallel rank holds one contiguous flat range
    of that TP-local shard (``dp_ranges``; possibly empty, possibly cutting rows); without it
    every DP rank holds all of it (``dp_ranges`` None).
A fused weight may also hold several independent matrices stacked by rows (``RowSplit``):
QKV per query group ``[q; k; v] × groups`` and SwiGLU fc1 ``[gate; up]``. Each sub-matrix is
itself TP-sharded along the same ``partition_dim``, because TP gives every rank whole query
groups and matching halves of gate and up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .newton_schulz import method_flops
from .shapes import full_shape, shard_shape

__all__ = ["MatrixLayout", "RowSplit"]


@dataclass(frozen=True)
class RowSplit:
    """Rows of a TP-local weight, viewed as ``(groups, sum(sizes))``, split along ``sizes``."""

    groups: int
    """number of repeats of the row pattern (query groups on this TP rank; 1 for fc1)."""
    sizes: tuple[int, ...]
    """rows of each sub-matrix per group, e.g. (q, k, v) rows of one query group."""


@dataclass(frozen=True)
class MatrixLayout:
    """One Muon-managed parameter as the optimizer sees it on this rank."""

    name: str
    """the parameter's name, for error messages."""
    local_shape: tuple[int, int]
    """shape of this TP rank's shard of the weight."""
    partition_dim: int | None
    """TP split dimension of the weight (None: every TP rank holds it whole)."""
    tp_size: int
    """tensor-parallel group size."""
    split: RowSplit | None = None
    """independent sub-matrices fused in the rows (None: one matrix)."""
    dp_ranges: tuple[tuple[int, int], ...] | None = None
    """per DP rank, the [start, end) flat range of the TP-local shard it holds; None: all of it."""

    @classmethod
    def from_full_shape(cls, name: str, full: tuple[int, int], partition_dim: int | None,
                        tp_size: int) -> MatrixLayout:
        """The TP-local layout of a whole ``full`` matrix split along ``partition_dim`` over ``tp_size``
        ranks (a paper model's matrix, or a class of same-shape matrices)."""
        return cls(name, shard_shape(tuple(full), partition_dim, tp_size), partition_dim, tp_size)

    @property
    def numel(self) -> int:
        """elements of this TP rank's shard (``full_shape`` for the whole matrix's)."""
        return self.local_shape[0] * self.local_shape[1]

    @property
    def full_shape(self) -> tuple[int, int]:
        """shape of the whole weight across the TP group."""
        return full_shape(self.local_shape, self.partition_dim, self.tp_size)

    @property
    def is_sharded(self) -> bool:
        """cut across more than one TP rank."""
        return self.partition_dim is not None and self.tp_size > 1

    def sub_matrices(self) -> tuple[MatrixLayout, ...]:
        """The independent matrices Newton–Schulz runs on: one per fused row block (itself when
        there is none), each TP-sharded like the weight, with no DP ranges (the DP owner holds the
        whole TP-local shard before it splits the rows)."""
        if self.split is None and self.dp_ranges is None:
            return (self,)
        shapes = self.sub_local_shapes()
        if len(shapes) == 1:
            return (MatrixLayout(self.name, shapes[0], self.partition_dim, self.tp_size),)
        return tuple(MatrixLayout(f"{self.name}[{k}]", shape, self.partition_dim, self.tp_size)
                     for k, shape in enumerate(shapes))

    # ---- sub-matrices ----------------------------------------------------------------------
    def _sizes(self) -> tuple[int, tuple[int, ...]]:
        if self.split is None:
            return 1, (self.local_shape[0],)
        return self.split.groups, self.split.sizes

    def sub_local_shapes(self) -> list[tuple[int, int]]:
        groups, sizes = self._sizes()
        return [(groups * s, self.local_shape[1]) for s in sizes]

    def sub_global_shapes(self) -> list[tuple[int, int]]:
        return [full_shape(s, self.partition_dim, self.tp_size) for s in self.sub_local_shapes()]

    def split_rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """TP-local ``(rows, cols)`` → its sub-matrices (views when there is no interleaving)."""
        groups, sizes = self._sizes()
        if groups == 1:
            return list(x.split(sizes, dim=0))
        return [s.reshape(-1, x.shape[1]) for s in x.view(groups, sum(sizes), x.shape[1]).split(sizes, dim=1)]

    def join_rows(self, subs: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``split_rows``."""
        groups, sizes = self._sizes()
        cols = self.local_shape[1]
        if groups == 1:
            return torch.cat(subs, dim=0)
        return torch.cat([s.view(groups, n, cols) for s, n in zip(subs, sizes)], dim=1).view(self.local_shape)

    def row_values(self, per_sub: list[float], device: torch.device) -> torch.Tensor:
        """A length-``rows`` fp32 vector on ``device`` giving each TP-local row its sub-matrix's value."""
        groups, sizes = self._sizes()
        pattern = torch.cat([torch.full((n,), v, dtype=torch.float32, device=device)
                             for n, v in zip(sizes, per_sub)])
        return pattern.repeat(groups)

    def ns_cost(self, steps: int, method: str = "standard") -> int:
        """NS FLOPs of the whole (global) sub-matrices with ``method`` (``--muon-ns-method``): what
        the owner's TP group must do."""
        return sum(method_flops(method, r, c, steps) for r, c in self.sub_global_shapes())

    # ---- DP pieces --------------------------------------------------------------------------
    def holders(self, dp_size: int) -> dict[int, int]:
        """DP rank → elements it holds (only ranks that hold something)."""
        if self.dp_ranges is None:
            return {r: self.numel for r in range(dp_size)}
        return {r: e - s for r, (s, e) in enumerate(self.dp_ranges) if e > s}

    def local_range(self, dp_rank: int) -> tuple[int, int]:
        return (0, self.numel) if self.dp_ranges is None else self.dp_ranges[dp_rank]
