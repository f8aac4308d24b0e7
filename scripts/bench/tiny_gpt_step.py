"""The tiny GPT's optimizer step: package bytes per collective, and MuonBP's step times.

    python -m scripts.bench.tiny_gpt_step bytes    # docs/megatron_optimizer.md: TP2 × DP2, 4 ranks, fp32 NS
    python -m scripts.bench.tiny_gpt_step muonbp   # docs/muonbp.md: TP2, 2 ranks, plain DDP, bf16 NS
    python -m scripts.bench.tiny_gpt_step muonbp --steps 3 --json out.json

The model has the dims of ``tests/megatron_harness.py``'s tiny GPT (hidden 64, ffn 128, 4 heads /
2 query groups, 2 layers, vocab 128, SwiGLU, RMSNorm, RoPE, untied, no biases), built as a real
megatron-core ``GPTModel`` by ``optimizer_step_setup.build_gpt`` (CPU init instead of the
harness's by-name init: the same parameters and buffer layout). Before every step each param's
``main_grad`` gets the deterministic gradient of ``optimizer_step_setup.make_grads``.

``bytes``: per configuration (optimizer DDP or distributed × TP mode × DP mode) the second
``optimizer.step()`` (the first also runs the one-time cross-rank shape check) under
``megatron_muon.comm_stats()`` (the package's own collectives only; Megatron's reduce-scatter and
param all-gather are not in it), bytes per primitive: max over ranks; total: max over ranks.

``muonbp``: ours owner, ours MuonBP (``--period``, owner full steps) and megatron-core's
``TensorParallelMuon`` duplicated (plain DDP for all), ``--warmup`` untimed and ``--steps`` timed
steps each, the rows taking turns step by step; a step's time is the slowest rank's (barrier,
start, step, stop, max over ranks). Median per step kind; MuonBP's period average is
(median full + (P−1) × median block) / P. Bytes: ``comm_stats()`` per step, mean per kind, max
over ranks (Megatron's collectives are not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_muon.core.models import ModelShape

from . import optimizer_step_setup as setup
from .launch import launch

TINY_GPT = ModelShape(name="tiny-gpt", num_layers=2, hidden=64, num_heads=4, num_query_groups=2, head_dim=16,
                      ffn_hidden=128, vocab=128)
# (optimizer, tp_mode, dp_mode) of the bytes table; dp_mode only matters without the distributed optimizer.
BYTES_CONFIGS = [("DDP", m, "owner") for m in ("duplicated", "distributed", "owner")] + [
    ("DDP", "owner", "redundant"), ("DDP", "blockwise", "owner")] + [
    ("distributed", m, "—") for m in ("duplicated", "distributed", "owner", "blockwise")]


def configs(args) -> list[tuple[str, str, str]]:
    return [c for c in BYTES_CONFIGS if c[1] in args.tp_modes.split(",")]


def build_ours(tp, device, *, dist_opt, tp_mode, dp_mode="owner", period=None, precision="high"):
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    model, config = setup.build_gpt(TINY_GPT, tp, device)
    ddp = setup.wrap_ddp(model, config, distributed_optimizer=dist_opt)
    opt_config = dataclasses.replace(setup.optimizer_config(setup.Row("ours", "muon-distopt", tp_mode, ""), precision),
                                     use_distributed_optimizer=dist_opt)
    muon = MuonConfig(tp_mode=tp_mode, dp_mode=dp_mode if dp_mode != "—" else "owner", muonbp_period=period,
                      fp32_matmul_prec=precision, momentum=0.95, nesterov=False, coefficient_type="quintic",
                      num_ns_steps=5, scale_mode="spectral")
    return ddp, get_megatron_muon_optimizer(opt_config, [ddp], muon)


def measured_step(ddp, opt, grads, device) -> tuple[float, str, dict]:
    """(slowest rank's seconds, step kind, this rank's bytes by primitive) of one step: CUDA events
    on a GPU (after a synchronize, so queued work does not count), the host clock on the CPU; the
    slowest rank's time by an all-reduce on the collective's own device (NCCL takes CUDA tensors)."""
    from megatron_muon import comm_stats
    from megatron_muon.optimizer import StepTimer
    from megatron_muon.parallel.devices import group_device

    setup.fill_main_grads(ddp, grads)
    dist.barrier()
    with comm_stats() as stats:
        seconds = StepTimer(device).measure(opt.step)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=group_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    inner = setup.muon_inner(opt)
    return slowest.item(), (inner.last_step_kind if inner else "muon") or "muon", dict(stats.bytes_by_primitive)


def rank_main(rank: int, world: int, device, tp: int, args) -> list[dict]:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.cpu_patches import apply_cpu_patches

    if device.type == "cpu":  # launch() picks NCCL when enough GPUs are visible
        apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        if args.table == "bytes":
            out = []
            for optimizer, tp_mode, dp_mode in configs(args):
                ddp, opt = build_ours(tp, device, dist_opt=optimizer == "distributed", tp_mode=tp_mode, dp_mode=dp_mode)
                grads = setup.make_grads(ddp.module, ps.get_tensor_model_parallel_rank(), tp, device)
                measured_step(ddp, opt, grads, device)  # the first step also runs the one-time shape check
                out.append(dict(optimizer=optimizer, tp_mode=tp_mode, dp_mode=dp_mode,
                                bytes=measured_step(ddp, opt, grads, device)[2]))
            return out
        rows = {"ours, owner": build_ours(tp, device, dist_opt=False, tp_mode="owner", precision="medium"),
                f"ours, MuonBP P={args.period}": build_ours(tp, device, dist_opt=False, tp_mode="owner",
                                                            period=args.period, precision="medium"),
                "megatron-core TensorParallelMuon duplicated": setup.build_row(
                    setup.Row("megatron", "muon-ddp", "duplicated", ""), TINY_GPT, tp, device, "medium", "medium")}
        grads = setup.make_grads(rows["ours, owner"][0].module, ps.get_tensor_model_parallel_rank(), tp, device)
        steps = {label: [] for label in rows}
        for i in range(args.warmup + args.steps):
            for label, (ddp, opt) in rows.items():
                step = measured_step(ddp, opt, grads, device)
                if i >= args.warmup:
                    steps[label].append(step)
        return [dict(label=label, steps=s) for label, s in steps.items()]
    finally:
        ps.destroy_model_parallel()


def bytes_table(per_rank: list[list[dict]]) -> tuple[str, list[dict]]:
    primitives = sorted({k for rank in per_rank for r in rank for k in r["bytes"]})
    rows = []
    for configs in zip(*per_rank):
        row = {k: v for k, v in configs[0].items() if k != "bytes"}
        row |= {p: max(c["bytes"].get(p, 0) for c in configs) for p in primitives}
        rows.append(row | dict(total=max(sum(c["bytes"].values()) for c in configs)))
    lines = ["| optimizer | tp_mode | dp_mode | " + " | ".join(primitives) + " | total |",
             "|---|---|---|" + "---:|" * (len(primitives) + 1)]
    lines += [f"| {r['optimizer']} | {r['tp_mode']} | {r['dp_mode']} | "
              + " | ".join(f"{r[p]:,}" for p in [*primitives, "total"]) + " |" for r in rows]
    return "\n".join(lines), rows


def muonbp_table(per_rank: list[list[dict]], period: int) -> tuple[str, list[dict]]:
    rows = []
    for by_rank in zip(*per_rank):
        label = by_rank[0]["label"]
        ours = not label.startswith("megatron")
        order = ("muon", "full", "block")  # MuonBP: full step first, as the period starts with it
        for kind in sorted({kind for _, kind, _ in by_rank[0]["steps"]}, key=order.index):
            times = [1e3 * t for t, k, _ in by_rank[0]["steps"] if k == kind]  # already the slowest rank's
            sent = max(statistics.mean(sum(b.values()) for _, k, b in r["steps"] if k == kind) for r in by_rank)
            rows.append(dict(label=label, kind=kind if ours else "—", steps=len(times),
                             median_ms=statistics.median(times), bytes=round(sent) if ours else None))
    kinds = {r["kind"]: r for r in rows if "MuonBP" in r["label"]}
    if {"full", "block"} <= kinds.keys():
        avg = lambda key: (kinds["full"][key] + (period - 1) * kinds["block"][key]) / period  # noqa: E731
        rows.insert(rows.index(kinds["block"]) + 1, dict(
            label=kinds["full"]["label"], kind="period average of medians", steps=None,
            median_ms=avg("median_ms"), bytes=round(avg("bytes"))))
    lines = ["| optimizer | step kind | steps | median ms | TP bytes/step (ours, comm_stats) |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['kind']} | {'' if r['steps'] is None else r['steps']} | {r['median_ms']:.2f} | "
              + ("(Megatron's collectives, not counted)" if r["bytes"] is None else f"{r['bytes']:,}") + " |"
              for r in rows]
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=("bytes", "muonbp"), help="which table to produce")
    parser.add_argument("--steps", type=int, default=20, help="muonbp: timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="muonbp: untimed steps per row first")
    parser.add_argument("--period", type=int, default=5, help="muonbp: MuonBP period P")
    parser.add_argument("--tp-modes", default="duplicated,distributed,owner,blockwise",
                        help="bytes: only the rows of these TP modes (comma-separated)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the ranks")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if min(args.steps, args.period) < 1 or args.warmup < 0:
        parser.error("--steps and --period must be >= 1, --warmup >= 0")
    if not configs(args):
        parser.error(f"--tp-modes: none of {args.tp_modes!r} is a TP mode of the bytes table")
    tp, world = (2, 4) if args.table == "bytes" else (2, 2)
    wall = time.perf_counter()
    try:
        per_rank = launch(world, rank_main, tp, args, timeout=args.timeout, tag="tiny-gpt")
    except RuntimeError as err:
        raise SystemExit(f"error: {err}") from None
    if args.table == "bytes":
        print("Tiny GPT, TP2 × DP2 (4 ranks), fp32 NS: bytes sent per rank in one optimizer.step(), "
              "megatron_muon.comm_stats() per primitive, max over ranks\n")
        table, rows = bytes_table(per_rank)
    else:
        print(f"Tiny GPT, TP2 (2 ranks), plain DDP, bf16 NS: optimizer.step() ms (slowest rank), {args.steps} timed "
              f"steps per row after {args.warmup} warm-up, rows interleaved\n")
        table, rows = muonbp_table(per_rank, args.period)
    print(table)
    print(f"\nwall time (start-up included): {time.perf_counter() - wall:.1f}s; command: "
          + " ".join(["python -m scripts.bench.tiny_gpt_step", *sys.argv[1:]]))
    if args.json:
        args.json.write_text(json.dumps(dict(table=args.table, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
