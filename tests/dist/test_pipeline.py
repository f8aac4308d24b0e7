"""The micro-group pipeline of ``orthogonalize_updates`` (``comm.pipelined``).

Four gloo ranks, TP2 x DP2, run the matrices of test_orthogonalize_updates (fused QKV, gate/up fc1,
row- and column-parallel weights, a replicated one), every one but one cut across the two DP ranks
(as the distributed optimizer cuts a matrix that straddles a bucket's DP boundary; the other lies
wholly on DP rank 1), with a bucket small enough for several micro-groups: both the DP exchange
and the TP owner exchange run pipelined, asynchronously. The result must be the
single-process NS of the global sub-matrices and, bitwise, the result of one micro-group; every
rank must issue the same collectives in the same order; group k+1's gathers must be issued before
group k's NS, and the updates must be handed over group by group; plans are built once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from matrix_harness import expected_bound, expected_local, global_matrix, tp_local
from matrix_harness import layouts as whole_layouts
from step_harness import run_step, step_plan

from megatron_muon.parallel import comm, orthogonalize, owner_exchange
from megatron_muon.parallel.orthogonalize import StepGroups, orthogonalize_updates
from megatron_muon.plan import exchange
from megatron_muon.plan.exchange import split_micro_groups

TP, DP = 2, 2
ELEMENT = 4  # fp32 NS, so that the comparison with the single-process reference is tight
MODES = ("owner", "auto", "duplicated")  # pipelined TP owner exchange; owner + blocking modes; blocking


def layouts(tp: int, dp: int, cut: bool = True) -> list:
    """Every matrix cut at a third between the two DP ranks, except proj, wholly on DP rank 1."""
    import dataclasses

    assert dp == 2 and cut
    out = []
    for lay in whole_layouts(tp, dp, cut=False):
        n = lay.numel
        ranges = ((0, 0), (0, n)) if lay.name == "proj" else ((0, n // 3), (n // 3, n))
        out.append(dataclasses.replace(lay, dp_ranges=ranges))
    return out


def _full_bytes(lays) -> list[int]:
    return [lay.numel * ELEMENT * (TP if lay.partition_dim is not None else 1) for lay in lays]


def _bucket(lays) -> int:
    """Room for the largest matrix only: (about) one matrix per micro-group."""
    return max(_full_bytes(lays))


def _worker(rank: int, world: int) -> dict:
    tp_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(DP)]
    dp_groups = [dist.new_group(list(range(j, world, TP))) for j in range(TP)]
    tp_rank, dp_rank = rank % TP, rank // TP
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    lays = layouts(TP, DP, cut=True)
    pieces = []
    for i, lay in enumerate(lays):
        s, e = lay.local_range(dp_rank)
        pieces.append(tp_local(global_matrix(i, TP), lay.partition_dim, TP, tp_rank).reshape(-1)[s:e].clone())
    events: list[tuple] = []

    def observe(c: comm.Collective) -> None:
        ranks = tuple(dist.get_process_group_ranks(c.group))
        events.append(("collective", ranks, c.primitive, c.input_split_sizes, c.output_split_sizes))

    record_ns_flops = comm.record_ns_flops

    def record(flops: int) -> None:  # NS runs right after it is counted
        events.append(("ns", flops))
        record_ns_flops(flops)

    def run(tp_mode: str, bucket: int, **kwargs):
        return run_step(pieces, lays, tp_mode=tp_mode, dp_group=dp_group, tp_group=tp_group,
                        ns_dtype=torch.float32, coefficients="jordan", bucket_bytes=bucket, **kwargs)

    out: dict = {"tp_rank": tp_rank, "dp_rank": dp_rank}
    comm.record_ns_flops = record
    try:
        # auto on the CPU profile without collective latency: these small matrices then go to
        # owner (NS once, not on both TP ranks); with the profile's 50 µs per call, the owner
        # pipeline's two all-to-alls per micro-group make duplicated win every one of them.
        from megatron_muon.plan.hardware import hardware_profile

        no_latency = dataclasses.replace(hardware_profile("cpu-gloo"), collective_latency_s=0.0)
        for mode in MODES:
            events.clear()
            with comm.observe_collectives(observe):
                out[mode] = run(mode, _bucket(lays), **({"hardware": no_latency} if mode == "auto" else {}))
            out[(mode, "events")] = list(events)
        # The updates handed over as they come back: the same values as the returned list.
        events.clear()
        handed: dict[int, torch.Tensor] = {}

        def apply(i: int, update: torch.Tensor, scale: float) -> None:
            events.append(("apply", i))
            handed[i] = update.to(torch.float32) * scale

        with comm.observe_collectives(observe):
            assert run("owner", _bucket(lays), apply=apply) is None
        out["apply"] = (handed, list(events))
    finally:
        comm.record_ns_flops = record_ns_flops

    # One micro-group: no overlap at all, the reference for the pipelined results.
    floor = exchange.MIN_MICRO_GROUPS  # read when a plan is built
    exchange.MIN_MICRO_GROUPS = 1
    try:
        for mode in MODES:
            out[(mode, "one group")] = run(mode, 2**40)
    finally:
        exchange.MIN_MICRO_GROUPS = floor

    # A second step with the same plan builds nothing: its exchanges are bound to the groups once.
    plan = step_plan(lays, tp_mode="owner", dp_size=DP, tp_size=TP, ns_dtype=torch.float32, coefficients="jordan",
                     bucket_bytes=_bucket(lays))
    groups = StepGroups(dp_group, tp_group)
    orthogonalize_updates(pieces, plan, groups)
    built = []
    original_init, original_execution = owner_exchange.OwnerExchange.__init__, orthogonalize._Execution.__init__

    def counting(original):
        def init(self, *args, **kwargs):
            built.append(type(self).__name__)
            original(self, *args, **kwargs)
        return init

    owner_exchange.OwnerExchange.__init__ = counting(original_init)
    orthogonalize._Execution.__init__ = counting(original_execution)
    try:
        orthogonalize_updates(pieces, plan, groups)
        out["rebuilt"] = list(built)
    finally:
        owner_exchange.OwnerExchange.__init__ = original_init
        orthogonalize._Execution.__init__ = original_execution
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(TP * DP, _worker)


def _tp_ranks(dp_rank: int) -> tuple[int, ...]:
    return tuple(range(dp_rank * TP, (dp_rank + 1) * TP))


def test_the_layout_runs_in_several_groups_with_cut_matrices():
    lays = layouts(TP, DP, cut=True)
    assert len(split_micro_groups(_full_bytes(lays), _bucket(lays))) >= 3
    assert sum(len(lay.holders(DP)) > 1 for lay in lays) == len(lays) - 1


@pytest.mark.parametrize("mode", MODES)
def test_both_exchanges_ran_pipelined(ranks, mode):
    for r in ranks:
        collectives = [e for e in r[(mode, "events")] if e[0] == "collective" and e[2] == "all_to_all"]
        dp = [e for e in collectives if e[1] != _tp_ranks(r["dp_rank"])]
        tp = [e for e in collectives if e[1] == _tp_ranks(r["dp_rank"])]
        assert len(dp) >= 2 * 3, f"{mode}: {len(dp)} DP exchanges, expected one there and back per group"
        if mode != "duplicated":  # duplicated gathers with all_gather, outside the owner exchange
            assert len(tp) >= 3, f"{mode}: {len(tp)} TP owner exchanges"


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_equals_single_process_newton_schulz(ranks, mode):
    lays = layouts(TP, DP, cut=True)
    for r in ranks:
        for i, lay in enumerate(lays):
            s, e = lay.local_range(r["dp_rank"])
            want = expected_local(i, lay, TP, r["tp_rank"]).reshape(-1)[s:e]
            got = r[mode][i]
            assert got.shape == want.shape
            err = (got - want).abs().max().item() if e > s else 0.0
            # fp32 NS; only the summation order differs from the single-process reference
            # (matrix_harness.expected_bound derives the bound).
            assert err <= expected_bound(i, lay, TP), f"{mode} {lay.name} rank {r['tp_rank']},{r['dp_rank']}: {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_equals_one_group(ranks, mode):
    # Grouping only changes which matrices share a stacked NS batch and when the exchanges run;
    # each matrix goes through the same ops. Measured bitwise for these shapes with one thread,
    # but a batched GEMM of another batch count need not block each entry alike (nothing in MKL
    # or oneDNN promises it, on another CPU or thread count), so the bound is the exact modes'
    # (matrix_harness.expected_bound); a routing bug, a matrix's update in another's place, is off
    # by its entries' size, ~0.3·scale.
    lays = layouts(TP, DP, cut=True)
    for r in ranks:
        for i, (a, b) in enumerate(zip(r[mode], r[(mode, "one group")], strict=True)):
            assert (a - b).abs().max().item() <= expected_bound(i, lays[i], TP) if a.numel() else True


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_issues_the_same_collectives(ranks, mode):
    by_group: dict[tuple, dict[int, list]] = {}
    for rank, r in enumerate(ranks):
        for _, group, primitive, sends, receives in (e for e in r[(mode, "events")] if e[0] == "collective"):
            by_group.setdefault(group, {}).setdefault(rank, []).append((primitive, sends, receives))
    assert len(by_group) == 4  # two TP groups, two DP groups
    for group, members in by_group.items():
        assert sorted(members) == list(group), f"{group}: some member issued nothing"
        first, *others = group
        for other in others:
            a, b = members[first], members[other]
            assert [p for p, *_ in a] == [p for p, *_ in b], f"{mode} {group}: ranks {first}, {other} differ"
            ia, ib = group.index(first), group.index(other)
            for (prim, send_a, recv_a), (_, send_b, recv_b) in zip(a, b):
                if prim == "all_to_all":  # what one sends the other expects
                    assert send_a[ib] == recv_b[ia] and send_b[ia] == recv_a[ib], f"{mode} {group}"


def test_next_gather_is_issued_before_this_groups_newton_schulz(ranks):
    for r in ranks:
        events = r[("owner", "events")]
        tp = _tp_ranks(r["dp_rank"])
        first_ns = next(k for k, e in enumerate(events) if e[0] == "ns")
        tp_issued = [k for k, e in enumerate(events) if e[0] == "collective" and e[1] == tp]
        dp_issued = [k for k, e in enumerate(events) if e[0] == "collective" and e[1] != tp]
        # When the first NS runs, the DP gathers of two groups and the TP gather of the next one
        # are already in flight (rounds advance the youngest group first).
        assert sum(k < first_ns for k in dp_issued) >= 2
        assert sum(k < first_ns for k in tp_issued) >= 1
        last_ns = max(k for k, e in enumerate(events) if e[0] == "ns")
        assert any(k > last_ns for k in tp_issued + dp_issued), "the last returns follow the last NS"


def test_updates_are_handed_over_group_by_group(ranks):
    for r in ranks:
        handed, events = r["apply"]
        assert sorted(handed) == list(range(len(r["owner"])))
        for i, update in handed.items():
            assert torch.equal(update, r["owner"][i])  # the same values as the returned list
        applies = [k for k, e in enumerate(events) if e[0] == "apply"]
        collectives = [k for k, e in enumerate(events) if e[0] == "collective"]
        assert applies[0] < collectives[-1], "the first group's updates must arrive before the step ends"


def test_plans_and_exchanges_are_built_once(ranks):
    for r in ranks:
        assert r["rebuilt"] == []


# ---- the scheduler alone ---------------------------------------------------------------------


def _task(name: str, stages: int, log: list):
    for stage in range(stages):
        log.append((name, stage))
        if stage < stages - 1:
            yield


def test_rounds_advance_the_youngest_group_first():
    log: list = []
    comm.pipelined(_task(k, 3, log) for k in range(4))
    # Round r starts task r, then moves task r−1 to its stage 1 and task r−2 to its stage 2, so
    # task k's stage 1 (its NS) runs after task k+1's stage 0 (the next gather) was issued.
    assert log == [
        (0, 0),
        (1, 0), (0, 1),
        (2, 0), (1, 1), (0, 2),
        (3, 0), (2, 1), (1, 2),
        (3, 1), (2, 2),
        (3, 2),
    ]


def test_tasks_without_stages_and_errors():
    log: list = []
    comm.pipelined(_task(k, 1, log) for k in range(3))  # nothing asynchronous: one after another
    assert log == [(0, 0), (1, 0), (2, 0)]

    def failing():
        yield
        raise RuntimeError("stage 1 failed")

    with pytest.raises(RuntimeError, match="stage 1 failed"):
        comm.pipelined([failing()])
