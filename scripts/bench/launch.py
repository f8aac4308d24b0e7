"""Start N fresh ranks for a benchmark script and collect one result from each.

The one launcher of ``bench_tp_modes.py``, ``bench_optimizer_step.py`` and
``calibrate_hardware.py``: a ``file://`` rendezvous in a temp dir (no port is ever fixed), NCCL
with one GPU per rank when that many are visible, otherwise gloo on the CPU with the cores split
evenly between the ranks (at least one thread each, so the ranks contend as a real job does).

A rank's exception comes back to the parent with its traceback; a rank that dies without a
report, or a run past ``timeout``, raises instead of hanging; the other ranks, possibly stuck in
a collective, are killed.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["backend_for", "launch"]


def backend_for(world: int) -> str:
    """``nccl`` when ``world`` GPUs are visible, else ``gloo``."""
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return "nccl" if gpus and dist.is_nccl_available() else "gloo"


def launch(world: int, body, *args, timeout: float = 600.0, tag: str = "bench", backend: str | None = None) -> list:
    """Run ``body(rank, world, device, *args)`` on ``world`` spawned ranks; results by rank.

    ``body`` must be a module-level function (spawn pickles it by name); the default process
    group is up while it runs and is destroyed after it. ``backend``: None = ``backend_for(world)``
    (NCCL with a GPU per rank, gloo on the CPU otherwise); ``gloo`` forces the CPU.
    """
    backend = backend or backend_for(world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=f"{tag}-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(r, world, init_file, backend, body, args, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        collected, deadline = {}, time.monotonic() + timeout
        try:
            while len(collected) < world:
                try:
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    crashed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                    if crashed:
                        raise RuntimeError(f"ranks died without a report (rank: exit code): {crashed}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no result from ranks {sorted(set(range(world)) - set(collected))} "
                                           f"after {timeout:.0f}s") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                collected[rank] = payload
        finally:
            for p in procs:  # after a failure the others may sit in a collective forever
                p.join(timeout=5 if len(collected) == world else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [collected[r] for r in range(world)]


def _child(rank, world, init_file, backend, body, args, results) -> None:
    # Megatron warns on import that Transformer Engine / Apex are absent; irrelevant here.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            # The ranks share the host's cores; more threads than that only adds contention.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                **({"device_id": device} if backend == "nccl" else {}))
        try:
            result = body(rank, world, device, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the parent reports it; a silent child would hang it
        results.put((rank, False, traceback.format_exc()))
