"""MuonBP's block grid (``--muonbp-block-grid RxC``): a block step's blocks, finer than a TP shard.

A MuonBP block step orthogonalizes each TP shard on its own (BlockMuon's block). With a grid of
R × C, each local matrix (a TP shard, or a whole matrix that every TP rank holds) of shape
(r, c) is cut into R row bands and C column bands, the R·C blocks of shape (r/R, c/C) are
orthogonalized each on its own, and the results are put back in place. Nothing moves between
ranks: a block lies inside one rank's shard. Each block's update is scaled by the block's own
shape (``scaling.muon_scale``), as BlockMuon scales a TP shard by the shard's.

Pure functions on plain tensors; the plan (``plan/step_plan.py``) checks divisibility once, at
construction, and the blockwise mode (``parallel/tp_modes.py``) runs them.
"""

from __future__ import annotations

import re

import torch

__all__ = ["block_shape", "check_grid", "join_blocks", "parse_grid", "split_blocks"]

Grid = tuple[int, int]


def parse_grid(text: str) -> Grid:
    """``"2x4"`` → ``(2, 4)``; ``ValueError`` naming the flag otherwise (R, C integers >= 1)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"--muonbp-block-grid: expected RxC with integers R, C >= 1 (e.g. 2x2), got {text!r}")
    return int(match[1]), int(match[2])


def block_shape(shape: tuple[int, int], grid: Grid) -> tuple[int, int]:
    """The shape of one block of a ``shape`` matrix cut by ``grid`` (``check_grid`` first)."""
    return shape[0] // grid[0], shape[1] // grid[1]


def check_grid(name: str, shape: tuple[int, int], grid: Grid) -> None:
    """``ValueError`` naming the flag and the matrix unless ``grid`` divides ``shape``."""
    rows, cols = shape
    if rows % grid[0] or cols % grid[1]:
        raise ValueError(f"--muonbp-block-grid {grid[0]}x{grid[1]}: {name} has local shape {rows}x{cols} on a "
                         f"block step, which {grid[0]} row bands and {grid[1]} column bands do not divide evenly")


def split_blocks(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A stack ``(n, r, c)`` → its blocks ``(n·R·C, r/R, c/C)``, each matrix's in row-major order."""
    n, r, c = x.shape
    R, C = grid
    return x.reshape(n, R, r // R, C, c // C).transpose(2, 3).reshape(n * R * C, r // R, c // C)


def join_blocks(blocks: torch.Tensor, grid: Grid, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of ``split_blocks``: ``(n·R·C, r/R, c/C)`` → ``(n, r, c)``."""
    R, C = grid
    r, c = shape
    n = blocks.shape[0] // (R * C)
    return blocks.reshape(n, R, C, r // R, c // C).transpose(2, 3).reshape(n, r, c)
