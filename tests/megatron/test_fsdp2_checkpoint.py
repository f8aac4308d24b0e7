"""torch FSDP2 (``--use-torch-fsdp2``) checkpoints: a torch_dist save and a resume in a fresh process.

Megatron loads an FSDP2 torch_dist checkpoint in place (``load_checkpoint`` with
``skip_load_to_model_and_opt``): dist_checkpointing fills the model's and the optimizer's tensors,
and the optimizer's ``load_state_dict`` is never called, so its counters (AdamW's ``step``, MuonBP's
``muon_steps``) and param-group settings would start over; ``checkpoint.restore_in_place_load``
(called by the ``load_checkpoint`` hook) restores them from the checkpoint's common state.
``checkpoint_harness.load_torch_dist_in_place`` replays that load.

Each case (TP1 x DP2 in fp32 and bf16, TP2 x DP2 in fp32 with the distributed TP mode; a MoE model
at EP1, TP1 x DP2 and TP2 x DP2, and at TP1 x EP2 x expert-DP2 under ``TorchFSDP2WithExpertMesh``, the
experts cut by rows over their expert-DP group and stepped by the chain's expert optimizer; MuonBP
period 3) trains the tiny GPT under FSDP2 (each DP rank on its own slice of a fresh global batch every
step) 4 steps without interruption, and 2 steps, a save, a load into a model built from other weights
in new processes, and 2 more steps. Compared bitwise:
the state right after the load with the state saved (every rank's rows of the weights, fp32 main params, Muon momentum,
Adam moments, the step counters, ``muon_steps``), the last state and the losses of steps 3 and 4
with the uninterrupted run's. The checkpoint read back by torch's own DCP reader, in one process,
equals the saved live state (TP1). A load at another DP size (DP2 -> DP1, DP4) restores the same state.
At DP3 megatron-core's save fails; the training hook refuses it at the optimizer's build.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from checkpoint_harness import load_torch_dist_in_place, read_offline, save_torch_dist, torch_dist_metadata, unwrap
from dist_harness import run_world
from megatron_harness import GLOBAL_BATCH, destroy_megatron, gather_fsdp_rows
from training_harness import ATOL, MOE, Run, build, start, steps

SAVED_AT, STEPS = 2, 4
FSDP2 = dict(wrap="fsdp2", batch=GLOBAL_BATCH, split_batch=True, schedule=True, fresh_batches=True, steps=STEPS)
# MuonBP period 3 (steps 1..4: full, block, block, full): a lost muon_steps restarts the phase
RUNS = {
    "fp32": Run(tp=1, tp_mode="owner", muon=dict(muonbp_period=3), **FSDP2),
    "bf16": Run(tp=1, tp_mode="owner", bf16=True, muon=dict(muonbp_period=3, fp32_matmul_prec="medium"), **FSDP2),
    "tp2": Run(tp=2, tp_mode="distributed", muon=dict(muonbp_period=3), **FSDP2),
    # MoE experts at EP1 (what --use-torch-fsdp2 takes): SequentialMLP's own sharded state dict
    "moe": Run(tp=1, tp_mode="owner", moe=MOE, muon=dict(muonbp_period=3), **FSDP2),
    "moe-tp2": Run(tp=2, tp_mode="owner", moe=MOE, muon=dict(muonbp_period=3), **FSDP2),
    # EP2 x expert-DP2 at TP1 (DP4): the experts cut by rows over their expert-DP group
    # (TorchFSDP2WithExpertMesh, what the command line builds), a dense and an expert optimizer
    "moe-ep2": Run(tp=1, ep=2, tp_mode="owner", moe=MOE, muon=dict(muonbp_period=3), expert_mesh=True, **FSDP2),
}
WORLDS = {"fp32": 2, "bf16": 2, "tp2": 4, "moe": 2, "moe-tp2": 4, "moe-ep2": 4}  # TP1 x DP2; TP2 x DP2; TP1 x DP4
WORLD = 2


# ----------------------------------------------------------------------------- on every rank


def _names(wrapper, model) -> dict[int, str]:
    """id(optimizer param) -> its model param's name (bf16: the fp32 main param of a bf16 param),
    for one optimizer of the chain."""
    names = {id(p): n for n, p in model[0].named_parameters()}
    out = {id(p): names[id(p)] for g in wrapper.optimizer.param_groups for p in g["params"] if id(p) in names}
    for main_group, model_group in zip(getattr(wrapper, "fp32_from_float16_groups", []),
                                       getattr(wrapper, "float16_groups", [])):
        out.update({id(main): names[id(p)] for main, p in zip(main_group, model_group)})
    return out


def _state(model, optimizer, *, whole: bool) -> dict:
    """``{name/key: tensor}``: every param's weight, fp32 main param (bf16), optimizer state tensors
    and step; ``muon_steps``. ``whole``: every DP rank's rows gathered (TP1), else this rank's."""
    def rows(t, expert=None):
        return gather_fsdp_rows(t, expert) if whole else t._local_tensor.detach().clone()

    out = {f"{n}/weight": rows(p) for n, p in model[0].named_parameters()}
    for index, wrapper in enumerate(optimizer.chained_optimizers):  # the experts' second at EP > 1
        inner, names, expert = wrapper.optimizer, _names(wrapper, model), index == 1
        for group in inner.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                if hasattr(wrapper, "float16_groups"):
                    out[f"{name}/main"] = rows(p, expert)
                for key, value in inner.state[p].items():
                    out[f"{name}/{key}"] = rows(value, expert) if key != "step" else value.clone()
    out["muon_steps"] = optimizer.chained_optimizers[0].optimizer.muon_steps
    return out


def _uninterrupted(rank: int, world: int, run: Run) -> dict:
    start(run)
    model, optimizer, scheduler = build(run)
    done = steps(run, model, optimizer, scheduler)
    return dict(losses=[s.loss for s in done], local=_state(model, optimizer, whole=False),
                whole=_state(model, optimizer, whole=True))


def _save(rank: int, world: int, run: Run, path: str) -> dict:
    start(run)
    model, optimizer, scheduler = build(run)
    done = steps(run, model, optimizer, scheduler, count=SAVED_AT)
    save_torch_dist(path, model, optimizer, scheduler, None)  # what --use-torch-fsdp2 saves: no dist-opt format
    keys = _checkpoint_keys(model)
    return dict(losses=[s.loss for s in done], local=_state(model, optimizer, whole=False),
                whole=_state(model, optimizer, whole=True), keys=keys)


def _checkpoint_keys(model) -> dict[str, tuple[str, int | None]]:
    """name -> (its torch_dist key, its layer along the stacked layer axis or None): the key from the
    model's own sharded state dict (whose tensors are the DTensors' local rows)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    items = nested_values(unwrap(model[0]).sharded_state_dict(metadata=torch_dist_metadata(None)))
    by_storage = {v.data.data_ptr(): v.key for v in items if isinstance(getattr(v, "data", None), torch.Tensor)}
    out = {}
    for name, p in model[0].named_parameters():
        layer = re.search(r"decoder\.layers\.(\d+)\.", name)
        out[name] = (by_storage[p._local_tensor.data_ptr()], int(layer[1]) if layer else None)
    return out


def _resume(rank: int, world: int, run: Run, path: str, restore: bool = True) -> dict:
    """A fresh build from other weights, the in-place load, the state after it, the remaining steps."""
    start(run)
    model, optimizer, scheduler = build(dataclasses.replace(run, seed=999))
    restored = load_torch_dist_in_place(path, model, optimizer, scheduler, restore=restore)
    loaded = dict(local=_state(model, optimizer, whole=False), whole=_state(model, optimizer, whole=True))
    kinds = []
    inner = optimizer.chained_optimizers[0].optimizer
    done = []
    for step in range(SAVED_AT, STEPS):
        done += steps(run, model, optimizer, scheduler, first=step, count=1)
        kinds.append(inner.last_step_kind)
    out = dict(restored=restored, loaded=loaded, losses=[s.loss for s in done], kinds=kinds,
               local=_state(model, optimizer, whole=False), whole=_state(model, optimizer, whole=True))
    del model, optimizer, scheduler
    destroy_megatron(release_groups=False)
    return out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (checkpoint dir, the saving run's results by rank)}: each saved once, in its own processes."""
    out = {}
    for case, run in RUNS.items():
        path = str(tmp_path_factory.mktemp(f"fsdp2_{case}"))
        out[case] = (path, run_world(WORLDS[case], _save, run, path, fresh=True))
    return out


@pytest.fixture(scope="module")
def uninterrupted():
    return {case: run_world(WORLDS[case], _uninterrupted, run, fresh=True) for case, run in RUNS.items()}


@pytest.fixture(scope="module")
def resumed(saved):
    """{case: results by rank} of the resume at the saving DP size, in fresh processes."""
    return {case: run_world(WORLDS[case], _resume, RUNS[case], saved[case][0], fresh=True) for case in RUNS}


def _equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key} differs by {(got[key] - value).abs().max()}"
        else:
            assert got[key] == value, f"{what}: {key} {got[key]} != {value}"


# ----------------------------------------------------------------------------- same DP size


@pytest.mark.parametrize("case", RUNS)
def test_load_restores_the_saved_state_bitwise(saved, resumed, case):
    """Right after the load every rank holds its saved rows of every weight, fp32 main param and
    optimizer state tensor, bitwise, and the saved step counters and ``muon_steps``."""
    for rank, (at_save, after_load) in enumerate(zip(saved[case][1], resumed[case])):
        _equal(after_load["loaded"]["local"], at_save["local"], f"rank {rank}")
        assert after_load["restored"] == {"step": float(SAVED_AT), "muon_steps": SAVED_AT}


@pytest.mark.parametrize("case", RUNS)
def test_resume_continues_the_uninterrupted_run_bitwise(saved, resumed, uninterrupted, case):
    """Steps 3 and 4 after the load log the uninterrupted run's losses and end in its state, bitwise;
    MuonBP continues its phase (step 3 a block step, step 4 a full one)."""
    for rank, (before, after, whole) in enumerate(zip(saved[case][1], resumed[case], uninterrupted[case])):
        assert before["losses"] + after["losses"] == whole["losses"], rank
        assert after["kinds"] == ["block", "full"], after["kinds"]
        _equal(after["local"], whole["local"], f"rank {rank}")


def test_without_the_restore_the_counters_start_over(saved):
    """What megatron-core 0.19.2's in-place load alone leaves: the tensors loaded, the counters at 0
    (so AdamW's bias correction and MuonBP's phase would restart)."""
    path = saved["fp32"][0]
    results = run_world(WORLD, _resume, RUNS["fp32"], path, False, fresh=True)
    for rank, (at_save, after_load) in enumerate(zip(saved["fp32"][1], results)):
        got = after_load["loaded"]["local"]
        assert got["muon_steps"] == 0
        assert all(float(v) == 0.0 for k, v in got.items() if k.endswith("/step"))
        tensors = {k: v for k, v in at_save["local"].items() if not k.endswith("/step") and k != "muon_steps"}
        _equal({k: got[k] for k in tensors}, tensors, f"rank {rank}")
        assert after_load["kinds"] == ["full", "block"]  # the phase restarted: the run differs from here


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_checkpoint_read_back_by_torch_equals_the_live_state(saved, case, tmp_path):
    """torch's own DCP reader (``dcp_to_torch_save``, one process, no Megatron loader) reads every
    weight, fp32 main param and optimizer state tensor of the save as the live state held it (TP1:
    the DP-gathered rows are the whole tensor)."""
    path, results = saved[case]
    flat = read_offline(path, str(tmp_path / "scratch.pt"))
    live, keys = results[0]["whole"], results[0]["keys"]
    prefixes = {"weight": "", "main": "optimizer.state.fp32_param.", "momentum_buffer":
                "optimizer.state.momentum_buffer.", "exp_avg": "optimizer.state.exp_avg.",
                "exp_avg_sq": "optimizer.state.exp_avg_sq."}
    compared = 0
    for name_key, value in live.items():
        if name_key == "muon_steps" or name_key.endswith("/step"):
            continue
        name, what = name_key.rsplit("/", 1)
        key, layer = keys[name]
        stored = flat[prefixes[what] + key]
        stored = stored[layer] if layer is not None else stored
        assert torch.equal(stored.float(), value), f"{name_key}: the checkpoint's {prefixes[what] + key} differs"
        compared += 1
    assert compared == len(live) - 1 - sum(k.endswith("/step") for k in live)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)["optimizer"]
    inner = common.get("optimizer", common)
    assert float(inner["state"]["common_step"]) == SAVED_AT and inner["muon_steps"] == SAVED_AT


def _expert_replica_ids(rank: int, world: int) -> dict:
    """For the MoE case's model: {expert tensor key: (replica id, global offset)} of this rank's expert
    rows, as the factory leaves ``SequentialMLP.sharded_state_dict`` (wrapped:
    ``torch_fsdp2.keep_fsdp2_expert_rows_main``) and as megatron-core 0.19.2 alone gives them (the
    wrap removed)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.moe.experts import SequentialMLP

    run = RUNS["moe"]
    start(run)
    model, _, _ = build(run)

    def ids() -> dict:
        items = nested_values(unwrap(model[0]).sharded_state_dict(metadata=torch_dist_metadata(None)))
        return {(t.key, t.global_offset): t.replica_id for t in items
                if isinstance(t, ShardedTensor) and ".experts.experts." in t.key}

    out = {"wrapped": ids()}
    for module in model[0].modules():
        if isinstance(module, SequentialMLP):
            del module.sharded_state_dict
    out["upstream"] = ids()
    destroy_megatron(release_groups=False)
    return out


def test_expert_rows_are_each_a_main_replica():
    """FSDP2 gives each DP rank its own rows of an expert (no two ranks write the same fragment), so
    each must be a main replica (DP replica id 0, as ``make_sharded_tensor_for_checkpoint`` gives
    FSDP2 rows). megatron-core 0.19.2's ``SequentialMLP.sharded_state_dict`` sets the expert-DP rank
    instead: DP rank 1's rows then have no main replica, and the torch_dist save fails its validation
    (measured: "Invalid access pattern for ShardedTensor(key='decoder.layers.mlp.experts.experts.
    linear_fc1.weight', ...)"). The MoE cases above save through the factory's wrap."""
    results = run_world(WORLD, _expert_replica_ids, fresh=True)
    for rank, out in enumerate(results):
        assert out["wrapped"] and out["wrapped"].keys() == out["upstream"].keys()
        assert {rid[2] for rid in out["wrapped"].values()} == {0}, (rank, out["wrapped"])
        assert {rid[2] for rid in out["upstream"].values()} == {rank}, (rank, out["upstream"])
    assert not set(results[0]["wrapped"]) & set(results[1]["wrapped"])  # each DP rank's own fragments


# ----------------------------------------------------------------------------- another DP size


@pytest.mark.parametrize("world", [1, 4])
def test_dp_change_restores_the_saved_state(saved, uninterrupted, world):
    """The DP2 checkpoint loaded at DP1 and DP4: right after the load the whole (DP-gathered) state
    is the saved one, bitwise; the two steps after it end within ATOL (training_harness: fp32, the DP
    mean's order of sums) of the uninterrupted DP2 run, and MuonBP continues its phase."""
    path, results = saved["fp32"]
    resumed = run_world(world, _resume, RUNS["fp32"], path, fresh=True)
    want = results[0]["whole"]
    for rank, result in enumerate(resumed):
        _equal(result["loaded"]["whole"], want, f"DP{world} rank {rank}")
        assert result["kinds"] == ["block", "full"]
    final, reference = resumed[0]["whole"], uninterrupted["fp32"][0]["whole"]
    for key, value in reference.items():
        if key.endswith("/weight"):
            torch.testing.assert_close(final[key], value, rtol=0, atol=ATOL, msg=key)
    assert final["muon_steps"] == reference["muon_steps"] == STEPS



# ----------------------------------------------------------------------------- what cannot be saved


def _dp3(rank: int, world: int, path: str) -> dict:
    """The tiny GPT under FSDP2 at DP3 (its 64- and 128-row params cut unevenly): the refusal, and
    what megatron-core's save does without it."""
    from megatron_muon.megatron.torch_fsdp2 import fsdp2_checkpoint_refusal

    run = RUNS["fp32"]
    start(run)
    model, optimizer, scheduler = build(run)
    refusal = fsdp2_checkpoint_refusal(model[0].named_parameters(), model[0].config.gated_linear_unit)
    try:
        os.makedirs(path, exist_ok=True)
        save_torch_dist(path, model, optimizer, scheduler, None)
        saved = "saved"
    except AssertionError as err:
        saved = str(err)
    return dict(refusal=refusal, saved=saved)


def test_uneven_rows_are_refused_before_training(tmp_path):
    """At DP3 megatron-core 0.19.2's save fails (the SwiGLU fc1 split asserts; every param's rows are
    written as equal thirds, which torch.chunk's are not); the training hook refuses it at the
    optimizer's build instead, naming the first param DP does not divide."""
    for result in run_world(3, _dp3, str(tmp_path / "ckpt"), fresh=True):
        assert result["saved"].startswith("SwiGLU FC1 FSDP ShardedTensor requires each DP shard of linear_fc1 to be "
                                          "completely inside either the W or V half"), result["saved"]
        assert result["refusal"] == (
            "--use-torch-fsdp2 with --save / --load at DP 3: module.embedding.word_embeddings.weight has 128 rows "
            "(shape (128, 64)), which FSDP2 cuts unevenly (torch.chunk), and megatron-core 0.19.2's torch_dist save "
            "writes each DP rank's rows as an equal 1/3 of them; use a DP size that divides every param's rows, or "
            "drop --save and --load"), result["refusal"]


def test_a_gated_fc1_needs_an_even_dp_size():
    """DP3 with rows DP divides: the gate/up split per DP shard still needs an even DP size."""
    from types import SimpleNamespace

    from megatron_muon.megatron.torch_fsdp2 import fsdp2_checkpoint_refusal

    def param(rows):
        mesh = SimpleNamespace(size=lambda: 3)
        return SimpleNamespace(is_torch_fsdp2_param=True, shape=(rows, 4), device_mesh=mesh, dim=lambda: 2)

    named = [("decoder.layers.0.self_attention.linear_qkv.weight", param(96)),
             ("decoder.layers.0.mlp.linear_fc1.weight", param(192))]
    assert fsdp2_checkpoint_refusal(named, gated=False) is None
    assert fsdp2_checkpoint_refusal(named, gated=True) == (
        "--use-torch-fsdp2 with --save / --load and --swiglu at DP 3: megatron-core 0.19.2's torch_dist save splits "
        "decoder.layers.0.mlp.linear_fc1.weight into gate and up per DP shard and asserts that each shard lies inside "
        "one half (an AssertionError at the first save); use an even DP size")
