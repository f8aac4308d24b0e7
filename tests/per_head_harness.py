"""The one-process per-head reference, shared by the per-head tests of the dist tier.

A fused QKV's whole update (every TP rank's rows, megatron-core's ``[q heads; k; v]`` per query
group) is cut into its heads by row slices of ``head_dim`` rows, never by ``MatrixLayout``; each
head's Newton–Schulz runs alone and is scaled by the head's own shape, and the result is cut back
to one TP rank's rows. How far the step may be from it: two fp32 NS roundings of each head
(``rounding_bounds.ns_bound``) times its scale, since the step runs the same fp32 iteration on the
same matrices and only the GEMMs' summation order differs.
"""

from __future__ import annotations

import torch
from rounding_bounds import ns_bound, sum_bound, unit_roundoff

from megatron_muon import comm_stats, newton_schulz
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.core.scaling import muon_scale
from megatron_muon.parallel import comm
from megatron_muon.plan.hardware import hardware_profile
from megatron_muon.plan.step_plan import PlanSettings

NS = NSOptions(5, "jordan", dtype=torch.float32)
"""The per-head tests' Newton–Schulz: fp32, so ``ns_bound``'s fp32 rounding applies."""


def plan_settings(mode: str) -> PlanSettings:
    """A per-head test's plan settings in TP mode ``mode`` (``auto`` on the CPU profile)."""
    return PlanSettings(mode, NS, hardware=hardware_profile("cpu-gloo") if mode == "auto" else None)


def tp_traffic(step, tp_group) -> tuple[int, object]:
    """Run ``step()`` and count what it hands the TP group's collectives: (elements, the step's
    ``comm_stats``)."""
    payload = []

    def observe(event):
        if event.group is tp_group:
            payload.append(sum(t.numel() for t in event.inputs))

    with comm_stats() as stats, comm.observe_collectives(observe):
        step()
    return sum(payload), stats


def per_head_reference(full: torch.Tensor, head_dim: int, tp: int, tp_rank: int) -> tuple[torch.Tensor, float]:
    """(TP rank ``tp_rank``'s 1/``tp`` of the rows of ``full`` with each ``head_dim``-row head
    orthogonalized alone, the bound on the step's distance from it). A half head's NS, or two heads'
    together, is off by 1e-1 or more at the tests' sizes."""
    out, bound = torch.empty_like(full), 0.0
    scale = muon_scale(head_dim, full.shape[1])
    for start in range(0, full.shape[0], head_dim):
        head = full[start:start + head_dim]
        out[start:start + head_dim] = newton_schulz(head, 5, "jordan") * scale
        bound = max(bound, ns_bound(torch.float32, head, "jordan") * scale)
    return out.chunk(tp, dim=0)[tp_rank], bound


def whole_reference(full: torch.Tensor, tp: int, tp_rank: int) -> tuple[torch.Tensor, float]:
    """The same for a RowParallel weight (cut along its columns) orthogonalized whole."""
    scale = muon_scale(*full.shape)
    out = newton_schulz(full, 5, "jordan") * scale
    return out.chunk(tp, dim=1)[tp_rank], ns_bound(torch.float32, full, "jordan") * scale


def flat_ranges(sizes: list[int], dp: int, cut: bool) -> list[tuple[tuple[int, int], ...] | None]:
    """Per matrix of ``sizes`` elements laid back to back in one flat buffer, every DP rank's range
    of it; ``cut``: DP shards 3 elements longer than an even share, so that the cuts fall inside
    heads (ZeRO-1 cutting heads across DP ranks); else None (every DP rank holds all of it)."""
    if not cut:
        return [None] * len(sizes)
    shard = -(-sum(sizes) // dp) + 3
    out, offset = [], 0
    for n in sizes:
        spans = [(max(offset, d * shard), min(offset + n, (d + 1) * shard)) for d in range(dp)]
        out.append(tuple((lo - offset, hi - offset) if hi > lo else (0, 0) for lo, hi in spans))
        offset += n
    return out


def residual64(x: torch.Tensor) -> float:
    """float64 ‖XᵀX − I‖_F / √k: the RMS of σ² − 1 over X's singular values."""
    s = torch.linalg.svdvals(x.double())
    return float((s.square() - 1).square().mean().sqrt())


def residual_tolerance(hidden: int, head_dim: int) -> float:
    """How far ``--muon-log-stats``' fp32 residual of a head may be from ``residual64``: the fp32
    Gram over ``hidden`` products of entries below 1.2 in magnitude, against float64's, one rounding
    path per entry plus the division by the scale (2u per product), ``head_dim`` entries' worth in
    the norm over √k (tests/unit/test_update_stats.py's bound)."""
    entry = sum_bound(torch.float32, hidden, 1.44, roundings=1) + 2 * unit_roundoff(torch.float32) * 1.44
    return head_dim ** 0.5 * entry
