"""Bounds for comparing one value computed two ways that round differently.

Two computations of the same value in another order (batched against single GEMMs, another
thread count, another world size or GEMM shape, a Gram matrix summed over ranks, Gram against
standard Newton–Schulz, fp32 against a float64 reference) agree only to rounding, and the order
is the machine's choice: MKL, OpenBLAS and oneDNN block a GEMM's reductions by CPU model,
instruction set, thread count and shape. A bound read off one machine's difference is one sample
of one order (a bound of 1e-6 set that way failed at 2.3e-6 on an AVX-512 machine with two
threads); the bounds here are derived instead, once, from the dtype's unit roundoff, the
reduction lengths and the growth of rounding errors through Newton–Schulz (NS).

The model (first order in u; rounding errors independent, zero-mean random variables, the model
under which blocked, threaded and vectorized sums are analysed: Higham & Mary, "A new approach
to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019):

1. ``u = eps / 2``: fp32 2^-24 = 6.0e-8, bf16 2^-8 = 3.9e-3, float64 2^-53 = 1.1e-16.
2. A reduction of n terms (a GEMM's dot product, a sum over ranks) errs by √n·u times the
   magnitude of its partial sums, in any order (``sum_bound``).
3. One standard NS step X ← a·X + (b·A + c·A²)·X, A = X·Xᵀ, on a k × m iterate (k ≤ m) whose
   singular values are at most s reduces over m (A) and twice over k (A·A, B·X); on the other
   orientation (the TP modes may iterate on the long side's Gram: in exact arithmetic the same
   result) over k once and m twice, so n = k + 2m covers both. Cauchy–Schwarz on rows and
   columns bounds the partial sums: A's by s², B's by |b|s² + |c|s⁴ (reaching X times s), the
   new X's by (|a| + |b|s² + |c|s⁴)·s, and A's rounding reaches X through (b + 2c·A)·X, times
   (|b| + 2|c|s²)·s. The largest, μ = s·max((|b| + 2|c|s²)·s², |a| + |b|s² + |c|s⁴)
   (``step_magnitude``; at s = 1 the coefficient sum, 10.25 for Jordan's quintic), makes the
   step round each entry by √n·u·μ, the three reductions added in quadrature. The Gram
   iteration (``gram_newton_schulz``) reduces over m for R and over k for Q·X, R², M·Q and
   M·R·M (twice): m + 5k; n = 2m + 4k covers it and the standard iteration a mode falls back
   to (``NSOptions`` below ``GRAM_MIN_ASPECT``, a distributed shard whose Gram would be long).
4. An error E in the iterate after step j leaves the remaining steps as DF(E), F the odd
   polynomial P (the composition of those steps' quintics) applied to the iterate's singular
   values. In its singular bases DF is an entrywise (Schur) multiplier whose entries are the
   divided differences (P(σ_i) ∓ P(σ_j)) / (σ_i ∓ σ_j), P'(σ_i) and P(σ_i)/σ_i; in the Frobenius
   norm such a multiplier is bounded by its largest entry, so ‖DF(E)‖ ≤ Λ_j·‖E‖ with Λ_j the
   largest |P'| and |P(σ)/σ| over the singular values the iterate can have after step j (the
   image of the input's [σ_min, σ_max] under the steps so far: an input without small singular
   values never meets P'(0), the product of the remaining steps' slopes at zero). For rounding
   errors spread over all entries the largest entry follows the Frobenius norm, so Λ_j bounds
   the growth of an entry's error too.
5. An NS result's entries therefore err by at most u·√n·Σ_j μ_j·Λ_j (``ns_growth``), plus the
   normalization's: dividing by the norm rounds each entry by u·s_0, grown by Λ of all steps,
   and the norm itself, a reduction over all km entries (in distributed mode summed over
   ranks), errs by √(km)·u/2 relative, a common rescaling σ → (1 + δ)·σ that moves the result
   by δ·σ·P'(σ), at most δ·Γ with Γ = max |σ·P'(σ)| over the input's spectrum. Two results that
   round differently differ by twice that (``roundings=2``); one against a float64 reference,
   whose own rounding is 2^29 times smaller, by once (``roundings=1``).

Why not the worst case: n·u per reduction (Higham's γ_n, every rounding of one sign) and the
coefficient sum as every step's growth (≈ 10.3 for Jordan's quintic, a Lipschitz factor of its
polynomial on [0, 1]) give 224·u·10.3⁵ ≈ 1.6 for a 64 × 224 fp32 matrix: larger than any wrong
answer the tests exist to catch (a wrong shard, a dropped scale factor, blockwise in place of
the whole matrix: 1e-2 … 1). The model's fp32 bounds for five steps on the tests' Gaussian
matrices are 1e-4 … 2e-3 (the most on a square one, whose smallest singular value is near 0):
≥ 5× below those, and ≥ 5× above every difference measured (10 shapes, Gaussian and
four-decade spectra, eight schedules up to 12 steps, thread counts 1 and 2, batched, transposed
and Gram variants, fp32 against float64: at most 0.18 of the bound, the fp32 Gram iteration with
deepseekv4's eight-step block on the four-decade spectrum); each test says what it can catch.

bf16 is another matter: bf16 products are exact in fp32 and CPU GEMMs accumulate in fp32, so a
bf16 GEMM's output is its fp32 sum rounded once, whatever the order (which moves the fp32 sum by
√n·2^-24, 2^16 below a bf16 rounding): bf16 results differ across machines only where that sum
sits at a rounding tie, and the tests compare them bitwise where the op sequence is the same.
"""

from __future__ import annotations

import math

import torch

from megatron_muon.core.newton_schulz import DEFAULT_COEFFICIENTS, coefficient_schedule

__all__ = ["muon_params_bound", "ns_bound", "ns_growth", "ns_lipschitz", "ns_spectrum", "ns_step_bound",
           "step_magnitude", "sum_bound", "unit_roundoff"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def sum_bound(dtype: torch.dtype, n: int, magnitude: float = 1.0, *, roundings: int = 2) -> float:
    """|difference| of two sums of ``n`` terms in ``dtype`` whose partial sums stay below
    ``magnitude``, added in different orders (``roundings=2``), or of one against an exact sum
    (``roundings=1``): roundings·√n·u·magnitude (model point 2)."""
    return roundings * math.sqrt(n) * unit_roundoff(dtype) * magnitude


def _image(a: float, b: float, c: float, lo: float, hi: float) -> tuple[float, float]:
    """The singular values after one step from [lo, hi]: the range of |p(σ)|, p(σ) = aσ + bσ³ +
    cσ⁵, found at lo, hi, where p'(σ) = 0 (t = σ² a root of 5c·t² + 3b·t + a) and, for its least
    value, where p(σ) = 0 (t a root of c·t² + b·t + a)."""
    def roots(q2, q1, q0):  # the σ = √t, lo < σ < hi, of the roots t of q2·t² + q1·t + q0
        if not q2:
            ts = [-q0 / q1] if q1 else []
        else:
            disc = q1 * q1 - 4 * q2 * q0
            ts = [] if disc < 0 else [(-q1 + r) / (2 * q2) for r in (math.sqrt(disc), -math.sqrt(disc))]
        return [math.sqrt(t) for t in ts if lo * lo < t < hi * hi]

    p = lambda sigma: abs(sigma * (a + b * sigma ** 2 + c * sigma ** 4))
    values = [p(sigma) for sigma in (lo, hi, *roots(5 * c, 3 * b, a))]
    return (0.0 if roots(c, b, a) else min(values)), max(values)


def _ranges(schedule, spectrum: tuple[float, float]) -> list[tuple[float, float]]:
    """The singular values' range entering each step, and after the last."""
    ranges = [spectrum]
    for a, b, c in schedule:
        ranges.append(_image(a, b, c, *ranges[-1]))
    return ranges


def _gains(rest, lo: float, hi: float) -> tuple[float, float]:
    """(Λ, Γ) of the polynomial P composing the steps ``rest``, over singular values in [lo, hi]:
    Λ = the largest |P'(σ)| and |P(σ)/σ| (model point 4), Γ = the largest |σ·P'(σ)| (a common
    rescaling's effect, model point 5). On a linear and a geometric grid (P's steep part sits
    at small σ) and at σ = 0, where P'(0) = P(σ)/σ = the product of the slopes a, if lo is 0."""
    if hi <= 0:
        return 0.0, 0.0
    sigma = torch.cat([torch.linspace(lo, hi, 4097, dtype=torch.float64),
                       torch.logspace(math.log10(max(lo, hi * 1e-12)), math.log10(hi), 4097, dtype=torch.float64)])
    sigma = sigma[sigma > 0]
    x, slope = sigma.clone(), torch.ones_like(sigma)
    for a, b, c in rest:
        t = x * x
        slope = slope * (a + 3 * b * t + 5 * c * t * t)
        x = x * (a + b * t + c * t * t)
    lipschitz = max(slope.abs().max().item(), (x / sigma).abs().max().item())
    if lo == 0:
        lipschitz = max(lipschitz, math.prod(abs(a) for a, _, _ in rest))
    return lipschitz, (sigma * slope).abs().max().item()


def _key(coefficients):
    return coefficients if isinstance(coefficients, str) else tuple(tuple(float(v) for v in t) for t in coefficients)


def step_magnitude(a: float, b: float, c: float, s: float) -> float:
    """μ of model point 3: the largest partial sum, in units of u·√n, of one step with these
    coefficients on an iterate whose singular values are at most ``s``."""
    a, b, c = abs(a), abs(b), abs(c)
    return s * max((b + 2 * c * s * s) * s * s, a + b * s * s + c * s ** 4)


def ns_lipschitz(coefficients=DEFAULT_COEFFICIENTS, steps: int = 5) -> tuple[float, ...]:
    """Each step's own factor for any input (singular values in [0, 1] after normalization):
    max of |p'(σ)| and |p(σ)/σ| over the range entering the step (quintic: 4.1, 8.0, 6.6, 2.9,
    2.8; the range grows to 1.27). ``ns_growth`` composes the steps instead, which is sharper."""
    out, lo, hi = [], 0.0, 1.0
    for a, b, c in coefficient_schedule(_key(coefficients), steps):
        t = torch.linspace(lo, hi, 4097, dtype=torch.float64) ** 2
        out.append(max((a + 3 * b * t + 5 * c * t * t).abs().max().item(), (a + b * t + c * t * t).abs().max().item()))
        lo, hi = _image(a, b, c, lo, hi)
    return tuple(out)


def ns_growth(coefficients=DEFAULT_COEFFICIENTS, steps: int = 5, spectrum: tuple[float, float] = (0.0, 1.0)) -> float:
    """Σ_j μ_j·Λ_j of model point 5 for an input whose normalized singular values lie in
    ``spectrum`` (default: any input): each step's rounding (μ_j, model point 3) grown by the
    steps after it (Λ_j over the range after step j, model point 4)."""
    schedule = coefficient_schedule(_key(coefficients), steps)
    ranges = _ranges(schedule, spectrum)
    return sum(step_magnitude(*schedule[j], ranges[j][1]) * _gains(schedule[j + 1:], *ranges[j + 1])[0]
               for j in range(steps))


def ns_spectrum(x: torch.Tensor) -> tuple[float, float]:
    """[σ_min, σ_max] of ``x`` / ‖x‖_F (each matrix of a stack normalized on its own; the range
    over the stack), in float64: what NS's normalization hands its first step."""
    x = x.detach().double()
    x = x if x.ndim == 3 else x[None]
    sv = torch.linalg.svdvals(x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=1e-300))
    return sv.min().item(), sv.max().item()


def ns_bound(dtype: torch.dtype, x: torch.Tensor | tuple[int, int], coefficients=DEFAULT_COEFFICIENTS,
             steps: int = 5, *, gram: bool = False, roundings: int = 2) -> float:
    """The largest |difference| of entries of two NS results (``steps``, ``coefficients``) of the
    matrix ``x`` (or of each of a stack) in ``dtype`` whose roundings differ, over ``x``'s
    normalized spectrum (``x`` a shape (rows, cols): any matrix of it, the spectrum [0, 1]):
    roundings·u·(√n·``ns_growth`` + √(km)/2·Γ + s·Λ), n = k + 2m (standard, either orientation)
    or 2m + 4k (``gram``, or its standard fallback), k ≤ m the matrix's sides, Γ and Λ those of all the steps over the
    input's spectrum, s its largest value (model points 3 to 5). ``roundings=1``: one result
    against a float64 reference."""
    shape = tuple(x) if isinstance(x, tuple) else tuple(x.shape)
    k, m = sorted(shape[-2:])
    n = 2 * m + 4 * k if gram else k + 2 * m
    spectrum = (0.0, 1.0) if isinstance(x, tuple) else ns_spectrum(x)
    lipschitz, rescale = _gains(coefficient_schedule(_key(coefficients), steps), *spectrum)
    normalization = math.sqrt(k * m) / 2 * rescale + spectrum[1] * lipschitz
    return roundings * unit_roundoff(dtype) * (math.sqrt(n) * ns_growth(coefficients, steps, spectrum) + normalization)


def ns_step_bound(dtype: torch.dtype, x: torch.Tensor, a: float, b: float, c: float, *, roundings: int = 2) -> float:
    """One quintic step on ``x`` as given (``quintic_iteration``: A = x·xᵀ over x's rows, in
    either association): roundings·u·√(cols + 2·rows)·μ, its rounding entering the result
    directly (model point 3 without growth)."""
    rows, cols = x.shape[-2:]
    s = torch.linalg.matrix_norm(x.detach().double(), ord=2).max().item()  # x's largest singular value
    return roundings * unit_roundoff(dtype) * math.sqrt(cols + 2 * rows) * step_magnitude(a, b, c, s)


def muon_params_bound(ns: float, lr: float, scale: float, param_max: float, steps: int = 1) -> float:
    """|difference| of fp32 params after ``steps`` Muon steps from the same params and gradients
    in two implementations whose NS results differ by at most ``ns`` per entry: each step moves a
    param by lr·scale·U, so the updates differ by lr·scale·ns, and each side rounds the param's
    new value θ·(1 − lr·wd) − lr·scale·U up to three times (the decay's product, the update's,
    their difference) by u·|θ| (``param_max`` bounds |θ| and the update is far smaller); the
    decay factor 1 − lr·wd < 1 only shrinks earlier differences. The momentum, computed alike or
    by another fp32 expression, differs by u relative: a perturbation of NS's input no larger than
    its normalization's rounding, already in ``ns``."""
    return steps * (lr * scale * ns + 2 * 3 * unit_roundoff(torch.float32) * param_max)

