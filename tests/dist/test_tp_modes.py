"""Each TP mode against Newton–Schulz of the full matrix on one process.

One gloo world per world size (1, 2, 3, 4) runs every mode on the same list of matrices — tall,
wide, square and odd shapes, each with partition_dim 0, 1 and None, two copies each so that
batching and owner spreading are exercised — and sends its pieces back. The parent assembles
the pieces and compares them with ``newton_schulz`` on the whole matrix, computed here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from rounding_bounds import ns_bound
from step_harness import run_step
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from megatron_muon import comm_stats, newton_schulz, ns_flops, orthogonalize_sharded
from megatron_muon.core.newton_schulz import (COEFFICIENT_SETS, gram_block_rows, reassociates, sharded_ns_flops,
                                             splits_gram)
from megatron_muon.plan.exchange import MIN_MICRO_GROUPS, split_micro_groups, split_rounds
from megatron_muon.plan.step_plan import DEFAULT_BUCKET_BYTES

WORLD_SIZES = (1, 2, 3, 4)
EXACT_MODES = ("duplicated", "distributed", "owner")
ALL_MODES = ("duplicated", "distributed", "blockwise", "owner", "auto")
# (dtype, power of two) of the huge-gradient check: fp32 entries ~1e30 (2^100), and bf16 ones
# next to bf16's max 3.4e38 (randn's largest entries here, ~4.5, times 2^125 < 2^128).
HUGE = ((torch.float32, 100), (torch.bfloat16, 125))
# "flat" split along its 16 rows is a shard narrower than its Gram (96 × 16/t under distributed):
# it runs the reassociated product A·(A·X); test_distributed_runs_every_product_form lists the rest.
BASE_SHAPES = {"tall": (96, 40), "wide": (40, 96), "square": (64, 64), "odd": (48, 24), "flat": (16, 96)}
PDIMS = (0, 1, None)
COPIES = 2

# fp32 tolerance for an exact mode against NS of the full matrix: the modes change only the
# summation order (Gram matrices and the norm summed over ranks, batched vs single GEMMs, the
# iteration on the long side's Gram or reassociated, ranks with one thread against this process's
# threads), so two fp32 NS roundings of that matrix: rounding_bounds.ns_bound, 1.7e-4 … 1.2e-3
# for these matrices (the most for the square ones, whose smallest singular value is near 0),
# measured ~1e-6. Any non-exact answer is off by far more: blockwise by ≥ 0.054 here (tested).
def fp32_bound(matrix: torch.Tensor, coefficients="quintic") -> float:
    return ns_bound(torch.float32, matrix, coefficients)


def full_shape(base: tuple[int, int], pdim: int | None, t: int) -> tuple[int, int]:
    """The base shape with its partition dim rounded down to a multiple of t (40 → 39 at t=3)."""
    rows, cols = base
    if pdim == 0:
        rows -= rows % t
    elif pdim == 1:
        cols -= cols % t
    return rows, cols


def matrix_cases(t: int) -> list[tuple[str, int | None, int, tuple[int, int]]]:
    return [
        (name, pdim, copy, full_shape(base, pdim, t))
        for name, base in BASE_SHAPES.items()
        for pdim in PDIMS
        for copy in range(COPIES)
    ]


def make_full(index: int, shape: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=g).to(dtype)


def shard_of(full: torch.Tensor, pdim: int | None, t: int, rank: int) -> torch.Tensor:
    return full if pdim is None else full.chunk(t, dim=pdim)[rank].contiguous()


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _stats(stats) -> dict:
    return {
        "calls": dict(stats.calls),
        "bytes_sent": stats.bytes_sent,
        "by_primitive": dict(stats.bytes_by_primitive),
        "ns_flops": stats.ns_flops,
    }


# ---- what every rank runs ------------------------------------------------------------------


def _tp_worker(rank: int, t: int) -> dict:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

    cases = matrix_cases(t)
    fulls = [make_full(i, shape) for i, (_, _, _, shape) in enumerate(cases)]
    pdims = [pdim for _, pdim, _, _ in cases]
    shards = [shard_of(f, p, t, rank) for f, p in zip(fulls, pdims)]
    out: dict = {"pieces": {}, "stats": {}, "single": {}, "emerging": {}, "ours_quintic": {}, "huge": {},
                 "empty": {}, "empty_updates": {}}

    for mode in ("duplicated", "distributed", "owner", "blockwise"):
        with comm_stats() as stats:
            out["pieces"][mode] = orthogonalize_sharded(shards, pdims, mode=mode)
        out["stats"][mode] = _stats(stats)

    # One matrix per call: the same op sequence as newton_schulz on a batch of one. Jordan's
    # coefficients, so the bf16 result can also be held against torch.optim.Muon's own NS.
    for i, (_name, pdim, copy, _) in enumerate(cases):
        if copy == 0 and pdim is not None:
            for mode in ("duplicated", "owner"):
                out["single"][(mode, i)] = orthogonalize_sharded([shards[i]], [pdim], mode=mode,
                                                                 coefficients="jordan")[0]
                out["single"][(mode, i, "bf16")] = orthogonalize_sharded(
                    [shards[i].bfloat16()], [pdim], mode=mode, coefficients="jordan"
                )[0]

    # emerging-optimizers' newton_schulz_tp on the same shards (quintic, its default set).
    torch.set_float32_matmul_precision("highest")
    for i, (_name, pdim, copy, _) in enumerate(cases):
        if copy == 0 and pdim is not None:
            for mode in ("duplicated", "distributed"):
                out["emerging"][(mode, i)] = newton_schulz_tp(
                    shards[i], 5, "quintic", tp_group=dist.group.WORLD, partition_dim=pdim, tp_mode=mode
                )
                out["ours_quintic"][(mode, i)] = orthogonalize_sharded(
                    [shards[i]], [pdim], mode=mode, coefficients="quintic"
                )[0]

    # Huge entries: orthogonalization is scale-invariant, so shards scaled by a power of two give
    # the same pieces; ‖X‖_F of such a matrix overflows unless it is scaled down first.
    for mode in ALL_MODES:
        for dtype, power in HUGE:
            base = [x.to(dtype) for x in shards]
            out["huge"][(mode, dtype)] = (orthogonalize_sharded(base, pdims, mode=mode),
                                          orthogonalize_sharded([x * 2.0**power for x in base], pdims, mode=mode))

    # Empty matrices next to a real one: empty results, the real one as alone.
    empty = [torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(4, 0), torch.zeros(4, 0)]
    alone = [dist.new_group([r]) for r in range(t)][rank]  # a level of this rank alone (None = the world)
    for mode in ALL_MODES:
        with_empty = orthogonalize_sharded([*empty, shards[0]], [0, 1, 0, None, pdims[0]], mode=mode)
        out["empty"][mode] = (with_empty, orthogonalize_sharded([shards[0]], [pdims[0]], mode=mode)[0])
        out["empty_updates"][mode] = _updates_with_empty(shards[0], pdims[0], rank, t, mode, alone)

    # A small bucket forces several exchange rounds; the result must not depend on it.
    bucket = 8 * 1024
    with comm_stats() as stats:
        out["pieces"]["owner_small_bucket"] = orthogonalize_sharded(shards, pdims, mode="owner", bucket_bytes=bucket)
    out["stats"]["owner_small_bucket"] = _stats(stats)
    out["pieces"]["duplicated_small_bucket"] = orthogonalize_sharded(
        shards, pdims, mode="duplicated", bucket_bytes=bucket
    )
    return out


def _updates_with_empty(shard, pdim, rank: int, t: int, mode: str, alone) -> dict:
    """``orthogonalize_updates`` on empty layouts next to a real one, over TP (the group) and
    over DP (the group, the real matrix cut in t flat ranges as the distributed optimizer cuts
    it), each against the same call without the empty ones. ``alone``: a group of this rank
    only, for the level that is not under test."""
    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.parallel.orthogonalize import orthogonalize_updates

    n = shard.numel()
    cuts = [(r * n // t, (r + 1) * n // t) for r in range(t)]
    setups = {
        "tp": ([MatrixLayout("e0", (0, 4), 0, t), MatrixLayout("e1", (4, 0), None, t),
                MatrixLayout("w", tuple(shard.shape), pdim, t)], shard.reshape(-1),
               dict(tp_group=dist.group.WORLD, dp_group=alone)),
        "dp": ([MatrixLayout("e0", (0, 4), None, 1, dp_ranges=((0, 0),) * t),
                MatrixLayout("e1", (4, 0), None, 1, dp_ranges=((0, 0),) * t),
                MatrixLayout("w", tuple(shard.shape), None, 1, dp_ranges=tuple(cuts))],
               shard.reshape(-1)[slice(*cuts[rank])], dict(dp_group=dist.group.WORLD, tp_group=alone)),
    }
    out = {}
    for name, (lays, piece, groups) in setups.items():
        if name == "dp" and mode != "owner":
            continue  # DP has no TP mode of its own: one mode is enough
        kwargs = dict(tp_mode=mode, ns_dtype=torch.float32, **groups)
        with_empty = run_step([torch.zeros(0), torch.zeros(0), piece], lays, **kwargs)
        out[name] = (with_empty, run_step([piece], lays[2:], **kwargs)[0])
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda t: f"world{t}")
def world(request):
    t = request.param
    return t, run_world(t, _tp_worker)


def _assembled(ranks: list, t: int, key_fn, pdim) -> torch.Tensor:
    pieces = [key_fn(r) for r in ranks]
    if pdim is None:
        for r in range(1, t):  # a replicated matrix's result must be identical everywhere
            assert torch.equal(pieces[r], pieces[0]), f"rank {r} disagrees on a replicated matrix"
        return pieces[0]
    return torch.cat(pieces, dim=pdim)


# ---- equivalence ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", EXACT_MODES + ("owner_small_bucket", "duplicated_small_bucket"))
def test_exact_modes_match_full_newton_schulz(world, mode):
    t, ranks = world
    for i, (name, pdim, _copy, shape) in enumerate(matrix_cases(t)):
        got = _assembled(ranks, t, lambda r: r["pieces"][mode][i], pdim)
        assert got.shape == shape and got.dtype == torch.float32
        want = newton_schulz(make_full(i, shape))
        err = (got - want).abs().max().item()
        assert err <= fp32_bound(make_full(i, shape)), f"{mode} t={t} {name} {shape} pdim={pdim}: max error {err:.2e}"


def test_blockwise_is_newton_schulz_of_the_local_shard(world):
    t, ranks = world
    for i, (name, pdim, _copy, shape) in enumerate(matrix_cases(t)):
        full = make_full(i, shape)
        for rank, res in enumerate(ranks):
            want = newton_schulz(shard_of(full, pdim, t, rank))
            err = (res["pieces"]["blockwise"][i] - want).abs().max().item()
            assert err <= fp32_bound(shard_of(full, pdim, t, rank)), (f"blockwise t={t} {name} pdim={pdim} "
                                                                       f"rank {rank}: {err:.2e}")
        if pdim is not None and t > 1:
            # The exactness check can tell exact from blockwise: they differ by 10× its bound
            # and more (measured ≥ 0.054, 45× the largest bound).
            blockwise = _assembled(ranks, t, lambda r: r["pieces"]["blockwise"][i], pdim)
            gap = (blockwise - newton_schulz(full)).abs().max().item()
            assert gap > 10 * fp32_bound(full), f"blockwise unexpectedly equals full NS for {name} pdim={pdim}"


def test_single_matrix_is_bitwise_newton_schulz(world):
    """With one matrix per call the owner and duplicated paths run the exact op sequence of
    ``newton_schulz`` on a batch of one: the same kernels on the same shapes with one thread on
    both sides (the ranks' count), so the same summation order on any machine, and the answer is
    bitwise equal (atol = 0), fp32 and bf16."""
    t, ranks = world
    for i, (name, pdim, copy, shape) in enumerate(matrix_cases(t)):
        if copy != 0 or pdim is None:
            continue
        for dtype, tag in ((torch.float32, ()), (torch.bfloat16, ("bf16",))):
            with one_thread():  # the ranks run single-threaded; GEMM blocking follows threads
                want = newton_schulz(make_full(i, shape).to(dtype)[None], 5, "jordan")[0]
            for mode in ("duplicated", "owner"):
                got = _assembled(ranks, t, lambda r: r["single"][(mode, i, *tag)], pdim)
                assert got.dtype == dtype
                assert torch.equal(got, want), f"{mode} {dtype} t={t} {name} pdim={pdim} not bitwise"


def test_bf16_paths_match_torch_optim_muon_newton_schulz(world):
    """torch.optim.Muon's own NS (bf16, jordan) on the full matrix, as an outside reference.

    bf16 against a bf16 reference, so the bound is zero: single-threaded (as the ranks run), our
    batched bf16 NS and torch's 2-D one round identically (bf16 GEMMs accumulate in fp32 and round
    once, so even another blocking moves a result only at a rounding tie: rounding_bounds).
    Measured before fixing it at zero: 1,400 random matrices of these shapes and the odd ones
    (seeds 0-199), max |difference| 0, while the same bf16 results sit a median 1.5% (max 2.2%,
    relative Frobenius) from fp32 NS, so any tolerance wide enough for bf16-vs-fp32 noise would
    hide a percent-level scale error.
    """
    t, ranks = world
    for i, (name, pdim, copy, shape) in enumerate(matrix_cases(t)):
        if copy != 0 or pdim is None:
            continue
        with one_thread():  # the ranks run single-threaded; GEMM blocking follows threads
            want = torch_zeropower(make_full(i, shape), COEFFICIENT_SETS["jordan"][0], 5, 1e-7)
        for mode in ("duplicated", "owner"):
            got = _assembled(ranks, t, lambda r: r["single"][(mode, i, "bf16")], pdim)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, want), (f"{mode} bf16 t={t} {name} pdim={pdim}: "
                                            f"{(got.float() - want.float()).abs().max().item():.2e} from torch")


def test_against_emerging_optimizers_newton_schulz_tp(world):
    """emerging-optimizers 0.3.0 is an independent implementation of both exact TP modes."""
    t, ranks = world
    for i, (name, pdim, copy, _shape) in enumerate(matrix_cases(t)):
        if copy != 0 or pdim is None:
            continue
        for mode in ("duplicated", "distributed"):
            theirs = _assembled(ranks, t, lambda r: r["emerging"][(mode, i)], pdim)
            ours = _assembled(ranks, t, lambda r: r["ours_quintic"][(mode, i)], pdim)
            err = (ours - theirs).abs().max().item()
            # Same math, different GEMM entry points (batched vs 2-D, F.normalize vs a clamped
            # norm): two fp32 NS roundings, as for fp32_bound.
            err_bound = fp32_bound(make_full(i, _shape))
            assert err <= err_bound, f"{mode} t={t} {name} pdim={pdim}: {err:.2e} from emerging-optimizers"


@pytest.mark.parametrize("dtype, power", HUGE, ids=["fp32_2^100", "bf16_2^125"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_huge_entries_give_the_update_of_the_scaled_down_matrix(world, mode, dtype, power):
    """Every mode divides by a power of two near the largest entry (one agreed on by all ranks
    in distributed) before the Frobenius norm. Scaling the input by 2^power is exact, so is that
    division, so the pieces are bitwise those of the unscaled matrices (atol = 0). Without the
    scaling the norm overflows to inf and every piece is zero."""
    t, ranks = world
    for rank, r in enumerate(ranks):
        plain, huge = r["huge"][(mode, dtype)]
        for i, (a, b) in enumerate(zip(plain, huge)):
            assert a.dtype == dtype and a.abs().max() > 0.1  # a real update, not a silent zero
            assert torch.equal(a, b), f"{mode} {dtype} t={t} rank {rank} matrix {i}: {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_empty_matrices_are_a_no_op(world, mode):
    """(0, n) and (n, 0) shards, split or replicated: empty results, and the real matrix next to
    them gets bitwise the result it gets alone (atol = 0: the empty ones never reach a mode)."""
    t, ranks = world
    for r in ranks:
        with_empty, alone = r["empty"][mode]
        assert [tuple(x.shape) for x in with_empty[:4]] == [(0, 4), (0, 4), (4, 0), (4, 0)]
        assert torch.equal(with_empty[4], alone)
        for name, (updates, alone) in r["empty_updates"][mode].items():
            assert [x.numel() for x in updates[:2]] == [0, 0], name
            assert torch.equal(updates[2], alone), name


# ---- accounting ----------------------------------------------------------------------------


def _shape_check_bytes(t: int, num_matrices: int) -> int:
    # Header (4 int64: count, mode, steps, auto's hardware checksum) and table (4 int64 per matrix:
    # rows, cols, partition dim, dtype), each all-gathered: input × (t − 1).
    return (4 + 4 * num_matrices) * 8 * (t - 1)


def test_owner_traffic_equals_analytic_total(world):
    t, ranks = world
    cases = matrix_cases(t)
    payload = 0
    for _, pdim, _, (rows, cols) in cases:
        full_bytes = rows * cols * 4
        if t == 1:
            continue
        # Sharded: every non-owner shard goes there and back. Replicated: the owner's result
        # goes to the t − 1 others.
        payload += 2 * (t - 1) * full_bytes // t if pdim is not None else (t - 1) * full_bytes
    meta = _shape_check_bytes(t, len(cases)) * t if t > 1 else 0
    total = sum(r["stats"]["owner"]["bytes_sent"] for r in ranks)
    assert total == payload + meta
    assert sum(r["stats"]["owner"]["by_primitive"].get("all_to_all", 0) for r in ranks) == payload
    for r in ranks:
        assert r["stats"]["owner"]["calls"].get("all_to_all", 0) == _owner_calls(cases, t, DEFAULT_BUCKET_BYTES)
    # Each matrix is orthogonalized exactly once in the whole group.
    assert sum(r["stats"]["owner"]["ns_flops"] for r in ranks) == sum(ns_flops(*s) for *_, s in cases)


def _owner_calls(cases, t: int, bucket: int) -> int:
    """All-to-alls of owner mode: per micro-group, one there if it holds a sharded matrix (a
    replicated one is gathered from its owner's own copy) and one back if it holds any; none at
    t = 1, where nothing changes rank. The plan decides, so the count is the same on every rank."""
    if t == 1:
        return 0
    groups = split_micro_groups([rows * cols * 4 for *_, (rows, cols) in cases], bucket)
    sharded = [any(cases[i][1] is not None for i in g) for g in groups]
    return sum(sharded) + len(groups)


def test_owner_small_bucket_runs_several_rounds(world):
    t, ranks = world
    cases = matrix_cases(t)
    rounds = split_micro_groups([rows * cols * 4 for *_, (rows, cols) in cases], 8 * 1024)
    assert rounds == split_rounds([rows * cols * 4 for *_, (rows, cols) in cases], 8 * 1024)  # the cap binds
    assert len(rounds) > 1
    for r in ranks:
        assert r["stats"]["owner_small_bucket"]["calls"].get("all_to_all", 0) == _owner_calls(cases, t, 8 * 1024)
    if t > 1:
        assert _owner_calls(cases, t, 8 * 1024) > 2 * MIN_MICRO_GROUPS


def test_duplicated_and_distributed_traffic_and_flops(world):
    t, ranks = world
    cases = matrix_cases(t)
    meta = _shape_check_bytes(t, len(cases)) if t > 1 else 0
    gather = sum(r * c * 4 // t * (t - 1) for _, p, _, (r, c) in cases if p is not None and t > 1)
    sharded_flops = sum(ns_flops(*s) for _, p, _, s in cases if p is not None or t == 1)
    # distributed: per same-shape group (COPIES matrices), two norm all-reduces of COPIES
    # floats (the overflow-safe scale, the squares) and five Gram all-reduces of COPIES × k × k
    # floats, ring-counted, all in fp32 (here the NS dtype too).
    ring = lambda nbytes: 2 * (t - 1) * nbytes // t
    dist_bytes = 0
    dist_flops = 0
    for _, pdim, copy, (rows, cols) in cases:
        if pdim is None:
            dist_flops += ns_flops(rows, cols) if t == 1 else 0
            continue
        if t == 1:
            dist_flops += ns_flops(rows, cols)
            continue
        k, local_cols = (cols, rows // t) if pdim == 0 else (rows, cols // t)
        dist_flops += sharded_ns_flops(k, local_cols, 5, t)
        if copy == 0:
            dist_bytes += 2 * ring(COPIES * 4) + 5 * ring(COPIES * k * k * 4)
            if splits_gram(k, local_cols, t):  # five all-gathers of every rank's padded rows of B
                dist_bytes += 5 * (t - 1) * COPIES * gram_block_rows(k, t) * k * 4
    # A replicated matrix (t > 1) runs once in the group, on one rank, which broadcasts its result:
    # its FLOPs and its bytes on that rank alone, both modes alike.
    replicated = [s for _, p, _, s in cases if p is None] if t > 1 else []
    for mode, shared_bytes, shared_flops in (("duplicated", gather, sharded_flops), ("distributed", dist_bytes,
                                                                                     dist_flops)):
        casts = [r["stats"][mode]["by_primitive"].get("broadcast", 0) for r in ranks]
        own_flops = [r["stats"][mode]["ns_flops"] - shared_flops for r in ranks]
        for rank, r in enumerate(ranks):
            assert r["stats"][mode]["bytes_sent"] == shared_bytes + meta + casts[rank], (mode, rank)
            assert (own_flops[rank] > 0) == (casts[rank] > 0), (mode, rank, own_flops, casts)
        assert sum(casts) == sum(rows * cols * 4 for rows, cols in replicated), mode
        assert sum(own_flops) == sum(ns_flops(*s) for s in replicated), mode
        if t > 1:  # the LPT spreads the replicated matrices over the ranks
            assert all(casts), (mode, casts)
    for r in ranks:
        assert r["stats"]["blockwise"]["bytes_sent"] == 0


def test_replicated_results_are_the_same_bits_on_every_rank(world):
    """Every rank's copy of a replicated matrix's update is the broadcast of one rank's, so the
    copies are bitwise equal (computed on each rank, they would be only where every rank's GEMMs
    pick the same kernels), in every mode that computes it once."""
    t, ranks = world
    for i, (name, pdim, _, _) in enumerate(matrix_cases(t)):
        if pdim is None:
            for mode in ("duplicated", "distributed", "owner"):
                first = ranks[0]["pieces"][mode][i]
                for rank, r in enumerate(ranks[1:], start=1):
                    assert torch.equal(r["pieces"][mode][i], first), (mode, name, rank)


def test_distributed_runs_every_product_form():
    """The tests above compare distributed mode with one-process NS on shards of every product
    form it has at two or more ranks: B's rows split over the ranks (even and uneven blocks) and
    A·(A·X) (A² whole is left for a shard as wide as the Gram, which no split of two or more
    has: ceil(k/t) < k <= cols); each world runs at least two of them."""
    seen = set()
    for t in WORLD_SIZES[1:]:
        forms = set()
        for _, pdim, _, (rows, cols) in matrix_cases(t):
            if pdim is not None:
                k, local_cols = (cols, rows // t) if pdim == 0 else (rows, cols // t)
                if splits_gram(k, local_cols, t):
                    forms.add("split B, even" if k % t == 0 else "split B, uneven")
                else:
                    forms.add("A(AX)" if reassociates(k, local_cols) else "A squared")
        assert len(forms) >= 2, (t, forms)
        seen |= forms
    assert seen == {"split B, even", "split B, uneven", "A(AX)"}


# ---- single process, no torch.distributed ----------------------------------------------------


@pytest.mark.parametrize("mode", ("duplicated", "distributed", "blockwise", "owner"))
def test_world_of_one_without_torch_distributed(mode):
    assert not dist.is_initialized()
    mats = [make_full(i, s) for i, s in enumerate([(96, 40), (40, 96), (64, 64)])]
    got = orthogonalize_sharded(mats, [0, 1, None], mode=mode)
    for m, g in zip(mats, got):
        assert (g - newton_schulz(m)).abs().max().item() <= fp32_bound(m)
