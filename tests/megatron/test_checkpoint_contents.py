"""What a save writes is the live state, and a resume continues from it bitwise, at DP >= 2.

The tiny GPT of ``megatron_harness`` at TP{1,2} x DP{2,4} (worlds of 2, 4 and 8 gloo ranks),
with ``--use-distributed-optimizer`` under both ``--muon-dp-layout`` values (several buckets
each) and under Megatron-FSDP (``optim_grads_params``). Each run trains 2 steps, saves, trains 2
more (the uninterrupted run), then a model built from another init seed loads the checkpoint
and trains the same 2 steps:

* **save vs live**: the checkpoint is read back in the test process by torch's own DCP reader,
  not by Megatron's loader, and every tensor of it (ZeRO-1: model weights, fp32 main params, Muon
  momentum under ``exp_avg``, Adam moments; Megatron-FSDP at TP1: the optimizer state) equals the
  live state at the save bitwise;
* **load**: right after the load, the optimizer state equals the live state at the save bitwise
  (ZeRO-1 and Megatron-FSDP);
* **resume**: after 2 more steps, the resumed run equals the uninterrupted one bitwise.

The regression this guards: megatron-muon's balanced layout handed megatron-core, as a bucket's
``per_bucket_numel_unpadded``, the sum of its params' sizes instead of its last param's end, so
every save zero-filled the tail of the bucket's last param (128-256 elements of
``linear_proj.weight`` on the demo model at DP2). ``test_runs_exercise_the_old_loss`` checks that
these layouts are ones where the old count was short, so the tests above would have caught it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from checkpoint_harness import (
    fsdp_optimizer_state,
    fsdp_saved_beside_live,
    load_fsdp_dtensor,
    load_torch_dist,
    read_offline,
    save_fsdp_dtensor,
    save_torch_dist,
    zero1_full_state,
)
from dist_harness import run_world
from megatron_harness import destroy_megatron
from training_harness import Run, build, start, steps

BUCKET = 6000  # elements: 2 or more buckets per buffer (the balanced layout keeps >= 2 x DP matrices in one)
STEPS = 2  # steps before the save, and after it
SEED, OTHER_SEED = 1234, 999
WORLDS = {2: (1,), 4: (1, 2), 8: (2,)}
"""world size: the TP sizes run in it (DP = world / TP): TP{1,2} x DP{2,4}."""
VARIANTS = ("balanced", "megatron", "fsdp")
"""``--muon-dp-layout balanced`` / ``megatron`` (ZeRO-1, saved ``fully_reshardable``, the format a
balanced layout always writes), Megatron-FSDP ``optim_grads_params`` (``fsdp_dtensor``)."""
CASES = [(tp, world // tp, variant) for world, tps in WORLDS.items() for tp in tps for variant in VARIANTS]
TIMEOUT = 1800  # a world of 8 ranks on 2 cores: minutes, more when other jobs share them


def _run(tp: int, variant: str) -> Run:
    """``variant``'s run at TP ``tp``: every DP rank on the same batch, a different one each step
    (``make_batch(100 + step)``)."""
    data = dict(tp=tp, seed=SEED, data_seed=100, fresh_batches=True, steps=STEPS)
    if variant == "fsdp":
        # bf16 params, as megatron-core 0.19.2's fsdp_dtensor save of a SwiGLU model needs
        return Run(**data, wrap="megatron_fsdp", sharding="optim_grads_params", dist_opt=True, bf16=True,
                   schedule=True, muon=dict(fp32_matmul_prec="medium"))
    return Run(**data, dist_opt=True, layout=variant, layout_bucket_size=BUCKET, muon=dict(dp_layout=variant))


def fsdp_wrapped(model) -> bool:
    return getattr(model[0].ddp_config, "use_megatron_fsdp", False)


def _buckets(model) -> list[tuple[int, int]]:
    """Per bucket of every buffer: (elements its params hold, its last param's end - its start)."""
    out = []
    for buffer in [] if fsdp_wrapped(model) else model[0].buffers:
        for bucket in buffer.buckets:
            end = max(buffer.param_index_map[p][1] for p in bucket.params_list) - bucket.offset
            out.append((sum(p.numel() for p in bucket.params_list), end))
    return out


def _train(tp: int, variant: str, path: str) -> dict:
    fsdp = variant == "fsdp"
    snapshot = (lambda model, optimizer: fsdp_optimizer_state(optimizer)) if fsdp else zero1_full_state
    run = _run(tp, variant)
    start(run)
    model, optimizer, scheduler = build(run)
    steps(run, model, optimizer, scheduler)
    if fsdp:
        save_fsdp_dtensor(path, model, optimizer)
    else:
        save_torch_dist(path, model, optimizer, scheduler, "fully_reshardable")
    live = snapshot(model, optimizer)  # a save changes nothing (Megatron-FSDP names its params at the first one)
    buckets = _buckets(model)
    steps(run, model, optimizer, scheduler, first=STEPS)
    straight = snapshot(model, optimizer)
    destroy_megatron(release_groups=not fsdp)  # DTensor device meshes are cached by torch and keep naming them

    run = dataclasses.replace(run, seed=OTHER_SEED)
    start(run)
    model, optimizer, scheduler = build(run)
    if fsdp:
        load_fsdp_dtensor(path, model, optimizer)
        for _ in range(STEPS):
            scheduler.step(1)  # saved apart from fsdp_dtensor (opt_param_scheduler); constant lr here
    else:
        load_torch_dist(path, model, optimizer, scheduler)
    loaded = snapshot(model, optimizer)
    steps(run, model, optimizer, scheduler, first=STEPS)
    resumed = snapshot(model, optimizer)
    destroy_megatron()
    return dict(live=live, loaded=loaded, straight=straight, resumed=resumed, buckets=buckets)


def _world(rank: int, world: int, root: str) -> dict:
    out = {}
    for tp in WORLDS[world]:
        for variant in VARIANTS:
            path = os.path.join(root, f"tp{tp}-dp{world // tp}-{variant}")
            result = _train(tp, variant, path)
            # ZeRO-1 snapshots are whole on every rank; FSDP's are TP-local: every rank's counts
            out[(tp, world // tp, variant)] = result if rank == 0 or variant == "fsdp" else None
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-contents")  # made here, shared by every rank
    for tp, dp, variant in CASES:
        (root / f"tp{tp}-dp{dp}-{variant}").mkdir()
    results = {}
    for world in WORLDS:
        for out in run_world(world, _world, str(root), timeout=TIMEOUT):
            for case, result in out.items():
                if result is not None:
                    results.setdefault(case, []).append(result)
    return root, results


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _assert_equal(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys differ"
        for key in a:
            _assert_equal(a[key], b[key], f"{what} {key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
    else:
        assert a == b, f"{what}: {a} != {b}"


def _ids(case) -> str:
    tp, dp, variant = case
    return f"tp{tp}-dp{dp}-{variant}"


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "fsdp"], ids=_ids)
def test_saved_state_equals_live(runs, case, tmp_path):
    """Every tensor the save wrote, read back by torch's DCP reader, is the live one bitwise."""
    root, results = runs
    live = results[case][0]["live"]
    saved = read_offline(str(root / _ids(case)), str(tmp_path / "ckpt.pt"))
    compared = 0
    for (key, layer), tensors in live.items():
        name = key if layer is None else f"{key} (layer {layer})"
        for part, value in tensors.items():
            stored = saved[key if part == "weight" else f"optimizer.state.{part}.{key}"]
            stored = stored if layer is None else stored[layer]
            _assert_equal(stored, value, f"{_ids(case)}: {part} of {name}")
            compared += 1
    assert compared == 4 * len(live)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "fsdp" and c[0] == 1], ids=_ids)
def test_fsdp_saved_state_equals_live(runs, case, tmp_path):
    """Megatron-FSDP's ``fsdp_dtensor`` save, read back by torch's DCP reader: every optimizer
    state tensor is the live one bitwise (Muon's momentum under ``exp_avg``; the SwiGLU fc1 saved
    as its gate and up halves, ``weight_w`` / ``weight_v``). At TP1, where a DP-gathered local
    tensor is the whole one."""
    root, results = runs
    live = results[case][0]["live"]
    pairs = fsdp_saved_beside_live(str(root / _ids(case)), str(tmp_path / "ckpt.pt"), live)
    for name, part, stored, value in pairs:
        _assert_equal(stored, value, f"{_ids(case)}: {part} of {name}")
    assert len(pairs) >= 15, len(pairs)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_load_restores_the_saved_state_bitwise(runs, case):
    for result in runs[1][case]:
        _assert_equal(result["loaded"], result["live"], f"{_ids(case)}: loaded vs saved")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_resume_continues_bitwise(runs, case):
    for result in runs[1][case]:
        assert not _same(result["straight"], result["live"]), "the steps after the save changed nothing"
        _assert_equal(result["resumed"], result["straight"], f"{_ids(case)}: resumed vs uninterrupted")


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "megatron" or c[2] == "balanced" and c[0] == 1], ids=_ids)
def test_several_buckets(runs, case):
    """More than one bucket, where the padding between buckets shifted megatron-core's
    ``fully_reshardable`` save (``MuonCheckpointMixin.get_parameter_state_dp_zero``). At TP2 the
    balanced layout keeps one bucket on this model: a bucket holds at least 2 x DP x its largest
    matrix (``balanced_layout.BUCKET_SPAN``), which at DP2 already exceeds the rest of the model."""
    buckets = runs[1][case][0]["buckets"]
    assert len(buckets) >= 2, buckets


def test_runs_exercise_the_old_loss(runs):
    """In some balanced run, a bucket's params hold fewer elements than its last param's end:
    the old ``per_bucket_numel_unpadded`` (the sum) would have zeroed the difference on save."""
    short = {_ids(c): sum(end - held for held, end in runs[1][c][0]["buckets"])
             for c in CASES if c[2] == "balanced"}
    assert any(short.values()), short
