"""MuonWithAdamW on one process against megatron_muon.Muon + torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch
from rounding_bounds import muon_params_bound, ns_bound

from megatron_muon import Muon
from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW


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
        catalogue=MatrixCatalogue((MatrixLayout("qkv", (24, 16), None, 1, QKV_SPLIT),
                                   MatrixLayout("proj", (16, 16), None, 1)), (ours["qkv"], ours["proj"])),
    )
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
    # AdamW runs torch's own foreach code, which on CPU fp32 is bitwise the single-tensor code
    # torch.optim.AdamW takes here (test_adamw_foreach_is_single_tensor_bitwise; elementwise ops
    # only, no reduction whose order a machine could choose): atol = 0.
    assert torch.equal(ours["bias"], ref["bias"]) and torch.equal(ours["emb"], ref["emb"])
    # Muon: same NS on the same sub-matrices (q 16 × 16, k and v 4 × 16, proj 16 × 16), but a
    # batched GEMM replaces single ones and the scale rides in add_'s alpha (lr·scale) where the
    # reference multiplies the update: two fp32 NS roundings of any 16 × 16 matrix (2.1e-3,
    # rounding_bounds.ns_bound) times lr·scale ≤ 0.02 · 2, plus the params' own rounding (|θ| < 4.5), three
    # steps: 2.6e-4 (measured max 1.2e-7 over these six cases). A wrong scale, split or
    # extra_scale_factor moves params by lr·scale·|U| ≥ 3e-3 a step.
    scale = max(muon_scale(r, 16, scale_mode, 0.5) for r in (16, 4))
    bound = muon_params_bound(ns_bound(torch.float32, (16, 16), "jordan"), 0.02, scale, 4.5, steps=3)
    for k in ("qkv", "proj"):
        assert (ours[k] - ref[k]).abs().max().item() <= bound
    assert opt.muon_steps == 3


@pytest.mark.parametrize("nesterov", [True, False])
def test_l2_weight_decay_matches_emerging_muon_and_torch_adam(nesterov):
    """decoupled_weight_decay False (Megatron's OptimizerConfig field): G + wd·θ into the Muon
    momentum, as emerging-optimizers' Muon(weight_decay_method="l2"), and into Adam's moments,
    as torch.optim.Adam(weight_decay=wd)."""
    from emerging_optimizers.orthogonalized_optimizers.muon import Muon as EmergingMuon

    def run(decoupled: bool) -> dict:
        cfg = MuonConfig(momentum=0.9, nesterov=nesterov, extra_scale_factor=0.5, fp32_matmul_prec="highest",
                         coefficient_type="quintic")
        params = _model()
        opt = MuonWithAdamW(
            [dict(params=[params["qkv"], params["proj"]], algorithm="muon", weight_decay=0.1),
             dict(params=[params["bias"], params["emb"]], algorithm="adamw", weight_decay=0.01)],
            lr=0.02, betas=(0.9, 0.95), eps=1e-8, config=cfg, decoupled_weight_decay=decoupled,
        )
        for step in range(3):
            _grads(params, step)
            opt.step()
        return params

    ours = run(decoupled=False)
    ref = _model()
    ref_muon = EmergingMuon([ref["qkv"], ref["proj"]], lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov,
                            weight_decay_method="l2", fp32_matmul_prec="highest", coefficient_type="quintic",
                            extra_scale_factor=0.5)
    ref_adam = torch.optim.Adam([ref["bias"], ref["emb"]], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(3):
        _grads(ref, step)
        ref_muon.step()
        ref_adam.step()
    # Adam: torch's own foreach code with decoupled_weight_decay False, bitwise the single-tensor
    # code torch.optim.Adam takes on CPU (test_adamw_foreach_is_single_tensor_bitwise; elementwise
    # ops only): atol = 0.
    assert torch.equal(ours["bias"], ref["bias"]) and torch.equal(ours["emb"], ref["emb"])
    # Muon: same math in fp32; emerging normalizes with F.normalize, runs its own GEMMs and
    # multiplies the update by its scale where we fold it into add_'s alpha: two fp32 NS
    # roundings of any 24 × 16 matrix (2.8e-3, rounding_bounds.ns_bound) times lr·scale ≤ 0.02 ·
    # 2.45, plus the params' own rounding, three steps: 4.2e-4 (measured max 1.2e-7).
    bound = muon_params_bound(ns_bound(torch.float32, (24, 16), "quintic"), 0.02, muon_scale(24, 16, "spectral", 0.5),
                              4.5, steps=3)
    for k in ("qkv", "proj"):
        assert (ours[k] - ref[k]).abs().max().item() <= bound
    # The flag is real: decoupled decay moves every parameter by far more than rounding (measured
    # 1.1e-3 … 5e-2, the Muon params by ≥ 1.2e-2, 30× their bound above).
    decoupled = run(decoupled=True)
    for k in ours:
        assert (ours[k] - decoupled[k]).abs().max().item() > 1e-4


@pytest.mark.parametrize("power", [100, 125])
def test_huge_gradients_give_the_update_of_scaled_down_ones(power):
    """‖G‖_F of a gradient with entries ~1e30 (2^100) or next to bf16's max (2^125: randn's
    largest entries here, ~4.5, stay below 2^128) overflows; unless NS scales before its norm,
    the Muon update is silently zero. NS is scale-invariant and a power-of-two scale is exact at
    every stage (momentum, bf16 cast, prescale), so the params are bitwise those of the
    unscaled run (atol = 0)."""

    def run(scale: float) -> dict:
        params = _model()
        before = {k: p.detach().clone() for k, p in params.items()}
        opt = MuonWithAdamW([dict(params=[params["qkv"], params["proj"]], algorithm="muon", weight_decay=0.1)],
                            lr=0.02, config=MuonConfig(tp_mode="owner"))  # bf16 NS: upstream's default
        for step in range(2):
            _grads(params, step)
            for k in ("qkv", "proj"):
                params[k].grad *= scale
            opt.step()
        return {k: params[k] - before[k] for k in ("qkv", "proj")}

    plain, huge = run(1.0), run(2.0**power)
    for k in plain:
        assert plain[k].abs().max() > 1e-2  # a real update, not weight decay alone (~4e-3 · |θ|)
        assert torch.equal(plain[k], huge[k])


@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling", "unit_rms_norm"])
def test_empty_matrices_are_a_no_op(scale_mode):
    """A (0, n), (n, 0) or (0, 0) parameter in a Muon group has an empty update; the other
    matrices step exactly as without it (atol = 0: the same NS on the same batch)."""
    cfg = MuonConfig(scale_mode=scale_mode, fp32_matmul_prec="highest")

    def run(with_empty: bool):
        params = _model()
        empty = [torch.nn.Parameter(torch.zeros(s)) for s in ((0, 5), (5, 0), (0, 0))] if with_empty else []
        opt = MuonWithAdamW([dict(params=[*empty, params["proj"]], algorithm="muon", weight_decay=0.1)], lr=0.02,
                            config=cfg)
        for step in range(2):
            _grads(params, step)
            for p in empty:
                p.grad = torch.zeros_like(p)
            opt.step()
        return params["proj"], empty, opt

    proj, empty, opt = run(True)
    assert torch.equal(proj, run(False)[0])
    for p in empty:
        assert p.numel() == 0 and opt.state[p]["momentum_buffer"].shape == p.shape


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("shapes", [[(16,), (40, 16)], [(256,), (512, 256), (3, 7)], [(1000,), (128, 1024)]])
def test_adamw_foreach_is_single_tensor_bitwise(shapes, decoupled):
    """The premise of MuonWithAdamW's foreach AdamW: on CPU fp32, torch's foreach path does the
    single-tensor path's arithmetic, op for op (atol = 0), over several steps with weight decay,
    decoupled (AdamW) or L2 (Adam)."""
    from torch.optim.adam import adam

    def run(foreach: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=g) for s in shapes]
        exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        steps = [torch.tensor(0.0) for _ in params]
        for _ in range(5):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, capturable=False,
                 differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
                 decoupled_weight_decay=decoupled, amsgrad=False, beta1=0.9, beta2=0.95, lr=0.02, weight_decay=0.01,
                 eps=1e-8, maximize=False)
        return params

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def _peak_bytes(step) -> int:
    """Peak bytes allocated above the start during ``step()`` on the CPU: the benchmark's own
    measure (torch.profiler's allocation and free events, summed in time order)."""
    from scripts.bench.optimizer_step_setup import peak_step_bytes

    return peak_step_bytes(step, torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")  # one cycle is all it records
def test_updates_are_applied_group_by_group(monkeypatch):
    """The step's extra memory is a micro-group's worth, not every update's: with one matrix per
    group the peak is a fraction of the Muon params' bytes (measured 0.27x: NS of one matrix
    needs about four matrix-sized temporaries, 16 matrices here), while one group for everything
    holds every result at once (measured 4.3x; before the pipeline every step held all updates
    in the NS dtype and again scaled in fp32, 2x even with the smallest bucket)."""
    from megatron_muon.plan import exchange

    def peak(bucket_bytes: int) -> float:
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(96, 64, generator=g)) for _ in range(16)]
        cfg = MuonConfig(tp_mode="owner", fp32_matmul_prec="highest", owner_bucket_bytes=bucket_bytes)
        opt = MuonWithAdamW([dict(params=params, algorithm="muon", weight_decay=0.1)], lr=0.02, config=cfg)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()  # the momentum buffers exist before the measured step, as in training
        return _peak_bytes(opt.step) / (16 * 96 * 64 * 4)

    assert peak(96 * 64 * 4) <= 0.5
    monkeypatch.setattr(exchange, "MIN_MICRO_GROUPS", 1)  # read when the optimizer builds its plan
    assert peak(2**40) >= 2


def test_split_changes_the_update():
    """The split is real: QKV orthogonalized whole gives a different update."""
    cfg = MuonConfig(fp32_matmul_prec="highest")
    a, b = _model(), _model()
    for params, split in ((a, QKV_SPLIT), (b, None)):
        opt = MuonWithAdamW([dict(params=[params["qkv"]], algorithm="muon")], lr=0.1, config=cfg,
                            catalogue=MatrixCatalogue((MatrixLayout("qkv", (24, 16), None, 1, split),),
                                                      (params["qkv"],)))
        _grads(params, 0)
        opt.step()
    assert (a["qkv"] - b["qkv"]).abs().max().item() > 1e-3


def test_the_catalogue_must_name_every_muon_param():
    p = _model()
    with pytest.raises(ValueError, match="every muon param must appear exactly once"):
        MuonWithAdamW([dict(params=[p["qkv"], p["proj"]], algorithm="muon")],
                      catalogue=MatrixCatalogue((MatrixLayout("qkv", (24, 16), None, 1),), (p["qkv"],)))


def test_the_optimizer_is_built_in_one_call_with_its_catalogue_and_plans():
    """The catalogue is given at construction and the plans are built there, once: the step
    executes those same plan objects, and there is no later phase that could replace them."""
    p = _model()
    catalogue = MatrixCatalogue((MatrixLayout("qkv", (24, 16), None, 1, QKV_SPLIT),), (p["qkv"],))
    opt = MuonWithAdamW([dict(params=[p["qkv"]], algorithm="muon")], lr=0.1, catalogue=catalogue)
    plans = opt.plans
    assert opt.catalogue is catalogue and plans["muon"].matrices == catalogue.layouts
    _grads(p, 0)
    opt.step()
    opt.step()
    assert opt.plans is plans and opt.plan is plans["muon"]
    with pytest.raises(AttributeError):
        opt.plans = {}  # read-only: the plan is the optimizer's, not a setting
    with pytest.raises(ValueError, match=r"^MuonWithAdamW: catalogue: expected a MatrixCatalogue or None, got dict$"):
        MuonWithAdamW([dict(params=[p["proj"]], algorithm="muon")], catalogue={})


def test_a_view_of_a_leaf_is_a_param_and_any_other_non_leaf_is_refused():
    """Megatron's ZeRO-1 main shard of an fp32 param is a flat view of the model param, so the
    update lands in the model; torch's leaf rule would refuse it. Any other non-leaf tensor is
    still refused, since an in-place update of it never reaches the model."""
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    shard = weight.view(-1)[8:24]  # rows 2-5, as Megatron's main shard of an fp32 param is cut
    opt = MuonWithAdamW([dict(params=[shard], algorithm="adamw")], lr=0.5)
    assert opt.param_groups[0]["params"][0] is shard
    assert "differentiable" not in opt.param_groups[0] and "differentiable" not in opt.defaults
    before = weight.detach().clone()
    shard.grad = torch.ones(16)
    opt.step()
    assert torch.equal(weight.detach()[:2], before[:2])
    assert (weight.detach()[2:] - before[2:]).abs().min().item() > 0.1  # the update is the model param's
    non_leaf = r"^MuonWithAdamW: param group 0 parameter 0: expected a leaf tensor or a view"
    with pytest.raises(ValueError, match=non_leaf):
        MuonWithAdamW([dict(params=[weight * 2], algorithm="adamw")])


def test_unknown_algorithm():
    expected = r"^MuonWithAdamW: param group 0: algorithm: expected one of \('muon', 'adamw'\), got 'lion'$"
    with pytest.raises(ValueError, match=expected):
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


def test_a_flat_muon_param_without_a_catalogue_is_refused_at_construction():
    """A 1-D Muon param is a flat range of some matrix only a catalogue can name: refused when
    the optimizer is built, before any step could write a param."""
    flat, bias = torch.nn.Parameter(torch.ones(12)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"^MuonWithAdamW: muon parameter 0 has shape \(12,\): a flat range"):
        MuonWithAdamW([dict(params=[flat], algorithm="muon"), dict(params=[bias], algorithm="adamw")], lr=0.1)

