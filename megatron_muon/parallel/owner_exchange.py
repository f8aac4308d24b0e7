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
collective sequence is identical everywhere. Two consequences of the plan being the same on every
rank: a piece already on its owner never enters the all-to-all (the owner reads it in place, so a
matrix that lies wholly on its owner costs no copy), and a direction in which the plan moves no
piece between ranks is not issued at all, by any rank.

The routes (who sends what to whom, split sizes, buffer offsets) are derived once, when the
exchange is built; callers build an exchange once per layout and reuse it every step. Both
directions come in a blocking form (``to_owners`` / ``from_owners``) and an asynchronous one
(``start_to_owners`` / ``start_from_owners``, whose ``wait()`` gives the pieces) for the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..plan.exchange import OwnedMatrix
from . import comm

__all__ = ["OwnerExchange", "PendingExchange"]


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
        self._there = _Route.build(self.matrices, self.rank, self.size, back=False)
        self._back = _Route.build(self.matrices, self.rank, self.size, back=True)
        # local_pieces[i][k] is this rank's k-th piece of matrix i: its index in m.gather.
        self._mine = [[n for n, p in enumerate(m.gather) if p.rank == self.rank] for m in self.matrices]

    # ---- there --------------------------------------------------------------------------
    def start_to_owners(self, local_pieces: Sequence[Sequence[torch.Tensor]]) -> PendingExchange:
        """Send this rank's gather pieces to their owners; ``wait()`` gives, per owned matrix,
        its pieces in ``gather`` order (flat views of the receive buffer, or this rank's own
        tensors as given, read in place: treat them as read-only).

        Args:
            local_pieces: for every matrix i, the tensors of this rank's pieces of
                ``matrices[i].gather`` (those with ``rank == self.rank``), in that order; any
                shape, numel must match. An empty list where this rank holds nothing.
        """
        if len(local_pieces) != len(self.matrices):
            raise ValueError(f"OwnerExchange: {len(local_pieces)} piece lists for {len(self.matrices)} matrices")
        for i, mine in enumerate(self._mine):
            if len(local_pieces[i]) != len(mine):
                raise ValueError(f"OwnerExchange: matrix {i} on rank {self.rank}: {len(local_pieces[i])} pieces "
                                 f"given, the plan has {len(mine)}")

        def source(i: int, n: int) -> torch.Tensor:
            t = local_pieces[i][self._mine[i].index(n)]
            if t.dtype != self.dtype:
                raise ValueError(f"OwnerExchange: matrix {i} piece {n} is {t.dtype}, this exchange moves {self.dtype}")
            return t

        return self._start(self._there, source)

    def to_owners(self, local_pieces: Sequence[Sequence[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Blocking ``start_to_owners``: matrix index → its assembled flat owner buffer, for the
        matrices this rank owns (the piece itself, not a copy, when the owner holds all of it)."""
        got = self.start_to_owners(local_pieces).wait()
        return {i: self.assemble(i, got[i]) for i in self.owned}

    def assemble(self, i: int, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """Matrix i's flat owner buffer from its pieces in ``gather`` order; no copy for one piece."""
        m = self.matrices[i]
        if len(pieces) == 1:
            return pieces[0].reshape(-1)
        buf = torch.empty(m.numel, dtype=self.dtype, device=self.device)
        for p, t in zip(m.gather, pieces, strict=True):
            buf[p.start : p.start + p.numel] = t.reshape(-1)
        return buf

    # ---- back ---------------------------------------------------------------------------
    def start_from_owners(self, results: Mapping[int, torch.Tensor | Sequence[torch.Tensor]]) -> PendingExchange:
        """Send slices of the owners' results back to the ranks named in ``returns``; ``wait()``
        gives, per matrix, this rank's pieces of ``returns`` in that order (matrices it gets
        nothing of are absent).

        Args:
            results: for every matrix this rank owns, its flat result buffer (sliced by the
                plan), or the tensors of its ``returns`` pieces in order (any shape, numel must
                match: the owner mode hands the TP shards of a full matrix, some of them strided).
        """
        missing = [i for i in self.owned if i not in results]
        if missing:
            raise ValueError(f"OwnerExchange.from_owners: no result for owned matrices {missing}")

        def source(i: int, n: int) -> torch.Tensor:
            r = results[i]
            if isinstance(r, torch.Tensor):
                p = self.matrices[i].returns[n]
                return r[p.start : p.start + p.numel]
            return r[n]

        return self._start(self._back, source)

    def from_owners(self, owned_buffers: Mapping[int, torch.Tensor]) -> list[list[torch.Tensor]]:
        """Blocking ``start_from_owners``: for every matrix i, this rank's pieces of
        ``matrices[i].returns`` as flat tensors, in that order (empty where it holds nothing)."""
        got = self.start_from_owners(owned_buffers).wait()
        return [[t.reshape(-1) for t in got.get(i, [])] for i in range(len(self.matrices))]

    # ---- the one code path of both directions ---------------------------------------------
    def _start(self, route: _Route, source: Callable[[int, int], torch.Tensor]) -> PendingExchange:
        def checked(i: int, n: int, numel: int) -> torch.Tensor:
            t = source(i, n)
            if t.numel() != numel:
                raise ValueError(f"OwnerExchange: matrix {i} piece {n} on rank {self.rank} has {t.numel()} "
                                 f"elements, the plan says {numel}")
            return t

        # One copy into the send buffer per outgoing piece (a strided shard is gathered by the
        # copy itself); pieces that stay on this rank are not copied at all.
        send = torch.empty(sum(route.send_splits), dtype=self.dtype, device=self.device)
        offset = 0
        for i, n, numel in route.send:
            t = checked(i, n, numel)
            send[offset : offset + numel].view(t.shape).copy_(t)
            offset += numel
        kept = [(i, n, checked(i, n, numel)) for i, n, numel in route.keep]
        recv = torch.empty(sum(route.recv_splits), dtype=self.dtype, device=self.device)
        if route.moves:
            pending = comm.all_to_all_single_async(recv, send, list(route.recv_splits), list(route.send_splits),
                                                   self.group)
        else:  # no piece changes rank anywhere in the group: no rank issues the collective
            pending = comm.Pending(None)
        return PendingExchange(pending, recv, route.recv, kept)


class PendingExchange:
    """One direction of an exchange in flight; ``wait()`` (once) → matrix index → the pieces
    that landed on this rank, in piece order. Holds the receive buffer (and, through the
    collective's handle, the send buffer) until then, and nothing after: the caller's views do."""

    def __init__(self, pending: comm.Pending, recv: torch.Tensor, recv_order, kept) -> None:
        self._pending, self._recv, self._recv_order, self._kept = pending, recv, recv_order, kept

    def wait(self) -> dict[int, list[torch.Tensor]]:
        if self._recv is None:
            raise RuntimeError("PendingExchange.wait: already waited; its pieces were handed over then")
        self._pending.wait()
        got: dict[int, dict[int, torch.Tensor]] = {}
        for i, n, t in self._kept:
            got.setdefault(i, {})[n] = t
        offset = 0
        for i, n, numel in self._recv_order:
            got.setdefault(i, {})[n] = self._recv[offset : offset + numel]
            offset += numel
        self._kept = self._recv = None  # the views above keep what is still needed
        return {i: [by_piece[n] for n in sorted(by_piece)] for i, by_piece in got.items()}


@dataclass(frozen=True)
class _Route:
    """One direction of an exchange as seen by one rank, derived from the plan alone."""

    send: tuple[tuple[int, int, int], ...]
    """(matrix, piece index, numel) in send-buffer order: by destination, matrix, piece."""
    send_splits: tuple[int, ...]
    recv: tuple[tuple[int, int, int], ...]
    """(matrix, piece index, numel) in receive-buffer order: by source, matrix, piece."""
    recv_splits: tuple[int, ...]
    keep: tuple[tuple[int, int, int], ...]
    """(matrix, piece index, numel) of pieces that start and end on this rank: never copied."""
    moves: bool
    """whether any piece changes rank anywhere in the group (the same answer on every rank)."""

    @staticmethod
    def build(matrices: Sequence[OwnedMatrix], rank: int, size: int, *, back: bool) -> _Route:
        # There: a gather piece goes from its holder to the owner. Back: a returns piece goes
        # from the owner to its holder. Both sides enumerate (matrix, piece) in the same order
        # for a given (source, destination) pair, so offsets agree without communication.
        hops = [(i, n, p.numel, *((m.owner, p.rank) if back else (p.rank, m.owner)))
                for i, m in enumerate(matrices) for n, p in enumerate(m.returns if back else m.gather)]
        send_splits, recv_splits = [0] * size, [0] * size
        send, recv, keep = [], [], []
        for peer in range(size):
            for i, n, numel, src, dst in hops:
                if src == rank and dst == peer and peer != rank:
                    send.append((i, n, numel))
                    send_splits[peer] += numel
                if dst == rank and src == peer and peer != rank:
                    recv.append((i, n, numel))
                    recv_splits[peer] += numel
        keep = [(i, n, numel) for i, n, numel, src, dst in hops if src == dst == rank]
        moves = any(src != dst and numel > 0 for _, _, numel, src, dst in hops)
        return _Route(tuple(send), tuple(send_splits), tuple(recv), tuple(recv_splits), tuple(keep), moves)


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


