"""megatron_muon.Muon against torch.optim.Muon, step by step, bitwise on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_muon import Muon

SHAPES = [(96, 40), (40, 96), (64, 64), (48, 24)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _run(opt_cls, steps, **kwargs):
    params = _params()
    opt = opt_cls(params, **kwargs)
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn, weight_decay",
    list(itertools.product([True, False], [None, "original", "match_rms_adamw"], [0.0, 0.1])),
)
def test_matches_torch_optim_muon_bitwise(nesterov, adjust_lr_fn, weight_decay):
    kwargs = dict(lr=0.02, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay)
    ours, our_opt = _run(Muon, 4, **kwargs)
    theirs, their_opt = _run(torch.optim.Muon, 4, **kwargs)
    for a, b in zip(ours, theirs):
        # Same ops on the same shapes in one process (bf16 NS, fp32 update): the same kernels and
        # thread count, so the same summation order on any machine: atol = 0.
        assert torch.equal(a, b)
    for a, b in zip(ours, theirs):
        assert torch.equal(our_opt.state[a]["momentum_buffer"], their_opt.state[b]["momentum_buffer"])


def test_defaults_match_torch():
    ours, _ = _run(Muon, 2)
    theirs, _ = _run(torch.optim.Muon, 2)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_fp32_ns_is_close_to_bf16():
    ours, _ = _run(Muon, 3, lr=0.02, ns_dtype=torch.float32)
    theirs, _ = _run(torch.optim.Muon, 3, lr=0.02)
    for a, b in zip(ours, theirs):
        # The update differs by bf16's rounding inside NS, grown through the steps. Unlike an
        # fp32 reordering that gap is the format's, not the machine's: bf16 products are exact
        # in fp32 and CPU GEMMs accumulate in fp32, so each bf16 output is the rounded fp32 sum,
        # which another order moves by √n·2^-24, 2^16 below a bf16 rounding (2^-8). Measured
        # 6e-3 … 8e-3 per entry (1.6–2 u_bf16) on these shapes; 0.05 (13 u_bf16) bounds it, times
        # lr·adjust ≤ 0.02·1.55, over 3 steps: 4.7e-3. A broken fp32 path moves params by
        # lr·adjust·|U| ≈ 1e-2 a step.
        assert (a - b).abs().max().item() <= 3 * 0.02 * 1.55 * 0.05


def test_coefficients_override():
    ours, _ = _run(Muon, 2, coefficients="quintic", ns_dtype=torch.float32)
    plain, _ = _run(Muon, 2, ns_dtype=torch.float32)
    assert not all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_skips_params_without_grad():
    p, q = _params()[:2]
    opt = Muon([p, q])
    before = q.detach().clone()
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(q, before) and q not in opt.state


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(adjust_lr_fn="bogus"), r"adjust_lr_fn must be one of .* got 'bogus'"),
        (dict(ns_steps=0), r"steps must be an integer >= 1"),
        (dict(lr=-1.0), r"lr must be >= 0"),
        (dict(coefficients="nope"), r"unknown coefficient set 'nope'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(_params(), **kwargs)


def test_rejects_non_matrix_parameter_by_name_and_shape():
    with pytest.raises(ValueError, match=r"param group 0 parameter 1 has shape \(7,\)"):
        Muon([torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(7))])
