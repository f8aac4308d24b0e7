"""``get_megatron_optimizer`` through the hooks on a real one-rank GPT (split from
``tests/unit/test_cli.py``, which checks the CLI layer and the hooks without a process group).

Megatron's own ``parse_args`` / ``validate_args`` with ``hooks.install()``, the
``OptimizerConfig`` Megatron builds from the parsed args, ``training.get_megatron_optimizer``
(dispatched to megatron-muon), one step, and Megatron's iteration log line through the
``training_log`` hook, in a Megatron world of one gloo rank.
"""

from __future__ import annotations

import sys

from dist_harness import run_world

# The smallest command line that passes validate_args on one CPU process (tests/unit/test_cli.py's BASE).
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 --lr 1e-3").split()


def _real_optimizer(rank: int, world: int) -> dict:
    """Megatron's args → Megatron's OptimizerConfig → training.get_megatron_optimizer, one step."""
    import contextlib
    import io
    import os

    import torch

    os.environ.update(WORLD_SIZE="1", RANK="0")
    from megatron.training import arguments, global_vars, training
    from megatron_harness import build_tiny_gpt, destroy_megatron, forward_backward, init_megatron, make_batch

    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.optimizer import MuonDistributedOptimizer

    hooks.install()
    sys.argv = ["pretrain_gpt.py", *BASE, *"--optimizer muon --use-distributed-optimizer --muon-tp-mode owner "
                "--muon-nesterov --clip-grad 0 --muonbp-period 2 --muon-log-stats --log-interval 1".split()]
    args = arguments.parse_args()
    arguments.validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)  # args, timers, ... as training does
    init_megatron(1)
    model = build_tiny_gpt(1, use_distributed_optimizer=True, dp_layout="balanced")  # at DP 1 every layout is whole
    config, overrides = training.get_megatron_optimizer_config(args)
    optimizer = training.get_megatron_optimizer(config, model, config_overrides=overrides,
                                                use_gloo_process_groups=args.use_gloo_process_groups,
                                                dump_param_to_param_group_map=args.dump_param_to_param_group_map)
    inner = optimizer.chained_optimizers[0]
    before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    forward_backward(model, make_batch(0), pp=1)
    ok, _, _ = optimizer.step()
    moved = sum(not torch.equal(before[n], p) for n, p in model[0].named_parameters())
    # Megatron's own iteration log, through the training_log hook (--muon-log-stats).
    args.padded_vocab_size = 128  # set by the tokenizer in a real run; read by the FLOPs estimate
    global_vars.get_timers()("interval-time", log_level=0).start(barrier=True)  # as train() does
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        training.training_log({"lm loss": torch.tensor(4.0)}, {}, 1e-3, 1, 1.0, False, 0, 1.0, None, None, None)
    out = dict(log=printed.getvalue(), kind=type(inner).__name__, is_muon=isinstance(inner, MuonDistributedOptimizer),
               ok=ok, tp_mode=inner.optimizer.config.tp_mode, nesterov=inner.optimizer.config.nesterov,
               moved=moved, total=len(before))
    destroy_megatron()
    return out


def test_get_megatron_optimizer_builds_muon_from_megatron_args():
    (out,) = run_world(1, _real_optimizer)
    assert out["is_muon"], out["kind"]
    assert out["ok"] and (out["tp_mode"], out["nesterov"]) == ("owner", True)
    assert out["moved"] == out["total"]
    # MuonBP P=2: the first applied step (t = 0) is a full step, and the log line says so.
    line = next(ln for ln in out["log"].splitlines() if " iteration " in ln)
    assert "muon mode: owner | muon step: full |" in line, line
    assert "muon bytes sent:" in line and "muon orthogonalize:" in line, line
