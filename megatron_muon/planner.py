"""Owner planning: which rank orthogonalizes which matrix.

Pure and deterministic: every rank calls ``plan_owners`` on the same inputs and gets the same
plan without communicating, which is what lets the owner exchange agree on split sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plan_owners", "rank_loads"]


def plan_owners(costs: Sequence[float], num_ranks: int) -> list[int]:
    """Assign each matrix one owner rank, balancing the summed cost per rank.

    Longest-processing-time first (Graham 1969): visit matrices by decreasing cost and give
    each to the currently least-loaded rank. LPT's makespan is within 4/3 − 1/(3·num_ranks)
    of optimal, and for transformer layer sets (many copies of a few shapes) it is near
    perfect. Ties break deterministically: equal costs keep their input order, equal loads go
    to the lowest rank, so the plan is a pure function of (costs, num_ranks).

    Args:
        costs: one non-negative cost per matrix (``ns_flops`` of the full matrix, usually).
        num_ranks: size of the group the owners are drawn from (>= 1).

    Returns:
        ``owner_rank[i]`` in ``[0, num_ranks)`` for every matrix i.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"plan_owners: num_ranks must be an integer >= 1, got {num_ranks!r}")
    for i, c in enumerate(costs):
        if not c >= 0:  # also rejects NaN
            raise ValueError(f"plan_owners: cost of matrix {i} must be >= 0, got {c!r}")
    loads = [0.0] * num_ranks
    owner_rank = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        owner_rank[i] = r
        loads[r] += costs[i]
    return owner_rank


def rank_loads(costs: Sequence[float], owner_rank: Sequence[int], num_ranks: int) -> list[float]:
    """Summed cost per rank under an assignment; ``max/mean`` of it is the imbalance."""
    loads = [0.0] * num_ranks
    for c, r in zip(costs, owner_rank, strict=True):
        loads[r] += c
    return loads
