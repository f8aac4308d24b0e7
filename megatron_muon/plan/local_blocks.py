"""MuonBP's local blocks (``--muonbp-block local``): what each DP rank orthogonalizes on a block step.

MuonBP (arXiv 2510.16981) defines a block as the intersection of a rank's TP shard and its
data-parallel shard, so that a block step never communicates. With Megatron's distributed
optimizer (or Megatron-FSDP) a DP rank holds one flat range of each TP-local weight, cut
anywhere; its blocks are, per sub-matrix of the weight (QKV's q, k, v; fc1's gate, up; or the
weight), the whole rows of that sub-matrix lying in the range, gathered into one matrix, and each
partial row at either end of the range as a block of its own (one row, the elements held). A range
covering the whole TP shard (the balanced layout, plain DDP) gives exactly the TP shard's
sub-matrices: BlockMuon's blocks, ``--muonbp-block tp_shard``.

Each block's update is scaled by its own shape (``scaling.muon_scale``), as the paper scales
blocks. Pure: a function of the layout and the DP rank; no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout

__all__ = ["Block", "fragment_blocks"]


@dataclass(frozen=True)
class Block:
    """One block of a DP rank's piece of a weight."""

    runs: tuple[tuple[int, int], ...]
    """(offset in the flat piece, elements) of each run of rows, in order; gathered, they are the
    ``rows × cols`` block (a partial row: one run of ``cols`` elements)."""
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def fragment_blocks(layout: MatrixLayout, dp_rank: int) -> tuple[Block, ...]:
    """The blocks of ``dp_rank``'s flat range of ``layout``'s TP-local shard (module docstring),
    in the order: the leading partial row, the sub-matrices' whole rows by sub-matrix, the
    trailing partial row. Their runs cover the piece exactly once."""
    start, end = layout.local_range(dp_rank)
    cols = layout.local_shape[1]
    if end <= start:
        return ()
    first_row, last_row = -(-start // cols), end // cols  # whole rows: [first_row, last_row)
    head = Block(((0, min(end, first_row * cols) - start),), 1, min(end, first_row * cols) - start) \
        if start % cols else None
    tail_start = max(last_row * cols, start)
    tail = Block(((tail_start - start, end - tail_start),), 1, end - tail_start) \
        if end % cols and last_row >= first_row and tail_start < end else None
    if last_row < first_row:  # the range lies inside one row
        return (Block(((0, end - start),), 1, end - start),)
    runs_of: dict[int, list[tuple[int, int]]] = {}
    for sub, row_lo, row_hi in _row_runs(layout):
        lo, hi = max(row_lo, first_row), min(row_hi, last_row)
        if hi > lo:
            runs_of.setdefault(sub, []).append((lo * cols - start, (hi - lo) * cols))
    blocks = [head] if head else []
    for sub in sorted(runs_of):
        runs = tuple(runs_of[sub])
        blocks.append(Block(runs, sum(n for _, n in runs) // cols, cols))
    if tail:
        blocks.append(tail)
    return tuple(blocks)


def _row_runs(layout: MatrixLayout) -> list[tuple[int, int, int]]:
    """(sub-matrix, first row, end row) of each run of consecutive TP-local rows of one sub-matrix."""
    if layout.split is None:
        return [(0, 0, layout.local_shape[0])]
    runs, row = [], 0
    for _ in range(layout.split.groups):
        for sub, size in enumerate(layout.split.sizes):
            runs.append((sub, row, row + size))
            row += size
    return runs
