"""Muon under Megatron-FSDP (``--use-megatron-fsdp``) on the tiny GPT, against one process.

Every run wraps the tiny GPT of ``megatron_harness`` in Megatron-FSDP's
``FullyShardedDataParallel`` (each sharding strategy; one bucket per transformer layer under
``optim_grads_params``, one for the whole model otherwise) and trains it K steps with
``get_megatron_muon_optimizer``. Each DP rank trains on its own slice of a global batch of 4
sequences, through Megatron's schedule with ``no_sync`` wired as ``megatron.training`` wires it
(only with ``--overlap-grad-reduce``: ``optim`` and ``no_shard`` then reduce on the last
micro-batch's backward, and otherwise in ``finish_grad_sync``; wiring it without overlap reduces
them twice), so a gradient that is not reduced over DP, or reduced twice, shows.
The weights are then gathered from the DP shards (and TP ranks) and compared with

* one process at TP1 on the whole global batch (``training_harness.reference``:
  ``megatron_muon.Muon`` on the split matrices, ``torch.optim.AdamW`` on the rest);
* our ZeRO-1 path (``--use-distributed-optimizer``, Megatron's DDP) in the same world.

Megatron-FSDP cuts matrices at row boundaries: at DP2 and DP4 some Muon matrices are cut between
ranks (asserted), so their rows travel to one owner and back every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import WorldsOnDemand, run_world
from megatron_harness import GLOBAL_BATCH
from training_harness import ATOL, MUON, K, Run, fsdp_resumed, references, train_all

TIMEOUT = 1800

# Each DP rank on its own slice of the global batch, through Megatron's schedule.
DATA = dict(batch=GLOBAL_BATCH, split_batch=True, schedule=True)
FSDP = dict(DATA, wrap="megatron_fsdp", dist_opt=True)
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
ZERO1 = dict(DATA, dist_opt=True, tp_mode="owner")
# auto on a compute-bound profile: at TP1 its wide form is a team of DP ranks (each a block of a
# unit cut between them); tests/compute_bound_hardware.json
AUTO = dict(tp_mode="auto", muon=dict(auto_hardware=str(Path(__file__).parents[1] / "compute_bound_hardware.json")))
RUNS = {
    2: [Run(tp=1, sharding=s, tp_mode="owner", **FSDP) for s in STRATEGIES]
    + [Run(tp=1, sharding=s, tp_mode="owner", microbatches=2, overlap=o, **FSDP)
       for s in ("optim_grads_params", "optim", "no_shard") for o in (False, True)]
    + [Run(tp=1, **ZERO1)]
    # MuonBP period 2 (steps 0, 2 full; 1 a block step), its block on the TP shard or local
    + [Run(tp=1, sharding="optim_grads_params", tp_mode="owner", muon=dict(muonbp_period=2, muonbp_block=b), **FSDP)
       for b in ("tp_shard", "local")],
    4: [Run(tp=1, sharding=s, tp_mode="owner", **FSDP) for s in STRATEGIES]
    + [Run(tp=2, sharding="optim_grads_params", tp_mode=m, **FSDP) for m in ("owner", "duplicated", "distributed")]
    # no_shard: DP owners over DP, not TP x DP
    + [Run(tp=2, sharding=s, tp_mode="owner", **FSDP) for s in ("optim", "no_shard")]
    + [Run(tp=1, **ZERO1), Run(tp=2, **ZERO1)]
    + [Run(tp=1, sharding="optim_grads_params", **AUTO, **FSDP)],
}
# the exact runs, compared with one process (MuonBP's block steps are another algorithm)
CASES = [(w, i) for w, runs in RUNS.items() for i, r in enumerate(runs)
         if r.wrap == "megatron_fsdp" and "muonbp_period" not in dict(r.muon)]


def _id(case):
    w, i = case
    r = RUNS[w][i]
    mb = f"-mb{r.microbatches}" if r.microbatches != 1 else ""
    mb += "-overlap" if r.overlap else ""
    return f"dp{w // r.tp}-tp{r.tp}-{r.sharding}-{r.tp_mode}{mb}"


@pytest.fixture(scope="module")
def reference():
    """{run: the TP1 one-process weights after K steps on the whole global batch}."""
    return {run: ref.full for run, ref in references(run for runs in RUNS.values() for run in runs).items()}


@pytest.fixture(scope="module")
def trained():
    return WorldsOnDemand(lambda world: run_world(world, train_all, RUNS[world], timeout=TIMEOUT))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_single_process_reference(trained, reference, case):
    """ATOL (test_megatron_optimizer): TP1 layouts are off the reference by the update's own
    rounding (3.25e-7 measured), TP2 by the cross entropy's and RowParallel's summation order."""
    world, index = case
    full = trained[world][0][index].full
    reference = reference[RUNS[world][index]]
    assert full.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(full[name], expected, rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_zero1_in_the_same_world(trained, case):
    """Against ``--use-distributed-optimizer`` (DDP + ZeRO-1) at the same TP and DP: the same
    update, with gradients reduced by another collective (reduce-scatter or all-reduce per
    bucket, in another grouping), so equal up to the summation order of the DP mean: measured
    max |diff| 0 at TP1 ... (see the assertion's tolerance, ATOL)."""
    world, index = case
    run = RUNS[world][index]
    zero1 = next(i for i, r in enumerate(RUNS[world]) if r.wrap == "ddp" and r.tp == run.tp)
    ours, theirs = trained[world][0][index].full, trained[world][0][zero1].full
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dp_replicas_see_the_same_model(trained, case):
    """After the step, Megatron-FSDP all-gathers the model weights for the next forward: every
    rank's loss on one shared batch is bitwise the same (TP ranks compute the same loss)."""
    world, index = case
    losses = {r[index].loss for r in trained[world]}
    assert len(losses) == 1, losses


def test_matrices_are_cut_and_travel(trained):
    """The tiny model's layers are cut between DP ranks: QKV at DP2 (each layer one bucket of
    ~45,000 elements, halved inside QKV), more at DP4; a cut matrix's rows travel every step."""
    for world, results in ((w, trained[w]) for w in RUNS):
        for index, run in enumerate(RUNS[world]):
            if run.sharding in ("optim_grads_params", "optim_grads", "optim"):
                assert results[0][index].cut > 0, (world, run)
                assert sum(sum(r[index].sent) for r in results) > 0, (world, run)
            if run.sharding == "no_shard":
                assert results[0][index].cut == 0


def test_auto_at_tp1_runs_units_on_dp_teams(trained):
    """The TP1 auto run (exact against one process above) has DP teams in it: on the compute-bound
    profile its plan, on Megatron-FSDP's real layouts, gives units to a team of the 4 DP ranks."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.plan.step_plan import build_step_plan

    index = next(i for i, r in enumerate(RUNS[4]) if r.tp_mode == "auto")
    result = trained[4][0][index]
    config = MuonConfig(tp_mode="auto", **dict(MUON, **dict(RUNS[4][index].muon)))  # the run's NS dtype
    plan = build_step_plan(result.layouts, dp_size=result.dp_size, tp_size=1, settings=config.plan_settings())
    assert plan.team_size == 4 and any(plan.team_of(u) is not None for u in range(len(plan.units)))


def test_muonbp_local_block_steps_send_nothing(trained):
    """Issue 24, item 2: under optim_grads_params at DP2 matrices are cut between the ranks, so a
    block step on the TP shard reassembles them on their DP owners, while a local block step
    orthogonalizes each rank's own rows and sends nothing. Full steps move bytes in both."""
    results = trained[2]
    runs = {dict(r.muon)["muonbp_block"]: i for i, r in enumerate(RUNS[2]) if "muonbp_block" in dict(r.muon)}
    for block, index in runs.items():
        sent = [sum(r[index].sent[t] for r in results) for t in range(K)]
        assert sent[0] > 0 and sent[2] > 0, (block, sent)  # full steps
        assert (sent[1] == 0) == (block == "local"), (block, sent)
        assert len({r[index].loss for r in results}) == 1  # DP replicas agree


# ----------------------------------------------------------------------------- checkpoints

CKPT_STEPS = 2  # steps before the save, and after the load
CKPT_STRATEGIES = ("optim_grads_params", "optim")


# bf16 params (``Float16Module``, fp32 main weights), as megatron-core 0.19.2's ``fsdp_dtensor``
# save of a SwiGLU model needs; each DP rank on its own data, a new batch every step
CKPT = dict(FSDP, tp=1, bf16=True, muon=dict(fp32_matmul_prec="medium"), data_seed=20, fresh_batches=True,
            steps=CKPT_STEPS)


def checkpoint_runs(rank: int, world: int, path: str, strategy: str) -> dict:
    """Uninterrupted 2 + 2 steps vs 2 steps, save, a new model and optimizer from another init
    seed, load, 2 steps (``training_harness.fsdp_resumed``)."""
    return fsdp_resumed(Run(sharding=strategy, **CKPT), path)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    return {s: run_world(2, checkpoint_runs, str(tmp_path_factory.mktemp(f"fsdp-{s}")), s, timeout=TIMEOUT)
            for s in CKPT_STRATEGIES}


@pytest.mark.parametrize("strategy", CKPT_STRATEGIES)
def test_checkpoint_restores_the_optimizer_state_bitwise(checkpointed, strategy):
    for result in checkpointed[strategy]:
        saved, loaded = result["saved"], result["loaded"]
        assert saved.keys() == loaded.keys()
        assert any(k.endswith("momentum_buffer") for k in saved)
        for key, value in saved.items():
            if key.startswith("muon_steps"):
                assert loaded[key] == value
            else:
                assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("strategy", CKPT_STRATEGIES)
def test_bitwise_resume(checkpointed, strategy):
    """Resumed from the checkpoint into a model initialized differently, two more steps give
    bitwise the weights and state of the uninterrupted run, on every rank (the first forward after
    the load must see the loaded weights, not the fresh model's)."""
    for result in checkpointed[strategy]:
        (full, state), (full_resumed, state_resumed) = result["straight"], result["resumed"]
        for name in full:
            assert torch.equal(full_resumed[name], full[name]), name
        for key in state:
            if key.startswith("muon_steps"):
                assert state_resumed[key] == state[key]
            else:
                assert torch.equal(state_resumed[key], state[key]), key
