"""``--muon-split-qkv-per-head`` on megatron-core's tiny GPT (GQA: 4 heads in 2 query groups):
trained at TP2 x DP2 (each TP rank holds one query group, whole heads) and TP1 x DP2, with the
distributed optimizer in buckets that cut a QKV matrix across DP ranks (heads cut in the middle),
on the balanced layout, under Megatron-FSDP and without a distributed optimizer, with QK-clip on
top; against one process at TP1 whose ``megatron_muon.Muon`` cuts each QKV into its heads by rows
(``reference_param_groups(per_head=True)``) and orthogonalizes
each alone, scaled by the head's shape.

The refusal of per-head counts taken before TP sharding (DeepSpeed #8384) on the real model:
``catalogue.tag_qkv`` reads the attention module's per-partition counts; a tag planted with the
whole model's counts is refused at the optimizer's construction, naming the weight and the flag.
"""

from __future__ import annotations

import dataclasses

import pytest
from dist_harness import run_world
from megatron_harness import GROUPS, HEADS, HIDDEN
from training_harness import ATOL, Run, references, train_all, worst_param

TIMEOUT = 900
# Megatron's layout of the TP2 shard in buckets of >= 5000 elements, each split over DP2, cuts a QKV
# (tests/megatron/test_qk_clip.py's CUT_QKV_BUCKET; asserted below)
CUT_QKV_BUCKET = 5000
SPLIT = dict(batch=4, split_batch=True, per_head=True)
TAU, ALPHA = 0.09, 0.5  # test_qk_clip's: crossed by some heads at every step
RUNS = [Run(tp=2, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET, **SPLIT),
        Run(tp=2, dist_opt=False, **SPLIT),
        Run(tp=2, tp_mode="duplicated", dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET, **SPLIT),
        Run(tp=2, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET, qk_clip=(TAU, ALPHA), **SPLIT),
        # Megatron-FSDP (optim: one bucket halved over DP2 inside layer 1's QKV, as in test_qk_clip)
        Run(tp=2, dist_opt=True, wrap="megatron_fsdp", sharding="optim", **SPLIT),
        # the balanced layout: every matrix whole on one DP rank, its heads pinned there
        Run(tp=2, dist_opt=True, layout="balanced", **SPLIT)]
RUNS_TP1 = [Run(tp=1, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET, **SPLIT)]


@pytest.fixture(scope="module")
def trained():
    return run_world(4, train_all, RUNS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def trained_tp1():
    return run_world(2, train_all, RUNS_TP1, timeout=TIMEOUT)


def test_per_head_reference_is_not_the_per_group_one():
    """The test could fail: per head and per query group differ by far more than ATOL."""
    per_head = RUNS[0].reference_run
    per_group = dataclasses.replace(per_head, per_head=False)
    refs = references([per_head, per_group], timeout=TIMEOUT)
    worst = max((refs[per_head].full[n] - refs[per_group].full[n]).abs().max().item()
                for n in refs[per_head].full if "linear_qkv" in n)
    assert worst > 100 * ATOL, f"per head moves the QKV weights by only {worst:.2e} from per group"


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_tp2_matches_per_head_reference(trained, index):
    # fp32: the same steps in another summation order (TP's split GEMMs, DP's reductions, the heads
    # batched): training_harness.ATOL, derived there
    reference = references([RUNS[index]], timeout=TIMEOUT)[RUNS[index]]
    result = trained[0][index]
    worst = worst_param(result, reference)
    assert worst[0] <= ATOL, f"{RUNS[index]}: {worst[1]} off by {worst[0]:.2e}"
    if RUNS[index].dist_opt and RUNS[index].layout != "balanced":
        cut = [len(lay.holders(r[index].dp_size)) for r in trained for lay in r[index].layouts
               if "linear_qkv" in lay.name]
        assert max(cut) > 1, "no QKV matrix is cut across DP"


def test_tp2_heads_are_each_tp_ranks_own_matrices(trained):
    """Each TP rank holds one query group whole (2 query heads, its k and v head): the QKV layouts
    are per rank, their matrices the heads (head_dim x hidden), which the step runs on their TP rank
    (tests/dist/test_per_head.py counts the TP bytes: none)."""
    head = (HIDDEN // HEADS, HIDDEN)
    for ranks in trained:
        for index, run in enumerate(RUNS):
            qkv = [lay for lay in ranks[index].layouts if "linear_qkv" in lay.name]
            assert qkv and all(lay.per_rank for lay in qkv), run
            assert all(lay.sub_global_shapes() == [head] * ((HEADS + 2 * GROUPS) // 2) for lay in qkv), run


def _planted_worker(rank: int, world: int) -> str:
    """Build the TP2 optimizer with the QKV's head counts taken before TP sharding (the whole
    model's query groups on each rank, DeepSpeed #8384's bug): the error it raises."""
    from training_harness import refusal_of

    from megatron_muon.megatron import catalogue

    honest = catalogue.qkv_heads_of

    def before_sharding(attention):
        groups, per_group, head_dim = honest(attention)
        return groups * 2, per_group, head_dim

    return refusal_of(Run(tp=2, per_head=True), catalogue, "qkv_heads_of", before_sharding)


def test_head_counts_taken_before_tp_sharding_are_refused():
    for message in run_world(2, _planted_worker, timeout=TIMEOUT, fresh=True):
        assert "linear_qkv" in message and "--muon-split-qkv-per-head" in message, message
        assert "after TP sharding" in message and "\n" not in message


def test_tp1_dp2_matches_per_head_reference(trained_tp1):
    reference = references(RUNS_TP1, timeout=TIMEOUT)[RUNS_TP1[0]]
    worst = worst_param(trained_tp1[0][0], reference)
    assert worst[0] <= ATOL, f"{RUNS_TP1[0]}: {worst[1]} off by {worst[0]:.2e}"
