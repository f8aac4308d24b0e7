"""Run a function in N gloo processes and bring back what each rank returns.

``run_world(world_size, fn, *args)`` spawns ``world_size`` fresh processes, initializes a gloo
group through a file:// rendezvous in a private temp dir (never a fixed port, so parallel test
runs cannot collide), calls ``fn(rank, world_size, *args)`` in each and returns the per-rank
results in rank order. A child's exception is re-raised in the parent with the child's
traceback; a child that hangs or dies is reported with its rank instead of hanging pytest.

``fn`` must be importable by name (a module-level function in a test module or here), and the
results must pickle. Test modules call it once per world size from a module-scoped fixture and
run many checks on the results, so process start-up is paid once per module and world size.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["ChildError", "run_world"]


class ChildError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _child(rank, world_size, init_file, fn, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores; oversubscription only adds noise
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Tensors are serialized to plain bytes: torch's queue would share their storage
        # through file descriptors that die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_world(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mm-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            # Not daemonic: a rank may start children of its own (dist_checkpointing's torch_dist
            # writer runs a multiprocessing Manager). The finally below ends every rank.
            ctx.Process(target=_child, args=(r, world_size, init_file, fn, args, results), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, object] = {}
        errors: list[str] = []
        try:
            while len(collected) + len(errors) < world_size:
                # Once a rank has failed, its peers fail soon after (a closed connection);
                # wait briefly for their reports, since the first one is not always the cause.
                wait = timeout if not errors else 10.0
                try:
                    rank, ok, payload = results.get(timeout=wait)
                except queue.Empty:
                    if errors:
                        break
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                    raise ChildError(
                        f"run_world({world_size}, {fn.__name__}): no result after {timeout:.0f}s; "
                        f"ranks that exited without reporting: {dead}"
                    ) from None
                if ok:
                    collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise ChildError(f"run_world({world_size}, {fn.__name__}) failed:\n" + "\n".join(errors))
        return [collected[r] for r in range(world_size)]
