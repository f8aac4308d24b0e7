"""``--muon-ns-method gram`` in every TP mode, against float64 Newton–Schulz of the whole matrix.

One gloo world per world size (1, 2, 4) runs ``orthogonalize_sharded`` with ``ns_method="gram"``
in each mode on tall, wide, thin and square matrices split along either dim (and replicated), in
fp32, and sends its pieces back; the parent compares them with the float64 standard iteration of
the whole matrix (the polynomial Gram NS computes) and, for blockwise, of each shard. The
distributed mode is checked to all-reduce each Gram once per restart block (2 per step, from 5)
and the scale once, nothing else.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from rounding_bounds import ns_bound

from megatron_muon import comm_stats, newton_schulz, orthogonalize_sharded
from megatron_muon.core.newton_schulz import method_flops, runs_gram, sharded_runs_gram
from megatron_muon.parallel.comm import observe_collectives

WORLD_SIZES = (1, 2, 4)
MODES = ("duplicated", "distributed", "owner", "blockwise", "auto")
# (rows, cols): long sides divisible by 4; 3.5:1 and 8:1 both ways, and a square one (standard
# iteration by NSOptions' fallback). Every matrix under each partition dim and replicated.
SHAPES = [(32, 112), (112, 32), (16, 128), (48, 48)]
PDIMS = (0, 1, None)
# fp32 against float64: one fp32 Gram NS rounding of the matrix, whatever order the sharded
# Grams are summed in (rounding_bounds.ns_bound, gram=True: the Gram iteration or the standard
# one a mode falls back to), 9e-5 … 6.6e-4 for these Gaussian matrices and their shards
# (measured ≤ 2e-6 on one process); another polynomial, a lost restart or a wrong shard is off by 1e-2 … 1.
def fp32_bound(matrix: torch.Tensor) -> float:
    return ns_bound(torch.float32, matrix, "quintic", gram=True, roundings=1)


def cases():
    return [(i, shape, pdim) for i, (shape, pdim) in enumerate((s, p) for s in SHAPES for p in PDIMS)]


def full(index: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(300 + index), dtype=torch.float64)


def _worker(rank: int, world: int) -> dict:
    out = {}
    shards, pdims = [], []
    for index, shape, pdim in cases():
        x = full(index, shape).float()
        shards.append(x if pdim is None else x.chunk(world, dim=pdim)[rank].contiguous())
        pdims.append(pdim)
    for mode in MODES:
        calls = []
        with comm_stats() as stats, observe_collectives(lambda c: calls.append((c.primitive, c.inputs[0].numel()))):
            got = orthogonalize_sharded(shards, pdims, mode=mode, steps=5, coefficients="quintic", ns_method="gram",
                                        validate=False)
        out[mode] = dict(pieces=got, flops=stats.ns_flops, calls=calls)
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return request.param, run_world(request.param, _worker)


@pytest.mark.parametrize("mode", ("duplicated", "distributed", "owner", "auto"))
def test_exact_modes_equal_float64_newton_schulz(world, mode):
    t, ranks = world
    for index, shape, pdim in cases():
        want = newton_schulz(full(index, shape), 5, "quintic")
        for rank, r in enumerate(ranks):
            piece = r[mode]["pieces"][index].double()
            expected = want if pdim is None else want.chunk(t, dim=pdim)[rank]
            err = (piece - expected).abs().max().item()
            assert err <= fp32_bound(full(index, shape)), f"{mode} {shape} pdim {pdim} rank {rank}: {err:.2e}"


def test_blockwise_equals_float64_ns_of_each_shard(world):
    t, ranks = world
    for index, shape, pdim in cases():
        for rank, r in enumerate(ranks):
            x = full(index, shape)
            block = x if pdim is None else x.chunk(t, dim=pdim)[rank]
            err = (r["blockwise"]["pieces"][index].double() - newton_schulz(block, 5, "quintic")).abs().max().item()
            assert err <= fp32_bound(block), f"blockwise {shape} pdim {pdim} rank {rank}: {err:.2e}"


def test_distributed_all_reduces_each_gram_once_per_restart_block(world):
    """Per same-shape batch that runs the Gram form: one scalar all-reduce (the overflow-safe
    scale) and two Gram all-reduces (one before each block of the published restart), against
    the standard form's 5 Grams and 2 scalars. Counted on the calls the step issued."""
    t, ranks = world
    if t == 1:
        return
    batches = {}  # the distributed kernel batches same (local shape, pdim); Gram form or not
    for index, shape, pdim in cases():
        if pdim is None:
            continue
        local = (shape[0] // t, shape[1]) if pdim == 0 else (shape[0], shape[1] // t)
        k, cols = (local[1], local[0]) if pdim == 0 else local
        batches[(local, pdim)] = (k, sharded_runs_gram("gram", k, cols, t))
    gram_batches = [k for k, gram in batches.values() if gram]
    standard_batches = [k for k, gram in batches.values() if not gram]
    assert gram_batches and standard_batches  # both forms ran
    reduces = [n for p, n in ranks[0]["distributed"]["calls"] if p == "all_reduce"]
    assert len(reduces) == 3 * len(gram_batches) + 7 * len(standard_batches)
    grams = sorted(n for n in reduces if n > 2)  # a batch of Grams, never a scalar per matrix
    assert sorted(k * k for k in gram_batches for _ in range(2)) == sorted(
        n for n in grams if n in {k * k for k in gram_batches})


def test_the_gram_iteration_ran(world):
    """Not vacuous: duplicated runs every sharded matrix whole on every rank (each replicated one
    on one rank, which broadcasts it), and its FLOPs are the Gram iteration's on the long matrices
    and the standard one's on the square one, to the unit."""
    assert runs_gram("gram", 32, 112) and runs_gram("gram", 16, 128) and not runs_gram("gram", 48, 48)
    t, ranks = world
    want = sum(method_flops("gram", *shape, 5) for _, shape, _ in cases())
    assert want < sum(method_flops("standard", *shape, 5) for _, shape, _ in cases())
    once = sum(method_flops("gram", *shape, 5) for _, shape, pdim in cases() if pdim is None) if t > 1 else 0
    assert sum(r["duplicated"]["flops"] for r in ranks) == t * (want - once) + once


# --muon-gram-fp16 on bf16 shards (the optimizer's NS dtype under --muon-fp32-matmul-prec medium).
FP16_SHAPES = [(32, 112), (112, 32), (16, 128)]  # all run the Gram form whole (aspect >= 3.5)
FP16_MODES = ("duplicated", "distributed", "owner")
# Relative error (Frobenius) against float64 standard NS of the same bf16 input, where the Gram
# form ran. Both results end cast to bf16, a relative error of u_bf16/√3 = 2.3e-3 (a uniform
# rounding's RMS): the floor. fp16 products (u 8× finer) add little to it, bf16 ones several times
# it: measured 2.7e-3–3.7e-3 and 9.8e-3–1.4e-2 (world 2 and 4, both partition dims), sizes the
# formats set rather than the machine, since half-precision GEMMs accumulate in fp32 and round
# once (rounding_bounds). 5e-3, 2.2× the floor, lies between: a mode that dropped gram_dtype fails.
FP16_REL = 5e-3


def _bf16(index: int, shape) -> torch.Tensor:
    return full(index, shape).to(torch.bfloat16)


def _fp16_worker(rank: int, world: int) -> dict:
    out = {}
    for pdim in (0, 1):
        shards = [_bf16(i, s).chunk(world, dim=pdim)[rank].contiguous() for i, s in enumerate(FP16_SHAPES)]
        for mode in FP16_MODES:
            for fp16 in (False, True):
                out[(pdim, mode, fp16)] = orthogonalize_sharded(
                    shards, [pdim] * len(shards), mode=mode, steps=5, coefficients="quintic", ns_method="gram",
                    gram_dtype=torch.float16 if fp16 else None, validate=False)
    return out


@pytest.mark.parametrize("t", (2, 4), ids=lambda t: f"world{t}")
def test_fp16_gram_products_in_every_exact_mode(t):
    """Each exact mode with fp16 Gram products matches float64 NS of the whole bf16 matrix within
    FP16_REL where it ran the Gram form; where the distributed mode's shard runs the standard
    form (the Gram would be the long side) the result is bitwise the one without fp16."""
    ranks = run_world(t, _fp16_worker)
    for (pdim, mode, fp16), _ in ranks[0].items():
        if not fp16:
            continue
        for i, shape in enumerate(FP16_SHAPES):
            got = torch.cat([r[(pdim, mode, True)][i] for r in ranks], dim=pdim)
            assert got.dtype == torch.bfloat16
            local = (shape[0] // t, shape[1]) if pdim == 0 else (shape[0], shape[1] // t)
            k, cols = (local[1], local[0]) if pdim == 0 else local
            if mode == "distributed" and not sharded_runs_gram("gram", k, cols, t):
                assert all(torch.equal(r[(pdim, mode, True)][i], r[(pdim, mode, False)][i]) for r in ranks)
                continue
            want = newton_schulz(_bf16(i, shape).double(), 5, "quintic")
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err <= FP16_REL, f"{mode} {shape} pdim {pdim}: {err:.2e}"
            bf16 = torch.cat([r[(pdim, mode, False)][i] for r in ranks], dim=pdim).double()
            assert ((bf16 - want).norm() / want.norm()).item() > FP16_REL  # the bound tells the two apart
