"""Measure the cost model's hardware constants on this machine, with micro-benchmarks only.

    python -m scripts.bench.calibrate_hardware --nproc 2 --out bench-results/hardware-2proc.json
    python -m scripts.bench.calibrate_hardware --nproc 4 --out bench-results/hardware-4proc.json

Starts ``--nproc`` processes with the benchmarks' own launcher (``scripts/bench/launch.py``: gloo on
the CPU with cores // nproc threads per process, at least one; or NCCL with one GPU per rank),
so every constant is measured under the same contention as the steps it will predict. All
ranks run every probe at once; a probe's time is the slowest rank's, and each constant is the
median over ``--repeats``. Nothing here runs an optimizer or Newton–Schulz: the constants are
calibrated on separate kernels and then used, unchanged, to predict the benchmark's rows
(``scripts/bench/validate_cost_model.py``).

Every compute probe runs for tens of milliseconds per call, so that the ranks really overlap
(on a shared host they contend for the cores as they do during a step; a probe of a few
milliseconds would let them take turns and overstate the per-rank rate).

Probes (fp32 on the CPU, the NS dtype the benchmark uses there; bf16 on GPUs):
    matmul_flops          batched square GEMMs of sizes 128, 256 and 512 (what NS multiplies at
                          the benchmark's scale), batches of 4 repeated to ~4 GFLOP per call;
                          the geometric mean of the three rates
    kernel_overhead_s     an in-place add on a 16-element tensor (dispatch cost, no data)
    memory_bandwidth      ``c = a + b`` on 8 MiB tensors, 64 times per call (3 × 8 MiB touched per
                          add), each result dropped at the next add, as a step drops its
                          temporaries, so the allocator hands the freed memory back (8 MiB: past a
                          core's L2, under glibc's 32 MiB mmap ceiling). Until 2026-12-07 the probe
                          kept all its results alive (32 MiB each), so every add wrote fresh pages
                          and paid their faults: one process on the 2-core machine, 12 GB/s kept
                          against 27 dropped at 8 MiB; 3.4-4.4 GB/s per rank at 2 processes in the
                          recorded calibrations, a rate none of the benchmark's tensors (at most
                          1 MiB) pays
    collective_latency_s  a 4-byte all-reduce, each called right after a GEMM on every rank, as a
                          step calls its collectives (20 such pairs, less the 20 GEMMs alone):
                          what a call costs where it follows compute. On the 2-core machine that
                          is up to 0.2 ms more than the same calls back to back (2026-12-07:
                          0.28-0.35 → 0.31-0.51 ms), as the ranks reach it at different times
                          and gloo's threads wake; a step never calls its collectives back to back
                          (the same calls back to back are kept beside, ``back_to_back``: what
                          the benchmark's host floor, a step with next to no compute, pays)
    all_reduce_step_s     a 256 KiB all-reduce (a 256 × 256 fp32 Gram: what the distributed mode
                          all-reduces at the benchmark's scale), each after a GEMM as above, less
                          its bytes at the all-reduce rate below, over its 2(nproc − 1) ring
                          steps: gloo's ring takes that many dependent steps per call, so a
                          payload's fixed cost is several scalar latencies, and grows with the
                          group
    solo_gather_bandwidth an in-place all-gather of 8 MiB over a group of one rank (each rank its
                          own, all at once), 8 per call: Megatron's param all-gather at DP 1,
                          which its distributed optimizer still calls and gloo runs as a copy
    bandwidths            all-gather, all-reduce and all-to-all of 1 MiB and 8 MiB per rank:
                          the extra bytes sent (``megatron_muon/parallel/comm.py``'s convention) over the
                          extra time; the all-gather rate is the bandwidth, the others are its
                          efficiencies
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_muon.plan.hardware import Hardware

from .launch import backend_for, launch

GEMM_SIZES = (128, 256, 512)
GEMM_TARGET_FLOPS = 4e9  # per timed call: tens of ms, so that concurrent ranks overlap
GEMM_BATCH = 4  # matrices per bmm
MEMORY_ELEMENTS = 2 * 2**20  # 8 MiB in fp32: past L2, under glibc's mmap ceiling (docstring)
MEMORY_PASSES = 64  # adds per timed call: tens of ms, so that concurrent ranks overlap
COLLECTIVE_ELEMENTS = (2**18, 2**21)  # 1 MiB and 8 MiB in fp32
LATENCY_CALLS = 20  # (GEMM, collective) pairs per timed call of the latency probes
GRAM_ELEMENTS = 2**16  # 256 KiB in fp32: the benchmark's 256 x 256 Grams
SOLO_CALLS = 8  # one-rank all-gathers of MEMORY_ELEMENTS per timed call: tens of ms on gloo


def _timed(fn, device, repeats: int) -> float:
    """Median over repeats of the slowest rank's seconds for one ``fn()``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: first-touch pages, cuBLAS heuristics, gloo connections
    samples = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed))
    return statistics.median(samples)


def measure(rank: int, nproc: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Every probe on every rank at once; returns the constants (identical on all ranks)."""
    return compute_probes(device, dtype, repeats) | collective_probes(nproc, device, dtype, repeats)


def compute_probes(device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """The per-rank compute constants (GEMM rate, kernel overhead, memory bandwidth), every rank
    at once."""
    rates = []
    for n in GEMM_SIZES:
        # a small batch (as NS batches a few same-shape matrices) repeated up to the FLOP target,
        # so the operands stay cache-sized as in a step, yet the call lasts long enough to overlap
        a = torch.randn(GEMM_BATCH, n, n, device=device, dtype=dtype)
        b = torch.randn(GEMM_BATCH, n, n, device=device, dtype=dtype)
        calls = max(1, round(GEMM_TARGET_FLOPS / (2 * GEMM_BATCH * n**3)))
        seconds = _timed(lambda: [torch.bmm(a, b) for _ in range(calls)], device, repeats)
        rates.append(2 * GEMM_BATCH * n**3 * calls / seconds)
    matmul_flops = math.exp(sum(math.log(r) for r in rates) / len(rates))

    tiny = torch.zeros(16, device=device, dtype=torch.float32)
    calls = 200
    overhead = _timed(lambda: [tiny.add_(1.0) for _ in range(calls)], device, repeats) / calls

    x = torch.ones(MEMORY_ELEMENTS, device=device)
    y = torch.ones(MEMORY_ELEMENTS, device=device)

    def adds():
        for _ in range(MEMORY_PASSES):
            _ = x + y  # dropped at the next add, as a step drops its temporaries

    memory_bandwidth = MEMORY_PASSES * 3 * x.numel() * 4 / _timed(adds, device, repeats)
    return dict(matmul_flops=matmul_flops, gemm_rates={str(n): r for n, r in zip(GEMM_SIZES, rates)},
                kernel_overhead_s=overhead, memory_bandwidth=memory_bandwidth)


def collective_probes(nproc: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """The collective constants over the default group of ``nproc`` ranks (``dtype``: the GEMMs'
    that the latencies are measured after)."""
    scalar = torch.zeros(1, device=device)
    # back to back: what a step on a model too small for its compute to count pays (the host
    # floor's, which validate_cost_model prices on these), and the least a call after a GEMM
    # costs (the same call, plus the wait for the ranks' skew): the floor of the after-GEMM
    # figures, which are a difference of two noisy times
    alone = _timed(lambda: [dist.all_reduce(scalar) for _ in range(LATENCY_CALLS)], device, repeats) / LATENCY_CALLS
    latency = max(_after_gemms(lambda: dist.all_reduce(scalar), device, dtype, repeats), alone)

    # Bandwidth from the slope between two payload sizes, so the latency (jittery when ranks
    # share cores) cancels instead of being subtracted.
    seconds, sent = {}, {}
    for size in COLLECTIVE_ELEMENTS:
        payload = torch.ones(size, device=device)
        nbytes = payload.numel() * 4
        gathered = [torch.empty_like(payload) for _ in range(nproc)]
        exchanged = torch.empty_like(payload)
        sent[size] = {  # bytes this rank sends, comm.py's convention
            "all_gather": nbytes * (nproc - 1),
            "all_reduce": 2 * (nproc - 1) * nbytes / nproc,
            "all_to_all": nbytes * (nproc - 1) / nproc,
        }
        seconds[size] = {
            "all_gather": _timed(lambda: dist.all_gather(gathered, payload), device, repeats),
            "all_reduce": _timed(lambda: dist.all_reduce(payload), device, repeats),
            "all_to_all": _timed(lambda: dist.all_to_all_single(exchanged, payload), device, repeats),
        }
    small, large = COLLECTIVE_ELEMENTS
    rate = {k: (sent[large][k] - sent[small][k]) / max(seconds[large][k] - seconds[small][k], 1e-9)
            for k in sent[large]}
    seconds = seconds[large]
    gram = torch.ones(GRAM_ELEMENTS, device=device)
    gram_alone = _timed(lambda: [dist.all_reduce(gram) for _ in range(LATENCY_CALLS)], device, repeats) / LATENCY_CALLS
    gram_s = max(_after_gemms(lambda: dist.all_reduce(gram), device, dtype, repeats), gram_alone)
    ring_bytes_s = 2 * (nproc - 1) * gram.numel() * 4 / nproc / rate["all_reduce"]
    fixed = max(gram_s - ring_bytes_s, latency)
    back_to_back = dict(collective_latency_s=alone,
                        all_reduce_step_s=max(gram_alone - ring_bytes_s, alone) / (2 * (nproc - 1)))
    solo, own = _solo_group(nproc), torch.ones(MEMORY_ELEMENTS, device=device)
    solo_s = _timed(lambda: [dist.all_gather_into_tensor(own, own, group=solo) for _ in range(SOLO_CALLS)],
                    device, repeats) / SOLO_CALLS
    return dict(all_reduce_step_s=fixed / (2 * (nproc - 1)), collective_latency_s=latency,
                collective_seconds=seconds, collective_rates=rate, back_to_back=back_to_back,
                solo_gather_bandwidth=own.numel() * own.element_size() / solo_s)


def _after_gemms(collective, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Seconds of one ``collective()`` called right after a GEMM on every rank: ``LATENCY_CALLS``
    (GEMM, collective) pairs less as many GEMMs alone (a batch of 4 of the middle GEMM size: NS at
    the benchmark's scale), never below zero (the caller floors it at the call back to back)."""
    n = GEMM_SIZES[1]
    a = torch.randn(GEMM_BATCH, n, n, device=device, dtype=dtype)

    def gemms(with_collective: bool) -> None:
        for _ in range(LATENCY_CALLS):
            torch.bmm(a, a)
            if with_collective:
                collective()

    both, alone = (_timed(lambda c=c: gemms(c), device, repeats) for c in (True, False))
    return max(0.0, both - alone) / LATENCY_CALLS


@functools.cache
def _solo_group(nproc: int):
    """This rank's group of one (every rank makes all ``nproc`` of them, in rank order, the first
    time the probes run: ``new_group`` is collective over the default group)."""
    groups = [dist.new_group([r]) for r in range(nproc)]
    return groups[dist.get_rank()]


def median_probes(results: list[dict]) -> dict:
    """Several probe results, field by field (nested dicts alike): the median."""
    first = results[0]
    return {k: median_probes([r[k] for r in results]) if isinstance(v, dict)
            else statistics.median(r[k] for r in results) for k, v in first.items()}


def hardware_from_probes(raw: dict, nproc: int, backend: str, command: str) -> Hardware:
    """The ``Hardware`` record of one ``measure`` result on ``nproc`` ranks (every rank's is the
    same); ``command`` says what ran the probes, for the record's ``source``."""
    gather_rate = raw["collective_rates"]["all_gather"]
    device = torch.cuda.get_device_name(0) if backend == "nccl" else f"cpu ({os.cpu_count()} cores)"
    return Hardware(
        name=f"{'gpu' if backend == 'nccl' else 'cpu'}-{backend}-{nproc}proc",
        source=f"{command} on {device}, {datetime.date.today().isoformat()}",
        matmul_flops=raw["matmul_flops"],
        memory_bandwidth=raw["memory_bandwidth"],
        intra_node_bandwidth=gather_rate,
        inter_node_bandwidth=gather_rate,  # one host: there is no second level
        collective_latency_s=raw["collective_latency_s"],
        all_reduce_step_s=raw["all_reduce_step_s"],
        kernel_overhead_s=raw["kernel_overhead_s"],
        ranks_per_node=nproc,
        all_gather_efficiency=1.0,
        all_reduce_efficiency=raw["collective_rates"]["all_reduce"] / gather_rate,
        all_to_all_efficiency=raw["collective_rates"]["all_to_all"] / gather_rate,
        solo_gather_bandwidth=raw["solo_gather_bandwidth"],
        fused_adam=backend == "nccl",  # Megatron's Adam on GPUs is TE's / apex's; on gloo, torch's
    )


def rank_main(rank: int, nproc: int, device: torch.device, repeats: int) -> dict:
    """One rank (started by ``_launch.launch``, the benchmarks' launcher and thread policy)."""
    return measure(rank, nproc, device, torch.bfloat16 if device.type == "cuda" else torch.float32, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes, as in the benchmark layout")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True, help="JSON file with the Hardware fields")
    args = parser.parse_args()
    if args.nproc < 2:
        raise SystemExit("--nproc: expected >= 2 (the collectives need peers)")
    backend = backend_for(args.nproc)
    try:
        raw = launch(args.nproc, rank_main, args.repeats, tag="calibrate")[0]  # identical on every rank
    except RuntimeError as err:  # a rank's traceback is the useful part, not the parent's
        raise SystemExit(f"calibration failed: {err}") from None
    hw = hardware_from_probes(raw, args.nproc, backend, f"scripts/bench/calibrate_hardware.py --nproc {args.nproc}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dataclasses.asdict(hw), indent=2) + "\n")
    print("| constant | value |\n|---|---:|")
    print(f"| matmul FLOP/s (GEMM {', '.join(map(str, GEMM_SIZES))}) | "
          f"{hw.matmul_flops / 1e9:.1f} G ({', '.join(f'{r / 1e9:.1f}' for r in raw['gemm_rates'].values())}) |")
    print(f"| memory bandwidth | {hw.memory_bandwidth / 1e9:.2f} GB/s |")
    print(f"| kernel overhead | {hw.kernel_overhead_s * 1e6:.1f} µs |")
    print(f"| collective latency | {hw.collective_latency_s * 1e6:.1f} µs |")
    print(f"| all-gather over a group of one, in place (8 MiB) | {hw.solo_gather_bandwidth / 1e9:.2f} GB/s |")
    print(f"| all-reduce ring step with a payload (256 KiB over {2 * (args.nproc - 1)} steps) | "
          f"{hw.all_reduce_step_s * 1e6:.1f} µs |")
    for k, r in raw["collective_rates"].items():
        print(f"| {k} bandwidth (1 → 8 MiB) | {r / 1e9:.2f} GB/s "
              f"({raw['collective_seconds'][k] * 1e3:.2f} ms at 8 MiB) |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
