"""Gram Newton–Schulz (``core.newton_schulz.gram_newton_schulz``): the standard iteration rewritten.

References: the float64 standard iteration with the same coefficients (the polynomial both
compute) and the float64 polar factor (SVD). The test matrices have a gradient-like spectrum
(singular values spread over four decades, logspace(0, −4)), where the Gram's rounding shows:
without its restart the Gram iteration drifts (bf16: relative error > 1, against 0.1).
"""

from __future__ import annotations

import pytest
import torch
from rounding_bounds import ns_bound, ns_lipschitz

from megatron_muon.core.newton_schulz import (
    COEFFICIENT_SETS,
    GRAM_MIN_ASPECT,
    NSOptions,
    gram_blocks,
    gram_newton_schulz,
    gram_ns_flops,
    newton_schulz,
    ns_flops,
    sharded_gram_flops,
    sharded_runs_gram,
)

# (short, long): 3.5:1 (Llama-3 MLP), 8:1, a thin 32 × 1024 (the 28672 × 512 class, scaled), square
SHAPES = [(64, 224), (224, 64), (32, 256), (32, 1024), (96, 96)]
# How much more the fp32 Gram iteration errs without its restart: the drift of its first block
# (Q no longer a polynomial of R) is carried through the three steps the restart would have
# recomputed, each growing it by up to L_j (rounding_bounds.ns_lipschitz: 6.65 · 2.88 · 2.84 = 54
# for quintic); with the restart both iterations round alike, so the two errors differ by a small
# factor. √54 = 7.4, the geometric middle, is the bound between the two, a ratio of two errors of
# the same run, so whatever order this machine's GEMMs sum in, it cancels.
RESTART_GAIN = ns_lipschitz("quintic", 5)[2] * ns_lipschitz("quintic", 5)[3] * ns_lipschitz("quintic", 5)[4]


def spectrum_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """float64 U·diag(logspace(0, −4))·Vᵀ with random orthogonal U, V."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    return U @ torch.diag(torch.logspace(0, -4, k, dtype=torch.float64)) @ V.T


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", sorted(COEFFICIENT_SETS))
def test_float64_gram_is_the_standard_polynomial(shape, coefficients):
    """In float64 the two iterations are the same polynomial; only rounding separates them: two
    float64 NS roundings of this matrix through this schedule (rounding_bounds.ns_bound: u =
    1.1e-16, √(2m + 4k) ≤ 47, the growth of the four-decade spectrum): 6e-12 … 5.2e-10, measured
    ≤ 1.8e-14 for five steps and 1.3e-11 for deepseekv4's ten (whose block after the one restart
    is eight steps long). A Gram iteration that computed another polynomial (a step, a
    coefficient or the M·R·M update wrong) is off by 1e-2 or more."""
    x = spectrum_matrix(*shape)
    steps = 10 if coefficients == "deepseekv4" else 5
    want = newton_schulz(x, steps, coefficients)
    got = gram_newton_schulz(x, steps, coefficients)
    assert (got - want).abs().max().item() <= ns_bound(torch.float64, x, coefficients, steps, gram=True)


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_fp32_gram_agrees_with_float64_and_needs_its_restart(shape):
    """fp32 against the float64 polynomial, in units of standard fp32 NS's own error on the same
    matrix (so the machine's GEMM order cancels). The Gram squares the matrix's spread (R = X·Xᵀ
    has singular values 1 … 1e-8 here), so its rounding is relative to the largest and drifts
    through the a × a products; the bound is √RESTART_GAIN = 7.4× standard's error (RESTART_GAIN
    derives it). Measured over seeds, thread counts 1–2 and oneDNN on/off: 1.2–2.3× with the
    restart, 42–76× without it (standard's own error 4.5e-6 … 5.3e-6): skipping the restart fails."""
    x = spectrum_matrix(*shape)
    want = newton_schulz(x, 5, "quintic")
    standard = rel(newton_schulz(x.float(), 5, "quintic"), want)
    assert rel(gram_newton_schulz(x.float(), 5, "quintic"), want) <= RESTART_GAIN ** 0.5 * standard
    assert rel(gram_newton_schulz(x.float(), 5, "quintic", restarts=()), want) > RESTART_GAIN ** 0.5 * standard


@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gram_is_as_close_as_standard(shape, dtype):
    """bf16 / fp16: what the restart exists for. Measured relative error against the float64
    polynomial, Gram ÷ standard in the same dtype: 1.05–1.17 (bf16), 0.99–1.13 (fp16); without the
    restart bf16 reaches 4.7 to 959 (the spurious negative eigenvalues of the write-up) and fp16
    0.16–0.55. Bound: 1.5× standard's error (a ratio of two errors of the same run, so the
    machine's GEMM order cancels): above what the Gram's extra k × k reductions alone add
    (√((m + 4k) / (m + 2k)) ≤ 1.29 here, rounding_bounds' model point 3; measured 0.96–1.09 over
    8 seeds, thread counts 1–2 and oneDNN on/off), ten times below skipping the restart."""
    x = spectrum_matrix(*shape)
    want = newton_schulz(x, 5, "quintic")
    standard = rel(newton_schulz(x.to(dtype), 5, "quintic"), want)
    assert rel(gram_newton_schulz(x.to(dtype), 5, "quintic"), want) <= 1.5 * standard
    assert rel(gram_newton_schulz(x.to(dtype), 5, "quintic", restarts=()), want) > 1.5 * standard


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_fp16_products_beat_bf16_on_bf16_input(shape):
    """``gram_dtype=float16`` (--muon-gram-fp16) on the bf16 input NS receives in the optimizer:
    against float64 standard NS of that same bf16 input, measured relative error with fp16
    products 0.070–0.106, bf16 Gram 0.099–0.126, bf16 standard 0.092–0.127 (ratio to bf16 Gram
    0.69–0.85: not the 8× of fp16's mantissa, because X enters already rounded to bf16 and the
    result is rounded back to it). Bound: 0.95× the bf16 Gram's error. What it guards against is
    gram_dtype ignored, which is the bf16 Gram op for op: a ratio of exactly 1, so the bound only
    has to sit below 1; the ratio's spread over 8 seeds, thread counts 1–2 and oneDNN on/off is
    0.67–0.88 (a ratio of two errors of the same run: the GEMM order moves it by the realization
    of its roundings only). The result keeps the input's dtype, and the restart is still needed
    (without it: 0.31–0.71, 4.1–6.8× the fp16 error; bound 2×)."""
    x = spectrum_matrix(*shape).to(torch.bfloat16)
    want = newton_schulz(x.double(), 5, "quintic")
    fp16 = gram_newton_schulz(x, 5, "quintic", gram_dtype=torch.float16)
    assert fp16.dtype == torch.bfloat16 and fp16.shape == x.shape
    assert rel(fp16, want) <= 0.95 * rel(gram_newton_schulz(x, 5, "quintic"), want)
    assert rel(gram_newton_schulz(x, 5, "quintic", gram_dtype=torch.float16, restarts=()), want) > 2 * rel(fp16, want)


def test_fp16_products_only_where_they_mean_something():
    """NSOptions routes gram_dtype to the Gram path only (the square fallback stays bf16) and
    refuses it where it would be ignored (standard method) or would lower precision (fp32 NS)."""
    opts = NSOptions(method="gram", gram_dtype=torch.float16)
    long, square = spectrum_matrix(64, 224).to(torch.bfloat16), spectrum_matrix(64, 64).to(torch.bfloat16)
    assert torch.equal(opts(long), gram_newton_schulz(long, 5, "quintic", gram_dtype=torch.float16))
    assert torch.equal(opts(square), newton_schulz(square, 5, "quintic"))
    for bad in (dict(method="standard", gram_dtype=torch.float16),
                dict(method="gram", dtype=torch.float32, gram_dtype=torch.float16),
                dict(method="gram", gram_dtype=torch.float64)):
        with pytest.raises(ValueError, match="^--muon-gram-fp16: expected with --muon-ns-method gram"):
            NSOptions(**bad)


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_as_far_from_the_polar_factor_as_standard(shape):
    """Five quintic steps do not reach the polar factor U·Vᵀ (the small singular values are still
    growing); Gram NS must land where standard NS lands: the same fp32 distance to the float64
    polar factor and the same singular values, to the two results' rounding. Both differences are
    at most ‖gram − standard‖ (triangle inequality; Weyl's for singular values), which is at most
    the two errors against the float64 polynomial, bounded by (1 + √RESTART_GAIN) × standard's
    own error (test_fp32_gram_agrees_with_float64_and_needs_its_restart): 8.4 × 4.5e-6 … 5.3e-6
    relative, measured 4e-8 … 3.7e-7 for the distance and ≤ 6.5e-6 (absolute, singular values
    0.68 … 1.12) for the singular values, over thread counts 1–2 and oneDNN on/off. Landing
    elsewhere (another polynomial, a lost restart's drift of 2e-4) is off by more."""
    x = spectrum_matrix(*shape)
    U, _, Vh = torch.linalg.svd(x, full_matrices=False)
    polar = U @ Vh
    standard, gram = newton_schulz(x.float(), 5, "quintic"), gram_newton_schulz(x.float(), 5, "quintic")
    want = newton_schulz(x, 5, "quintic")
    bound = (1 + RESTART_GAIN ** 0.5) * rel(standard, want)  # relative to ‖want‖ ≈ ‖polar‖ (rel ≤ 0.5)
    assert abs(rel(gram, polar) - rel(standard, polar)) <= bound * want.norm().item() / polar.norm().item()
    s_std = torch.linalg.svdvals(standard.double())
    s_gram = torch.linalg.svdvals(gram.double())
    assert (s_gram - s_std).abs().max().item() <= bound * want.norm().item()


def test_restarts_cut_the_schedule():
    steps = list(range(5))
    assert gram_blocks(steps, (2,)) == [[0, 1], [2, 3, 4]]
    assert gram_blocks(steps, ()) == [steps]
    assert gram_blocks(steps, (0, 5, 9)) == [steps]  # outside 1 … 4: ignored
    assert gram_blocks(steps, (3, 1)) == [[0], [1, 2], [3, 4]]


def test_flops_count_the_operations():
    """Per block of j steps: R and Q·X (4a²b), R² each step, M·Q after the first, M·R·M before
    the last. Five steps with one restart: 8a²b + 28a³ (standard: 20a²b + 10a³)."""
    a, b = 64, 224
    assert gram_ns_flops(a, b) == gram_ns_flops(b, a) == 8 * a * a * b + 28 * a ** 3
    assert gram_ns_flops(a, b, restarts=()) == 4 * a * a * b + 34 * a ** 3
    assert ns_flops(a, b) == 20 * a * a * b + 10 * a ** 3
    # equal FLOPs at aspect 1.5; NSOptions falls back below the measured 1.75 (GRAM_MIN_ASPECT)
    assert gram_ns_flops(64, 96) == ns_flops(64, 96) and GRAM_MIN_ASPECT == 1.75
    # distributed: each rank its share of the rectangular products, the k × k iteration whole
    assert sharded_gram_flops(64, 56, 5) == 2 * 4 * 64 * 64 * 56 + 28 * 64 ** 3


def test_nsoptions_runs_gram_where_it_is_cheaper():
    """``method="gram"``: the Gram iteration from aspect 1.75 on, the standard one below (bitwise
    the standard result, since it is the standard call), and FLOPs to match."""
    gram = NSOptions(5, "quintic", dtype=torch.float32, method="gram")
    standard = NSOptions(5, "quintic", dtype=torch.float32)
    square = spectrum_matrix(64, 96).float()  # aspect 1.5: FLOPs equal, measured slower: standard
    assert torch.equal(gram(square), standard(square))
    assert gram.flops(64, 96) == standard.flops(64, 96) == ns_flops(64, 96)
    long = spectrum_matrix(64, 224).float()
    assert torch.equal(gram(long), gram_newton_schulz(long, 5, "quintic"))
    assert gram.flops(64, 224) == gram_ns_flops(64, 224) < ns_flops(64, 224)
    batch = torch.stack([spectrum_matrix(224, 64, seed=s).float() for s in range(3)])
    # Batching changes the GEMMs' blocking, so the order of their sums (bmm against mm; with two
    # threads MKL splits them differently again): two fp32 Gram NS roundings of this 224 × 64
    # four-decade spectrum, rounding_bounds.ns_bound = 5e-3 (measured 2.3e-6 with two threads, 0
    # with one). Mixing up the batch's matrices would be off by ~0.3, the size of their entries.
    assert torch.allclose(gram(batch)[1], gram(batch[1]), rtol=0,
                          atol=ns_bound(torch.float32, batch[1], "quintic", gram=True))
    assert sharded_runs_gram("gram", 64, 56, 4) and not sharded_runs_gram("gram", 64, 8, 4)  # 64 > 32
    assert not sharded_runs_gram("standard", 64, 56, 4)
    with pytest.raises(ValueError, match="--muon-ns-method: expected one of"):
        NSOptions(method="fastest")


def test_zero_rows_stay_zero_and_empty_matrices_stay_empty():
    x = spectrum_matrix(32, 128).float()
    x[5] = 0
    out = gram_newton_schulz(x)
    assert torch.equal(out[5], torch.zeros(128))
    assert gram_newton_schulz(torch.zeros(0, 7)).shape == (0, 7)
    assert torch.equal(gram_newton_schulz(torch.zeros(8, 40)), torch.zeros(8, 40))
