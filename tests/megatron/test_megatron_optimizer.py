"""Muon on a real megatron-core GPT under TP × DP, against a single-process reference.

Every run trains the tiny GPT of ``megatron_harness`` (local spec, RoPE, SwiGLU, GQA) for K
steps on one fixed batch with ``get_megatron_muon_optimizer`` — Megatron's own DDP, buffers,
optimizer wrappers and LR scheduler — then gathers every parameter into its full TP=1 shape.
The reference is the same model at TP=1 on one process, trained with ``megatron_muon.Muon`` on
the matrices (QKV split per query group, fc1 into gate/up, Megatron's scale rule) and
``torch.optim.AdamW`` on the rest, with the same hyper-parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import WorldsOnDemand, run_world
from training_harness import (
    ATOL,
    ATOL_CLIP,
    BF16_DISTANCE,
    BF16_MIN_COSINE,
    BF16_NORM_RATIO,
    CLIP,
    MUON,
    NORM_RTOL,
    TIMEOUT,
    K,
    Run,
    references,
    train_all,
)

# bf16 params with fp32 main params, NS in bf16 (upstream's "medium"): Megatron's usual path.
BF16 = dict(bf16=True, muon=dict(fp32_matmul_prec="medium"))
RUNS_1 = [dict(tp=1, dist_opt=d, tp_mode="owner") for d in (False, True)]
RUNS_1 += [dict(tp=1, dist_opt=True, tp_mode="owner", **BF16)]
RUNS_2 = [dict(tp=t, dist_opt=d, tp_mode=m)
          for t in (1, 2) for d in (False, True) for m in ("duplicated", "distributed", "owner")]
RUNS_2 += [dict(tp=1, dist_opt=False, tp_mode="owner", muon=dict(dp_mode="redundant"))]  # plain DDP, no DP owner
RUNS_2 += [dict(tp=1, pp=2, dist_opt=d, tp_mode="owner") for d in (False, True)]  # TP1 x PP2 x DP1
RUNS_4 = [dict(tp=2, dist_opt=d, tp_mode=m)
          for d in (False, True) for m in ("duplicated", "distributed", "owner", "blockwise")]
# Fragments: Megatron's DDP ignores bucket_size without overlap_grad_reduce (one bucket per
# buffer), so cuts come from where the 1/dp boundaries fall: at DP4, and per stage at PP2 x DP2,
# they fall inside fc1 matrices (checked below).
RUNS_4 += [dict(tp=1, dist_opt=True, tp_mode="owner", expect_cut=True)]
RUNS_4 += [dict(tp=1, pp=2, dist_opt=d, tp_mode="owner", expect_cut=d) for d in (False, True)]  # x DP2
RUNS_4 += [dict(tp=2, dist_opt=True, tp_mode="owner", **BF16)]
# --muon-dp-layout balanced: every matrix whole on one DP rank (no DP exchange), all exact modes
# at TP1 × DP2 and TP2 × DP2, the owner mode at TP1 × DP4 and PP2 × DP{1, 2}, and bf16.
BALANCED = dict(dist_opt=True, layout="balanced")
RUNS_2 += [dict(tp=1, tp_mode=m, **BALANCED) for m in ("duplicated", "distributed", "owner")]
RUNS_2 += [dict(tp=1, pp=2, tp_mode="owner", **BALANCED)]
RUNS_4 += [dict(tp=2, tp_mode=m, **BALANCED) for m in ("duplicated", "distributed", "owner")]
RUNS_4 += [dict(tp=1, tp_mode="owner", **BALANCED), dict(tp=1, pp=2, tp_mode="owner", **BALANCED)]
RUNS_4 += [dict(tp=2, tp_mode="owner", **BALANCED, **BF16)]
# --overlap-grad-reduce with several buckets (DDP honours bucket_size only with it), and
# --overlap-param-gather with the distributed optimizer: grads reduce-scattered bucket by bucket
# from backward hooks, the param all-gather left to the next forward's pre-hooks. At 20,000
# elements the tiny model's buffer splits into several buckets (asserted), each sharded over DP
# on its own, so matrices are cut at bucket and shard boundaries alike.
OVERLAP = dict(overlap=True, bucket_size=20_000)
RUNS_4 += [dict(tp=t, dist_opt=True, tp_mode="owner", expect_cut=True, **OVERLAP) for t in (1, 2)]
RUNS_4 += [dict(tp=2, dist_opt=False, tp_mode="owner", **OVERLAP)]
RUNS_4 += [dict(tp=2, tp_mode="owner", **BALANCED, **OVERLAP)]
# auto's joint TP x DP schedule through Megatron's optimizer, on a compute-bound profile where the
# split matrices run wide (distributed) at TP2 x DP2; at TP1 (x PP2 x DP2, and x DP4) the wide form
# is a team of DP ranks, each member a row or column block of a cut unit (asserted below).
AUTO = dict(tp_mode="auto", muon=dict(auto_hardware=str(Path(__file__).parents[1] / "compute_bound_hardware.json")))
RUNS_4 += [dict(tp=2, dist_opt=True, **AUTO), dict(tp=1, pp=2, dist_opt=True, expect_cut=True, **AUTO),
           dict(tp=1, dist_opt=True, expect_cut=True, **AUTO)]
RUNS = {world: [Run(**run, clip=clip) for run in runs for clip in (0.0, CLIP)]
        for world, runs in ((1, RUNS_1), (2, RUNS_2), (4, RUNS_4))}


@pytest.fixture(scope="module")
def reference():
    """{run: its one-process reference} (one per clip; shared with every module asking for it)."""
    return references(run for runs in RUNS.values() for run in runs)


@pytest.fixture(scope="module")
def trained():
    return WorldsOnDemand(lambda world: run_world(world, train_all, RUNS[world], timeout=TIMEOUT))


def _run_id(world: int, run: Run) -> str:
    tags = [f"w{world}", f"tp{run.tp}", f"pp{run.pp}", "distopt" if run.dist_opt else "ddp", run.tp_mode]
    tags += ["bf16"] * run.bf16
    tags += [run.layout] if run.layout != "megatron" else []
    tags += [dict(run.muon)["dp_mode"]] if dict(run.muon).get("dp_mode") else []
    tags += ["overlap"] if run.overlap else []
    tags += [f"clip{run.clip:g}"] if run.clip else []
    return "-".join(tags)


def _cases():
    for world, runs in RUNS.items():
        for i, run in enumerate(runs):
            yield pytest.param(world, i, id=_run_id(world, run))


@pytest.mark.parametrize("world, index", list(_cases()))
def test_matches_single_process_reference(trained, reference, world, index):
    result = trained[world][0][index]
    run = result.run
    ref = reference[run]
    reference, initial, reference_norms = ref.full, ref.initial, ref.grad_norms
    assert set(result.full) == set(reference)
    if run.clip:
        # Clipping must have happened: Megatron clips when the norm its step returns exceeds clip_grad.
        assert all(n > run.clip for n in result.grad_norms), f"{run}: no clipping, norms {result.grad_norms}"
    if not run.bf16 and run.tp_mode != "blockwise":
        # Megatron's norm over the layout's shards is the full model's: nothing missed, nothing
        # counted twice (TP-duplicated norm weights, DP shards, PP stages).
        for step, (got, want) in enumerate(zip(result.grad_norms, reference_norms)):
            assert abs(got - want) <= NORM_RTOL * want, f"{run} step {step}: grad norm {got} vs {want}"
    worst = max(((result.full[n] - reference[n]).abs().max().item(), n) for n in reference)
    if run.bf16:
        # bf16 activations change the gradient in its 3rd significant digit, and NS maps every
        # singular value to ~1, so the small (noisy) directions of the gradient change the
        # update visibly; an entry-wise bound would be meaningless. The bf16 update must still
        # be the same update: the same size, the same direction (bounds measured, see above).
        for n in reference:
            if reference[n].dim() != 2 or "embedding" in n or "output_layer" in n:
                continue  # AdamW moves entries by ~±lr whatever the gradient's size
            want = (reference[n] - initial[n]).flatten()
            got = (result.full[n].float() - initial[n]).flatten()
            ratio = (got.norm() / want.norm()).item()
            cosine = (torch.dot(got, want) / (got.norm() * want.norm())).item()
            distance = ((got - want).norm() / want.norm()).item()
            assert abs(ratio - 1) <= BF16_NORM_RATIO, f"{run}: {n} update's size is {ratio:.4f}x the reference's"
            assert cosine >= BF16_MIN_COSINE, f"{run}: {n} update's cosine to the reference is {cosine:.4f}"
            assert distance <= BF16_DISTANCE, f"{run}: {n} update off by {distance:.3f} of its size"
    elif run.tp_mode == "blockwise":
        # BlockMuon is a different algorithm: the matrices must NOT match the reference.
        assert worst[0] > 1e-3, f"blockwise unexpectedly matched the reference (max diff {worst[0]:.2e})"
    else:
        atol = ATOL_CLIP if run.clip else ATOL
        assert worst[0] <= atol, f"{run}: {worst[1]} off by {worst[0]:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_dp_replicas_bitwise_identical(trained, world):
    """Upstream 0.19.2's muon + distributed optimizer let DP replicas diverge; ours must not."""
    for index in range(len(trained[world][0])):
        ranks = [r[index] for r in trained[world]]
        for r in ranks:
            for q in ranks:
                if (q.tp_rank, q.pp_rank) == (r.tp_rank, r.pp_rank):
                    for name, t in r.local.items():
                        assert torch.equal(t, q.local[name]), f"{r.run}: {name} differs across DP"


def test_only_cut_or_moved_matrices_travel_across_dp(trained):
    """TP=1 runs with the distributed optimizer: the DP owner exchange moves exactly the pieces
    not already on their owner (there and back), and nothing else."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.plan.owners import plan_unit_owners
    from megatron_muon.plan.step_plan import build_step_plan
    from megatron_muon.plan.units import split_units

    checked = 0
    for world, runs in RUNS.items():
        for index, run in enumerate(runs):
            if not run.dist_opt or run.tp != 1 or run.bf16 or world == 1:
                continue
            ranks = [r[index] for r in trained[world]]
            cut = []
            for pp_rank in {r.pp_rank for r in ranks}:
                stage = [r for r in ranks if r.pp_rank == pp_rank]
                layouts, dp = stage[0].layouts, stage[0].dp_size
                if dp == 1:
                    continue
                units = split_units(layouts)  # the exchange moves units: fc1's gate and up apart
                if run.tp_mode == "auto":  # auto's joint schedule places the units, some on DP teams
                    config = MuonConfig(tp_mode="auto", **dict(MUON, **dict(run.muon)))  # the run's NS dtype
                    plan = build_step_plan(layouts, dp_size=dp, tp_size=1, settings=config.plan_settings())
                    moved = sum(plan.dp_bytes)  # a team block's pieces go to its member: the plan's count
                else:
                    owners = plan_unit_owners(layouts, units, dp)
                    moved = sum(2 * (e - s) * 4 for unit, o in zip(units, owners)
                                for d, (s, e) in enumerate(unit.layout.dp_ranges) if d != o)
                for step in range(K):
                    sent = sum(r.by_primitive[step].get("all_to_all", 0) for r in stage)
                    assert sent == moved, f"{_run_id(world, run)} step {step}: {sent} bytes, expected {moved}"
                cut += [lay.name for lay in layouts if len(lay.holders(dp)) > 1]
            if run.expect_cut:
                assert cut, f"{_run_id(world, run)}: some matrix should be cut across DP ranks"
            checked += 1
    assert checked >= 3


def test_auto_at_tp1_runs_units_on_dp_teams(trained):
    """The TP1 x DP4 auto runs above are exact with DP teams in them: on the compute-bound profile
    the schedule gives units of the real layouts to a team of the 4 DP ranks. (At PP2 x DP2 each
    stage's tiny units stay on single owners; their bytes are checked above.)"""
    from megatron_muon.config import MuonConfig
    from megatron_muon.plan.step_plan import build_step_plan

    indices = [i for i, run in enumerate(RUNS[4]) if run.tp_mode == "auto" and run.tp == 1 and run.pp == 1]
    assert len(indices) == 2  # with and without clipping
    for index in indices:
        result = trained[4][0][index]
        config = MuonConfig(tp_mode="auto", **dict(MUON, **dict(RUNS[4][index].muon)))
        plan = build_step_plan(result.layouts, dp_size=result.dp_size, tp_size=1, settings=config.plan_settings())
        assert plan.team_size == result.dp_size == 4, _run_id(4, RUNS[4][index])
        assert any(plan.team_of(u) is not None for u in range(len(plan.units))), _run_id(4, RUNS[4][index])


def test_overlap_runs_have_several_buckets(trained):
    """The overlap runs exercise what they are for: more than one bucket per buffer, where
    megatron-core lays the buffer out. (The balanced layout keeps a bucket open until it holds
    a few times DP x its largest matrix, which is this whole tiny model: one bucket, by design;
    that run checks the overlapped grad reduce and param gather on our layout.)"""
    overlap = [i for i, run in enumerate(RUNS[4]) if run.overlap]
    assert len(overlap) == 8  # 4 layouts, with and without clipping
    for index in overlap:
        if RUNS[4][index].layout != "balanced":
            assert trained[4][0][index].buckets >= 3, (RUNS[4][index], trained[4][0][index].buckets)
    plain = next(i for i, run in enumerate(RUNS[4]) if run.dist_opt and not run.overlap)
    assert trained[4][0][plain].buckets == 1  # without overlap DDP ignores bucket_size


def test_redundant_dp_mode_moves_nothing_across_dp(trained):
    indices = [i for i, r in enumerate(RUNS[2]) if dict(r.muon).get("dp_mode") == "redundant"]
    assert len(indices) == 2  # with and without clipping
    for r in trained[2]:
        for index in indices:
            assert all(step.get("all_to_all", 0) == 0 for step in r[index].by_primitive)


def test_balanced_layout_cuts_no_matrix_and_moves_nothing_across_dp(trained):
    """--muon-dp-layout balanced: every Muon matrix lies in one DP rank's range, so the DP plan
    pins it there; at TP1 (where every all-to-all is the DP exchange) no byte moves."""
    checked = 0
    for world, runs in RUNS.items():
        for index, run in enumerate(runs):
            if run.layout != "balanced":
                continue
            for r in trained[world]:
                result = r[index]
                dp = result.dp_size
                assert all(len(lay.holders(dp)) == 1 for lay in result.layouts), \
                    f"{_run_id(world, run)}: a matrix is cut across DP ranks"
                if run.tp == 1:
                    assert all(step.get("all_to_all", 0) == 0 for step in result.by_primitive), _run_id(world, run)
            checked += 1
    assert checked >= 9
