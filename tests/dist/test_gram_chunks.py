"""The distributed mode's large Grams, formed and all-reduced in row chunks (``gram_chunks``),
against Newton–Schulz of the whole matrix on one process.

A Gram of k ≥ 8192 rows (Llama-3 70B and 405B's hidden size) is summed in ``GRAM_CHUNKS``
all-reduces, each issued as soon as its rows are formed. One gloo world per world size (2, 3)
runs the distributed mode on a 8192 × 48 matrix split along its columns and its transpose split
along its rows (both with k = 8192), two copies each so the chunks are cut from a batch of two,
in both NS methods; the parent compares the assembled pieces with the whole matrix's NS and
counts the all-reduces and their bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import run_world
from rounding_bounds import ns_bound

from megatron_muon import comm_stats, newton_schulz, orthogonalize_sharded
from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.newton_schulz import (
    DEFAULT_GRAM_RESTARTS,
    GRAM_CHUNKS,
    NSOptions,
    gram_blocks,
    gram_chunks,
    sharded_runs_gram,
)
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.pricing import PRIMITIVES, Link, hidden_s, sub_price

K, COLS = 8192, 48
CASES = (((K, COLS), 1), ((COLS, K), 0))  # (full shape, partition dim): the Gram is K × K in both
COPIES = 2
METHODS = ("standard", "gram")


def _full(index: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(4200 + index))


def _worker(rank: int, t: int) -> dict:
    out = {}
    for method in METHODS:
        for c, (shape, pdim) in enumerate(CASES):
            shards = [_full(c * COPIES + i, shape).chunk(t, dim=pdim)[rank].contiguous() for i in range(COPIES)]
            with comm_stats() as stats:
                pieces = orthogonalize_sharded(shards, [pdim] * COPIES, mode="distributed", ns_method=method)
            out[method, c] = (pieces, dict(stats.calls).get("all_reduce", 0),
                              stats.bytes_by_primitive.get("all_reduce", 0), stats.ns_flops)
    return out


@pytest.fixture(scope="module", params=(2, 3), ids=lambda t: f"world{t}")
def world(request):
    t = request.param
    return t, run_world(t, _worker)


@pytest.mark.parametrize("method", METHODS)
def test_chunked_grams_give_the_whole_matrixs_newton_schulz(world, method):
    t, ranks = world
    assert gram_chunks(K, t) == GRAM_CHUNKS > 1  # the path under test
    for c, (shape, pdim) in enumerate(CASES):
        for i in range(COPIES):
            full = _full(c * COPIES + i, shape)
            got = torch.cat([r[method, c][0][i] for r in ranks], dim=pdim)
            # fp32 against the float64 iteration of the whole matrix: one fp32 NS rounding of it
            # (rounding_bounds.ns_bound; the Gram method's own bound where it runs): the chunks
            # change which GEMM forms each Gram entry, never the entry's dot product
            runs_gram = method == "gram" and sharded_runs_gram("gram", K, COLS // t, t)
            want = newton_schulz(full.double()).float()
            bound = ns_bound(torch.float32, full, "quintic", gram=runs_gram, roundings=1)
            err = (got - want).abs().max().item()
            assert err <= bound, (method, shape, pdim, i, err, bound)


@pytest.mark.parametrize("method", METHODS)
def test_each_gram_is_all_reduced_in_chunks_of_the_same_bytes(world, method):
    """Per batch of two: the scalar all-reduces (scale and norm; the Gram method one, its norm
    from the first Gram's trace), then each Gram (5 standard, one per restart block with Gram NS)
    in ``GRAM_CHUNKS`` calls whose fp32 bytes add up to the unchunked ring's 2(t − 1)/t · 2k²·4."""
    t, ranks = world
    runs_gram = method == "gram" and sharded_runs_gram("gram", K, COLS // t, t)
    grams = len(gram_blocks([None] * 5, DEFAULT_GRAM_RESTARTS)) if runs_gram else 5
    scalars = 1 if runs_gram else 2
    ring = lambda nbytes: 2 * (t - 1) * nbytes // t  # noqa: E731
    for c in range(len(CASES)):
        for r in ranks:
            _, calls, nbytes, _ = r[method, c]
            assert calls == scalars + grams * GRAM_CHUNKS, (method, c, calls)
            chunk_rows = [K * (j + 1) // GRAM_CHUNKS - K * j // GRAM_CHUNKS for j in range(GRAM_CHUNKS)]
            assert nbytes == scalars * ring(COPIES * 4) + grams * sum(ring(COPIES * n * K * 4) for n in chunk_rows)


@pytest.mark.parametrize("method", METHODS)
def test_the_price_counts_the_chunks_and_what_runs_beside_them(world, method):
    """``pricing.sub_price`` of each case, against the real call's counts: the all-reduce calls
    (the chunks) and the FLOPs exactly, the ring bytes to a byte per call;
    and its ``overlap``: of each Gram, the rows of X·Xᵀ after the first chunk (2k²·cols · 3/4)
    beside the all-reduces before the last (3/4 of its ring bytes). ``hidden_s`` hides
    ``comm_overlap`` of the shorter, and nothing on a profile without overlap."""
    t, ranks = world
    ns = NSOptions(dtype=torch.float32, method=method)
    for c, (shape, pdim) in enumerate(CASES):
        layout = MatrixLayout.from_full_shape(f"case{c}", shape, pdim, t)
        price = sub_price(layout, "distributed", ns, tp=t, rank=0)
        _, calls, nbytes, flops = ranks[0][method, c]
        assert price.calls[PRIMITIVES.index("all_reduce")] + price.scalar_calls == calls
        assert COPIES * price.flops == flops
        # comm counts each call's ring bytes floored to a whole byte, the price 2(t − 1)/t exactly
        assert COPIES * price.sent == pytest.approx(nbytes, abs=calls)
        runs_gram = method == "gram" and sharded_runs_gram("gram", K, COLS // t, t)
        grams = len(gram_blocks([None] * 5, DEFAULT_GRAM_RESTARTS)) if runs_gram else 5
        share = (GRAM_CHUNKS - 1) / GRAM_CHUNKS
        ring = 2 * (t - 1) / t * 4 * K * K
        assert price.overlap == pytest.approx((grams * 2 * K * K * (COLS // t) * share, grams * ring * share))
        link = Link(t, False)
        h100 = GPU_PROFILES["h100-sxm"]
        assert 0 < hidden_s(price, h100, link) <= h100.comm_overlap * (price.overlap[0] / h100.matmul_flops)
        assert hidden_s(price, dataclasses.replace(h100, comm_overlap=0.0), link) == 0.0
