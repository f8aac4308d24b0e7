"""The plan's digests (``plan.digest``): which field a difference lands in, and what leaves them alone.

The one-plan check at construction (``parallel.step_setup``, tested across ranks in
tests/dist/test_step_setup.py) names the first field whose digest differs; these tests pin that a
change of each input moves its own field first, that names do not count, and that the startup
report's warm-up line appears only with a device measurement.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.optimizer import step_plans
from megatron_muon.parallel.step_setup import SetupReport
from megatron_muon.plan.digest import PLAN_FIELDS, plan_digests
from megatron_muon.plan.hardware import CPU_GLOO
from megatron_muon.plan.topology import Topology

FIELDS = [name for name, _ in PLAN_FIELDS]
HARDWARE = dataclasses.replace(CPU_GLOO, matmul_flops=1e6, collective_latency_s=0.0, kernel_overhead_s=0.0,
                               ranks_per_node=2)


def _layouts(names=("a", "b"), ranges=((0, 300), (300, 576))):
    """A 48 x 12 matrix cut over 2 DP ranks at element 300 (inside a row), and a 12 x 60 one held by
    DP rank 1."""
    return [MatrixLayout(names[0], (48, 12), None, 1, None, ranges),
            MatrixLayout(names[1], (12, 60), None, 1, None, ((0, 0), (0, 720)))]


def _digests(layouts=None, hardware=HARDWARE, topology=None, **config):
    plan = step_plans(MuonConfig(tp_mode="auto", **config), layouts or _layouts(), 2, 1, hardware, topology)["muon"]
    return dict(zip(FIELDS, plan_digests(plan)))


def _first_difference(a: dict, b: dict) -> str | None:
    return next((f for f in FIELDS if a[f] != b[f]), None)


def test_each_input_moves_its_own_field_first():
    base = _digests()
    assert _first_difference(base, _digests()) is None  # deterministic: the same plan twice
    assert _first_difference(base, _digests(hardware=dataclasses.replace(HARDWARE, matmul_flops=1e7))) == \
        "hardware constants"
    assert _first_difference(base, _digests(num_ns_steps=6)) == "step settings"
    shapes = [MatrixLayout("a", (48, 12), None, 1, None, ((0, 300), (300, 576))),
              MatrixLayout("b", (12, 48), None, 1, None, ((0, 0), (0, 576)))]
    assert _first_difference(base, _digests(shapes)) == "matrices"
    assert _first_difference(base, _digests(_layouts(ranges=((0, 288), (288, 576))))) == "DP ranges"


def test_the_rank_map_moves_its_own_field_first():
    """The stage's DP ranks 0 and 1 on one node of 2 or on two nodes of 1 (another launch), and at
    global ranks 4 and 5 (another PP stage's; the same node structure): each moves the rank map,
    never the step settings, which hold every other setting."""
    one_node = _digests(topology=Topology.contiguous(2, 1, 2))
    assert _first_difference(one_node, _digests(topology=Topology.contiguous(2, 1, 2))) is None
    assert _first_difference(one_node, _digests(topology=Topology.contiguous(2, 1, 1))) == "rank map"
    later_stage = _digests(topology=Topology.contiguous(2, 1, 2, first=4))
    assert _first_difference(one_node, later_stage) == "rank map" and later_stage["step settings"] == \
        one_node["step settings"]
    # no map (None: the contiguous default) and a given one are different inputs
    assert _first_difference(_digests(), one_node) == "rank map"


def test_names_and_profile_labels_do_not_count():
    base = _digests()
    assert _digests(_layouts(names=("x", "y"))) == base
    assert _digests(hardware=dataclasses.replace(HARDWARE, name="other", source="elsewhere")) == base


def test_the_digests_are_int64():
    assert all(-2**63 <= d < 2**63 for d in _digests().values())
    torch.tensor(list(_digests().values()), dtype=torch.int64)  # what the check all-gathers


def test_the_startup_report_says_what_the_warm_up_took_on_cuda_only():
    from megatron_muon.megatron.report import startup_report

    config = MuonConfig(tp_mode="owner")
    chunk = torch.nn.Module()
    chunk.linear_fc2 = torch.nn.Linear(32, 64, bias=False)
    plans = step_plans(config, [MatrixLayout("chunk0.linear_fc2.weight", (64, 32), None, 1)], 1, 1)
    cuda = SetupReport(team_groups=1, groups_warmed=3, collectives=14, seconds=0.4, device_bytes=300_000_000,
                       allocator_bytes=2_097_152)
    line = ("  process groups made and warmed up at build: 3 groups of this rank, 1 DP team groups, 0.4 s; device "
            "memory taken 300.0 MB (297.9 MB outside PyTorch's caching allocator: NCCL's communicators and peer "
            "buffers)")
    assert line in startup_report(plans, [chunk], config, setup=cuda).splitlines()
    cpu = dataclasses.replace(cuda, device_bytes=None, allocator_bytes=None)
    assert "warmed up" not in startup_report(plans, [chunk], config, setup=cpu)
