"""Who sends which elements to whom: the owner exchange described, without moving anything.

A matrix's pieces travel to one owner rank and its result comes back (``parallel.owner_exchange``
moves them). The description is the same for both cuts of a matrix: TP shards (rank r of a t-way
group holds rows or columns [r·m/t, (r+1)·m/t)) and DP fragments (one contiguous flat range of a
Megatron buffer per DP rank, cut anywhere). Each is a set of flat ``Piece``s of the matrix's
*owner buffer*. Also here: how the step is cut into rounds and pipeline micro-groups.

Pure: no torch.distributed; every rank derives the same description from the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout

__all__ = ["MIN_MICRO_GROUPS", "OwnedMatrix", "Piece", "dp_owned_matrix", "split_micro_groups", "split_rounds",
           "tp_owned_matrix"]


@dataclass(frozen=True)
class Piece:
    """A flat range of a matrix's owner buffer that one rank holds."""

    rank: int
    """group rank that holds the piece."""
    start: int
    """element offset of the piece in the owner buffer."""
    numel: int
    """number of elements."""


@dataclass(frozen=True)
class OwnedMatrix:
    """Where the pieces of one matrix live and who assembles it."""

    owner: int
    """group rank that receives the whole buffer and computes on it."""
    numel: int
    """length of the owner buffer (the whole matrix, flat)."""
    gather: tuple[Piece, ...]
    """pieces sent to the owner; together they cover ``[0, numel)`` exactly once."""
    scatter: tuple[Piece, ...] | None = None
    """pieces sent back; ``None`` means the same as ``gather``. A replicated matrix gathers only
    the owner's own copy and scatters the whole result to every rank."""

    @property
    def returns(self) -> tuple[Piece, ...]:
        return self.gather if self.scatter is None else self.scatter


def split_rounds(round_bytes: Sequence[int], cap_bytes: int) -> list[list[int]]:
    """Cut a sequence of matrices into consecutive rounds of at most ``cap_bytes`` each.

    A matrix larger than the cap gets a round of its own. Pure, so every rank cuts alike;
    the cap bounds the transient buffers of one exchange round.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {cap_bytes}")
    rounds: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, nbytes in enumerate(round_bytes):
        if current and used + nbytes > cap_bytes:
            rounds.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    if current:
        rounds.append(current)
    return rounds


MIN_MICRO_GROUPS = 4
"""micro-groups the step is cut into when the bucket cap alone would give fewer (see
``split_micro_groups``). Read at each call: a test or a benchmark may set it. Why 4: on the CPU
benchmark (2 cores, gloo, the bench_optimizer_step model) 4 groups were the fastest or within noise
of it at TP2 and TP2 x DP2 against 1, 2, 6 and 8 (each group adds two gloo round trips, each fewer
group less overlap and more memory); at production sizes the bucket cap binds first."""


def split_micro_groups(nbytes: Sequence[int], bucket_bytes: int, min_groups: int | None = None) -> list[list[int]]:
    """Cut a sequence of matrices into the pipeline's micro-groups: consecutive, at most
    ``bucket_bytes`` each, and about ``min_groups`` (default ``MIN_MICRO_GROUPS``) of them when
    the cap alone would give fewer.

    Why a floor on the count: the pipeline overlaps the collectives of one group with the NS of
    another, so a single group overlaps nothing; and it holds a few groups' buffers at once, so
    the extra memory of the step is a few groups' worth, not the whole model's. A group never
    splits a matrix: the cap is at least the largest matrix. Pure, so every rank cuts alike.
    """
    if not nbytes:
        return []
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    groups = MIN_MICRO_GROUPS if min_groups is None else min_groups
    floor = max(max(nbytes), -(-sum(nbytes) // groups), 1)
    return split_rounds(nbytes, min(bucket_bytes, floor))


def dp_owned_matrix(layout: MatrixLayout, owner: int, dp_size: int) -> OwnedMatrix:
    """The owner-exchange description of one matrix across the DP group.

    With the distributed optimizer each DP rank's flat range is one piece; without it
    (``dp_ranges`` None) every rank holds the whole matrix, so only the owner's own copy is
    gathered and nothing returns through the exchange: the owner broadcasts the result
    (``parallel.comm.broadcast_async``), one copy on its link rather than dp − 1 in a send buffer.
    """
    if layout.dp_ranges is None:
        return OwnedMatrix(owner=owner, numel=layout.numel, gather=(Piece(owner, 0, layout.numel),), scatter=())
    pieces = tuple(Piece(r, s, e - s) for r, (s, e) in enumerate(layout.dp_ranges) if e > s)
    return OwnedMatrix(owner=owner, numel=layout.numel, gather=pieces)


def tp_owned_matrix(sub: MatrixLayout, owner: int) -> OwnedMatrix:
    """The exchange description of one TP-sharded (or replicated) sub-matrix with the given TP
    owner: row or column shard r is rank r's piece of the owner buffer (a replicated matrix:
    the owner's own copy there, the whole result to every other rank back; a head cut by TP's row
    cut, ``tp_rows``: each holder's rows, a contiguous flat range of the head, there and back,
    nothing for a head whole on its owner)."""
    rows, cols = sub.full_shape
    full = rows * cols
    if sub.tp_rows is not None:
        return OwnedMatrix(owner=owner, numel=full, gather=tuple(Piece(r, lo * cols, (hi - lo) * cols)
                                                                 for r, (lo, hi) in enumerate(sub.tp_rows) if hi > lo))
    if not sub.is_sharded:
        return OwnedMatrix(
            owner=owner,
            numel=full,
            gather=(Piece(owner, 0, full),),
            scatter=tuple(Piece(r, 0, full) for r in range(sub.tp_size) if r != owner),
        )
    local = sub.numel
    return OwnedMatrix(owner=owner, numel=full, gather=tuple(Piece(r, r * local, local) for r in range(sub.tp_size)))
