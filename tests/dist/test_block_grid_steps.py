"""``--muonbp-block-grid RxC``: a MuonBP block step orthogonalizes each local matrix as R x C
blocks, each scaled by its own shape, with no communication; against the one-process reference
that cuts the same blocks out of each TP shard and runs Newton–Schulz on each, at TP{1,2} x DP{1,2}
with Megatron-style DP ranges (a matrix may be cut across DP ranks: it is reassembled on its DP
owner first, as a tp_shard block step does)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from rounding_bounds import ns_bound

from megatron_muon import comm_stats, newton_schulz
from megatron_muon.config import MuonConfig
from megatron_muon.core.block_grid import join_blocks, split_blocks
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW

GRID = (2, 2)
# (name, TP-local shape at TP2, partition_dim, row split): QKV of 2 groups, row-parallel, gated fc1,
# fc2, replicated; every local sub-matrix divisible by GRID at TP1 and TP2
PARAMS = [("qkv", (24, 16), 0, RowSplit(2, (8, 2, 2))), ("proj", (16, 8), 1, None),
          ("fc1", (20, 16), 0, RowSplit(1, (10, 10))), ("fc2", (16, 10), 1, None), ("router", (6, 16), None, None)]
CONFIG = dict(momentum=0.0, nesterov=False, fp32_matmul_prec="highest", coefficient_type="quintic",
              scale_mode="spectral", muonbp_period=0, muonbp_block_grid=GRID)


def _full(i: int, tp2_shape, pdim) -> torch.Tensor:
    r, c = tp2_shape
    shape = (r * 2, c) if pdim == 0 else (r, c * 2) if pdim == 1 else (r, c)
    return torch.randn(shape, generator=torch.Generator().manual_seed(40 + i))


def _layouts(tp: int, dp: int) -> tuple[list[MatrixLayout], int]:
    layouts, offset = [], 0
    local = []
    for name, (r, c), pdim, split in PARAMS:
        shape = (r * 2 // tp, c) if pdim == 0 else (r, c * 2 // tp) if pdim == 1 else (r, c)
        local.append((name, shape, pdim, split))
    total = sum(s[0] * s[1] for _, s, _, _ in local)
    shard = -(-total // dp)
    for name, (r, c), pdim, split in local:
        spans = [(max(offset, d * shard), min(offset + r * c, (d + 1) * shard)) for d in range(dp)]
        ranges = tuple((lo - offset, hi - offset) if hi > lo else (0, 0) for lo, hi in spans) if dp > 1 else None
        split = None if split is None else RowSplit(split.groups, split.sizes) if tp == 2 or pdim != 0 else \
            RowSplit(split.groups * 2, split.sizes)
        layouts.append(MatrixLayout(name, (r, c), pdim if tp > 1 else None, tp, split, ranges))
        offset += r * c
    return layouts, shard


def expected_local(lay: MatrixLayout, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """The block step on one process: this TP rank's shard, its sub-matrices, each cut into GRID's
    blocks, Newton–Schulz of each block (fp32), scaled by the block's shape, put back."""
    pdim = lay.partition_dim
    shard = full if pdim is None else full.chunk(tp, dim=pdim)[tp_rank]
    out = []
    for sub in lay.split_rows(shard):
        blocks = split_blocks(sub[None].double(), GRID)
        ns = torch.stack([newton_schulz(b, 5, "quintic") for b in blocks])
        scale = muon_scale(sub.shape[0] // GRID[0], sub.shape[1] // GRID[1], "spectral")
        out.append(join_blocks(ns, GRID, tuple(sub.shape))[0] * scale)
    return lay.join_rows(out)


def expected_bound(lay: MatrixLayout, full: torch.Tensor, tp: int, tp_rank: int) -> float:
    """How far the ranks' fp32 block step may be from ``expected_local`` (float64): one fp32 NS
    rounding of each block (rounding_bounds.ns_bound, roundings=1) times its scale."""
    pdim = lay.partition_dim
    shard = full if pdim is None else full.chunk(tp, dim=pdim)[tp_rank]
    return max(ns_bound(torch.float32, b, "quintic", roundings=1)
               * muon_scale(sub.shape[0] // GRID[0], sub.shape[1] // GRID[1], "spectral")
               for sub in lay.split_rows(shard) for b in split_blocks(sub[None].double(), GRID))


def _worker(rank: int, world: int, tp: int) -> dict:
    import torch.distributed as dist

    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_groups = [dist.new_group([d * tp + j for j in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + j for d in range(dp)]) for j in range(tp)]
    layouts, _ = _layouts(tp, dp)
    params, matrices = [], []
    for i, (lay, (_, shape, pdim, _)) in enumerate(zip(layouts, PARAMS)):
        full = _full(i, shape, pdim)
        local = full if lay.partition_dim is None else full.chunk(tp, dim=lay.partition_dim)[tp_rank]
        s, e = lay.local_range(dp_rank)
        p = torch.nn.Parameter(torch.zeros(e - s)) if e > s else None
        if p is not None:
            p.grad = local.reshape(-1)[s:e].clone()
            params.append(p)
        matrices.append(p)
    catalogue = MatrixCatalogue(tuple(layouts), tuple(matrices), dp_groups[tp_rank], tp_groups[dp_rank])
    opt = MuonWithAdamW([dict(params=params, algorithm="muon")], lr=1.0, weight_decay=0.0,
                        config=MuonConfig(**CONFIG), catalogue=catalogue)
    with comm_stats() as stats:
        opt.step()
    tp_bytes = stats.bytes_sent - stats.bytes_by_primitive.get("shape_check", 0) - stats.bytes_by_primitive.get(
        "all_to_all", 0)
    plan = opt.plans["block"]
    here = dp_rank * tp + tp_rank
    return dict(pieces=[None if p is None else -p.detach().clone() for p in matrices], tp_rank=tp_rank,
                dp_rank=dp_rank, flops=stats.ns_flops, plan_flops=plan.ns_flops[here], tp_bytes=tp_bytes,
                last_kind=opt.last_step_kind)


@pytest.mark.parametrize("tp, world", [(1, 1), (2, 2), (1, 2), (2, 4)], ids=["tp1dp1", "tp2dp1", "tp1dp2", "tp2dp2"])
def test_block_grid_equals_one_process_block_newton_schulz(tp, world):
    ranks = run_world(world, _worker, tp)
    layouts, _ = _layouts(tp, world // tp)
    worst = 0.0
    for r in ranks:
        assert r["last_kind"] == "block" and r["tp_bytes"] == 0  # no TP traffic on a block step
        assert r["flops"] == r["plan_flops"]  # the blocks' FLOPs, as the plan counts them
        for i, (lay, (_, shape, pdim, _)) in enumerate(zip(layouts, PARAMS)):
            s, e = lay.local_range(r["dp_rank"])
            if e > s:
                want = expected_local(lay, _full(i, shape, pdim), tp, r["tp_rank"]).reshape(-1)[s:e]
                bound = expected_bound(lay, _full(i, shape, pdim), tp, r["tp_rank"])
                worst = max(worst, (r["pieces"][i].double() - want).abs().max().item() / bound)
    # fp32 NS of the blocks against float64: rounding only (expected_bound: 2e-4 … 1.6e-3 here;
    # another grid, block or scale is off by 1e-2 … 1). worst: the largest error ÷ its bound.
    assert worst <= 1, worst


def test_a_grid_that_does_not_divide_is_refused_when_the_plan_is_built():
    """docs/bad_inputs.md row "api-block-grid-divides" (the plan is built with the optimizer, where
    the local shapes are known: after the model, before any step)."""
    layout, param = MatrixLayout("fc2", (16, 10), None, 1), torch.nn.Parameter(torch.zeros(16, 10))
    with pytest.raises(ValueError, match=r"^--muonbp-block-grid 3x2: fc2 has local shape 16x10 on a block step"):
        MuonWithAdamW([dict(params=[param], algorithm="muon")], lr=1.0,
                      config=MuonConfig(**dict(CONFIG, muonbp_block_grid=(3, 2))),
                      catalogue=MatrixCatalogue((layout,), (param,)))
    for bad, needle in (((0, 2), "RxC with integers R, C >= 1"), ((2, 2, 2), "RxC with integers R, C >= 1")):
        with pytest.raises(ValueError, match=f"^--muonbp-block-grid: expected {needle}"):
            MuonConfig(**dict(CONFIG, muonbp_block_grid=bad))
    with pytest.raises(ValueError, match=r"^--muonbp-block-grid: expected --muonbp-period P other than 1"):
        MuonConfig(**dict(CONFIG, muonbp_period=None))
    with pytest.raises(ValueError, match=r"^--muonbp-block-grid: expected --muonbp-block tp_shard"):
        MuonConfig(**dict(CONFIG, muonbp_block="local"))
