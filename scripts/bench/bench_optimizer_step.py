"""Benchmark whole Megatron optimizers' ``optimizer.step()`` side by side, in one run.

    .venv/bin/python -m scripts.bench.bench_optimizer_step                          # tp2 and tp2dp2, scale 16, 4 layers
    .venv/bin/python -m scripts.bench.bench_optimizer_step --layouts tp2 --scale 64 --layers 1 --warmup 1 --repeats 2
    .venv/bin/python -m scripts.bench.bench_optimizer_step --out-dir bench-results/  # writes optimizer_step.{json,md}

Per layout (``tp2``: 2 ranks; ``tp2dp2``: TP 2 × DP 2, 4 ranks) the script starts the ranks
itself (file:// rendezvous in a temp dir; NCCL and one GPU per rank when that many are visible,
else gloo on the CPU with ``megatron_muon.megatron.cpu_patches``). Every rank builds, per row, its own
copy of one real Megatron ``GPTModel`` (local spec, RoPE, RMSNorm, SwiGLU, GQA 8 heads / 2
query groups, untied embeddings, no biases; Llama-3-8B's hidden 4096 and ffn 14336 divided by
``--scale``, ``--layers`` layers, vocab ``--vocab``), fp32, same seed (identical weights),
wrapped in Megatron's DDP as ``megatron.training`` wraps it for that optimizer.

Rows (``impl`` / ``optimizer`` / ``mode``):
  ours     muon-distopt  owner | duplicated | distributed | blockwise   ``get_megatron_muon_optimizer``
           with ``use_distributed_optimizer`` (MuonDistributedOptimizer, even at DP 1), i.e.
           ``--optimizer muon --use-distributed-optimizer --muon-tp-mode MODE --muon-dp-layout
           megatron`` (megatron-core's buffer layout: cut matrices travel to a DP owner);
  ours     muon-distopt  owner balanced: the same with ``--muon-dp-layout balanced`` (our layout:
           every matrix whole in one DP shard, nothing travels between DP ranks);
  ours     muon-distopt  muonbp-5 (owner full steps): MuonBP period 5, reported as its full
           step, its block step and the average over one period (three rows of one optimizer);
  megatron muon-ddp      duplicated | distributed | blockwise   megatron-core's
           ``TensorParallelMuon`` from ``get_megatron_optimizer`` (plain DDP: in 0.19.2 muon with
           the non-layer-wise distributed optimizer is wrong);
  megatron layerwise     duplicated   ``LayerWiseDistributedOptimizer`` (what Megatron builds for
           ``--optimizer muon --use-distributed-optimizer``: whole matrices per DP rank, Adam
           params in a DistributedOptimizer beside it);
  megatron adam-distopt  Adam with the distributed optimizer, the coordinate-wise baseline.
All: lr 1e-3, weight decay 0.01, clip_grad 1.0; Muon momentum 0.95, no Nesterov, quintic, 5 NS
steps, spectral scale, QKV split per query group (both), fc1 split into gate/up (ours only:
Megatron 0.19.2 cannot); Newton–Schulz in fp32 on the CPU, bf16 on CUDA.

Every step is preceded by writing the same deterministic gradient into every param's
``main_grad`` (the full gradient drawn from (seed, name), this TP rank's shard; the same on
every DP rank, as after the all-reduce). Only ``optimizer.step()`` is timed: barrier, start,
step, device sync, stop; a step's time is the slowest rank's (all-reduce MAX). The rows take
turns, one step each per round (MuonBP: one period per round), after ``--warmup`` rounds.

Figures, from untimed steps:
  bytes     every ``torch.distributed`` collective the step calls is wrapped (also Megatron's
            import-time aliases) and counted with ``megatron_muon/parallel/comm.py``'s convention:
            all_to_all bytes to other ranks; all_gather own input × (t−1); all_reduce
            2(t−1)/t × bytes; reduce_scatter (t−1)/t × input; broadcast root bytes × (t−1).
            Ours also report ``comm_stats()`` (package collectives only) as a cross-check.
  NS FLOPs  ours: ``comm_stats().ns_flops``; Megatron: emerging_optimizers' ``newton_schulz``
            wrapped, FLOPs from the shapes it receives.
  memory    CUDA: ``max_memory_allocated`` above the start; CPU: the peak of the cumulative sum
            of allocations / frees during one step under ``torch.profiler(profile_memory)``;
            optimizer state MiB per rank (momentum, exp_avg(_sq), steps, main-param copies).
  hardware  the cost model's constants, measured by the same ranks (``calibrate_hardware``'s
            probes, one sample each after every timed round) and recorded per layout
            (``hardware``), each the median over the rounds, with the collective latencies also
            as timed back to back (``back_to_back``: what the host floor's steps pay, whose
            collectives follow next to no compute). ``validate_cost_model`` predicts each
            row on the machine as the rows found it, not as a separate calibration run found it
            minutes earlier: on the shared 2-core host the GEMM rate moved from 64 to 133 GFLOP/s
            per rank between runs, more than the model's error.
  host floor every row timed again, in rounds after the timed ones, on a copy of the model with
            hidden and ffn divided by ``--floor-scale`` (default 128: hidden 32, ffn 112, vocab
            128) and the same layers, layout and optimizer (``host_floor_ms``, the median): a step
            whose arithmetic is a few percent of its time, so what it measures is the step's path
            through Python, the dispatcher and Megatron's bookkeeping, which the cost model does
            not price (on a GPU that path runs ahead of the device's kernels; on the CPU it is the
            same thread's time).
  exactness after the first step, the params of ours owner / duplicated / distributed must agree
            with each other and with Megatron duplicated (fc1 excepted for Megatron: it
            orthogonalizes [gate; up] as one matrix), Megatron layer-wise with Megatron
            duplicated; max |Δ| in the notes, flagged (exit status 1, after writing) if > 1e-5.

CPU workarounds for megatron-core 0.19.2's layer-wise optimizer (this script only, see
``optimizer_step_setup.py``): its one ``device='cuda'`` literal is retargeted like
``megatron_muon.megatron.cpu_patches`` does; with fp32 params its torch optimizers are wrapped in
``FP32Optimizer`` (upstream wraps them only under bf16 and otherwise fails to build).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from . import calibrate_hardware as calibrate
from . import optimizer_step_setup as setup
from .collectives import CollectiveCounter
from .launch import backend_for, launch

LAYER_WISE = "megatron layer-wise (duplicated)"
LAYOUTS = {"tp2": (2, 1), "tp2dp2": (2, 2)}  # (TP, DP); 2 query groups allow TP <= 2
ROWS = [setup.Row("ours", "muon-distopt", m, f"ours {m}") for m in ("owner", "duplicated", "distributed", "blockwise")]
ROWS += [setup.Row("ours", "muon-distopt", "owner", "ours owner balanced", dp_layout="balanced")]
ROWS += [setup.Row("ours", "muon-distopt", "owner", "ours MuonBP P=5", muonbp_period=5)]
ROWS += [setup.Row("ours", "muon-distopt", m, f"ours {m} gram", ns_method="gram") for m in ("owner", "distributed")]
ROWS += [setup.Row("megatron", "muon-ddp", m, f"megatron {m}") for m in ("duplicated", "distributed", "blockwise")]
ROWS += [setup.Row("megatron", "layerwise", "duplicated", LAYER_WISE),
         setup.Row("megatron", "adam-distopt", "adam", "megatron adam distopt")]
EXACT_ROWS = ("ours owner", "ours duplicated", "ours distributed", "ours owner balanced", "ours owner gram",
              "ours distributed gram")
REFERENCE = "megatron duplicated"
FC1_DIFFERS = "different math: split vs fused gate/up, not checked"
# Max |Δparam| after one step at lr 1e-3. fp32 NS of the same matrices, batched or reduced in
# another order: observed <= 1e-8; a different update (fc1 split vs fused, blockwise) moves params
# by ~1e-3. bf16 NS (CUDA) rounds each update element by ~2^-8 relative: lr·2^-5 leaves margin.
EXACT_TOL = {"float32": 1e-5, "bfloat16": setup.LR * 2**-5}
MIB = 2**20


# ---- per rank ------------------------------------------------------------------------------


def _max_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def exactness(built, grads, device) -> dict:
    """First step of every row, then max |Δ| of the exact rows' params against each other and
    against Megatron duplicated (max over ranks)."""
    for ddp, opt in built.values():
        setup.fill_main_grads(ddp, grads)
        opt.step()
    params = {label: dict(ddp.module.named_parameters()) for label, (ddp, _) in built.items()}
    names = list(params[REFERENCE])
    not_fc1 = [n for n in names if "linear_fc1" not in n]
    pairs = [(f"{a} vs {EXACT_ROWS[0]}", a, EXACT_ROWS[0], names) for a in EXACT_ROWS[1:]]
    pairs += [(f"{a} vs {REFERENCE} (fc1 excluded)", a, REFERENCE, not_fc1) for a in EXACT_ROWS]
    pairs.append((f"{LAYER_WISE} vs {REFERENCE}", LAYER_WISE, REFERENCE, names))  # the same TensorParallelMuon
    pairs.append((f"{EXACT_ROWS[0]} vs {REFERENCE} on fc1 ({FC1_DIFFERS})", EXACT_ROWS[0], REFERENCE,
                  [n for n in names if "linear_fc1" in n]))
    diffs = [max((params[a][n] - params[b][n]).abs().max().item() for n in subset) for _, a, b, subset in pairs]
    return dict(zip([key for key, *_ in pairs], _max_over_ranks(diffs, device)))


def measure_steps(row, ddp, opt, grads, device) -> list[dict]:
    """Untimed: bytes, package bytes, NS FLOPs of each step of one period (one for most rows),
    then peak memory of each such step and the optimizer state."""
    from megatron_muon import comm_stats

    inner = setup.muon_inner(opt)
    n = row.muonbp_period or 1
    steps = []
    for _ in range(n):
        setup.fill_main_grads(ddp, grads)
        with CollectiveCounter() as counter, setup.NsFlopCounter() as flops, comm_stats() as stats:
            opt.step()
        steps.append(dict(kind=inner.last_step_kind if inner else None, bytes_sent=counter.bytes_sent,
                          bytes_by_primitive=counter.bytes_by_primitive, calls=counter.calls,
                          package_bytes=stats.bytes_sent if inner else None,
                          ns_flops=stats.ns_flops if inner else flops.flops))
    peaks = {}  # step kind -> peak bytes; a MuonBP period's steps, profiled in the same kinds
    for _ in range(n):
        setup.fill_main_grads(ddp, grads)
        peak = setup.peak_step_bytes(opt.step, device)
        kind = inner.last_step_kind if inner else None
        peaks[kind] = max(peaks.get(kind, 0), peak)
    state = setup.optimizer_state_bytes(opt, ddp)
    return [dict(s, peak_bytes=peaks[s["kind"]], state_bytes=state) for s in steps]


def timed_rounds(built, grads, args, device, *,
                 probe: bool = True) -> tuple[list[list[list[tuple[str, float]]]], list[dict]]:
    """Per row, per round, the (kind, seconds) of each step (the slowest rank's seconds), and the
    probes (``calibrate_hardware.measure``, one sample each) taken after each timed round
    (``probe=False``: none)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = [(row, *built[row.label]) for row in ROWS]

    def one_round():
        out = []
        for row, ddp, opt in rows:
            inner, steps = setup.muon_inner(opt), []
            for _ in range(row.muonbp_period or 1):
                setup.fill_main_grads(ddp, grads)
                dist.barrier()
                sync()
                start = time.perf_counter()
                opt.step()
                sync()
                steps.append((inner.last_step_kind if inner else "step", time.perf_counter() - start))
            out.append(steps)
        return out

    for _ in range(args.warmup):
        one_round()
    probe_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the NS dtype
    rounds, probes = [], []
    for _ in range(args.repeats):
        rounds.append(one_round())
        if probe:
            probes.append(calibrate.measure(dist.get_rank(), dist.get_world_size(), device, probe_dtype, repeats=1))
    flat = _max_over_ranks([t for r in rounds for row in r for _, t in row], device)
    it = iter(flat)
    return [[[(kind, next(it)) for kind, _ in row] for row in r] for r in rounds], probes


def bench_rank(tp: int, args, device) -> dict:
    from megatron.core import parallel_state as ps

    shape = setup.scaled_llama3_8b(args.scale, args.layers, args.vocab)
    ns_precision, ours_precision = ("medium", "medium") if device.type == "cuda" else ("highest", "high")
    built = {row.label: setup.build_row(row, shape, tp, device, ns_precision, ours_precision, args.bucket_size)
             for row in ROWS}
    grads = setup.make_grads(built[REFERENCE][0].module, ps.get_tensor_model_parallel_rank(), tp, device)
    exact = exactness(built, grads, device)
    measured = {row.label: measure_steps(row, *built[row.label], grads, device) for row in ROWS}
    rounds, probes = timed_rounds(built, grads, args, device)
    # the median over the rounds, as each row's time is: on a shared host the machine's speed
    # drifts by tens of percent within a minute, so a probe far from the rounds would miss it
    probes = calibrate.median_probes(probes)
    times = {row.label: [r[i] for r in rounds] for i, row in enumerate(ROWS)}
    from megatron_muon.megatron.catalogue import is_muon_matrix

    params = [dict(name=n, shape=setup.global_shape(p, tp),
                   numel=p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1),
                   partition_dim=p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
                   muon=is_muon_matrix(p)) for n, p in built[REFERENCE][0].module.named_parameters()]
    del built
    floor_times = None
    if args.floor_scale:
        # the host floor: every row again on a copy of the model too small for its arithmetic to count
        floor = {row.label: setup.build_row(row, floor_shape(args), tp, device, ns_precision, ours_precision,
                                            args.bucket_size) for row in ROWS}
        floor_grads = setup.make_grads(floor[REFERENCE][0].module, ps.get_tensor_model_parallel_rank(), tp, device)
        floor_rounds, _ = timed_rounds(floor, floor_grads, args, device, probe=False)
        floor_times = {row.label: [r[i] for r in floor_rounds] for i, row in enumerate(ROWS)}
    return dict(exactness=exact, measured=measured, times=times, floor_times=floor_times, params=params,
                probes=probes)


def floor_shape(args):
    """The host floor's model: the benchmark's layers, hidden and ffn divided by ``--floor-scale``
    instead of ``--scale``, the vocabulary by as much more (at least 16)."""
    return setup.scaled_llama3_8b(args.floor_scale, args.layers, max(16, args.vocab * args.scale // args.floor_scale),
                                  flag="--floor-scale")


def rank_main(rank: int, world: int, device, tp: int, args) -> dict:
    """One rank (started by ``_launch.launch``): Megatron's parallel state, then ``bench_rank``."""
    warnings.filterwarnings("ignore")  # Megatron warns on import that TE / Apex are absent
    if device.type == "cpu":
        from megatron_muon.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
        setup.apply_layer_wise_cpu_patch()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        return bench_rank(tp, args, device)
    finally:
        ps.destroy_model_parallel()


# ---- report --------------------------------------------------------------------------------


def _figures(row, step_kind, per_rank_steps, times_s) -> dict:
    """One JSON row from every rank's measured steps of ``step_kind`` (all: period average)."""
    def pick(steps):
        return [s for s in steps if step_kind in (None, "period_avg") or s["kind"] == step_kind]

    def per_rank(key, reduce):
        return [reduce([s[key] for s in pick(steps)]) for steps in per_rank_steps]

    mean = lambda v: sum(v) / len(v)  # noqa: E731
    sent, flops = per_rank("bytes_sent", mean), per_rank("ns_flops", mean)
    primitives = sorted({k for steps in per_rank_steps for s in pick(steps) for k in s["bytes_by_primitive"]})
    by_primitive = {k: max(mean([s["bytes_by_primitive"].get(k, 0) for s in pick(steps)]) for steps in per_rank_steps)
                    for k in primitives}
    package = per_rank("package_bytes", mean) if row.impl == "ours" else None
    times_ms = [1e3 * t for t in times_s]
    return dict(
        impl=row.impl, optimizer=row.optimizer_kind, mode=row.mode, dp_layout=row.dp_layout, ns_method=row.ns_method,
        step_kind=step_kind or ("adam" if row.optimizer_kind == "adam-distopt" else "muon"),
        label=row.label + ({"full": " full step", "block": " block step",
                            "period_avg": " period avg"}.get(step_kind, "")),
        times_ms=times_ms, median_ms=statistics.median(times_ms), min_ms=min(times_ms), max_ms=max(times_ms),
        bytes_sent_per_rank=sent, bytes_sent_max=max(sent), bytes_by_primitive=by_primitive,
        package_bytes_per_rank=package, ns_flops_per_rank=flops, ns_flops_max=max(flops), ns_flops_mean=mean(flops),
        peak_mib_per_rank=[v / MIB for v in per_rank("peak_bytes", max)],
        state_mib_per_rank=[v / MIB for v in per_rank("state_bytes", max)],
        calls_rank0={k: mean([s["calls"].get(k, 0) for s in pick(per_rank_steps[0])])
                     for k in sorted({k for s in pick(per_rank_steps[0]) for k in s["calls"]})},
    )


def _round_seconds(row, rounds) -> dict:
    """Per step kind of ``row`` (None: its one kind), the seconds of each round: MuonBP's full and
    block steps apart (block: the mean of the round's) and the period's average."""
    if row.muonbp_period is None:
        return {None: [r[0][1] for r in rounds]}
    out = {kind: [statistics.mean(t for k, t in r if k == kind) for r in rounds] for kind in ("full", "block")}
    return out | {"period_avg": [sum(t for _, t in r) / len(r) for r in rounds]}


def summarize_layout(results: list[dict]) -> list[dict]:
    rows = []
    for row in ROWS:
        steps = [r["measured"][row.label] for r in results]
        # the rounds' times are already the max over ranks
        floor = results[0]["floor_times"]
        floor = _round_seconds(row, floor[row.label]) if floor else {}
        for kind, seconds in _round_seconds(row, results[0]["times"][row.label]).items():
            figures = _figures(row, kind, steps, seconds)
            if kind in floor:
                figures["host_floor_ms"] = 1e3 * statistics.median(floor[kind])
            rows.append(figures)
    baseline = next(r["median_ms"] for r in rows if r["label"] == REFERENCE)
    for r in rows:
        r["ratio_vs_megatron_duplicated"] = r["median_ms"] / baseline
    return rows


def markdown_table(layouts: list[dict]) -> str:
    lines = []
    for layout in layouts:
        lines += [f"\n### {layout['name']} (TP {layout['tp']} × DP {layout['dp']}, {layout['world']} ranks)\n",
                  "| row | median ms | min–max ms | host floor ms | vs Megatron dup | sent/rank MiB max "
                  "| package MiB max | NS GFLOP/rank max | mean | peak MiB max | state MiB max |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in layout["rows"]:
            package = "–" if r["package_bytes_per_rank"] is None else f"{max(r['package_bytes_per_rank']) / MIB:.3f}"
            floor = f"{r['host_floor_ms']:.1f}" if "host_floor_ms" in r else "–"
            lines.append(
                f"| {r['label']} | {r['median_ms']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} | {floor} "
                f"| {r['ratio_vs_megatron_duplicated']:.2f}× | {r['bytes_sent_max'] / MIB:.3f} | {package} "
                f"| {r['ns_flops_max'] / 1e9:.3f} | {r['ns_flops_mean'] / 1e9:.3f} "
                f"| {max(r['peak_mib_per_rank']):.2f} | {max(r['state_mib_per_rank']):.2f} |")
    return "\n".join(lines)


def model_inventory(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(muon_matrices, adam_params) with full global shapes, from rank 0's reference model."""
    kinds = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    muon, adam = [], []
    for p in results[0]["params"]:
        if p["muon"]:
            kind = next(v for k, v in kinds.items() if k in p["name"])
            muon.append(dict(name=p["name"], rows=p["shape"][0], cols=p["shape"][1],
                             partition_dim=p["partition_dim"], kind=kind))
        else:
            adam.append(dict(name=p["name"], numel=p["numel"], partition_dim=p["partition_dim"]))
    return muon, adam


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="tp2,tp2dp2", help=f"comma-separated, from {sorted(LAYOUTS)}")
    parser.add_argument("--scale", type=int, default=16, help="divide Llama-3-8B's hidden and ffn by this")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary (embedding and output: Adam)")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="elements per DDP bucket for the distributed-optimizer rows (default: one bucket, "
                             "as without --overlap-grad-reduce); small buckets cut many matrices under "
                             "megatron-core's layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (one step per row each)")
    parser.add_argument("--floor-scale", type=int, default=128,
                        help="also time every row on Llama-3-8B / this (its host floor, what "
                             "validate_cost_model adds to the cost model's arithmetic); 0: not")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for one layout's ranks")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"),
                        help="writes optimizer_step.json and optimizer_step.md here")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        parser.error(f"--layouts: expected names from {sorted(LAYOUTS)}, got {args.layouts!r}")
    if min(args.scale, args.layers, args.repeats, args.vocab) < 1 or args.warmup < 0:
        parser.error("--scale, --layers, --repeats, --vocab must be >= 1 and --warmup >= 0")
    if args.floor_scale and args.floor_scale <= args.scale:
        parser.error(f"--floor-scale: expected 0 or more than --scale ({args.scale}), got {args.floor_scale}")
    import megatron.core

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the CPU profiler's "no GPU" errors, per rank
    shape = setup.scaled_llama3_8b(args.scale, args.layers, args.vocab)
    report = dict(command=" ".join([Path(sys.executable).name] + sys.argv), torch=torch.__version__,
                  megatron_core=megatron.core.__version__, scale=args.scale, layers=args.layers,
                  bucket_size=args.bucket_size,
                  warmup=args.warmup, repeats=args.repeats,
                  model=dict(hidden=shape.hidden, ffn=shape.ffn_hidden, heads=shape.num_heads,
                             query_groups=shape.num_query_groups, head_dim=shape.head_dim, vocab=shape.vocab,
                             layers=shape.num_layers),
                  layouts=[])
    if args.floor_scale:
        tiny = floor_shape(args)
        report["floor_model"] = dict(hidden=tiny.hidden, ffn=tiny.ffn_hidden, heads=tiny.num_heads,
                                     query_groups=tiny.num_query_groups, head_dim=tiny.head_dim, vocab=tiny.vocab,
                                     layers=tiny.num_layers)
    notes, exact_failed = [], False
    wall = time.perf_counter()
    for name in layouts:
        tp, dp = LAYOUTS[name]
        world = tp * dp
        backend = backend_for(world)
        use_cuda = backend == "nccl"
        report |= dict(backend=backend, device=torch.cuda.get_device_name(0) if use_cuda else "cpu",
                       ns_dtype="bfloat16" if use_cuda else "float32")
        started = time.perf_counter()
        try:
            results = launch(world, rank_main, tp, args, timeout=args.timeout, tag="bench-optstep")
        except RuntimeError as err:  # a rank's traceback is the useful part, not the parent's
            raise SystemExit(f"error ({name}): {err}") from None
        report["muon_matrices"], report["adam_params"] = model_inventory(results)
        exact = results[0]["exactness"]
        tol = EXACT_TOL[report["ns_dtype"]]
        failed = {k: v for k, v in exact.items() if v > tol and FC1_DIFFERS not in k}
        exact_failed |= bool(failed)
        hardware = calibrate.hardware_from_probes(results[0]["probes"], world, backend,
                                                  "scripts/bench/bench_optimizer_step.py (in-run probes)")
        report["layouts"].append(dict(name=name, tp=tp, dp=dp, world=world, rows=summarize_layout(results),
                                      hardware=dataclasses.asdict(hardware),
                                      back_to_back=results[0]["probes"]["back_to_back"],
                                      exactness=dict(max_abs_diff=exact, tolerance=tol, passed=not failed),
                                      wall_s=time.perf_counter() - started))
        notes.append(f"{name}: exactness after step 1 (max |Δparam| over ranks): "
                     + "; ".join(f"{k}: {v:.2e}" for k, v in exact.items())
                     + (f" -- FLAGGED, above {tol:g}: {sorted(failed)}" if failed else f" (all checked <= {tol:g})"))
    wall = time.perf_counter() - wall
    notes += [
        "time: optimizer.step() only (barrier, start, step, device sync, stop), the slowest rank's; median "
        "and min-max over the repeats; rows take turns step by step. MuonBP: each round steps it one period "
        "(one full and four block steps, classified by MuonWithAdamW.last_step_kind); 'full step' / 'block step' "
        "time those steps (block: the mean of the round's four), 'period avg' is the round's sum / 5.",
        "bytes: every torch.distributed collective called during one untimed step, for every row alike "
        "(torch.distributed attributes and Megatron's import-time aliases such as param_and_grad_buffer."
        "dist_all_gather_func wrapped), megatron_muon/parallel/comm.py's convention: all_to_all: bytes to other ranks; "
        "all_gather: own input x (t-1); all_reduce: 2(t-1)/t x bytes; reduce_scatter: (t-1)/t x input; "
        "broadcast: root bytes x (t-1). Megatron's rows are counted only this way; 'package' is ours' "
        "megatron_muon.comm_stats() (our collectives alone), the rest of ours' bytes are Megatron's (grad-norm "
        "all-reduces, the distributed optimizer's param all-gather).",
        "NS FLOPs: ours from comm_stats().ns_flops (what the package ran); Megatron's counted by wrapping "
        "emerging_optimizers.muon_utils.newton_schulz, from the shapes it receives (X m x n after its transpose "
        "rule: steps x (4m^2 n + 2m^3) per matrix; distributed mode's m is the full unsharded dim).",
        "memory: " + ("torch.cuda.max_memory_allocated above the step's start" if report["backend"] == "nccl" else
                      "CPU: peak of the cumulative allocations minus frees during one untimed step under "
                      "torch.profiler(profile_memory=True), above the step's start")
        + "; state: the torch optimizers' state tensors plus main-param copies (none in fp32).",
        "NS precision: " + ("bf16 (ours fp32_matmul_prec medium; Megatron muon_fp32_matmul_prec medium)."
                            if report["backend"] == "nccl" else
                            "fp32 (ours MuonConfig fp32_matmul_prec='high': fp32 NS; Megatron "
                            "muon_fp32_matmul_prec='highest', the same fp32 matmuls on the CPU)."),
        "QKV split per query group for both; fc1 split into gate/up by ours only (Megatron 0.19.2 has no fc1 split), "
        "so fc1's update differs between ours and Megatron by design.",
        "megatron layer-wise: built as megatron.training does for --optimizer muon --use-distributed-optimizer "
        "(params tagged, LayerWiseDistributedOptimizer.compute_full_param_layout, DDP with "
        "use_distributed_optimizer=True, OptimizerConfig(use_layer_wise_distributed_optimizer=True)), muon_tp_mode "
        "duplicated (exact); at DP 1 it has nothing to distribute.",
        f"wall time of the whole benchmark (start-up and imports included): {wall:.1f}s.",
    ]
    report["notes"] = notes
    table = markdown_table(report["layouts"])
    head = (f"Optimizer step, Megatron GPT (hidden {shape.hidden}, ffn {shape.ffn_hidden}, {shape.num_heads} heads / "
            f"{shape.num_query_groups} groups, {shape.num_layers} layers, vocab {shape.vocab}; "
            f"Llama-3-8B / {args.scale}), "
            f"{report['backend']} on {report['device']}, NS {report['ns_dtype']}, warmup {args.warmup}, "
            f"repeats {args.repeats}")
    text = head + "\n" + table + "\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "optimizer_step.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / "optimizer_step.md").write_text(text)
    if exact_failed:
        raise SystemExit("error: the exactness check failed (see the notes)")


if __name__ == "__main__":
    main()
