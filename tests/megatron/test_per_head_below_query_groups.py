"""``--muon-split-qkv-per-head`` on megatron-core's tiny GPT with fewer query groups than TP ranks.

megatron-core 0.19.2 (``Attention.get_query_key_value_tensors``, num_query_groups < world size)
gives each TP rank a contiguous 1/TP of ``linear_qkv``'s rows, ``[q heads; k; v]`` per query group,
all-gathers the projection's output and keeps its own group's heads. Per head, the rank's slice
holds whole heads when TP divides the count of query, k and v heads, and cuts heads otherwise:

* 4 heads in 1 query group (6 head blocks): TP2, 3 whole heads a rank; TP4, 1.5 heads a rank, two
  heads cut between ranks (gathered on one by the owner exchange over TP);
* 4 heads in 2 query groups (8 head blocks) at TP4: 2 whole heads a rank (q1 q2 | k1 v1 | ...).

Against one process at TP1 whose ``megatron_muon.Muon`` cuts each QKV into its heads by rows
(``reference_param_groups(per_head=True)``), at TP4 x DP1 in owner, duplicated, distributed and
auto mode (the cut heads run the owner exchange in each), TP2 x DP2 and TP4 x DP2 under ZeRO-1 with
buckets that cut QKV across DP ranks, TP4 x DP2 on the balanced layout and under Megatron-FSDP.
The bytes: the cut and the aligned TP4 runs differ by the cut heads' rows alone
(``tests/dist/test_per_head_query_groups_tp.py`` counts the collectives' elements on the layouts).
"""

from __future__ import annotations

import pytest
from dist_harness import run_world
from megatron_harness import HIDDEN
from training_harness import ATOL, ATOL_ADAMW, Run, references, train_all, worst_by_optimizer

TIMEOUT = 1800
CUT = dict(heads=4, groups=1)  # at TP4: 6 heads of 16 rows over 4 ranks of 24 rows
ALIGNED = dict(heads=4, groups=2)  # at TP4: 8 heads over 4 ranks, 2 whole heads each
HEAD_DIM = HIDDEN // 4
# ZeRO-1 in buckets of >= 5000 elements cuts a QKV across DP2 at TP2 (test_per_head_training's
# CUT_QKV_BUCKET), of >= 2000 at TP4 (its QKV shards are 24 or 32 x 64); asserted below
CUT_QKV_BUCKET, CUT_QKV_BUCKET_TP4 = 5000, 2000
SPLIT = dict(batch=4, split_batch=True, per_head=True)
RUNS_TP4 = [Run(tp=4, attention=CUT, per_head=True),
            Run(tp=4, attention=ALIGNED, per_head=True),
            Run(tp=4, attention=CUT, tp_mode="duplicated", per_head=True),
            Run(tp=4, attention=CUT, tp_mode="distributed", per_head=True),
            Run(tp=4, attention=CUT, tp_mode="auto", per_head=True)]
RUNS_TP2 = [Run(tp=2, attention=CUT, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET, **SPLIT)]
RUNS_TP4_DP2 = [Run(tp=4, attention=CUT, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET_TP4, **SPLIT),
                Run(tp=4, attention=ALIGNED, dist_opt=True, layout_bucket_size=CUT_QKV_BUCKET_TP4, **SPLIT),
                # every matrix whole on one DP rank (the cut heads' QKV one DP unit, pinned there)
                Run(tp=4, attention=CUT, dist_opt=True, layout="balanced", **SPLIT),
                # Megatron-FSDP (optim: each bucket halved over DP2; at TP4 the halves fall between
                # QKVs, so this checks the FSDP road, not a QKV cut across DP)
                Run(tp=4, attention=CUT, dist_opt=True, wrap="megatron_fsdp", sharding="optim", **SPLIT)]


@pytest.fixture(scope="module")
def trained():
    """Each world's runs: TP4 x DP1 and TP2 x DP2 in the pool's world of 4, TP4 x DP2 in 8 fresh
    processes."""
    return {"tp4": run_world(4, train_all, RUNS_TP4, timeout=TIMEOUT),
            "tp2": run_world(4, train_all, RUNS_TP2, timeout=TIMEOUT),
            "tp4dp2": run_world(8, train_all, RUNS_TP4_DP2, timeout=TIMEOUT, fresh=True)}


ALL = [("tp4", i) for i in range(len(RUNS_TP4))] + [("tp2", 0)] + [("tp4dp2", i) for i in range(len(RUNS_TP4_DP2))]
RUNS = {"tp4": RUNS_TP4, "tp2": RUNS_TP2, "tp4dp2": RUNS_TP4_DP2}


@pytest.mark.parametrize("world,index", ALL, ids=[f"{w}-{i}" for w, i in ALL])
def test_matches_per_head_reference(trained, world, index):
    # fp32: the same steps in another summation order (TP's split GEMMs, DP's reductions, the heads
    # batched; a cut head's rows moved, not rounded, to its owner): the Muon matrices within
    # training_harness.ATOL, derived there, the AdamW params within its ATOL_ADAMW, and why
    run = RUNS[world][index]
    reference = references([run], timeout=TIMEOUT)[run]
    result = trained[world][0][index]
    muon, adamw = worst_by_optimizer(result, reference)
    assert muon[0] <= ATOL, f"{run}: {muon[1]} off by {muon[0]:.2e}"
    assert adamw[0] <= ATOL_ADAMW, f"{run}: {adamw[1]} off by {adamw[0]:.2e}"
    if run.dist_opt and run.layout != "balanced" and run.wrap == "ddp":
        cut = [len(lay.holders(r[index].dp_size)) for r in trained[world] for lay in r[index].layouts
               if "linear_qkv" in lay.name]
        assert max(cut) > 1, "no QKV matrix is cut across DP"


def test_layouts_follow_megatrons_row_cut(trained):
    """The QKV layouts as the catalogue reads megatron-core's module: per rank heads where the row
    cut falls on head boundaries, else the whole weight's 6 heads, two of them cut between ranks."""
    for ranks in trained["tp4"]:
        cut = [lay for lay in ranks[0].layouts if "linear_qkv" in lay.name]
        assert cut and all(lay.tp_blocks == (HEAD_DIM,) * 6 and not lay.per_rank for lay in cut)
        held = [sum(hi > lo for lo, hi in sub.tp_rows) for lay in cut[:1] for sub in lay.sub_matrices()]
        assert held == [1, 2, 1, 1, 2, 1]
        aligned = [lay for lay in ranks[1].layouts if "linear_qkv" in lay.name]
        assert aligned and all(lay.per_rank and lay.sub_global_shapes() == [(HEAD_DIM, HIDDEN)] * 2
                               for lay in aligned)
    for ranks in trained["tp2"]:
        assert all(lay.per_rank and len(lay.sub_global_shapes()) == 3
                   for lay in ranks[0].layouts if "linear_qkv" in lay.name)


def test_more_bytes_only_for_heads_cut_by_tp(trained):
    """The TP4 runs of the cut and the aligned attention have the same projection and MLP, the same
    owner plan for them (the heads are outside its LPT) and no DP dim, so their step's bytes differ
    by the QKVs' alone: nothing for the aligned heads, and per layer the two cut heads, each half
    on two ranks: every rank sends one half head (HEAD_DIM / 2 rows of HIDDEN), there or back."""
    from training_harness import MUON

    from megatron_muon.config import MuonConfig

    elem = MuonConfig(**MUON).ns.dtype_bytes  # what the exchange moves: the NS dtype
    for ranks in trained["tp4"]:
        cut, aligned = ranks[0].sent, ranks[1].sent
        layers = sum(1 for lay in ranks[0].layouts if "linear_qkv" in lay.name)
        per_step = layers * (HEAD_DIM // 2) * HIDDEN * elem
        assert all(c - a == per_step for c, a in zip(cut, aligned)), (ranks[0].tp_rank, cut, aligned)


def test_per_head_reference_is_not_the_per_group_one():
    """The test could fail: for the cut attention, per head and per query group (one q block of 4
    heads, k, v) differ by far more than ATOL."""
    per_head = RUNS_TP4[0].reference_run
    per_group = Run(**{**{f: getattr(per_head, f) for f in ("attention", "steps", "batch")}, "per_head": False})
    refs = references([per_head, per_group], timeout=TIMEOUT)
    worst = max((refs[per_head].full[n] - refs[per_group].full[n]).abs().max().item()
                for n in refs[per_head].full if "linear_qkv" in n)
    assert worst > 100 * ATOL, f"per head moves the QKV weights by only {worst:.2e} from per group"


def _refusals_worker(rank: int, world: int) -> str:
    """The TP4 cut run built with the query heads counted per TP rank (heads / TP, as
    megatron-core counts them at TP up to the query groups) instead of the group's, a planted bug:
    the error it raises. (QK-clip there: tests/megatron/test_qk_clip_below_query_groups.py.)"""
    from training_harness import refusal_of

    from megatron_muon.megatron import catalogue

    honest = catalogue.qkv_heads_of

    def per_tp_rank(attention):
        groups, _, head_dim = honest(attention)
        return groups, attention.config.num_attention_heads // 4, head_dim

    return refusal_of(RUNS_TP4[0], catalogue, "qkv_heads_of", per_tp_rank)


def test_refusals_below_tp_query_groups():
    """Head counts that do not describe the row slice, in one line naming the weight and the flag."""
    for planted in run_world(4, _refusals_worker, timeout=TIMEOUT, fresh=True):
        assert "linear_qkv" in planted and "--muon-split-qkv-per-head" in planted, planted
        assert "after TP sharding" in planted and "\n" not in planted
