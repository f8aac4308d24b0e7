"""A step plan as a few 64-bit digests, one per field, so ranks can check they hold the same plan.

Every rank of a DP group (and of a TP group) must execute the same ``StepPlan``: the exchanges'
split sizes, the owners, the teams and the micro-groups decide which collectives each rank posts
and how large they are. Two ranks that built different plans (other ``--muon-*`` flags, other
hardware constants under ``auto``, another DP layout) would post collectives that do not line up:
a hang on NCCL, or garbage where the sizes happen to agree. ``plan_digests`` turns a plan into one
digest per field of ``PLAN_FIELDS``, inputs first and the planner's decisions after them, so the
first field that differs between two ranks is the likeliest cause; ``parallel.step_setup``
all-gathers them once, at optimizer construction.

The rank map (``PlanSettings.topology``: each position's global rank, the ranks per node) is a
field of its own: every rank of a stage derives it from its own DP and TP groups, so equal maps
across every DP and TP group are what proves the map true (``plan.topology``), and a launcher
that puts another number of ranks on some node is named as such.

Names are left out (they do not change a collective, and two replicas may name a parameter
differently), and so are the hardware profile's ``name`` and ``source`` texts: two profiles with
equal constants plan the same step.

Pure: no torch.distributed. The digest of a value is the first 8 bytes of BLAKE2b over its
``repr``, which is deterministic for the plan's frozen dataclasses, tuples, ints, floats, strings
and torch dtypes.
"""

from __future__ import annotations

import dataclasses
import hashlib

from .step_plan import StepPlan

__all__ = ["PLAN_FIELDS", "digest", "plan_digests"]

_DECIDED = "the planner decides from the fields before it (ranks running different megatron-muon versions?)"
PLAN_FIELDS: tuple[tuple[str, str], ...] = (
    ("step settings", "the --muon-* flags decide (NS steps, coefficients, dtype, scale, bucket, TP and DP modes)"),
    ("hardware constants", "--muon-auto-hardware gives (detect: the GPU model)"),
    ("rank map", "the launcher and the process groups decide (LOCAL_WORLD_SIZE; the DP and TP groups' global "
                 "ranks, which must repeat one grid over the stage, as Megatron's do)"),
    ("matrices", "the model decides (their shapes, TP splits and fused rows)"),
    ("DP ranges", "the DP layout decides (--muon-dp-layout, the distributed optimizer's buckets)"),
    ("DP owners", _DECIDED),
    ("teams", _DECIDED),
    ("micro-groups", _DECIDED),
    ("TP modes and owners", _DECIDED),
    ("scales", _DECIDED),
)
"""(field, what decides it: the end of "the first difference is in the <field>, which <it>"), in
the order they are compared: a plan's inputs, then its decisions (which equal inputs make equal
on every rank, unless the ranks run different code)."""


def digest(value) -> int:
    """A signed 64-bit digest of ``repr(value)`` (it fits an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def plan_digests(plan: StepPlan) -> tuple[int, ...]:
    """One digest per field of ``PLAN_FIELDS``, in that order."""
    settings = plan.settings
    hw = settings.hardware
    constants = None if hw is None else tuple((f.name, getattr(hw, f.name)) for f in dataclasses.fields(hw)
                                              if f.name not in ("name", "source"))
    values = (
        (dataclasses.replace(settings, hardware=None, topology=None), plan.dp_size, plan.tp_size),
        constants,
        settings.topology,
        tuple((lay.local_shape, lay.partition_dim, lay.tp_size, lay.split, lay.per_rank, lay.tp_blocks)
              for lay in plan.matrices),
        tuple(lay.dp_ranges for lay in plan.matrices),
        plan.dp_owners,
        (plan.team_size, plan.teams),
        (plan.micro_groups, plan.local_blocks),
        tuple((w.matrices, w.modes, w.tp_owners) for w in plan.work),
        plan.scales,
    )
    return tuple(digest(v) for v in values)
