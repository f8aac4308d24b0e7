"""Megatron's DDP overlap on this CPU: a real training iteration at DP4, many buckets against one.

    python -m scripts.bench.ddp_overlap
    python -m scripts.bench.ddp_overlap --iters 12 --json out.json

Four gloo ranks (``launch``: one thread each on this machine's cores) train a scaled Llama-3-8B
(``optimizer_step_setup.build_gpt``: megatron-core's GPTModel, fp32, hidden 4096 / ``--scale``)
with Megatron's own pieces: its DDP (``--overlap-grad-reduce --overlap-param-gather``, the
distributed optimizer, fp32 grad reduction), its schedule (``get_forward_backward_func``, ``no_sync``
before the last micro-batch, ``finalize_model_grads``) and its Adam distributed optimizer, so the
only difference between the rows is the bucketing: megatron-core's rule at a bucket size that cuts
this model into about ``--buckets`` buckets (its 40M default would hold the whole model in one),
one bucket, and, as the floor, no overlap at all (one bucket, both flags off). gloo runs each
async collective on its process group's own worker thread, so a reduce-scatter can run while the
backward continues, and an all-gather while the forward does.

An iteration's time is the slowest rank's (barrier, start, zero the grads, forward/backward of
``--micro-batches`` micro-batches, ``optimizer.step()``, stop, max over ranks); the rows take turns
iteration by iteration (warm-up first); the table has the median of ``--iters``. Beside it,
``plan.iteration``'s prediction for the same buckets (read from each row's DDP) on the 4-process CPU
profile (``docs/perf-results/hardware-4proc.json``, ``calibrate_hardware --nproc 4``), with Adam's
step from the cost model. The model assumes the link and the compute do not slow each other; on
two cores shared by four ranks and gloo's threads they do, which is what the rows measure.
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
from megatron_muon.plan.cost_model import collective_time
from megatron_muon.plan.hardware import Hardware
from megatron_muon.plan.iteration import Bucket, IterationSettings, Stage, attention_flops, iteration_time, linear_flops
from megatron_muon.plan.step_cost import optimizer_step_cost

from . import optimizer_step_setup as setup
from .launch import launch

REPO = Path(__file__).resolve().parents[2]
CPU_PROFILE = REPO / "docs" / "perf-results" / "hardware-4proc.json"
WORLD = 4
SEQ = 64  # build_gpt's max_sequence_length
ROWS = ("megatron-core buckets, overlapped", "one bucket, overlapped", "one bucket, no overlap")


def _shape(args) -> ModelShape:
    return setup.scaled_llama3_8b(args.scale, args.layers, args.vocab)


def _build(shape: ModelShape, bucket_size: int | None, overlap: bool, device):
    """(DDP, Adam distributed optimizer) as ``get_model`` / ``get_megatron_optimizer`` build them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, config = setup.build_gpt(shape, 1, device)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap, use_distributed_optimizer=True,
                                               bucket_size=bucket_size)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=setup.LR, weight_decay=setup.WEIGHT_DECAY,
                                                       use_distributed_optimizer=True, clip_grad=1.0, bf16=False),
                                       [ddp])
    if overlap:  # megatron.training hands the schedule no_sync only with --overlap-grad-reduce
        config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def _buckets(ddp) -> list[dict]:
    """Each bucket of the DDP: its numel (padded) and its params (name, numel, ndim)."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    return [dict(numel=b.grad_data.numel(), grad_bytes=b.grad_data.element_size(),
                 param_bytes=b.param_data.element_size(),
                 params=[(names[p], p.numel(), p.dim()) for p in b.params_list])
            for group in ddp.bucket_groups for b in group.buckets]


def _iteration(ddp, optimizer, batches: list[dict]) -> None:
    """One iteration as ``train_step`` runs it: zero the grads, forward/backward over the
    micro-batches (Megatron's schedule, which reduces the grads), the optimizer step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp.config.finalize_model_grads_func = finalize_model_grads

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
        return out, lambda output: (output.float().mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                num_microbatches=len(batches), seq_length=SEQ,
                                micro_batch_size=batches[0]["tokens"].shape[0], forward_only=False)
    optimizer.step()


def _timed(ddp, optimizer, batches) -> float:
    dist.barrier()
    started = time.perf_counter()
    _iteration(ddp, optimizer, batches)
    slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def rank_main(rank: int, world: int, device, args) -> dict:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        shape = _shape(args)
        total = sum(p.numel() for p in setup.build_gpt(shape, 1, device)[0].parameters())
        sizes = (max(1, total // args.buckets), None, None)
        rows = [_build(shape, size, overlap, device) for size, overlap in zip(sizes, (True, True, False))]
        gen = torch.Generator().manual_seed(setup.SEED + rank)

        def batch() -> dict:
            tokens = torch.randint(0, shape.vocab, (args.micro_batch, SEQ + 1), generator=gen)
            return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                        position_ids=torch.arange(SEQ).expand(args.micro_batch, SEQ))

        batches = [batch() for _ in range(args.micro_batches)]
        times: list[list[float]] = [[] for _ in rows]
        for i in range(args.warmup + args.iters):
            for k, (ddp, optimizer) in enumerate(rows):
                seconds = _timed(ddp, optimizer, batches)
                if i >= args.warmup:
                    times[k].append(seconds)
        for ddp, _ in rows:  # the last step's param all-gather, which the next forward would start
            if ddp.ddp_config.overlap_param_gather:
                ddp.disable_forward_pre_hook(param_sync=True)
        return dict(times=times, buckets=[_buckets(ddp) for ddp, _ in rows], params=total)
    finally:
        ps.destroy_model_parallel()


def predicted(shape: ModelShape, buckets: list[dict], overlap: bool, args, hw: Hardware) -> dict:
    """``plan.iteration`` on this row's real buckets and the CPU profile."""
    tokens = args.micro_batch * SEQ
    stage_buckets = []
    for b in buckets:
        forward = sum(linear_flops(n, tokens) for name, n, ndim in b["params"] if ndim >= 2 and "embedding" not in name)
        forward += sum(attention_flops(SEQ, args.micro_batch, shape.num_heads, shape.head_dim, 1)
                       for name, _, _ in b["params"] if name.endswith("linear_qkv.weight"))
        stage_buckets.append(Bucket(b["numel"], forward, 2 * forward))
    adam = optimizer_step_cost(shape, optimizer="adam", tp=1, dp=WORLD, hw=hw, param_bytes=buckets[0]["param_bytes"])
    # Megatron's param all-gather out of the step (plan.iteration prices it from the buckets)
    step = adam.total_s - collective_time("all_gather", adam.param_gather_bytes, 1, WORLD, hw,
                                          WORLD > hw.ranks_per_node)
    stage = Stage(tuple(stage_buckets), step, buckets[0]["grad_bytes"], buckets[0]["param_bytes"])
    settings = IterationSettings(args.micro_batches, WORLD, WORLD > hw.ranks_per_node, overlap_grad_reduce=overlap,
                                 overlap_param_gather=overlap)
    it = iteration_time([stage], settings, hw)
    return dict(iteration_s=it.iteration_s, exposed_ddp_s=it.exposed_ddp_s, compute_s=it.compute_s,
                exposed_step_s=it.exposed_step_s, reduce_scatter_s=it.stages[0].reduce_scatter_s,
                all_gather_s=it.stages[0].all_gather_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=16, help="Llama-3-8B's hidden and ffn divided by this")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences of 64 tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    parser.add_argument("--buckets", type=int, default=16,
                        help="the first row's bucket size: the model's params / this (megatron-core's rule)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per row first")
    parser.add_argument("--hardware", type=Path, default=CPU_PROFILE, help="the CPU profile the model predicts on")
    parser.add_argument("--timeout", type=float, default=170.0, help="seconds to wait for the ranks")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if min(args.scale, args.layers, args.vocab, args.micro_batch, args.micro_batches, args.buckets, args.iters) < 1:
        parser.error("--scale, --layers, --vocab, --micro-batch, --micro-batches, --buckets and --iters must be >= 1")
    hw = Hardware(**json.loads(args.hardware.read_text()))
    wall = time.perf_counter()
    try:
        per_rank = launch(WORLD, rank_main, args, timeout=args.timeout, tag="ddp-overlap", backend="gloo")
    except RuntimeError as err:
        raise SystemExit(f"error: {err}") from None
    shape = _shape(args)
    first = per_rank[0]
    rows = []
    for k, label in enumerate(ROWS):
        rows.append(dict(label=label, buckets=len(first["buckets"][k]), times_s=first["times"][k],
                         measured_s=statistics.median(first["times"][k]),  # already the slowest rank's
                         predicted=predicted(shape, first["buckets"][k], k < 2, args, hw)))
    # The profile's GEMM rate is Newton-Schulz's (square GEMMs); the layers' small GEMMs, softmax and
    # elementwise passes run slower. The no-overlap row exposes everything, so its measured time less
    # the predicted step and DDP time is the compute: at that rate the overlapped rows are predicted
    # again, which tests the overlap term alone.
    floor = rows[2]["predicted"]
    compute = rows[2]["measured_s"] - (floor["iteration_s"] - floor["compute_s"])
    rate = hw.matmul_flops * floor["compute_s"] / compute if compute > 0 else hw.matmul_flops
    for k, r in enumerate(rows):
        r["predicted_at_measured_compute"] = predicted(shape, first["buckets"][k], k < 2, args,
                                                       dataclasses.replace(hw, matmul_flops=rate))
    print(f"DDP overlap on this CPU: {shape.name} ({first['params'] / 1e6:.2f}M params, fp32), DP{WORLD} on gloo, "
          f"{args.micro_batches} micro-batches of {args.micro_batch} x {SEQ} tokens, Adam distributed optimizer; "
          f"iteration ms, slowest rank, median of {args.iters} (rows interleaved, {args.warmup} warm-up); predicted "
          f"on {hw.name}, and with the compute the no-overlap row measures ({rate / 1e9:.1f} GFLOP/s against the "
          f"profile's {hw.matmul_flops / 1e9:.1f})\n")
    print("| row | buckets | measured ms | predicted ms (profile) | predicted ms (measured compute) "
          "| predicted exposed DDP ms | RS / AG on the link ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p, q = r["predicted"], r["predicted_at_measured_compute"]
        print(f"| {r['label']} | {r['buckets']} | {1e3 * r['measured_s']:.1f} | {1e3 * p['iteration_s']:.1f} | "
              f"{1e3 * q['iteration_s']:.1f} | {1e3 * q['exposed_ddp_s']:.1f} | "
              f"{1e3 * p['reduce_scatter_s']:.1f} / {1e3 * p['all_gather_s']:.1f} |")
    many, one = rows[0], rows[1]
    gain = lambda key: 1e3 * (one[key]["iteration_s"] - many[key]["iteration_s"])  # noqa: E731
    spread = 1e3 * (max(many["times_s"]) - min(many["times_s"]))
    print(f"\none bucket − megatron-core's buckets: measured {1e3 * (one['measured_s'] - many['measured_s']):+.1f} ms "
          f"(the first row's iterations spread over {spread:.1f} ms), predicted {gain('predicted'):+.1f} ms "
          f"(profile), {gain('predicted_at_measured_compute'):+.1f} ms (measured compute)")
    print(f"wall time (start-up included): {time.perf_counter() - wall:.1f}s; command: "
          + " ".join(["python -m scripts.bench.ddp_overlap", *sys.argv[1:]]))
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, hardware=hw.name), indent=1) + "\n")


if __name__ == "__main__":
    main()
