"""Owner mode: each matrix is orthogonalized once, on one rank, chosen to balance NS cost.

    1. ``plan_owners`` gives every matrix of the *whole list* an owner (LPT on ``ns_flops`` of the
       full shape); every rank computes the same plan locally.
    2. The list is executed in micro-groups (at most ``bucket_bytes`` of full matrices each,
       ``owner_exchange.split_micro_groups``), each through ``OwnerGroup``:
       ``start``    one all-to-all sends each shard to its owner (asynchronous);
       ``compute``  the owner assembles its full matrices straight from the received pieces into
                    one stacked batch per full shape and runs NS on it;
       ``start_back`` a second all-to-all sends every rank its slice back (asynchronous);
       ``finish``   each rank keeps its slice.
    3. ``comm.pipelined`` interleaves the groups: while NS runs on group k, the gather of group
       k+1 and the return of group k−1 are in flight.
Planning over the whole list and only *executing* by groups keeps the balance of one plan: per
group plans would each restart from zero load and give TP rank 0 the largest matrix of every group.
The pipeline absorbs a group whose owners are unevenly loaded, since a rank waits on a group's
gather only one round after issuing it.

A replicated matrix (partition_dim None) is computed by its owner alone and its result sent to
every other rank in the second all-to-all.

Traffic per sharded matrix of S bytes: (t−1)/t·S there and the same back, summed over ranks
(each non-owner shard moves once each way), i.e. 2(t−1)/t²·S per rank on average: a 2/t fraction
of duplicated's (t−1)/t·S — the same at t = 2, a quarter at t = 8 (Canzona, arXiv 2602.06079) —
and NS runs once per matrix instead of t times.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..core.newton_schulz import newton_schulz, ns_flops
from . import comm, owner_exchange
from .owner_exchange import OwnedMatrix, OwnerExchange, PendingExchange, Piece, split_micro_groups
from .planner import plan_owners
from .sharding import ShardSpec, group_by

__all__ = ["OwnerGroup", "owner_groups", "owner_orthogonalize", "tp_owned_matrix"]


def tp_owned_matrix(spec: ShardSpec, owner: int) -> OwnedMatrix:
    """The exchange plan of one TP-sharded (or replicated) matrix with the given owner."""
    full = spec.full_shape[0] * spec.full_shape[1]
    if not spec.is_sharded:
        return OwnedMatrix(
            owner=owner,
            numel=full,
            gather=(Piece(owner, 0, full),),
            scatter=tuple(Piece(r, 0, full) for r in range(spec.group_size) if r != owner),
        )
    local = spec.local_shape[0] * spec.local_shape[1]
    return OwnedMatrix(
        owner=owner, numel=full, gather=tuple(Piece(r, r * local, local) for r in range(spec.group_size))
    )


class OwnerGroup:
    """One micro-group of owner mode on this rank: its exchange and the batches it computes.

    ``specs`` are the group's matrices (all of one dtype), ``owners`` their TP owners from the
    whole-list plan. Built once per layout (``owner_groups`` is cached); holds no tensor.
    """

    def __init__(self, specs: Sequence[ShardSpec], owners: Sequence[int], dtype: torch.dtype, group,
                 rank: int, device: torch.device) -> None:
        self.specs = list(specs)
        self.rank, self.dtype, self.device = rank, dtype, device
        self.plans = [tp_owned_matrix(s, o) for s, o in zip(self.specs, owners, strict=True)]
        self.exchange = OwnerExchange(self.plans, group, dtype=dtype, device=device)
        owned = [j for j, plan in enumerate(self.plans) if plan.owner == rank]
        # Same-shape matrices this rank owns run as one stacked NS (dion's batching).
        self.batches = list(group_by(owned, lambda j: self.specs[j].full_shape).values())
        self._holds = [any(p.rank == rank for p in plan.gather) for plan in self.plans]

    def start(self, shards: Sequence[torch.Tensor]) -> PendingExchange:
        """Issue the gather: ``shards[j]`` is this rank's ``local_shape`` piece of matrix j."""
        return self.exchange.start_to_owners([[x] if held else [] for x, held in zip(shards, self._holds)])

    def compute(self, gathered: dict[int, list[torch.Tensor]], steps, coefficients, eps) -> dict[int, torch.Tensor]:
        """NS of every matrix this rank owns: j → its full result (a slice of a stacked batch).

        The pieces are copied once, straight into the batch (a row shard is a block of rows, a
        column shard a block of columns of the full matrix): no per-matrix buffer in between.
        """
        results: dict[int, torch.Tensor] = {}
        for js in self.batches:
            shape = self.specs[js[0]].full_shape
            full = torch.empty((len(js), *shape), dtype=self.dtype, device=self.device)
            for b, j in enumerate(js):
                spec, pieces = self.specs[j], gathered[j]
                if spec.is_sharded:
                    blocks = full[b].chunk(spec.group_size, dim=spec.partition_dim)
                    for block, piece in zip(blocks, pieces, strict=True):
                        block.copy_(piece.reshape(spec.local_shape))
                else:
                    full[b].copy_(pieces[0].reshape(shape))
            comm.record_ns_flops(len(js) * ns_flops(*shape, steps))
            for j, res in zip(js, newton_schulz(full, steps, coefficients, eps=eps).unbind(0)):
                results[j] = res
        return results

    def start_back(self, results: dict[int, torch.Tensor]) -> PendingExchange:
        """Issue the return of every owned result: shard r to TP rank r (the whole result to
        every other rank for a replicated matrix)."""
        parts = {}
        for j, res in results.items():
            spec = self.specs[j]
            if spec.is_sharded:
                parts[j] = res.chunk(spec.group_size, dim=spec.partition_dim)
            else:
                parts[j] = [res] * len(self.plans[j].returns)
        return self.exchange.start_from_owners(parts)

    def finish(self, back: dict[int, list[torch.Tensor]], results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's ``local_shape`` result of every matrix of the group, in group order."""
        out = []
        for j, spec in enumerate(self.specs):
            if self.plans[j].owner == self.rank and not spec.is_sharded:
                out.append(results[j])  # the owner keeps its own result of a replicated matrix
            else:
                out.append(back[j][0].reshape(spec.local_shape))
        return out


@functools.lru_cache(maxsize=64)
def owner_groups(specs: tuple[ShardSpec, ...], dtypes: tuple[torch.dtype, ...], members: tuple | None, group,
                 size: int, rank: int, steps: int, bucket_bytes: int, min_groups: int,
                 device: torch.device) -> list[tuple]:
    """The whole-list plan, cut into micro-groups: ``[(positions, OwnerGroup), ...]``.

    ``members``: the caller's micro-groups as tuples of positions into ``specs`` (each of one
    dtype); None cuts each dtype's matrices by ``split_micro_groups(..., bucket_bytes,
    min_groups)`` on full-matrix bytes.
    Cached: a fixed layout gets the same plan and exchanges every step (every argument is
    hashable; layouts are fixed for a run).
    """
    owners = plan_owners([ns_flops(*s.full_shape, steps) for s in specs], size)
    if members is None:
        members = []
        for dtype, positions in group_by(range(len(specs)), lambda j: dtypes[j]).items():
            full_bytes = [specs[j].full_shape[0] * specs[j].full_shape[1] * dtype.itemsize for j in positions]
            chunks = split_micro_groups(full_bytes, bucket_bytes, min_groups)
            members += [[positions[k] for k in chunk] for chunk in chunks]
    out = []
    for positions in members:
        if len({dtypes[j] for j in positions}) > 1:
            raise ValueError("owner mode: a micro-group mixes dtypes; the exchange moves one dtype")
        dtype = dtypes[positions[0]] if positions else torch.float32  # an empty group moves nothing
        out.append((list(positions), OwnerGroup([specs[j] for j in positions], [owners[j] for j in positions],
                                                 dtype, group, rank, device)))
    return out


def owner_orthogonalize(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes, device):
    """``orthogonalize_sharded(mode="owner")``; arguments already validated there, ``device``
    resolved there (``devices.resolve_device``): every exchange buffer is allocated on it."""
    plan = owner_groups(tuple(specs), tuple(shards[s.index].dtype for s in specs), None, group, size, rank,
                        steps, bucket_bytes, owner_exchange.MIN_MICRO_GROUPS, device)
    out: list[torch.Tensor | None] = [None] * len(shards)

    def task(positions, g: OwnerGroup):
        there = g.start([shards[specs[j].index] for j in positions])
        yield
        results = g.compute(there.wait(), steps, coefficients, eps)
        del there
        back = g.start_back(results)
        yield
        for j, res in zip(positions, g.finish(back.wait(), results)):
            out[specs[j].index] = res

    comm.pipelined(task(positions, g) for positions, g in plan)
    return out
