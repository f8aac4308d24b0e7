"""The cost of one ``orthogonalize_sharded`` call in one TP mode: the price of the plan it runs.

``tp_mode_cost`` builds the one-TP-group plan the call builds (``step_plan.build_step_plan``,
the settings of ``parallel.orthogonalize.orthogonalize_sharded``) and prices it
(``pricing.plan_cost``), so a mode's predicted time and the step plan's per-rank figures come
from the same price. The benchmarks (``scripts/bench/bench_tp_modes.py``,
``validate_cost_model.py``) compare it with measured calls; ``auto_mode.predicted_time`` sums it
over the modes a choice runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions
from .cost_model import Cost
from .hardware import Hardware
from .pricing import plan_cost
from .step_plan import SUB_MODES, build_step_plan, call_settings

__all__ = ["tp_mode_cost"]

_DEFAULT_NS = NSOptions()


def tp_mode_cost(matrices: Sequence[MatrixLayout], mode: str, tp: int, hw: Hardware, ns: NSOptions = _DEFAULT_NS,
                 *, megatron_core: bool = False) -> Cost:
    """Cost of ``orthogonalize_sharded(mode=...)`` over ``matrices`` on a TP group of ``tp`` ranks.

    ``matrices``: the sub-matrices Newton–Schulz runs on (``MatrixLayout.sub_matrices``), each
    split over ``tp`` ranks or held whole (any ``tp_size``: a matrix no TP rank splits is whole on
    each of the ``tp``). ``megatron_core`` models megatron-core's ``TensorParallelMuon``: NS and
    its collectives once per matrix instead of once per same-shape group, and its own distributed
    mode (``pricing.plan_cost``).
    """
    if mode not in SUB_MODES:
        raise ValueError(f"tp_mode_cost: unknown mode {mode!r}; expected one of {SUB_MODES}")
    layouts = []
    for m in matrices:
        if m.is_sharded and m.tp_size != tp:
            raise ValueError(f"tp_mode_cost: {m.name} is split over {m.tp_size} ranks, costed for {tp}")
        layouts.append(m if m.is_sharded else dataclasses.replace(m, partition_dim=None, tp_size=tp))
    if not any(m.numel for m in layouts):
        return Cost()
    # the profile's ranks per node decide whether the TP group leaves a node
    settings = dataclasses.replace(call_settings(mode, ns, None), hardware=hw)
    return plan_cost(build_step_plan(layouts, dp_size=1, tp_size=tp, settings=settings), hw,
                     megatron_core=megatron_core)
