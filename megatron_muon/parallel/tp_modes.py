"""One entry point, ``orthogonalize_sharded``, for Newton–Schulz on tensor-parallel shards.

The modes (``docs/tp_modes.md`` has the derivations and the cost table):

``duplicated``   all-gather the shards, every rank runs NS on the full matrix, keeps its slice.
                 Exact; NS runs t times per matrix; each rank receives (t−1)/t of it.
``distributed``  no rank ever holds the full matrix. NS runs on the orientation whose Gram
                 matrix spans the *unsharded* dimension k, so X·Xᵀ summed over ranks is the
                 full Gram (k × k); one all-reduce per iteration plus two for the norm (its
                 overflow-safe scale, then the squares). Exact.
``blockwise``    NS on the local shard only (BlockMuon). No communication; not the same math.
``owner``        every matrix gets one owner rank (``planner.plan_owners``); shards travel
                 there by one all-to-all and back by another (``owner_exchange``), asynchronous
                 and pipelined over micro-groups. Exact; NS runs once per matrix. Implemented in
                 ``owner_mode.py``.
``auto``         per matrix, the cheapest of owner / duplicated / distributed by the cost model
                 (``auto_mode.choose_tp_modes``, on the ``hardware`` constants); each subset runs
                 in its mode's implementation. Exact, since every candidate is.

When is ``distributed`` cheaper than ``duplicated``? For a matrix with unsharded dim k,
sharded dim S, t ranks and s NS steps, per rank:

    duplicated:  compute s·(4a²b + 2a³), a = min(k, S), b = max(k, S);  send (t−1)·k·S/t
    distributed: compute s·(4k²·S/t + 2k³);                              send 2(t−1)/t·(s·k² + 2)

With k <= S distributed always saves 4s·k²·S·(1 − 1/t) FLOPs; it sends fewer bytes only when
2·s·k < S (k < S/10 at s = 5), and it has s+2 dependent collectives on the critical path, so
it pays off for tall-and-thin shards split along the long side (fc1, QKV at large TP).
With k > S the Gram is the large one and distributed costs more compute than duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..core.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    coefficient_schedule,
    max_abs,
    newton_schulz,
    ns_flops,
    power_of_two_floor,
)
from . import comm
from .devices import resolve_device
from .owner_exchange import split_rounds
from .sharding import ShardSpec, group_by, join_shards, split_full

if TYPE_CHECKING:
    from .cost_model import Hardware

__all__ = ["DEFAULT_BUCKET_BYTES", "MODES", "check_call", "distributed_ns_flops", "orthogonalize_sharded",
           "validate_across_ranks"]

# Append new modes last: validate_across_ranks sends MODES.index(mode).
MODES = ("duplicated", "distributed", "blockwise", "owner", "auto")
DEFAULT_BUCKET_BYTES = 256 * 2**20


def orthogonalize_sharded(
    shards: Sequence[torch.Tensor],
    partition_dims: Sequence[int | None],
    *,
    mode: str,
    group=None,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    full_shapes: Sequence[tuple[int, int]] | None = None,
    validate: bool = True,
    hardware: Hardware | None = None,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Orthogonalize matrices that ``group`` holds in TP shards; return this rank's pieces.

    Args:
        shards: ``shards[i]`` is this rank's 2-D piece of full matrix i.
        partition_dims: the full matrix i is split evenly, in rank order of ``group``, along
            ``partition_dims[i]`` (0 or 1); ``None`` means every rank holds all of it.
        mode: one of ``MODES``.
        group: a torch.distributed group (gloo/CPU or NCCL/CUDA); None = the default group,
            or a single process when torch.distributed is not initialised.
        steps, coefficients, eps: passed to ``newton_schulz``.
        bucket_bytes: cap on the full-matrix bytes gathered per collective round
            (duplicated and owner), which bounds transient memory on large models. Owner mode
            runs its rounds as the micro-groups of a pipeline, cut finer (to about
            ``MIN_MICRO_GROUPS``) when the cap alone gives fewer (``split_micro_groups``): the
            gather of the next group and the return of the previous one are in flight while NS runs.
        full_shapes: optional global shapes to check the shards against.
        validate: check, with one small all-gather of shapes, that every rank agrees on the
            matrix list before moving data. Callers with a fixed layout may check once.
        hardware: the cost model's constants for ``auto`` (ignored by the other modes);
            None = ``auto_mode.hardware_profile("detect")``. Every rank of ``group`` must pass
            the same constants: the choice is made locally, without communicating.
        device: where this call's buffers live; None = the shards' device, or the group's when
            this rank has no shard (``devices.resolve_device``). The optimizer passes its own.

    Returns:
        A list with ``shards[i].shape`` and dtype per entry (an empty matrix's is empty: a
        no-op update, computed without communication). For the exact modes, the pieces
        concatenated over ranks equal ``newton_schulz`` of the full matrix up to floating-point
        reassociation (the Gram sums and batched GEMMs change the summation order).
    """
    size, rank = comm.group_size(group), comm.group_rank(group)
    device = resolve_device(shards, group, what="orthogonalize_sharded: shards") if device is None else device
    specs = _validate_local(shards, partition_dims, mode, size, steps, coefficients, full_shapes)
    if mode == "auto" and hardware is None:
        from .auto_mode import hardware_profile

        hardware = hardware_profile("detect")
    if validate and size > 1 and mode != "blockwise":
        validate_across_ranks(specs, mode, steps, size, group, device, hardware if mode == "auto" else None)
    # An empty matrix (a zero dim) has an empty update: answered here, so that no mode, cost
    # model or exchange ever sees a zero-size matrix. Every rank drops the same ones (the shapes
    # were just checked to agree), so the collectives below still line up.
    work = [s for s in specs if s.local_shape[0] and s.local_shape[1]]
    if not work:
        out = [None] * len(shards)
    elif mode == "owner":
        from .owner_mode import owner_orthogonalize

        out = owner_orthogonalize(shards, work, group, size, rank, steps, coefficients, eps, bucket_bytes, device)
    elif mode == "auto":
        out = _auto(shards, work, group, size, rank, steps, coefficients, eps, bucket_bytes, hardware, device)
    else:
        run = {"duplicated": _duplicated, "distributed": _distributed, "blockwise": _blockwise}[mode]
        out = run(shards, work, group, size, rank, steps, coefficients, eps, bucket_bytes)
    for s in specs:
        if out[s.index] is None:
            out[s.index] = shards[s.index].clone()  # empty: nothing is copied
    return out


# ---- modes -------------------------------------------------------------------------------


def _auto(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes, hardware, device):
    """Each matrix in the mode ``choose_tp_modes`` picks; one sub-call per mode, in a fixed order.

    Every rank computes the same choice from the same (validated) shapes, so the sub-calls and
    their collectives line up across the group. Each sub-mode records its own bytes and FLOPs.
    """
    from .auto_mode import AUTO_CANDIDATES, choose_tp_modes
    from .cost_model import Matrix

    hw = hardware
    matrices = [Matrix(*s.full_shape, s.partition_dim) for s in specs]
    dtype_bytes = max(shards[s.index].element_size() for s in specs)
    chosen = choose_tp_modes(matrices, size, hw, steps=steps, dtype_bytes=dtype_bytes)
    out: list[torch.Tensor | None] = [None] * len(shards)
    for mode in AUTO_CANDIDATES:
        members = [s for s, m in zip(specs, chosen) if m == mode]
        if not members:
            continue
        sub_shards = [shards[s.index] for s in members]
        sub_specs = [ShardSpec(j, s.local_shape, s.partition_dim, s.group_size) for j, s in enumerate(members)]
        if mode == "owner":
            from .owner_mode import owner_orthogonalize

            results = owner_orthogonalize(sub_shards, sub_specs, group, size, rank, steps, coefficients, eps,
                                          bucket_bytes, device)
        else:
            run = {"duplicated": _duplicated, "distributed": _distributed}[mode]
            results = run(sub_shards, sub_specs, group, size, rank, steps, coefficients, eps, bucket_bytes)
        for s, res in zip(members, results):
            out[s.index] = res
    return out


def _blockwise(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes):
    out: list[torch.Tensor | None] = [None] * len(shards)
    for members in group_by(specs, lambda s: (s.local_shape, shards[s.index].dtype)).values():
        _ns_into(out, shards, members, steps, coefficients, eps)
    return out


def _duplicated(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes):
    out: list[torch.Tensor | None] = [None] * len(shards)
    key = lambda s: (s.local_shape, s.partition_dim if s.is_sharded else None, shards[s.index].dtype)
    for (_, pdim, _), members in group_by(specs, key).items():
        if pdim is None:  # every rank holds the whole matrix: NS locally, no traffic
            _ns_into(out, shards, members, steps, coefficients, eps)
            continue
        full_bytes = [_numel(s.full_shape) * shards[s.index].element_size() for s in members]
        for chunk in split_rounds(full_bytes, bucket_bytes):
            batch = [members[j] for j in chunk]
            local = torch.stack([shards[s.index] for s in batch])
            gathered = [torch.empty_like(local) for _ in range(size)]
            comm.all_gather(gathered, local, group)
            full = join_shards(torch.stack(gathered), pdim)
            comm.record_ns_flops(len(batch) * ns_flops(*batch[0].full_shape, steps))
            mine = split_full(newton_schulz(full, steps, coefficients, eps=eps), pdim, size, rank)
            for s, piece in zip(batch, mine.unbind(0)):
                out[s.index] = piece.contiguous()
    return out


def _distributed(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes):
    out: list[torch.Tensor | None] = [None] * len(shards)
    schedule = coefficient_schedule(coefficients, steps)
    key = lambda s: (s.local_shape, s.partition_dim if s.is_sharded else None, shards[s.index].dtype)
    for (_, pdim, _), members in group_by(specs, key).items():
        if pdim is None:
            _ns_into(out, shards, members, steps, coefficients, eps)
            continue
        X = torch.stack([shards[s.index] for s in members])
        # Orient so rows span the unsharded dim k: then X·Xᵀ (k × k) summed over ranks is the
        # full Gram, and X ← aX + B·X acts on each rank's columns independently. Row shards
        # (pdim 0) therefore run on the transpose; NS(Mᵀ)ᵀ = NS(M) since the iteration is odd.
        # This follows emerging-optimizers' newton_schulz_tp (transpose = partition_dim == 0).
        if pdim == 0:
            X = X.mT
        k, local_cols = X.shape[-2], X.shape[-1]
        X = _normalize_distributed(X, group, size, eps)
        for a, b, c in schedule:
            A = X @ X.mT
            comm.all_reduce(A, group)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        comm.record_ns_flops(len(members) * distributed_ns_flops(k, local_cols, steps))
        if pdim == 0:
            X = X.mT
        for s, piece in zip(members, X.unbind(0)):
            out[s.index] = piece.contiguous()
    return out


def _normalize_distributed(X: torch.Tensor, group, size: int, eps: float) -> torch.Tensor:
    """X / max(‖full matrix‖_F, eps) for a stack of column shards, summed over ``group``.

    As in ``newton_schulz``, every rank first divides by one power of two near the largest
    entry, so that the squares cannot overflow (entries past ~1e19 in fp32/bf16 would make the
    norm inf and the update a silent zero). The power must be the same on every rank, so it
    comes from the sum over ranks of max|shard| / size, which lies in [max/size, max] and
    cannot overflow (comm's all-reduce sums; a MAX would need another primitive). All-reduce
    results are identical on every rank, hence so is the power. (Empty matrices never get
    here: ``orthogonalize_sharded`` answers them first.)
    """
    share = max_abs(X).reshape(X.shape[0]) / size
    comm.all_reduce(share, group)
    scale = power_of_two_floor(share)[:, None, None]
    X = X / scale
    sq_norms = (X * X).sum(dim=(-2, -1), keepdim=True)
    comm.all_reduce(sq_norms, group)
    return X.div_(sq_norms.sqrt().clamp(min=eps / scale))


def _ns_into(out, shards, members: list[ShardSpec], steps, coefficients, eps) -> None:
    """Run NS on these ranks' own (same-shape) matrices as one batch and file the results."""
    X = torch.stack([shards[s.index] for s in members])
    comm.record_ns_flops(len(members) * ns_flops(*members[0].local_shape, steps))
    for s, piece in zip(members, newton_schulz(X, steps, coefficients, eps=eps).unbind(0)):
        out[s.index] = piece


def distributed_ns_flops(k: int, local_cols: int, steps: int = 5) -> int:
    """Per-rank FLOPs of distributed NS on a (k × local_cols) shard: s·(4k²·cols + 2k³)."""
    return steps * (4 * k * k * local_cols + 2 * k * k * k)


def _numel(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


# ---- validation --------------------------------------------------------------------------


def _where(mode: str, size: int) -> str:
    return f"[mode={mode!r}, group size {size}]"


def _validate_local(shards, partition_dims, mode, size, steps, coefficients, full_shapes) -> list[ShardSpec]:
    if mode not in MODES:
        raise ValueError(
            f"orthogonalize_sharded: unknown mode {mode!r}; expected one of {MODES} {_where(mode, size)}"
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
        spec = ShardSpec(i, shape, pdim, size)
        if full_shapes is not None:
            want = tuple(full_shapes[i])
            if pdim is not None and want[pdim] % size != 0:
                raise ValueError(
                    f"orthogonalize_sharded: {spec.describe()}: full dim {pdim} of {want} is not "
                    f"divisible by the group size {size} {_where(mode, size)}"
                )
            if want != spec.full_shape:
                raise ValueError(
                    f"orthogonalize_sharded: {spec.describe()}: full shape {want} does not match "
                    f"{size} shards of {shape} {_where(mode, size)}"
                )
        specs.append(spec)
    return specs


def check_call(mode: str, size: int, steps: int, coefficients: Coefficients) -> None:
    """The checks of ``orthogonalize_sharded`` that need no matrix: the mode, steps, coefficients."""
    _validate_local([], [], mode, size, steps, coefficients, None)


def _hardware_tag(hardware) -> int:
    """A checksum of ``auto``'s constants, equal on two ranks only if the constants are equal
    (crc32 of their repr: stable across processes, unlike ``hash``); 0 for the other modes."""
    if hardware is None:
        return 0
    import dataclasses
    import zlib

    return zlib.crc32(repr(dataclasses.astuple(hardware)).encode())


def validate_across_ranks(specs, mode, steps, size, group, device, hardware=None) -> None:
    """Check with two small all-gathers that every rank describes the same matrices.

    Must run before any payload collective: mismatched sizes would otherwise hang or corrupt
    an all-gather. The first call compares list length, mode and steps; the second, per
    matrix, both dims and the partition_dim (a sharded dim may legitimately be equal only
    because the split is even, which is the claim being checked).
    """
    # auto: ranks with different hardware constants (``detect`` on mixed GPUs) would choose
    # different modes and their collectives would not line up: compare a checksum of them too
    header = torch.tensor([len(specs), MODES.index(mode), steps, _hardware_tag(hardware)], dtype=torch.int64,
                          device=device)
    headers = [torch.empty_like(header) for _ in range(size)]
    comm.all_gather(headers, header, group, tag="shape_check")
    if device.type == "meta":
        # The dry run (torch's fake group, meta tensors): the gathers are issued, so their devices
        # and sizes are checked, but no value moves; scripts/dry_run.py checks sizes instead.
        if specs:
            mine = torch.empty(len(specs), 3, dtype=torch.int64, device=device)
            comm.all_gather([torch.empty_like(mine) for _ in range(size)], mine, group, tag="shape_check")
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
    mine = torch.tensor(
        [[*s.local_shape, -1 if s.partition_dim is None else s.partition_dim] for s in specs],
        dtype=torch.int64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(size)]
    comm.all_gather(everyone, mine, group, tag="shape_check")
    table = torch.stack(everyone)  # (rank, matrix, [rows, cols, pdim])
    for s in specs:
        rows = table[:, s.index, :]
        if not bool((rows == rows[0]).all()):
            per_rank = [tuple(r.tolist()) for r in rows]
            raise ValueError(
                f"orthogonalize_sharded: {s.describe()}: ranks disagree on (rows, cols, partition_dim): "
                f"{per_rank}; a sharded matrix must be split evenly, so every rank's shard has the same "
                f"shape {_where(mode, size)}"
            )
