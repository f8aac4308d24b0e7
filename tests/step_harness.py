"""One orthogonalize step described by keywords, for tests that vary one setting at a time.

``run_step(pieces, layouts, tp_mode=..., dp_group=..., ...)`` builds the ``StepPlan`` those
settings give (``plan.step_plan.build_step_plan``, as ``MuonWithAdamW`` builds its own) and runs
it through the one dispatcher, ``parallel.orthogonalize.orthogonalize_updates``. Nothing here
re-implements the step: it only spells a plan's settings as keywords.
"""

from __future__ import annotations

import torch

from megatron_muon.core.newton_schulz import DEFAULT_COEFFICIENTS, NSOptions
from megatron_muon.parallel import comm
from megatron_muon.parallel.orthogonalize import StepGroups, orthogonalize_updates
from megatron_muon.plan.hardware import hardware_profile
from megatron_muon.plan.step_plan import DEFAULT_BUCKET_BYTES, PlanSettings, StepPlan, build_step_plan


def step_plan(layouts, *, tp_mode: str, dp_size: int, tp_size: int, dp_mode: str = "owner", steps: int = 5,
              coefficients=DEFAULT_COEFFICIENTS, eps: float = 1e-7, ns_dtype: torch.dtype = torch.bfloat16,
              scale_mode: str = "spectral", extra_scale_factor: float = 1.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              hardware=None, ns_method: str = "standard") -> StepPlan:
    """The plan of one step with these settings (``auto`` without ``hardware``: this device's)."""
    if tp_mode == "auto" and hardware is None:
        hardware = hardware_profile("detect")
    ns = NSOptions(steps, coefficients, eps, ns_dtype, method=ns_method)
    settings = PlanSettings(tp_mode, ns, dp_mode, scale_mode, extra_scale_factor, bucket_bytes,
                            hardware if tp_mode == "auto" else None)
    return build_step_plan(layouts, dp_size=dp_size, tp_size=tp_size, settings=settings)


def run_step(pieces, layouts, *, dp_group=None, tp_group=None, device=None, apply=None, **settings):
    """``orthogonalize_updates`` of ``pieces`` under the plan ``step_plan(layouts, **settings)`` for
    these groups (None: the default group, as a process group argument means in torch)."""
    plan = step_plan(layouts, dp_size=comm.group_size(dp_group), tp_size=comm.group_size(tp_group), **settings)
    return orthogonalize_updates(pieces, plan, StepGroups(dp_group, tp_group, device), apply)


def payload_bytes(stats: comm.CommStats) -> int:
    """Bytes a step sent without its one-time cross-rank shape check (``shape_check`` all-gathers,
    issued when a plan is first bound to its groups)."""
    return stats.bytes_sent - stats.bytes_by_primitive.get("shape_check", 0)
