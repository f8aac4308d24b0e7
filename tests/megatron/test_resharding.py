"""Resharding Muon checkpoints across TP, PP and DP (issue 13 item 5).

The tiny GPT of ``megatron_harness`` with the distributed optimizer (megatron-core's buffer
layout), tp_mode owner, MuonBP period 3, saved in the ``fully_reshardable`` format with exactly
the metadata ``--dist-ckpt-optim-fully-reshardable`` alone gives (no
``--distrib-optim-fully-reshardable-mem-efficient``: on CPU that used to crash at save time, see
``MuonDistributedOptimizer.sharded_state_dict``). One world of 4 gloo ranks runs every scenario:

* the saving runs train 5 steps without interruption, saving after steps 2 and 3 (MuonBP kinds
  full, block, block | block, full — or, saved after 3: | full, block);
* each load rebuilds the model at another TP x PP x DP from a different init seed, loads, and
  trains on from there. Right after the load the full (TP-, PP- and DP-gathered) params, fp32
  main params, Muon momentum and Adam moments equal the saved ones bitwise, and so do the step
  counters (MuonBP's phase ``muon_steps`` included); the steps after match the saving run's within
  ``ATOL``, and every step's MuonBP kind equals the saving run's.

MuonBP's block steps orthogonalize each TP rank's block (arXiv 2510.16981): a block step at
another TP size is another update by design. So a load that changes TP resumes at a full step
(saved after step 3) and only that step is compared; the next one's kind is still checked. Loads
that keep TP resume at a block step (saved after step 2), where a phase reset (``muon_steps`` 0)
would take a full step instead, and both steps are compared.

TP4: the harness model has 2 query groups. At TP4 Megatron would run its num_query_groups < TP
mode (a KV head computed on several TP ranks), which ``build_tiny_gpt`` refuses (``GROUPS % tp``)
and megatron-muon's TP modes, written for disjoint TP shards of one matrix, are not tested with.
The TP4 scenario therefore runs the same model with 4 query groups (MHA:
``megatron_harness.GROUPS`` set to 4 during this test's job only, and put back after it: the
ranks are pooled, and the next job's model must have 2; ``_build`` checks the model got them),
saved at TP2 x DP2.

Through Megatron's own training loop (``scripts/pretrain_gpt.py``, 2 ranks), the default format's
refusal of a TP change and the fix it names: ``tests/e2e/test_resharding_training_loop.py``.
"""

from __future__ import annotations

import dataclasses
import os

import megatron_harness
import pytest
import torch
from checkpoint_harness import SMALL_BUCKET
from checkpoint_harness import load_torch_dist as _load
from checkpoint_harness import max_state_diff as _max_diff
from checkpoint_harness import save_fully_reshardable as _save
from checkpoint_harness import unwrap as _unwrap
from dist_harness import run_world
from megatron_harness import HEADS, destroy_megatron, gather_full_params, unshard
from training_harness import ATOL, Run, build, start, steps

from megatron_muon.megatron.resharding import FULLY_RESHARDABLE_FLAG, explain_load_error

PERIOD = 3
SEED, OTHER_SEED = 1234, 999
LAST = 5
"""the saving runs' last step; they save after steps 2 and 3."""

SAVES = {"A": dict(tp=2, pp=1, groups=2), "B": dict(tp=1, pp=2, groups=2), "C": dict(tp=2, pp=1, groups=HEADS)}
"""saving run: its TP x PP (x DP = 4 / (TP x PP)) and the model's query groups (C: MHA, for TP4)."""
LOADS = {
    "A@2->tp2pp2": ("A", 2, dict(tp=2, pp=2)),  # PP 1 -> 2, DP 2 -> 1
    "A@3->tp1": ("A", 3, dict(tp=1, pp=1)),  # TP 2 -> 1, DP 2 -> 4
    "B@2->pp1": ("B", 2, dict(tp=1, pp=1)),  # PP 2 -> 1, DP 2 -> 4
    "B@3->tp2": ("B", 3, dict(tp=2, pp=1)),  # TP 1 -> 2, PP 2 -> 1
    "C@3->tp4": ("C", 3, dict(tp=4, pp=1)),  # TP 2 -> 4, DP 2 -> 1
}
"""load name: (saving run, step saved after, the TP x PP loaded at)."""
STEPS_AFTER_LOAD = 2

# fp32 NS. Observed on CPU: loads that keep TP (PP and DP change) continue bitwise (0.0); a TP
# change reorders the sums of the vocab-parallel cross entropy and the row-parallel all-reduces, so
# gradients differ in the last bits: max |diff| over params, main params, momentum and Adam moments
# after the full step following the load 1.19e-7 (TP2 -> TP1, TP2 -> TP4) and 1.23e-7 (TP1 -> TP2),
# on norm and embedding weights (AdamW's 1/sqrt(v) amplifies the reordering most). The bound is
# training_harness.ATOL, K steps of another summation order (5.9e-6), 48x over what one step
# here shows. Broken loads are far off (measured by breaking them after the load): momentum lost
# 8.1e-3 to 1.2e-2 right after the load, 1.6e-2 to 3.2e-2 after the next step; a MuonBP phase
# reset (muon_steps 0) fails the counter and step-kind checks.


def _kind(model, optimizer) -> str:
    """``Run.probe``: the MuonBP kind of the step just taken."""
    return optimizer.chained_optimizers[0].optimizer.last_step_kind


def _run(layout: dict) -> Run:
    """The run at ``layout``'s TP x PP: megatron-core's buffer layout, MuonBP period ``PERIOD``;
    step ``s`` (1-based, as ``LAST`` and the saves count) trains on ``make_batch(100 + s)``."""
    return Run(tp=layout["tp"], pp=layout["pp"], seed=SEED, dist_opt=True, bucket_size=SMALL_BUCKET, data_seed=101,
               fresh_batches=True, muon=dict(dp_layout="megatron", muonbp_period=PERIOD), probe=_kind)


def _build(run: Run, seed: int):
    """``start(run)``, then model, optimizer and Megatron's scheduler with initial weights from ``seed``."""
    start(run)
    model, optimizer, scheduler = build(dataclasses.replace(run, seed=seed))
    assert _unwrap(model[0]).config.num_query_groups == megatron_harness.GROUPS
    return model, optimizer, scheduler


def _step(run: Run, model, optimizer, scheduler, step: int) -> str:
    """Step ``step`` (1-based); its MuonBP kind."""
    (done,) = steps(run, model, optimizer, scheduler, first=step - 1, count=1)
    return done.probe


def _full_state(model, optimizer, pp: int) -> dict:
    """{global param name: {"param", "main", and "momentum_buffer" (Muon) or "exp_avg",
    "exp_avg_sq" (AdamW)}}, every tensor in its full TP=1 shape, on every rank.

    Each DP rank's range of a main param and its state is summed over DP (the ranges are
    disjoint: the sum is exact), TP shards are all-gathered and reassembled (``unshard``), and
    the PP stages exchanged, so the result does not depend on the layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.catalogue import is_muon_matrix

    opt = optimizer.chained_optimizers[0]
    inner = opt.optimizer
    tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    params = gather_full_params(model, tp_group, pp)
    gpt = _unwrap(model[0])
    full = {}
    for name, p in gpt.named_parameters():
        keys = ("momentum_buffer",) if is_muon_matrix(p) else ("exp_avg", "exp_avg_sq")
        local = {k: torch.zeros(p.numel()) for k in ("main", *keys)}
        if p in opt.model_param_group_index_map:
            gi, go = opt.model_param_group_index_map[p]
            main = inner.param_groups[gi]["params"][go]
            rng = opt._get_model_param_range_map(p)["param"]
            local["main"][rng.start:rng.end] = main
            for k in keys:
                local[k][rng.start:rng.end] = inner.state[main][k]
        tensors = {}
        for k, v in local.items():
            dist.all_reduce(v, group=ps.get_data_parallel_group())
            v = v.view(p.shape)
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                pieces = [torch.empty_like(v) for _ in range(tp)]
                dist.all_gather(pieces, v, group=tp_group)
                v = unshard(pieces, p)
            tensors[k] = v
        full[megatron_harness.global_name(gpt, name)] = tensors
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, full, group=ps.get_pipeline_model_parallel_group())
        full = {k: v for stage in stages for k, v in stage.items()}
    for name, tensors in full.items():
        tensors["param"] = params[name]
    return full


def _counters(optimizer) -> dict:
    """This rank's step counters: per-param optimizer steps (a set) and MuonBP's ``muon_steps``."""
    inner = optimizer.chained_optimizers[0].optimizer
    return dict(steps={float(s["step"]) for s in inner.state.values() if "step" in s},
                muon_steps=inner.muon_steps)


def _snapshot(model, optimizer, pp: int, rank: int) -> dict:
    """The full state (kept on global rank 0 only: it is the same on every rank) and this rank's
    counters."""
    full = _full_state(model, optimizer, pp)
    return dict(full=full if rank == 0 else None, **_counters(optimizer))


def _world(rank: int, world: int, root: str) -> dict:
    """Every saving run, then every load; a load that raises is reported to its own test."""
    groups = megatron_harness.GROUPS
    try:
        return _saves_and_loads(rank, root)
    finally:
        megatron_harness.GROUPS = groups  # a pooled rank runs other tests' jobs next


def _saves_and_loads(rank: int, root: str) -> dict:
    import traceback

    from megatron.core import parallel_state as ps

    out = {}
    for name, layout in SAVES.items():
        megatron_harness.GROUPS = layout["groups"]  # see the module docstring
        run = _run(layout)
        model, optimizer, scheduler = _build(run, SEED)
        snaps, kinds = {}, {}
        for step in range(1, LAST + 1):
            kinds[step] = _step(run, model, optimizer, scheduler, step)
            if step >= 2:
                snaps[step] = _snapshot(model, optimizer, run.pp, rank)
            if step in (2, 3):
                _save(os.path.join(root, f"{name}@{step}"), model, optimizer, scheduler)
        destroy_megatron()
        out[name] = dict(snaps=snaps, kinds=kinds)
    for name, (source, saved_after, layout) in LOADS.items():
        megatron_harness.GROUPS = SAVES[source]["groups"]
        try:
            run = _run(layout)
            model, optimizer, scheduler = _build(run, OTHER_SEED)
            fresh = gather_full_params(model, ps.get_tensor_model_parallel_group(), run.pp)
            _load(os.path.join(root, f"{source}@{saved_after}"), model, optimizer, scheduler)
            snaps = {saved_after: _snapshot(model, optimizer, run.pp, rank)}
            kinds = {}
            for step in range(saved_after + 1, saved_after + 1 + STEPS_AFTER_LOAD):
                kinds[step] = _step(run, model, optimizer, scheduler, step)
                snaps[step] = _snapshot(model, optimizer, run.pp, rank)
            out[name] = dict(fresh=fresh, snaps=snaps, kinds=kinds)
        except Exception:  # noqa: BLE001 - reported by this load's test
            out[name] = traceback.format_exc()
        if ps.model_parallel_is_initialized():
            destroy_megatron()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon-reshard")  # made here, shared by every rank
    for name in SAVES:  # dist_checkpointing.save wants an existing, empty directory
        for step in (2, 3):
            (root / f"{name}@{step}").mkdir()
    return run_world(4, _world, str(root))


def _ok(result, what: str):
    if isinstance(result, str):
        pytest.fail(f"{what} raised:\n{result}", pytrace=False)
    return result


def test_saving_runs_take_muonbp_kinds(runs):
    """Period 3: full on steps 1 and 4 (t = 0, 3), block otherwise, on every rank."""
    want = {1: "full", 2: "block", 3: "block", 4: "full", 5: "block"}
    for r in runs:
        for name in SAVES:
            assert r[name]["kinds"] == want, name


@pytest.mark.parametrize("load", list(LOADS))
def test_load_restores_saved_state_bitwise(runs, load):
    """Right after the load at another layout: full params, main params, Muon momentum and Adam
    moments are the saved ones bitwise; every rank's step counters and MuonBP phase too."""
    source, saved_after, _ = LOADS[load]
    saved = runs[0][source]["snaps"][saved_after]["full"]
    res = _ok(runs[0][load], load)
    # The fresh model (other seed) really differs, so the load has something to do.
    assert max((res["fresh"][n] - saved[n]["param"]).abs().max().item() for n in saved) > 1e-3
    worst, where = _max_diff(res["snaps"][saved_after]["full"], saved)
    assert worst == 0.0, f"{load}: {where} off by {worst:.3e} after the load"
    for r in runs:
        loaded = _ok(r[load], load)["snaps"][saved_after]
        assert loaded["steps"] == {float(saved_after)}, load
        assert loaded["muon_steps"] == saved_after, load


@pytest.mark.parametrize("load", list(LOADS))
def test_training_continues_as_uninterrupted(runs, load):
    """The steps after the load take the saving run's MuonBP kinds and match its state within
    ``ATOL`` — every step when TP is unchanged; the (full) first step when TP changes."""
    source, saved_after, run = LOADS[load]
    same_tp = run["tp"] == SAVES[source]["tp"]
    ref = runs[0][source]
    for r in runs:
        res = _ok(r[load], load)
        assert res["kinds"] == {s: ref["kinds"][s] for s in res["kinds"]}, load
        for step, snap in res["snaps"].items():
            assert snap["steps"] == {float(step)} and snap["muon_steps"] == step, load
    res = _ok(runs[0][load], load)
    compared = sorted(res["kinds"]) if same_tp else [saved_after + 1]
    if not same_tp:
        assert res["kinds"][saved_after + 1] == "full"  # the premise of comparing across TP
    for step in compared:
        worst, where = _max_diff(res["snaps"][step]["full"], ref["snaps"][step]["full"])
        print(f"{load} step {step} ({res['kinds'][step]}): max |diff| {worst:.3e} at {where}")
        assert worst <= ATOL, f"{load} step {step}: {where} off by {worst:.2e}"


def test_explain_load_error_names_both_layouts_and_leaves_other_errors_alone():
    """A PP change gets the same explanation (Megatron's text, as load_checkpoint formats it for
    ckpt (1, 2) loaded at (1, 1)); any other error, or this text in another exception type, None."""
    refusal = ("(TP, PP) mismatch after resume ((1, 1) vs (1, 2) from checkpoint): not supported for "
               "DistributedOptimizer with sharding type dp_reshardable. Please use `--ckpt-fully-parallel-save` "
               "flag during checkpoint saving.")
    message = explain_load_error(RuntimeError(refusal))
    assert message is not None
    assert "saved at TP1 x PP2" in message and "loaded at TP1 x PP1" in message
    assert FULLY_RESHARDABLE_FLAG in message and "\n" not in message
    for other in (RuntimeError("Fully parallel load is not supported for dp_zero_gather_scatter checkpoints. "
                               "Please remove --ckpt-fully-parallel-load flag"),
                  ValueError(refusal), KeyError("optimizer")):
        assert explain_load_error(other) is None, repr(other)
