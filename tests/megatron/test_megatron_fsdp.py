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

* one process at TP1 on the whole global batch (``test_megatron_optimizer.train_reference``:
  ``megatron_muon.Muon`` on the split matrices, ``torch.optim.AdamW`` on the rest);
* our ZeRO-1 path (``--use-distributed-optimizer``, Megatron's DDP) in the same world.

Megatron-FSDP cuts matrices at row boundaries: at DP2 and DP4 some Muon matrices are cut between
ranks (asserted), so their rows travel to one owner and back every step.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_harness import fsdp_optimizer_state as _optimizer_state
from checkpoint_harness import load_fsdp_dtensor as _load_fsdp
from checkpoint_harness import save_fsdp_dtensor as _save_fsdp
from dist_harness import WorldsOnDemand, run_world
from megatron_harness import (
    GLOBAL_BATCH,
    build_tiny_gpt,
    destroy_megatron,
    dp_slice,
    forward_backward,
    gather_full_params,
    init_megatron,
    make_batch,
)
from training_harness import ATOL, MUON, K, _optimizer_config, _scheduler, train_reference

TIMEOUT = 1800


def train_fsdp(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Each run: ``tp``, ``fsdp`` (sharding strategy; None: our ZeRO-1 path), ``tp_mode``,
    ``microbatches`` (1), ``overlap`` (``--overlap-grad-reduce`` / ``--overlap-param-gather``).
    Returns per run: the full weights (rank 0), this rank's loss on a batch every rank shares
    after the last step (DP replicas must agree), the Muon matrices cut between DP ranks, and
    the bytes this rank's Muon step sent, per step."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    from megatron_muon import comm_stats
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    out = []
    for run in runs:
        tp = run["tp"]
        init_megatron(tp)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        muon_config = MuonConfig(tp_mode=run["tp_mode"], **MUON)
        model = build_tiny_gpt(tp, use_distributed_optimizer=True, fsdp=run["fsdp"], overlap=run.get("overlap", False))
        if run.get("overlap"):  # megatron.training hands the schedule no_sync only with --overlap-grad-reduce
            get_model_config(model[0]).no_sync_func = model[0].no_sync
        optimizer = get_megatron_muon_optimizer(_optimizer_config(True), model, muon_config)
        scheduler = _scheduler(optimizer)
        batch = dp_slice(make_batch(7, micro_batch_size=GLOBAL_BATCH), dp_rank, dp)
        sent = []
        for _ in range(K):
            forward_backward(model, batch, pp=1, num_microbatches=run.get("microbatches", 1), optimizer=optimizer,
                             use_schedule=True)
            with comm_stats() as stats:
                ok, _, _ = optimizer.step()
            assert ok
            scheduler.step(1)
            sent.append(stats.bytes_sent)
        full = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
        with torch.no_grad():  # the model weights Megatron-FSDP gathers for a forward, on every DP rank
            shared = make_batch(11)
            local_loss = model[0](shared["tokens"], shared["position_ids"], None, labels=shared["labels"]).mean()
        out.append(dict(run=run, full=full if rank == 0 else None, local_loss=float(local_loss), sent=sent,
                        cut=getattr(optimizer.chained_optimizers[0], "cut_matrices", 0)))
        destroy_megatron()
    return out


STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
ZERO1 = dict(fsdp=None, tp_mode="owner")
RUNS = {
    2: [dict(tp=1, fsdp=s, tp_mode="owner") for s in STRATEGIES]
    + [dict(tp=1, fsdp=s, tp_mode="owner", microbatches=2, overlap=o)
       for s in ("optim_grads_params", "optim", "no_shard") for o in (False, True)]
    + [dict(tp=1, **ZERO1)],
    4: [dict(tp=1, fsdp=s, tp_mode="owner") for s in STRATEGIES]
    + [dict(tp=2, fsdp="optim_grads_params", tp_mode=m) for m in ("owner", "duplicated", "distributed")]
    + [dict(tp=2, fsdp=s, tp_mode="owner") for s in ("optim", "no_shard")]  # no_shard: DP owners over DP, not TP x DP
    + [dict(tp=1, **ZERO1), dict(tp=2, **ZERO1)],
}
CASES = [(w, i) for w, runs in RUNS.items() for i, r in enumerate(runs) if r["fsdp"]]


def _id(case):
    w, i = case
    r = RUNS[w][i]
    mb = f"-mb{r['microbatches']}" if r.get("microbatches") else ""
    mb += "-overlap" if r.get("overlap") else ""
    return f"dp{w // r['tp']}-tp{r['tp']}-{r['fsdp']}-{r['tp_mode']}{mb}"


@pytest.fixture(scope="module")
def reference():
    """The TP1 one-process weights after K steps on the whole global batch."""
    return run_world(1, train_reference, [dict(clip=0.0, batch=GLOBAL_BATCH)])[0][0][0]


@pytest.fixture(scope="module")
def trained():
    return WorldsOnDemand(lambda world: run_world(world, train_fsdp, RUNS[world], timeout=TIMEOUT))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_single_process_reference(trained, reference, case):
    """ATOL (test_megatron_optimizer): TP1 layouts are off the reference by the update's own
    rounding (3.25e-7 measured), TP2 by the cross entropy's and RowParallel's summation order."""
    world, index = case
    full = trained[world][0][index]["full"]
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
    zero1 = next(i for i, r in enumerate(RUNS[world]) if r["fsdp"] is None and r["tp"] == run["tp"])
    ours, theirs = trained[world][0][index]["full"], trained[world][0][zero1]["full"]
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dp_replicas_see_the_same_model(trained, case):
    """After the step, Megatron-FSDP all-gathers the model weights for the next forward: every
    rank's loss on one shared batch is bitwise the same (TP ranks compute the same loss)."""
    world, index = case
    losses = {r[index]["local_loss"] for r in trained[world]}
    assert len(losses) == 1, losses


def test_matrices_are_cut_and_travel(trained):
    """The tiny model's layers are cut between DP ranks: QKV at DP2 (each layer one bucket of
    ~45,000 elements, halved inside QKV), more at DP4; a cut matrix's rows travel every step."""
    for world, results in ((w, trained[w]) for w in RUNS):
        for index, run in enumerate(RUNS[world]):
            if run["fsdp"] in ("optim_grads_params", "optim_grads", "optim"):
                assert results[0][index]["cut"] > 0, (world, run)
                assert sum(sum(r[index]["sent"]) for r in results) > 0, (world, run)
            if run["fsdp"] == "no_shard":
                assert results[0][index]["cut"] == 0


# ----------------------------------------------------------------------------- checkpoints

CKPT_STEPS = 2  # steps before the save, and after the load
CKPT_STRATEGIES = ("optim_grads_params", "optim")


def checkpoint_runs(rank: int, world: int, path: str, strategy: str) -> dict:
    """Uninterrupted 2 + 2 steps vs 2 steps, save, a new model and optimizer from another init
    seed, load, 2 steps. bf16 params (``Float16Module``, fp32 main weights), as megatron-core
    0.19.2's ``fsdp_dtensor`` save of a SwiGLU model needs. Each DP rank on its own data."""
    from megatron.core import parallel_state as ps

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    def build(seed):
        init_megatron(1, seed=seed)
        model = build_tiny_gpt(1, use_distributed_optimizer=True, fsdp=strategy, bf16=True, seed=seed)
        optimizer = get_megatron_muon_optimizer(_optimizer_config(True, bf16=True), model,
                                                MuonConfig(tp_mode="owner", **dict(MUON, fp32_matmul_prec="medium")))
        return model, optimizer, _scheduler(optimizer)

    def train(model, optimizer, scheduler, first_step):
        for step in range(first_step, first_step + CKPT_STEPS):
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            batch = dp_slice(make_batch(20 + step, micro_batch_size=GLOBAL_BATCH), dp_rank, dp)
            forward_backward(model, batch, pp=1, optimizer=optimizer, use_schedule=True)
            ok, _, _ = optimizer.step()
            assert ok
            scheduler.step(1)

    out = {}
    model, optimizer, scheduler = build(1234)
    train(model, optimizer, scheduler, 0)
    _save_fsdp(path, model, optimizer)
    saved = _optimizer_state(optimizer)
    train(model, optimizer, scheduler, CKPT_STEPS)
    out["straight"] = (gather_full_params(model, ps.get_tensor_model_parallel_group(), 1), _optimizer_state(optimizer))
    # Groups stay alive: DTensor device meshes are cached by torch and keep naming them
    destroy_megatron(release_groups=False)

    model, optimizer, scheduler = build(999)
    _load_fsdp(path, model, optimizer)
    out["loaded"] = _optimizer_state(optimizer)
    out["saved"] = saved
    for _ in range(CKPT_STEPS):
        scheduler.step(1)  # the scheduler's own state is saved apart (opt_param_scheduler); constant lr here
    train(model, optimizer, scheduler, CKPT_STEPS)
    out["resumed"] = (gather_full_params(model, ps.get_tensor_model_parallel_group(), 1), _optimizer_state(optimizer))
    destroy_megatron()
    return out


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
            if key == "muon_steps":
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
            if key == "muon_steps":
                assert state_resumed[key] == state[key]
            else:
                assert torch.equal(state_resumed[key], state[key]), key
