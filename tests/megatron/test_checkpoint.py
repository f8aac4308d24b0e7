"""Save / load of Muon through Megatron's dist_checkpointing (torch_dist), as megatron.training does.

The tiny GPT of ``megatron_harness`` at TP2 x DP2 (4 gloo ranks), tp_mode owner, small buckets:

* bitwise resume: train 2 steps, save (model + optimizer + scheduler), rebuild everything from
  scratch with a DIFFERENT init seed, load, train 2 more steps; the result must equal an
  uninterrupted 4-step run bitwise (every param, fp32 main param and optimizer state tensor, the
  step counters). With the distributed optimizer (``dp_reshardable``, megatron.training's
  default) and without it (``FP32Optimizer``); the same in bf16 (``Float16Module`` params, fp32
  main params; ``Float16OptimizerWithFloat16Params`` without the distributed optimizer).
* post-load param sync (upstream #6920): loading the distributed optimizer's state ALONE (not the
  model's) into a fresh model must leave every DP replica with the saved params.
* DP resharding: the distributed optimizer's checkpoints saved at TP2 x DP2 (``fully_reshardable``,
  and ``dp_reshardable``, whose unpadded bucket layout does not depend on DP here) are loaded at
  TP2 x DP1 (2 ranks); the loaded params and optimizer state equal the saved ones bitwise, and
  one more step matches the uninterrupted run's third step within ``ATOL``.

Each run is a ``training_harness.Run`` (``BASE``, ``_run``); the flows save, rebuild and load
around its ``start`` / ``build`` / ``steps``. Each run checks everything it can; a run that
raises fails only its own tests.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from checkpoint_harness import SMALL_BUCKET
from checkpoint_harness import load_torch_dist as _load
from checkpoint_harness import save_torch_dist as _save
from dist_harness import ChildError, run_world
from megatron_harness import destroy_megatron
from training_harness import ATOL, Run, build, start, steps

TP = 2
SEED, OTHER_SEED = 1234, 999
# DP resharding: the continued step runs at DP1 instead of DP2. Every rank sees the same batch and
# the 1/DP grad scaling is a power of two, so the DP-averaged gradients are the same numbers; yet
# DP1 is a different program (no DP padding, no reduce-scatter / all-gather, Muon's owner exchange
# on one rank), free to reassociate sums. Observed on CPU: 0.0 (bitwise) for both formats. The
# bound is ``training_harness.ATOL``, K steps of another summation order (5.9e-6): the
# continuation's three steps are those, one of them in another program. Broken loads are far off
# (measured by breaking checkpoint.py): momentum not restored 1.0e-2 (already in the bitwise load
# check), one step tensor shared by all params (Megatron's own load) 5.6e-3 after the step.
KINDS = {"distopt": (True, False), "ddp": (False, False),
         "distopt-bf16": (True, True), "ddp-bf16": (False, True), "distopt-balanced": (True, False),
         "distopt-per-head": (True, False)}
"""run name: (use_distributed_optimizer, bf16); ``-balanced``: --muon-dp-layout balanced; ``-per-head``:
--muon-split-qkv-per-head (every QKV head its own unit and matrix: the state is the param's all the same)."""
SHARDINGS = {"distopt": ("dp_reshardable", "fully_reshardable"), "ddp": (None,),
             "distopt-bf16": ("dp_reshardable",), "ddp-bf16": (None,),
             "distopt-balanced": ("dp_reshardable", "fully_reshardable"), "distopt-per-head": ("dp_reshardable",)}
"""the checkpoints each run saves; the first is the one it resumes from."""
CROSS_LAYOUT = [("distopt-fully_reshardable", "balanced"), ("distopt-balanced-fully_reshardable", "megatron"),
                ("distopt-balanced-dp_reshardable", "megatron")]
"""(checkpoint saved in one --muon-dp-layout, the layout it is loaded into)."""
CHECKPOINTS = [f"{kind}-{sharding}" for kind, shardings in SHARDINGS.items() for sharding in shardings]


BASE = Run(tp=TP, seed=SEED, bucket_size=SMALL_BUCKET, data_seed=100, fresh_batches=True, steps=4)
"""Every run's settings: a different batch every step (``make_batch(100 + step)``), 4 steps uninterrupted."""


def _run(kind: str, layout: str | None = None) -> Run:
    """``kind``'s run (``KINDS``), in its --muon-dp-layout unless ``layout`` is given."""
    dist_opt, bf16 = KINDS[kind]
    layout = layout or ("balanced" if kind.endswith("-balanced") else "megatron")
    return dataclasses.replace(BASE, dist_opt=dist_opt, bf16=bf16, layout=layout, muon=dict(dp_layout=layout),
                               per_head=kind.endswith("-per-head"))


def _build(run: Run, seed: int):
    """``start(run)`` (the parallel state seeded with ``SEED``), then ``build`` with initial weights from ``seed``."""
    start(run)
    return build(dataclasses.replace(run, seed=seed))


def _snapshot(model, optimizer) -> dict:
    """This rank's TP-local params and, per param, its fp32 main param (``main``) and optimizer
    state as full TP-local tensors (distributed optimizer: every DP rank's range summed over DP),
    the per-param steps and ``muon_steps``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import DistributedOptimizer

    from megatron_muon.megatron.catalogue import is_muon_matrix

    opt = optimizer.chained_optimizers[0]
    inner = opt.optimizer
    distributed = isinstance(opt, DistributedOptimizer)
    params, states, steps = {}, {}, set()
    for name, p in model[0].named_parameters():
        params[name] = p.detach().clone()
        keys = ("momentum_buffer",) if is_muon_matrix(p) else ("exp_avg", "exp_avg_sq")
        if distributed:
            full = {k: torch.zeros(p.numel()) for k in ("main", *keys)}
            if p in opt.model_param_group_index_map:
                gi, go = opt.model_param_group_index_map[p]
                main = inner.param_groups[gi]["params"][go]
                rng = opt._get_model_param_range_map(p)["param"]
                full["main"][rng.start:rng.end] = main
                for k in keys:
                    full[k][rng.start:rng.end] = inner.state[main][k]
                steps.add(float(inner.state[main]["step"]))
            for v in full.values():  # disjoint ranges: the sum is exact
                dist.all_reduce(v, group=ps.get_data_parallel_group())
            states[name] = {k: v.view(p.shape) for k, v in full.items()}
        else:
            main = getattr(p, "main_param", None)
            main = p if main is None else main  # bf16: Megatron's fp32 copy
            states[name] = {"main": main.detach().clone(), **{k: inner.state[main][k].clone() for k in keys}}
            steps.add(float(inner.state[main]["step"]))
    return dict(params=params, states=states, steps=steps, muon_steps=inner.muon_steps,
                lr=sorted({g["lr"] for g in optimizer.param_groups}),
                algorithms=[g["algorithm"] for g in optimizer.param_groups],
                tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def _resume_run(kind: str, root: str) -> dict:
    """One kind's runs on this rank: uninterrupted, saved, resumed (and optimizer-only)."""
    run = _run(kind)
    out = {}
    # The uninterrupted run, a snapshot after every step.
    model, optimizer, scheduler = _build(run, SEED)
    done = steps(dataclasses.replace(run, probe=_snapshot), model, optimizer, scheduler)
    ref = {step + 1: s.probe for step, s in enumerate(done)}
    destroy_megatron()

    # 2 steps, save, rebuild from scratch (other init), load, 2 more steps.
    model, optimizer, scheduler = _build(run, SEED)
    steps(run, model, optimizer, scheduler, count=2)
    paths = {}
    for sharding in SHARDINGS[kind]:
        paths[sharding] = os.path.join(root, f"{kind}-{sharding}")
        _save(paths[sharding], model, optimizer, scheduler, sharding)
    destroy_megatron()

    model, optimizer, scheduler = _build(run, OTHER_SEED)
    fresh = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    _load(paths[SHARDINGS[kind][0]], model, optimizer, scheduler)
    loaded = _snapshot(model, optimizer)
    steps(run, model, optimizer, scheduler, first=2, count=2)
    resumed = _snapshot(model, optimizer)
    destroy_megatron()
    out[kind] = dict(ref=ref, fresh=fresh, loaded=loaded, resumed=resumed)

    if kind == "distopt":  # the optimizer alone into a fresh model: the post-load param sync
        model, optimizer, scheduler = _build(run, OTHER_SEED)
        _load(paths["dp_reshardable"], model, optimizer, scheduler, load_model=False)
        out["optimizer_only"] = _snapshot(model, optimizer)
        destroy_megatron()
    return out


def _world4(rank: int, world: int, root: str) -> dict:
    """Every kind in one world; a kind that raises is reported to its own tests (every rank
    raises at the same point: the runs are symmetric), the others still run."""
    import traceback

    from megatron.core import parallel_state as ps

    out = {}
    for kind in KINDS:
        try:
            out.update(_resume_run(kind, root))
        except Exception:  # noqa: BLE001 - reported by the tests of this kind
            out[kind] = traceback.format_exc()
            if kind == "distopt":
                out["optimizer_only"] = out[kind]
            if ps.model_parallel_is_initialized():
                destroy_megatron()
    for source, layout in CROSS_LAYOUT:
        try:  # a checkpoint of one --muon-dp-layout loaded into the other, one more step
            run = _run("distopt", layout)
            model, optimizer, scheduler = _build(run, OTHER_SEED)
            _load(os.path.join(root, source), model, optimizer, scheduler)
            loaded = _snapshot(model, optimizer)
            steps(run, model, optimizer, scheduler, first=2, count=1)
            out[f"{source}->{layout}"] = dict(loaded=loaded, continued=_snapshot(model, optimizer))
        except Exception:  # noqa: BLE001 - reported by the test of this pair
            out[f"{source}->{layout}"] = traceback.format_exc()
        if ps.model_parallel_is_initialized():
            destroy_megatron()
    # Megatron's dp_reshardable format cannot hold a balanced layout
    model, optimizer, scheduler = _build(_run("distopt-balanced"), OTHER_SEED)
    try:
        _load(os.path.join(root, "distopt-dp_reshardable"), model, optimizer, scheduler)
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    destroy_megatron()
    return out


def _world2(rank: int, world: int, root: str) -> dict:
    """TP2 x DP1: load each TP2 x DP2 distributed-optimizer checkpoint, one more step."""
    import traceback

    from megatron.core import parallel_state as ps

    out = {}
    for sharding in SHARDINGS["distopt"]:
        try:
            run = _run("distopt")
            model, optimizer, scheduler = _build(run, OTHER_SEED)
            _load(os.path.join(root, f"distopt-{sharding}"), model, optimizer, scheduler)
            loaded = _snapshot(model, optimizer)
            steps(run, model, optimizer, scheduler, first=2, count=1)
            out[sharding] = dict(loaded=loaded, continued=_snapshot(model, optimizer))
        except Exception:  # noqa: BLE001 - reported by the test of this sharding type
            out[sharding] = traceback.format_exc()
        if ps.model_parallel_is_initialized():
            destroy_megatron()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon-ckpt")  # made here, shared by every rank
    for name in CHECKPOINTS:  # dist_checkpointing.save wants an existing, empty directory
        (root / name).mkdir()
    root = str(root)
    world4 = run_world(4, _world4, root)
    try:
        world2 = run_world(2, _world2, root)
    except ChildError as e:  # reported by test_dp_resharding_load alone
        world2 = str(e)
    return world4, world2


def _ok(result, what: str):
    """A run's result, or the failure with the rank's traceback."""
    if isinstance(result, str):
        pytest.fail(f"{what} raised:\n{result}", pytrace=False)
    return result


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        if isinstance(a[name], dict):
            _assert_equal(a[name], b[name], f"{what} {name}")
        else:
            assert torch.equal(a[name], b[name]), (
                f"{what} {name}: max diff {(a[name] - b[name]).abs().max().item():.3e}")


def _flat(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def _assert_same_state(x: dict, y: dict, what: str) -> None:
    _assert_equal(x["params"], y["params"], f"{what}: param")
    _assert_equal(x["states"], y["states"], f"{what}: optimizer state")
    assert x["steps"] == y["steps"], what
    assert x["muon_steps"] == y["muon_steps"], what
    assert x["lr"] == y["lr"] and x["algorithms"] == y["algorithms"], what


@pytest.mark.parametrize("kind", list(KINDS))
def test_bitwise_resume(runs, kind):
    """TP2 x DP2: save after 2 steps, load into a differently initialized model, 2 more steps ==
    4 uninterrupted steps, bitwise (params, momentum, Adam moments, steps, muon_steps)."""
    for r in runs[0]:
        res = _ok(r[kind], kind)
        # The fresh model really is different, so the load has something to do.
        fc1 = next(n for n in res["fresh"] if n.endswith("layers.0.mlp.linear_fc1.weight"))
        assert not torch.equal(res["fresh"][fc1], res["ref"][2]["params"][fc1])
        _assert_same_state(res["loaded"], res["ref"][2], f"{kind} rank {res['loaded']['tp_rank']}: loaded")
        assert res["loaded"]["steps"] == {2.0} and res["loaded"]["muon_steps"] == 2
        _assert_same_state(res["resumed"], res["ref"][4], f"{kind}: resumed")
        assert res["resumed"]["muon_steps"] == 4


@pytest.mark.parametrize("kind", [*KINDS, "optimizer_only"])
def test_dp_replicas_identical_after_load(runs, kind):
    """After a load every DP replica holds the same params (upstream #6920), also when only the
    distributed optimizer's state was loaded; then they are the saved params."""
    snaps = [_ok(r[kind], kind) for r in runs[0]]
    snaps = [s if kind == "optimizer_only" else s["loaded"] for s in snaps]
    for a in snaps:
        for b in snaps:
            if a["tp_rank"] == b["tp_rank"]:
                _assert_equal(a["params"], b["params"], f"{kind}: DP replicas")
    if kind == "optimizer_only":
        for r in runs[0]:
            _assert_same_state(r["optimizer_only"], r["distopt"]["ref"][2], "optimizer-only load")


@pytest.mark.parametrize("sharding", SHARDINGS["distopt"])
def test_dp_resharding_load(runs, sharding):
    """Saved at TP2 x DP2, loaded at TP2 x DP1: params and every optimizer state (Muon momentum
    under ``exp_avg``) arrive bitwise; one more step matches the DP2 run."""
    world4, world2 = runs
    refs = [_ok(r["distopt"], "distopt")["ref"] for r in world4]
    ref = {x[2]["tp_rank"]: x for x in refs if x[2]["dp_rank"] == 0}
    world2 = _ok(world2, "the TP2 x DP1 run")
    for r in world2:
        r = _ok(r[sharding], f"the TP2 x DP1 load of {sharding}")
        tp_rank = r["loaded"]["tp_rank"]
        _assert_same_state(r["loaded"], ref[tp_rank][2], f"DP2 -> DP1 tp_rank {tp_rank}: loaded")
        cont, want = r["continued"], ref[tp_rank][3]
        for part in ("params", "states"):
            flat_c, flat_w = _flat(cont[part]), _flat(want[part])
            assert flat_c.keys() == flat_w.keys()
            worst = max(((flat_c[k] - flat_w[k]).abs().max().item(), k) for k in flat_w)
            assert worst[0] <= ATOL, f"DP1 continuation: {part} {worst[1]} off by {worst[0]:.2e}"
        assert cont["steps"] == {3.0} and cont["muon_steps"] == 3


@pytest.mark.parametrize("source, layout", CROSS_LAYOUT)
def test_load_across_dp_layouts(runs, source, layout):
    """A ``fully_reshardable`` checkpoint saved with one --muon-dp-layout loads into the other:
    params and every optimizer state arrive bitwise (they are keyed per model param, not by
    buffer offset), and one more step matches the saving layout's third step within ``ATOL``
    (the two layouts compute the same update; only where the bytes sit differs)."""
    kind = source.rsplit("-", 1)[0]
    for r in runs[0]:
        ref = _ok(r[kind], kind)["ref"]
        res = _ok(r[f"{source}->{layout}"], f"{source} loaded with --muon-dp-layout {layout}")
        _assert_same_state(res["loaded"], ref[2], f"{source} -> {layout}: loaded")
        cont, want = res["continued"], ref[3]
        for part in ("params", "states"):
            flat_c, flat_w = _flat(cont[part]), _flat(want[part])
            worst = max(((flat_c[k] - flat_w[k]).abs().max().item(), k) for k in flat_w)
            assert worst[0] <= ATOL, f"{source} -> {layout}: {part} {worst[1]} off by {worst[0]:.2e}"


def test_dp_reshardable_checkpoint_refused_by_balanced_layout(runs):
    """megatron-core's dp_reshardable format stores buckets as flat ranges of its own layout: a
    balanced-layout optimizer refuses to load one, in one line naming the flag to use. (Saving
    with the balanced layout writes fully_sharded_model_space instead, loaded above.)"""
    for r in runs[0]:
        message = r["refused"]
        assert message is not None, "a dp_reshardable checkpoint loaded into a balanced layout"
        assert "--muon-dp-layout megatron" in message and "\n" not in message
