"""Owner mode: each matrix is orthogonalized once, on one rank, chosen to balance NS cost.

    1. The step plan gives every matrix of the *whole list* an owner (``plan_owners``: LPT on
       ``ns_flops`` of the full shape); every rank builds the same plan locally.
    2. The list is executed in micro-groups (at most ``bucket_bytes`` of full matrices each,
       ``plan.exchange.split_micro_groups``), each through ``OwnerMicroGroup``:
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
every other rank in the second all-to-all. A head that TP's row cut splits (``MatrixLayout.tp_rows``:
per-head QKV at TP above the query groups) travels as its holders' rows, to one of them and back.

Traffic per sharded matrix of S bytes: (t−1)/t·S there and the same back, summed over ranks
(each non-owner shard moves once each way), i.e. 2(t−1)/t²·S per rank on average: a 2/t fraction
of duplicated's (t−1)/t·S — the same at t = 2, a quarter at t = 8 (Canzona, arXiv 2602.06079) —
and NS runs once per matrix instead of t times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions
from ..plan.exchange import tp_owned_matrix
from . import comm
from .owner_exchange import OwnerExchange, PendingExchange
from .sharding import group_by

__all__ = ["OwnerMicroGroup"]


class OwnerMicroGroup:
    """One micro-group of owner mode on this rank: its exchange and the batches it computes.

    ``subs`` are the group's sub-matrices (TP-sharded ``MatrixLayout``s, all exchanged in one
    dtype), ``owners`` their TP owners from the plan (``StepPlan.work``: LPT over everything the
    DP owner holds). Built once per plan and groups; holds no tensor.
    """

    def __init__(self, subs: Sequence[MatrixLayout], owners: Sequence[int], dtype: torch.dtype, group,
                 rank: int, device: torch.device) -> None:
        self.subs = list(subs)
        self.rank, self.dtype, self.device = rank, dtype, device
        self.routes = [tp_owned_matrix(s, o) for s, o in zip(self.subs, owners, strict=True)]
        self.exchange = OwnerExchange(self.routes, group, dtype=dtype, device=device)
        owned = [j for j, route in enumerate(self.routes) if route.owner == rank]
        # Same-shape matrices this rank owns run as one stacked NS (dion's batching).
        self.batches = list(group_by(owned, lambda j: self.subs[j].full_shape).values())
        self._holds = [any(p.rank == rank for p in route.gather) for route in self.routes]

    def start(self, shards: Sequence[torch.Tensor]) -> PendingExchange:
        """Issue the gather: ``shards[j]`` is this rank's ``local_shape`` piece of matrix j."""
        return self.exchange.start_to_owners([[x] if held else [] for x, held in zip(shards, self._holds)])

    def compute(self, gathered: dict[int, list[torch.Tensor]], ns: NSOptions) -> dict[int, torch.Tensor]:
        """NS of every matrix this rank owns: j → its full result (a slice of a stacked batch).

        The pieces are copied once, straight into the batch (a row shard is a block of rows, a
        column shard a block of columns of the full matrix): no per-matrix buffer in between.
        """
        results: dict[int, torch.Tensor] = {}
        for js in self.batches:
            shape = self.subs[js[0]].full_shape
            full = torch.empty((len(js), *shape), dtype=self.dtype, device=self.device)
            for b, j in enumerate(js):
                sub, pieces = self.subs[j], gathered[j]
                if sub.tp_rows is not None:  # a head's rows from its holders, each a flat range of it
                    flat = full[b].view(-1)
                    for p, piece in zip(self.routes[j].gather, pieces, strict=True):
                        flat[p.start : p.start + p.numel].copy_(piece.reshape(-1))
                elif sub.is_sharded:
                    blocks = full[b].chunk(sub.tp_size, dim=sub.partition_dim)
                    for block, piece in zip(blocks, pieces, strict=True):
                        block.copy_(piece.reshape(sub.local_shape))
                else:
                    full[b].copy_(pieces[0].reshape(shape))
            comm.record_ns_flops(len(js) * ns.flops(*shape))
            for j, res in zip(js, ns(full).unbind(0)):
                results[j] = res
        return results

    def start_back(self, results: dict[int, torch.Tensor]) -> PendingExchange:
        """Issue the return of every owned result: shard r to TP rank r (the whole result to
        every other rank for a replicated matrix)."""
        parts = {}
        for j, res in results.items():
            sub = self.subs[j]
            if sub.tp_rows is not None:
                parts[j] = res.reshape(-1)  # sliced by the plan: each holder's rows
            elif sub.is_sharded:
                parts[j] = res.chunk(sub.tp_size, dim=sub.partition_dim)
            else:
                parts[j] = [res] * len(self.routes[j].returns)
        return self.exchange.start_from_owners(parts)

    def finish(self, back: dict[int, list[torch.Tensor]], results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's ``local_shape`` result of every matrix of the group, in group order."""
        out = []
        for j, sub in enumerate(self.subs):
            if sub.tp_rows is not None:  # this rank's rows of a head (none: empty)
                lo, hi = sub.tp_rows[self.rank]
                out.append(back[j][0].reshape(hi - lo, sub.local_shape[1]) if hi > lo
                           else torch.empty(0, sub.local_shape[1], dtype=self.dtype, device=self.device))
            elif self.routes[j].owner == self.rank and not sub.is_sharded:
                out.append(results[j])  # the owner keeps its own result of a replicated matrix
            else:
                out.append(back[j][0].reshape(sub.local_shape))
        return out
