"""The one orthogonalize step: a rank's slice of a ``StepPlan``, executed as a pipeline.

The plan (``plan.step_plan``) has decided everything: the DP owner of each matrix, the
micro-groups, each sub-matrix's TP mode and TP owner, the scales. Here a rank runs its part. One
micro-group goes through these stages; ``comm.pipelined`` runs the groups as a software pipeline,
one stage per round:

    pieces of the update (flat, on each DP rank), cut into the plan's units (fc1: gate, up)
     1 │  DP owner exchange there, async     (only pieces not already on their owner move)
       ▼
    owner holds the TP-local shard ─ split fused rows (QKV per group, fc1 gate/up)
     2 │  TP owner exchange there, async     (sub-matrices in owner mode, TP > 1)
     3 │  NS on the TP owners; TP exchange back, async; the other TP modes, blocking
       ▼
    TP-local result ─ join rows
     4 │  DP owner exchange back, async
       ▼
     5 each rank's piece of each unit, scaled per sub-matrix, joined per weight → ``apply`` (or the
       returned list)

While group k is in stage 3 (NS), groups k+1 and k+2 have their gathers in flight and groups k−1
and k−2 their returns. Which stages exist depends on the plan's settings only (a DP exchange,
a pipelined TP owner exchange), never on a rank's data, so every rank yields at the same points
and issues the same collectives in the same order.

Correctness rule: NS never runs on a fragment; every unit has exactly one DP owner, and TP
peers own the same units (the DP plan is identical on every TP rank), so they run the TP mode
together. At TP 1 a unit may instead go to a DP team (``plan.teams``): each member receives its
block of the unit in the same exchange and the team runs the distributed mode on the blocks over
its own process group, in micro-group order on every member.

What a plan needs bound to process groups (the exchanges, a team's group) is built once per plan
and groups and cached on the plan object, which lives as long as its optimizer: by ``bind`` at the
optimizer's construction (``step_setup.prepare``, which has made the team groups, checked the plan
across ranks and warmed the groups up), or else on the first call of the pure API. That first call
makes a plan's team group itself (``team_groups.make_team_groups``: a collective over the default
group, so every rank of the job must make the call) and checks the TP list across the TP group.

Pure torch + torch.distributed; no Megatron import.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import DEFAULT_COEFFICIENTS, Coefficients, NSOptions
from ..plan.exchange import dp_owned_matrix
from ..plan.step_plan import DEFAULT_BUCKET_BYTES, PlanSettings, StepPlan, build_step_plan, call_settings
from ..plan.teams import Run, team_blocks
from . import comm
from .devices import resolve_device
from .owner_exchange import OwnerExchange
from .owner_mode import OwnerMicroGroup
from .sharding import group_by
from .step_stats import ResidualProbe, measure_residuals
from .team_groups import make_team_groups, team_request
from .tp_modes import check_local_shards, run_blocking_mode, validate_across_ranks

if TYPE_CHECKING:
    from ..plan.hardware import Hardware

__all__ = ["Apply", "StepGroups", "bind", "orthogonalize_sharded", "orthogonalize_updates"]

Apply = Callable[[int, torch.Tensor, float], None]
"""``apply(i, update, scale)``: this rank's piece of matrix i's orthogonalized update is
``update × scale`` (``update`` flat, shaped like ``pieces[i]``, in the NS dtype — or fp32 already
scaled row by row, with ``scale`` 1.0, for a fused matrix whose sub-matrices scale differently)."""


@dataclass(frozen=True)
class StepGroups:
    """Where a plan runs: the process groups of its DP and TP dims, and the device of its buffers."""

    dp: object = None
    """the DP group the pieces are cut over (None: the default group, or one process)."""
    tp: object = None
    """the TP group the matrices are sharded over."""
    device: torch.device | None = None
    """where every buffer of the step lives; None = the pieces' device (they must agree), or the
    DP group's when there are none (``devices.resolve_device``). The optimizer passes its
    parameters' device, so a rank holding no piece of some matrix still allocates on the GPU."""


def orthogonalize_updates(pieces: Sequence[torch.Tensor], plan: StepPlan, groups: StepGroups = StepGroups(),
                          apply: Apply | None = None,
                          residuals: ResidualProbe | None = None) -> list[torch.Tensor] | None:
    """Scaled orthogonalized updates for this rank's pieces of every matrix of ``plan``.

    Args:
        pieces: per matrix, this DP rank's flat piece of the update (its ``local_range``; may be
            empty); any float dtype. Read, never written; read until the last group's stage 1.
        plan: the step's plan (the same on every rank of the stage).
        groups: the plan's process groups and device; their sizes must be the plan's.
        apply: called once per matrix, micro-group by micro-group as results come back (see
            ``Apply``), so a caller can update its parameters without holding every update.
        residuals: the weights whose NS output's orthogonality residual this step measures, and
            where it goes (``step_stats.measure_residuals``; a log's recording step, the same
            on every rank); None: none.

    Returns:
        without ``apply``: per matrix, an fp32 flat tensor shaped like ``pieces[i]`` (the scaled
        update; empty for an empty matrix, which needs no work and no traffic); with ``apply``: None.
    """
    dp_rank = comm.group_rank(groups.dp) if plan.dp_size > 1 else 0
    if len(pieces) != len(plan.matrices):
        raise ValueError(f"orthogonalize_updates: {len(pieces)} pieces for a plan of {len(plan.matrices)} matrices")
    for piece, layout in zip(pieces, plan.matrices):
        start, end = layout.local_range(dp_rank)
        if piece.numel() != end - start:
            raise ValueError(
                f"orthogonalize_updates: {layout.name}: piece has {piece.numel()} elements, its range "
                f"on DP rank {dp_rank} is [{start}, {end})"
            )
    return _run(pieces, plan, groups, apply, validate=True, residuals=residuals)


def _run(pieces, plan: StepPlan, groups: StepGroups, apply: Apply | None, *, validate: bool,
         residuals: ResidualProbe | None = None):
    """``orthogonalize_updates``; ``validate``: check the plan's TP list across ranks when it is
    first bound to these groups (``orthogonalize_sharded`` has checked its shards already)."""
    dp_rank = comm.group_rank(groups.dp) if plan.dp_size > 1 else 0
    device = groups.device
    if device is None:
        device = resolve_device(pieces, groups.dp, what="orthogonalize_updates: pieces")
    if plan.local_blocks is not None:
        return _run_local_blocks(pieces, plan, plan.local_blocks[dp_rank], apply)
    run = _execution(plan, groups.dp, groups.tp, device, validate)

    listed = apply is None
    out: list[torch.Tensor] = [torch.empty(0, device=device)] * (len(pieces) if listed else 0)
    if listed:

        def apply(i: int, update: torch.Tensor, scale: float) -> None:
            out[i] = update.to(torch.float32) * scale

    # A unit's piece is a slice of its weight's piece; a weight is delivered once its last unit is
    # (a weight's units share a micro-group and come back in order).
    unit_pieces = [pieces[unit.weight][lo:hi] for unit, (lo, hi) in zip(plan.units, run.unit_slices)]
    waiting: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def deliver(u: int, mine: torch.Tensor) -> None:
        i = plan.units[u].weight
        done = waiting.setdefault(i, [])
        done.append((u, mine))
        if len(done) < run.units_per_weight[i]:
            return
        del waiting[i]
        scales = [run.row_scales[v] for v, _ in done]
        if all(isinstance(x, float) for x in scales) and len(set(scales)) == 1:
            apply(i, mine if len(done) == 1 else torch.cat([m for _, m in done]), scales[0])
        else:
            apply(i, torch.cat([_scaled(run.matrices[v], m, x, dp_rank) for (v, m), x in zip(done, scales)]), 1.0)

    comm.pipelined(_task(run, g, unit_pieces, deliver, residuals) for g in run.micro_groups)
    # An empty matrix (a zero dim) is in no micro-group: its update is empty, delivered with scale 0.
    for i, layout in enumerate(plan.matrices):
        if not layout.numel:
            if listed:
                out[i] = pieces[i].new_empty(0, dtype=torch.float32)
            else:
                apply(i, pieces[i].to(plan.settings.ns.dtype), 0.0)
    return out if listed else None


def _run_local_blocks(pieces, plan: StepPlan, rounds, apply: Apply | None):
    """MuonBP's local block step: this rank's rounds of ``plan.local_blocks`` (decided at
    construction: the weights of each round, its blocks batched by shape, each block's scale),
    NS per batch, each round's updates applied before the next is built; no collective."""
    ns = plan.settings.ns
    listed = [] if apply is None else None
    for rnd in rounds:
        out = {i: pieces[i].new_zeros(pieces[i].numel(), dtype=torch.float32) for i in rnd.weights}
        for (rows, cols), items in rnd.batches:
            X = torch.stack([torch.cat([pieces[i][o:o + n] for o, n in block.runs]).view(rows, cols).to(ns.dtype)
                             for i, block, _ in items])
            comm.record_ns_flops(len(items) * ns.flops(rows, cols))
            for (i, block, scale), Y in zip(items, ns(X).unbind(0)):
                flat, at = Y.reshape(-1), 0
                for o, n in block.runs:
                    out[i][o:o + n] = flat[at:at + n].to(torch.float32) * scale
                    at += n
            del X
        for i in rnd.weights:
            if listed is None:
                apply(i, out.pop(i), 1.0)
            else:
                listed.append(out.pop(i))
    return listed


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
    ns_method: str = "standard",
    gram_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Orthogonalize matrices that ``group`` holds in TP shards; return this rank's pieces.

    The public entry for Newton–Schulz on TP shards outside an optimizer. It builds a one-off
    ``StepPlan`` (one DP rank, this TP group) and runs it through the optimizer's own step
    (``orthogonalize.orthogonalize_updates``), without scaling: one dispatcher for every mode.

    Args:
        shards: ``shards[i]`` is this rank's 2-D piece of full matrix i.
        partition_dims: the full matrix i is split evenly, in rank order of ``group``, along
            ``partition_dims[i]`` (0 or 1); ``None`` means every rank holds all of it.
        mode: one of ``TP_MODES``.
        group: a torch.distributed group (gloo/CPU or NCCL/CUDA); None = the default group,
            or a single process when torch.distributed is not initialised.
        steps, coefficients, eps: passed to ``newton_schulz``; NS runs in each shard's dtype.
        bucket_bytes: cap on the full-matrix bytes gathered per collective round
            (duplicated and owner), which bounds transient memory on large models. Owner mode
            runs its rounds as the micro-groups of a pipeline, cut finer (to about
            ``MIN_MICRO_GROUPS``) when the cap alone gives fewer (``split_micro_groups``): the
            gather of the next group and the return of the previous one are in flight while NS runs.
        full_shapes: optional global shapes to check the shards against.
        validate: check, with one small all-gather of shapes, that every rank agrees on the
            matrix list before moving data. Callers with a fixed layout may check once.
        hardware: the cost model's constants for ``auto`` (ignored by the other modes);
            None = ``hardware.hardware_profile("detect")``. Every rank of ``group`` must pass
            the same constants: the choice is made locally, without communicating.
        device: where this call's buffers live; None = the shards' device, or the group's when
            this rank has no shard (``devices.resolve_device``).
        ns_method: ``standard`` or ``gram`` (``NSOptions.method``: Gram Newton–Schulz where the
            aspect makes it cheaper; in distributed mode one Gram all-reduce per restart block).
        gram_dtype: with ``ns_method="gram"`` and half-precision shards, the dtype of the Gram
            iteration's products (``NSOptions.gram_dtype``: float16, as --muon-gram-fp16).

    Returns:
        A list with ``shards[i].shape`` and dtype per entry (an empty matrix's is empty: a
        no-op update, computed without communication). For the exact modes, the pieces
        concatenated over ranks equal ``newton_schulz`` of the full matrix up to floating-point
        reassociation (the Gram sums and batched GEMMs change the summation order).
    """
    size = comm.group_size(group)
    device = resolve_device(shards, group, what="orthogonalize_sharded: shards") if device is None else device
    subs = check_local_shards(shards, partition_dims, mode, size, steps, coefficients, full_shapes)
    if mode == "auto" and hardware is None:
        from ..plan.hardware import hardware_profile

        hardware = hardware_profile("detect")
    if validate and size > 1 and mode != "blockwise":
        validate_across_ranks(subs, mode, steps, size, group, device, hardware if mode == "auto" else None,
                              dtypes=[x.dtype for x in shards])
    # An empty matrix (a zero dim) has an empty update: answered here, so that no mode, cost
    # model or exchange ever sees a zero-size matrix. Every rank drops the same ones (the shapes
    # were just checked to agree), so the collectives below still line up.
    out = [x.clone() if not (s.local_shape[0] and s.local_shape[1]) else None for x, s in zip(shards, subs)]
    work = [i for i, x in enumerate(out) if x is None]
    # One plan per dtype (first-seen order, the same on every rank): NS runs in each shard's dtype.
    for dtype, members in group_by(work, lambda i: shards[i].dtype).items():
        ns = NSOptions(steps, coefficients, eps, dtype, method=ns_method, gram_dtype=gram_dtype)
        settings = call_settings(mode, ns, hardware, bucket_bytes)
        plan = _one_off_plan(tuple(subs[i] for i in members), size, settings)

        def put(k: int, update: torch.Tensor, scale: float, members=members) -> None:
            out[members[k]] = update.view(subs[members[k]].local_shape)

        _run([shards[i].reshape(-1) for i in members], plan, StepGroups(None, group, device), put, validate=False)
    return out


@functools.lru_cache(maxsize=64)
def _one_off_plan(subs: tuple[MatrixLayout, ...], size: int, settings: PlanSettings):
    """The plan of one ``orthogonalize_sharded`` call, cached: a caller with a fixed layout gets the
    same plan (and its bound exchanges) every call. Pure: it holds no process group."""
    return build_step_plan(subs, dp_size=1, tp_size=size, settings=settings)


# ---- a plan bound to process groups ----------------------------------------------------------------


class _MicroGroup:
    """One micro-group as this rank runs it; built once per plan and groups (no tensors)."""

    def __init__(self, members: tuple[int, ...]) -> None:
        self.members = members
        """matrix indices, consecutive."""
        self.exchange: OwnerExchange | None = None
        """the DP owner exchange of the members (None when the step has none)."""
        self.entries: list[int] = []
        """per owned matrix of the exchange, its unit: a unit with one DP owner is one entry, a
        team's unit one entry per block (member order)."""
        self.runs: list[tuple[Run, ...] | None] = []
        """per entry: None for a unit with one DP owner, else where this rank's pieces of that
        team block lie in its piece of the unit (in gather order; empty where it holds none)."""
        self.holds: list[bool] = []
        self.entry_of: dict[int, int] = {}
        """a one-owner unit's only entry (a team unit's entries are found through ``runs``)."""
        """per entry of a one-owner unit: this rank sends the owner a piece of it."""
        self.broadcast: list[int] = []
        """member positions held whole on every DP rank: their owner broadcasts the result."""
        self.owned: list[int] = []
        """the members whose TP-local matrix (or team block) this rank, with its TP peers (or its
        team), orthogonalizes."""
        self.owner_positions: list[int] = []
        """sub-matrix positions (``OwnerWork.subs``) that run in the pipelined TP owner exchange."""
        self.owner_micro_group: OwnerMicroGroup | None = None
        self.blocking: list[tuple[str, list[int]]] = []
        """(TP mode, positions) run in that mode's own, blocking implementation, in this order."""


class _Execution:
    """``plan`` bound to this rank's process groups and device."""

    def __init__(self, plan: StepPlan, dp_group, tp_group, device: torch.device, validate: bool,
                 team_group=None) -> None:
        # A plan with one DP rank never talks over DP: no group (None) means no DP dim at all.
        dp_size = comm.group_size(dp_group) if dp_group is not None or plan.dp_size > 1 else 1
        tp_size = comm.group_size(tp_group)
        if (dp_size, tp_size) != (plan.dp_size, plan.tp_size):
            raise ValueError(f"orthogonalize_updates: the plan is for DP {plan.dp_size} x TP {plan.tp_size}, the "
                             f"groups are DP {dp_size} x TP {tp_size}")
        settings = plan.settings
        # No reference to the plan itself: it is the weak key this execution is cached under.
        # Everything here is per unit (``plan.units``): the exchanges move units, NS runs on them.
        self.matrices = tuple(unit.layout for unit in plan.units)
        self.dp_owners, self.exchanges_dp = plan.dp_owners, plan.exchanges_dp
        self.unit_weight = tuple(unit.weight for unit in plan.units)
        self.units_per_weight = [0] * len(plan.matrices)
        for unit in plan.units:
            self.units_per_weight[unit.weight] += 1
        self.dp_rank = comm.group_rank(dp_group) if dp_size > 1 else 0
        self.unit_slices = [unit.slice_of(plan.matrices[unit.weight].local_range(self.dp_rank)) for unit in plan.units]
        """per unit, [lo, hi) of this DP rank's piece of its weight that the unit's piece is."""
        self.tp_group, self.device = tp_group, device
        self.dtype, self.ns, self.bucket_bytes = settings.ns.dtype, settings.ns, settings.bucket_bytes
        self.block_grid = settings.block_grid
        self.tp_rank = comm.group_rank(tp_group)
        self.work = plan.work[self.dp_rank]
        self.teams = plan.teams
        self.team_group = team_group
        """this rank's team's process group (``step_setup`` made it at construction; unprepared, here)."""
        if plan.teams is not None and team_group is None:
            (self.team_group,) = make_team_groups([team_request(plan, dp_group)])
        # A configuration property, the same on every rank: every rank's tasks have the same stages.
        self.tp_async = settings.tp_mode in ("owner", "auto") and tp_size > 1
        self.micro_groups = [_MicroGroup(members) for members in plan.micro_groups]
        work = self.work
        for g in self.micro_groups:
            if plan.exchanges_dp:
                routes = []
                for u in g.members:
                    if plan.team_of(u) is None:
                        routes.append(dp_owned_matrix(self.matrices[u], plan.dp_owners[u], dp_size))
                        g.entries.append(u)
                        g.runs.append(None)
                        continue
                    for block in team_blocks(self.matrices[u], plan.team_size, plan.team_of(u) * plan.team_size):
                        routes.append(block.owned)
                        g.entries.append(u)
                        g.runs.append(tuple(r for p, r in zip(block.owned.gather, block.runs)
                                            if p.rank == self.dp_rank))
                g.exchange = OwnerExchange(routes, dp_group, dtype=self.dtype, device=device)
                g.entry_of = {u: e for e, (u, runs) in enumerate(zip(g.entries, g.runs)) if runs is None}
                g.holds = [any(p.rank == self.dp_rank for p in route.gather) for route in routes]
                g.owned = [g.entries[e] for e in g.exchange.owned]
                g.broadcast = [j for j, u in enumerate(g.members) if self.matrices[u].dp_ranges is None]
            else:
                g.owned = list(g.members)
            positions = [p for i in g.owned for p in work.sub_positions[i]]
            owners = [p for p in positions if work.modes[p] == "owner"]
            # Without the pipelined exchange, the heads of TP's row cut (``MatrixLayout.tp_rows``, owner
            # mode in every mode) still run the owner exchange, blocking (``_task``): the positions
            # come from the plan, the same on every TP peer.
            if self.tp_async or (tp_size > 1 and owners):
                g.owner_positions = owners
                g.owner_micro_group = OwnerMicroGroup([work.subs[p] for p in g.owner_positions],
                                                      [work.tp_owners[p] for p in g.owner_positions], self.dtype,
                                                      tp_group, self.tp_rank, device)
            for mode in ("owner", "duplicated", "distributed", "blockwise", "team"):
                chosen = [p for p in positions if work.modes[p] == mode and p not in g.owner_positions]
                if chosen:
                    g.blocking.append((mode, chosen))
        self.row_scales = [_row_scales(lay, scales, device, self.tp_rank)
                           for lay, scales in zip(self.matrices, plan.scales)]
        if validate and tp_size > 1 and settings.tp_mode != "blockwise":
            validate_across_ranks(work.subs, settings.tp_mode, settings.ns.steps, tp_size, tp_group, device,
                                  settings.hardware if settings.tp_mode == "auto" else None,
                                  dtypes=[self.dtype] * len(work.subs))

    def run_blocking(self, g: _MicroGroup, subs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The sub-matrices of ``g`` outside the pipelined owner exchange, mode by mode."""
        done = {}
        for mode, positions in g.blocking:
            # a team's blocks: the distributed mode over the team, as a TP group runs it on shards
            group, mode = (self.team_group, "distributed") if mode == "team" else (self.tp_group, mode)
            results = run_blocking_mode(mode, [subs[p] for p in positions], [self.work.subs[p] for p in positions],
                                        group, self.ns, self.bucket_bytes, self.block_grid,
                                        [self.work.tp_owners[p] for p in positions])
            done.update(zip(positions, results))
        return done

    def sources(self, g: _MicroGroup, pieces, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """Per entry of ``g``'s exchange, this rank's pieces to send: its whole piece of a unit
        with one DP owner, the runs of a team block (strided views, copied once into the send
        buffer)."""
        cast: dict[int, torch.Tensor] = {}  # one cast per unit, however many blocks it feeds
        out = []
        for u, runs, held in zip(g.entries, g.runs, g.holds):
            if runs is None:
                out.append([pieces[u].to(dtype)] if held else [])
            else:
                mine = cast.setdefault(u, pieces[u].to(dtype).contiguous())
                out.append([_run_view(mine, r) for r in runs])
        return out

    def team_piece(self, g: _MicroGroup, u: int, got: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """This rank's piece of team unit ``u`` from its blocks' returns (each run written into
        its strided place)."""
        lo, hi = self.unit_slices[u]
        mine = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
        for e, (v, runs) in enumerate(zip(g.entries, g.runs)):
            if v == u:
                for r, t in zip(runs, got.get(e, ())):
                    _run_view(mine, r).copy_(t.view(r.rows, r.cols))
        return mine


_EXECUTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""plan → {(dp group, tp group, device): _Execution}: dies with the plan (and its optimizer), so
the process groups an execution holds are released with it (no execution refers to its plan)."""


def _execution(plan: StepPlan, dp_group, tp_group, device: torch.device, validate: bool) -> _Execution:
    bound = _EXECUTIONS.setdefault(plan, {})
    key = (dp_group, tp_group, device)
    if key not in bound:
        bound[key] = _Execution(plan, dp_group, tp_group, device, validate)
    return bound[key]


def bind(plan: StepPlan, groups: StepGroups, team_group=None) -> None:
    """Bind ``plan`` to ``groups`` now (its exchanges, its team's group ``team_group``), so that
    its first ``orthogonalize_updates`` with these groups makes nothing and checks nothing: the
    optimizer's construction does it (``step_setup.prepare``) after checking the plan across the
    DP and TP groups, which supersedes the first call's TP shape check. ``groups.device`` must be
    set, as the step's own ``StepGroups``. A plan of local blocks is never bound (no collective)."""
    if groups.device is None:
        raise ValueError("bind: groups.device must be set (the step's device)")
    if plan.local_blocks is not None:
        return
    key = (groups.dp, groups.tp, groups.device)
    bound = _EXECUTIONS.setdefault(plan, {})
    if key not in bound:
        bound[key] = _Execution(plan, groups.dp, groups.tp, groups.device, validate=False, team_group=team_group)


def _task(run: _Execution, g: _MicroGroup, pieces, deliver, residuals: ResidualProbe | None = None):
    """One micro-group through the stages of the module docstring; yields after each issue.

    Each buffer is dropped (``del``) as soon as its stage is done: a generator keeps its locals
    alive across yields, and up to five groups are live at once.
    """
    layouts, dtype, work = run.matrices, run.dtype, run.work
    if run.exchanges_dp:
        there = g.exchange.start_to_owners(run.sources(g, pieces, dtype))
        yield
        got = there.wait()
        del there
        # a rank owns a unit whole, or one block of a team's unit: never two entries of one unit
        owned = {g.entries[e]: g.exchange.assemble(e, got[e]) for e in g.exchange.owned}
        del got
    else:
        owned = {i: pieces[i].to(dtype) for i in g.owned}
    subs = {}
    for i, flat in owned.items():
        if run.teams is not None and run.teams[i] is not None:  # this rank's block
            p = work.sub_positions[i][0]
            subs[p] = flat.view(work.subs[p].local_shape)
            continue
        subs.update(zip(work.sub_positions[i], layouts[i].split_rows(flat.view(layouts[i].local_shape), run.tp_rank)))
    del owned

    if run.tp_async:
        there = g.owner_micro_group.start([subs[p] for p in g.owner_positions])
        yield
        results = g.owner_micro_group.compute(there.wait(), run.ns)
        del there
        back = g.owner_micro_group.start_back(results)
        done = run.run_blocking(g, subs)  # overlaps the return just issued
        del subs
        if residuals is not None:
            measure_residuals(residuals, work, g.owned, run.unit_weight, run.teams, done, g.owner_positions, results,
                              run.tp_group, run.tp_rank, run.block_grid)
        yield
        done.update(zip(g.owner_positions, g.owner_micro_group.finish(back.wait(), results)))
        del back, results
    else:
        results = {}
        if g.owner_micro_group is not None:  # heads of TP's row cut: the owner exchange, blocking
            owner = g.owner_micro_group
            results = owner.compute(owner.start([subs[p] for p in g.owner_positions]).wait(), run.ns)
            back = owner.start_back(results)
        done = run.run_blocking(g, subs)  # overlaps the return just issued
        del subs
        if g.owner_micro_group is not None:
            done.update(zip(g.owner_positions, g.owner_micro_group.finish(back.wait(), results)))
            del back
        if residuals is not None:
            measure_residuals(residuals, work, g.owned, run.unit_weight, run.teams, done, g.owner_positions, results,
                              run.tp_group, run.tp_rank, run.block_grid)
        del results
    joined = {}
    for i in g.owned:
        parts = [done.pop(p) for p in work.sub_positions[i]]
        joined[i] = parts[0].reshape(-1) if len(parts) == 1 else layouts[i].join_rows(parts).reshape(-1)
        del parts
    del done

    if not run.exchanges_dp:
        for i in g.members:
            deliver(i, joined.pop(i))
        return
    back = g.exchange.start_from_owners({e: joined[g.entries[e]] for e in g.exchange.owned})
    # A unit whole on every DP rank comes back by one broadcast from its owner, in member order
    # on every rank (sizes from the plan): the owner's result, the others' receive buffers.
    casts = {}
    for j in g.broadcast:
        i = g.members[j]
        owner = run.dp_owners[i]
        buffer = joined[i] if owner == run.dp_rank else torch.empty(layouts[i].numel, dtype=dtype, device=run.device)
        casts[j] = (buffer, comm.broadcast_async(buffer, owner, g.exchange.group))
    yield
    got = back.wait()
    del back
    for j, i in enumerate(g.members):
        if j in casts:
            mine, pending = casts.pop(j)
            pending.wait()
        elif run.teams is not None and run.teams[i] is not None:
            mine = run.team_piece(g, i, got)
        elif got.get(g.entry_of[i]):
            mine = got[g.entry_of[i]][0]
        else:
            mine = torch.empty(0, dtype=dtype, device=run.device)
        deliver(i, mine)


def _run_view(piece: torch.Tensor, r: Run) -> torch.Tensor:
    """The ``(rows, cols)`` strided view of flat ``piece`` that run ``r`` names."""
    if r.rows == 1:
        return piece[r.start : r.start + r.cols].view(1, r.cols)
    return piece[r.start : r.start + (r.rows - 1) * r.stride + r.cols].as_strided(
        (r.rows, r.cols), (r.stride, 1))


def _scaled(layout: MatrixLayout, mine: torch.Tensor, scale: float | torch.Tensor, dp_rank: int) -> torch.Tensor:
    """fp32 ``mine`` (this DP rank's piece of a unit) times its scale: a float, or per row."""
    if isinstance(scale, float):
        return mine.to(torch.float32) * scale
    return _scale_rows(mine, layout.local_range(dp_rank)[0], layout.local_shape[1], scale)


def _row_scales(layout: MatrixLayout, scales: tuple[float, ...], device: torch.device,
                tp_rank: int) -> float | torch.Tensor:
    """A matrix's scale: a float when its sub-matrices agree, else a per-row vector of this TP
    rank's rows (built once)."""
    if len(set(scales)) == 1:
        return scales[0]
    return layout.row_values(list(scales), device, tp_rank)


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
