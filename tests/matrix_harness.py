"""Transformer-shaped matrices for the orthogonalize tests, without Megatron: their layouts in a
flat buffer cut into DP ranges as Megatron's distributed optimizer cuts it, their seeded global
updates, and the expected result (Newton–Schulz of each global sub-matrix, cut back to a TP
rank)."""

from __future__ import annotations

import torch
from rounding_bounds import ns_bound

from megatron_muon import newton_schulz
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale

__all__ = ["PARAMS", "expected_bound", "expected_local", "global_matrix", "layouts", "local_pieces", "tp_local"]

# name, TP-local shape, partition_dim, row split (groups, sizes) or None
PARAMS = [
    ("qkv", (2 * 12, 16), 0, (2, (8, 2, 2))),  # 2 local query groups of [q 8; k 2; v 2] rows
    ("proj", (16, 8), 1, None),
    ("fc1", (2 * 10, 16), 0, (1, (10, 10))),  # [gate; up]
    ("fc2", (16, 10), 1, None),
    ("router", (6, 16), None, None),  # not TP-split: every TP rank holds all of it
    # a Mamba mixer's in_proj: [z 8; x 8; B 4; C 4; dt 2] rows per TP rank, each role TP-sharded on
    # its own (megatron-core's partition_sizes), so the global role is the TP ranks' parts in order
    ("in_proj", (26, 16), 0, (1, (8, 8, 4, 4, 2))),
]


def layouts(tp: int, dp: int, cut: bool) -> list[MatrixLayout]:
    """Megatron-style DP ranges: params back to back, the buffer cut in dp equal parts."""
    sizes = [r * c for _, (r, c), *_ in PARAMS]
    total = sum(sizes)
    shard = -(-total // dp)
    out, offset = [], 0
    for (name, shape, pdim, split), n in zip(PARAMS, sizes):
        ranges = None
        if cut:
            spans = [(max(offset, d * shard), min(offset + n, (d + 1) * shard)) for d in range(dp)]
            ranges = tuple((lo - offset, hi - offset) if hi > lo else (0, 0) for lo, hi in spans)
        out.append(MatrixLayout(name, shape, pdim, tp, RowSplit(split[0], split[1]) if split else None, ranges))
        offset += n
    return out


def packed_layouts(shapes, dp: int, tp: int = 1) -> list[MatrixLayout]:
    """``shapes`` (``(name, (rows, cols))``) packed in one flat buffer cut into ``dp`` equal ranges
    (cuts inside rows), each matrix whole on every TP rank of ``tp``: a ZeRO-1 buffer in miniature."""
    total = sum(r * c for _, (r, c) in shapes)
    per = -(-total // dp)
    out, offset = [], 0
    for name, (rows, cols) in shapes:
        ranges = []
        for d in range(dp):
            lo, hi = max(offset, d * per), min(offset + rows * cols, (d + 1) * per)
            ranges.append((lo - offset, hi - offset) if hi > lo else (0, 0))
        out.append(MatrixLayout(name, (rows, cols), None, tp, None, tuple(ranges)))
        offset += rows * cols
    return out


def global_matrix(i: int, tp: int) -> torch.Tensor:
    """The full (all TP ranks) update of param i, seeded by index."""
    _, (r, c), pdim, _ = PARAMS[i]
    shape = (r * tp, c) if pdim == 0 else (r, c * tp) if pdim == 1 else (r, c)
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + i))


def tp_local(full: torch.Tensor, pdim, tp: int, tp_rank: int) -> torch.Tensor:
    return full if pdim is None else full.chunk(tp, dim=pdim)[tp_rank]


def local_pieces(lays, full_of, tp: int, tp_rank: int, dp_rank: int) -> list[torch.Tensor]:
    """This rank's piece of each matrix, as a step hands it over: the TP rank's shard of the full
    update ``full_of(i)`` (all of it where the layout is not TP-split), flattened, cut to the
    DP range the layout gives ``dp_rank``."""
    out = []
    for i, lay in enumerate(lays):
        s, e = lay.local_range(dp_rank)
        out.append(tp_local(full_of(i), lay.partition_dim, tp, tp_rank).reshape(-1)[s:e].clone())
    return out


def _global_subs(i: int, layout: MatrixLayout, tp: int) -> list[torch.Tensor]:
    """Param i's global sub-matrices (its row split's parts, each gathered over the TP ranks)."""
    full = global_matrix(i, tp)
    pdim = layout.partition_dim
    locals_ = [layout.split_rows(tp_local(full, pdim, tp, r)) for r in range(tp)]
    return [locals_[0][k] if pdim is None else torch.cat([parts[k] for parts in locals_], dim=pdim)
            for k in range(len(layout.sub_global_shapes()))]


def expected_local(i: int, layout: MatrixLayout, tp: int, tp_rank: int, scale_mode="spectral") -> torch.Tensor:
    """NS of each global sub-matrix, scaled by its global shape, cut back to this TP rank."""
    subs = [tp_local(newton_schulz(sub, 5, "jordan") * muon_scale(*sub.shape, scale_mode), layout.partition_dim, tp,
                     tp_rank) for sub in _global_subs(i, layout, tp)]
    return layout.join_rows(subs)


def expected_bound(i: int, layout: MatrixLayout, tp: int, scale_mode="spectral") -> float:
    """How far another exact computation of ``expected_local`` may be from it: the modes, the DP
    exchange and the stacking change only the summation order (sums over ranks, batched against
    single GEMMs, the other orientation's Gram), so two fp32 NS roundings of each sub-matrix
    (``rounding_bounds.ns_bound``, 1e-4 … 2e-3 for these) times its scale (√max(rows, cols) ≤ 6
    under spectral). Blockwise NS, a wrong shard or a dropped scale is off by 1e-2 … 1."""
    return max(ns_bound(torch.float32, sub, "jordan") * muon_scale(*sub.shape, scale_mode)
               for sub in _global_subs(i, layout, tp))
