"""Owner mode: each matrix is orthogonalized once, on one rank, chosen to balance NS cost.

    1. ``plan_owners`` gives every matrix an owner (LPT on ``ns_flops`` of the full shape);
       every rank computes the same plan locally.
    2. One all-to-all sends each shard to its owner (``OwnerExchange.to_owners``).
    3. The owner reassembles its full matrices and runs NS on each same-shape set as one batch.
    4. A second all-to-all sends every rank its slice back (``OwnerExchange.from_owners``).
    5. Matrices are processed in rounds of at most ``bucket_bytes`` of full matrices, so a
       large model never materializes more than that per exchange.
A replicated matrix (partition_dim None) is computed by its owner alone and its result sent to
every other rank in the same second all-to-all.

Traffic per sharded matrix of S bytes: (t−1)/t·S there and the same back, summed over ranks
(each non-owner shard moves once each way), i.e. 2(t−1)/t²·S per rank on average: a 2/t fraction
of duplicated's (t−1)/t·S — the same at t = 2, a quarter at t = 8 (Canzona, arXiv 2602.06079) —
and NS runs once per matrix instead of t times.
"""

from __future__ import annotations

import torch

from ..core.newton_schulz import newton_schulz, ns_flops
from . import comm
from .owner_exchange import OwnedMatrix, OwnerExchange, Piece, split_rounds
from .planner import plan_owners
from .sharding import ShardSpec, group_by, matrix_to_owner_buffer, owner_buffer_to_matrix

__all__ = ["owner_orthogonalize", "tp_owned_matrix"]


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


def owner_orthogonalize(shards, specs, group, size, rank, steps, coefficients, eps, bucket_bytes, device):
    """``orthogonalize_sharded(mode="owner")``; arguments already validated there, ``device``
    resolved there (``devices.resolve_device``): every exchange buffer is allocated on it."""
    owners = plan_owners([ns_flops(*s.full_shape, steps) for s in specs], size)
    out: list[torch.Tensor | None] = [None] * len(shards)
    for dtype, members in group_by(specs, lambda s: shards[s.index].dtype).items():
        full_bytes = [s.full_shape[0] * s.full_shape[1] * shards[s.index].element_size() for s in members]
        for chunk in split_rounds(full_bytes, bucket_bytes):
            batch = [members[j] for j in chunk]
            _one_round(shards, batch, owners, out, group, size, rank, steps, coefficients, eps, dtype, device)
    return out


def _one_round(shards, batch, owners, out, group, size, rank, steps, coefficients, eps, dtype, device):
    plans = [tp_owned_matrix(s, owners[s.index]) for s in batch]
    exchange = OwnerExchange(plans, group, dtype=dtype, device=device)
    local = [
        [shards[s.index]] if any(p.rank == rank for p in plan.gather) else []
        for s, plan in zip(batch, plans)
    ]
    buffers = exchange.to_owners(local)

    # Orthogonalize everything this rank owns, one batched call per full shape.
    results: dict[int, torch.Tensor] = {}
    owned = [j for j in range(len(batch)) if plans[j].owner == rank]
    for js in group_by(owned, lambda j: batch[j].full_shape).values():
        full = torch.stack([owner_buffer_to_matrix(buffers[j], batch[j]) for j in js])
        comm.record_ns_flops(len(js) * ns_flops(*batch[js[0]].full_shape, steps))
        for j, res in zip(js, newton_schulz(full, steps, coefficients, eps=eps).unbind(0)):
            results[j] = matrix_to_owner_buffer(res, batch[j])

    back = exchange.from_owners(results)
    for j, s in enumerate(batch):
        if plans[j].owner == rank and not s.is_sharded:
            out[s.index] = results[j].view(s.local_shape)  # the owner keeps its own result
        else:
            out[s.index] = back[j][0].view(s.local_shape)
