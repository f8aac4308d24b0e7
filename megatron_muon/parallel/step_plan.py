"""What one Muon step will cost each rank, from the plans alone: no tensor, no collective.

The optimizer's step is a pure function of the layouts: DP owners (``plan_dp_owners``), the
sub-matrices each DP owner's TP group orthogonalizes (``MatrixLayout.sub_*_shapes``), the TP
mode of each, and, in owner mode, the TP owner of each (``plan_owners``). ``plan_step`` replays
those plans and adds up, per rank of one pipeline stage, the Newton–Schulz FLOPs and the bytes
the package's collectives send (``comm.py``'s convention). The startup report prints it; the dry
run (``scripts/dry_run.py``) checks the real step against the same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import ns_flops
from .planner import plan_owners

__all__ = ["StepPlan", "plan_step", "tp_modes_of"]


@dataclass(frozen=True)
class StepPlan:
    """Per rank of one pipeline stage (index ``dp_rank * tp + tp_rank``)."""

    ns_flops: tuple[int, ...]
    """Newton–Schulz FLOPs the rank runs."""
    dp_bytes: tuple[int, ...]
    """bytes the rank sends in the DP owner exchange, there and back."""
    tp_bytes: tuple[int, ...]
    """bytes the rank sends in its TP group's mode (owner exchange, all-gather or all-reduces)."""

    @property
    def bytes_sent(self) -> tuple[int, ...]:
        """Everything the rank sends in the step."""
        return tuple(d + t for d, t in zip(self.dp_bytes, self.tp_bytes))


def _dp_bytes(layout: MatrixLayout, owner: int, dp: int, elem: int) -> dict[int, int]:
    """DP rank → bytes it sends for ``layout``: pieces to the owner, the results back."""
    out: dict[int, int] = {}
    if layout.dp_ranges is None:  # every DP rank holds it: the owner sends the result to the others
        if dp > 1:
            out[owner] = (dp - 1) * layout.numel * elem
        return out
    for r, n in layout.holders(dp).items():
        if r != owner:
            out[r] = out.get(r, 0) + n * elem
            out[owner] = out.get(owner, 0) + n * elem
    return out


def plan_step(
    layouts: Sequence[MatrixLayout],
    dp_owners: Sequence[int] | None,
    tp: int,
    dp: int,
    *,
    tp_mode: str,
    steps: int = 5,
    ns_bytes: int = 2,
    hardware=None,
) -> StepPlan:
    """Replay one step's plans. ``dp_owners`` None (or DP = 1): every DP rank computes every
    matrix, as ``--muon-dp-mode redundant`` does. ``hardware``: the cost model's constants, for
    ``tp_mode="auto"``. Blockwise ignores TP; the exact modes follow ``tp_modes.py``."""
    flops, dp_sent, tp_sent = [0.0] * (tp * dp), [0.0] * (tp * dp), [0.0] * (tp * dp)
    by_owner: dict[int, list[MatrixLayout]] = {}
    for i, layout in enumerate(layouts):
        if dp_owners is None or dp == 1:
            for d in range(dp):
                by_owner.setdefault(d, []).append(layout)
            continue
        by_owner.setdefault(dp_owners[i], []).append(layout)
        for d, b in _dp_bytes(layout, dp_owners[i], dp, ns_bytes).items():
            for j in range(tp):  # every TP peer moves its own TP-local shard alike
                dp_sent[d * tp + j] += b
    for d, owned in by_owner.items():  # one orthogonalize_sharded call per DP owner's TP group
        subs = [(local, full, lay.partition_dim if tp > 1 else None)
                for lay in owned for local, full in zip(lay.sub_local_shapes(), lay.sub_global_shapes())]
        modes = tp_modes_of(subs, tp, tp_mode, steps, ns_bytes, hardware)
        owner_subs = [k for k, m in enumerate(modes) if m == "owner"]  # owner mode plans among its own
        owners = dict(zip(owner_subs, plan_owners([ns_flops(*subs[k][1], steps) for k in owner_subs], tp)))
        for k, ((local, full, pdim), mode) in enumerate(zip(subs, modes)):
            for j in range(tp):
                f, b = _sub_cost(local, full, pdim, mode, owners.get(k), j, tp, steps, ns_bytes)
                flops[d * tp + j] += f
                tp_sent[d * tp + j] += b
    return StepPlan(tuple(int(f) for f in flops), tuple(round(b) for b in dp_sent), tuple(round(b) for b in tp_sent))


def _sub_cost(local, full, pdim, mode, owner, j, tp, steps, ns_bytes) -> tuple[float, float]:
    """(NS FLOPs, bytes sent) of one sub-matrix on TP rank ``j``."""
    from .tp_modes import distributed_ns_flops

    local_n, full_n = local[0] * local[1], full[0] * full[1]
    if mode == "blockwise" or (pdim is None and mode != "owner"):  # NS of what the rank holds
        return ns_flops(*local, steps), 0
    if mode == "duplicated":
        return ns_flops(*full, steps), (tp - 1) * local_n * ns_bytes
    if mode == "distributed":  # k: the unsharded dim; the scale, the norm and `steps` k×k Grams all-reduced
        k, cols = (local[1], local[0]) if pdim == 0 else local
        return distributed_ns_flops(k, cols, steps), 2 * (tp - 1) * (steps * k * k + 2) * ns_bytes / tp
    if j != owner:  # owner mode: the shard goes to the owner (a replicated matrix stays put)
        return 0, 0 if pdim is None else local_n * ns_bytes
    return ns_flops(*full, steps), (tp - 1) * (full_n if pdim is None else local_n) * ns_bytes


def tp_modes_of(subs, tp: int, tp_mode: str, steps: int, ns_bytes: int, hardware) -> list[str]:
    """The TP mode each sub-matrix ``(local, full, partition_dim)`` of one call runs in."""
    if tp_mode != "auto":
        return [tp_mode] * len(subs)
    from .auto_mode import choose_tp_modes, hardware_profile
    from .cost_model import Matrix

    hw = hardware if hardware is not None else hardware_profile("detect")
    return choose_tp_modes([Matrix(*full, pdim) for _, full, pdim in subs], tp, hw, steps=steps,
                           dtype_bytes=ns_bytes)
