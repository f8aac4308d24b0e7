"""Owner planner: exact tie-breaking, argument checks, and load balance on Llama-3 shapes.

Single process, no torch.distributed. The Megatron comparison only runs megatron-core's layout
function (pure index arithmetic) on meta-device parameters, so nothing the size of a model is
allocated.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

from megatron_muon.core.models import llama3_matrices
from megatron_muon.core.newton_schulz import ns_flops
from megatron_muon.plan.owners import plan_owners, rank_loads

MODELS = ("8B", "70B", "405B")
NUM_RANKS = 8  # TP=8: owner mode draws owners from the tensor-parallel group
# Required by the issue: LPT on ns_flops must keep the busiest rank within 3% of the mean.
MAX_OVER_MEAN = 1.03
# Megatron DDP's default bucket: max(40M, 1M·dp) elements (DistributedDataParallel.__init__,
# when ddp_config.bucket_size is None); at dp = 8 that is 40M.
MEGATRON_BUCKET_SIZE = max(40_000_000, 1_000_000 * NUM_RANKS)


def _imbalance(loads: list[float]) -> float:
    """max/mean of per-rank loads (1.0 = perfect balance)."""
    return max(loads) / (sum(loads) / len(loads))


def _llama_costs(model: str) -> list[int]:
    # Owner mode runs NS on the FULL (unsharded) matrix, so that is what each owner pays.
    return [ns_flops(rows, cols) for _, rows, cols, _ in llama3_matrices(model)]


def _ours(model: str, num_ranks: int = NUM_RANKS) -> float:
    costs = _llama_costs(model)
    return _imbalance(rank_loads(costs, plan_owners(costs, num_ranks), num_ranks))


def _megatron(model: str, num_ranks: int = NUM_RANKS) -> float:
    """max/mean NS FLOPs per rank under megatron-core's layer-wise (Muon) param assignment."""
    mats = llama3_matrices(model)
    params = []
    for _, rows, cols, _ in mats:  # forward (model-definition) order, as Megatron expects
        p = torch.nn.Parameter(torch.empty(rows, cols, device="meta"))
        p.is_managed_by_layer_wise_optimizer = True
        params.append(p)
    layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
        params, MEGATRON_BUCKET_SIZE, num_ranks, DistributedDataParallelConfig()
    )
    assert len(layout.layouts) == 1  # one dtype, all layer-wise managed: a single buffer
    (buffer_layout,) = layout.layouts.values()
    loads = [0.0] * num_ranks
    for p, (_, rows, cols, _) in zip(params, mats, strict=True):
        start, end, bucket_id = buffer_layout.param_index_map[p]
        bucket_start, bucket_end = buffer_layout.bucket_indices[bucket_id]
        shard_size = (bucket_end - bucket_start) // num_ranks
        rank = (start - bucket_start) // shard_size
        assert (end - 1 - bucket_start) // shard_size == rank  # a param never straddles shards
        loads[rank] += ns_flops(rows, cols)
    return _imbalance(loads)


# ---------------------------------------------------------------------------------------------
# plan_owners: exact behaviour


def test_deterministic():
    costs = _llama_costs("8B") + [3.0, 3.0, 0.0, 7.5]
    first = plan_owners(costs, NUM_RANKS)
    assert plan_owners(costs, NUM_RANKS) == first
    assert plan_owners(tuple(costs), NUM_RANKS) == first


def test_equal_costs_keep_input_order():
    # The first of two equal costs is placed first, so it takes the lower rank.
    assert plan_owners([5, 5], 2) == [0, 1]
    # Order: idx1(3)->r0, idx2(3)->r1, idx0(2)->r0 (3 vs 3: lowest rank), idx3(1)->r1.
    # Visiting equal costs in reverse input order would give [0, 1, 0, 1].
    assert plan_owners([2, 3, 3, 1], 2) == [0, 0, 1, 1]


def test_equal_loads_go_to_lowest_rank():
    assert plan_owners([0, 0, 0], 3) == [0, 0, 0]  # every load stays 0: always rank 0
    assert plan_owners([1], 4) == [0]
    # idx0->r0 (3), idx1->r1 (2), idx2->r1 (3, 3), idx3 sees a 3/3 tie -> r0.
    assert plan_owners([3, 2, 1, 1], 2) == [0, 1, 1, 0]
    # Mid-plan ties among several ranks: loads (4,1,1) -> r1; then (4,2,1) -> r2.
    assert plan_owners([4, 1, 1, 1, 1], 3) == [0, 1, 2, 1, 2]


def test_one_rank_owns_everything():
    assert plan_owners([3.0, 0.0, 1e12, 2], 1) == [0, 0, 0, 0]
    assert plan_owners([], 1) == []


def test_more_ranks_than_matrices():
    owners = plan_owners([5, 1, 3], 8)
    assert len(set(owners)) == 3
    assert owners == [0, 2, 1]  # by decreasing cost onto ranks 0, 1, 2
    owners = plan_owners([1.0] * 7, 8)
    assert owners == list(range(7))


def test_rank_loads_sums_per_rank():
    costs = [2, 3, 3, 1]
    assert rank_loads(costs, plan_owners(costs, 2), 2) == [5.0, 4.0]
    with pytest.raises(ValueError):
        rank_loads(costs, [0, 1], 2)  # length mismatch


@pytest.mark.parametrize("num_ranks", [0, -1, 2.0, True])
def test_bad_num_ranks(num_ranks):
    with pytest.raises(ValueError, match="num_ranks"):
        plan_owners([1.0], num_ranks)


@pytest.mark.parametrize("bad", [-1.0, -1e-300, math.nan, float("-inf")])
def test_bad_cost(bad):
    with pytest.raises(ValueError, match=r"cost of matrix 1 must be >= 0"):
        plan_owners([1.0, bad, 2.0], 2)


# ---------------------------------------------------------------------------------------------
# Llama-3 shapes


def test_llama3_shapes():
    expected = {  # model: (layers, qkv, proj, fc1, fc2), full (unsharded) shapes
        "8B": (32, (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
        "70B": (80, (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)),
        "405B": (126, (18432, 16384), (16384, 16384), (106496, 16384), (16384, 53248)),
    }
    for model, (layers, *shapes) in expected.items():
        mats = llama3_matrices(model)
        assert len(mats) == 4 * layers
        assert mats[0][0] == "layers.0.linear_qkv"
        assert mats[-1][0] == f"layers.{layers - 1}.linear_fc2"
        for i in range(layers):
            got = mats[4 * i : 4 * i + 4]
            names = [f"layers.{i}.linear_{n}" for n in ("qkv", "proj", "fc1", "fc2")]
            assert [m[0] for m in got] == names
            assert [(m[1], m[2]) for m in got] == shapes
            assert [m[3] for m in got] == [0, 1, 0, 1]  # Column, Row, Column, Row
    with pytest.raises(ValueError, match=r"'13B'.*8B.*70B.*405B"):
        llama3_matrices("13B")


# ---------------------------------------------------------------------------------------------
# Load balance on real models


@pytest.mark.parametrize("model", MODELS)
def test_lpt_balance_llama3(model):
    assert _ours(model) <= MAX_OVER_MEAN


def test_lpt_vs_megatron_layer_wise():
    """Our plan balances NS FLOPs at least as well as Megatron's layer-wise assignment.

    Megatron packs each DDP bucket by numel (LPT per bucket); we pack all matrices by FLOPs.
    """
    rows = [(model, _ours(model), _megatron(model)) for model in MODELS]
    print(f"\nNS FLOPs max/mean over {NUM_RANKS} ranks (Megatron bucket {MEGATRON_BUCKET_SIZE:,})")
    print(f"{'model':>6}  {'ours':>8}  {'megatron':>8}")
    for model, ours, megatron in rows:
        print(f"{model:>6}  {ours:8.4f}  {megatron:8.4f}")
    for model, ours, megatron in rows:
        assert ours <= megatron + 1e-9, (model, ours, megatron)


def test_dp_owners_balance_the_method_that_runs():
    """With ``--muon-ns-method gram`` the DP owners are balanced on Gram NS FLOPs, not the
    standard iteration's. Three 64 × 64 (standard under both methods: 30 units of 64³ each) and
    one 64 × 224 (aspect 3.5: standard 80 units, Gram 56) on 2 ranks: on standard costs the long
    one is alone on a rank (80 against 90); on Gram costs it shares with a square (86 against 60)."""
    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.core.newton_schulz import NSOptions, method_flops
    from megatron_muon.plan.owners import plan_dp_owners

    layouts = [MatrixLayout(f"m{i}", shape, None, 1) for i, shape in enumerate([(64, 64)] * 3 + [(64, 224)])]
    for method in ("standard", "gram"):
        costs = [method_flops(method, *lay.full_shape, 5) for lay in layouts]
        assert [lay.ns_cost(5, method) for lay in layouts] == costs
        assert plan_dp_owners(layouts, 2, NSOptions(5, method=method)) == plan_owners(costs, 2)
    assert plan_dp_owners(layouts, 2, NSOptions(5)) == [1, 1, 1, 0]
    assert plan_dp_owners(layouts, 2, NSOptions(5, method="gram")) == [1, 1, 0, 0]
