"""Newton–Schulz time by method, standard against Gram, side by side in one run (issue 25, item 5).

    python -m scripts.bench.bench_ns_methods [--scale 8] [--repeats 5] [--dtypes float32,bfloat16]

One process, this machine's threads. Per Llama-3 shape class (scaled down by ``--scale`` to fit a
CPU), per dtype: the median of ``--repeats`` timed calls of ``newton_schulz`` and of
``gram_newton_schulz`` (5 quintic steps, one restart), their ratio, and the FLOP ratio the
counts predict (``gram_ns_flops`` ÷ ``ns_flops``). On CUDA each call is timed with events after a
synchronize. The square class is the one ``--muon-ns-method gram`` runs the standard iteration
on (``GRAM_MIN_ASPECT``); it is timed both ways so the fallback's decision can be read off.
In bf16 a third column times Gram NS with its products in fp16 (``--muon-gram-fp16``). Every row
also gives each variant's relative error (Frobenius) against float64 standard NS of the same
(rounded) input: the polynomial all of them compute, so the error is rounding alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_muon.core.newton_schulz import gram_newton_schulz, gram_ns_flops, newton_schulz, ns_flops

# (class, rows, cols) of Llama-3 weights, full size; divided by --scale
CLASSES = (
    ("square: q, proj (8B: 4096 x 4096)", 4096, 4096),
    ("4:1: k, v (8B: 1024 x 4096)", 1024, 4096),
    ("3.5:1: fc1 half (8B: 14336 x 4096)", 14336, 4096),
    ("3.5:1: fc2 (8B: 4096 x 14336)", 4096, 14336),
    ("3.25:1: fc1 half (405B: 53248 x 16384, /4)", 13312, 4096),
    ("8:1: (32768 x 4096)", 32768, 4096),
    ("56:1: thin (28672 x 512)", 28672, 512),
)


def _timed(fn, x, repeats: int) -> float:
    """Median seconds of ``fn(x)`` over ``repeats`` calls after one warm-up (CUDA events on a GPU)."""
    fn(x)
    samples = []
    for _ in range(repeats):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def run(scale: int, repeats: int, dtypes: list[torch.dtype], device: torch.device) -> list[dict]:
    rows = []
    for name, r, c in CLASSES:
        rows_s, cols_s = max(1, r // scale), max(1, c // scale)
        x = torch.randn(rows_s, cols_s, generator=torch.Generator().manual_seed(0))
        for dtype in dtypes:
            xd = x.to(device=device, dtype=dtype)
            variants = {"standard": lambda m: newton_schulz(m, 5, "quintic"),
                        "gram": lambda m: gram_newton_schulz(m, 5, "quintic")}
            if dtype == torch.bfloat16:
                variants["gram_fp16"] = lambda m: gram_newton_schulz(m, 5, "quintic", gram_dtype=torch.float16)
            want = newton_schulz(xd.double(), 5, "quintic")
            ms = {k: _timed(fn, xd, repeats) * 1e3 for k, fn in variants.items()}
            error = {k: _rel_error(fn(xd), want) for k, fn in variants.items()}
            rows.append(dict(shape_class=name, shape=(rows_s, cols_s), dtype=str(dtype).removeprefix("torch."),
                             standard_ms=ms["standard"], gram_ms=ms["gram"], gram_fp16_ms=ms.get("gram_fp16"),
                             ratio=ms["gram"] / ms["standard"], error=error,
                             flop_ratio=gram_ns_flops(rows_s, cols_s) / ns_flops(rows_s, cols_s)))
    return rows


ASPECTS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5)
"""long side ÷ short side of the sweep that places ``GRAM_MIN_ASPECT``."""


def sweep(short: int, repeats: int, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """gram ÷ standard time by aspect at a fixed short side: where the Gram iteration starts to pay."""
    out = []
    for aspect in ASPECTS:
        long = int(round(short * aspect))
        x = torch.randn(short, long, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
        standard = _timed(lambda m: newton_schulz(m, 5, "quintic"), x, repeats)
        gram = _timed(lambda m: gram_newton_schulz(m, 5, "quintic"), x, repeats)
        out.append(dict(aspect=aspect, shape=(short, long), ratio=gram / standard,
                        flop_ratio=gram_ns_flops(short, long) / ns_flops(short, long)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="divide each class's dims by this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    parser.add_argument("--sweep-short", type=int, default=256,
                        help="short side of the aspect sweep (fp32; 0: no sweep)")
    args = parser.parse_args()
    if args.scale < 1 or args.repeats < 1:
        parser.error("--scale and --repeats must be >= 1")
    dtypes = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            parser.error(f"--dtypes: {name!r} is not a floating-point torch dtype")
        dtypes.append(dtype)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"Newton-Schulz, 5 quintic steps, one process on {device} ({torch.get_num_threads()} threads), "
          f"shapes / {args.scale}, median of {args.repeats}\n")
    print("| shape class | shape | dtype | standard ms | gram ms | gram ÷ standard | FLOP ratio | "
          "gram, fp16 products, ms | rel. error: standard / gram / gram fp16 products |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for row in run(args.scale, args.repeats, dtypes, device):
        fp16 = "—" if row["gram_fp16_ms"] is None else f"{row['gram_fp16_ms']:.1f}"
        errors = " / ".join(f"{e:.2e}" for e in row["error"].values())
        print(f"| {row['shape_class']} | {row['shape'][0]} x {row['shape'][1]} | {row['dtype']} | "
              f"{row['standard_ms']:.1f} | {row['gram_ms']:.1f} | {row['ratio']:.2f} | {row['flop_ratio']:.2f} | "
              f"{fp16} | {errors} |")
    if args.sweep_short:
        print(f"\nAspect sweep, float32, short side {args.sweep_short}: gram ÷ standard time (FLOP ratio)\n")
        rows = sweep(args.sweep_short, args.repeats, torch.float32, device)
        print("| aspect | " + " | ".join(f"{r['aspect']:g}" for r in rows) + " |")
        print("|---|" + "---:|" * len(rows))
        print("| time | " + " | ".join(f"{r['ratio']:.2f}" for r in rows) + " |")
        print("| FLOPs | " + " | ".join(f"{r['flop_ratio']:.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
