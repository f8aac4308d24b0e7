"""A skipped step changes nothing; unsupported configurations fail with one line naming the flag."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from megatron_harness import build_tiny_gpt, destroy_megatron, init_megatron
from training_harness import Run, train_all


def _config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    base = dict(optimizer="adam", lr=0.02, min_lr=0.02, weight_decay=0.1, bf16=False, clip_grad=0.0)
    return OptimizerConfig(**{**base, **kw})


def _snapshot(model, optimizer) -> dict:
    """A ``Run.probe``: the inner optimizer's params, state and step counter."""
    inner = optimizer.chained_optimizers[0].optimizer
    params = {id(p): p.detach().clone() for g in inner.param_groups for p in g["params"]}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in inner.state.items()}
    return dict(params=params, state=state, muon_steps=inner.muon_steps)


# TP2 x DP1. A loss scale is what makes Megatron check grads for inf/NaN (ConstantGradScaler);
# Megatron's plain fp32 optimizer (no distributed optimizer, no bf16) has no such check at all.
# At the second step one rank's one local gradient entry is NaN: found-inf is all-reduced over
# TP, so all ranks skip.
NAN = dict(tp=2, loss_scale=1.0, nan_step=1, probe=_snapshot)


@pytest.mark.parametrize("dist_opt, bf16", [(False, True), (True, False)], ids=["ddp-bf16", "distopt-fp32"])
def test_nan_step_is_skipped_and_changes_nothing(dist_opt, bf16):
    for (r,) in run_world(2, train_all, [Run(dist_opt=dist_opt, bf16=bf16, **NAN)]):
        assert r.oks[0], "the first step must be taken"
        assert r.oks[1] is False, "Megatron's found-inf check should reject the step"
        before, after = r.probes[0], r.probes[1]
        same_params = all(torch.equal(before["params"][k], after["params"][k]) for k in before["params"])
        same_state = all(
            torch.equal(v, after["state"][k][name]) for k, s in before["state"].items() for name, v in s.items()
        )
        assert same_params and same_state, "a skipped step touched params or momentum"
        assert before["muon_steps"] == after["muon_steps"], "the step counter moved on a skipped step"
        assert r.oks[2], "training must resume after a skipped step"


# One decision on every rank (MuonChainedOptimizer.prepare_grads): here the NaN lies in one DP
# rank's local gradient only, and DDP's all-reduce carries it into every DP rank's reduced
# gradient, so Megatron's per-optimizer reduction (over TP x PP, not DP) finds it on both ranks:
# neither steps into the DP owner exchange alone. TP1 x DP2 dense, and TP1 x EP2 with experts
# (two optimizers in the chain), without the distributed optimizer.
SPLIT_NAN = [Run(tp=1, dist_opt=False, bf16=True, loss_scale=1.0, nan_step=1, probe=_snapshot),
             Run(tp=1, ep=2, dist_opt=False, bf16=True, loss_scale=1.0, nan_step=1, probe=_snapshot,
                 moe=dict(experts=4, topk=2))]


@pytest.mark.parametrize("run", SPLIT_NAN, ids=["dp2-dense", "ep2-moe"])
def test_a_nan_on_one_dp_rank_skips_the_step_on_every_rank(run):
    results = run_world(2, train_all, [run])
    assert [r.oks[:3] for (r,) in results] == [[True, False, True]] * 2
    for (r,) in results:
        before, after = r.probes[0], r.probes[1]
        assert all(torch.equal(before["params"][k], after["params"][k]) for k in before["params"])
        assert before["muon_steps"] == after["muon_steps"]


def _fsdp2_nan_worker(rank: int, world: int) -> list[bool]:
    """Two steps under torch FSDP2 at DP2 (bf16, ``--loss-scale``); at the second, after FSDP2's
    reduce-scatter, rank 1 puts a NaN in its own rows of one grad. Returns whether each step was taken."""
    from megatron_harness import GLOBAL_BATCH, destroy_megatron, forward_backward, make_batch
    from training_harness import Run, build, start

    run = Run(tp=1, wrap="fsdp2", bf16=True, loss_scale=1.0, batch=GLOBAL_BATCH, split_batch=True, schedule=True)
    start(run)
    model, optimizer, _ = build(run)
    oks = []
    for step in range(2):
        forward_backward(model, make_batch(step), pp=1, optimizer=optimizer, use_schedule=True)
        if step == 1 and rank == 1:
            param = next(p for p in model[0].parameters() if p.grad is not None and p.grad._local_tensor.numel())
            param.grad._local_tensor.view(-1)[0] = float("nan")
        oks.append(optimizer.step()[0])
    destroy_megatron()
    return oks


# FSDP2 leaves each DP rank its own rows of every grad, so a NaN there is on one DP rank only;
# DTensor's found-inf check reduces the flag over FSDP2's DP mesh (MuonChainedOptimizer), and
# both ranks skip.
def test_fsdp2_a_nan_in_one_dp_ranks_rows_skips_the_step_on_every_rank():
    assert run_world(2, _fsdp2_nan_worker) == [[True, False]] * 2


def _errors_worker(rank: int, world: int) -> dict:
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    init_megatron(1, 1)
    model = build_tiny_gpt(1, 1)
    errors = {}

    def attempt(name, make):
        try:
            make()
            errors[name] = "<no error>"
        except ValueError as e:
            errors[name] = str(e)

    attempt("fp16", lambda: get_megatron_muon_optimizer(_config(fp16=True, bf16=False), model))
    attempt("tp_mode", lambda: MuonConfig(tp_mode="sharded"))
    ddp = model[0].ddp_config
    # The flags below are read from DDP's config; setting them on the built model's config is
    # what Megatron's own arguments do before wrapping (the check runs before any use of it).
    ddp.num_distributed_optimizer_instances = 2
    attempt("instances", lambda: get_megatron_muon_optimizer(_config(), model))
    ddp.num_distributed_optimizer_instances = 1
    # Experts are supported (tests/megatron/test_moe.py); one tensor holding every local expert is not
    # (TE's moe_single_grouped_weight): a 3-D weight, refused by name and shape.
    model[0].module.decoder.layers[0].mlp.register_parameter("grouped", torch.nn.Parameter(torch.zeros(2, 3, 4)))
    attempt("grouped_experts", lambda: get_megatron_muon_optimizer(_config(), model))
    destroy_megatron()
    return errors


EXPECTED = {
    "fp16": r"^--fp16: .*use --bf16$",
    "tp_mode": r"^--muon-tp-mode: expected one of .*'owner'.* got 'sharded'$",
    "instances": r"^--num-distributed-optimizer-instances > 1: not supported",
    "grouped_experts": r"^module\.decoder\.layers\.0\.mlp\.grouped has shape \(2, 3, 4\): Muon takes 2-D matrices; "
                       r"a grouped expert weight \(moe_single_grouped_weight\) is not supported",
}


def test_unsupported_configurations_name_the_flag():
    import re

    errors = run_world(1, _errors_worker)[0]
    for name, pattern in EXPECTED.items():
        assert re.search(pattern, errors[name]), f"{name}: {errors[name]!r}"
        assert "\n" not in errors[name], "errors are one line"
