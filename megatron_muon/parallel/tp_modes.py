"""One entry point, ``orthogonalize_sharded``, for Newton–Schulz on tensor-parallel shards.

The modes (``docs/tp_modes.md`` has the derivations and the cost table):

``duplicated``   all-gather the shards, every rank runs NS on the full matrix, keeps its slice.
                 Exact; NS runs t times per matrix; each rank receives (t−1)/t of it.
``distributed``  no rank ever holds the full matrix. NS runs on the orientation whose Gram
                 matrix spans the *unsharded* dimension k, so X·Xᵀ summed over ranks is the
                 full Gram (k × k); one all-reduce per iteration plus two for the norm (its
                 overflow-safe scale, then the squares), all in fp32 (``REDUCE_DTYPE``). Exact.
``blockwise``    NS on the local shard only (BlockMuon). No communication; not the same math.
``owner``        every matrix gets one owner rank (``planner.plan_owners``); shards travel
                 there by one all-to-all and back by another (``owner_exchange``), asynchronous
                 and pipelined over micro-groups. Exact; NS runs once per matrix. Implemented in
                 ``owner_mode.py``.
``auto``         per matrix, the cheapest of owner / duplicated / distributed by the cost model
                 (``auto_mode.choose_tp_modes``, on the ``hardware`` constants); each subset runs
                 in its mode's implementation. Exact, since every candidate is.

A replicated matrix (partition_dim None: every rank holds it whole) runs on one rank in every exact
mode (the plan's TP owner) and reaches the others by a broadcast of the result (owner mode: in the
return all-to-all), so every rank holds the same bits whatever kernels its GEMMs would pick.
Blockwise, which never communicates, runs it on every rank.

When is ``distributed`` cheaper than ``duplicated``? For a matrix with unsharded dim k,
sharded dim S, t ranks and s NS steps, per rank:

    duplicated:  compute s·(4a²b + 2a³), a = min(k, S), b = max(k, S);  send (t−1)·k·S/t
    distributed: compute s·(2k²·c + min(2k²·⌈k/t⌉ + 2k²·c, 4k²·c, 2k³ + 2k²·c)), c = S/t;
                 send 2(t−1)/t·(s·k² + 2) fp32 elements, plus s·(t−1)·⌈k/t⌉·k when B's rows
                 are split

(the min, by shapes: where the shards together are wider than k each rank forms ⌈k/t⌉ rows of
B = bA + cA² and the rows are all-gathered, so no rank pays the k³ term alone; else a shard
narrower than k computes A·(A·X) instead of A².) With k <= S distributed always saves FLOPs
(with B split, its per-rank FLOPs are NS's over t plus the Gram, which all ranks form for
their own columns); it sends fewer bytes only when 2·s·k < S (k < S/10 at s = 5; in bf16, whose
shards are half the Gram's fp32 bytes per element, k < S/20), and it has
2s+2 dependent collectives on the critical path, so it pays off for tall-and-thin shards split
along the long side (fc1, QKV at large TP). With k > S the Gram is the large one and distributed
costs more compute than duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.block_grid import block_shape, join_blocks, split_blocks
from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import (
    NSOptions,
    coefficient_schedule,
    gram_block_rows,
    gram_blocks,
    gram_chunk_bounds,
    gram_chunks,
    gram_iteration,
    max_abs,
    power_of_two_floor,
    quintic_block,
    quintic_iteration,
    sharded_gram_flops,
    sharded_ns_flops,
    sharded_runs_gram,
    splits_gram,
)
from ..plan.exchange import split_rounds
from ..plan.pricing import DISTRIBUTED_SUM_BYTES
from ..plan.step_plan import TP_MODES
from . import comm
from .sharding import group_by, join_shards, split_full

__all__ = ["REDUCE_DTYPE", "check_local_shards", "run_blocking_mode", "validate_across_ranks"]

REDUCE_DTYPE = torch.float32
"""the dtype of every all-reduce of the distributed mode (the Grams, the scale, the norm), whatever
the NS dtype: k² elements are small next to the shards, and a half-precision ring would round each
hop's partial sum where the one-device NS accumulates its Gram in fp32 (tests/dist/test_gram_sum_precision.py
measures the difference). The plan prices them at ``DISTRIBUTED_SUM_BYTES`` per element."""
assert REDUCE_DTYPE.itemsize == DISTRIBUTED_SUM_BYTES


# ---- the blocking modes -------------------------------------------------------------------


def run_blocking_mode(mode: str, shards: list[torch.Tensor], subs: list[MatrixLayout], group, ns: NSOptions,
                      bucket_bytes: int, grid: tuple[int, int] = (1, 1),
                      owners: Sequence[int | None] | None = None) -> list[torch.Tensor]:
    """NS of ``shards`` (same order as ``subs``) in a mode's own blocking implementation: every
    mode but the pipelined owner exchange. ``owner`` here is the one-rank case (TP 1), where every
    exact mode is NS of the whole matrix on its rank. ``grid``: blockwise only, each local matrix
    orthogonalized as R x C blocks (``core.block_grid``; the plan checked that they divide).
    ``owners``: per shard, the TP rank that computes it where it is replicated (the plan's
    ``OwnerWork.tp_owners``; needed by duplicated and distributed on a group of two or more)."""
    if mode == "blockwise":
        return _local(shards, subs, ns, grid)
    if comm.group_size(group) == 1:
        return _local(shards, subs, ns)
    out: list[torch.Tensor | None] = [None] * len(shards)
    # Replicated matrices first: each computed on its owner, its result broadcast while the
    # sharded ones run (identical bits on every rank, whatever kernels each rank's GEMMs pick).
    replicated = [k for k, sub in enumerate(subs) if not sub.is_sharded]
    pending = _replicated(out, shards, replicated, owners, group, ns) if replicated else []
    sharded = [k for k, sub in enumerate(subs) if sub.is_sharded]
    if mode == "distributed":  # its own products, outside NSOptions.__call__: the precision set here
        with ns.matmul_precision():
            _distributed(out, shards, subs, sharded, group, ns)
    else:
        _duplicated(out, shards, subs, sharded, group, ns, bucket_bytes)
    for p in pending:
        p.wait()
    return out


def _local(shards, subs, ns: NSOptions, grid: tuple[int, int] = (1, 1)) -> list[torch.Tensor]:
    """NS of what each rank holds, batched by shape and dtype (blockwise, in ``grid``'s blocks;
    every matrix on a group of one)."""
    out: list[torch.Tensor | None] = [None] * len(shards)
    for positions in group_by(range(len(shards)), lambda k: (subs[k].local_shape, shards[k].dtype)).values():
        _ns_into(out, shards, positions, subs[positions[0]].local_shape, ns, grid)
    return out


def _replicated(out, shards, members: list[int], owners, group, ns: NSOptions) -> list[comm.Pending]:
    """Replicated matrices (every rank holds the whole matrix): each owner runs NS of its own, as
    batches by shape, into one flat buffer per (owner, dtype), broadcast from the owner; ``out``
    gets views of the buffers. Every rank walks the owners in rank order, so the broadcasts line
    up; the owner computes before it issues its own broadcast, the others' are already posted."""
    if owners is None or any(owners[k] is None for k in members):
        raise ValueError("run_blocking_mode: a replicated matrix needs its TP owner (the plan's tp_owners)")
    rank = comm.group_rank(group)
    pending = []
    for (owner, dtype), mine in sorted(group_by(members, lambda k: (owners[k], shards[k].dtype)).items(),
                                       key=lambda item: (item[0][0], _dtype_code(item[0][1]))):
        flat = torch.empty(sum(shards[k].numel() for k in mine), dtype=dtype, device=shards[mine[0]].device)
        views = dict(zip(mine, flat.split([shards[k].numel() for k in mine])))
        if owner == rank:
            results: list[torch.Tensor | None] = [None] * len(shards)
            for positions in group_by(mine, lambda k: tuple(shards[k].shape)).values():
                _ns_into(results, shards, positions, tuple(shards[positions[0]].shape), ns)
                for k in positions:
                    views[k].view_as(shards[k]).copy_(results[k])
                    results[k] = None
        pending.append(comm.broadcast_async(flat, owner, group))
        for k in mine:
            out[k] = views[k].view_as(shards[k])
    return pending


def _duplicated(out, shards, subs, members: list[int], group, ns: NSOptions, bucket_bytes: int) -> None:
    """Sharded matrices: all-gathered into one flat buffer per batch of same-shape matrices (at most
    ``bucket_bytes`` of full matrices), joined, NS on every rank, this rank's slice kept.

    Live full-batch copies (F) besides NS's own: the gathered buffer (NCCL writes it in place,
    where for the list form it gathers into a hidden flat buffer and copies out; gloo copies
    through one in both forms), then the joined matrices (a copy, except for one row-split
    matrix, whose gathered rows already are the full matrix), the gathered buffer freed before NS
    runs on them: at most 2F outside NS, F during it. The list form held the list, the hidden
    buffer, their stack and the joined copy: 3F outside NS, 2F during it. The result is cut to
    this rank's slices by copy, so no view keeps F alive after the call."""
    size, rank = comm.group_size(group), comm.group_rank(group)
    key = lambda k: (subs[k].local_shape, subs[k].partition_dim, shards[k].dtype)
    for (shape, pdim, _), batch_members in group_by(members, key).items():
        full = subs[batch_members[0]].full_shape
        full_bytes = [full[0] * full[1] * shards[k].element_size() for k in batch_members]
        for chunk in split_rounds(full_bytes, bucket_bytes):
            batch = [batch_members[j] for j in chunk]
            local = torch.stack([shards[k] for k in batch])
            gathered = local.new_empty((size * len(batch), *shape))  # rank-major: rank r's stack at [r·n, (r+1)·n)
            comm.all_gather_into_tensor(gathered, local, group)
            del local
            joined = join_shards(gathered.view(size, len(batch), *shape), pdim)
            del gathered
            comm.record_ns_flops(len(batch) * ns.flops(*full))
            result = ns(joined)
            del joined
            for k, piece in zip(batch, split_full(result, pdim, size, rank).unbind(0)):
                out[k] = piece.clone()  # a copy even where the slice is contiguous: a view would keep F alive
            del result


def _distributed(out, shards, subs, members: list[int], group, ns: NSOptions) -> None:
    size = comm.group_size(group)
    schedule = coefficient_schedule(ns.coefficients, ns.steps)
    key = lambda k: (subs[k].local_shape, subs[k].partition_dim, shards[k].dtype)
    for (_, pdim, _), batch in group_by(members, key).items():
        X = torch.stack([shards[k] for k in batch])
        # Orient so rows span the unsharded dim k: then X·Xᵀ (k × k) summed over ranks is the
        # full Gram, and X ← aX + B·X acts on each rank's columns independently. Row shards
        # (pdim 0) therefore run on the transpose; NS(Mᵀ)ᵀ = NS(M) since the iteration is odd.
        # This follows emerging-optimizers' newton_schulz_tp (transpose = partition_dim == 0).
        if pdim == 0:
            X = X.mT
        k, local_cols = X.shape[-2], X.shape[-1]
        if sharded_runs_gram(ns.method, k, local_cols, size):
            X = _distributed_gram(X, group, size, ns, schedule)
            comm.record_ns_flops(len(batch) * sharded_gram_flops(k, local_cols, ns.steps, ns.restarts))
        else:
            X = _normalize_distributed(X, group, size, ns.eps)
            # The product form is decided on shapes alone (``splits_gram``), so every rank picks the
            # same and issues the same collectives: B's rows split over the group and all-gathered
            # where the shards together are wider than k, else A·(A·X) (the shard is then narrower
            # than k).
            split = splits_gram(k, local_cols, size)
            for a, b, c in schedule:
                A = _summed_gram(X, group)
                if split:
                    X = torch.baddbmm(X, _gathered_quintic(A, group, size, b, c), X, beta=a)
                else:
                    X = quintic_iteration(X, A, a, b, c)
            comm.record_ns_flops(len(batch) * sharded_ns_flops(k, local_cols, ns.steps, size))
        if pdim == 0:
            X = X.mT
        for m, piece in zip(batch, X.unbind(0)):
            out[m] = piece.contiguous()


def _summed_gram(X: torch.Tensor, group, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole matrix's Gram, Σ over ``group`` of X·Xᵀ, in ``dtype`` (None: ``X``'s): each rank's
    product rounded once in X's dtype (as the one-device NS rounds its Gram), summed in fp32
    (``REDUCE_DTYPE``; a half-precision ring would round every hop's partial sum).

    A large Gram (``gram_chunks``) is formed and summed in row chunks: each chunk's all-reduce is
    issued as soon as its rows are computed and runs while the next chunk's are (on NCCL, on the
    communicator's stream beside the GEMM). Every entry is the same dot product either way."""
    chunks = gram_chunks(X.shape[-2], comm.group_size(group))
    if chunks == 1:
        G = (X @ X.mT).to(REDUCE_DTYPE)
        comm.all_reduce(G, group)
        return G.to(dtype or X.dtype)
    pending = []
    for lo, hi in gram_chunk_bounds(X.shape[-2], chunks):
        rows = (X[..., lo:hi, :] @ X.mT).to(REDUCE_DTYPE)  # contiguous: one buffer per chunk
        pending.append((lo, hi, rows, comm.all_reduce_async(rows, group)))
    # the result allocated once every chunk is in flight, each chunk freed as it is copied in:
    # the peak is the unchunked one's (the fp32 sum and the result side by side)
    G = X.new_empty(X.shape[:-1] + X.shape[-2:-1], dtype=dtype or X.dtype)
    pending.reverse()
    while pending:
        lo, hi, rows, work = pending.pop()
        work.wait()
        G[..., lo:hi, :] = rows
        del rows, work
    return G


def _distributed_gram(X: torch.Tensor, group, size: int, ns: NSOptions, schedule) -> torch.Tensor:
    """Gram Newton–Schulz on a stack of column shards ``(n, k, cols)`` whose Gram (k × k, the
    whole matrix's short side) is the sum over ``group`` of each rank's X·Xᵀ: one all-reduce of it
    per block (``gram_blocks``: 2 with the published restart, against one per step), then every
    rank runs the k × k iteration on the same summed R, so every rank's Q is the same and Q·X acts
    on its own columns. The norm comes from the first Gram's trace (‖X‖_F² = tr X·Xᵀ), so besides
    the overflow-safe scale's scalar all-reduce (``_normalize_distributed``) nothing else moves.
    With ``ns.gram_dtype`` everything after the normalization (the iteration, the later Grams,
    Q·X) runs in it; every Gram is summed in fp32 (``_summed_gram``), the first one kept in fp32
    until the norm has been divided out, because before that its entries are not bounded by 1."""
    dtype = X.dtype
    scale = _shared_scale(X, group, size)
    X = X / scale
    for i, block in enumerate(gram_blocks(schedule, ns.restarts)):
        if i == 0:
            R = _summed_gram(X, group, REDUCE_DTYPE)
            norm = R.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None].sqrt().clamp(min=ns.eps / scale.to(REDUCE_DTYPE))
            X = X.div_(norm).to(ns.gram_dtype or dtype)
            R = R.div_(norm * norm).to(X.dtype)
        else:
            R = _summed_gram(X, group)
        X = gram_iteration(R, block) @ X
    return X.to(dtype)


def _gathered_quintic(A: torch.Tensor, group, size: int, b: float, c: float) -> torch.Tensor:
    """The whole B = b·A + c·A² (a stack ``(n, k, k)``) on every rank of ``group``, each rank having
    formed ``gram_block_rows(k, size)`` of its rows (zero-padded past k, so the all-gather's
    pieces have one size); identical on every rank, since every rank holds the same A."""
    n, k = A.shape[0], A.shape[-1]
    block = gram_block_rows(k, size)
    start = min(k, comm.group_rank(group) * block)
    stop = min(k, start + block)
    mine = A.new_zeros(n, block, k)
    mine[:, : stop - start] = quintic_block(A, start, stop, b, c)
    parts = A.new_empty(size * n, block, k)
    comm.all_gather_into_tensor(parts, mine, group)
    return parts.view(size, n, block, k).transpose(0, 1).reshape(n, size * block, k)[:, :k]


def _shared_scale(X: torch.Tensor, group, size: int) -> torch.Tensor:
    """One power of two per matrix of the stack near its largest entry, the same on every rank.

    As in ``newton_schulz``, every rank first divides by it, so that the squares cannot overflow
    (entries past ~1e19 in fp32/bf16 would make the norm inf and the update a silent zero). It
    comes from the sum over ranks of max|shard| / size, which lies in [max/size, max] and cannot
    overflow (comm's all-reduce sums; a MAX would need another primitive), summed in fp32 like
    every all-reduce of this mode. All-reduce results are identical on every rank, hence so is the
    power; in X's dtype (every power of two of an fp32 max fits bf16; fp16's max is below 2¹⁶)."""
    share = max_abs(X).reshape(X.shape[0]).to(REDUCE_DTYPE) / size
    comm.all_reduce(share, group)
    return power_of_two_floor(share).to(X.dtype)[:, None, None]


def _normalize_distributed(X: torch.Tensor, group, size: int, eps: float) -> torch.Tensor:
    """X / max(‖full matrix‖_F, eps) for a stack of column shards, summed over ``group``: scaled
    first by ``_shared_scale``, the squares summed in fp32. (Empty matrices never get here: the
    plan leaves them out.)"""
    scale = _shared_scale(X, group, size)
    X = X / scale
    sq_norms = (X * X).sum(dim=(-2, -1), keepdim=True, dtype=REDUCE_DTYPE)
    comm.all_reduce(sq_norms, group)
    return X.div_(sq_norms.sqrt().clamp(min=eps / scale.to(REDUCE_DTYPE)))


def _ns_into(out, shards, positions, shape: tuple[int, int], ns: NSOptions,
             grid: tuple[int, int] = (1, 1)) -> None:
    """Run NS on these ranks' own (same-shape) matrices as one batch (each as ``grid``'s blocks,
    all of them in the batch) and file the results."""
    X = torch.stack([shards[k] for k in positions])
    if grid != (1, 1):
        comm.record_ns_flops(len(positions) * grid[0] * grid[1] * ns.flops(*block_shape(shape, grid)))
        result = join_blocks(ns(split_blocks(X, grid)), grid, shape)
    else:
        comm.record_ns_flops(len(positions) * ns.flops(*shape))
        result = ns(X)
    for k, piece in zip(positions, result.unbind(0)):
        out[k] = piece


# ---- validation --------------------------------------------------------------------------


def _where(mode: str, size: int) -> str:
    return f"[mode={mode!r}, group size {size}]"


def _describe(sub: MatrixLayout) -> str:
    return f"{sub.name} (local shape {sub.local_shape}, partition_dim {sub.partition_dim})"


def check_local_shards(shards, partition_dims, mode, size, steps, coefficients, full_shapes) -> list[MatrixLayout]:
    if mode not in TP_MODES:
        raise ValueError(
            f"orthogonalize_sharded: unknown mode {mode!r}; expected one of {TP_MODES} {_where(mode, size)}"
        )
    coefficient_schedule(coefficients, steps)  # raises on bad steps / coefficient set
    if len(shards) != len(partition_dims):
        raise ValueError(
            f"orthogonalize_sharded: {len(shards)} shards but {len(partition_dims)} partition_dims "
            f"{_where(mode, size)}"
        )
    if full_shapes is not None and len(full_shapes) != len(shards):
        raise ValueError(
            f"orthogonalize_sharded: {len(shards)} shards but {len(full_shapes)} full_shapes {_where(mode, size)}"
        )
    specs = []
    for i, (x, pdim) in enumerate(zip(shards, partition_dims)):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"orthogonalize_sharded: matrix {i} must be a 2-D tensor, got shape {shape} {_where(mode, size)}"
            )
        if pdim not in (0, 1, None) or isinstance(pdim, bool):
            raise ValueError(
                f"orthogonalize_sharded: matrix {i} (local shape {shape}) has partition_dim {pdim!r}; "
                f"expected 0, 1 or None {_where(mode, size)}"
            )
        spec = MatrixLayout(f"matrix {i}", shape, pdim, size)
        if full_shapes is not None:
            want = tuple(full_shapes[i])
            if pdim is not None and want[pdim] % size != 0:
                raise ValueError(
                    f"orthogonalize_sharded: {_describe(spec)}: full dim {pdim} of {want} is not "
                    f"divisible by the group size {size} {_where(mode, size)}"
                )
            if want != spec.full_shape:
                raise ValueError(
                    f"orthogonalize_sharded: {_describe(spec)}: full shape {want} does not match "
                    f"{size} shards of {shape} {_where(mode, size)}"
                )
        specs.append(spec)
    return specs


def _hardware_tag(hardware) -> int:
    """A checksum of ``auto``'s constants, equal on two ranks only if the constants are equal
    (crc32 of their repr: stable across processes, unlike ``hash``); 0 for the other modes."""
    if hardware is None:
        return 0
    import dataclasses
    import zlib

    return zlib.crc32(repr(dataclasses.astuple(hardware)).encode())


_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""dtype → its index here in the validation table (any other dtype: ``len``)."""


def _dtype_code(dtype: torch.dtype | None) -> int:
    return -1 if dtype is None else (_DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else len(_DTYPE_CODES))


def validate_across_ranks(specs, mode, steps, size, group, device, hardware=None, dtypes=None) -> None:
    """Check with two small all-gathers that every rank describes the same matrices.

    Must run before any payload collective: mismatched sizes would otherwise hang or corrupt
    an all-gather. The first call compares list length, mode and steps; the second, per
    matrix, both dims, the partition_dim (a sharded dim may legitimately be equal only
    because the split is even, which is the claim being checked) and the dtype its pieces
    travel in (``dtypes``, one per spec; None: not compared): on NCCL two ranks posting one
    collective with different dtypes move different byte counts, a hang or garbage.
    """
    # auto: ranks with different hardware constants (``detect`` on mixed GPUs) would choose
    # different modes and their collectives would not line up: compare a checksum of them too
    header = torch.tensor([len(specs), TP_MODES.index(mode), steps, _hardware_tag(hardware)], dtype=torch.int64,
                          device=device)
    headers = header.new_empty(size, header.numel())
    comm.all_gather_into_tensor(headers, header, group, tag="shape_check")
    if device.type == "meta" or comm.is_fake(group):
        # The dry run (torch's fake group; meta tensors, or real ones in gpu_check's real-step): the
        # gathers are issued, so their devices and sizes are checked, but no value moves (what they
        # return is uninitialized memory); scripts/dry_run.py checks sizes across ranks instead.
        if specs:
            mine = torch.empty(len(specs), 4, dtype=torch.int64, device=device)
            comm.all_gather_into_tensor(mine.new_empty(size, *mine.shape), mine, group, tag="shape_check")
        return
    lengths = [int(h[0]) for h in headers]
    if len(set(lengths)) > 1 or any(not torch.equal(h[1:], header[1:]) for h in headers):
        raise ValueError(
            f"orthogonalize_sharded: ranks disagree on the call: matrices per rank {lengths}, "
            f"(mode index, steps, auto hardware checksum) per rank {[tuple(h[1:].tolist()) for h in headers]}; "
            f"with auto every rank needs the same --muon-auto-hardware constants {_where(mode, size)}"
        )
    if not specs:
        return
    codes = [_dtype_code(None)] * len(specs) if dtypes is None else [_dtype_code(d) for d in dtypes]
    mine = torch.tensor(
        [[*s.local_shape, -1 if s.partition_dim is None else s.partition_dim, code] for s, code in zip(specs, codes)],
        dtype=torch.int64,
        device=device,
    )
    table = mine.new_empty(size, *mine.shape)  # (rank, matrix, [rows, cols, pdim, dtype code])
    comm.all_gather_into_tensor(table, mine, group, tag="shape_check")
    for k, s in enumerate(specs):
        rows = table[:, k, :]
        if not bool((rows[:, :3] == rows[0, :3]).all()):
            per_rank = [tuple(r.tolist()[:3]) for r in rows]
            raise ValueError(
                f"orthogonalize_sharded: {_describe(s)}: ranks disagree on (rows, cols, partition_dim): "
                f"{per_rank}; a sharded matrix must be split evenly, so every rank's shard has the same "
                f"shape {_where(mode, size)}"
            )
        if not bool((rows[:, 3] == rows[0, 3]).all()):
            names = [str(_DTYPE_CODES[c]).removeprefix("torch.") if 0 <= c < len(_DTYPE_CODES) else "other"
                     for c in rows[:, 3].tolist()]
            raise ValueError(
                f"orthogonalize_sharded: {_describe(s)}: ranks disagree on its dtype: {names} per rank; every "
                f"rank must pass the same dtype for one matrix {_where(mode, size)}"
            )
