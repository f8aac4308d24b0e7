"""DP teams' geometry (``plan.teams``): their size from the rank map, which units a team takes, and
the blocks' pieces.

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
from megatron_muon.plan.topology import Topology


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


@pytest.mark.parametrize("dp,tp,per_node,want", [(64, 1, 8, 8), (6, 1, 6, 6), (7, 1, 8, 7), (64, 8, 8, 1),
                                                  (1, 1, 8, 1), (5, 1, 4, 1)])
def test_team_size_on_megatrons_contiguous_order(dp, tp, per_node, want):
    """TP fastest, then DP, from global rank 0: DP 64 on nodes of 8 is 8 teams of 8; DP 5 on nodes
    of 4 has no divisor but 1 inside a node (5 straddles two)."""
    assert team_size(Topology.contiguous(dp, tp, per_node)) == want


def test_a_partial_node_takes_no_team_across_its_edge():
    """DP 12 on nodes of 8 (ranks 0-7 and 8-11): 6 divides 12 and fits in a node, but the team
    of ranks 6-11 would sit on both; teams of 4 (0-3, 4-7, 8-11) do not. DP 6 on nodes of 4: 2,
    not 3 (ranks 3-5 straddle). Contiguous DP 4 from global rank 6 on nodes of 8 (6, 7 | 8, 9): 2."""
    assert team_size(Topology.contiguous(12, 1, 8)) == 4
    assert team_size(Topology.contiguous(6, 1, 4)) == 2
    assert team_size(Topology.contiguous(4, 1, 8, first=6)) == 2


def test_an_expert_dp_group_strided_by_ep_forms_no_team():
    """Megatron's expert-DP group at TP 1 x EP 8 x DP 64 on nodes of 8: expert-DP rank d of EP
    rank e is global rank e + 8d, so consecutive expert-DP ranks sit a node apart and each node
    holds one member: team 1, where the group's size alone (8, a node's worth) gave 8."""
    for ep_rank in (0, 5):
        strided = Topology(tuple(ep_rank + 8 * d for d in range(8)), 1, 8)
        assert strided.dp_ranks_per_node == 1 and team_size(strided) == 1
    # EP 2 on nodes of 8: consecutive expert-DP ranks 2 apart, 4 of them per node
    assert team_size(Topology(tuple(1 + 2 * d for d in range(32)), 1, 8)) == 4
