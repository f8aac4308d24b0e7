"""``core.block_grid``: MuonBP's R × C blocks of a local matrix, cut and put back exactly."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.core.block_grid import block_shape, check_grid, join_blocks, parse_grid, split_blocks


@pytest.mark.parametrize("grid", [(1, 1), (2, 1), (1, 4), (2, 3), (4, 6)])
def test_blocks_are_the_slices_in_row_major_order_and_join_back(grid):
    x = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(0))
    blocks = split_blocks(x, grid)
    R, C = grid
    br, bc = block_shape((8, 12), grid)
    assert blocks.shape == (3 * R * C, br, bc)
    for n in range(3):
        for i in range(R):
            for j in range(C):
                assert torch.equal(blocks[(n * R + i) * C + j], x[n, i * br:(i + 1) * br, j * bc:(j + 1) * bc])
    assert torch.equal(join_blocks(blocks, grid, (8, 12)), x)


def test_bad_grids_are_one_line_errors_naming_the_flag():
    assert parse_grid("2x4") == (2, 4) and parse_grid(" 3X1 ") == (3, 1)
    for text in ("2", "0x2", "2x0", "-1x2", "2x2x2", "axb", ""):
        with pytest.raises(ValueError, match=r"^--muonbp-block-grid: expected RxC with integers R, C >= 1") as err:
            parse_grid(text)
        assert "\n" not in str(err.value)
    check_grid("fc2", (8, 12), (2, 4))
    with pytest.raises(ValueError, match=r"^--muonbp-block-grid 3x4: fc2 has local shape 8x12 on a block step"):
        check_grid("fc2", (8, 12), (3, 4))
