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

``--gradients`` adds the same errors on real gradients: a one-layer Llama-3-8B-shaped GPT scaled
down by 16 (Megatron's ``GPTModel``, one gloo process on the CPU), one forward and backward on
random tokens, each weight's gradient per sub-matrix as the optimizer splits it (QKV's q, k, v;
fc1's gate and up), in fp32, bf16 and fp16, with the range of the result's singular values.
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


def _gradients_body(rank: int, world: int, device: torch.device) -> dict:
    """The tiny GPT's gradient sub-matrices (fp32 numpy arrays: they cross the process boundary
    by value), by name (spawned by ``launch``)."""
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.cpu_patches import apply_cpu_patches
    from scripts.bench import optimizer_step_setup as setup

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        shape = setup.scaled_llama3_8b(16, 1, 512)
        model, _ = setup.build_gpt(shape, 1, torch.device("cpu"))
        tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(64).expand(4, 64)
        mask = torch.tril(torch.ones(64, 64, dtype=torch.bool)).logical_not()[None, None]
        model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).float().mean().backward()
        layer = model.decoder.layers[0]
        q = shape.num_heads // shape.num_query_groups * shape.head_dim
        qkv = layer.self_attention.linear_qkv.weight.grad.view(shape.num_query_groups, q + 2 * shape.head_dim, -1)
        fc1 = layer.mlp.linear_fc1.weight.grad
        subs = {"q": qkv[:, :q].reshape(-1, shape.hidden), "k": qkv[:, q:q + shape.head_dim].reshape(-1, shape.hidden),
                "proj": layer.self_attention.linear_proj.weight.grad, "gate": fc1[: fc1.shape[0] // 2],
                "up": fc1[fc1.shape[0] // 2:], "fc2": layer.mlp.linear_fc2.weight.grad}
        return {name: g.detach().contiguous().numpy().copy() for name, g in subs.items()}
    finally:
        ps.destroy_model_parallel()


def gradient_accuracy() -> list[dict]:
    """Per gradient sub-matrix and dtype: relative error of standard, Gram and (half precision)
    Gram-with-fp16-products NS against float64 standard NS of the same rounded input, and the
    spread (min, max) of the Gram result's singular values."""
    from scripts.bench.launch import launch

    grads = launch(1, _gradients_body, tag="ns-gradients", backend="gloo")[0]
    rows = []
    for name, array in grads.items():
        g = torch.from_numpy(array)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = g.to(dtype)
            want = newton_schulz(x.double(), 5, "quintic")
            gram = gram_newton_schulz(x, 5, "quintic")
            sv = torch.linalg.svdvals(gram.double())
            rows.append(dict(matrix=name, shape=tuple(g.shape), dtype=str(dtype).removeprefix("torch."),
                             standard=_rel_error(newton_schulz(x, 5, "quintic"), want),
                             gram=_rel_error(gram, want),
                             gram_fp16=_rel_error(gram_newton_schulz(x, 5, "quintic", gram_dtype=torch.float16), want)
                             if dtype == torch.bfloat16 else None,
                             sigma=(sv.min().item(), sv.max().item())))
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
    parser.add_argument("--gradients", action="store_true",
                        help="also the errors on a tiny GPT's gradients (module docstring)")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed shape classes")
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
    if args.gradients:
        print("Accuracy on a tiny GPT's gradients (Llama-3-8B shapes / 16, one layer, one backward on random "
              "tokens): relative error against float64 standard NS of the same rounded input\n")
        print("| matrix | shape | dtype | standard | gram | gram, fp16 products | gram ÷ standard | "
              "singular values of the gram result |")
        print("|---|---|---|---:|---:|---:|---:|---|")
        for r in gradient_accuracy():
            fp16 = "—" if r["gram_fp16"] is None else f"{r['gram_fp16']:.2e}"
            print(f"| {r['matrix']} | {r['shape'][0]} x {r['shape'][1]} | {r['dtype']} | {r['standard']:.2e} | "
                  f"{r['gram']:.2e} | {fp16} | {r['gram'] / r['standard']:.2f} | "
                  f"{r['sigma'][0]:.3f} – {r['sigma'][1]:.3f} |")
        print()
    if args.no_timing:
        return
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
