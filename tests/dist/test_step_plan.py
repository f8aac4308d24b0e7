"""The step plan against the step that executes it: per rank NS FLOPs and bytes of every TP mode.

The tiny layouts of test_orthogonalize_updates (fused QKV, gate/up fc1, a row-parallel weight, a
replicated one, cut into Megatron-style DP ranges) run through orthogonalize_updates on 4 gloo
ranks (TP2 x DP2), and each rank's counted FLOPs and bytes must be what its plan says
(``plan.step_plan``: the plan the step executed, its costs derived from its decisions).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from step_harness import payload_bytes, run_step, step_plan
from matrix_harness import global_matrix, layouts, tp_local

from megatron_muon import comm_stats

TP, DP = 2, 2
MODES = ("owner", "duplicated", "distributed", "blockwise")
METHODS = ("standard", "gram")  # --muon-ns-method: Gram NS's FLOPs and its distributed all-reduces


def _worker(rank: int, world: int) -> dict:
    tp_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(DP)]
    dp_groups = [dist.new_group(list(range(j, world, TP))) for j in range(TP)]
    tp_rank, dp_rank = rank % TP, rank // TP
    out = {}
    for cut in (True, False):
        lays = layouts(TP, DP, cut=cut)
        pieces = []
        for i, lay in enumerate(lays):
            s, e = lay.local_range(dp_rank)
            pieces.append(tp_local(global_matrix(i, TP), lay.partition_dim, TP, tp_rank).reshape(-1)[s:e].clone())
        for mode in MODES:
            for method in METHODS:
                with comm_stats() as stats:
                    run_step(pieces, lays, tp_mode=mode, dp_group=dp_groups[tp_rank], tp_group=tp_groups[dp_rank],
                             ns_dtype=torch.bfloat16, ns_method=method)
                out[(cut, mode, method)] = (stats.ns_flops, payload_bytes(stats))
    return out


@pytest.fixture(scope="module")
def measured():
    return run_world(TP * DP, _worker)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cut", [True, False], ids=["dp_cut", "dp_whole"])
@pytest.mark.parametrize("mode", MODES)
def test_plan_matches_the_step(measured, mode, cut, method):
    lays = layouts(TP, DP, cut=cut)
    plan = step_plan(lays, tp_mode=mode, dp_size=DP, tp_size=TP, ns_dtype=torch.bfloat16, ns_method=method)
    for rank, result in enumerate(measured):
        flops, sent = result[(cut, mode, method)]
        assert flops == plan.ns_flops[rank], f"rank {rank}: {flops} FLOPs, plan {plan.ns_flops[rank]}"
        # distributed: the ring all-reduce's bytes are rounded per call, the plan per matrix
        assert abs(sent - plan.bytes_sent[rank]) <= (8 if mode == "distributed" else 0), (rank, sent, plan.bytes_sent)
