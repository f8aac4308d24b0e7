"""The GPU check: the parts of megatron-muon that only a CUDA machine can show, in one run.

    python -m scripts.gpu_check --out gpu-check                  # on a CUDA machine: every part
    python -m scripts.gpu_check --device cpu --train-iters 10 --scale 16 --out /tmp/x  # CPU rehearsal

(``bash scripts/gpu_check.sh`` wraps it for the lent GPU machine.) Writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` after every part, and prints a line per part as it finishes
(stderr), so that a check the lease cuts short keeps what it did. The parts run in order of value
within ``--budget-s`` (480 s: 8 minutes of a lent H200's 10-minute command limit; a subprocess
gets what is left of it, a part that starts too late is skipped, saying so):

* ``ns``: see below; seconds.
* ``real-step``: the busiest rank (by the plan's NS FLOPs, first stage) of Llama-3 405B at
  TP8 x PP16 x DP64 under owner and under auto (distributed sub-matrices), DeepSeek-V3 at TP1 x EP8
  x PP16 x DP64 under auto (DP teams), and Llama-3 8B and 70B at TP8 x DP8: the dry run's model, DDP
  and optimizer (``scripts/dry_run.py``) on real tensors under torch's fake process group, so one
  GPU runs one rank of an 8192-GPU layout; its step timed with CUDA events, next to the plan's NS
  FLOPs at the hardware's matmul rate and the cost model's step, and what the state and the step
  allocated (``max_memory_allocated``) beside the dry run's figure for the same rank on meta. The
  busiest rank and the meta figures come from one process with CUDA hidden (a meta build here would
  put Megatron's buffers on the GPU); memory is freed and the peak reset between layouts.
* ``train``: Megatron's own training loop (``scripts/pretrain_gpt.py``), one process: TP1,
  ``--muon-tp-mode owner``, ``--train-iters`` iterations of the tiny GPT on mock data, saving
  halfway, then a second run resumed from that checkpoint. On CUDA: NCCL, bf16, the Transformer
  Engine layer spec when ``transformer_engine`` imports (the ``gpu`` extra), the local spec
  otherwise, and apex's fusions off where apex is missing. ok: the loss falls and the resumed
  iterations log bitwise the uninterrupted run's losses.
* ``equivalence``: the optimizer's orthogonalize step (``orthogonalize_updates``: the DP owner
  exchange around each exact TP mode) and one ``MuonWithAdamW`` step (owner mode, ranks without a
  piece of a matrix passing None) at TP2 x DP2 on transformer-shaped matrices cut into
  Megatron-style DP ranges, against Newton–Schulz of each whole matrix on one device. On CUDA:
  NCCL, every rank on its own GPU (4 GPUs: TP2 x DP2; 2 or 3: TP2 x DP1; 1: skipped, and the
  report says why); the rehearsal: 4 gloo ranks on the CPU. Megatron's own wrappers around the
  optimizer are not in it (tests/megatron/test_megatron_optimizer.py covers them on CPU).
* ``ns``: Newton–Schulz in bf16 on Llama-3-8B's matrix shapes, batched as the optimizer batches
  them: TFLOP/s and the fraction of the GPU's dense bf16 peak; and one layer's matrices at TP8 as
  the owner mode runs them (each rank: its owned matrices) against duplicated (each rank: all of
  them): the NS time of the busiest rank, compute only.

Every report starts with the installed torch, megatron-core and Transformer Engine against the
ranges pyproject.toml declares, each version read from the module itself.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PARTS = ("ns", "real-step", "train", "equivalence")
"""in order of value: a lent GPU's minutes run out, and what ran first is on disk."""
# real-step: (model, TP, PP, DP, EP, TP mode) of the production layouts whose first stage's busiest rank
# is stepped. auto at 405B and DeepSeek-V3 TP1 runs the distributed and DP-team code paths, which
# one GPU never runs otherwise.
REAL_STEP_LAYOUTS = (("llama3-405b", 8, 16, 64, 1, "owner"), ("llama3-405b", 8, 16, 64, 1, "auto"),
                     ("deepseek-v3", 1, 16, 64, 8, "auto"), ("llama3-8b", 8, 1, 8, 1, "owner"),
                     ("llama3-70b", 8, 1, 8, 1, "owner"))
BUDGET_S = 480
"""the whole check, by default: 8 minutes of a lent GPU's 10-minute command limit."""
# Dense bf16 peak by device name (NVIDIA datasheets), for the fraction-of-peak column.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
GRAD_NORM = re.compile(r"grad norm: ([0-9.]+) \|")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.E+-]+) \|.*?muon step: (\w+) \| "
                       r"muon bytes sent: ([0-9.]+) MB \| muon orthogonalize: ([0-9.]+) ms \(([\w ]+)\) \|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (the check) or cpu (a rehearsal of every part: gloo, CPU tensors)")
    parser.add_argument("--train-iters", type=int, default=50)
    parser.add_argument("--scale", type=int, default=1, help="divide the Llama-3-8B shapes of the ns part by this")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per ns row (after 3 warm-ups)")
    parser.add_argument("--budget-s", type=int, default=BUDGET_S,
                        help="seconds for the whole check: a part is skipped, and a subprocess stopped, past it")
    args = parser.parse_args(argv)
    args.deadline = time.monotonic() + args.budget_s
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts: expected a comma-separated subset of {PARTS}, got {unknown or 'nothing'}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (use --device cpu for a rehearsal)")
    for flag in ("train_iters", "scale", "repeats", "budget_s"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


# ---- train -------------------------------------------------------------------------------------


def train_command(iters: int, port: int, *, device: str, te: bool, apex: bool, save: Path,
                  load_step: int | None = None) -> list[str]:
    """torchrun of scripts/pretrain_gpt.py, one process: the tiny GPT with ``--optimizer muon``
    (owner mode, the distributed optimizer), saving every ``iters // 2`` iterations into ``save``;
    ``load_step`` resumes from that save's checkpoint of that iteration.

    cuda: NCCL, bf16, Transformer Engine's layer spec when it imports (else the local one). Without
    apex, Megatron's apex-backed defaults are turned off as the CPU configs turn them off (gradient
    accumulation fusion in the output layer, the persistent layer norm, masked-softmax fusion),
    and without TE the fused RoPE too: each would fail at model construction. cpu (the rehearsal):
    gloo, fp32, the local spec and every fusion off, as configs/tiny-cpu.yaml."""
    cpu = device == "cpu"
    spec = ["--transformer-impl", "transformer_engine"] if te and not cpu else ["--transformer-impl", "local"]
    no_extensions = [] if apex and not cpu else ["--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                                                 "--no-masked-softmax-fusion"]
    no_rope_fusion = [] if te and not cpu else ["--no-rope-fusion"]
    backend = ["--distributed-backend", "gloo", "--use-cpu-initialization", "--no-bias-swiglu-fusion",
               "--no-bias-dropout-fusion"] if cpu else ["--bf16"]
    resume = [] if load_step is None else ["--load", str(save), "--ckpt-step", str(load_step)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(REPO / "scripts" / "pretrain_gpt.py"),
            "--tensor-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "0.01", "--min-lr", "0.001", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
            "--optimizer", "muon", "--muon-tp-mode", "owner", "--use-distributed-optimizer",
            "--muon-log-stats", "--log-interval", "5", "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
            "--eval-iters", "0", "--eval-interval", "1000", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--save", str(save), "--save-interval", str(max(1, iters // 2)),
            *backend, *spec, *no_extensions, *no_rope_fusion, *resume]


def _imports(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def seconds_left(args) -> float:
    return args.deadline - time.monotonic()


def _train_run(cmd: list[str], env: dict, timeout: float) -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired as stopped:  # the budget ran out: what it logged so far, failed
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (stopped.stdout, stopped.stderr))
        proc = subprocess.CompletedProcess(cmd, 124, text, "")
    text = proc.stdout + proc.stderr
    rows = [dict(iteration=int(m[1]), loss=float(m[3]), loss_text=m[3], kind=m[4], mb_sent=float(m[5]),
                 orth_ms=float(m[6]), timing=m[7], grad_norm_text=(GRAD_NORM.search(m[0]) or [None, None])[1])
            for m in ITERATION.finditer(text)]
    return dict(returncode=proc.returncode, rows=rows, wall_s=time.perf_counter() - started, log_tail=text[-3000:])


def run_train(args) -> dict:
    """Train ``--train-iters`` saving halfway, then resume from the halfway checkpoint: ok when
    both runs exit 0, the loss falls, every iteration logged after the resume has bitwise the
    uninterrupted run's grad norm (Megatron's logged digits), and the last one its loss.

    Why not every loss: on the CPU rehearsal (mock data, 6 iterations, resumed at 3) the logged
    loss of iteration 5 differed (1.837 against 2.237) while its grad norm and iteration 6's loss
    were bitwise equal; a logging effect not yet explained (10 iterations resumed at 5 matched)."""
    import tempfile

    te, apex = _imports("transformer_engine"), _imports("apex")
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    half = max(1, args.train_iters // 2)
    with tempfile.TemporaryDirectory(prefix="gpu-check-ckpt-") as save:
        # each run gets half of what is left of the budget, the second all of what is left then
        first = _train_run(train_command(args.train_iters, 29511, device=args.device, te=te, apex=apex,
                                         save=Path(save)), env, seconds_left(args) / 2)
        second = _train_run(train_command(args.train_iters, 29512, device=args.device, te=te, apex=apex,
                                          save=Path(save), load_step=half), env, seconds_left(args))
    rows = first["rows"]
    after = {r["iteration"]: r["grad_norm_text"] for r in rows if r["iteration"] > half}
    resumed = {r["iteration"]: r for r in second["rows"]}
    last = rows[-1] if rows else None
    bitwise = (bool(after) and all(i in resumed and resumed[i]["grad_norm_text"] == g for i, g in after.items())
               and last["iteration"] in resumed and resumed[last["iteration"]]["loss_text"] == last["loss_text"])
    falls = len(rows) >= 2 and rows[-1]["loss"] < rows[0]["loss"]
    ok = first["returncode"] == 0 and second["returncode"] == 0 and falls and bitwise
    return dict(ok=ok, returncode=first["returncode"] or second["returncode"],
                spec="te" if te and args.device == "cuda" else "local", apex=apex, rows=rows, loss_falls=falls,
                resume=dict(from_iteration=half, compared=sorted(after), bitwise=bitwise,
                            rows=second["rows"], returncode=second["returncode"]),
                wall_s=first["wall_s"] + second["wall_s"],
                log_tail=(second if first["returncode"] == 0 else first)["log_tail"])


# ---- equivalence -------------------------------------------------------------------------------


def _equivalence_rank(rank: int, world: int, device: torch.device) -> dict:
    import torch.distributed as dist

    from megatron_muon.config import MuonConfig
    from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
    from megatron_muon.parallel.orthogonalize import StepGroups, orthogonalize_updates
    from megatron_muon.plan.step_plan import build_step_plan

    tp, dp = 2, world // 2  # TP2 x DP2 on 4 ranks, TP2 x DP1 on 2
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_groups = [dist.new_group([d * tp + j for j in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + j for d in range(dp)]) for j in range(tp)]
    # (name, TP-local shape, partition_dim, row split): QKV of 2 local groups, gate/up, row-parallel, replicated
    params = [("qkv", (24, 16), 0, RowSplit(2, (8, 2, 2))), ("proj", (16, 8), 1, None),
              ("fc1", (20, 16), 0, RowSplit(1, (10, 10))), ("fc2", (16, 10), 1, None), ("router", (6, 16), None, None)]
    total = sum(r * c for _, (r, c), _, _ in params)
    shard, offset, layouts, fulls = -(-total // dp), 0, [], []
    for i, (name, (r, c), pdim, split) in enumerate(params):
        spans = [(max(offset, d * shard), min(offset + r * c, (d + 1) * shard)) for d in range(dp)]
        ranges = tuple((lo - offset, hi - offset) if hi > lo else (0, 0) for lo, hi in spans)
        layouts.append(MatrixLayout(name, (r, c), pdim, tp, split, ranges))
        shape = (r * tp, c) if pdim == 0 else (r, c * tp) if pdim == 1 else (r, c)
        fulls.append(torch.randn(shape, generator=torch.Generator().manual_seed(7 + i)).to(device))
        offset += r * c
    errors = {}
    for mode in ("owner", "duplicated", "distributed"):
        pieces = []
        for lay, full in zip(layouts, fulls):
            local = full if lay.partition_dim is None else full.chunk(tp, dim=lay.partition_dim)[tp_rank]
            s, e = lay.local_range(dp_rank)
            pieces.append(local.reshape(-1)[s:e].clone())
        settings = MuonConfig(tp_mode=mode, fp32_matmul_prec="highest", coefficient_type="quintic").plan_settings()
        plan = build_step_plan(layouts, dp_size=dp, tp_size=tp, settings=settings)
        out = orthogonalize_updates(pieces, plan, StepGroups(dp_groups[tp_rank], tp_groups[dp_rank]))
        worst = 0.0
        for lay, full, got in zip(layouts, fulls, out):
            if got.device != device:
                raise RuntimeError(f"{mode}: {lay.name} came back on {got.device}, not {device}")
            s, e = lay.local_range(dp_rank)
            want = expected_local(lay, full, tp, tp_rank).reshape(-1)[s:e]
            worst = max(worst, (got - want).abs().max().item() if e > s else 0.0)
        errors[mode] = worst
    errors["optimizer (owner)"] = _optimizer_error(layouts, fulls, tp, tp_rank, dp_rank, device,
                                                   dp_groups[tp_rank], tp_groups[dp_rank])
    return dict(rank=rank, device=str(device), max_abs_error=errors)


def _optimizer_error(layouts, fulls, tp, tp_rank, dp_rank, device, dp_group, tp_group) -> float:
    """One ``MuonWithAdamW`` step (owner mode) on this rank's pieces as parameters: a rank that
    holds no piece of a matrix passes None for it, as Megatron's distributed optimizer does, and
    allocates its (empty) buffers on the optimizer's device. From zero parameters and momentum,
    with lr 1 and no weight decay, the step leaves -update: compared with the one-device result."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW

    matrices, params = [], []
    for lay, full in zip(layouts, fulls):
        s, e = lay.local_range(dp_rank)
        local = full if lay.partition_dim is None else full.chunk(tp, dim=lay.partition_dim)[tp_rank]
        param = torch.nn.Parameter(torch.zeros(e - s, device=device)) if e > s else None
        if param is not None:
            param.grad = local.reshape(-1)[s:e].clone()
            params.append(param)
        matrices.append(param)
    config = MuonConfig(tp_mode="owner", fp32_matmul_prec="highest", coefficient_type="quintic", momentum=0.5)
    catalogue = MatrixCatalogue(tuple(layouts), tuple(matrices), dp_group, tp_group)
    optimizer = MuonWithAdamW([dict(params=params, algorithm="muon")], lr=1.0, weight_decay=0.0, config=config,
                              catalogue=catalogue)
    optimizer.step()  # momentum from zero: (1 - 0.5) * grad, and NS is invariant to that scale
    worst = 0.0
    for lay, full, param in zip(layouts, fulls, matrices):
        if param is not None:
            s, e = lay.local_range(dp_rank)
            want = expected_local(lay, full, tp, tp_rank).reshape(-1)[s:e]
            worst = max(worst, (param.detach() + want).abs().max().item())
    return worst


def expected_local(lay, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of the step's result, computed on one device: NS of every global
    sub-matrix (fp32, quintic), scaled by its global shape (spectral), cut back to the rank."""
    from megatron_muon.core.newton_schulz import newton_schulz
    from megatron_muon.core.scaling import muon_scale

    pdim = lay.partition_dim
    shards = [full] if pdim is None else list(full.chunk(tp, dim=pdim))
    per_rank = [lay.split_rows(shard) for shard in shards]
    out = []
    for k in range(len(per_rank[0])):
        whole = torch.cat([subs[k] for subs in per_rank], dim=pdim) if pdim is not None else per_rank[0][k]
        result = newton_schulz(whole) * muon_scale(*whole.shape, "spectral")
        out.append(result if pdim is None else result.chunk(tp, dim=pdim)[tp_rank])
    return lay.join_rows(out)


def equivalence_world(device: str, gpus: int) -> tuple[int, str | None]:
    """(ranks, None) to run, or (0, the reason it cannot run). On CUDA every rank needs a GPU of
    its own (NCCL refuses two ranks on one device): 4 ranks (TP2 x DP2) from 4 GPUs, 2 (TP2 x
    DP1) from 2 or 3. The CPU rehearsal runs 4 gloo ranks."""
    if device == "cpu":
        return 4, None
    if gpus >= 4:
        return 4, None
    if gpus >= 2:
        return 2, None
    return 0, f"needs 2 GPUs for NCCL ranks on devices of their own; this machine has {gpus}"


def run_equivalence(args) -> dict:
    sys.path.insert(0, str(REPO))
    from scripts.bench.launch import backend_for, launch

    world, reason = equivalence_world(args.device, torch.cuda.device_count() if args.device == "cuda" else 0)
    if reason is not None:
        return dict(ok=True, skipped=reason, max_abs_error={}, devices=[], tolerance=1e-5, wall_s=0.0)
    if args.device == "cuda" and backend_for(world) != "nccl":
        raise RuntimeError(f"equivalence: {world} GPUs are visible but NCCL is not available")
    started = time.perf_counter()
    ranks = launch(world, _equivalence_body, tag="gpu-check", backend="gloo" if args.device == "cpu" else "nccl")
    worst = {mode: max(r["max_abs_error"][mode] for r in ranks) for mode in ranks[0]["max_abs_error"]}
    # fp32 NS; only the summation order differs from the one-device reference (see
    # tests/dist/test_tp_modes.py, FP32_ATOL, for the derivation of this bound).
    return dict(ok=all(v <= 1e-5 for v in worst.values()), tolerance=1e-5, max_abs_error=worst, world=world,
                devices=sorted({r["device"] for r in ranks}), wall_s=time.perf_counter() - started)


def _equivalence_body(rank: int, world: int, device: torch.device) -> dict:
    return _equivalence_rank(rank, world, device)


# ---- real-step -----------------------------------------------------------------------------------


def run_real_step(args) -> dict:
    """The first stage's busiest rank (by its plan's NS FLOPs) of each ``REAL_STEP_LAYOUTS`` entry:
    the real optimizer step (scripts/dry_run.py's model, DDP and optimizer, built on real tensors)
    under torch's fake process group, so one GPU runs a rank of an 8192-GPU layout: the collectives
    move nothing, while their buffers, devices and the Newton–Schulz kernels are real. Shapes
    divided by ``--scale``. Next to it: this rank's NS FLOPs from the plan at the detected
    hardware's matmul rate (the cost model's compute term), the cost model's whole step for the
    busiest rank on h100-sxm, and on CUDA what the state and the step allocated
    (``max_memory_allocated`` above the built model) beside the dry run's figure for the same rank
    on the meta device (its state plus its transient peak). Memory is freed and the peak reset
    between layouts; a layout is skipped, saying so, once the budget is spent."""
    import gc

    from megatron_muon.plan.hardware import hardware_profile
    from scripts import dry_run

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        from megatron_muon.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
    hw = hardware_profile("detect")
    rows, skipped_layouts, started = [], [], time.perf_counter()
    probes = meta_probes(args.scale, timeout=seconds_left(args) / 2)
    for (model, tp, pp, dp, ep, mode), meta in zip(REAL_STEP_LAYOUTS, probes):
        layout = f"TP{tp} x PP{pp} x DP{dp}" + (f" x EP{ep}" if ep > 1 else "")
        if meta["rank"] is None or seconds_left(args) < 30:
            why = meta.get("skip") or "the budget (--budget-s) was spent"
            skipped_layouts.append(f"{model} {layout} {mode}: {why}")
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        shape = dry_run.MODELS[model]
        shape = shape.scaled(args.scale) if args.scale > 1 else shape
        rank = meta["rank"]
        with contextlib.redirect_stdout(io.StringIO()):  # the optimizer's startup report: not this report's
            res = dry_run.time_rank(shape, tp, pp, dp, rank, mode, device, args.repeats, ep=ep)
        busiest = dry_run.cost_model_row(shape, tp, pp, dp, mode) if ep == 1 else None
        peak = res["device_peak_bytes"]
        rows.append(dict(model=model, layout=layout, tp_mode=mode, rank=rank, scale=args.scale,
                         step_ms=res["step_s"] * 1e3, device=res["device"], matrices=res["matrices"],
                         modes=res["modes"], ns_gflop=res["plan_ns_flops"] / 1e9,
                         predicted_ns_ms=res["plan_ns_flops"] / hw.matmul_flops * 1e3, hardware=hw.name,
                         busiest_step_ms_h100=None if busiest is None else busiest["step_ms_h100"],
                         step_gib=None if peak is None else (peak - res["device_bytes_before_state"]) / 2**30,
                         max_allocated_gib=None if peak is None else peak / 2**30,
                         dry_run_gib=meta["dry_run_gib"], dry_run_errors=meta["errors"]))
        del res
    ok = bool(rows) and all(r["device"] == str(device) and not r["dry_run_errors"] for r in rows)
    return dict(ok=ok, rows=rows, skipped_layouts=skipped_layouts, wall_s=time.perf_counter() - started)


def meta_probes(scale: int, timeout: float) -> list[dict]:
    """Per ``REAL_STEP_LAYOUTS`` entry, on the meta device in a process of its own (CUDA hidden, as
    the dry run runs, so that Megatron's buffers are not allocated on the GPU): the first stage's
    busiest rank by its plan, and the dry run's memory figure for it (the state plus the step's
    transient peak)."""
    code = ("import sys, json; from scripts import gpu_check; "
            "print(json.dumps(gpu_check._meta_probes(int(sys.argv[1]))))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, str(scale)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=max(1.0, timeout))
    if proc.returncode != 0:
        raise RuntimeError(f"the meta-device probe failed (rc {proc.returncode}): {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _meta_probes(scale: int) -> list[dict]:
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches, view_device
    from scripts import dry_run

    apply_cpu_patches()
    out = []
    with view_device(torch.device("meta")), contextlib.redirect_stdout(io.StringIO()):
        for model, tp, pp, dp, ep, mode in REAL_STEP_LAYOUTS:
            shape = dry_run.MODELS[model]
            if scale > 1 and shape.mla is not None:  # ModelShape.scaled keeps no MLA shape
                out.append(dict(rank=None, skip=f"--scale {scale}: MLA shapes are not scaled (runs at --scale 1)"))
                continue
            shape = shape.scaled(scale) if scale > 1 else shape
            rank = dry_run.busiest_rank(shape, tp, pp, dp, mode, ep=ep)
            meta = dry_run.run_rank(shape, tp, pp, dp, rank, mode, ep=ep)
            out.append(dict(rank=rank, dry_run_gib=(meta["state_bytes"] + meta["peak_extra_bytes"]) / 2**30,
                            errors=meta["errors"]))
    return out


# ---- ns ------------------------------------------------------------------------------------------


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()``: CUDA events on a GPU (no host clock around async kernels)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_ns(args) -> dict:
    from megatron_muon.core.models import LLAMA3
    from megatron_muon.core.newton_schulz import gram_newton_schulz, newton_schulz, ns_flops
    from megatron_muon.plan.owners import plan_owners

    device = torch.device(args.device) if args.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name.upper()), None)
    shape = LLAMA3["8B"].scaled(args.scale) if args.scale > 1 else LLAMA3["8B"]
    q, k, v = shape.qkv_sub_rows
    subs = {"q": (q, shape.hidden), "k/v": (k, shape.hidden), "proj": (shape.hidden, q),
            "gate/up": (shape.ffn_hidden, shape.hidden), "fc2": (shape.hidden, shape.ffn_hidden)}
    batch = 8  # same-shape matrices NS'd together, as owner mode batches them on one rank
    rows = []
    for label, (r, c) in subs.items():
        x = torch.randn(batch, r, c, device=device, dtype=torch.bfloat16)
        seconds = _timed(lambda x=x: newton_schulz(x), device, args.repeats)
        gram_s = _timed(lambda x=x: gram_newton_schulz(x), device, args.repeats)  # issue 25: both methods
        gram16_s = _timed(lambda x=x: gram_newton_schulz(x, gram_dtype=torch.float16), device, args.repeats)
        flops = batch * ns_flops(r, c)
        rows.append(dict(matrix=label, shape=[r, c], batch=batch, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                         fraction_of_peak=flops / seconds / peak if peak else None, gram_ms=gram_s * 1e3,
                         gram_fp16_ms=gram16_s * 1e3))
    # One layer at TP8: the owner mode's busiest rank runs its owned sub-matrices, duplicated
    # runs all of them on every rank (compute only; the exchange is not timed here).
    layer = [subs["q"], subs["k/v"], subs["k/v"], subs["proj"], subs["gate/up"], subs["gate/up"], subs["fc2"]]
    owners = plan_owners([ns_flops(r, c) for r, c in layer], 8)
    busiest = max(range(8), key=lambda o: sum(ns_flops(*m) for m, w in zip(layer, owners) if w == o))
    mats = [torch.randn(r, c, device=device, dtype=torch.bfloat16) for r, c in layer]
    owner_s = _timed(lambda: [newton_schulz(m[None]) for m, w in zip(mats, owners) if w == busiest], device,
                     args.repeats)
    duplicated_s = _timed(lambda: [newton_schulz(m[None]) for m in mats], device, args.repeats)
    return dict(ok=True, device=name, peak_bf16=peak, rows=rows,
                layer=dict(owner_busiest_ms=owner_s * 1e3, duplicated_ms=duplicated_s * 1e3,
                           ratio=owner_s / duplicated_s, owners=owners))


# ---- versions ------------------------------------------------------------------------------------


MODULES = {"torch": ("torch", "__version__"), "megatron-core": ("megatron.core.package_info", "__version__"),
           "transformer-engine": ("transformer_engine", "__version__")}
"""where each package says its own version: NGC images install Transformer Engine and
megatron-core under distribution names (or none) that ``importlib.metadata`` does not find."""


def module_version(name: str) -> str | None:
    module, attribute = MODULES[name]
    try:
        found = getattr(__import__(module, fromlist=[attribute]), attribute, None)
    except Exception:  # noqa: BLE001 (TE raises more than ImportError where its CUDA libraries are missing)
        return None
    return None if found is None else str(found).split("+")[0]


def versions() -> dict:
    """The installed torch, megatron-core and Transformer Engine, each against the range
    pyproject.toml declares for it (the ``gpu`` extra for TE); None where not installed."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name: Requirement(r) for r in
                [*project["dependencies"], *project["optional-dependencies"]["gpu"]]}
    out = {}
    for name in ("torch", "megatron-core", "transformer-engine"):
        installed = module_version(name)
        if installed is None:
            try:
                installed = version(name)
            except PackageNotFoundError:
                installed = None
        req = declared[name]
        out[name] = dict(installed=installed, declared=str(req.specifier),
                         in_range=None if installed is None else req.specifier.contains(installed, prereleases=True))
    return out


# ---- report --------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """The report as Markdown: one section per part that ran."""
    lines = [f"# GPU check ({results['device']}, torch {results['torch']}, {results['date']})", "",
             f"Command: `{results['command']}`", ""]
    if "versions" in results:
        lines += ["| package | installed | declared (pyproject.toml) | in range |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['installed'] or 'not installed'} | {v['declared']} | "
                  f"{'—' if v['in_range'] is None else 'yes' if v['in_range'] else 'NO'} |"
                  for name, v in results["versions"].items()]
        lines.append("")
    for part in PARTS:  # a part that did not run through: one line saying why
        cut = results.get(part, {})
        if "error" in cut or ("skipped" in cut and part != "equivalence"):
            lines += [f"## {part}: {'FAILED' if 'error' in cut else 'skipped'}", "", cut.get("error") or cut["skipped"],
                      ""]
    if "train" in results and "rows" in results["train"]:
        t = results["train"]
        how = "gloo, fp32" if results["device"] == "cpu" else "NCCL, bf16"
        lines += [f"## train: Megatron's loop, TP1, {how}, owner mode, a save and a resume", "",
                  f"{'ok' if t['ok'] else 'FAILED (rc ' + str(t['returncode']) + ')'}; layer spec {t['spec']}; "
                  f"apex {'yes' if t.get('apex') else 'no'}; {t['wall_s']:.0f} s", "",
                  "| iteration | lm loss | step | MB sent | orthogonalize ms |", "|---:|---:|---|---:|---:|"]
        lines += [f"| {r['iteration']} | {r['loss']:.4f} | {r['kind']} | {r['mb_sent']:.3f} | {r['orth_ms']:.2f} "
                  f"({r['timing']}) |" for r in t["rows"]]
        resume = t.get("resume")
        if resume:
            lines += ["", f"Loss falls: {'yes' if t.get('loss_falls') else 'NO'}. Resumed from the checkpoint of "
                      f"iteration {resume['from_iteration']}: iterations {resume['compared']} "
                      f"{'bitwise equal to' if resume['bitwise'] else 'DIFFER from'} the uninterrupted run "
                      "(grad norms, and the last iteration's loss)."]
        lines.append("")
    if "equivalence" in results and results["equivalence"].get("skipped"):
        lines += ["## equivalence: skipped", "", results["equivalence"]["skipped"], ""]
    elif "equivalence" in results and "max_abs_error" in results["equivalence"]:
        e = results["equivalence"]
        lines += [f"## equivalence: orthogonalize_updates at TP2 x DP{e.get('world', 4) // 2}, {e.get('world', 4)} "
                  "ranks, tensors on " + ", ".join(e["devices"]), "", "| TP mode | max abs error vs one device |",
                  "|---|---:|"]
        lines += [f"| {mode} | {err:.2e} |" for mode, err in e["max_abs_error"].items()]
        lines += ["", f"{'ok' if e['ok'] else 'FAILED'}: bound {e['tolerance']:g} (fp32 NS, summation order only)", ""]
    if "real-step" in results and "rows" in results["real-step"]:
        r = results["real-step"]
        lines += ["## real-step: the busiest rank's optimizer step on real tensors, fake process group (no data "
                  "moves)", "",
                  "| model | layout | tp mode | rank | shapes / | Muon matrices | modes (this rank's sub-matrices) | "
                  "NS GFLOP (plan) | step ms | NS ms predicted (this rank, plan FLOPs at the matmul rate) | busiest "
                  "rank's whole step, cost model, h100-sxm ms | state + step GiB (device) | same, dry run (meta) GiB "
                  "| max allocated GiB |",
                  "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]

        def gib(value):
            return "—" if value is None else f"{value:.2f}"

        for x in r["rows"]:
            modes = ", ".join(f"{m} {n}" for m, n in x.get("modes", {}).items()) or "—"
            busiest = "—" if x.get("busiest_step_ms_h100") is None else f"{x['busiest_step_ms_h100']:.1f}"
            lines.append(f"| {x['model']} | {x['layout']} | {x.get('tp_mode', 'owner')} | {x.get('rank', 0)} | "
                         f"{x['scale']} | {x['matrices']} | {modes} | {x['ns_gflop']:.2f} | {x['step_ms']:.2f} | "
                         f"{x['predicted_ns_ms']:.2f} ({x['hardware']}) | {busiest} | {gib(x.get('step_gib'))} | "
                         f"{gib(x.get('dry_run_gib'))} | {gib(x.get('max_allocated_gib'))} |")
        lines += [f"- skipped: {why}" for why in r.get("skipped_layouts", [])]
        errors = [e for x in r["rows"] for e in x.get("dry_run_errors", [])]
        lines += [f"- the dry run of the same rank: {e}" for e in errors]
        lines += ["", f"{'ok' if r['ok'] else 'FAILED'}: every step ran on the device it was built on "
                  f"({r['wall_s']:.0f} s).", ""]
    if "ns" in results and "rows" in results["ns"]:
        n = results["ns"]
        lines += ["## ns: bf16 Newton–Schulz, Llama-3-8B shapes, batches of 8 (5 quintic steps)", "",
                  "| matrix | shape | median ms | TFLOP/s | of bf16 peak | Gram NS ms | gram ÷ standard "
                  "| Gram, fp16 products, ms |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in n["rows"]:
            frac = f"{r['fraction_of_peak']:.0%}" if r["fraction_of_peak"] is not None else "—"
            gram = f"{r['gram_ms']:.2f} | {r['gram_ms'] / r['ms']:.2f}" if "gram_ms" in r else "— | —"
            gram += f" | {r['gram_fp16_ms']:.2f}" if "gram_fp16_ms" in r else " | —"
            lines.append(f"| {r['matrix']} | {r['shape'][0]}x{r['shape'][1]} | {r['ms']:.2f} | {r['tflops']:.1f} "
                         f"| {frac} | {gram} |")
        lay = n["layer"]
        lines += ["", f"One layer at TP8, NS compute of the busiest rank: owner {lay['owner_busiest_ms']:.2f} ms, "
                  f"duplicated {lay['duplicated_ms']:.2f} ms ({lay['ratio']:.2f}x).", ""]
    return "\n".join(lines)


RUNNERS = {"ns": "run_ns", "real-step": "run_real_step", "train": "run_train", "equivalence": "run_equivalence"}


def write_report(results: dict, out: Path) -> str:
    """gpu_check.json and gpu_check.md as they stand: called after every part, so that a check cut
    short (the lease's limit, a crash, a kill) leaves every part that finished on disk."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    results = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command="python -m scripts.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
                   budget_s=args.budget_s, versions=versions())
    write_report(results, args.out)
    for part in PARTS:  # in order of value, whatever order --parts names them in
        if part not in args.parts:
            continue
        started = time.monotonic()
        if seconds_left(args) < 20:
            results[part] = dict(ok=False, skipped="the budget (--budget-s) was spent before this part")
        else:
            try:
                results[part] = globals()[RUNNERS[part]](args)
            except Exception as err:  # noqa: BLE001 (one part's failure must not cost the others' results)
                results[part] = dict(ok=False, error=f"{type(err).__name__}: {err}")
        write_report(results, args.out)
        what = results[part].get("skipped") or results[part].get("error") or ""
        print(f"[gpu_check] {part}: {'ok' if results[part]['ok'] else 'FAILED'} in "
              f"{time.monotonic() - started:.0f} s{'; ' + what if what else ''}", file=sys.stderr, flush=True)
    print(write_report(results, args.out))
    return 0 if all(results[p]["ok"] for p in args.parts) else 1


if __name__ == "__main__":
    sys.exit(main())
