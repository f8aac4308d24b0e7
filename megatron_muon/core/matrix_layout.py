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

Per-head QKV (``--muon-split-qkv-per-head``; MLA's up-projections alike) is the exception: its
sub-matrices are the heads, and a column-parallel weight gives every TP rank whole heads of its
own, so each TP rank's block is a whole matrix, not a shard of one (``per_rank``). Newton–Schulz
then runs on every TP rank on its own heads: per-head Muon exactly, with nothing crossing TP.

With fewer query groups than TP ranks megatron-core gives each TP rank a contiguous 1/TP of the
whole weight's rows, and that cut may fall inside a head (``tp_blocks``): the sub-matrices are
then the whole weight's heads, each described by the rows every TP rank holds of it
(``tp_rows``); a head whole on one rank is NS'd there, a cut one on one of its holders after
the owner exchange over TP has gathered its rows there (``plan.exchange.tp_owned_matrix``).
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
    per_rank: bool = False
    """each TP rank's sub-matrices are whole matrices of their own (per-head QKV: a TP rank holds
    whole heads), not shards of the TP group's; its sub-matrices are then unsharded
    (``partition_dim`` None) and ``per_rank``: NS runs on every TP rank on its own, TP sends
    nothing, and ``full_shape`` of one is its local shape."""
    per_head: bool = False
    """its sub-matrices are attention heads (``--muon-split-qkv-per-head``: a fused QKV's heads or an
    MLA up-projection's head blocks), whether or not TP cut the weight (``per_rank`` says that); the
    ``--muon-log-stats`` class ``attention_head`` reads it."""
    tp_blocks: tuple[int, ...] | None = None
    """the whole weight's row blocks in order (its heads), each its own matrix, which TP's even row
    cut (``partition_dim`` 0, ``local_shape[0]`` rows per rank) may split between two or more TP
    ranks: per-head QKV at TP above the query groups. Its sub-matrices are the blocks, whole
    (``local_shape`` the block's), with ``tp_rows``; ``split`` is then None."""
    tp_rows: tuple[tuple[int, int], ...] | None = None
    """a sub-matrix of a ``tp_blocks`` layout: per TP rank, the [start, end) of this matrix's rows
    that rank holds (empty where it holds none); they tile ``[0, local_shape[0])`` in rank order.
    ``partition_dim`` is None and ``full_shape`` is the whole block's."""

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

    @property
    def tp_copies(self) -> int:
        """distinct matrices the TP group holds of each sub-matrix: one per TP rank for a
        ``per_rank`` layout (each rank's own heads), else one (sharded or replicated)."""
        return self.tp_size if self.per_rank else 1

    def sub_matrices(self) -> tuple[MatrixLayout, ...]:
        """The independent matrices Newton–Schulz runs on: one per fused row block (itself when
        there is none), each TP-sharded like the weight (``per_rank``: whole on each TP rank,
        unsharded), with no DP ranges (the DP owner holds the whole TP-local shard before it
        splits the rows)."""
        if self.tp_blocks is not None:
            cols = self.local_shape[1]
            return tuple(MatrixLayout(f"{self.name}[{k}]", (rows, cols), None, self.tp_size,
                                      tp_rows=self.block_rows(k)) for k, rows in enumerate(self.tp_blocks))
        if self.split is None and self.dp_ranges is None and not self.per_rank:
            return (self,)
        shapes = self.sub_local_shapes()
        pdim = None if self.per_rank else self.partition_dim
        if len(shapes) == 1:
            return (MatrixLayout(self.name, shapes[0], pdim, self.tp_size, per_rank=self.per_rank),)
        return tuple(MatrixLayout(f"{self.name}[{k}]", shape, pdim, self.tp_size, per_rank=self.per_rank)
                     for k, shape in enumerate(shapes))

    # ---- sub-matrices ----------------------------------------------------------------------
    def block_rows(self, k: int) -> tuple[tuple[int, int], ...]:
        """Of a ``tp_blocks`` layout: per TP rank, the [start, end) rows of block ``k`` it holds
        (relative to the block; TP rank r holds the weight's rows [r·L, (r+1)·L), L the local rows)."""
        first = sum(self.tp_blocks[:k])
        last, per_rank = first + self.tp_blocks[k], self.local_shape[0]
        out = []
        for r in range(self.tp_size):
            lo, hi = max(first, r * per_rank), min(last, (r + 1) * per_rank)
            out.append((lo - first, hi - first) if hi > lo else (0, 0))
        return tuple(out)

    def _local_blocks(self, tp_rank: int) -> list[int]:
        """Of a ``tp_blocks`` layout: the rows TP rank ``tp_rank`` holds of each block, in order."""
        return [hi - lo for lo, hi in (self.block_rows(k)[tp_rank] for k in range(len(self.tp_blocks)))]

    def _sizes(self) -> tuple[int, tuple[int, ...]]:
        if self.split is None:
            return 1, (self.local_shape[0],)
        return self.split.groups, self.split.sizes

    def sub_local_shapes(self) -> list[tuple[int, int]]:
        """the shape of each sub-matrix on this TP rank (``tp_blocks``: each block's whole shape,
        what its owner runs NS on)."""
        if self.tp_blocks is not None:
            return [(rows, self.local_shape[1]) for rows in self.tp_blocks]
        groups, sizes = self._sizes()
        return [(groups * s, self.local_shape[1]) for s in sizes]

    def sub_global_shapes(self) -> list[tuple[int, int]]:
        """the shape of each matrix NS runs on (``per_rank``: the local one, a head; ``tp_blocks``:
        each whole block)."""
        if self.per_rank or self.tp_blocks is not None:
            return self.sub_local_shapes()
        return [full_shape(s, self.partition_dim, self.tp_size) for s in self.sub_local_shapes()]

    def group_flops(self, flops) -> float:
        """``flops(rows, cols)`` summed over every matrix the TP group orthogonalizes for this
        layout: each sub-matrix once, a ``per_rank`` one once per TP rank (what balancing weighs)."""
        return self.tp_copies * sum(flops(r, c) for r, c in self.sub_global_shapes())

    def split_rows(self, x: torch.Tensor, tp_rank: int = 0) -> list[torch.Tensor]:
        """TP-local ``(rows, cols)`` → its sub-matrices (views when there is no interleaving;
        ``tp_blocks``: TP rank ``tp_rank``'s rows of every block, empty where it holds none)."""
        if self.tp_blocks is not None:
            return list(x.split(self._local_blocks(tp_rank), dim=0))
        groups, sizes = self._sizes()
        if groups == 1:
            return list(x.split(sizes, dim=0))
        return [s.reshape(-1, x.shape[1]) for s in x.view(groups, sum(sizes), x.shape[1]).split(sizes, dim=1)]

    def join_rows(self, subs: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``split_rows`` (``tp_blocks``: of any TP rank's, its blocks' rows in order)."""
        groups, sizes = self._sizes()
        cols = self.local_shape[1]
        if groups == 1 or self.tp_blocks is not None:
            return torch.cat(subs, dim=0)
        return torch.cat([s.view(groups, n, cols) for s, n in zip(subs, sizes)], dim=1).view(self.local_shape)

    def row_values(self, per_sub: list[float], device: torch.device, tp_rank: int = 0) -> torch.Tensor:
        """A length-``rows`` fp32 vector on ``device`` giving each TP-local row (of TP rank
        ``tp_rank`` for ``tp_blocks``) its sub-matrix's value."""
        groups, sizes = (1, self._local_blocks(tp_rank)) if self.tp_blocks is not None else self._sizes()
        pattern = torch.cat([torch.full((n,), v, dtype=torch.float32, device=device)
                             for n, v in zip(sizes, per_sub)])
        return pattern.repeat(groups)

    def ns_cost(self, steps: int, method: str = "standard") -> int:
        """NS FLOPs of the whole (global) sub-matrices with ``method`` (``--muon-ns-method``): what
        the owner's TP group must do."""
        return self.group_flops(lambda r, c: method_flops(method, r, c, steps))

    # ---- DP pieces --------------------------------------------------------------------------
    def holders(self, dp_size: int) -> dict[int, int]:
        """DP rank → elements it holds (only ranks that hold something)."""
        if self.dp_ranges is None:
            return {r: self.numel for r in range(dp_size)}
        return {r: e - s for r, (s, e) in enumerate(self.dp_ranges) if e > s}

    def local_range(self, dp_rank: int) -> tuple[int, int]:
        return (0, self.numel) if self.dp_ranges is None else self.dp_ranges[dp_rank]
