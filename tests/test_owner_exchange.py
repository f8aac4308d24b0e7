"""The owner exchange on uneven flat pieces, as Megatron's DP fragments will cut matrices.

Three ranks hold contiguous flat ranges of several matrices cut at arbitrary offsets (some
ranks hold nothing of a matrix, one rank holds two pieces of one matrix). Each owner must
receive exactly the flat matrix; after it transforms the buffer, every rank must get back
exactly its own ranges of the transformed buffer.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world

from megatron_muon import comm_stats
from megatron_muon.parallel.devices import group_device
from megatron_muon.parallel.owner_exchange import OwnedMatrix, OwnerExchange, Piece

WORLD = 3

# matrix numel and its cut: (rank, start, numel) pieces covering [0, numel)
CUTS = [
    (100, [(0, 0, 37), (1, 37, 50), (2, 87, 13)]),
    (64, [(2, 0, 64)]),  # lies wholly in one rank's range: never needs to move if owned there
    (90, [(1, 0, 10), (0, 10, 30), (1, 40, 50)]),  # rank 1 holds two pieces, rank 2 none
    (7, [(0, 0, 3), (2, 3, 4)]),
]
OWNERS = [1, 2, 0, 1]


def _matrices() -> list[OwnedMatrix]:
    return [
        OwnedMatrix(owner=o, numel=n, gather=tuple(Piece(*p) for p in cut))
        for o, (n, cut) in zip(OWNERS, CUTS)
    ]


def _flat(i: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float64) + 1000 * i


def _exchange_worker(rank: int, t: int) -> dict:
    exchange = OwnerExchange(_matrices(), dtype=torch.float64, device=group_device())
    local = [
        [_flat(i, n)[s : s + k] for r, s, k in cut if r == rank] for i, (n, cut) in enumerate(CUTS)
    ]
    # A replicated matrix: the owner (rank 2) computes, every other rank receives the whole result.
    replicated = OwnerExchange(
        [OwnedMatrix(owner=2, numel=6, gather=(Piece(2, 0, 6),), scatter=(Piece(0, 0, 6), Piece(1, 0, 6)))],
        dtype=torch.float64,
        device=group_device(),
    )
    with comm_stats() as stats:
        buffers = exchange.to_owners(local)
        back = exchange.from_owners({i: 2 * b + 1 for i, b in buffers.items()})
        rep_buffers = replicated.to_owners([[torch.ones(6, dtype=torch.float64)] if rank == 2 else []])
        rep_back = replicated.from_owners({i: b * 5 for i, b in rep_buffers.items()})
    return {
        "buffers": buffers,
        "back": back,
        "bytes": stats.bytes_sent,
        "calls": dict(stats.calls),
        "rep_back": rep_back,
    }


@pytest.fixture(scope="module")
def ranks():
    return run_world(WORLD, _exchange_worker)


def test_owners_receive_the_whole_flat_matrix(ranks):
    for i, ((n, _), owner) in enumerate(zip(CUTS, OWNERS)):
        assert set(ranks[owner]["buffers"]) >= {i}
        assert torch.equal(ranks[owner]["buffers"][i], _flat(i, n))
        for r in range(WORLD):
            if r != owner:
                assert i not in ranks[r]["buffers"]


def test_every_rank_gets_back_its_own_ranges(ranks):
    for rank in range(WORLD):
        for i, (n, cut) in enumerate(CUTS):
            want = [(2 * _flat(i, n) + 1)[s : s + k] for r, s, k in cut if r == rank]
            got = ranks[rank]["back"][i]
            assert len(got) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_traffic_is_exactly_the_pieces_that_change_rank(ranks):
    # Pieces not held by their owner travel once each way; 8 bytes per float64 element.
    moved = sum(k for o, (_, cut) in zip(OWNERS, CUTS) for r, _, k in cut if r != o)
    replicated = 2 * 6 * 8  # owner rank 2 sends its 6 results to ranks 0 and 1
    assert sum(r["bytes"] for r in ranks) == 2 * moved * 8 + replicated
    assert all(r["calls"] == {"all_to_all": 4} for r in ranks)  # 2 per exchange, on every rank


def test_replicated_result_reaches_every_rank(ranks):
    assert torch.equal(ranks[0]["rep_back"][0][0], torch.full((6,), 5.0, dtype=torch.float64))
    assert torch.equal(ranks[1]["rep_back"][0][0], torch.full((6,), 5.0, dtype=torch.float64))
    assert ranks[2]["rep_back"][0] == []  # the owner keeps its own result


@pytest.mark.parametrize(
    "matrix, match",
    [
        (OwnedMatrix(0, 10, (Piece(0, 0, 4), Piece(0, 5, 5))), r"matrix 0 gather pieces must cover \[0, 10\)"),
        (OwnedMatrix(0, 10, (Piece(0, 0, 6), Piece(0, 4, 6))), r"gap or overlap"),
        (OwnedMatrix(0, 10, (Piece(0, 0, 4),)), r"cover 4 of 10 elements"),
        (OwnedMatrix(1, 4, (Piece(0, 0, 4),)), r"owner 1 is outside a group of size 1"),
        (OwnedMatrix(0, 4, (Piece(0, 2, 4),)), r"outside \[0, 4\)"),
    ],
)
def test_bad_plans_are_rejected(matrix, match):
    with pytest.raises(ValueError, match=match):
        OwnerExchange([matrix], device=group_device())


def test_piece_size_mismatch_is_named():
    exchange = OwnerExchange([OwnedMatrix(0, 4, (Piece(0, 0, 4),))], device=group_device())
    with pytest.raises(ValueError, match=r"matrix 0 piece 0 on rank 0 has 3 elements, the plan says 4"):
        exchange.to_owners([[torch.ones(3)]])
