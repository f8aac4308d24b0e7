"""Owner planning: which rank orthogonalizes which matrix.

Pure and deterministic: every rank calls ``plan_owners`` on the same inputs and gets the same
plan without communicating, which is what lets the owner exchange agree on split sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions

if TYPE_CHECKING:
    from .units import Unit

__all__ = ["dp_pins", "plan_dp_owners", "plan_owners", "plan_unit_owners", "rank_loads", "unit_pinnable"]

_DEFAULT_NS = NSOptions()


def plan_owners(
    costs: Sequence[float],
    num_ranks: int,
    *,
    fixed: Mapping[int, int] | None = None,
    prefer: Sequence[int | None] | None = None,
) -> list[int]:
    """Assign each matrix one owner rank, balancing the summed cost per rank.

    Longest-processing-time first (Graham 1969): visit matrices by decreasing cost and give
    each to the currently least-loaded rank. LPT's makespan is within 4/3 − 1/(3·num_ranks)
    of optimal, and for transformer layer sets (many copies of a few shapes) it is near
    perfect. Ties break deterministically: equal costs keep their input order, equal loads go
    to the lowest rank, so the plan is a pure function of the arguments.

    Args:
        costs: one non-negative cost per matrix (``ns_flops`` of the full matrix, usually).
        num_ranks: size of the group the owners are drawn from (>= 1).
        fixed: matrix → rank assignments made before LPT runs (their cost counts toward that
            rank's load). The DP plan fixes a matrix that lies wholly in one rank's range to
            that rank, so it never moves.
        prefer: per matrix, a rank to use instead of LPT's choice whenever that does not raise
            the current maximum load beyond what LPT's choice would make it (the DP plan
            prefers the rank holding the largest piece: fewer bytes move).

    Returns:
        ``owner_rank[i]`` in ``[0, num_ranks)`` for every matrix i.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"plan_owners: num_ranks must be an integer >= 1, got {num_ranks!r}")
    for i, c in enumerate(costs):
        if not c >= 0:  # also rejects NaN
            raise ValueError(f"plan_owners: cost of matrix {i} must be >= 0, got {c!r}")
    fixed = dict(fixed or {})
    if prefer is not None and len(prefer) != len(costs):
        raise ValueError(f"plan_owners: {len(prefer)} preferences for {len(costs)} matrices")
    for i, r in {**fixed, **{i: r for i, r in enumerate(prefer or []) if r is not None}}.items():
        if not (0 <= i < len(costs)) or not (0 <= r < num_ranks):
            raise ValueError(f"plan_owners: matrix {i} pinned or preferred to rank {r}, outside {num_ranks} ranks")
    loads = [0.0] * num_ranks
    owner_rank = [0] * len(costs)
    for i, r in sorted(fixed.items()):
        owner_rank[i] = r
        loads[r] += costs[i]
    for i in sorted((i for i in range(len(costs)) if i not in fixed), key=lambda i: (-costs[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        want = prefer[i] if prefer is not None else None
        if want is not None and loads[want] + costs[i] <= max(max(loads), loads[r] + costs[i]):
            r = want
        owner_rank[i] = r
        loads[r] += costs[i]
    return owner_rank


def rank_loads(costs: Sequence[float], owner_rank: Sequence[int], num_ranks: int) -> list[float]:
    """Summed cost per rank under an assignment; ``max/mean`` of it is the imbalance."""
    loads = [0.0] * num_ranks
    for c, r in zip(costs, owner_rank, strict=True):
        loads[r] += c
    return loads


def plan_dp_owners(layouts: Sequence[MatrixLayout], dp_size: int, ns: NSOptions = _DEFAULT_NS, *,
                   pinnable: Sequence[bool] | None = None) -> list[int]:
    """One DP owner per matrix: balanced on NS FLOPs (``ns.flops`` of its sub-matrices' global
    shapes), moving as little as possible.

    A matrix lying wholly in one rank's range is pinned to that rank (it never moves) where
    ``pinnable`` allows it (None: everywhere); any other matrix held in DP ranges prefers the rank
    holding its largest piece unless that would worsen the balance. Without DP ranges (plain DDP:
    every rank holds everything) it is plain LPT.
    """
    fixed, prefer = dp_pins(layouts, dp_size, pinnable)
    costs = [lay.group_flops(ns.flops) for lay in layouts]
    return plan_owners(costs, dp_size, fixed=fixed, prefer=prefer)


def dp_pins(layouts: Sequence[MatrixLayout], dp_size: int,
            pinnable: Sequence[bool] | None = None) -> tuple[dict[int, int], list[int | None]]:
    """(matrix → the DP rank it lies wholly on, where ``pinnable`` allows; per matrix, the rank
    holding its largest piece, None without DP ranges): what a DP placement must and should keep."""
    fixed: dict[int, int] = {}
    prefer: list[int | None] = []
    for i, layout in enumerate(layouts):
        holders = layout.holders(dp_size)
        if layout.dp_ranges is None or not holders:
            prefer.append(None)
            continue
        largest = max(holders, key=lambda r: (holders[r], -r))
        if len(holders) == 1 and (pinnable is None or pinnable[i]):
            fixed[i] = largest
        prefer.append(largest)
    return fixed, prefer


def plan_unit_owners(weights: Sequence[MatrixLayout], units: Sequence[Unit], dp_size: int,
                     ns: NSOptions = _DEFAULT_NS) -> list[int]:
    """One DP owner per unit (``units.split_units`` of ``weights``): ``plan_dp_owners`` on the
    units, a unit pinned to the rank holding it only when its whole weight lies there.

    Pinning a half of a cut fc1 would let the pins, not the balance, decide (70B TP8 x DP8 in the
    megatron layout: NS max/mean 1.038 against 1.011), while a weight whole on a rank (the
    balanced layout) still never moves.
    """
    return plan_dp_owners([unit.layout for unit in units], dp_size, ns, pinnable=unit_pinnable(weights, units, dp_size))


def unit_pinnable(weights: Sequence[MatrixLayout], units: Sequence[Unit], dp_size: int) -> list[bool]:
    """Per unit, whether it may be pinned: its whole weight lies on one DP rank."""
    return [len(weights[unit.weight].holders(dp_size)) == 1 for unit in units]
