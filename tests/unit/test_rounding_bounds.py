"""tests/rounding_bounds.py, the suite's derived tolerances: its pieces against brute force, and its
bounds between what fp32 rounding does and what a wrong answer does."""

from __future__ import annotations

import pytest
import torch
from rounding_bounds import _gains, _image, ns_bound, ns_growth, ns_lipschitz, sum_bound, unit_roundoff

from megatron_muon.core.newton_schulz import COEFFICIENT_SETS, coefficient_schedule, newton_schulz


def test_unit_roundoff_and_sums():
    assert unit_roundoff(torch.float32) == 2.0 ** -24 and unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert sum_bound(torch.float64, 100, 3.0, roundings=1) == 10 * 2.0 ** -53 * 3.0


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_each_steps_range_is_its_polynomials_image(name):
    """_image (closed form) against |p| on a dense grid of [lo, hi], for every step of every set."""
    lo, hi = 0.05, 1.0
    for a, b, c in coefficient_schedule(name, 10):
        sigma = torch.linspace(lo, hi, 200_001, dtype=torch.float64)
        p = (sigma * (a + b * sigma ** 2 + c * sigma ** 4)).abs()
        got = _image(a, b, c, lo, hi)
        assert got[1] == pytest.approx(p.max().item(), rel=1e-9) and got[0] <= p.min().item() + 1e-12
        lo, hi = got


@pytest.mark.parametrize("name", ["jordan", "quintic", "polar_express"])
def test_growth_bounds_how_far_a_perturbation_moves_ns(name):
    """Λ of all five steps over the input's spectrum (model point 4) against NS itself in float64:
    a perturbation E of the normalized input moves the result by at most Λ·‖E‖ (Frobenius),
    for random E and for E along the smallest singular direction, where the slope is steepest.
    The product of the per-step factors (ns_lipschitz) is larger still."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 24, generator=g, dtype=torch.float64)
    x = x / x.norm()
    U, s, Vh = torch.linalg.svd(x, full_matrices=False)
    lipschitz = _gains(coefficient_schedule(name, 5), s.min().item(), s.max().item())[0]
    eps = 1e-7
    for e in (torch.randn(48, 24, generator=g, dtype=torch.float64), U[:, -1:] @ Vh[-1:]):
        e = e / e.norm() * eps
        moved = (newton_schulz(x + e, 5, name, eps=0) - newton_schulz(x, 5, name, eps=0)).norm().item()
        assert moved <= lipschitz * eps * (1 + 1e-3)  # first order: Λ is a sup of the divided differences
    assert lipschitz <= torch.tensor(ns_lipschitz(name)).prod().item()


@pytest.mark.parametrize("shape", [(96, 40), (64, 64), (16, 96)])
@pytest.mark.parametrize("name", ["jordan", "quintic"])
def test_fp32_error_is_below_the_bound_and_the_bound_below_a_wrong_answer(shape, name):
    """fp32 NS against float64 stays under ns_bound(roundings=1) with room (measured ≤ 1/20 of it),
    and the bound stays under 1e-2, the size of the smallest wrong answer the TP tests tell apart
    (blockwise NS: ≥ 5e-2); ns_growth is larger for any input than for this one."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    error = (newton_schulz(x.float(), 5, name).double() - newton_schulz(x, 5, name)).abs().max().item()
    bound = ns_bound(torch.float32, x, name, roundings=1)
    assert error <= bound / 5 and 2 * bound <= 1e-2
    assert ns_bound(torch.float32, shape, name) >= 2 * bound
    assert ns_growth(name) >= ns_growth(name, spectrum=(0.1, 0.3))
