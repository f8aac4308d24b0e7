"""Where a stage's ranks live: which plan positions share a node, from the global rank map.

A plan indexes a stage's ranks by position ``dp_rank * tp_size + tp_rank``; the links between
them are NVLink inside a node and InfiniBand across nodes. Which one a group uses depends on the
global ranks behind the positions, not on the group's size: Megatron's expert-DP group strides
by EP (its consecutive DP ranks sit EP ranks apart, often on other nodes), and a DP group at
TP 8 has one rank per node. ``Topology`` records the global rank of every position and the ranks
per node (node of a rank: ``rank // ranks_per_node``, the launchers' contiguous placement:
torchrun, Slurm's block distribution), and answers the planner's three questions: does a TP
group span nodes, does a DP group, and how many consecutive DP ranks share a node (the largest
DP team whose all-reduces stay on NVLink).

The map comes from one rank's own groups (``from_groups``): its DP group's global ranks and its TP
group's, with no collective. That is exact where every DP group of the stage is a translate of
every other (and so every TP group): Megatron's ``RankGenerator`` numbers ranks mixed-radix
(global rank = Σ coordinate × stride, over tp-cp-ep-dp-pp, the expert grid over etp-ep-edp-pp), a
DP group varies only the DP (and CP) coordinates and a TP group only the TP one, so position
(d, j)'s rank is ``dp_ranks[d] + tp_ranks[j] − rank`` from any rank's view. Where the groups are
not translates, the ranks derive different maps, and the plan digests' check at construction
refuses them (``plan.digest``'s rank map): each rank's map holds its own DP and TP groups
exactly, the check makes the maps equal across every DP and every TP group, those groups connect
the stage, so maps that pass are one map, and it is the true one.

Pure: every rank derives the same answers from the same rank map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """The global rank of every plan position, and the ranks per node."""

    grid: tuple[int, ...]
    """global rank at position ``dp_rank * tp_size + tp_rank``; ``dp_size * tp_size`` entries."""
    tp_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ranks_per_node < 1 or not self.grid or len(self.grid) % self.tp_size:
            raise ValueError(f"Topology: {len(self.grid)} ranks for TP {self.tp_size}, {self.ranks_per_node} "
                             f"ranks per node; expected a positive multiple of the TP size")

    @staticmethod
    def contiguous(dp_size: int, tp_size: int, ranks_per_node: int, first: int = 0) -> Topology:
        """Megatron's default order at the stage's front: TP fastest, then DP (position = global
        rank − ``first``)."""
        return Topology(tuple(range(first, first + dp_size * tp_size)), tp_size, ranks_per_node)

    @staticmethod
    def from_groups(dp_ranks: Sequence[int], tp_ranks: Sequence[int], rank: int, ranks_per_node: int) -> Topology:
        """The stage's map as global rank ``rank`` sees it, from its DP and TP groups' global ranks
        (each in group-rank order, ``rank`` in both): position (d, j) holds ``dp_ranks[d] +
        tp_ranks[j] − rank`` (the module docstring says when that is exact)."""
        if rank not in dp_ranks or rank not in tp_ranks:
            raise ValueError(f"Topology.from_groups: global rank {rank} is not in its own DP group {list(dp_ranks)} "
                             f"and TP group {list(tp_ranks)}")
        return Topology(tuple(d + j - rank for d in dp_ranks for j in tp_ranks), len(tp_ranks), ranks_per_node)

    @property
    def dp_size(self) -> int:
        return len(self.grid) // self.tp_size

    def node(self, dp_rank: int, tp_rank: int) -> int:
        return self.grid[dp_rank * self.tp_size + tp_rank] // self.ranks_per_node

    @property
    def tp_spans_nodes(self) -> bool:
        """Some TP group has ranks on two nodes."""
        return any(len({self.node(d, j) for j in range(self.tp_size)}) > 1 for d in range(self.dp_size))

    @property
    def dp_spans_nodes(self) -> bool:
        """Some DP group (one TP rank's) has ranks on two nodes."""
        return any(len({self.node(d, j) for d in range(self.dp_size)}) > 1 for j in range(self.tp_size))

    @property
    def dp_ranks_per_node(self) -> int:
        """The largest t dividing the DP size such that every aligned run of t consecutive DP
        ranks, in every DP group, lies in one node (1: no two consecutive DP ranks share one)."""
        dp = self.dp_size
        return max(t for t in range(1, dp + 1) if dp % t == 0 and all(
            len({self.node(d, j) for d in range(start, start + t)}) == 1
            for j in range(self.tp_size) for start in range(0, dp, t)))
