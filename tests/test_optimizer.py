"""MuonWithAdamW on one process against megatron_muon.Muon + torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from megatron_muon import Muon
from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.optimizer import MuonMatrix, MuonWithAdamW


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g))
    return {"qkv": mk(24, 16), "proj": mk(16, 16), "bias": mk(16), "emb": mk(40, 16)}


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g)


QKV_SPLIT = RowSplit(2, (8, 2, 2))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling", "unit_rms_norm"])
def test_matches_muon_and_adamw(nesterov, scale_mode):
    cfg = MuonConfig(momentum=0.9, nesterov=nesterov, scale_mode=scale_mode, extra_scale_factor=0.5,
                     fp32_matmul_prec="highest", coefficient_type="jordan", tp_mode="owner")
    ours = _model()
    opt = MuonWithAdamW(
        [dict(params=[ours["qkv"], ours["proj"]], algorithm="muon", weight_decay=0.1),
         dict(params=[ours["bias"], ours["emb"]], algorithm="adamw", weight_decay=0.01)],
        lr=0.02, betas=(0.9, 0.95), eps=1e-8, config=cfg,
    )
    opt.attach([MuonMatrix(MatrixLayout("qkv", (24, 16), None, 1, QKV_SPLIT), ours["qkv"]),
                MuonMatrix(MatrixLayout("proj", (16, 16), None, 1), ours["proj"])])
    ref = _model()
    ref_muon = Muon([dict(params=[ref["qkv"]], row_split=QKV_SPLIT), dict(params=[ref["proj"]])],
                    lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_dtype=torch.float32,
                    coefficients="jordan", scale_mode=scale_mode, extra_scale_factor=0.5)
    ref_adam = torch.optim.AdamW([ref["bias"], ref["emb"]], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        ref_muon.step()
        ref_adam.step()
    # AdamW runs torch's own single-tensor code on the same tensors: bitwise.
    assert torch.equal(ours["bias"], ref["bias"]) and torch.equal(ours["emb"], ref["emb"])
    # Muon: same NS on the same sub-matrices; the scale multiplies the update (Megatron) instead
    # of the lr (reference), and a batched GEMM replaces single ones: fp32 rounding only.
    for k in ("qkv", "proj"):
        assert (ours[k] - ref[k]).abs().max().item() <= 1e-6
    assert opt.muon_steps == 3


def test_split_changes_the_update():
    """The split is real: QKV orthogonalized whole gives a different update."""
    cfg = MuonConfig(fp32_matmul_prec="highest")
    a, b = _model(), _model()
    for params, split in ((a, QKV_SPLIT), (b, None)):
        opt = MuonWithAdamW([dict(params=[params["qkv"]], algorithm="muon")], lr=0.1, config=cfg)
        opt.attach([MuonMatrix(MatrixLayout("qkv", (24, 16), None, 1, split), params["qkv"])])
        _grads(params, 0)
        opt.step()
    assert (a["qkv"] - b["qkv"]).abs().max().item() > 1e-3


def test_attach_must_name_every_muon_param():
    p = _model()
    opt = MuonWithAdamW([dict(params=[p["qkv"], p["proj"]], algorithm="muon")])
    with pytest.raises(ValueError, match="every muon param must appear exactly once"):
        opt.attach([MuonMatrix(MatrixLayout("qkv", (24, 16), None, 1), p["qkv"])])


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="param group 0: algorithm must be one of"):
        MuonWithAdamW([dict(params=[_model()["proj"]], algorithm="lion")])


@pytest.mark.parametrize(
    "kwargs, flag",
    [(dict(tp_mode="sharded"), "--muon-tp-mode"), (dict(scale_mode="x"), "--muon-scale-mode"),
     (dict(num_ns_steps=0), "--muon-num-ns-steps"), (dict(fp32_matmul_prec="low"), "--muon-fp32-matmul-prec"),
     (dict(dp_mode="x"), "--muon-dp-mode"), (dict(momentum=1.0), "--muon-momentum")],
)
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        MuonConfig(**kwargs)
