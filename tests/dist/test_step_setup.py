"""What the optimizer's construction prepares for its steps (``parallel.step_setup``), in gloo worlds.

A world of 6 ranks stands for two pipeline stages of a TP 1 job under ``auto``: stage A is a DP
group of 4 whose hardware puts 2 ranks on a node, so its plan gives units to two DP teams of two
({0, 1} and {2, 3}); stage B is a DP group of 2 with other matrices, whose only team is its whole
DP group (reused, no new group). ``torch.distributed.new_group`` and ``split_group`` are spied on
while the optimizer is built and while it steps: every group is made at construction, by every
rank (stage B's ranks too, whose plan needs neither of A's teams), in the same order, never with
``use_local_synchronization``, with the DP group's timeout, and nothing is made in a step. The
collectives a step issues on each group are all of kinds the construction already issued there
(the warm-up).

Two DP ranks handed different hardware constants are refused at construction, on both ranks, in
the one line of docs/bad_inputs.md's ``api-plan-mismatch`` row; ``broadcast_hardware`` gives every
rank rank 0's constants.
"""

from __future__ import annotations

import dataclasses
import datetime
import json

import pytest
import torch
import torch.distributed as dist
from bad_inputs_table import expected_line
from dist_harness import run_world
from matrix_harness import packed_layouts

from megatron_muon.config import MuonConfig
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW
from megatron_muon.parallel.comm import observe_collectives
from megatron_muon.parallel.step_setup import broadcast_hardware
from megatron_muon.plan.hardware import CPU_GLOO

# Compute-bound (slow GEMMs, free collectives), as tests/dist/test_dp_teams.py: the schedule gives
# the large units to teams. Two ranks per node: DP 4 has two teams of two.
TEAM_HARDWARE = dataclasses.replace(CPU_GLOO, name="compute-bound", matmul_flops=1e6, collective_latency_s=0.0,
                                    kernel_overhead_s=0.0, ranks_per_node=2)
STAGES = {"A": ((0, 1, 2, 3), [("tall", (48, 12)), ("wide", (12, 60)), ("small", (6, 10))]),
          "B": ((4, 5), [("wide", (12, 48)), ("tall", (36, 12))])}
CONFIG = dict(tp_mode="auto", fp32_matmul_prec="highest", coefficient_type="jordan")
DP_TIMEOUT = datetime.timedelta(minutes=7)  # not torch's default: a team inherits its DP group's


def _optimizer(members, shapes, dp_group, tp_group, config: MuonConfig, dp_rank: int) -> MuonWithAdamW:
    lays = packed_layouts(shapes, len(members))
    params = []
    for i, lay in enumerate(lays):
        lo, hi = lay.local_range(dp_rank)
        full = torch.randn(lay.local_shape, generator=torch.Generator().manual_seed(10 + i))
        params.append(torch.nn.Parameter(full.reshape(-1)[lo:hi].clone()) if hi > lo else None)
    return MuonWithAdamW([dict(params=[p for p in params if p is not None], algorithm="muon")], lr=0.1,
                         config=config, catalogue=MatrixCatalogue(tuple(lays), tuple(params), dp_group, tp_group))


def _kind(primitive: str) -> str:
    """A collective's kind: the all-gathers carry tags (metadata, warm-up) besides their primitive."""
    return primitive if primitive in ("all_to_all", "all_reduce", "broadcast") else "all_gather"


def _spy_worker(rank: int, world: int, hardware_json: str) -> dict:
    stage = "A" if rank < 4 else "B"
    members, shapes = STAGES[stage]
    dp_groups = {name: dist.new_group(list(m), timeout=DP_TIMEOUT) for name, (m, _) in STAGES.items()}
    tp_groups = [dist.new_group([r]) for r in range(world)]  # TP 1
    calls, phase, seen = [], ["construction"], {"construction": set(), "step": set()}
    originals = {name: getattr(dist, name) for name in ("new_group", "split_group")}

    def spy(name):
        def call(*args, **kwargs):
            ranks = kwargs.get("ranks", kwargs.get("split_ranks", args[0] if args else None))
            calls.append((phase[0], name, sorted(ranks) if ranks is not None else None,
                          bool(kwargs.get("use_local_synchronization", False)), kwargs.get("timeout")))
            return originals[name](*args, **kwargs)
        return call

    def observe(c):
        ranks = tuple(dist.get_process_group_ranks(c.group)) if c.group is not None else None
        seen[phase[0]].add((ranks, _kind(c.primitive)))

    for name in originals:
        setattr(dist, name, spy(name))
    try:
        with observe_collectives(observe):
            opt = _optimizer(members, shapes, dp_groups[stage], tp_groups[rank],
                             MuonConfig(auto_hardware=hardware_json, **CONFIG), members.index(rank))
            phase[0] = "step"
            for _ in range(2):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(rank))
                opt.step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    plan = opt.plan
    return {"calls": calls, "seen": seen, "team_size": plan.team_size, "dp_size": plan.dp_size,
            "teamed": sum(1 for u in range(len(plan.units)) if plan.team_of(u) is not None)}


@pytest.fixture(scope="module")
def spied(tmp_path_factory):
    path = tmp_path_factory.mktemp("step_setup") / "hardware.json"
    path.write_text(json.dumps(dataclasses.asdict(TEAM_HARDWARE)))
    return run_world(6, _spy_worker, str(path))


def test_every_group_is_made_at_construction_by_every_rank_in_one_order(spied):
    ranks = spied
    # not vacuous: stage A runs units on teams of two, stage B on its whole DP group
    assert ranks[0]["team_size"] == 2 and ranks[0]["teamed"] > 0, ranks[0]
    assert ranks[4]["team_size"] == ranks[4]["dp_size"] == 2 and ranks[4]["teamed"] > 0, ranks[4]
    for rank, r in enumerate(ranks):
        assert all(when == "construction" for when, *_ in r["calls"]), (rank, r["calls"])
        assert not any(local for _, _, _, local, _ in r["calls"]), (rank, r["calls"])
    # the same calls in the same order on every rank, B's included: A's two teams, B's reused
    made = [(name, members) for _, name, members, _, _ in ranks[0]["calls"]]
    assert made == [("new_group", [0, 1]), ("new_group", [2, 3])], made
    for rank, r in enumerate(ranks):
        assert [(name, members) for _, name, members, _, _ in r["calls"]] == made, rank
        # a member makes its team with its DP group's timeout (the factory passes Megatron's)
        assert all(timeout == DP_TIMEOUT for _, _, members, _, timeout in r["calls"] if rank in members), rank


def test_each_collective_of_a_step_was_warmed_up_at_construction(spied):
    for rank, r in enumerate(spied):
        step, built = r["seen"]["step"], r["seen"]["construction"]
        assert step, rank  # the step talks: DP exchange, team all-reduces and gathers
        assert step <= built, (rank, sorted(step - built, key=repr))
        groups = {g for g, _ in step}
        assert any(g is not None and len(g) == 2 for g in groups), (rank, groups)  # a team's collectives


def _mismatch_worker(rank: int, world: int, paths: list[str]) -> dict:
    """DP 2 at TP 1 under auto, each rank with its own hardware file; then broadcast_hardware."""
    tp = [dist.new_group([r]) for r in range(world)][rank]
    config = MuonConfig(auto_hardware=paths[rank], **CONFIG)
    try:
        _optimizer((0, 1), STAGES["A"][1], dist.group.WORLD, tp, config, rank)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "broadcast": broadcast_hardware(config.hardware())}


def test_different_hardware_constants_are_refused_in_one_line_on_every_rank(tmp_path):
    """The row ``api-plan-mismatch``: rank 1's GEMMs 10x faster. Not a hang: both ranks refuse
    at construction, before any step posts a collective."""
    paths = []
    for rank, flops in enumerate((1e6, 1e7)):
        path = tmp_path / f"hardware{rank}.json"
        path.write_text(json.dumps(dataclasses.asdict(dataclasses.replace(TEAM_HARDWARE, matmul_flops=flops))))
        paths.append(str(path))
    ranks = run_world(2, _mismatch_worker, paths, timeout=180)
    line = expected_line("api-plan-mismatch")
    for rank, r in enumerate(ranks):
        assert r["error"] is not None and line.fullmatch(r["error"]), (rank, r["error"])
        assert r["broadcast"].matmul_flops == 1e6, rank  # rank 0's, on both ranks
