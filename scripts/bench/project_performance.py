"""Project the optimizer step of Llama-3 8B / 70B / 405B onto H100 and H200 nodes with the cost model.

    python -m scripts.bench.project_performance                 # Markdown tables to stdout
    python -m scripts.bench.project_performance --json out.json

Nothing here is measured: ``hardware.GPU_PROFILES`` holds the vendor-derived constants (their
``source`` fields say which), and the layouts below are typical Megatron ones. The model is the
one validated on CPU against measured steps (``scripts/bench/validate_cost_model.py``); on GPUs its
constants are quoted, not calibrated, so read these as estimates.

Training step: forward + backward ≈ 6 · params · tokens FLOPs, spread over every GPU at
``--mfu`` of the dense bf16 peak (989 TFLOP/s on both H100 SXM and H200). The optimizer step
runs after it with nothing overlapped (``--overlap-param-gather`` would hide the ZeRO-1
all-gather; the model does not assume it), so its share is opt / (fwd+bwd + opt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.stage_params import model_numel
from megatron_muon.plan.step_cost import optimizer_step_cost

BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM / H200 (NVIDIA datasheets)
# model -> (tp, pp, dp): TP inside a node, pipeline stages as Llama-3 405B used (TP8 × PP16)
LAYOUTS = {"8B": (8, 1, 8), "70B": (8, 4, 8), "405B": (8, 16, 8)}
# (label, optimizer, tp_mode[, --muon-dp-layout[, --muon-ns-method]]); ours default to the balanced buffer layout
# (no DP exchange); MuonBP is derived from its full (owner) and block (blockwise) steps
ROWS = (
    ("ours duplicated", "ours", "duplicated"),
    ("ours distributed", "ours", "distributed"),
    ("ours owner", "ours", "owner"),
    ("ours owner, --muon-dp-layout megatron", "ours", "owner", "megatron"),
    ("ours owner, --muon-ns-method gram", "ours", "owner", "balanced", "gram"),
    ("ours distributed, --muon-ns-method gram", "ours", "distributed", "balanced", "gram"),
    ("ours auto", "ours", "auto"),
    ("ours blockwise (BlockMuon)", "ours", "blockwise"),
    ("megatron layer-wise duplicated", "megatron-layerwise", "duplicated"),
    ("megatron layer-wise distributed", "megatron-layerwise", "distributed"),
    ("megatron layer-wise blockwise", "megatron-layerwise", "blockwise"),
    ("megatron DDP duplicated", "megatron-muon", "duplicated"),
    ("adam (distributed optimizer)", "adam", "owner"),
)
UPSTREAM_GB300_MS = {"duplicated": 632, "distributed": 356, "layer_sharded": 157}  # 32 GB300, upstream PR


def fwd_bwd_seconds(model: str, tokens: int, gpus: int, mfu: float) -> float:
    return 6 * model_numel(LLAMA3[model]) * tokens / (gpus * BF16_PEAK * mfu)


def step_ms(model: str, hw_name: str, optimizer: str, mode: str, period: int, dp_layout: str = "balanced",
            ns_method: str = "standard") -> float:
    tp, pp, dp = LAYOUTS[model]
    hw, shape = GPU_PROFILES[hw_name], LLAMA3[model]
    # DDP's default bucket with --overlap-grad-reduce: max(40M, 1M·DP) elements
    cost = lambda o, m: optimizer_step_cost(shape, optimizer=o, tp=tp, dp=dp, pp=pp, hw=hw, tp_mode=m,  # noqa: E731
                                            ns=NSOptions(method=ns_method), dp_layout=dp_layout,
                                            bucket_numel=max(40_000_000, 1_000_000 * dp)).total_s * 1e3
    if mode == "muonbp":
        return (cost(optimizer, "owner") + (period - 1) * cost(optimizer, "blockwise")) / period
    return cost(optimizer, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=512, help="sequences per step (4M tokens at 8192)")
    parser.add_argument("--mfu", type=float, default=0.40, help="fwd+bwd model FLOPs utilisation")
    parser.add_argument("--period", type=int, default=5, help="MuonBP period P")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu: expected a fraction in (0, 1], got {args.mfu}")
    if min(args.seq, args.global_batch, args.period) < 1:
        parser.error("--seq, --global-batch and --period: expected integers >= 1")
    tokens = args.seq * args.global_batch
    out = {"tokens_per_step": tokens, "mfu": args.mfu, "layouts": LAYOUTS, "rows": []}
    rows = ROWS + ((f"ours MuonBP P={args.period} (period avg)", "ours", "muonbp"),)

    for hw_name in GPU_PROFILES:
        print(f"\n### {hw_name}: {GPU_PROFILES[hw_name].source}\n")
        print(f"tokens/step {tokens:,}, MFU {args.mfu:.0%}; layouts TP×PP×DP: "
              + ", ".join(f"{m} {t}×{p}×{d}" for m, (t, p, d) in LAYOUTS.items()) + "\n")
        print("| row | " + " | ".join(f"{m} ms (share)" for m in LAYOUTS) + " |")
        print("|---|" + "---:|" * len(LAYOUTS))
        for label, optimizer, mode, *layout in rows:
            cells = []
            for model, (tp, pp, dp) in LAYOUTS.items():
                ms = step_ms(model, hw_name, optimizer, mode, args.period, *layout)
                fb = fwd_bwd_seconds(model, tokens, tp * pp * dp, args.mfu) * 1e3
                cells.append(f"{ms:.0f} ({ms / (fb + ms):.1%})")
                out["rows"].append(dict(hardware=hw_name, model=model, row=label, optimizer_ms=ms, fwd_bwd_ms=fb))
            print(f"| {label} | " + " | ".join(cells) + " |")
        print("| fwd+bwd (6·N·tokens) | " + " | ".join(
            f"{fwd_bwd_seconds(m, tokens, t * p * d, args.mfu) * 1e3:.0f}" for m, (t, p, d) in LAYOUTS.items()) + " |")

    # MuonBP's throughput gain at 8B TP8 against exact Muon, and how it moves with tokens per GPU
    print(f"\n### MuonBP P={args.period} throughput gain at Llama-3 8B, TP8 × DP8, h100-sxm (paper: +8%)\n")
    print("| global batch (seq) | tokens/GPU | fwd+bwd ms | vs ours duplicated | vs megatron layer-wise duplicated "
          "| vs ours owner |")
    print("|---:|---:|---:|---:|---:|---:|")
    tp, pp, dp = LAYOUTS["8B"]
    bp = step_ms("8B", "h100-sxm", "ours", "muonbp", args.period)
    baselines = [step_ms("8B", "h100-sxm", o, m, args.period)
                 for o, m in (("ours", "duplicated"), ("megatron-layerwise", "duplicated"), ("ours", "owner"))]
    for batch in (32, 64, 128, 256, 512):
        fb = fwd_bwd_seconds("8B", batch * args.seq, tp * pp * dp, args.mfu) * 1e3
        gains = [(fb + base) / (fb + bp) - 1 for base in baselines]
        print(f"| {batch} | {batch * args.seq // (tp * pp * dp):,} | {fb:.0f} | "
              + " | ".join(f"{g:+.1%}" for g in gains) + " |")
        out.setdefault("muonbp_gain", []).append(dict(global_batch=batch, fwd_bwd_ms=fb, gains=gains))

    print("\n### Against upstream's published optimizer step (32 GB300; model not stated in what we could read)\n")
    print("| mode | upstream GB300 ms | ratio to duplicated | ours, 70B TP8×PP4×DP8 h100 ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    ours = {"duplicated": step_ms("70B", "h100-sxm", "megatron-layerwise", "duplicated", args.period),
            "distributed": step_ms("70B", "h100-sxm", "megatron-layerwise", "distributed", args.period),
            "layer_sharded": step_ms("70B", "h100-sxm", "ours", "owner", args.period)}
    for mode, ms in UPSTREAM_GB300_MS.items():
        print(f"| {mode} | {ms} | {ms / UPSTREAM_GB300_MS['duplicated']:.2f} | {ours[mode]:.0f} | "
              f"{ours[mode] / ours['duplicated']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
