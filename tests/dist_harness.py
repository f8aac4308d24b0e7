"""Run a function in N gloo processes and bring back what each rank returns.

``run_world(world_size, fn, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size``
ranks of a fresh gloo group (file:// rendezvous in a private temp dir, never a fixed port, so
parallel test runs cannot collide) and returns the per-rank results in rank order. A rank's
exception is re-raised in the parent with that rank's traceback; a rank that hangs or dies is
reported with its rank instead of hanging pytest.

**One world per size per session.** The ranks are a pool of processes kept alive for the pytest
session, one pool per world size, each rank forked from multiprocessing's fork server, which
imports torch, megatron-core and megatron.training once (``PRELOAD``): a spawned rank paid those
imports itself, about 5-10 s a rank on 2 cores, so a world of 8 took about a minute to start.
Every job gets a new default group and its own rendezvous, so a job sees a world exactly as a
fresh one, with these invariants kept between jobs:
- the job runs in the submitting process's environment (``os.environ`` at ``run_world``), as a
  spawned rank would; afterwards the rank's own environment, ``sys.argv``, ``sys.excepthook``
  (which every ``init_process_group`` replaces), the default dtype and the thread count are put
  back, and the torch CPU generator is reset to the state the rank started with (every job of a
  pool draws the same unseeded values);
- a job that changed process-wide state the harness cannot put back (Megatron's global args,
  hooks installed into ``megatron.training``) retires its pool after it returns, and so does a
  rank whose thread count grew past ``MAX_THREADS``;
- a job that fails or hangs tears its pool down; the next call starts a fresh one, so a failure
  never leaks into the next test.
``fresh=True`` runs one call in processes of its own, forked from the same server.

The fork server never runs a job: it only imports, in one thread (a fork copies only the forking
thread). The CPU patches, applied by each job (``init_megatron``), retarget functions in place
(their ``__code__``) or module attributes looked up at call time, so it does not matter that the
modules were imported before them, as in ``scripts/pretrain_gpt.py``, whose ``megatron.training``
imports come before the patches too.

``fn`` must be importable by name (a module-level function in a test module or a harness), and
the results must pickle. Megatron's parallel state is the job's to build and tear down
(``megatron_harness.init_megatron`` / ``destroy_megatron``).
"""

from __future__ import annotations

import atexit
import io
import itertools
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["ChildError", "WorldsOnDemand", "run_world", "shutdown_pools"]

# A rank past this many threads after a job retires its pool: gloo keeps a few threads per live
# group, so a count this high means groups that outlived their job, and every later collective
# on the machine slows down (measured: a MoE world once reached about 1,150 threads per rank).
MAX_THREADS = 400
POLL_S = 1.0  # how often the parent looks for a dead rank while it waits for reports
DEAD_GRACE_S = 5.0  # a rank's report can still be in the queue's pipe when the rank has exited
PEER_WAIT_S = 10.0  # after one rank's failure, how long the parent waits for its peers' reports
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt",
           "megatron.core.distributed", "megatron.core.optimizer", "megatron.training",
           "megatron.training.training", "megatron_muon.megatron.optimizer"]
"""What the fork server imports before it forks any rank."""


HARNESS_MODULES = ("megatron_harness", "training_harness", "checkpoint_harness")


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, i.e. at the first rank
    return ctx


class ChildError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))  # native threads too (gloo's are not Python threads)
    except OSError:
        import threading

        return threading.active_count()


def _global_state() -> tuple:
    """What a job may change in this process that the worker cannot restore (Megatron's global args,
    the functions hooks replace, the harness modules' constants): compared before and after each
    job; a difference retires the pool after the job's results are returned."""
    from megatron_muon.megatron.hooks import HOOKED

    global_vars = sys.modules.get("megatron.training.global_vars")
    # parse_args too: the CLI tests replace it
    functions = tuple(id(getattr(sys.modules[module], name, None))
                      for module, name in (*HOOKED, ("megatron.training.arguments", "parse_args"))
                      if module in sys.modules)
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None
    # The harness modules' constants (the tiny GPT's sizes, the tolerances): a job that sets one
    # for its own runs would hand its model to the next job.
    constants = tuple((module, name, repr(value)) for module in HARNESS_MODULES if module in sys.modules
                      for name, value in sorted(vars(sys.modules[module]).items()) if name.isupper())
    return functions, id(args) if args is not None else None, constants


def _run_job(rank, world_size, init_file, fn, args):
    """One job on this rank: (ok, payload)."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Gloo's connectFullMesh can return on one rank while its peer still reads the handshake;
        # a rank that then tore its group down (a job without collectives) failed the peer's
        # init with "Connection closed by peer" (seen in about 1 of 8 short jobs). The barriers
        # hold every rank until all are connected, and again until all are done.
        dist.barrier()
        try:
            out = fn(rank, world_size, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        # Tensors are serialized to plain bytes: torch's queue would share their storage
        # through file descriptors that die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        return True, buf.getvalue()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        return False, traceback.format_exc()


def _worker(rank, world_size, jobs, results):
    """A pooled rank: runs jobs until it receives None."""
    import gc

    torch.set_num_threads(1)  # N ranks share 2 cores; oversubscription only adds noise
    rng, environ, argv, dtype = torch.get_rng_state(), dict(os.environ), list(sys.argv), torch.get_default_dtype()
    excepthook = sys.excepthook
    while (job := jobs.get()) is not None:
        job_id, init_file, path, job_env, payload = job
        # The parent's sys.path at submission: pytest adds each test directory as it collects,
        # after this rank started, and ``fn`` is imported by name from one of them.
        sys.path[:0] = [p for p in path if p not in sys.path]
        os.environ.clear()
        os.environ.update(job_env)
        try:
            fn, args = pickle.loads(payload)
        except BaseException:  # noqa: BLE001 - an fn this rank cannot import fails its job, not the rank
            results.put((job_id, rank, False, traceback.format_exc(), None))
            continue
        torch.set_rng_state(rng)  # unseeded draws give what a fresh process gives
        before = _global_state()
        ok, payload = _run_job(rank, world_size, init_file, fn, args)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv[:] = argv
        sys.excepthook = excepthook
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)
        gc.collect()
        # What survives a job is module state (imports, patches): frozen, so the gc.collect that
        # every Megatron teardown runs scans only the next job's objects (measured 0.34 s a call
        # on an unfrozen heap, 0.09 s frozen, per run of the tiny GPT).
        gc.freeze()
        retire = None
        if _global_state() != before:
            retire = f"{fn.__name__} changed process-wide state (Megatron's global args or hooks)"
        elif (threads := _thread_count()) > MAX_THREADS:
            retire = f"{threads} threads after {fn.__name__} (limit {MAX_THREADS})"
        results.put((job_id, rank, ok, payload, retire))


class _Pool:
    """``size`` pooled ranks and their queues."""

    def __init__(self, size: int):
        ctx = _context()
        self.size = size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(size)]
        # Not daemonic: a rank may start children of its own (dist_checkpointing's torch_dist
        # writer runs a multiprocessing Manager). close() ends every rank.
        self.procs = [ctx.Process(target=_worker, args=(r, size, self.jobs[r], self.results), daemon=False)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.jobs:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self.jobs, self.results):
            q.close()
            q.cancel_join_thread()


_POOLS: dict[int, _Pool] = {}
_JOB_IDS = itertools.count()


def shutdown_pools() -> None:
    """End every pooled rank (pytest's session end and interpreter exit call it)."""
    while _POOLS:
        _POOLS.popitem()[1].close(graceful=True)


atexit.register(shutdown_pools)  # before multiprocessing's own exit handler joins the ranks


def _collect(results, world_size: int, name: str, timeout: float, alive, job_id=None):
    """Wait for every rank's report; returns (results by rank, errors, retire reasons).

    A rank that dies (a segfault, the OOM killer) never reports: its death is noticed within
    ``DEAD_GRACE_S`` instead of after the whole ``timeout``."""
    collected: dict[int, object] = {}
    errors: list[str] = []
    retire: list[str] = []
    deadline = time.monotonic() + timeout
    first_error_at = dead_since = None
    while len(collected) + len(errors) < world_size:
        try:
            report = results.get(timeout=POLL_S)
        except queue.Empty:
            now = time.monotonic()
            # Once a rank has failed, its peers fail soon after (a closed connection); wait
            # briefly for their reports, since the first one is not always the cause.
            if first_error_at is not None and now - first_error_at > PEER_WAIT_S:
                break
            dead = [r for r in range(world_size) if not alive(r) and r not in collected]
            if dead:
                dead_since = dead_since or now
                if now - dead_since > DEAD_GRACE_S:
                    errors.append(f"run_world({world_size}, {name}): ranks {dead} exited without reporting")
                    break
            if now > deadline:
                errors.append(f"run_world({world_size}, {name}): no result after {timeout:.0f}s")
                break
            continue
        got_id, rank, ok, payload, reason = report
        if got_id != job_id:
            continue  # a late report of a job already given up on (its pool is gone)
        if reason:
            retire.append(f"rank {rank}: {reason}")
        if ok:
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            first_error_at = first_error_at or time.monotonic()
            errors.append(f"--- rank {rank} ---\n{payload}")
    return collected, errors, retire


def _job(job_id: int, init_file: str, fn, args) -> tuple:
    """What a rank receives: this process's sys.path and environment, and ``fn`` and ``args``
    pickled here, unpickled by the rank after it has taken the sys.path."""
    return job_id, init_file, list(sys.path), dict(os.environ), pickle.dumps((fn, args))


def _run_fresh(world_size: int, fn, args, timeout: float) -> list:
    ctx = _context()
    jobs = [ctx.Queue() for _ in range(world_size)]
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mm-rdzv-") as tmp:
        job = _job(0, os.path.join(tmp, "rendezvous"), fn, args)
        for q in jobs:
            q.put(job)
            q.put(None)
        procs = [ctx.Process(target=_worker, args=(r, world_size, jobs[r], results), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            collected, errors, _ = _collect(results, world_size, fn.__name__, timeout,
                                            lambda r: procs[r].is_alive(), job_id=0)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise ChildError(f"run_world({world_size}, {fn.__name__}) failed:\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]


def run_world(world_size: int, fn, *args, timeout: float = 600.0, fresh: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fresh``: in processes started for this call alone (a job that must see a clean interpreter).
    """
    if fresh:
        return _run_fresh(world_size, fn, args, timeout)
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    job_id = next(_JOB_IDS)
    with tempfile.TemporaryDirectory(prefix="mm-rdzv-") as tmp:
        job = _job(job_id, os.path.join(tmp, "rendezvous"), fn, args)
        for q in pool.jobs:
            q.put(job)
        try:
            collected, errors, retire = _collect(pool.results, world_size, fn.__name__, timeout,
                                                 lambda r: pool.procs[r].is_alive(), job_id=job_id)
        except BaseException:
            errors, retire = ["interrupted"], []
            raise
        finally:
            if errors or retire:
                # A failed job may leave Megatron state or a rank blocked in a collective: the
                # pool goes, and the next call starts a fresh one.
                del _POOLS[world_size]
                pool.close(graceful=not errors)
    if errors:
        raise ChildError(f"run_world({world_size}, {fn.__name__}) failed:\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]


class WorldsOnDemand(dict):
    """world size -> ``start(world size)``, computed on first lookup and kept: a module fixture that
    returns one trains only the worlds its selected tests read (``-k w2`` trains world 2 alone)."""

    def __init__(self, start):
        super().__init__()
        self._start = start

    def __missing__(self, world: int):
        self[world] = value = self._start(world)
        return value


def grid_groups(rank: int, world: int, tp: int):
    """``(tp_rank, dp_rank, tp_group, dp_group)`` of ``rank`` on Megatron's grid: TP groups are
    consecutive ranks, DP groups stride by ``tp``. Every rank makes every group, in one order (as
    ``parallel_state`` does), so it is called by all ranks of the world alike."""
    import torch.distributed as dist

    dp = world // tp
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
    tp_rank, dp_rank = rank % tp, rank // tp
    return tp_rank, dp_rank, tp_groups[dp_rank], dp_groups[tp_rank]
