"""DP teams' geometry (``plan.teams``): which units a team takes, and the blocks' pieces.

Pure: a team block's pieces, read from every DP rank's flat piece of the unit through their
runs and written at their offsets, must rebuild exactly the block of the whole matrix, for row
and column blocks and DP ranges cut anywhere (inside rows, empty, one element).
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.plan.teams import team_blocks, team_layout, team_size


def _cut(rows: int, cols: int, bounds: list[int]) -> MatrixLayout:
    ranges = tuple((bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))
    return MatrixLayout("m", (rows, cols), None, 1, None, ranges)


def _rebuilt(layout: MatrixLayout, team: int) -> list[torch.Tensor]:
    full = torch.arange(layout.numel, dtype=torch.float64)
    out = []
    for block in team_blocks(layout, team, 0):
        buf = torch.full((block.owned.numel,), -1.0, dtype=torch.float64)
        for piece, run in zip(block.owned.gather, block.runs, strict=True):
            held = full[slice(*layout.dp_ranges[piece.rank])].clone()
            view = held.as_strided((run.rows, run.cols), (run.stride, 1), run.start)
            assert view.numel() == piece.numel
            buf[piece.start:piece.start + piece.numel] = view.reshape(-1)
        out.append(buf)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_blocks_rebuild_the_matrix_from_any_dp_cut(seed):
    rng = random.Random(seed)
    team = rng.choice([2, 3, 4])
    rows, cols = rng.choice([(team * rng.randint(2, 5), rng.randint(1, 2 * team)),
                             (rng.randint(1, 2 * team), team * rng.randint(2, 5))])
    if team_layout(_cut(rows, cols, [0, rows * cols]), team) is None:  # square-ish with an odd long dim
        return
    n = rows * cols
    layout = _cut(rows, cols, [0, *sorted(rng.randint(0, n) for _ in range(rng.randint(0, 6))), n])
    pdim = team_layout(layout, team).partition_dim
    whole = torch.arange(n, dtype=torch.float64).view(rows, cols)
    for j, buf in enumerate(_rebuilt(layout, team)):
        assert torch.equal(buf, whole.chunk(team, dim=pdim)[j].reshape(-1)), (rows, cols, layout.dp_ranges, j)


def test_a_column_block_takes_at_most_three_pieces_per_rank():
    """A DP range from the middle of row 1 to the middle of row 4 of a 6 x 8 matrix: each column
    block of 4 gets a partial row, whole rows and a partial row from it, each one piece."""
    layout = _cut(6, 8, [0, 10, 38, 48])
    assert team_layout(layout, 2).partition_dim == 1
    for block in team_blocks(layout, 2, 0):
        assert sum(p.rank == 1 for p in block.owned.gather) <= 3


def test_which_units_a_team_takes():
    cut = ((0, 60), (60, 120))
    assert team_layout(MatrixLayout("tall", (12, 10), None, 1, None, cut), 4).partition_dim == 0
    assert team_layout(MatrixLayout("wide", (10, 12), None, 1, None, cut), 4).partition_dim == 1
    assert team_layout(MatrixLayout("odd", (10, 12), None, 1, None, cut), 5) is None  # 12 % 5
    assert team_layout(MatrixLayout("fused", (12, 10), None, 1, RowSplit(1, (6, 6)), cut), 2) is None
    assert team_layout(MatrixLayout("replicated", (12, 10), None, 1), 2) is None
    assert team_layout(MatrixLayout("tp", (12, 10), 0, 2, None, cut), 2) is None


@pytest.mark.parametrize("dp,tp,per_node,want", [(64, 1, 8, 8), (6, 1, 4, 3), (7, 1, 8, 7), (64, 8, 8, 1),
                                                  (1, 1, 8, 1), (5, 1, 4, 1)])
def test_team_size_is_the_largest_divisor_in_a_node(dp, tp, per_node, want):
    assert team_size(dp, tp, per_node) == want
