"""Everything a step needs from the process groups, done once, when the optimizer is built.

On NCCL nothing may be left for the first step: a communicator made there (a DP team's) can
block forever unless every rank of the job makes it at the same point, NCCL's peer buffers are
allocated outside PyTorch's caching allocator when a group first talks to a peer (after forward
and backward have filled the pool, an out-of-memory in step 1 of a job that fits), and two ranks
holding different plans post collectives that do not line up. ``prepare`` takes a rank's
optimizers (``PlannedStep``: a label, its step plans, its ``StepGroups``) and, in this order:

    1. team groups   ``team_groups.make_team_groups``: every DP team of the job, made by every
                     rank in one global order (one all-gather over the default group first)
    2. one plan      each plan's digests (``plan.digest``) all-gathered over its DP group, then its
                     TP group; a rank that differs is refused in one line naming the first field
                     that differs and the ranks, on every rank of the group (no hang)
    3. bind          each plan bound to its groups (``orthogonalize.bind``): the first step makes
                     nothing and checks nothing
    4. warm-up       on every group a step will use (DP, TP, team), one tiny collective of each
                     kind it issues: an all-to-all with every peer, an all-reduce, an all-gather,
                     a broadcast, so communicators and peer connections exist before training.
                     On CUDA the device memory this took is measured (``torch.cuda.mem_get_info``
                     before step 1 and after step 4) and reported (``SetupReport``).

``broadcast_hardware`` gives every rank global rank 0's ``auto`` constants, resolved once, for a
caller (the Megatron factory) to plan with; the digest then still refuses a rank handed others.
``stage_topology`` gives the plans their stage's rank map (``plan.topology``), before any of this:
from the rank's own DP and TP groups and the launcher's ranks per node, with no collective; a
rank map that differs between ranks is refused by the digest check of step 2.

Every call is collective: every rank of the default group calls ``prepare`` the same number of
times, with its optimizers in the same order (dense, then experts); step 1 talks over the
default group only when some plan is ``auto`` (the only mode with teams; the mode is a flag, the
same on every rank). Steps 2 and 4 run group kind by group kind (each kind's groups partition the
ranks that have it), so no two ranks wait on each other in opposite orders. All of it is
``comm.uncounted``: no step's traffic. Under torch's fake process group (the dry run) the
collectives are issued, so their devices are checked, but no value is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..plan.digest import PLAN_FIELDS, plan_digests
from ..plan.hardware import Hardware
from ..plan.step_plan import StepPlan
from ..plan.topology import Topology
from . import comm
from .devices import group_device
from .orthogonalize import StepGroups, bind
from .team_groups import make_team_groups, team_request

__all__ = ["PLAN_KINDS", "PlannedStep", "SetupReport", "broadcast_hardware", "launcher_ranks_per_node", "prepare",
           "prepare_optimizers", "stage_topology"]

PLAN_KINDS = ("muon", "full", "block")
"""the step kinds an optimizer may plan (``optimizer.step_plans``), in the order they are compared."""


@dataclass(frozen=True)
class PlannedStep:
    """One optimizer's steps as ``prepare`` sees them."""

    label: str
    """how a refusal names the optimizer (``the dense optimizer``)."""
    plans: Mapping[str, StepPlan]
    """step kind (of ``PLAN_KINDS``) → its plan."""
    groups: StepGroups
    """the groups and device every step of it runs on (``device`` set)."""


@dataclass(frozen=True)
class SetupReport:
    """What ``prepare`` did on this rank."""

    team_groups: int
    """team groups this rank's plans run on (made by every rank in one order, or a group reused)."""
    groups_warmed: int
    """groups this rank took part in warming up (size > 1)."""
    collectives: int
    """collectives it issued for the check and the warm-up."""
    seconds: float
    device_bytes: int | None = None
    """CUDA only: device memory that the four steps took (``mem_get_info`` before and after);
    None elsewhere."""
    allocator_bytes: int | None = None
    """CUDA only: how much of ``device_bytes`` PyTorch's caching allocator reserved (the tiny
    buffers); the rest is NCCL's, outside the allocator."""


def prepare(steps: Sequence[PlannedStep], *, timeout: timedelta | None = None, existing: Sequence = ()) -> SetupReport:
    """Steps 1-4 of the module docstring for this rank's optimizers; raises ``ValueError`` (one line)
    when a DP or TP group's ranks planned different steps. ``timeout``: the new groups' (Megatron's
    ``--distributed-timeout-minutes``; None: the team's DP group's); ``existing``: groups a team may reuse."""
    start = time.perf_counter()
    cuda = [s.groups.device for s in steps if s.groups.device is not None and s.groups.device.type == "cuda"]
    before = _memory(cuda[0]) if cuda else None
    counter = [0]
    with comm.uncounted():
        teams = _team_groups(steps, timeout, existing)
        if dist.is_available() and dist.is_initialized():
            for step in steps:
                _check_one_plan(step, "DP", counter)
                _check_one_plan(step, "TP", counter)
        for step in steps:
            for kind, plan in step.plans.items():
                bind(plan, step.groups, teams.get((id(step), kind)))
        warmed = _warm_up(steps, teams, counter)
    device_bytes = allocator_bytes = None
    if before is not None:
        after = _memory(cuda[0])
        device_bytes, allocator_bytes = before[0] - after[0], after[1] - before[1]
    return SetupReport(len(teams), warmed, counter[0], time.perf_counter() - start, device_bytes, allocator_bytes)


def prepare_optimizers(optimizers, *, labels=None, timeout: timedelta | None = None,
                       existing_groups: Sequence = ()) -> SetupReport:
    """``prepare`` for this rank's ``MuonWithAdamW`` optimizers together (their ``plans`` and
    ``step_groups``); each gets the report as ``setup_report``. ``labels`` name them in a refusal
    (default ``MuonWithAdamW``)."""
    labels = list(labels) if labels is not None else ["MuonWithAdamW"] * len(optimizers)
    report = prepare([PlannedStep(label, opt.plans, opt.step_groups) for opt, label in zip(optimizers, labels)],
                     timeout=timeout, existing=existing_groups)
    for opt in optimizers:
        opt.setup_report = report
    return report


def _memory(device: torch.device) -> tuple[int, int]:
    """(free device memory, bytes the caching allocator reserves) once the device is idle."""
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


# ---- 1. team groups ---------------------------------------------------------------------------


def _team_groups(steps: Sequence[PlannedStep], timeout, existing) -> dict:
    """(id(step), kind) → its team's group, for every plan with teams; every rank takes part in
    the exchange when some plan is ``auto`` (every rank's flags say the same)."""
    wanted = [((id(s), kind), plan, s.groups.dp) for s in steps for kind, plan in s.plans.items()
              if plan.teams is not None]
    if not wanted and not any(p.settings.tp_mode == "auto" for s in steps for p in s.plans.values()):
        return {}
    groups = make_team_groups([team_request(plan, dp) for _, plan, dp in wanted], timeout=timeout,
                              existing=existing)
    return {key: g for (key, _, _), g in zip(wanted, groups)}


# ---- 2. one plan on every rank ------------------------------------------------------------------


def _row(plans: Mapping[str, StepPlan]) -> list[int]:
    """Per step kind of ``PLAN_KINDS``: [planned?, then each field's digest (0 when unplanned)]."""
    row = []
    for kind in PLAN_KINDS:
        plan = plans.get(kind)
        row += [0, *[0] * len(PLAN_FIELDS)] if plan is None else [1, *plan_digests(plan)]
    return row


def _check_one_plan(step: PlannedStep, what: str, counter: list[int]) -> None:
    """All-gather the step's digests over its ``what`` (DP or TP) group and refuse, on every rank
    of it, a rank whose plans differ from group rank 0's. The group's size is the plans' (a None
    group of a plan with several ranks is the default group, as the step reads it)."""
    group = step.groups.dp if what == "DP" else step.groups.tp
    if max((p.dp_size if what == "DP" else p.tp_size for p in step.plans.values()), default=1) == 1:
        return
    size = comm.group_size(group)
    device = step.groups.device
    mine = torch.tensor(_row(step.plans), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(size)]
    comm.all_gather(rows, mine, group, tag="plan_check")
    counter[0] += 1
    if comm.is_fake(group) or device.type == "meta":  # nothing moved: the gather's devices were checked
        return
    table = [r.tolist() for r in rows]
    other = next((r for r in range(1, size) if table[r] != table[0]), None)
    if other is None:
        return
    at = next(k for k, (a, b) in enumerate(zip(table[0], table[other])) if a != b)
    kind, slot = PLAN_KINDS[at // (1 + len(PLAN_FIELDS))], at % (1 + len(PLAN_FIELDS))
    field, hint = ("step kinds", "--muonbp-period decides") if slot == 0 else PLAN_FIELDS[slot - 1]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    raise ValueError(
        f"{step.label}: {what} ranks 0 and {other} (global ranks {ranks[0]} and {ranks[other]}) planned different "
        f"'{kind}' steps; the first difference is in the {field}, which {hint}; every rank of a {what} group must "
        "plan the same step, or their collectives would not line up")


# ---- 4. warm-up -----------------------------------------------------------------------------------


def _warm_up(steps: Sequence[PlannedStep], teams: dict, counter: list[int]) -> int:
    """One tiny collective of each kind on each group the steps use, kind by kind: per optimizer
    its DP group, its TP group, its team group."""
    warmed = 0
    for step in steps:
        plans = [p for p in step.plans.values() if p.local_blocks is None]
        if not plans:
            continue
        dtype = plans[0].settings.ns.dtype
        used = []
        if any(p.exchanges_dp for p in plans):
            used.append(step.groups.dp)
        if any(p.tp_size > 1 for p in plans):
            used.append(step.groups.tp)
        used += [g for kind, g in teams.items() if kind[0] == id(step) and g is not None]
        for group in used:
            if comm.group_size(group) > 1:
                counter[0] += _warm_group(group, dtype, step.groups.device)
                warmed += 1
    return warmed


def _warm_group(group, dtype: torch.dtype, device: torch.device) -> int:
    """An all-to-all with one element for every peer (a connection to each), an all-reduce, an
    all-gather and a broadcast of one element on ``group``; returns the number issued."""
    t = comm.group_size(group)
    send = torch.zeros(t, dtype=dtype, device=device)
    comm.all_to_all_single(torch.empty_like(send), send, [1] * t, [1] * t, group)
    one = torch.zeros(1, dtype=dtype, device=device)
    comm.all_reduce(one, group)
    comm.all_gather([torch.empty_like(one) for _ in range(t)], one, group, tag="warm_up")
    comm.broadcast_async(one, 0, group).wait()
    return 4


# ---- the hardware constants ------------------------------------------------------------------------


def broadcast_hardware(hardware: Hardware) -> Hardware:
    """Global rank 0's ``hardware``, on every rank (a collective over the default group): ``auto``'s
    constants resolved once for the whole job, so ranks that would resolve other ones (``detect``
    on mixed GPUs, a JSON file that differs between nodes) plan the same step. Unchanged without
    torch.distributed, in a world of one, and under the fake process group (nothing moves)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or comm.is_fake(None):
        return hardware
    device = group_device(None)
    payload = list(json.dumps(dataclasses.asdict(hardware)).encode())
    with comm.uncounted():
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        comm.broadcast_async(size, 0, None).wait()
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if dist.get_rank() == 0:
            data.copy_(torch.tensor(payload, dtype=torch.uint8, device=device))
        comm.broadcast_async(data, 0, None).wait()
    return Hardware(**json.loads(bytes(data.tolist()).decode()))


# ---- the rank map ----------------------------------------------------------------------------------


def launcher_ranks_per_node() -> int | None:
    """The launcher's ranks per node: ``LOCAL_WORLD_SIZE``, which torchrun sets on every rank (it
    launches the same number on every node, rank = node × LOCAL_WORLD_SIZE + local rank; our Slurm
    scripts and run.sh launch through it); None where it is unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE: expected the launcher's ranks per node (an integer >= 1), got {value!r}")
    return int(value)


def stage_topology(dp_group, tp_group, hardware: Hardware | None) -> Topology | None:
    """The rank map of the stage whose DP and TP groups these are (None: a group of this rank
    alone), as ``Topology.from_groups`` derives it from this rank's view (no collective; a group's
    global ranks in group-rank order), with ``launcher_ranks_per_node``, else ``hardware``'s ranks
    per node. None without torch.distributed, or when neither says how many ranks share a node."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    per_node = launcher_ranks_per_node() or (hardware.ranks_per_node if hardware is not None else None)
    if per_node is None:
        return None
    rank = dist.get_rank()
    return Topology.from_groups(_global_ranks(dp_group, rank), _global_ranks(tp_group, rank), rank, per_node)


def _global_ranks(group, rank: int) -> list[int]:
    if group is None:
        return [rank]
    return sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))
