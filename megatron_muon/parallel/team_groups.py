"""The process groups of DP teams, made by every rank of the job in one global order.

A DP team (``plan.teams``: consecutive DP ranks running a unit's Newton–Schulz together, at TP 1
under ``auto``) needs a process group of its members. torch makes a group with ``new_group``,
which every rank of the default group must call, for every group, in the same order: the group's
name is a counter of the calls, and once the default group is bound to a device
(``init_process_group(device_id=...)``) NCCL makes the communicator by ``ncclCommSplit`` of the
world's, which every rank of the world must join (a non-member with "no colour"). A team made by
its members alone (``use_local_synchronization``) blocks those members forever there; so does a
rank that skips a team because its own plan has none (another pipeline stage, another DP group).

``make_team_groups`` therefore asks every rank, in one all-gather over the default group, which
team it needs, and makes the union of them on every rank, sorted by global ranks, with the timeout
given (Megatron's; else its DP group's) and its DP group's NCCL options where torch exposes them. A team whose
members are already a group (the whole DP group, or one of Megatron's groups the caller lists)
reuses that group when every member of it says so; otherwise it is made, and every member uses
the made one. Made groups are kept per default group (``made_groups``) and reused by later calls,
which every rank makes alike, so every rank's registry holds the same teams.

Every call is a collective over the default group: every rank makes it, the same number of times,
in the same order (the optimizer does it once, at construction). Under torch's fake process group
(the dry run: one simulated rank per process, nothing moves) no rank's answer can be read, so
each process makes the teams it asked for itself.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import comm
from .devices import group_device

__all__ = ["TeamRequest", "made_groups", "make_team_groups", "team_request"]


@dataclass(frozen=True)
class TeamRequest:
    """One team this rank is a member of."""

    ranks: tuple[int, ...]
    """its members' global ranks, ascending."""
    parent: object
    """the DP group the team is cut from (None: the default group): a candidate for reuse, and
    the source of the new group's NCCL options."""


def team_request(plan, dp_group) -> TeamRequest | None:
    """The team of ``plan`` (a ``StepPlan``) this rank belongs to over ``dp_group``; None without
    teams. Members are ``team_size`` consecutive DP ranks (``plan.teams``)."""
    if plan.teams is None:
        return None
    parent = dp_group if dp_group is not None else dist.group.WORLD
    dp_rank, t = comm.group_rank(parent), plan.team_size
    first = dp_rank - dp_rank % t
    ranks = dist.get_process_group_ranks(parent)
    return TeamRequest(tuple(sorted(ranks[first:first + t])), dp_group)


_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""default group → {global ranks: group made for that team} (a non-member holds what new_group
returned it); released when the default group is destroyed."""


def made_groups() -> list[dist.ProcessGroup]:
    """The team groups made under the current default group that this rank is a member of (for a
    caller that tears groups down between runs in one process, as the tests do, and must spare
    these: later optimizers of the process reuse them)."""
    if not dist.is_initialized():
        return []
    return [g for g in _MADE.get(dist.group.WORLD, {}).values() if isinstance(g, dist.ProcessGroup)]


def make_team_groups(requests: Sequence[TeamRequest], *, timeout: timedelta | None = None,
                     existing: Sequence = ()) -> list:
    """Per request, the process group of its team; a collective over the default group (module
    docstring). ``existing``: groups a team may reuse besides its DP group (Megatron's)."""
    if not (dist.is_available() and dist.is_initialized()):
        if requests:
            raise RuntimeError("make_team_groups: DP teams need torch.distributed initialized")
        return []
    made = _MADE.setdefault(dist.group.WORLD, {})
    reuse = [_existing_group(r, existing) for r in requests]
    wanted = {r.ranks for r, same in zip(requests, reuse) if same is None}
    if dist.get_world_size() > 1 and not comm.is_fake(None):
        wanted = _everyones(requests, reuse)
    parents = {r.ranks: r.parent if r.parent is not None else dist.group.WORLD for r in requests}
    for ranks in sorted(wanted - set(made)):  # one order on every rank: every rank calls for every team
        options, parent_timeout = _parent_settings(parents.get(ranks))
        made[ranks] = dist.new_group(list(ranks), timeout=timeout if timeout is not None else parent_timeout,
                                     pg_options=options, group_desc="megatron_muon_dp_team")
    # a team made for anyone is used by all its members, even one that could have reused a group
    return [made.get(r.ranks, same) for r, same in zip(requests, reuse)]


def _existing_group(request: TeamRequest, existing: Sequence):
    """A group of exactly the team's ranks among its DP group and ``existing``, or None."""
    parent = request.parent if request.parent is not None else dist.group.WORLD
    for group in (parent, *existing):
        if group is None or not isinstance(group, dist.ProcessGroup):
            continue
        try:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        except (ValueError, RuntimeError):  # not a member, or destroyed
            continue
        if ranks == request.ranks and str(dist.get_backend(group)) == str(dist.get_backend(parent)):
            return group
    return None


def _everyones(requests: Sequence[TeamRequest], reuse: Sequence) -> set[tuple[int, ...]]:
    """The teams some rank needs and cannot reuse a group for, from an all-gather of every rank's
    requests over the default group (sizes first, then the padded records)."""
    mine: list[int] = []
    for r, same in zip(requests, reuse):
        mine += [len(r.ranks), 0 if same is None else 1, *r.ranks]
    device = group_device(None)
    world = dist.get_world_size()
    with comm.uncounted():
        size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(world)]
        comm.all_gather(sizes, size, None, tag="team_requests")
        longest = max(int(s.item()) for s in sizes)
        if not longest:
            return set()
        flat = torch.full((longest,), -1, dtype=torch.int64, device=device)
        flat[:len(mine)] = torch.tensor(mine, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(flat) for _ in range(world)]
        comm.all_gather(everyone, flat, None, tag="team_requests")
    wanted = set()
    for record, n in zip(everyone, sizes):
        values, at = record.tolist()[:int(n.item())], 0
        while at < len(values):
            count, reusable = values[at], values[at + 1]
            if not reusable:
                wanted.add(tuple(values[at + 2:at + 2 + count]))
            at += 2 + count
    return wanted


def _parent_settings(parent) -> tuple:
    """(a copy of ``parent``'s NCCL options, its timeout) for a team cut from it (Megatron's DP
    group: its per-group NCCL settings, such as CTA limits, copied as ``split_group`` copies its
    parent's; its timeout, for a caller that gives none). (None, None) where torch exposes neither
    (the fake backend, a rank outside the team); no options but the timeout on gloo."""
    if parent is None:
        return None, None
    try:
        options = parent._get_backend(group_device(parent)).options
    except (RuntimeError, AttributeError, ValueError):
        return None, None
    timeout = getattr(options, "_timeout", None)
    return (copy.deepcopy(options) if "nccl" in str(dist.get_backend(parent)) else None), timeout
