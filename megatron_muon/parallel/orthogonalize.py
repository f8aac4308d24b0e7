"""The one orthogonalize step of the optimizer: DP owner exchange around a TP mode, pipelined.

One micro-group (consecutive matrices, at most ``bucket_bytes`` of full matrices) goes through
these stages; ``comm.pipelined`` runs the groups as a software pipeline, one stage per round:

    pieces of the update (flat, on each DP rank)
     1 │  DP owner exchange there, async     (only pieces not already on their owner move)
       ▼
    owner holds the TP-local shard ─ split fused rows (QKV per group, fc1 gate/up)
     2 │  TP owner exchange there, async     (owner / auto's owner part, TP > 1)
     3 │  NS on the TP owners; TP exchange back, async; the other TP modes, blocking
       ▼
    TP-local result ─ join rows
     4 │  DP owner exchange back, async
       ▼
     5 each rank's piece, scaled per sub-matrix (global shape) → ``apply`` (or the returned list)

While group k is in stage 3 (NS), groups k+1 and k+2 have their gathers in flight and groups k−1
and k−2 their returns. A stage whose exchange does not exist in the configuration (DP = 1, a TP
mode without an owner exchange) is not a stage: fewer groups live at once, less memory.

Correctness rule: NS never runs on a fragment. Every matrix has exactly one DP owner, chosen by
``plan_dp_owners`` identically on every rank (and so on every TP peer: TP peers own the same
matrices, which lets them run the TP mode together). The TP plan (owner mode's owners, auto's
modes) is made once over *everything* a DP owner holds, then executed by micro-groups, so the
FLOPs and bytes per rank are those of one call over the whole list (``step_plan`` replays it).
Everything that depends only on the layouts (groups, exchanges, TP plan) is built once and cached.

Pure torch + torch.distributed; no Megatron import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import DEFAULT_COEFFICIENTS
from ..core.scaling import muon_scale
from . import comm, owner_exchange
from .devices import resolve_device
from .owner_exchange import OwnedMatrix, OwnerExchange, Piece, split_micro_groups
from .owner_mode import owner_groups
from .planner import plan_owners
from .sharding import ShardSpec
from .tp_modes import DEFAULT_BUCKET_BYTES, check_call, orthogonalize_sharded, validate_across_ranks

__all__ = ["DP_MODES", "dp_owned_matrix", "orthogonalize_updates", "plan_dp_owners"]

DP_MODES = ("owner", "redundant")

Apply = Callable[[int, torch.Tensor, float], None]
"""``apply(i, update, scale)``: this rank's piece of matrix i's orthogonalized update is
``update × scale`` (``update`` flat, shaped like ``pieces[i]``, in the NS dtype — or fp32 already
scaled row by row, with ``scale`` 1.0, for a fused matrix whose sub-matrices scale differently)."""


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
    apply: Apply | None = None,
) -> list[torch.Tensor] | None:
    """Scaled orthogonalized updates for this rank's pieces of every matrix.

    Args:
        pieces: per matrix, this DP rank's flat piece of the update (its ``local_range``; may be
            empty); any float dtype. Read, never written; read until the last group's stage 1.
        layouts: per matrix, where its pieces live (identical on every rank of the DP group and,
            for the same parameter, on every TP peer).
        tp_mode: ``orthogonalize_sharded`` mode across ``tp_group``.
        dp_mode: ``owner`` (NS on the DP owner, result exchanged) or ``redundant`` (plain DDP
            only: every DP rank computes every matrix, no DP traffic; for comparison).
        owners: DP owner per matrix; default ``plan_dp_owners``.
        ns_dtype: dtype of the exchange and of NS (bf16 halves the bytes at no loss, since NS
            casts to it anyway).
        scale_mode, extra_scale_factor: ``scaling.muon_scale`` on each sub-matrix's global shape
            (its local shape in blockwise mode, as Megatron does).
        bucket_bytes: cap on the full-matrix bytes of one micro-group, at both levels (the DP
            exchange and the TP owner exchange): with the pipeline's few live groups it bounds
            the step's extra memory (``owner_exchange.split_micro_groups``).
        hardware: ``cost_model.Hardware`` for ``tp_mode="auto"`` (see ``orthogonalize_sharded``).
        device: where every buffer of the step lives; None = the pieces' device (they must agree),
            or the DP group's when there are none (``devices.resolve_device``). The optimizer
            passes its parameters' device, so a rank holding no piece of some matrix (empty
            pieces) still allocates on the GPU.
        apply: called once per matrix, micro-group by micro-group as results come back (see
            ``Apply``), so a caller can update its parameters without holding every update.

    Returns:
        without ``apply``: per matrix, an fp32 flat tensor shaped like ``pieces[i]`` (the
        scaled update; empty for an empty matrix, which needs no work and no traffic); with
        ``apply``: None.
    """
    if dp_mode not in DP_MODES:
        raise ValueError(f"--muon-dp-mode: expected one of {DP_MODES}, got {dp_mode!r}")
    dp_size, dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
    check_call(tp_mode, comm.group_size(tp_group), steps, coefficients)
    for piece, layout in zip(pieces, layouts, strict=True):
        start, end = layout.local_range(dp_rank)
        if piece.numel() != end - start:
            raise ValueError(
                f"orthogonalize_updates: {layout.name}: piece has {piece.numel()} elements, its range "
                f"on DP rank {dp_rank} is [{start}, {end})"
            )
    if any(lay.numel == 0 for lay in layouts):
        return _skip_empty(pieces, layouts, owners, apply, dict(
            tp_mode=tp_mode, dp_group=dp_group, tp_group=tp_group, dp_mode=dp_mode, steps=steps,
            coefficients=coefficients, eps=eps, ns_dtype=ns_dtype, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor, bucket_bytes=bucket_bytes, validate=validate,
            hardware=hardware, device=device))
    if dp_mode == "redundant" and dp_size > 1:
        cut = [lay.name for lay in layouts if lay.dp_ranges is not None]
        if cut:
            raise ValueError(
                f"--muon-dp-mode redundant needs every DP rank to hold whole matrices (no "
                f"--use-distributed-optimizer); {cut[0]} is split across DP ranks"
            )
    if device is None:
        device = resolve_device(pieces, dp_group, what="orthogonalize_updates: pieces")
    if tp_mode == "auto" and hardware is None:
        from .auto_mode import hardware_profile

        hardware = hardware_profile("detect")
    if dp_mode == "owner" and dp_size > 1 and owners is None:
        owners = plan_dp_owners(layouts, dp_size, steps)
    plan = _plan(tuple(layouts), tuple(owners) if owners is not None else None, dp_mode, tp_mode, dp_group,
                 tp_group, ns_dtype, bucket_bytes, owner_exchange.MIN_MICRO_GROUPS, steps,
                 hardware if tp_mode == "auto" else None, device)
    if validate and plan.tp_size > 1 and tp_mode != "blockwise":
        validate_across_ranks(plan.tp_specs, tp_mode, steps, plan.tp_size, tp_group, device,
                              hardware if tp_mode == "auto" else None)

    listed = apply is None
    out: list[torch.Tensor] = [torch.empty(0, device=device)] * (len(layouts) if listed else 0)
    if listed:

        def apply(i: int, update: torch.Tensor, scale: float) -> None:
            out[i] = update.to(torch.float32) * scale

    def deliver(i: int, mine: torch.Tensor) -> None:
        layout = layouts[i]
        scale = _row_scales(layout, tp_mode == "blockwise", scale_mode, extra_scale_factor, device)
        if isinstance(scale, float):
            apply(i, mine, scale)
        else:
            apply(i, _scale_rows(mine, layout.local_range(dp_rank)[0], layout.local_shape[1], scale), 1.0)

    ns_kwargs = dict(steps=steps, coefficients=coefficients, eps=eps)
    comm.pipelined(_task(plan, g, pieces, deliver, ns_kwargs) for g in plan.groups)
    return out if listed else None


def _skip_empty(pieces, layouts, owners, apply, kwargs) -> list[torch.Tensor] | None:
    """``orthogonalize_updates`` with the empty matrices (a zero dim) taken out: their update
    is empty, delivered here with scale 0; the others run as one call. Every rank holds the same
    layouts, so every rank takes out the same ones and the collectives of the call line up; no
    plan, exchange, cost model or TP mode ever sees a zero-size matrix."""
    keep = [i for i, lay in enumerate(layouts) if lay.numel]
    inner_apply = None if apply is None else (lambda j, update, scale: apply(keep[j], update, scale))
    done = orthogonalize_updates([pieces[i] for i in keep], [layouts[i] for i in keep],
                                 owners=None if owners is None else [owners[i] for i in keep],
                                 apply=inner_apply, **kwargs)
    if apply is not None:
        for i, lay in enumerate(layouts):
            if not lay.numel:
                apply(i, pieces[i].to(kwargs["ns_dtype"]), 0.0)
        return None
    out = [pieces[i].new_empty(0, dtype=torch.float32) for i in range(len(layouts))]
    for j, i in enumerate(keep):
        out[i] = done[j]
    return out


class _Group:
    """One micro-group as this rank runs it; built once per layout (no tensors)."""

    def __init__(self, members: list[int]) -> None:
        self.members = members
        """matrix indices, consecutive."""
        self.exchange: OwnerExchange | None = None
        """the DP owner exchange of the members (None when the step has none)."""
        self.holds: list[bool] = []
        """per member: this rank sends the owner a piece of it."""
        self.owned: list[int] = []
        """the members whose TP-local matrix this rank (with its TP peers) orthogonalizes."""
        self.subs: dict[int, list[int]] = {}
        """owned matrix → positions of its sub-matrices in the TP list (``_Plan.tp_specs``)."""
        self.owner_positions: list[int] = []
        """positions that run in the pipelined owner exchange (``owner_group``)."""
        self.owner_group = None
        self.blocking: list[tuple[str, list[int]]] = []
        """(TP mode, positions) run in that mode's own, blocking implementation, in this order."""


class _Plan:
    """Everything in a step that depends only on the layouts, for this rank."""

    def __init__(self, layouts, owners, dp_mode, tp_mode, dp_group, tp_group, ns_dtype, bucket_bytes, min_groups,
                 steps, hardware, device) -> None:
        self.layouts, self.owners, self.tp_mode, self.ns_dtype, self.device = layouts, owners, tp_mode, ns_dtype, device
        self.tp_group, self.bucket_bytes, self.hardware = tp_group, bucket_bytes, hardware
        self.dp_size, self.dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
        self.tp_size, self.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.exchange_dp = dp_mode == "owner" and self.dp_size > 1
        self.tp_async = tp_mode in ("owner", "auto") and self.tp_size > 1
        element = ns_dtype.itemsize
        # Groups are cut on full-matrix bytes: the TP owner holds whole matrices, and a full
        # matrix is at least the TP-local shard the DP exchange moves, so one cap bounds both.
        full_bytes = [lay.numel * element * (lay.tp_size if lay.partition_dim is not None else 1) for lay in layouts]
        self.groups = [_Group(chunk) for chunk in split_micro_groups(full_bytes, bucket_bytes, min_groups)]

        specs: list[ShardSpec] = []
        for g in self.groups:
            if self.exchange_dp:
                plans = [dp_owned_matrix(layouts[i], owners[i], self.dp_size) for i in g.members]
                g.exchange = OwnerExchange(plans, dp_group, dtype=ns_dtype, device=device)
                g.holds = [any(p.rank == self.dp_rank for p in plan.gather) for plan in plans]
                g.owned = [g.members[j] for j in g.exchange.owned]
            else:
                g.owned = list(g.members)
            for i in g.owned:
                shapes = layouts[i].sub_local_shapes()
                g.subs[i] = list(range(len(specs), len(specs) + len(shapes)))
                specs += [ShardSpec(len(specs) + k, shape, layouts[i].partition_dim, self.tp_size)
                          for k, shape in enumerate(shapes)]
        self.tp_specs = specs
        modes = self._tp_modes(specs, steps, element)
        owner_specs: list[ShardSpec] = []
        members: list[tuple[int, ...]] = []
        for g in self.groups:
            positions = [p for i in g.owned for p in g.subs[i]]
            if self.tp_async:
                g.owner_positions = [p for p in positions if modes[p] == "owner"]
                members.append(tuple(range(len(owner_specs), len(owner_specs) + len(g.owner_positions))))
                owner_specs += [ShardSpec(len(owner_specs) + k, specs[p].local_shape, specs[p].partition_dim,
                                          self.tp_size) for k, p in enumerate(g.owner_positions)]
            for mode in ("owner", "duplicated", "distributed", "blockwise"):
                chosen = [p for p in positions if modes[p] == mode and p not in g.owner_positions]
                if chosen:
                    g.blocking.append((mode, chosen))
        if self.tp_async:
            # One owner plan over everything this DP rank owns, executed by micro-groups.
            cut = owner_groups(tuple(owner_specs), (ns_dtype,) * len(owner_specs), tuple(members), tp_group,
                               self.tp_size, self.tp_rank, steps, bucket_bytes, min_groups, device)
            for g, (_, owner_group) in zip(self.groups, cut, strict=True):
                g.owner_group = owner_group

    def _tp_modes(self, specs: list[ShardSpec], steps: int, element: int) -> list[str]:
        """The TP mode of each sub-matrix: auto chooses over the whole list, as one call would."""
        if self.tp_mode != "auto" or not specs:
            return [self.tp_mode] * len(specs)
        from .auto_mode import choose_tp_modes
        from .cost_model import Matrix

        return choose_tp_modes([Matrix(*s.full_shape, s.partition_dim) for s in specs], self.tp_size,
                               self.hardware, steps=steps, dtype_bytes=element)

    def run_blocking(self, g: _Group, subs: dict[int, torch.Tensor], ns_kwargs) -> dict[int, torch.Tensor]:
        """The sub-matrices of ``g`` outside the pipelined owner exchange, mode by mode."""
        done = {}
        for mode, positions in g.blocking:
            results = orthogonalize_sharded(
                [subs[p] for p in positions], [self.tp_specs[p].partition_dim for p in positions], mode=mode,
                group=self.tp_group, bucket_bytes=self.bucket_bytes, validate=False, hardware=self.hardware,
                device=self.device, **ns_kwargs)
            done.update(zip(positions, results))
        return done


@functools.lru_cache(maxsize=16)
def _plan(*key) -> _Plan:
    """The plan of a step, cached on everything it depends on (layouts are frozen and fixed for a
    run; a MuonBP run alternates two entries, its full and its block steps)."""
    return _Plan(*key)


def _task(plan: _Plan, g: _Group, pieces, deliver, ns_kwargs):
    """One micro-group through the stages of the module docstring; yields after each issue.

    The stages present depend only on the configuration (DP exchange or not, pipelined TP owner
    exchange or not), never on this rank's data, so every rank yields at the same points. Each
    buffer is dropped (``del``) as soon as its stage is done: a generator keeps its locals alive
    across yields, and up to five groups are live at once.
    """
    layouts, dtype = plan.layouts, plan.ns_dtype
    if plan.exchange_dp:
        there = g.exchange.start_to_owners(
            [[pieces[i].to(dtype)] if held else [] for i, held in zip(g.members, g.holds)])
        yield
        got = there.wait()
        del there
        owned = {g.members[j]: g.exchange.assemble(j, got[j]) for j in g.exchange.owned}
        del got
    else:
        owned = {i: pieces[i].to(dtype) for i in g.owned}
    subs = {}
    for i, flat in owned.items():
        subs.update(zip(g.subs[i], layouts[i].split_rows(flat.view(layouts[i].local_shape))))
    del owned

    if plan.tp_async:
        there = g.owner_group.start([subs[p] for p in g.owner_positions])
        yield
        results = g.owner_group.compute(there.wait(), **ns_kwargs)
        del there
        back = g.owner_group.start_back(results)
        done = plan.run_blocking(g, subs, ns_kwargs)  # overlaps the return just issued
        del subs
        yield
        done.update(zip(g.owner_positions, g.owner_group.finish(back.wait(), results)))
        del back, results
    else:
        done = plan.run_blocking(g, subs, ns_kwargs)
        del subs
    joined = {}
    for i in g.owned:
        parts = [done.pop(p) for p in g.subs[i]]
        joined[i] = parts[0].reshape(-1) if len(parts) == 1 else layouts[i].join_rows(parts).reshape(-1)
        del parts
    del done

    if not plan.exchange_dp:
        for i in g.members:
            deliver(i, joined.pop(i))
        return
    back = g.exchange.start_from_owners({j: joined[g.members[j]] for j in g.exchange.owned})
    yield
    got = back.wait()
    del back
    for j, i in enumerate(g.members):
        if layouts[i].dp_ranges is None and plan.owners[i] == plan.dp_rank:
            mine = joined[i]  # the owner of a whole-on-every-rank matrix keeps its result
        elif got.get(j):
            mine = got[j][0]
        else:
            mine = torch.empty(0, dtype=dtype, device=plan.device)
        deliver(i, mine)


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


def _scale_rows(flat: torch.Tensor, start: int, cols: int, row_scale: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``flat`` (elements [start, start+n) of a row-major matrix) × per-row factors,
    without an index tensor: a partial first row, whole middle rows as a (rows, cols) view, a
    partial last row."""
    out = flat.to(torch.float32, copy=True)
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
