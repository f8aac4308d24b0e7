"""``auto``'s plan: where each matrix's Newton–Schulz runs on a stage's TP × DP grid, and on how many ranks.

Pure (no torch.distributed): every rank computes the same schedule from the same shapes.

Each sub-matrix is a *malleable* task on its DP owner's TP group of t ranks. It runs either
*narrow*, on one rank (``owner`` mode: its shards travel to that rank by the owner exchange; a
replicated matrix, held whole by every rank, in ``duplicated`` mode, its result broadcast), or
*wide*, on all t ranks of the group (``distributed``: the Gram all-reduced, B's rows split; or
``duplicated``: gathered, every rank runs it; whichever the cost model predicts faster). A unit
(``units.Unit``: a weight, or fc1's gate or up) goes whole to one DP group, the DP owner exchange
bringing its pieces there. The schedule minimizes the predicted makespan of the busiest rank, in
seconds on ``hardware`` (NS, its TP collectives and the unit's DP exchange), in two phases:

    1. allotment  every sub-matrix that costs the group no more rank-seconds wide than narrow runs
                  wide (``free_to_widen``), and for each threshold θ among the narrow times (and
                  θ = ∞) so does every one whose narrow time is ≥ θ; the rest run narrow (one more
                  candidate: all narrow). Same shapes therefore always share a width (and batch
                  together in their mode).
    2. placement  list scheduling, the pinned units first, then longest first (Graham's LPT,
                  against the loads the pins fix, as ``owners.plan_owners``): each unit goes to the DP group
                  where the busiest of its ranks ends earliest (a pinned unit to its pin; a cut
                  unit to the holder of its largest piece unless that ends later than both the
                  current makespan and the best group), its wide sub-matrices on every rank of
                  the group, its narrow ones each on the group's least-loaded rank.

The allotment with the smallest makespan wins (ties: the larger θ, fewer collectives).

At TP 1 a TP group has no second rank, so ``team`` > 1 regroups the DP ranks into teams of
``team`` consecutive ranks (``teams.team_size``: one node's worth) and schedules on those: a
group is a team, narrow is one member (the unit's DP owner), wide is the whole team running the
distributed mode on the unit's blocks (``teams.team_layout``; only a unit a team can take).
The same two phases balance DeepSeek-V3's dense stage at TP1 × DP64, whose 7168 × 18432
matrices would otherwise each sit whole on one of 64 ranks.

A per-matrix choice, as ``auto`` made before, cannot see that 21 whole 53248 × 16384 fc1 halves on
a 512-rank stage (Llama-3 405B, TP8 × PP16 × DP64) leave one rank 330 TFLOP while most idle:
here each runs on its own TP group, 41 TFLOP per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions
from .hardware import Hardware
from .pricing import Link, Widths, dp_exchange, moved_s, team_widths, widths
from .topology import Topology

__all__ = ["GridSchedule", "schedule_grid"]


@dataclass(frozen=True)
class GridSchedule:
    """Per unit: its DP group, and per sub-matrix its TP mode and (narrow) TP rank."""

    dp_owners: tuple[int, ...]
    modes: tuple[tuple[str, ...], ...]
    """per unit, per sub-matrix: ``owner`` (narrow), ``distributed`` or ``duplicated`` (wide); with
    teams one entry per unit, ``owner`` or ``team``."""
    tp_owners: tuple[tuple[int | None, ...], ...]
    """per unit, per sub-matrix: the TP rank (with teams: the member) of a narrow one, None for a
    wide one."""
    makespan_s: float
    """predicted seconds of the busiest rank."""
    ns_makespan_s: float
    """the same without the DP exchange: Newton–Schulz and its TP collectives."""


def schedule_grid(units: Sequence[MatrixLayout], dp_size: int, tp_size: int, hw: Hardware, ns: NSOptions, *,
                  pinned: Mapping[int, int] | None = None, prefer: Sequence[int | None] | None = None, team: int = 1,
                  topology: Topology | None = None) -> GridSchedule:
    """The schedule of the module docstring.

    Args:
        units: per unit, its layout (``units.Unit.layout``): TP split, fused rows, and DP ranges
            when the distributed optimizer cuts it (what the DP exchange must move).
        dp_size: DP groups to place on (1: no DP exchange; every unit runs on group 0).
        tp_size: ranks of each TP group.
        hw: the cost model's constants.
        pinned: unit → DP group it must go to (it lies whole there).
        prefer: per unit, a DP group to take unless it ends later (the holder of its largest piece).
        ns: the Newton–Schulz settings (FLOPs, iterations, element size of each form).
        topology: where the ranks live (``topology.Topology``; None: the contiguous order with
            ``hw.ranks_per_node``), for the TP and DP groups' link classes.
        team: DP ranks per team at TP 1 (see the module docstring; 1: no teams). Then the
            schedule's groups are teams: ``dp_owners`` holds team indices and ``tp_owners`` the
            member of a narrow unit; ``pinned`` and ``prefer`` still name DP ranks.
    """
    pinned = dict(pinned or {})
    topo = topology if topology is not None else Topology.contiguous(dp_size, tp_size, hw.ranks_per_node)
    tp_link, dp_link = Link(tp_size, topo.tp_spans_nodes), Link(dp_size, topo.dp_spans_nodes)
    members: dict[int, int] = {}
    groups, width = dp_size, tp_size
    if team > 1:
        if tp_size != 1 or dp_size % team:
            raise ValueError(f"schedule_grid: teams of {team} need TP 1 and a DP size they divide, got TP {tp_size} "
                             f"x DP {dp_size}")
        tasks = [[team_widths(unit, team, hw, ns)] for unit in units]
        moves = [_team_move_s(unit, dp_size, team, hw, ns.dtype_bytes, dp_link) for unit in units]
        members = {u: d % team for u, d in pinned.items()}
        pinned = {u: d // team for u, d in pinned.items()}
        prefer = None if prefer is None else [None if d is None else d // team for d in prefer]
        groups, width = dp_size // team, team
    else:
        tasks = [[widths(sub, hw, ns, tp_link) for sub in unit.sub_matrices()] for unit in units]
        moves = [_dp_move_s(unit, dp_size, hw, ns.dtype_bytes, dp_link) for unit in units]
    widenable = sorted({t.narrow_s for ts in tasks for t in ts if t.wide_mode is not None}, reverse=True)
    best = None
    allotments = [(float("inf"), False)] + [(threshold, True) for threshold in (float("inf"), *widenable)]
    for threshold, free in allotments:
        wide = [[t.wide_mode is not None and (t.narrow_s >= threshold or (free and t.free_to_widen(width)))
                 for t in ts] for ts in tasks]
        schedule = _place(tasks, wide, moves, groups, width, pinned, prefer, members)
        # Equal makespans (within float noise), e.g. when one unit's DP exchange sets it: the
        # busier Newton–Schulz rank loses, so a critical exchange does not hide a worse NS plan.
        if best is None or _better(schedule, best):
            best = schedule
    return best


def _better(a: GridSchedule, b: GridSchedule) -> bool:
    if a.makespan_s < b.makespan_s * (1 - 1e-9):
        return True
    return a.makespan_s <= b.makespan_s * (1 + 1e-9) and a.ns_makespan_s < b.ns_makespan_s * (1 - 1e-9)


def _place(tasks, wide, moves, dp: int, tp: int, pinned, prefer, members) -> GridSchedule:
    loads = [[0.0] * tp for _ in range(dp)]
    ns_loads = [[0.0] * tp for _ in range(dp)]
    seconds = [sum(t.wide_s if w else t.narrow_s for t, w in zip(ts, ws)) for ts, ws in zip(tasks, wide)]
    dp_owners = [0] * len(tasks)
    tp_owners: list[tuple[int | None, ...]] = [()] * len(tasks)
    makespan = 0.0
    # pinned units first (their group is fixed: the loads the others are placed against), then LPT
    for u in sorted(range(len(tasks)), key=lambda u: (u not in pinned, -seconds[u], u)):
        groups = [pinned[u]] if u in pinned else range(dp)
        trials = {d: _try(loads[d], tasks[u], wide[u], moves[u][d], members.get(u)) for d in groups}
        d = min(trials, key=lambda d: (max(trials[d][0]), sum(trials[d][0]), d))
        want = prefer[u] if prefer is not None and u not in pinned else None
        if want is not None and max(trials[want][0]) <= max(makespan, max(trials[d][0])):
            d = want
        added = [new - old - moves[u][d] for new, old in zip(trials[d][0], loads[d])]
        ns_loads[d] = [x + y for x, y in zip(ns_loads[d], added)]
        loads[d], tp_owners[u] = trials[d]
        dp_owners[u] = d
        makespan = max(makespan, max(loads[d]))
    modes = tuple(tuple(t.wide_mode if w else t.narrow_mode for t, w in zip(ts, ws)) for ts, ws in zip(tasks, wide))
    return GridSchedule(tuple(dp_owners), modes, tuple(tp_owners), makespan, max(max(x) for x in ns_loads))


def _try(group: list[float], tasks: list[Widths], wide: list[bool], move_s: float, member: int | None = None):
    """The group's loads after taking one unit (wide tasks first, then narrow ones longest first,
    each on the rank where it ends earliest: on ``member``, the rank that holds the unit whole,
    it does not pay the gather, ``narrow_move_s``) and each task's TP rank."""
    loads = [x + move_s for x in group]
    owners: list[int | None] = [None] * len(tasks)
    for t, w in zip(tasks, wide):
        if w:
            loads = [x + t.wide_s for x in loads]
    for k in sorted((k for k, w in enumerate(wide) if not w), key=lambda k: -tasks[k].narrow_s):
        own = [tasks[k].narrow_s - (tasks[k].narrow_move_s if j == member else 0.0) for j in range(len(loads))]
        r = min(range(len(loads)), key=lambda j: (loads[j] + own[j], j))
        loads = [x + (own[r] if j == r else tasks[k].narrow_other_s) for j, x in enumerate(loads)]
        owners[k] = r
    return loads, tuple(owners)


def _team_move_s(unit: MatrixLayout, dp: int, team: int, hw: Hardware, elem: int, link: Link) -> list[float]:
    """Per team, seconds on each member of the unit's exchange with the other teams: what the team
    does not hold, there and back, shared by its members (or the result broadcast to every DP rank
    when each holds the unit whole)."""
    if not unit.numel:
        return [0.0] * (dp // team)
    if unit.dp_ranges is None:
        return [moved_s(unit.numel * elem, hw, link)] * (dp // team)
    holders = unit.holders(dp)
    held = [sum(holders.get(d, 0) for d in range(g * team, (g + 1) * team)) for g in range(dp // team)]
    return [moved_s((unit.numel - h) * elem / team, hw, link) for h in held]


def _dp_move_s(unit: MatrixLayout, dp: int, hw: Hardware, elem: int, link: Link) -> list[float]:
    """Per DP group, seconds of the unit's DP exchange on that group's ranks if it owns the unit
    (``pricing.dp_exchange``: the pieces it does not hold arrive and their results leave, the
    busier direction of its link; or, every rank holding the whole unit, the result broadcast)."""
    if dp == 1 or not unit.numel:
        return [0.0] * dp
    out = []
    for d in range(dp):
        sent, received = dp_exchange(unit, d, dp, elem).get(d, (0, 0))
        out.append(moved_s(max(sent, received), hw, link))
    return out
