"""The owner exchange: pieces of matrices travel to one owner rank and come back.

One idea serves two cuts of the same matrix:
  * TP shards: rank r of a t-way group holds rows (or columns) [r·m/t, (r+1)·m/t);
  * DP fragments: Megatron's distributed optimizer gives each DP rank one contiguous range of a
    flat grad buffer, so a matrix can be cut anywhere, into uneven flat ranges.
Both are described the same way, as flat ``Piece``s of a per-matrix *owner buffer*: piece
(rank, start, numel) is held by ``rank`` and lands at ``buffer[start:start+numel]`` on the owner.
How a buffer maps back to the matrix (a plain view for row shards and DP ranges, a permute for
column shards) is the caller's business; this module only moves elements.

One exchange is one ``all_to_all_single`` there and one back, whatever the number of matrices
(Canzona, arXiv 2602.06079, §4: fused all-to-all). Every rank issues both calls with
split sizes derived from the same plan, including ranks that send or own nothing, so the
collective sequence is identical everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import comm

__all__ = ["OwnedMatrix", "OwnerExchange", "Piece", "split_rounds"]


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


class OwnerExchange:
    """A fixed plan for moving pieces of ``matrices`` to their owners and back.

    Built identically on every rank of ``group`` from the same ``matrices``; the send and
    receive orders (by destination / source rank, then matrix index, then piece order) are
    derived from the plan alone, so no sizes are exchanged at run time.
    """

    def __init__(
        self,
        matrices: Sequence[OwnedMatrix],
        group=None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device,
    ):
        # dtype and device are fixed up front: a rank that holds and owns nothing still has to
        # post correctly typed (empty) buffers, and NCCL wants them on the GPU.
        self.matrices = list(matrices)
        self.group = group
        self.dtype = dtype
        self.device = device
        self.size = comm.group_size(group)
        self.rank = comm.group_rank(group)
        for i, m in enumerate(self.matrices):
            _check_cover(i, m, self.size)
        self.owned = [i for i, m in enumerate(self.matrices) if m.owner == self.rank]

    # ---- there --------------------------------------------------------------------------
    def to_owners(self, local_pieces: Sequence[Sequence[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Send this rank's gather pieces to their owners.

        Args:
            local_pieces: for every matrix i, the tensors of this rank's pieces of
                ``matrices[i].gather`` (those with ``rank == self.rank``), in that order; any
                shape, numel must match. An empty list where this rank holds nothing.

        Returns:
            matrix index → assembled flat owner buffer, for the matrices this rank owns.
        """
        dtype, device = self.dtype, self.device
        send, send_splits = self._pack(
            lambda m: m.gather, lambda i, k: local_pieces[i][k], dtype, device
        )
        recv_splits = [0] * self.size  # to me, as owner: each rank's pieces of my matrices
        for i in self.owned:
            for p in self.matrices[i].gather:
                recv_splits[p.rank] += p.numel
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        comm.all_to_all_single(recv, send, recv_splits, send_splits, self.group)

        buffers = {i: torch.empty(self.matrices[i].numel, dtype=dtype, device=device) for i in self.owned}
        offset = 0
        for src in range(self.size):
            for i in self.owned:
                for p in self.matrices[i].gather:
                    if p.rank == src:
                        buffers[i][p.start : p.start + p.numel] = recv[offset : offset + p.numel]
                        offset += p.numel
        return buffers

    # ---- back ---------------------------------------------------------------------------
    def from_owners(self, owned_buffers: dict[int, torch.Tensor]) -> list[list[torch.Tensor]]:
        """Send slices of the owners' results back to the ranks named in ``returns``.

        Args:
            owned_buffers: matrix index → flat result buffer, for every matrix this rank owns.

        Returns:
            for every matrix i, this rank's pieces of ``matrices[i].returns`` as flat tensors,
            in that order (empty where this rank holds nothing).
        """
        missing = [i for i in self.owned if i not in owned_buffers]
        if missing:
            raise ValueError(f"OwnerExchange.from_owners: no result for owned matrices {missing}")
        dtype, device = self.dtype, self.device

        send_parts: list[torch.Tensor] = []
        send_splits = [0] * self.size
        for dst in range(self.size):
            for i in self.owned:
                for p in self.matrices[i].returns:
                    if p.rank == dst:
                        send_parts.append(owned_buffers[i][p.start : p.start + p.numel].to(dtype))
                        send_splits[dst] += p.numel
        send = _cat(send_parts, dtype, device)
        recv_splits = [0] * self.size  # from each owner: my pieces of the matrices it owns
        for m in self.matrices:
            recv_splits[m.owner] += sum(p.numel for p in m.returns if p.rank == self.rank)
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        comm.all_to_all_single(recv, send, recv_splits, send_splits, self.group)

        out: list[list[torch.Tensor]] = [[] for _ in self.matrices]
        offset = 0
        for src in range(self.size):
            for i, m in enumerate(self.matrices):
                if m.owner != src:
                    continue
                for p in m.returns:
                    if p.rank == self.rank:
                        out[i].append(recv[offset : offset + p.numel])
                        offset += p.numel
        return out

    # ---- helpers ------------------------------------------------------------------------
    def _pack(self, pieces_of, tensor_of, dtype, device):
        parts: list[torch.Tensor] = []
        splits = [0] * self.size
        for dst in range(self.size):
            for i, m in enumerate(self.matrices):
                if m.owner != dst:
                    continue
                mine = [p for p in pieces_of(m) if p.rank == self.rank]
                for k, p in enumerate(mine):
                    t = tensor_of(i, k)
                    if t.numel() != p.numel:
                        raise ValueError(
                            f"OwnerExchange: matrix {i} piece {k} on rank {self.rank} has "
                            f"{t.numel()} elements, the plan says {p.numel}"
                        )
                    if t.dtype != dtype:
                        raise ValueError(
                            f"OwnerExchange: matrix {i} piece {k} is {t.dtype}, this exchange moves {dtype}"
                        )
                    parts.append(t.reshape(-1))
                    splits[dst] += p.numel
        return _cat(parts, dtype, device), splits


def _cat(parts: list[torch.Tensor], dtype, device) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(parts)


def _check_cover(i: int, m: OwnedMatrix, size: int) -> None:
    if not 0 <= m.owner < size:
        raise ValueError(f"OwnerExchange: matrix {i} owner {m.owner} is outside a group of size {size}")
    for name, pieces in (("gather", m.gather), ("scatter", m.returns)):
        for p in pieces:
            if not 0 <= p.rank < size:
                raise ValueError(f"OwnerExchange: matrix {i} {name} piece on rank {p.rank} "
                                 f"outside a group of size {size}")
            if p.start < 0 or p.numel < 0 or p.start + p.numel > m.numel:
                raise ValueError(f"OwnerExchange: matrix {i} {name} piece {p} outside [0, {m.numel})")
    covered = sorted((p.start, p.numel) for p in m.gather)
    cursor = 0
    for start, numel in covered:
        if start != cursor:
            raise ValueError(
                f"OwnerExchange: matrix {i} gather pieces must cover [0, {m.numel}) exactly once; "
                f"gap or overlap at element {min(start, cursor)}"
            )
        cursor += numel
    if cursor != m.numel:
        raise ValueError(f"OwnerExchange: matrix {i} gather pieces cover {cursor} of {m.numel} elements")


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
