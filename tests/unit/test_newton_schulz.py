"""newton_schulz: shapes, dtypes, coefficient schedules, references and errors (one process)."""

from __future__ import annotations

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils as eo_muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as eo_newton_schulz
from rounding_bounds import ns_bound, ns_step_bound
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from megatron_muon import newton_schulz, ns_flops
from megatron_muon.core.newton_schulz import (
    COEFFICIENT_SETS,
    coefficient_schedule,
    power_of_two_floor,
    quintic_iteration,
    reassociates,
    sharded_ns_flops,
)

SHAPES = [(96, 40), (40, 96), (64, 64), (48, 24), (1, 7), (7, 1)]
# Every coefficient-set name the installed emerging-optimizers knows (read from its table, so a
# new set there fails test_every_emerging_set_is_ours until it is added here), plus our alias.
EMERGING_SETS = sorted(eo_muon_utils._COEFFICIENT_SETS)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_equal_to_torch_optim_muon_in_bf16(shape):
    """Same op sequence as torch.optim.Muon's private NS (bf16, jordan, 5 steps) on the same
    shapes in one process, so the same kernels and thread count sum in the same order on any
    machine: atol = 0."""
    g = randn(*shape)
    want = torch_zeropower(g, COEFFICIENT_SETS["jordan"][0], 5, 1e-7)
    got = newton_schulz(g.bfloat16(), 5, "jordan")
    assert got.dtype == torch.bfloat16 and got.shape == g.shape
    assert torch.equal(got, want)


def test_every_emerging_set_is_ours():
    """Same names, same numbers (both tables hold the published decimals; a float compare is exact)."""
    assert {"simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"} <= set(EMERGING_SETS)
    for name in EMERGING_SETS:
        assert COEFFICIENT_SETS[name] == tuple(tuple(t) for t in eo_muon_utils._COEFFICIENT_SETS[name]), name


@pytest.mark.parametrize("name", ["jordan", *EMERGING_SETS])
@pytest.mark.parametrize("steps", [1, 3, 5, 9, 12])
def test_named_sets_match_emerging_optimizers(name, steps):
    """Steps 9 > every set's length but deepseekv4's 10, 12 > that one, so the cycle /
    repeat-last rules are exercised for every set."""
    g = randn(96, 40, seed=steps)
    theirs = eo_newton_schulz(g, steps, "simple" if name == "jordan" else name)
    ours = newton_schulz(g, steps, name)
    # fp32; emerging normalizes with F.normalize (another norm kernel) and calls its own GEMMs,
    # so the two round differently: rounding_bounds.ns_bound for this matrix and schedule, 4e-6
    # (one step) … 2.3e-4 (quintic, five) … 1.7e-2 (CANS, five: coefficients up to 25 and a first
    # step that swings singular values to 1.8), measured < 1e-6. Another coefficient, another
    # cycle or repeat-last rule, another normalization moves entries by 0.1 or more.
    assert (ours - theirs).abs().max().item() <= ns_bound(torch.float32, g, name, steps)


def test_explicit_list_cycles_like_emerging_custom():
    coeffs = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    g = randn(40, 96, seed=3)
    theirs = eo_newton_schulz(g, 5, "custom", custom_coefficient_sets=coeffs)
    # as in test_named_sets_match_emerging_optimizers: two fp32 NS roundings (bound 6e-5)
    assert (newton_schulz(g, 5, coeffs) - theirs).abs().max().item() <= ns_bound(torch.float32, g, coeffs)
    assert coefficient_schedule(coeffs, 5) == [coeffs[0], coeffs[1], coeffs[0], coeffs[1], coeffs[0]]


def test_schedule_rules():
    pe = COEFFICIENT_SETS["polar_express"]
    assert coefficient_schedule("polar_express", 10) == list(pe) + [pe[-1], pe[-1]]  # repeat last
    q = COEFFICIENT_SETS["quintic"]
    assert coefficient_schedule("quintic", 7) == list(q) + [q[0], q[1]]  # cycles


def test_batched_equals_each_matrix():
    x = randn(5, 48, 24, seed=4)
    batched = newton_schulz(x)
    each = torch.stack([newton_schulz(m) for m in x])
    # baddbmm vs addmm may block the GEMM differently: two fp32 NS roundings of each matrix,
    # rounding_bounds.ns_bound ≤ 2.7e-4 here; NS of the wrong batch entry is off by ~0.3.
    assert all((batched[i] - each[i]).abs().max().item() <= ns_bound(torch.float32, x[i]) for i in range(len(x)))


def test_output_is_nearly_orthogonal():
    """Jordan's quintic leaves singular values in roughly [0.7, 1.2] (it trades exactness for
    slope at zero), far from the input's spread."""
    x = randn(64, 32, seed=5) @ torch.diag(torch.logspace(-2, 1, 32))
    s = torch.linalg.svdvals(newton_schulz(x, 10))
    assert s.min() > 0.6 and s.max() < 1.25


def test_transposes_tall_matrices():
    x = randn(96, 40, seed=6)
    # Same math on the same orientation; only the memory layout handed to the GEMM differs
    # (a transposed view vs a contiguous copy), which may change its blocking, so the order of
    # its sums: two fp32 NS roundings, rounding_bounds.ns_bound = 2.3e-4. NS of the other
    # orientation's Gram (untransposed: a 96 × 96 A) differs by far more.
    assert (newton_schulz(x) - newton_schulz(x.T.contiguous()).T).abs().max().item() <= ns_bound(torch.float32, x)


def test_zero_matrix_and_zero_rows():
    assert torch.equal(newton_schulz(torch.zeros(8, 5)), torch.zeros(8, 5))  # eps clamp: no NaN
    x = randn(10, 6, seed=7)
    x[3] = 0
    padded = newton_schulz(x)
    assert torch.equal(padded[3], torch.zeros(6))
    # NS preserves zero rows, so zero-padding then cropping equals NS of the unpadded matrix, up
    # to the order of the sums (a 10-row and a 9-row GEMM may be blocked differently): two fp32
    # NS roundings, rounding_bounds.ns_bound = 1.3e-4. A zero row that leaked would move entries
    # by their size, ~0.3.
    keep = [i for i in range(10) if i != 3]
    assert (padded[keep] - newton_schulz(x[keep])).abs().max().item() <= ns_bound(torch.float32, x[keep])


def test_deepseekv4_schedule_repeats_its_last_step():
    ds = COEFFICIENT_SETS["deepseekv4"]
    assert len(ds) == 10 and ds[:8] == (COEFFICIENT_SETS["jordan"][0],) * 8 and ds[8:] == ((2.0, -1.5, 0.5),) * 2
    assert coefficient_schedule("deepseekv4", 12) == list(ds) + [ds[-1], ds[-1]]


@pytest.mark.parametrize("dtype, power", [(torch.float32, 100), (torch.bfloat16, 125), (torch.float16, 10)])
@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (3, 48, 24)])
def test_huge_entries_give_the_update_of_the_scaled_down_matrix(shape, dtype, power):
    """NS is scale-invariant. Entries ~1e30 (fp32), next to bf16's max 3.4e38 (randn's largest
    entries ~4.5 × 2^125 < 2^128) or to fp16's 65504 (× 2^10) used to overflow ‖X‖_F to inf and
    return zeros. Scaling by 2^power is exact and so is the power-of-two prescale, so the
    result is bitwise the unscaled one (atol = 0)."""
    x = randn(*shape, seed=11).to(dtype)
    want = newton_schulz(x)
    assert want.abs().max() > 0.1
    assert torch.equal(newton_schulz(x * 2.0**power), want)


def test_huge_entries_not_a_power_of_two():
    x = randn(64, 32, seed=12)
    got = newton_schulz(x * 1e30)
    # x·1e30 rounds each entry by up to u (relative 6e-8): a perturbation of the normalized input
    # no larger than normalization's own rounding, which rounding_bounds' model counts below step
    # 1's; the two NS runs may also sum in different orders. Bound: two fp32 NS roundings,
    # rounding_bounds.ns_bound = 2.3e-4; a silent zero or an overflowed norm is off by ~0.3.
    assert (got - newton_schulz(x)).abs().max().item() <= ns_bound(torch.float32, x)


def test_non_finite_input_gives_non_finite_output():
    """An inf or NaN gradient (which Megatron's found-inf check skips) must not come out as a
    silent zero update."""
    for bad in (float("inf"), float("nan")):
        x = randn(8, 5, seed=13)
        x[2, 3] = bad
        assert not torch.isfinite(newton_schulz(x)).all()


def test_power_of_two_floor():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        a = torch.tensor([0.0, 0.3, 1.0, 3.0, 1e4, float("inf"), float("nan")]).to(dtype)
        got = power_of_two_floor(a)
        assert got.dtype == dtype
        assert got.tolist()[:5] == [1.0, 0.25, 1.0, 2.0, 8192.0] and got.tolist()[5:] == [float("inf")] * 2
    assert power_of_two_floor(torch.tensor(3e38)).item() == 2.0**127  # fp32's largest power of two
    assert power_of_two_floor(torch.tensor(1e-40)).item() == 1.0  # subnormal: no scaling


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (3, 0, 5), (3, 5, 0), (0, 4, 6)])
def test_empty_matrices_give_an_empty_result(shape):
    x = torch.ones(shape, dtype=torch.bfloat16)
    got = newton_schulz(x)
    assert got.shape == shape and got.dtype == torch.bfloat16


def test_ns_flops():
    assert ns_flops(64, 64) == 30 * 64**3
    assert ns_flops(96, 40) == ns_flops(40, 96) == 5 * (4 * 40 * 40 * 96 + 2 * 40**3)
    assert ns_flops(10, 20, steps=1) == 4 * 100 * 20 + 2 * 1000


@pytest.mark.parametrize("shape", [(48, 8), (48, 47), (48, 48), (16, 96), (3, 48, 8), (3, 16, 96)])
def test_quintic_iteration_is_the_quintic_in_either_order(shape):
    """Both associations against the polynomial in float64: a·X + b·A·X + c·A·A·X.

    fp32 tolerance: one step's rounding against float64 (rounding_bounds.ns_step_bound: u·√(cols
    + 2·rows) times the step's partial sums, ≤ 13.9·σ_max for these coefficients): 0.9e-6 … 1.9e-6,
    measured ≤ 8e-8. A wrong term or association moves entries by ~0.1."""
    X = randn(*shape, seed=3)
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    a, b, c = COEFFICIENT_SETS["quintic"][0]
    X64 = X.double()
    A64 = X64 @ X64.mT
    want = a * X64 + b * (A64 @ X64) + c * (A64 @ (A64 @ X64))
    got = quintic_iteration(X, X @ X.mT, a, b, c)
    assert got.shape == X.shape
    torch.testing.assert_close(got.double(), want, atol=ns_step_bound(torch.float32, X, a, b, c, roundings=1), rtol=0)


def test_reassociation_rule_and_its_flops():
    assert reassociates(48, 8) and not reassociates(48, 48) and not reassociates(16, 96)
    # a shard as wide as its Gram: the usual 4k²c + 2k³ per step; narrower: 6k²c, no k³ term
    assert sharded_ns_flops(64, 64) == ns_flops(64, 64)
    assert sharded_ns_flops(64, 8, steps=1) == 6 * 64 * 64 * 8
    assert sharded_ns_flops(64, 100, steps=1) == 4 * 64 * 64 * 100 + 2 * 64**3
    # Llama-3 405B fc1 half (53248 × 16384) at TP8: k = 16384, 6656 local rows; 53.6 TFLOP per rank
    # reassociated against 79.7 with A² formed (five steps)
    assert round(sharded_ns_flops(16384, 6656) / 1e12, 1) == 53.6
    assert round(5 * (4 * 16384**2 * 6656 + 2 * 16384**3) / 1e12, 1) == 79.7


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: newton_schulz(torch.ones(5)), r"2-D \(m, n\) or 3-D .* got shape \(5,\)"),
        (lambda: newton_schulz(torch.ones(2, 2, 2, 2)), r"got shape \(2, 2, 2, 2\)"),
        (lambda: newton_schulz(torch.ones(3, 3), steps=0), r"steps must be an integer >= 1, got 0"),
        (lambda: newton_schulz(torch.ones(3, 3), coefficients="nope"), r"unknown coefficient set 'nope'"),
        (lambda: newton_schulz(torch.ones(3, 3), coefficients=[(1.0, 2.0)]), r"\(a, b, c\) tuples"),
        (lambda: newton_schulz(torch.ones(3, 3, dtype=torch.int64)), r"floating-point"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("inside", ["medium", "high", "highest"])
def test_fp32_matmul_precision_is_set_inside_the_call_only(inside):
    """--muon-fp32-matmul-prec means torch's float32 matmul precision *inside* Newton–Schulz (high:
    TF32 on GPUs), whatever the launcher set around it, and the launcher's setting after it: every
    GEMM of the call sees ``inside``, the caller's value is restored (also when the call raises)."""
    from torch.overrides import TorchFunctionMode

    from megatron_muon.core.newton_schulz import NSOptions

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.__matmul__, torch.matmul, torch.addmm, torch.baddbmm):
                seen.append(torch.get_float32_matmul_precision())
            return func(*args, **(kwargs or {}))

    before = torch.get_float32_matmul_precision()
    outside = "highest" if inside != "highest" else "medium"
    torch.set_float32_matmul_precision(outside)
    try:
        for method in ("standard", "gram"):
            with Spy():
                NSOptions(dtype=torch.float32, method=method, fp32_precision=inside)(randn(8, 24))
            assert seen and set(seen) == {inside}, (method, set(seen))
            assert torch.get_float32_matmul_precision() == outside
            seen.clear()
        with pytest.raises(ValueError):
            NSOptions(dtype=torch.float32, fp32_precision=inside)(randn(3, 4, 5, 6))  # 4-D: refused inside
        assert torch.get_float32_matmul_precision() == outside
        with pytest.raises(ValueError, match="--muon-fp32-matmul-prec: expected one of"):
            NSOptions(fp32_precision="low")
    finally:
        torch.set_float32_matmul_precision(before)
