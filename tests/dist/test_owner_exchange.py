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
from megatron_muon.parallel.owner_exchange import OwnerExchange
from megatron_muon.plan.exchange import OwnedMatrix, Piece

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
    # A matrix that lies wholly on its owner is read in place: the buffer is the caller's tensor.
    in_place = {i: buffers[i].data_ptr() == local[i][0].data_ptr()
                for i in exchange.owned if [r for r, *_ in CUTS[i][1]] == [rank]}

    # Asynchronous: two gathers and two returns of the same exchange in flight at once, waited
    # in the other order; each must give what the blocking calls gave.
    tripled = [[3 * x for x in pieces] for pieces in local]
    first, second = exchange.start_to_owners(local), exchange.start_to_owners(tripled)
    got_second, got_first = second.wait(), first.wait()
    async_buffers = {i: exchange.assemble(i, got_first[i]) for i in exchange.owned}
    async_tripled = {i: exchange.assemble(i, got_second[i]) for i in exchange.owned}
    back_first = exchange.start_from_owners({i: 2 * b + 1 for i, b in async_buffers.items()})
    back_second = exchange.start_from_owners({i: b for i, b in async_tripled.items()})
    async_back_second, async_back_first = back_second.wait(), back_first.wait()

    # Every rank owns the one matrix it holds: nothing changes rank, so nobody issues anything.
    still = OwnerExchange([OwnedMatrix(r, 5, (Piece(r, 0, 5),)) for r in range(t)], dtype=torch.float64,
                          device=group_device())
    with comm_stats() as quiet:
        still_back = still.from_owners(still.to_owners([[torch.full((5,), float(rank), dtype=torch.float64)]
                                                        if r == rank else [] for r in range(t)]))
    return {
        "buffers": buffers,
        "back": back,
        "bytes": stats.bytes_sent,
        "calls": dict(stats.calls),
        "rep_back": rep_back,
        "in_place": in_place,
        "async_buffers": async_buffers,
        "async_tripled": async_tripled,
        "async_back_first": async_back_first,
        "async_back_second": async_back_second,
        "still": (dict(quiet.calls), still_back),
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
    # 2 per exchange on every rank, but the replicated one's way there moves nothing (its owner
    # gathers its own copy), so by the plan, which every rank shares, no rank issues it.
    assert all(r["calls"] == {"all_to_all": 3} for r in ranks)


def test_a_matrix_on_its_owner_is_not_copied(ranks):
    # CUTS[1] lies wholly on rank 2, its owner
    assert ranks[2]["in_place"] == {1: True}


def test_async_exchanges_in_flight_together(ranks):
    for rank, r in enumerate(ranks):
        for i, buf in r["buffers"].items():
            assert torch.equal(r["async_buffers"][i], buf)
            assert torch.equal(r["async_tripled"][i], 3 * buf)
        for i, (n, cut) in enumerate(CUTS):
            mine = [(s, k) for q, s, k in cut if q == rank]
            got_first = r["async_back_first"].get(i, [])
            got_second = r["async_back_second"].get(i, [])
            assert len(got_first) == len(got_second) == len(mine)
            for (s, k), a, b in zip(mine, got_first, got_second):
                assert torch.equal(a.reshape(-1), (2 * _flat(i, n) + 1)[s : s + k])
                assert torch.equal(b.reshape(-1), 3 * _flat(i, n)[s : s + k])


def test_an_exchange_that_moves_nothing_issues_nothing(ranks):
    for rank, r in enumerate(ranks):
        calls, back = r["still"]
        assert calls == {}
        # the owner's own piece comes back to it (a view of its result, no copy); nothing else
        assert [len(pieces) for pieces in back] == [int(q == rank) for q in range(WORLD)]
        assert torch.equal(back[rank][0], torch.full((5,), float(rank), dtype=torch.float64))


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
