"""DP teams: a matrix's Newton–Schulz shared by a team of DP ranks, where TP has no ranks to share it.

At TP 1 a unit's only wide form is across DP ranks. ``auto`` may give a unit to a *team*: t
consecutive DP ranks that share a node, so the team's all-reduces stay on NVLink. Which ranks
share one is read from the stage's rank map (``topology.Topology``: each DP rank's global rank
and the ranks per node), not from the DP group's size: Megatron's expert-DP group strides by EP,
so at EP 8 on nodes of 8 no two of its consecutive ranks share a node and its teams are of one
(no teams). Member j of
the team receives block j of the unit, cut along its long dim, and the members run the
distributed (Gram) mode over the team's process group, exactly as a TP group runs it on its TP
shards: rows of a tall matrix, columns of a wide one, so the Gram spans the short dim (DeepSeek-V3's
7168 × 18432 fc2: a 7168² Gram, each member 2304 columns).

Block j travels by the DP owner exchange as its own owned matrix (``TeamBlock.owned``): its
owner buffer is the block, row-major. The elements a DP rank holds of the unit are one flat
range ``[a, b)``; those in block j are one flat sub-range for a row block, and for a column
block at most three ``Run``s of the holder's piece (a partial row ending at the block's right
edge, whole rows as a strided 2-D view of the block's columns, a partial row starting at its left
edge), each a contiguous range of the block buffer and one ``Piece`` of the exchange, so every
piece is copied once, straight from the holder's strided view into the send buffer.

Pure: no torch.distributed. Every rank derives the same blocks from the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout
from .exchange import OwnedMatrix, Piece
from .topology import Topology

__all__ = ["Run", "TeamBlock", "team_blocks", "team_layout", "team_size", "teamable"]


def team_size(topology: Topology) -> int:
    """Ranks per DP team: at TP 1, the largest divisor t of the DP size such that every aligned
    run of t consecutive DP ranks lies in one node (``Topology.dp_ranks_per_node``, from the
    global ranks: a team's collectives never leave NVLink); 1 = no teams, at TP > 1 (the TP group
    is the wide form) and where no two consecutive DP ranks share a node (an expert-DP group
    strided by EP across nodes). Contiguous DP 64 on nodes of 8: 8; DP 12 on nodes of 8: 4 (a
    team of 6 would straddle ranks 6-11's two nodes)."""
    if topology.tp_size != 1 or topology.dp_size < 2:
        return 1
    return topology.dp_ranks_per_node


def team_layout(unit: MatrixLayout, team: int) -> MatrixLayout | None:
    """The unit as a team runs it: its whole matrix cut over ``team`` members along its long dim
    (rows when it is at least as tall as wide), like a TP shard; None when a team cannot take it:
    a fused unit (several sub-matrices), a replicated one (every DP rank holds it whole, so its
    result would travel as dp − 1 copies), an empty one, or a long dim the team does not divide."""
    rows, cols = unit.local_shape
    if team < 2 or unit.split is not None or unit.dp_ranges is None or unit.is_sharded or not unit.numel:
        return None
    pdim = 0 if rows >= cols else 1
    if unit.local_shape[pdim] % team:
        return None
    return MatrixLayout.from_full_shape(unit.name, (rows, cols), pdim, team)


def teamable(unit: MatrixLayout, team: int) -> bool:
    return team_layout(unit, team) is not None


@dataclass(frozen=True)
class Run:
    """Elements ``piece[start + r·stride + c]`` for r < rows, c < cols of a DP rank's flat piece of
    a unit: in that (row-major) order, one contiguous run of a team block's buffer."""

    start: int
    rows: int
    cols: int
    stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class TeamBlock:
    """Member j's block of a team unit: its owned matrix in the DP exchange, and where each of its
    gather pieces lies in its holder's flat piece of the unit."""

    owned: OwnedMatrix
    """owner: the member's DP rank; gather: one piece per run, by holder, in block-buffer order."""
    runs: tuple[Run, ...]
    """per gather piece, where it lies in its holder's flat piece of the unit."""


def team_blocks(unit: MatrixLayout, team: int, first_rank: int) -> tuple[TeamBlock, ...]:
    """The blocks of ``unit`` for the team of DP ranks ``first_rank … first_rank + team − 1``
    (``team_layout`` must accept it); the pieces of every block together are every DP rank's
    range of the unit, each element once."""
    layout = team_layout(unit, team)
    if layout is None:
        raise ValueError(f"{unit.name}: a DP team of {team} cannot take this matrix (see team_layout)")
    rows, cols = unit.local_shape
    block_rows, block_cols = layout.local_shape
    out = []
    for j in range(team):
        gather, runs = [], []
        for r, (a, b) in enumerate(unit.dp_ranges):
            if layout.partition_dim == 0:
                lo, hi = max(a, j * block_rows * cols), min(b, (j + 1) * block_rows * cols)
                if hi > lo:
                    gather.append(Piece(r, lo - j * block_rows * cols, hi - lo))
                    runs.append(Run(lo - a, 1, hi - lo, cols))
                continue
            for run, (row, col) in _column_runs(a, b, cols, j * block_cols, block_cols):
                gather.append(Piece(r, row * block_cols + col - j * block_cols, run.numel))
                runs.append(run)
        out.append(TeamBlock(OwnedMatrix(first_rank + j, block_rows * block_cols, tuple(gather)), tuple(runs)))
    return tuple(out)


def _column_runs(a: int, b: int, cols: int, c0: int, width: int) -> list[tuple[Run, tuple[int, int]]]:
    """The runs of flat range ``[a, b)`` of a ``(·, cols)`` row-major matrix that fall in columns
    ``[c0, c0 + width)``, each with its first element's (row, col); relative to ``a``."""
    c1 = c0 + width
    out = []
    row, col = divmod(a, cols)
    if col:  # a partial first row
        end = min(b - row * cols, cols)
        lo, hi = max(col, c0), min(end, c1)
        if hi > lo:
            out.append((Run(row * cols + lo - a, 1, hi - lo, cols), (row, lo)))
        row += 1
    last_row, last_col = divmod(b, cols)
    if row * cols >= b:
        return out
    whole = last_row - row
    if whole > 0:
        out.append((Run(row * cols + c0 - a, whole, width, cols), (row, c0)))
    if last_col:  # a partial last row
        hi = min(last_col, c1)
        if hi > c0:
            out.append((Run(last_row * cols + c0 - a, 1, hi - c0, cols), (last_row, c0)))
    return out
