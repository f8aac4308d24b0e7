"""The one orthogonalize step of the optimizer: DP owner exchange around a TP mode.

    pieces of the update (flat, on each DP rank)
        │  DP owner exchange there   (only matrices cut across DP ranks, or owned elsewhere, move)
        ▼
    owner holds the TP-local shard ─ split fused rows (QKV per group, fc1 gate/up)
        │  orthogonalize_sharded(mode=tp_mode) across the owner's TP peers
        ▼
    TP-local result ─ join rows
        │  DP owner exchange back
        ▼
    each rank scales its own piece (per sub-matrix, by global shape) → the update it applies

Correctness rule: NS never runs on a fragment. Every matrix has exactly one DP owner, chosen by
``plan_dp_owners`` identically on every rank (and so on every TP peer: TP peers own the same
matrices, which lets them run the TP mode together).

Pure torch + torch.distributed; no Megatron import.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import DEFAULT_COEFFICIENTS
from ..core.scaling import muon_scale
from . import comm
from .devices import resolve_device
from .owner_exchange import OwnedMatrix, OwnerExchange, Piece, split_rounds
from .planner import plan_owners
from .tp_modes import DEFAULT_BUCKET_BYTES, orthogonalize_sharded

__all__ = ["DP_MODES", "dp_owned_matrix", "orthogonalize_updates", "plan_dp_owners"]

DP_MODES = ("owner", "redundant")


def dp_owned_matrix(layout: MatrixLayout, owner: int, dp_size: int) -> OwnedMatrix:
    """The owner-exchange plan of one matrix across the DP group.

    With the distributed optimizer each DP rank's flat range is one piece; without it
    (``dp_ranges`` None) every rank holds the whole matrix, so only the owner's own copy is
    gathered and the result is scattered whole to every other rank.
    """
    if layout.dp_ranges is None:
        return OwnedMatrix(
            owner=owner,
            numel=layout.numel,
            gather=(Piece(owner, 0, layout.numel),),
            scatter=tuple(Piece(r, 0, layout.numel) for r in range(dp_size) if r != owner),
        )
    pieces = tuple(Piece(r, s, e - s) for r, (s, e) in enumerate(layout.dp_ranges) if e > s)
    return OwnedMatrix(owner=owner, numel=layout.numel, gather=pieces)


def plan_dp_owners(layouts: Sequence[MatrixLayout], dp_size: int, steps: int = 5) -> list[int]:
    """One DP owner per matrix: balanced on NS FLOPs, moving as little as possible.

    A matrix lying wholly in one rank's range is pinned to that rank (it never moves); a cut
    matrix prefers the rank holding its largest piece unless that would worsen the balance.
    Without DP ranges (plain DDP: every rank holds everything) it is plain LPT.
    """
    fixed: dict[int, int] = {}
    prefer: list[int | None] = []
    for i, layout in enumerate(layouts):
        holders = layout.holders(dp_size)
        if layout.dp_ranges is None or not holders:
            prefer.append(None)
            continue
        largest = max(holders, key=lambda r: (holders[r], -r))
        if len(holders) == 1:
            fixed[i] = largest
        prefer.append(largest)
    return plan_owners([lay.ns_cost(steps) for lay in layouts], dp_size, fixed=fixed, prefer=prefer)


def orthogonalize_updates(
    pieces: Sequence[torch.Tensor],
    layouts: Sequence[MatrixLayout],
    *,
    tp_mode: str,
    dp_group=None,
    tp_group=None,
    dp_mode: str = "owner",
    owners: Sequence[int] | None = None,
    steps: int = 5,
    coefficients=DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.bfloat16,
    scale_mode: str = "spectral",
    extra_scale_factor: float = 1.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    validate: bool = True,
    hardware=None,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Scaled orthogonalized updates for this rank's pieces of every matrix.

    Args:
        pieces: per matrix, this DP rank's flat piece of the update (its ``local_range``; may be
            empty); any float dtype.
        layouts: per matrix, where its pieces live (identical on every rank of the DP group and,
            for the same parameter, on every TP peer).
        tp_mode: ``orthogonalize_sharded`` mode across ``tp_group``.
        dp_mode: ``owner`` (NS on the DP owner, result exchanged) or ``redundant`` (plain DDP
            only: every DP rank computes every matrix, no DP traffic; for comparison).
        owners: DP owner per matrix; default ``plan_dp_owners``.
        ns_dtype: dtype of the exchange and of NS (bf16 halves the bytes at no loss, since NS
            casts to it anyway); the returned updates are fp32.
        scale_mode, extra_scale_factor: ``scaling.muon_scale`` on each sub-matrix's global shape
            (its local shape in blockwise mode, as Megatron does).
        hardware: ``cost_model.Hardware`` for ``tp_mode="auto"`` (see ``orthogonalize_sharded``).
        device: where every buffer of the step lives; None = the pieces' device (they must agree),
            or the DP group's when there are none (``devices.resolve_device``). The optimizer
            passes its parameters' device, so a rank holding no piece of some matrix (empty
            pieces) still allocates on the GPU.

    Returns:
        per matrix, an fp32 flat tensor shaped like ``pieces[i]``.
    """
    if dp_mode not in DP_MODES:
        raise ValueError(f"--muon-dp-mode: expected one of {DP_MODES}, got {dp_mode!r}")
    dp_size, dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
    for piece, layout in zip(pieces, layouts, strict=True):
        start, end = layout.local_range(dp_rank)
        if piece.numel() != end - start:
            raise ValueError(
                f"orthogonalize_updates: {layout.name}: piece has {piece.numel()} elements, its range "
                f"on DP rank {dp_rank} is [{start}, {end})"
            )
    if device is None:
        device = resolve_device(pieces, dp_group, what="orthogonalize_updates: pieces")
    tp_kwargs = dict(mode=tp_mode, group=tp_group, steps=steps, coefficients=coefficients, eps=eps,
                     bucket_bytes=bucket_bytes, validate=validate, hardware=hardware, device=device)

    results: dict[int, torch.Tensor] = {}
    if dp_mode == "redundant" or dp_size == 1:
        cut = [lay.name for lay in layouts if lay.dp_ranges is not None and dp_size > 1]
        if cut:
            raise ValueError(
                f"--muon-dp-mode redundant needs every DP rank to hold whole matrices (no "
                f"--use-distributed-optimizer); {cut[0]} is split across DP ranks"
            )
        owned = {i: pieces[i].to(ns_dtype) for i in range(len(layouts))}
        results.update(_tp_orthogonalize(owned, layouts, tp_kwargs))
        return [_scaled(results[i], layouts[i], 0, tp_mode, scale_mode, extra_scale_factor)
                for i in range(len(layouts))]

    owners = list(owners) if owners is not None else plan_dp_owners(layouts, dp_size, steps)
    element = ns_dtype.itemsize
    # Pieces travel to their DP owners in rounds of at most bucket_bytes, but the TP mode runs
    # once over everything this rank owns: owner mode balances its TP plan over the whole list,
    # and per-round calls would restart that plan from zero load each time (TP rank 0 would take
    # the largest sub-matrix of every round). The owned matrices are 1/DP of the TP-local Muon
    # weights in the NS dtype; orthogonalize_sharded bounds its own full-matrix rounds.
    rounds, owned = [], {}
    for chunk in split_rounds([lay.numel * element for lay in layouts], bucket_bytes):
        plans = [dp_owned_matrix(layouts[i], owners[i], dp_size) for i in chunk]
        exchange = OwnerExchange(plans, dp_group, dtype=ns_dtype, device=device)
        local = [
            [pieces[i].to(ns_dtype)] if any(p.rank == dp_rank for p in plan.gather) else []
            for i, plan in zip(chunk, plans)
        ]
        buffers = exchange.to_owners(local)
        owned.update({chunk[j]: buf for j, buf in buffers.items()})
        rounds.append((chunk, exchange, sorted(buffers)))
    done = _tp_orthogonalize(owned, layouts, tp_kwargs)
    del owned

    out: list[torch.Tensor | None] = [None] * len(layouts)
    for chunk, exchange, mine_here in rounds:
        back = exchange.from_owners({j: done[chunk[j]] for j in mine_here})
        for j, i in enumerate(chunk):
            start, end = layouts[i].local_range(dp_rank)
            if layouts[i].dp_ranges is None and owners[i] == dp_rank:
                mine = done[i]  # the owner of a whole-on-every-rank matrix keeps its result
            elif back[j]:
                mine = back[j][0]
            else:
                mine = torch.empty(0, dtype=ns_dtype, device=device)
            out[i] = _scaled(mine, layouts[i], start, tp_mode, scale_mode, extra_scale_factor)
    return out


def _tp_orthogonalize(owned: dict[int, torch.Tensor], layouts, tp_kwargs) -> dict[int, torch.Tensor]:
    """Flat TP-local buffers of the matrices this rank owns → flat unscaled NS results.

    TP peers own the same matrices in the same order, so one ``orthogonalize_sharded`` call over
    all their sub-matrices lines up across the TP group.
    """
    subs, pdims, counts = [], [], []
    order = sorted(owned)
    for i in order:
        layout = layouts[i]
        parts = layout.split_rows(owned[i].view(layout.local_shape))
        subs += parts
        pdims += [layout.partition_dim] * len(parts)
        counts.append(len(parts))
    results = orthogonalize_sharded(subs, pdims, **tp_kwargs)
    done, k = {}, 0
    for i, n in zip(order, counts):
        done[i] = layouts[i].join_rows(results[k : k + n]).reshape(-1)
        k += n
    return done


@functools.lru_cache(maxsize=4096)
def _row_scales(layout: MatrixLayout, blockwise: bool, scale_mode: str, extra: float, device: torch.device):
    """Per sub-matrix scales of a layout (a float when all are equal, else a per-row vector).

    Cached: layouts are frozen and fixed for a run, so the vector is built once, not per step.
    """
    shapes = layout.sub_local_shapes() if blockwise else layout.sub_global_shapes()
    scales = [muon_scale(r, c, scale_mode, extra) for r, c in shapes]
    if len(set(scales)) == 1:
        return scales[0]
    return layout.row_values(scales, device)


def _scaled(flat: torch.Tensor, layout: MatrixLayout, start: int, tp_mode: str, scale_mode: str, extra: float):
    """fp32 ``flat`` (elements [start, start+n) of the TP-local matrix) × its rows' scales."""
    out = flat.to(torch.float32)
    scale = _row_scales(layout, tp_mode == "blockwise", scale_mode, extra, out.device)
    if isinstance(scale, float):
        return out * scale
    return _scale_rows(out, start, layout.local_shape[1], scale)


def _scale_rows(flat: torch.Tensor, start: int, cols: int, row_scale: torch.Tensor) -> torch.Tensor:
    """Multiply a flat range of a row-major matrix by per-row factors, without an index tensor:
    a partial first row, whole middle rows as a (rows, cols) view, a partial last row."""
    out = flat.clone()
    pos, n = 0, flat.numel()
    row, offset = divmod(start, cols)
    if offset and n:
        head = min(n, cols - offset)
        out[:head] *= row_scale[row]
        pos, row = head, row + 1
    whole = (n - pos) // cols
    if whole:
        out[pos : pos + whole * cols].view(whole, cols).mul_(row_scale[row : row + whole, None])
        pos, row = pos + whole * cols, row + whole
    if pos < n:
        out[pos:] *= row_scale[row]
    return out
