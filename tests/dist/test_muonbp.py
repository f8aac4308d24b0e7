"""MuonBP: the schedule, its limits (P = 1 is Muon, P = 0 is BlockMuon), the block learning rate,
zero TP traffic on block steps, and the phase surviving a checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from rounding_bounds import muon_params_bound

from megatron_muon import comm_stats, newton_schulz
from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW

TP = 2
STEPS = 7
# TP-local shards of three full matrices: QKV-like (split, row-parallel), column-split, plain.
SHAPES = [((24, 16), 0, RowSplit(2, (8, 2, 2))), ((16, 12), 1, None), ((20, 16), 0, None)]
BASE = dict(momentum=0.9, nesterov=True, fp32_matmul_prec="highest", coefficient_type="jordan",
            scale_mode="spectral", extra_scale_factor=0.2)


def _full(i: int) -> torch.Tensor:
    (r, c), pdim, _ = SHAPES[i]
    shape = (r * TP, c) if pdim == 0 else (r, c * TP)
    return torch.randn(shape, generator=torch.Generator().manual_seed(10 + i))


def _grad(i: int, step: int, rank: int) -> torch.Tensor:
    (r, c), pdim, _ = SHAPES[i]
    shape = (r * TP, c) if pdim == 0 else (r, c * TP)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + i))
    return g.chunk(TP, dim=pdim)[rank].contiguous()


def _optimizer(rank: int, cfg: MuonConfig):
    params = [torch.nn.Parameter(_full(i).chunk(TP, dim=pdim)[rank].contiguous())
              for i, (_, pdim, _) in enumerate(SHAPES)]
    layouts = tuple(MatrixLayout(f"m{i}", shape, pdim, TP, split) for i, (shape, pdim, split) in enumerate(SHAPES))
    catalogue = MatrixCatalogue(layouts, tuple(params), dp_group=_SOLO[rank], tp_group=dist.group.WORLD)  # pure TP
    opt = MuonWithAdamW([dict(params=params, algorithm="muon", weight_decay=0.1)], lr=0.05, config=cfg,
                        catalogue=catalogue)
    return params, opt


def _run(rank: int, cfg: MuonConfig, steps: int, start: int = 0, opt_and_params=None):
    params, opt = opt_and_params or _optimizer(rank, cfg)
    kinds, tp_bytes = [], []
    for step in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = _grad(i, step, rank)
        with comm_stats() as stats:
            opt.step()
        kinds.append(opt.last_step_kind)
        tp_bytes.append(stats.bytes_sent - stats.bytes_by_primitive.get("shape_check", 0))
    return [p.detach().clone() for p in params], kinds, tp_bytes, opt


_SOLO: list = []


def _worker(rank: int, world: int) -> dict:
    _SOLO[:] = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out = {}
    plain = MuonConfig(tp_mode="owner", **BASE)
    out["plain"] = _run(rank, plain, STEPS)[:3]
    out["p1"] = _run(rank, MuonConfig(tp_mode="owner", muonbp_period=1, muonbp_block_lr_mult=0.3, **BASE), STEPS)[:3]
    out["blockwise"] = _run(rank, MuonConfig(tp_mode="blockwise", **BASE), STEPS)[:3]
    out["p0"] = _run(rank, MuonConfig(tp_mode="owner", muonbp_period=0, **BASE), STEPS)[:3]
    bp = MuonConfig(tp_mode="owner", muonbp_period=3, muonbp_block_lr_mult=0.5, **BASE)
    out["p3"] = _run(rank, bp, STEPS)[:3]
    for mode in ("duplicated", "distributed"):
        out[f"p3-{mode}"] = _run(rank, MuonConfig(tp_mode=mode, muonbp_period=3, muonbp_block_lr_mult=0.5, **BASE),
                                 STEPS)[:3]
    # Resume: 2 steps, state_dict round trip into a fresh optimizer, the remaining steps.
    first = _run(rank, bp, 2)
    saved = first[3].state_dict()
    fresh = _optimizer(rank, bp)
    fresh[1].load_state_dict(saved)
    for p, q in zip(fresh[0], first[0]):
        p.data.copy_(q)
    resumed = _run(rank, bp, STEPS - 2, start=2, opt_and_params=fresh)
    out["resumed"] = (resumed[0], first[1] + resumed[1], first[2] + resumed[2])
    # The same with --muonbp-block-grid 2x2: the grid is a plan setting, not state, so a resume
    # is bitwise as well.
    grid = MuonConfig(tp_mode="owner", muonbp_period=3, muonbp_block_lr_mult=0.5, muonbp_block_grid=(2, 2), **BASE)
    out["p3-grid"] = _run(rank, grid, STEPS)[:3]
    first = _run(rank, grid, 2)
    fresh = _optimizer(rank, grid)
    fresh[1].load_state_dict(first[3].state_dict())
    for p, q in zip(fresh[0], first[0]):
        p.data.copy_(q)
    resumed = _run(rank, grid, STEPS - 2, start=2, opt_and_params=fresh)
    out["resumed-grid"] = (resumed[0], first[1] + resumed[1], first[2] + resumed[2])
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(TP, _worker)


def test_period_one_is_muon_bitwise(ranks):
    # Every step is a full step with the plain run's plan: the same op sequence on the same shapes
    # and ranks, so the same summation order on any machine (atol = 0); likewise a block step and
    # blockwise below (the block plan is blockwise's settings with a 1 × 1 grid), and a resumed
    # run against the unbroken one.
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["p1"][0], r["plain"][0]))
        assert r["p1"][1] == ["full"] * STEPS


def test_period_zero_is_blockwise_bitwise(ranks):
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["p0"][0], r["blockwise"][0]))
        assert r["p0"][1] == ["block"] * STEPS and all(b == 0 for b in r["p0"][2])


@pytest.mark.parametrize("key", ["p3", "p3-duplicated", "p3-distributed"])
def test_schedule_and_tp_traffic(ranks, key):
    expected = ["full" if t % 3 == 0 else "block" for t in range(STEPS)]
    for r in ranks:
        kinds, tp_bytes = r[key][1], r[key][2]
        assert kinds == expected
        for kind, sent in zip(kinds, tp_bytes):
            # Block steps move nothing over TP; full steps move the exact mode's traffic.
            assert (sent == 0) if kind == "block" else (sent > 0), f"{key}: {kind} step sent {sent} bytes"


def test_resume_keeps_the_phase(ranks):
    for r in ranks:
        assert r["resumed"][1] == r["p3"][1]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"][0], r["p3"][0]))


def test_block_grid_resumes_bitwise_and_changes_the_block_steps(ranks):
    for r in ranks:
        assert r["resumed-grid"][1] == r["p3-grid"][1] == r["p3"][1]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed-grid"][0], r["p3-grid"][0]))
        assert all(b == 0 for kind, b in zip(r["p3-grid"][1], r["p3-grid"][2]) if kind == "block")
        assert not all(torch.equal(a, b) for a, b in zip(r["p3-grid"][0], r["p3"][0]))  # finer blocks, other update


def test_block_step_learning_rate_by_hand():
    """One block step (P = 0) on one process: θ·(1 − lr·wd) − mult·lr·scale(block)·NS(U)."""
    cfg = MuonConfig(tp_mode="owner", muonbp_period=0, muonbp_block_lr_mult=0.25, momentum=0.9,
                     nesterov=False, fp32_matmul_prec="highest", coefficient_type="jordan")
    theta = torch.randn(12, 20, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(12, 20, generator=torch.Generator().manual_seed(4))
    p = torch.nn.Parameter(theta.clone())
    opt = MuonWithAdamW([dict(params=[p], algorithm="muon", weight_decay=0.1)], lr=0.05, config=cfg)
    p.grad = grad.clone()
    opt.step()
    momentum = 0.1 * grad  # B = 0.lerp(G, 1 − 0.9)
    expected = (theta * (1 - 0.05 * 0.1)
                - 0.25 * 0.05 * muon_scale(12, 20, "spectral") * newton_schulz(momentum[None], 5, "jordan")[0])
    # NS runs the same op sequence on the same bitwise input (0.lerp(G, 0.1) is 0.1·G, rounded
    # once) in one process, so its result is the same; the only difference is where the scale
    # multiplies (update vs lr): three fp32 roundings per side of entries below 4.5
    # (rounding_bounds.muon_params_bound with no NS difference): 1.6e-6. A wrong multiplier, scale
    # or decay moves entries by ≥ 5e-3.
    assert (p.detach() - expected).abs().max().item() <= muon_params_bound(0.0, 0.05, 1.0, 4.5)
    assert opt.last_step_kind == "block"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(muonbp_period=-1), r"--muonbp-period: expected an integer >= 0"),
        (dict(muonbp_period=5, muonbp_block_lr_mult=0.0), r"--muonbp-block-lr-mult: expected a finite value > 0"),
        (dict(muonbp_period=5, muonbp_block_lr_mult=float("inf")), r"--muonbp-block-lr-mult: expected a finite"),
        (dict(muonbp_period=5, tp_mode="blockwise"),
         r"--muon-tp-mode: expected an exact mode .* --muonbp-period 5, got 'blockwise'"),
    ],
)
def test_errors_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig(**{"tp_mode": "owner", **kwargs})
