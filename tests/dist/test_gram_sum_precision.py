"""The distributed mode sums its Gram matrices in fp32: the accuracy that buys, against float64.

With bf16 shards the distributed mode's one reduction across ranks that matters is the k × k Gram
X·Xᵀ (``tp_modes._summed_gram``; the scale and the squared norm are two scalars). Summed in bf16,
gloo's ring (as NCCL's) adds the partial sums in the tensor's dtype and rounds at every hop,
where the one-device NS forms its Gram in one GEMM, accumulated in fp32 and rounded once. Now each
rank's product is rounded once to bf16, as the one-device Gram is, and the t partials are summed
in fp32 (``tp_modes.REDUCE_DTYPE``) and rounded once more. Two checks, on a gloo world of 4:

* the summed Gram of a normalized bf16 matrix against its float64 Gram, entry by entry, within the
  bound those two roundings allow; summed in bf16 (the code before) it breaks that bound, so the
  check tells the two apart;
* bf16 NS in the distributed mode against float64 NS of the whole matrix, no worse than √2 × the
  one-device bf16 NS's own error (derivation at ``NS_RATIO``).

Measured on this world (2 cores, MKL; relative Frobenius error against float64; "before" = the
same step with ``REDUCE_DTYPE`` bf16, the old all-reduces):

    Gram, max |error| / bound      (64, 2048): 0.71, before 1.14; (128, 4096): 0.62, before 1.08;
                                   (256, 1024): 0.74, before 1.24
    Gram, relative error           2.06e-3 / 1.93e-3 / 2.09e-3, before 2.64e-3 / 2.47e-3 / 2.66e-3
    NS standard, relative error    one device 5.30e-3 / 5.18e-3 / 5.73e-3; distributed 5.10e-3 /
                                   5.05e-3 / 5.68e-3, before 5.53e-3 / 5.36e-3 / 6.05e-3
    NS gram                        one device 1.05e-2 / 1.18e-2 / 1.27e-2; distributed 1.07e-2 /
                                   1.20e-2 / 1.28e-2, before 1.14e-2 / 1.12e-2 / 1.31e-2

(NS rows: (64, 2048) split by columns, (2048, 64) by rows, (128, 4096) by columns.) The Gram's
error drops by a fifth, to the one-device level (one rounding: u/√3 = 2.3e-3); the standard NS
result's by 6–8 %, the Gram iteration's moves by −6 … +8 %: bf16 NS rounds its iterate, A and B
every step as well, and the Gram sum was one rounding source among several. At t = 2 both sums
round once and agree bitwise; at t = 8 the Gram's relative error was 1.8–2.0e-3 against 3.15e-3
summed in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_world
from rounding_bounds import unit_roundoff

from megatron_muon import newton_schulz, orthogonalize_sharded
from megatron_muon.core.newton_schulz import NSOptions

WORLD = 4
GRAM_SHAPES = [(64, 2048), (128, 4096), (256, 1024)]  # k × m, split along m: the Gram is k × k
NS_CASES = [((64, 2048), 1), ((2048, 64), 0), ((128, 4096), 1)]  # (shape, partition dim)
METHODS = ("standard", "gram")

# NS against float64, relative Frobenius error. In the rounding model of rounding_bounds (errors
# independent, zero mean) a result's error is linear in the roundings, so its mean square is the
# sum of each rounding's variance times its gain. bf16 NS rounds per step A, B and the new X, each
# entry once (bf16 GEMMs accumulate in fp32 and round once): variance u²/3·v² for a value v. The
# distributed mode rounds the same B and X entries the same way (B·X acts on each rank's columns
# alone) and its norm in fp32 (a rounding less); its Gram is Σ_r fl(A_r) rounded once, variance
# u²/3·(Σ_r A_r² + A²) per entry, against u²/3·A² on one device. Σ_r A_r² ≤ A² where the
# partials share a sign (the diagonal), and its mean is A²'s for the off-diagonal sums of
# independent terms (each partial sums 1/t of them): at most twice A's variance, so at most twice
# the mean-square error, √2× the error. With k·m ≥ 1.3e5 entries the Frobenius norm is within a
# few 1/√(k·m) of its mean. A dropped or doubled Gram term, a wrong shard or scale is off by 0.1 … 1.
NS_RATIO = math.sqrt(2)


def normalized(shape, seed: int) -> torch.Tensor:
    """A bf16 Gaussian matrix divided by its norm, as NS hands its first step (entries ~1/√(k·m))."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return (x.float() / x.float().norm()).bfloat16()


def ns_input(index: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + index)).bfloat16()


def _worker(rank: int, world: int) -> dict:
    from megatron_muon.parallel import tp_modes

    out: dict = {"gram": {}, "ns": {}}
    saved = tp_modes.REDUCE_DTYPE
    try:
        for i, shape in enumerate(GRAM_SHAPES):
            X = normalized(shape, 70 + i).chunk(world, dim=1)[rank].contiguous()[None]
            for dtype in (torch.float32, torch.bfloat16):
                tp_modes.REDUCE_DTYPE = dtype
                out["gram"][(i, dtype)] = tp_modes._summed_gram(X, None)[0]
        tp_modes.REDUCE_DTYPE = saved
        for i, (shape, pdim) in enumerate(NS_CASES):
            shard = ns_input(i, shape).chunk(world, dim=pdim)[rank].contiguous()
            for method in METHODS:
                out["ns"][(i, method)] = orthogonalize_sharded([shard], [pdim], mode="distributed",
                                                               ns_method=method, validate=False)[0]
    finally:
        tp_modes.REDUCE_DTYPE = saved
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(WORLD, _worker)


def _gram_bound(x: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 Gram of ``x``, the bound on its fp32-summed estimate's error per entry).

    Each rank's product X_r·X_rᵀ is accumulated in fp32 (within γ_n = n·2^-24 relative to
    |X_r|·|X_r|ᵀ, n = m/t) and rounded to bf16 (u·|A_r|); the t partials are summed in fp32
    ((t − 1)·2^-24·Σ|A_r|) and the sum rounded to bf16 (u·|A|): first order in u, times (1 + u)
    for the products of two roundings. A bf16 ring rounds each of its t − 1 partial sums as well,
    up to u·|partial| each more, which this bound does not allow for."""
    u, u32 = unit_roundoff(torch.bfloat16), unit_roundoff(torch.float32)
    x = x.double()
    shards = x.chunk(t, dim=1)
    partials = sum((s @ s.T).abs() for s in shards)
    magnitudes = x.abs() @ x.abs().T
    n = x.shape[1] // t
    G = x @ x.T
    return G, u * (1 + u) * (partials + G.abs()) + n * u32 * magnitudes + (t - 1) * u32 * partials


def test_the_summed_gram_rounds_once_per_partial_and_once_summed(ranks):
    for i, shape in enumerate(GRAM_SHAPES):
        G, bound = _gram_bound(normalized(shape, 70 + i), WORLD)
        summed = ranks[0]["gram"][(i, torch.float32)]
        assert all(torch.equal(r["gram"][(i, torch.float32)], summed) for r in ranks)  # one all-reduce result
        ratio = ((summed.double() - G).abs() / bound).max().item()
        assert ratio <= 1, f"{shape}: the fp32-summed Gram errs by {ratio:.2f}x its bound"
        # the bound can tell: the bf16 ring's extra roundings break it (measured 1.08 … 1.24x)
        ring = ((ranks[0]["gram"][(i, torch.bfloat16)].double() - G).abs() / bound).max().item()
        assert ring > 1, f"{shape}: the bf16-summed Gram stays within the fp32 sum's bound ({ring:.2f}x)"


@pytest.mark.parametrize("method", METHODS)
def test_distributed_bf16_ns_against_float64(ranks, method):
    for i, (shape, pdim) in enumerate(NS_CASES):
        x = ns_input(i, shape)
        want = newton_schulz(x.double())
        got = torch.cat([r["ns"][(i, method)] for r in ranks], dim=pdim).double()
        one_device = NSOptions(dtype=torch.bfloat16, method=method)(x).double()
        err = ((got - want).norm() / want.norm()).item()
        own = ((one_device - want).norm() / want.norm()).item()
        assert err <= NS_RATIO * own, f"{method} {shape} pdim {pdim}: {err:.3e}, one device {own:.3e}"
