"""Nothing per step for logs that are not written (``log_stats``), and the loss-scale check no
dearer than Megatron's own (``MuonChainedOptimizer.prepare_grads``), in gloo worlds of 2 ranks.

* Through the hooks (Megatron's parser, ``training.get_megatron_optimizer``, Megatron's own
  ``training_log``), iterations driven as ``train()`` drives them: on an iteration that does not
  log, the optimizer step makes no norm pass (no ``vector_norm`` / ``_foreach_norm`` call from
  ``megatron_muon.optimizer``) and ``training_log`` makes no collective of megatron-muon's (Megatron's
  own max of the lr over the model-parallel group remains); on a log iteration
  the norms are one all-reduce over Megatron's grad-stats group, and their values are exactly
  those of the same run logging every iteration (MuonBP P=2: each log shows the kind it did not
  step from the iteration before).
* With ``--loss-scale`` a step makes one all-reduce and one host read more than without: Megatron's
  own found-inf check, over its grad-stats group (with and without the distributed optimizer).
  A NaN in one DP rank's local gradient, before DDP's reduction, skips the step on every rank,
  and the step makes no collective over the default (world) group.
"""

from __future__ import annotations

import sys

import pytest
from dist_harness import run_world

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --train-iters 6 --lr 1e-3 --optimizer muon --use-distributed-optimizer "
        "--muon-tp-mode owner --clip-grad 0 --muonbp-period 2 --muon-log-stats").split()
ITERATIONS = 6
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "reduce_scatter_tensor", "all_to_all_single", "reduce")


class _Spy:
    """Counts, while ``active``, the collectives called through ``torch.distributed`` (name, group
    size, whether megatron-muon called it) and the norm calls made from ``megatron_muon.optimizer``
    (the Muon step's norm passes); ``on_default`` keeps the collectives made over the default group
    itself (``group`` None or ``WORLD``, not another group of the same ranks)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.active, self.collectives, self.norm_calls, self.on_default = False, [], 0, []
        self._undo = []
        for name in COLLECTIVES:
            self._wrap(dist, name, self._collective(name, getattr(dist, name)))
        for owner, name in ((torch, "_foreach_norm"), (torch.linalg, "vector_norm")):
            self._wrap(owner, name, self._norm(getattr(owner, name)))

    def _wrap(self, owner, name, replacement):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _collective(self, name, original):
        import inspect

        import torch.distributed as dist

        signature = inspect.signature(original)

        def spy(*args, **kwargs):
            if self.active:
                ours = sys._getframe(1).f_globals.get("__name__", "").startswith("megatron_muon")
                group = signature.bind(*args, **kwargs).arguments.get("group")
                self.collectives.append((name, dist.get_world_size(group), ours))
                if group is None or group is dist.group.WORLD:
                    self.on_default.append((name, sys._getframe(1).f_globals.get("__name__")))
            return original(*args, **kwargs)
        return spy

    def _norm(self, original):
        def spy(*args, **kwargs):
            if self.active and sys._getframe(1).f_globals.get("__name__") == "megatron_muon.optimizer":
                self.norm_calls += 1
            return original(*args, **kwargs)
        return spy

    def take(self):
        out = dict(collectives=list(self.collectives), norm_calls=self.norm_calls, on_default=list(self.on_default))
        self.collectives, self.norm_calls, self.on_default = [], 0, []
        return out

    def close(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _logged_run(rank: int, world: int, log_interval: int) -> dict:
    """``ITERATIONS`` iterations as ``train()`` runs them, through the hooks: per iteration, what
    its optimizer step and its ``training_log`` cost, and the norms the log read."""
    import contextlib
    import io
    import os

    import torch
    from megatron.training import arguments, global_vars, training
    from megatron_harness import build_tiny_gpt, destroy_megatron, forward_backward, init_megatron, make_batch

    from megatron_muon.megatron import hooks, log_stats

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    hooks.install()
    sys.argv = ["pretrain_gpt.py", *BASE, "--log-interval", str(log_interval)]
    args = arguments.parse_args()
    arguments.validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)
    init_megatron(1)
    model = build_tiny_gpt(1, use_distributed_optimizer=True, dp_layout="balanced")
    config, overrides = training.get_megatron_optimizer_config(args)
    optimizer = training.get_megatron_optimizer(config, model, config_overrides=overrides,
                                                use_gloo_process_groups=args.use_gloo_process_groups)
    args.padded_vocab_size = 128  # set by the tokenizer in a real run; read by the FLOPs estimate
    global_vars.get_timers()("interval-time", log_level=0).start(barrier=True)  # as train() does
    read = {}
    norm_scalars = log_stats.norm_scalars

    def recording(optimizers):  # what each log read, by iteration
        read[iteration] = norm_scalars(optimizers)
        return read[iteration]

    log_stats.norm_scalars = recording
    spy, costs, printed = _Spy(), [], io.StringIO()
    try:
        for iteration in range(1, ITERATIONS + 1):  # train(): curr_iteration, train_step, +1, training_log
            args.curr_iteration = iteration - 1
            forward_backward(model, make_batch(iteration), pp=1)
            spy.active = True
            ok, _, _ = optimizer.step()
            step = spy.take()
            with contextlib.redirect_stdout(printed):
                training.training_log({"lm loss": torch.tensor(4.0)}, {}, 1e-3, iteration, 1.0, False, 0, 1.0, None,
                                      None, None, is_first_iteration=iteration == 1)
            spy.active = False
            costs.append(dict(ok=ok, step=step, log=spy.take()))
    finally:
        spy.close()
        log_stats.norm_scalars = norm_scalars
    stats_group = optimizer.chained_optimizers[0].get_grad_stats_parallel_group()
    out = dict(costs=costs, read=read, lines=[ln for ln in printed.getvalue().splitlines() if " iteration " in ln],
               stats_group_size=torch.distributed.get_world_size(stats_group))
    destroy_megatron()
    return out


def test_no_norm_pass_and_no_collective_on_iterations_that_do_not_log():
    every, sparse = (run_world(2, _logged_run, interval, fresh=True) for interval in (1, 3))
    logged = {1, 3, 6}  # the first iteration, then every --log-interval
    for out in sparse:
        assert all(c["ok"] for c in out["costs"])
        assert sorted(out["read"]) == sorted(logged)
        for iteration, cost in enumerate(out["costs"], start=1):
            # MuonBP P=2: a log shows the last step of each kind, so the step before a log records too
            records = iteration in logged or iteration + 1 in logged
            assert (cost["step"]["norm_calls"] > 0) == records, (iteration, cost)
            ours = [c for c in cost["log"]["collectives"] if c[2]]  # Megatron's own (its lr's max) aside
            if iteration in logged:  # the norms: one all-reduce over the grad-stats group (here the job)
                assert ours == [("all_reduce", out["stats_group_size"], True)], (iteration, cost)
            else:
                assert ours == [], (iteration, cost)
    lines = sparse[-1]["lines"]  # Megatron prints on the last rank
    assert len(lines) == len(logged) and all(" muon param norm: " in ln for ln in lines), lines
    for out_every, out_sparse in zip(every, sparse):
        assert all(c["step"]["norm_calls"] > 0 for c in out_every["costs"])  # every iteration logs there
        for iteration in logged:  # the same figures, bitwise, as a run computing them every step
            assert out_sparse["read"][iteration] == out_every["read"][iteration], iteration
        assert set(out_sparse["read"][6]) == {"muon/param_norm", "muon/update_rms_full", "muon/update_rms_block"} | {
            # per class, from the last (block) step: no residual, a block step runs NS on no whole matrix
            f"muon/{c}/{f}" for c in ("attention", "mlp") for f in ("update_rms", "matched_rms")}


def _step_cost(rank: int, world: int, dist_opt: bool, loss_scale: float | None, nan: bool = False,
               moe: bool = False) -> dict:
    """Steps of the tiny GPT at TP1 x DP2 (bf16 without the distributed optimizer, as Megatron's
    Float16 wrapper needs; ``moe``: experts at EP2, a chain of two optimizers): the collectives and
    the host reads (``Tensor.item``) the spied step makes. ``nan``: three steps, the second with a
    NaN in rank 1's local gradient before DDP's reduction (``training_harness.plant_nan``), spied,
    with whether each step was taken and whether the skipped one left the params as they were."""
    import torch
    from megatron_harness import destroy_megatron, forward_backward, make_batch
    from training_harness import Run, build, local_params, plant_nan, start

    run = Run(tp=1, ep=2 if moe else 1, dist_opt=dist_opt, bf16=not dist_opt, loss_scale=loss_scale,
              moe=dict(experts=4, topk=2) if moe else None)
    start(run)
    model, optimizer, _ = build(run)
    spy, item, reads = _Spy(), torch.Tensor.item, [0]

    def counted_item(self):
        reads[0] += spy.active
        return item(self)

    oks, spied, unchanged = [], None, None
    try:
        for step in range(3 if nan else 1):
            planted = nan and step == 1
            forward_backward(model, make_batch(step), pp=1, optimizer=optimizer,
                             before_reduce=plant_nan if planted else None)
            before = local_params(model)
            torch.Tensor.item, spy.active = counted_item, planted or not nan
            try:
                ok, _, _ = optimizer.step()
            finally:
                torch.Tensor.item, spy.active = item, False
            oks.append(ok)
            if planted or not nan:
                spied = dict(reads=reads[0], **spy.take())
                after = local_params(model)
                unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finally:
        spy.close()
    stats_groups = [torch.distributed.get_world_size(o.get_grad_stats_parallel_group())
                    for o in optimizer.chained_optimizers]
    destroy_megatron()
    return dict(oks=oks, unchanged=unchanged, stats_groups=stats_groups, **spied)


@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp-bf16", "distopt"])
def test_loss_scale_costs_only_megatrons_own_check(dist_opt):
    plain, scaled = (run_world(2, _step_cost, dist_opt, scale) for scale in (None, 1.0))
    for a, b in zip(plain, scaled):
        assert a["oks"] == b["oks"] == [True]
        added = list(b["collectives"])
        for call in a["collectives"]:
            added.remove(call)
        # Megatron's found-inf all-reduce over its grad-stats group (TP x PP without the
        # distributed optimizer: here one rank; with it every rank) and its host read: nothing else
        assert added == [("all_reduce", b["stats_groups"][0], False)], (a["collectives"], b["collectives"])
        assert b["reads"] - a["reads"] == 1, (a["reads"], b["reads"])
        assert b["on_default"] == [], b["on_default"]


# A NaN in one DP rank's local gradient reaches every DP rank's reduced gradient through DDP's
# all-reduce, so each grad-stats group finds it (MuonChainedOptimizer.prepare_grads): the ranks
# skip together, and nothing in the step reduces over the default group. Dense at TP1 x DP2, and
# at TP1 x EP2 with experts (a chain of two optimizers: dense over DP2, experts over EP2).
@pytest.mark.parametrize("moe", [False, True], ids=["dp2-dense", "ep2-moe"])
def test_a_nan_on_one_dp_rank_skips_every_rank_without_a_world_collective(moe):
    for out in run_world(2, _step_cost, False, 1.0, True, moe):
        assert out["oks"] == [True, False, True], out["oks"]
        assert out["unchanged"], "a skipped step changed this rank's params"
        assert out["on_default"] == [], out["on_default"]
        # the skipped step: Megatron's found-inf all-reduce per optimizer, over its grad-stats group
        assert out["collectives"] == [("all_reduce", n, False) for n in out["stats_groups"]], out["collectives"]
