"""Benchmark the TP modes of ``orthogonalize_sharded`` against megatron-core's own TP Muon.

    python -m scripts.bench.bench_tp_modes                       # 2 ranks, defaults below
    python -m scripts.bench.bench_tp_modes --nproc 4 --json out.json

(or ``bash scripts/run.sh bench [ARGS...]``, which builds the pinned venv first.)

The script starts ``--nproc`` processes itself (file:// rendezvous in a temp dir, so no port
is ever fixed). It uses NCCL and one CUDA device per rank when that many GPUs are visible,
otherwise gloo on the CPU. Every rank builds the same full matrices from a fixed seed and
keeps its even chunk along the matrix's partition_dim, exactly as Megatron shards a layer.

Matrices: one Llama-3-8B transformer layer in Megatron layout (linear_qkv 6144×4096 and
linear_fc1 28672×4096 split along rows, linear_proj 4096×4096 and linear_fc2 4096×14336 split
along columns), every dim divided by ``--scale`` (16: a CPU-sized problem with the same aspect
ratios), repeated ``--layers`` times.

Rows: ours (duplicated / distributed / blockwise / owner; one ``orthogonalize_sharded`` call
over all matrices) and megatron-core's ``TensorParallelMuon.orthogonalize`` (duplicated /
distributed / blockwise; per matrix, as its optimizer step calls it), on identical shards.

Per row: step time (each step: barrier, start, run, device sync, stop; a step's time is the
slowest rank's; the rows take turns step by step), median and min–max over ``--repeats``;
bytes sent per rank (``megatron_muon/parallel/comm.py``'s convention); Newton–Schulz FLOPs per rank;
median time relative to Megatron duplicated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_muon import comm_stats, ns_flops, orthogonalize_sharded
from megatron_muon.core.models import llama3_matrices

from .collectives import CollectiveCounter
from .launch import backend_for, launch

# (name, rows, cols, partition_dim) of one Llama-3-8B layer (megatron_muon/core/models.py).
LLAMA3_8B_LAYER = tuple((name.split(".")[-1], r, c, p) for name, r, c, p in llama3_matrices("8B")[:4])
OUR_MODES = ("duplicated", "distributed", "blockwise", "owner")
MEGATRON_MODES = ("duplicated", "distributed", "blockwise")
SEED = 1234


def layer_shapes(scale: int, nproc: int) -> tuple[list[tuple[str, int, int, int]], list[str]]:
    """The scaled layer, each sharded dim rounded down to a multiple of nproc (with notes)."""
    shapes, notes = [], []
    for name, rows, cols, pdim in LLAMA3_8B_LAYER:
        dims = [rows // scale, cols // scale]
        even = dims[pdim] - dims[pdim] % nproc
        if even == 0 or min(dims) == 0:
            raise SystemExit(f"error: {name} {rows}×{cols} / scale {scale} leaves no rows for {nproc} ranks")
        if even != dims[pdim]:
            notes.append(f"{name}: dim {pdim} {dims[pdim]} rounded down to {even} to split evenly over {nproc} ranks")
            dims[pdim] = even
        shapes.append((name, dims[0], dims[1], pdim))
    return shapes, notes


# ---- per rank ------------------------------------------------------------------------------


def timed_rounds(runs, args, device) -> list[list[float]]:
    """Seconds per step of each run; a step's time is the slowest rank's.

    The rows take turns, one step each per round, so that load drifting on a shared host
    lands on every row alike instead of on whichever row happened to run then.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for run in runs:
        for _ in range(args.warmup):
            run()
    times = [[] for _ in runs]
    for _ in range(args.repeats):
        for run, row_times in zip(runs, times):
            dist.barrier()
            sync()
            start = time.perf_counter()
            run()
            sync()
            row_times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def megatron_ns_flops(mode: str, full_shape, local_shape, pdim: int, steps: int) -> int:
    """Analytic NS FLOPs of one matrix on one rank in Megatron's modes."""
    if mode == "duplicated":
        return ns_flops(*full_shape, steps)
    if mode == "blockwise":
        return ns_flops(*local_shape, steps)
    k = full_shape[1 - pdim]  # the unsharded dim spans the all-reduced Gram
    cols = local_shape[pdim]
    return steps * (4 * k * k * cols + 2 * k ** 3)  # Megatron forms A², whatever the shard's width


def bench_rank(rank: int, nproc: int, device, args, shapes) -> list[dict]:
    """This rank's measurements for every row: step times (max over ranks), bytes, FLOPs."""
    from emerging_optimizers.utils import fp32_matmul_precision
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from megatron.core.process_groups_config import ProcessGroupCollection

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(SEED)
    full = [torch.randn(rows, cols, generator=gen) for _ in range(args.layers) for _, rows, cols, _ in shapes]
    pdims = [pdim for _ in range(args.layers) for *_, pdim in shapes]
    shards_fp32 = [m.chunk(nproc, dim=pd)[rank].contiguous().to(device) for m, pd in zip(full, pdims)]
    shards = [s.to(dtype) for s in shards_fp32]
    rows = []  # (what this rank measured outside the timing, the step to time)

    for mode in OUR_MODES:
        def run(validate=False, mode=mode):
            orthogonalize_sharded(shards, pdims, mode=mode, steps=args.steps,
                                  coefficients=args.coefficients, validate=validate)

        with comm_stats() as stats:  # untimed: checks the layout once and counts the traffic
            run(validate=True)
        rows.append((dict(
            impl="ours", mode=mode, ns_flops=stats.ns_flops,
            bytes_sent=stats.bytes_sent - stats.bytes_by_primitive["shape_check"],
            calls={k: v for k, v in stats.calls.items() if k != "shape_check"},
        ), run))

    # MuonBP (arXiv 2510.16981) with period P: a block step is exactly a blockwise call and a full
    # step an owner call (rows above); this row runs one whole period, [owner, blockwise × (P−1)],
    # and reports it per step, so its time, bytes and FLOPs are the period's average.
    period = args.muonbp_period

    def run_period(validate=False):
        for t in range(period):
            orthogonalize_sharded(shards, pdims, mode="owner" if t == 0 else "blockwise", steps=args.steps,
                                  coefficients=args.coefficients, validate=validate)

    with comm_stats() as stats:
        run_period(validate=True)
    rows.append((dict(
        impl="ours", mode=f"muonbp P={period} (avg/step)", ns_flops=stats.ns_flops // period,
        bytes_sent=(stats.bytes_sent - stats.bytes_by_primitive["shape_check"]) // period,
        calls={k: v for k, v in stats.calls.items() if k != "shape_check"}, per_step_divisor=period,
    ), run_period))

    # Megatron's newton_schulz accepts fp32 only; with precision "medium" it casts to bf16 itself.
    precision = "highest" if args.dtype == "fp32" else "medium"
    pg_collection = ProcessGroupCollection(tp=dist.group.WORLD)  # the TP group is every rank here
    params = [torch.nn.Parameter(torch.empty_like(shard)) for shard in shards_fp32]
    for p, pdim in zip(params, pdims):  # the attributes Megatron's TP layers set on weights
        p.partition_dim, p.tensor_model_parallel = pdim, True
    for mode in MEGATRON_MODES:
        opt = TensorParallelMuon(params, pg_collection=pg_collection, tp_mode=mode,
                                 coefficient_type=args.coefficients, num_ns_steps=args.steps,
                                 fp32_matmul_prec=precision, split_qkv=False)

        def run(opt=opt):
            with fp32_matmul_precision(precision):
                for p, grad in zip(params, shards_fp32):
                    opt.orthogonalize(p, grad)

        with CollectiveCounter() as counter:  # Megatron calls torch.distributed directly
            run()
        bytes_sent, calls = counter.bytes_sent, dict(counter.calls)
        flops = sum(megatron_ns_flops(mode, m.shape, s.shape, pd, args.steps)
                    for m, s, pd in zip(full, shards_fp32, pdims))
        rows.append((dict(impl="megatron", mode=mode, ns_flops=flops, bytes_sent=bytes_sent, calls=calls), run))

    times = timed_rounds([run for _, run in rows], args, device)
    return [dict(measured, times=row_times) for (measured, _), row_times in zip(rows, times)]


# ---- report --------------------------------------------------------------------------------


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (impl, mode): time stats, bytes and FLOPs over ranks, ratio to Megatron duplicated."""
    rows = []
    for row_by_rank in zip(*per_rank):
        divisor = row_by_rank[0].get("per_step_divisor", 1)  # a MuonBP row times a whole period
        times_ms = [1e3 * t / divisor for t in row_by_rank[0]["times"]]  # already the max over ranks
        sent = [r["bytes_sent"] for r in row_by_rank]
        flops = [r["ns_flops"] for r in row_by_rank]
        rows.append(dict(
            impl=row_by_rank[0]["impl"], mode=row_by_rank[0]["mode"], times_ms=times_ms,
            median_ms=statistics.median(times_ms), min_ms=min(times_ms), max_ms=max(times_ms),
            bytes_sent_max=max(sent), bytes_sent_mean=sum(sent) / len(sent),
            ns_flops_max=max(flops), ns_flops_mean=sum(flops) / len(flops),
            calls_rank0=row_by_rank[0]["calls"],
        ))
    baseline = next(r["median_ms"] for r in rows if (r["impl"], r["mode"]) == ("megatron", "duplicated"))
    for r in rows:
        r["vs_megatron_duplicated"] = r["median_ms"] / baseline
    return rows


def markdown_table(rows: list[dict]) -> str:
    mib, gflop = 2**20, 1e9
    lines = ["| impl | mode | median ms | min–max ms | sent/rank MiB max | mean "
             "| NS GFLOP/rank max | mean | vs Megatron duplicated |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['mode']} | {r['median_ms']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} "
            f"| {r['bytes_sent_max'] / mib:.3f} | {r['bytes_sent_mean'] / mib:.3f} "
            f"| {r['ns_flops_max'] / gflop:.2f} | {r['ns_flops_mean'] / gflop:.2f} "
            f"| {r['vs_megatron_duplicated']:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="tensor-parallel ranks to start")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers of matrices")
    parser.add_argument("--scale", type=int, default=16, help="divide every Llama-3-8B dim by this")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--coefficients", default="quintic",
                        choices=("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"),
                        help="NS coefficient set both libraries know (Megatron's default: quintic)")
    parser.add_argument("--steps", type=int, default=5, help="Newton–Schulz iterations")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row before timing")
    parser.add_argument("--muonbp-period", type=int, default=5,
                        help="MuonBP period for the period-average row (the paper's best: 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the ranks")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if min(args.nproc, args.layers, args.scale, args.repeats, args.muonbp_period) < 1 or args.warmup < 0:
        parser.error("--nproc, --layers, --scale, --repeats and --muonbp-period must be >= 1, --warmup >= 0")

    backend = backend_for(args.nproc)
    use_cuda = backend == "nccl"
    device = "cuda" if use_cuda else "cpu"
    args.dtype = args.dtype or ("bf16" if use_cuda else "fp32")
    shapes, notes = layer_shapes(args.scale, args.nproc)

    wall = time.perf_counter()
    try:
        rows = summarize(launch(args.nproc, bench_rank, args, shapes, timeout=args.timeout, tag="bench-tp"))
    except RuntimeError as err:  # a rank's traceback is the useful part, not the parent's
        raise SystemExit(f"error: {err}") from None
    wall = time.perf_counter() - wall

    shape_text = ", ".join(f"{n} {r}×{c} (pd {pd})" for n, r, c, pd in shapes)
    print(f"TP Muon orthogonalization: world size {args.nproc}, backend {backend}, device {device}, "
          f"dtype {args.dtype}, shapes {args.layers} × [{shape_text}] (Llama-3-8B / {args.scale}), "
          f"repeats {args.repeats} (warmup {args.warmup}), NS steps {args.steps}, "
          f"coefficients {args.coefficients}\n")
    print(markdown_table(rows))
    notes += [
        "time: per step, the slowest rank's; median and min–max over the repeats; the rows take "
        "turns, one step each per round, so load drift on the host hits them alike.",
        "ours: bytes and FLOPs from megatron_muon.comm_stats (payload only; the shape check runs untimed).",
        f"muonbp P={args.muonbp_period}: one period [owner, blockwise x {args.muonbp_period - 1}] run as one "
        "timed unit, reported per step; its block step is the blockwise row (0 TP bytes), its full step "
        "the owner row.",
        "megatron: bytes measured by wrapping every torch.distributed collective (scripts/bench/collectives.py) "
        "during one untimed step, counted with megatron_muon/parallel/comm.py's convention "
        "(all_gather: own input × (t−1); all_reduce: 2(t−1)/t × bytes).",
        "megatron: NS FLOPs computed analytically (duplicated: full matrix on every rank; blockwise: local "
        "shard; distributed: s·(4k²·cols + 2k³), k the unsharded dim: Megatron forms A²).",
        "megatron: includes its spectral scale-factor multiply per matrix (one cheap elementwise op); "
        "ours returns the unscaled factor. It orthogonalizes one matrix per call; ours batches same-shape ones.",
        "megatron: fed fp32 shards (its newton_schulz requires fp32), fp32_matmul_prec "
        + ("'highest'." if args.dtype == "fp32" else
           "'medium', so it casts to bf16 itself: its duplicated all-gathers fp32, its distributed "
           "all-reduces a bf16 Gram."),
        f"wall time of the ranks (start-up and imports included): {wall:.1f}s.",
    ]
    print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))

    if args.json:
        config = ({k: v for k, v in vars(args).items() if k != "json"}
                  | dict(backend=backend, device=device, shapes=shapes))
        args.json.write_text(json.dumps(dict(config=config, rows=rows, notes=notes), indent=2) + "\n")


if __name__ == "__main__":
    main()
