#!/usr/bin/env python
"""Convergence comparison: AdamW, Muon, BlockMuon and MuonBP on a tiny GPT, same token budget.

Every run is Megatron's own training loop (``scripts/pretrain_gpt.py`` under
``torchrun --nproc-per-node 2``: TP=2, gloo, CPU) on the byte-level stdlib dataset that
``scripts/prepare_data.py`` writes (``data/train_text_document``, ``data/valid_text_document``;
NullTokenizer, vocab 257; built first if missing). The full comparison (about 30 minutes on
2 cores)::

    .venv/bin/python -m scripts.bench.compare_optimizers --out-dir bench-results/compare

Runs (each optimizer × each LR of its grid; ``--optimizers`` picks a subset):

    adamw      --optimizer adam                                   lrs 3e-4, 1e-3, 3e-3
    muon       --optimizer muon --muon-tp-mode owner              lrs 3e-4, 1e-3, 3e-3
    blockmuon  --optimizer muon --muon-tp-mode blockwise          lrs 3e-4, 1e-3, 3e-3
    muonbp     --optimizer muon --muon-tp-mode owner --muonbp-period 5   (same lrs as muon)
    muon_gram  --optimizer muon --muon-tp-mode owner --muon-ns-method gram   (not in the default set)
    muon_gram_fp16   the same with --muon-gram-fp16                           (not in the default set)
    muon_per_head    --optimizer muon --muon-tp-mode owner --muon-split-qkv-per-head   (not in the default set)

all with ``--use-distributed-optimizer``, the same seed (same initial weights, same batches in
the same order; ``--seeds 1234,1,2`` runs every (optimizer, lr) once per seed, and the tables then
show mean ± sample standard deviation over seeds, the best lr chosen by the mean), weight decay
0.1, Adam betas (0.9, 0.95), clip-grad 1.0 and the same schedule: linear warmup over the first
10% of iterations, then cosine decay to 0.1 × lr at the last one.

Model (``--model default``): 4 layers, hidden 256, 4 heads in 2 query groups (GQA), sequence 256,
Llama-style (RoPE, RMSNorm, SwiGLU, untied embeddings, no biases) with the CPU flags of
``configs/tiny-cpu.yaml``; micro-batch 8 = global batch 8 (one micro-batch per step at DP=1),
200 iterations: 200 × 8 × 256 = 409,600 training tokens per run. ``--model tiny`` (2 layers,
hidden 64, seq 64) is for the test.

Sizing (measured on 2 cores, this model, micro-batch = global batch 8): about 470 ms per
iteration with AdamW and 540 ms with Muon (owner) on a quiet machine (420 ms at batch 4, 900 ms
at 16: a ~300 ms per-step floor, so batch 8 buys the most steps per second without wasting it),
about 9 s of startup per run, ~1.5 s per evaluation: ~125 s a run, ~25 minutes for the 12 runs
(more when other work shares the cores: 700-850 ms per iteration and ~20 s startup at load 7).

What ``--lr`` moves under ``--optimizer muon`` (megatron_muon/megatron/optimizer.py,
optimizer.py): the Muon group holds only the hidden 2-D weights (QKV, attention output, fc1,
fc2); the embedding, the output layer and the RMSNorm gains are updated by AdamW *with the same
scheduled --lr* (Megatron's scheduler rewrites every group's lr; there is no separate Muon lr).
Sweeping --lr therefore moves both halves of a Muon run together. (Megatron's ``--decoupled-lr``
would give the embedding and output layer their own lr, not the norms; ``--extra-args`` passes
it to every run if wanted.) With the default ``--muon-scale-mode spectral`` the orthogonalized
update is scaled by sqrt(max(rows, cols)), so its per-entry RMS is lr itself, several times
AdamW's at the same lr: Muon alone would want a lower lr than AdamW, while its AdamW half wants
AdamW's. All grids are 3e-4, 1e-3, 3e-3: first sweeps at AdamW 1e-3/3e-3/1e-2 and at Muon,
BlockMuon and MuonBP 1e-3/3e-3/1e-2 had their best at 1e-3, the low edge, every time (and 1e-2
was the worst for all four), so the grids were moved down one step (``--reuse`` kept the runs
already made). ``--lr-grid NAME=a,b,c`` replaces a
grid; results.md flags an optimizer whose best lr lies at the edge of its grid.

Evaluation: ``--evals`` (5) evaluations spread over the run (``--eval-interval`` = train-iters /
evals), each on ``--eval-iters`` (8) global batches = 16,384 validation tokens, plus the one
Megatron runs after training; when that falls on the iteration of the last in-loop evaluation
the two are averaged (twice the tokens at the end). The k-th evaluation of every run sees the
same validation batches, so runs compare point by point. A run's best validation loss is the
minimum over its evaluations; an optimizer's best lr is the run with the lowest best validation
loss among its grid.

Outputs in ``--out-dir``: ``<optimizer>_lr<lr>.log`` (the full torchrun stdout+stderr of each
run), ``results.json`` (per run: curves of (iteration, lm loss) for training as logged every
``--log-interval`` iterations, and for validation, best validation loss, wall time, status),
``results.md`` (best per optimizer, the full sweep, token budget, command; also printed) and
``loss_curves.png`` (smoothed training loss and validation loss vs tokens, best lr of each).
A failed run is recorded, shown as failed, and makes the script exit 1 after the others ran.

``--reference NAME`` adds a table of every other optimizer's best and final validation loss minus
NAME's at the same lr and seed (same weights, same batches): the Gram Newton–Schulz equivalence
check (issue 25) is ``--optimizers muon,muon_gram --lr-grid muon=1e-3 --lr-grid muon_gram=1e-3
--seeds 1234,1,2 --reference muon``.

Caveat: at scale the paper (Khaled et al., arXiv 2510.16981) orders final losses as
MuonBP ≈ Muon < BlockMuon < AdamW. A 0.4M-token run of a 3M-parameter model on 2 CPU cores is
far from that regime (and TP=2 blocks are halves of small matrices), so it may not show that
ordering; it checks that all four train sensibly inside Megatron at equal budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "scripts" / "pretrain_gpt.py"
BASE_CONFIG = REPO / "configs" / "tiny-cpu.yaml"

# name → (label, flags). Everything else about a run is shared.
OPTIMIZERS = {
    "adamw": ("AdamW", ["--optimizer", "adam"]),
    "muon": ("Muon", ["--optimizer", "muon", "--muon-tp-mode", "owner"]),
    "blockmuon": ("BlockMuon", ["--optimizer", "muon", "--muon-tp-mode", "blockwise"]),
    "muonbp": ("MuonBP (P=5)", ["--optimizer", "muon", "--muon-tp-mode", "owner", "--muonbp-period", "5"]),
    "muon_gram": ("Muon, Gram NS", ["--optimizer", "muon", "--muon-tp-mode", "owner", "--muon-ns-method", "gram"]),
    "muon_gram_fp16": ("Muon, Gram NS, fp16 products", ["--optimizer", "muon", "--muon-tp-mode", "owner",
                                                        "--muon-ns-method", "gram", "--muon-gram-fp16"]),
    "muon_per_head": ("Muon, per-head QKV", ["--optimizer", "muon", "--muon-tp-mode", "owner",
                                              "--muon-split-qkv-per-head"]),
}
DEFAULT_LRS = {
    "adamw": [3e-4, 1e-3, 3e-3],
    "muon": [3e-4, 1e-3, 3e-3],
    "blockmuon": [3e-4, 1e-3, 3e-3],
    "muonbp": [3e-4, 1e-3, 3e-3],
    "muon_gram": [3e-4, 1e-3, 3e-3],
    "muon_gram_fp16": [3e-4, 1e-3, 3e-3],
    "muon_per_head": [3e-4, 1e-3, 3e-3],
}
DEFAULT_OPTIMIZERS = ("adamw", "muon", "blockmuon", "muonbp")
DEFAULT_SEED = 1234  # Megatron's --seed default: the single-seed runs recorded so far used it
MODELS = {
    "default": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, seq_length=256),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64),
}
# Keys of configs/tiny-cpu.yaml this script sets itself or leaves out (no checkpoints, no stats).
DROPPED_CONFIG_KEYS = ("save", "load", "save_interval", "ckpt_format", "optimizer", "muon_tp_mode",
                       "muon_log_stats", "train_data_path", "valid_data_path")

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                            r".*?lm loss: ([0-9.EeNnAaIiFf+-]+) \|")
PARAM_NORM = re.compile(r"muon param norm: ([0-9.EeNnAaIiFf+-]+) \|")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| "
                             r"lm loss value: ([0-9.EeNnAaIiFf+-]+) \|")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS), help="comma-separated, from "
                   + ", ".join(OPTIMIZERS) + f" (default: {','.join(DEFAULT_OPTIMIZERS)})")
    p.add_argument("--seeds", default=str(DEFAULT_SEED),
                   help="comma-separated Megatron --seed values; every (optimizer, lr) runs once per seed "
                        "(weights and batch order follow the seed)")
    p.add_argument("--reference", default=None, metavar="NAME",
                   help="an optimizer of --optimizers: every other one's per-seed difference in best and "
                        "final validation loss against it, at the same lr and seed, is tabulated")
    p.add_argument("--lr-grid", action="append", default=[], metavar="NAME=LR,LR,...",
                   help="replace an optimizer's LR grid (repeatable), e.g. muon=2e-3,5e-3,1e-2")
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    for key in ("num_layers", "hidden_size", "seq_length"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="override the --model preset")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--evals", type=int, default=5, help="evaluations during a run")
    p.add_argument("--eval-iters", type=int, default=8, help="global batches per evaluation")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--data-dir", type=Path, default=REPO / "data",
                   help="where prepare_data.py wrote train/valid_text_document (built if missing)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "compare")
    p.add_argument("--extra-args", default="", help="more Megatron flags for every run (one shell string)")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds before a run is killed")
    p.add_argument("--reuse", action="store_true",
                   help="keep the successful runs of --out-dir's results.json whose Megatron flags are "
                        "unchanged (to extend a grid or finish an interrupted comparison)")
    args = p.parse_args(argv)
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in args.optimizers if o not in OPTIMIZERS]
    if unknown or not args.optimizers:
        p.error(f"--optimizers: unknown {unknown}; choose from {', '.join(OPTIMIZERS)}")
    args.lrs = {name: list(lrs) for name, lrs in DEFAULT_LRS.items()}
    for item in args.lr_grid:
        name, _, values = item.partition("=")
        if name not in OPTIMIZERS or not values:
            p.error(f"--lr-grid {item!r}: expected NAME=LR,LR,... with NAME in {', '.join(OPTIMIZERS)}")
        args.lrs[name] = [float(v) for v in values.split(",")]
    try:
        args.seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds {args.seeds}: expected at least one seed, none repeated")
    if args.reference is not None and args.reference not in args.optimizers:
        p.error(f"--reference {args.reference!r}: expected one of --optimizers ({', '.join(args.optimizers)})")
    if args.evals < 1 or args.eval_iters < 1 or args.train_iters < args.evals:
        p.error("need evals >= 1, eval-iters >= 1 and train-iters >= evals")
    return args


def model_dims(args) -> dict:
    dims = dict(MODELS[args.model])
    for key in ("num_layers", "hidden_size", "seq_length"):
        if getattr(args, key) is not None:
            dims[key] = getattr(args, key)
    return dims


def eval_interval(args) -> int:
    return args.train_iters // args.evals


def expected_train_points(train_iters: int, log_interval: int) -> list[int]:
    """Iterations Megatron logs: the first, then every log_interval-th."""
    return sorted({1, *range(log_interval, train_iters + 1, log_interval)})


def expected_val_points(train_iters: int, interval: int) -> list[int]:
    """In-loop evaluations at multiples of the interval, then the one after training."""
    return sorted({*range(interval, train_iters + 1, interval), train_iters})


def shared_flags(args, data_dir: Path, cache_dir: Path) -> list[str]:
    """Megatron flags common to every run: the tiny-cpu config's CPU and Llama-style flags, this
    comparison's model size, batch, schedule and evaluation (validated by the real parser)."""
    from megatron_muon.megatron.yaml_config import args_from_mapping, read_yaml

    mapping = read_yaml(BASE_CONFIG)
    for key in DROPPED_CONFIG_KEYS:
        mapping.pop(key, None)
    dims = model_dims(args)
    mapping.update(
        num_layers=dims["num_layers"], hidden_size=dims["hidden_size"],
        num_attention_heads=dims["num_attention_heads"],
        group_query_attention=True, num_query_groups=dims["num_query_groups"],
        seq_length=dims["seq_length"], max_position_embeddings=dims["seq_length"],
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, use_distributed_optimizer=True,
        lr_decay_style="cosine", lr_decay_iters=args.train_iters,
        lr_warmup_iters=max(1, round(args.warmup_fraction * args.train_iters)),
        weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
        tokenizer_type="NullTokenizer", vocab_size=257,
        log_interval=args.log_interval, eval_interval=eval_interval(args), eval_iters=args.eval_iters,
    )
    flags = args_from_mapping(mapping, f"{BASE_CONFIG} + compare_optimizers")
    flags += ["--train-data-path", str(data_dir / "train_text_document"),
              "--valid-data-path", str(data_dir / "valid_text_document"),
              "--data-cache-path", str(cache_dir)]
    return flags + shlex.split(args.extra_args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_log(text: str) -> dict:
    train = [(int(m[1]), float(m[3])) for m in ITERATION_LINE.finditer(text)]
    ms = [float(m[2]) for m in ITERATION_LINE.finditer(text)][1:]  # the first includes warm-up
    # Same-iteration evaluations (the last in-loop one and the post-training one) are averaged.
    by_iteration: dict[int, list[float]] = {}
    for m in VALIDATION_LINE.finditer(text):
        by_iteration.setdefault(int(m[1]), []).append(float(m[2]))
    val = [(it, sum(v) / len(v)) for it, v in sorted(by_iteration.items())]
    # --muon-log-stats: the Muon matrices' global parameter norm after the step, per logged iteration.
    norms = []
    for m in ITERATION_LINE.finditer(text):
        end = text.find("\n", m.start())
        if n := PARAM_NORM.search(text, m.start(), len(text) if end < 0 else end):
            norms.append((int(m[1]), float(n[1])))
    return dict(train_loss=train, val_loss=val, param_norm=norms,
                ms_per_iteration=statistics.median(ms) if ms else None)


def run_name(name: str, lr: float, seed: int) -> str:
    """A run's file stem; the default seed's keeps the name single-seed comparisons always had."""
    return f"{name}_lr{lr:g}" + ("" if seed == DEFAULT_SEED else f"_seed{seed}")


PORT_TAKEN = "EADDRINUSE"
"""In a run's log when its rendezvous port was taken between ``free_port`` and the bind (runs
started side by side, as the MuonBP study starts them, can draw the same freed port)."""


def run_training(flags: list[str], log_path: Path, timeout: float, nproc: int = 2) -> dict:
    """One run of Megatron's loop (``scripts/pretrain_gpt.py`` with ``flags``) on CPU, its stdout
    and stderr in ``log_path``: returncode, wall_s, status (ok = exit 0, logged losses, all finite),
    the parsed curves and best_val_loss. ``nproc`` ranks under torchrun; one rank runs the entry
    directly with torchrun's variables set (no launcher interpreter to import torch in). A run
    whose rendezvous port was taken before it bound it is started again on another port (up to
    three times): it never began training."""
    for _ in range(3):
        result = _run_training_once(flags, log_path, timeout, nproc)
        if result["returncode"] == 0 or PORT_TAKEN not in log_path.read_text(errors="replace"):
            break
    return result


def _run_training_once(flags: list[str], log_path: Path, timeout: float, nproc: int) -> dict:
    port = str(free_port())
    if nproc == 1:
        cmd = [sys.executable, str(ENTRY), *flags]
        launch_env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", port, str(ENTRY), *flags]
        launch_env = {}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",  # the CPU comparison wherever it runs
               CUDA_DEVICE_MAX_CONNECTIONS="1",     # Megatron wants it with TP > 1
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),  # ranks share the cores
               **launch_env)
    start = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, to kill on timeout
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException as err:  # a timeout, or Ctrl-C (which its own session does not get)
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            if not isinstance(err, subprocess.TimeoutExpired):
                raise
            log.write(f"\n[{Path(sys.argv[0]).stem}] killed after --run-timeout {timeout:g} s\n")
    wall = time.time() - start
    result = dict(returncode=rc, wall_s=round(wall, 1), log=log_path.name,
                  **parse_log(log_path.read_text(errors="replace")))
    losses = [v for _, v in result["train_loss"] + result["val_loss"]]
    ok = rc == 0 and result["train_loss"] and result["val_loss"] and all(map(math.isfinite, losses))
    result["status"] = "ok" if ok else "failed"
    result["best_val_loss"] = min(v for _, v in result["val_loss"]) if ok else None
    return result


def run_one(name: str, lr: float, seed: int, flags: list[str], out_dir: Path, timeout: float) -> dict:
    run_flags = [*flags, *OPTIMIZERS[name][1], "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--seed", str(seed)]
    result = run_training(run_flags, out_dir / f"{run_name(name, lr, seed)}.log", timeout)
    return dict(optimizer=name, label=OPTIMIZERS[name][0], lr=lr, seed=seed, **result)


def previous_runs(results_path: Path, flags: list[str]) -> dict[tuple[str, float, int], dict]:
    """(optimizer, lr, seed) → a successful run recorded with exactly these shared Megatron flags
    (the per-run flags follow from the optimizer, the lr and the seed; the port is not among them;
    a run recorded before seeds were a knob ran with the default seed)."""
    if not results_path.is_file():
        return {}
    recorded = json.loads(results_path.read_text())
    if recorded["meta"]["megatron_flags"] != flags:
        return {}
    runs = [dict(r, seed=r.get("seed", DEFAULT_SEED)) for r in recorded["runs"] if r["status"] == "ok"]
    return {(r["optimizer"], r["lr"], r["seed"]): r for r in runs}


def smooth(values: list[float], beta: float = 0.7) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def cells(runs: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """(optimizer, lr) → its runs, one per seed, in run order."""
    out: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        out.setdefault((r["optimizer"], r["lr"]), []).append(r)
    return out


def best_cells(runs: list[dict]) -> dict[str, list[dict]]:
    """optimizer → the runs (one per seed) of its best lr: the lowest mean best validation loss
    over seeds, among the lrs whose every seed finished (a mean over fewer seeds is not comparable)."""
    best: dict[str, list[dict]] = {}
    for (name, _), group in cells(runs).items():
        if any(r["status"] != "ok" for r in group):
            continue
        if name not in best or mean_of(group, "best_val_loss") < mean_of(best[name], "best_val_loss"):
            best[name] = group
    return best


def best_runs(runs: list[dict]) -> dict[str, dict]:
    """optimizer → the first seed's run at its best lr."""
    return {name: group[0] for name, group in best_cells(runs).items()}


def final_val(r: dict) -> float | None:
    return r["val_loss"][-1][1] if r["status"] == "ok" else None


def mean_of(group: list[dict], key: str) -> float:
    values = [final_val(r) if key == "final_val_loss" else r[key] for r in group]
    return statistics.fmean(values)


def spread(values: list[float]) -> str:
    """mean, and ± the sample standard deviation over seeds when there is more than one."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def reference_lines(runs: list[dict], reference: str) -> list[str]:
    """Per (optimizer, lr, seed): best and final validation loss minus the reference's at the same
    lr and seed (same weights, same batches), then each optimizer's largest |difference|."""
    ref = {(r["lr"], r["seed"]): r for r in runs if r["optimizer"] == reference and r["status"] == "ok"}
    label = OPTIMIZERS[reference][0]
    lines = [f"## Against {label} (same lr, same seed)", "",
             f"| optimizer | lr | seed | best val ({label}) | best val | Δ best | final val ({label}) | "
             "final val | Δ final |", "|---|---|---|---|---|---|---|---|---|"]
    worst: dict[str, list[float]] = {}
    for r in runs:
        base = ref.get((r["lr"], r["seed"]))
        if r["optimizer"] == reference or r["status"] != "ok" or base is None:
            continue
        d_best, d_final = r["best_val_loss"] - base["best_val_loss"], final_val(r) - final_val(base)
        worst.setdefault(r["label"], []).extend([abs(d_best), abs(d_final)])
        lines.append(f"| {r['label']} | {r['lr']:g} | {r['seed']} | {base['best_val_loss']:.4f} | "
                     f"{r['best_val_loss']:.4f} | {d_best:+.4f} | {final_val(base):.4f} | {final_val(r):.4f} | "
                     f"{d_final:+.4f} |")
    lines.append("")
    lines += [f"- {name}: largest |Δ| over its runs {max(ds):.4f} ({len(ds) // 2} runs paired)"
              for name, ds in worst.items()]
    return lines + [""]


def fmt(x, spec=".4f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(runs: list[dict], meta: dict, lrs: dict) -> str:
    best = best_cells(runs)
    names = list(dict.fromkeys(r["optimizer"] for r in runs))
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    lines = ["# Optimizer comparison (megatron-muon, TP=2 on CPU)", "",
             f"Model: {meta['model']}. Token budget per run: {meta['tokens_per_run']:,} "
             f"({meta['train_iters']} iterations × global batch {meta['global_batch_size']} × "
             f"sequence {meta['seq_length']}). Schedule: {meta['schedule']}. Validation: "
             f"{meta['validation']}.", "",
             "LR grids: " + "; ".join(f"{OPTIMIZERS[n][0]} {', '.join(f'{lr:g}' for lr in g)}"
                                      for n, g in lrs.items() if n in names) + ".",
             f"Seeds: {', '.join(map(str, seeds))}" + (" (mean ± sample standard deviation over seeds)."
                                                      if len(seeds) > 1 else "."), "",
             "## Best validation loss per optimizer", "",
             "| optimizer | best lr | best val loss | final val loss | final train loss | ms/iteration |",
             "|---|---|---|---|---|---|"]
    for name in names:
        group = best.get(name)
        if group is None:
            lines.append(f"| {OPTIMIZERS[name][0]} | failed | — | — | — | — |")
            continue
        r = group[0]
        edge = " (grid edge)" if len(lrs[name]) > 1 and r["lr"] in (min(lrs[name]), max(lrs[name])) else ""
        ms = statistics.median(g["ms_per_iteration"] for g in group)
        lines.append(f"| {r['label']} | {r['lr']:g}{edge} | {spread([g['best_val_loss'] for g in group])} | "
                     f"{spread([final_val(g) for g in group])} | "
                     f"{spread([g['train_loss'][-1][1] for g in group])} | {fmt(ms, '.0f')} |")
    lines += ["", "## Full sweep", "",
              "| optimizer | lr | seed | status | best val loss | final val loss | final train loss | ms/iteration "
              "| wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ok = r["status"] == "ok"
        lines.append(f"| {r['label']} | {r['lr']:g} | {r['seed']} | "
                     f"{r['status'] if ok else f'FAILED (rc {r["returncode"]})'} | "
                     f"{fmt(r['best_val_loss'])} | {fmt(r['val_loss'][-1][1] if ok else None)} | "
                     f"{fmt(r['train_loss'][-1][1] if r['train_loss'] else None)} | "
                     f"{fmt(r['ms_per_iteration'], '.0f')} | {r['wall_s']:.0f} |")
    lines += ["", "Best = the lr whose runs reached the lowest validation loss (minimum over a run's "
              "evaluations, mean over seeds); \"grid edge\" means the grid should be extended that way.", ""]
    if meta.get("reference"):
        lines += reference_lines(runs, meta["reference"])
    lines += [f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def plot(runs: list[dict], tokens_per_iteration: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for group in best_cells(runs).values():
        r = group[0]
        label = f"{r['label']}, lr {r['lr']:g}" + (f", {len(group)} seeds" if len(group) > 1 else "")
        for key, ax, smoothed in (("train_loss", ax_train, True), ("val_loss", ax_val, False)):
            # The seeds' mean (every seed logs the same iterations), with their min-max band.
            it = [i for i, _ in r[key]]
            curves = [[v for _, v in g[key]] for g in group]
            curves = [smooth(c) if smoothed else c for c in curves]
            tokens = [i * tokens_per_iteration for i in it]
            line, = ax.plot(tokens, [statistics.fmean(v) for v in zip(*curves)], label=label,
                            marker=None if smoothed else "o")
            if len(group) > 1:
                ax.fill_between(tokens, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)],
                                color=line.get_color(), alpha=0.2)
    for ax, title in ((ax_train, "training loss (smoothed)"), (ax_val, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("best lr of each optimizer, same token budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir.resolve()
    if not (data_dir / "train_text_document.bin").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(data_dir)],
                       check=True)
    flags = shared_flags(args, data_dir, out_dir / "data-cache")
    dims = model_dims(args)
    tokens_per_iteration = args.global_batch_size * dims["seq_length"]
    meta = dict(
        command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
        else shlex.join(["compare_optimizers.py", *argv]),
        model=(f"{dims['num_layers']} layers, hidden {dims['hidden_size']}, {dims['num_attention_heads']} heads / "
               f"{dims['num_query_groups']} query groups, seq {dims['seq_length']}, RoPE, RMSNorm, SwiGLU, "
               f"untied, no bias; TP=2 (gloo, CPU)"),
        train_iters=args.train_iters, global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size, seq_length=dims["seq_length"],
        tokens_per_run=args.train_iters * tokens_per_iteration,
        schedule=(f"warmup {max(1, round(args.warmup_fraction * args.train_iters))} iterations, cosine to "
                  f"0.1 × lr, weight decay {args.weight_decay}, Adam betas (0.9, 0.95), clip-grad 1.0"),
        validation=(f"{args.evals} evaluations every {eval_interval(args)} iterations (+ the one after "
                    f"training), {args.eval_iters} batches = {args.eval_iters * tokens_per_iteration:,} tokens each"),
        expected_train_iterations=expected_train_points(args.train_iters, args.log_interval),
        expected_val_iterations=expected_val_points(args.train_iters, eval_interval(args)),
        lr_grids={name: args.lrs[name] for name in args.optimizers},
        seeds=args.seeds, reference=args.reference,
        megatron_flags=flags,
    )
    runs = []
    total = sum(len(args.lrs[name]) for name in args.optimizers) * len(args.seeds)
    done = previous_runs(out_dir / "results.json", flags) if args.reuse else {}
    for name, lr, seed in ((n, lr, seed) for n in args.optimizers for lr in args.lrs[n] for seed in args.seeds):
        print(f"[{len(runs) + 1}/{total}] {OPTIMIZERS[name][0]} lr {lr:g} seed {seed} ...", end=" ", flush=True)
        r = done.get((name, lr, seed)) or run_one(name, lr, seed, flags, out_dir, args.run_timeout)
        if (name, lr, seed) in done:
            print("(reused)", end=" ")
        runs.append(r)
        print(f"{r['status']}, best val {fmt(r['best_val_loss'])}, {r['wall_s']:.0f} s", flush=True)
        # Written after every run, so an interrupted comparison keeps what it finished.
        (out_dir / "results.json").write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    table = markdown(runs, meta, args.lrs)
    (out_dir / "results.md").write_text(table)
    plot(runs, tokens_per_iteration, out_dir / "loss_curves.png")
    print("\n" + table)
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} run(s) failed; see their logs in {out_dir}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
