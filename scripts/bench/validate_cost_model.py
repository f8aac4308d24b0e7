"""Predict the optimizer-step benchmark's rows with the cost model and report the error per row.

    python -m scripts.bench.bench_optimizer_step --out-dir bench-results
    python -m scripts.bench.validate_cost_model --bench bench-results/optimizer_step.json
    python -m scripts.bench.validate_cost_model --bench OLD/optimizer_step.json \
        --hardware 2=OLD/hardware-2proc.json --hardware 4=OLD/hardware-4proc.json

The hardware constants come only from micro-measurements (``calibrate_hardware``'s probes),
per process count, since a 4-process layout on 2 cores has half the compute per rank. By
default they are the ones the benchmark's own ranks measured after each of its timed rounds
(their median: each layout's ``hardware``); ``--hardware WORLD=FILE`` replaces them by a
separate calibration run's (needed for a benchmark file recorded before the in-run probes). Nothing is fitted to the
benchmark's times. Each row's model figure is ``cost_model.optimizer_step_cost`` on
the benchmark's own shapes and layout; the MuonBP period average is (full + (P−1)·block)/P of the
predicted full and block steps.

The cost model prices a step's arithmetic, its bytes and its collectives, not the step's path
through Python, the dispatcher and Megatron's bookkeeping: on a GPU that path runs ahead of the
kernels, on the CPU it is the same thread's time (2026-12-07, one ours blockwise step at TP 2:
14.8 ms on a model too small for its arithmetic to count, against 4.9 ms the model prices
there). The benchmark measures it per row (``host_floor_ms``: the same row on the host floor's
tiny model); the prediction is the model's figure plus that row's host floor less what the model
already prices on the tiny model (never below zero, as a row the model prices slower there than
it runs has no unpriced path to add). The tiny model's collectives follow next to no compute, so
they are priced at the latencies the probes measured back to back (the layout's
``back_to_back``, where recorded), not after a GEMM as the full model's are. Error = (predicted −
measured) / measured; the summary also counts the model's figure alone, and a benchmark file
without host floors is predicted on that.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from megatron_muon.core.models import ModelShape
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.hardware import Hardware
from megatron_muon.plan.step_cost import optimizer_step_cost

NS_DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""the benchmark's NS element size → its dtype."""

TARGET = 0.20  # issue 42: every row within 20% (the first validation issue asked 25%)


def model_from_bench(bench: dict, key: str = "model") -> ModelShape:
    """The benchmark's model (a scaled Llama-3 GPT: ``bench[key]``'s sizes; ``floor_model``: the
    host floor's). The cost model lays it out as megatron-core builds it (``plan.stage_params``)
    and splits it as each optimizer does (ours: QKV, fc1's gate and up; megatron-core 0.19.2's
    Muon: QKV only)."""
    m = bench[key]
    return ModelShape("bench", m["layers"], m["hidden"], m["heads"], m["query_groups"], m["head_dim"], m["ffn"],
                      m["vocab"])


def predict_row(row: dict, model: ModelShape, tp: int, dp: int, hw: Hardware, ns_bytes: int,
                period: int, clip_grad: bool, bucket_numel: int | None = None) -> float:
    """Predicted seconds of one benchmark row on the benchmark's buffer layout (the row's
    ``dp_layout`` and its ``bucket_numel``)."""

    def step(optimizer: str, mode: str) -> float:
        return optimizer_step_cost(model, optimizer=optimizer, tp=tp, dp=dp, hw=hw, tp_mode=mode,
                                   ns=NSOptions(dtype=NS_DTYPES[ns_bytes], method=row.get("ns_method", "standard")),
                                   clip_grad=clip_grad, dp_layout=row.get("dp_layout", "megatron"),
                                   bucket_numel=bucket_numel, param_bytes=4).total_s  # the bench's fp32 params

    kind, mode = row["step_kind"], row["mode"]
    if row["optimizer"] == "adam-distopt":
        return step("adam", "owner")
    if row["impl"] == "megatron":
        return step("megatron-layerwise" if row["optimizer"] == "layerwise" else "megatron-muon", mode)
    if kind == "full":
        return step("ours", "owner")
    if kind == "block":
        return step("ours", "blockwise")
    if kind == "period_avg":
        return (step("ours", "owner") + (period - 1) * step("ours", "blockwise")) / period
    return step("ours", mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", type=Path, required=True, help="optimizer_step.json of the benchmark")
    parser.add_argument("--hardware", action="append", default=[], metavar="WORLD=FILE",
                        help="a separate calibration's constants for a process count (repeat per layout "
                             "size); default: the benchmark's in-run probes")
    parser.add_argument("--period", type=int, default=5, help="the MuonBP period of the benchmark")
    parser.add_argument("--json", type=Path, help="also write the per-row table here")
    args = parser.parse_args()
    bench = json.loads(args.bench.read_text())
    hardware = {}
    for spec in args.hardware:
        world, _, path = spec.partition("=")
        if not world.isdigit() or not path:
            raise SystemExit(f"--hardware: expected WORLD=FILE (e.g. 2=hw.json), got {spec!r}")
        hardware[int(world)] = Hardware(**json.loads(Path(path).read_text()))
    table = validate(bench, hardware, args.period)
    print("| layout | row | measured ms | model ms | unpriced host ms | predicted ms | error |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in table:
        flag = "" if abs(r["error"]) <= TARGET else " ✗"
        print(f"| {r['layout']} | {r['label']} | {r['measured_ms']:.1f} | {r['model_ms']:.1f} | {r['host_ms']:.1f} | "
              f"{r['predicted_ms']:.1f} | {r['error']:+.0%}{flag} |")
    print()
    for key, what in (("error", "predicted"), ("model_error", "the model alone")):
        errors = [abs(r[key]) for r in table]
        within = sum(e <= TARGET for e in errors)
        print(f"{what}: {within}/{len(errors)} rows within {TARGET:.0%}; median |error| "
              f"{statistics.median(errors):.0%}, max {max(errors):.0%}")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=table, hardware={k: v.__dict__ for k, v in hardware.items()}),
                                        indent=2) + "\n")


def validate(bench: dict, hardware: dict[int, Hardware], period: int) -> list[dict]:
    """Every row of ``bench`` predicted and set beside its measured (median) time: the table's
    rows. ``hardware``: a separate calibration per process count, in place of the benchmark's
    in-run probes (their median over the rounds)."""
    ns_bytes = {"float32": 4, "bfloat16": 2}[bench["ns_dtype"]]
    model = model_from_bench(bench)
    tiny = model_from_bench(bench, "floor_model") if "floor_model" in bench else None
    clip_grad = bench.get("clip_grad", 1.0) > 0
    table = []
    for layout in bench["layouts"]:
        recorded = layout.get("hardware")
        if layout["world"] in hardware:
            hw = hardware[layout["world"]]
        elif recorded is not None:
            hw = Hardware(**recorded)
        else:
            raise SystemExit(f"--hardware: no constants for {layout['world']} processes (layout {layout['name']}; "
                             f"the benchmark file has no in-run probes)")
        # the host floor's collectives run back to back (recorded by the in-run probes since
        # 2026-12-07; a separate calibration, or an older file, has the one kind)
        in_run = layout["world"] not in hardware and "back_to_back" in layout
        floor_hw = replace(hw, **layout["back_to_back"]) if in_run else hw
        for row in layout["rows"]:
            def predict(shape, on=hw):
                return predict_row(row, shape, layout["tp"], layout["dp"], on, ns_bytes, period, clip_grad,
                                   bench.get("bucket_size"))
            priced = predict(model)
            floor = row.get("host_floor_ms")
            host = max(0.0, floor / 1e3 - predict(tiny, floor_hw)) if tiny is not None and floor is not None else 0.0
            measured = row["median_ms"] / 1e3
            predicted = priced + host
            table.append(dict(layout=layout["name"], label=row["label"], measured_ms=measured * 1e3,
                              model_ms=priced * 1e3, host_ms=host * 1e3, predicted_ms=predicted * 1e3,
                              error=(predicted - measured) / measured, model_error=(priced - measured) / measured))
    return table


if __name__ == "__main__":
    main()
