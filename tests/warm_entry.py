"""A warm interpreter that launches Megatron entry scripts by fork, as torchrun would.

Run by ``entry_harness`` as ``python tests/warm_entry.py ENTRY`` with the launch environment
(``entry_harness.BASE_ENV``). It imports, once, the torch and megatron modules that ENTRY
(``scripts/pretrain_gpt.py``) imports, and nothing of megatron_muon: no hook is installed and no
patch applied here, so a job's script does both itself, in its own order, as in a fresh process
(a driver may wrap a Megatron function before the plugin's hooks do, an entry may skip the
hooks). Then it reads one job per line on stdin (JSON: ``entry``, ``args``, ``cwd``, ``nproc``,
``env``, ``port``, ``timeout``, ``outdir``) and, per job, forks ``nproc`` ranks. Each rank sets the
variables torchrun sets for a one-node job, ``sys.argv`` and the job's ``env`` (a ``null`` value
unsets), writes stdout and stderr to ``outdir/rank<i>.out`` and ``.err`` and runs the job's entry as
``__main__``. No job ever runs in this process itself, so each starts from the state a fresh
import leaves. The CPU patches retarget functions in place (their ``__code__``) or module
attributes looked up at call time, so modules imported before them are patched all the same.

The reply is one JSON line on the original stdout: each rank's exit code (torchrun's rule: the
first rank that fails ends the job, the others get SIGTERM at once and SIGKILL ``GRACE_S`` later),
and ``timed_out``. Why: a fresh torchrun job spends
about 15 s of its 22 s importing (two ranks and the launcher, on 2 cores); forked ranks skip it.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import runpy
import signal
import sys
import time

GRACE_S = 5.0
POLL_S = 0.05


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(job: dict, rank: int, reply_fd: int) -> None:
    """In the forked child: become rank ``rank`` of the job and run the entry; never returns."""
    code = 1
    try:
        os.setsid()  # one process group per rank: a timeout kills its data-loader workers too
        os.close(reply_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, stream in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(job["outdir"], f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                    fd)
        nproc = job["nproc"]
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="warm_entry",
        )
        for key, value in job["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.chdir(job["cwd"])
        entry = job["entry"]
        sys.argv = [entry, *job["args"]]
        sys.path[0] = os.path.dirname(entry)  # where `python entry` looks first (this file's directory here)
        try:
            runpy.run_path(entry, run_name="__main__")
            code = 0
        except SystemExit as done:
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter would: the plugin's hook exits 2 on a refusal
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # the rank's own group (setsid); gone already if it has exited
        except ProcessLookupError:
            pass


def _wait(pids: dict[int, int], codes: list, timeout: float) -> bool:
    """Reap the ranks; returns whether the job ran past ``timeout``. ``pids``: pid -> rank."""
    deadline, failed_at = time.monotonic() + timeout, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            rank = pids.pop(pid)
            codes[rank] = os.waitstatus_to_exitcode(status)
            _signal([pid], signal.SIGKILL)  # what the rank left behind (data-loader workers)
            if codes[rank] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        if now > deadline:
            _signal(pids, signal.SIGKILL)
            _reap(pids, codes)
            return True
        if failed_at is not None:
            _signal(pids, signal.SIGTERM)
            while pids and time.monotonic() - failed_at < GRACE_S:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
                else:
                    time.sleep(POLL_S)
            _signal(pids, signal.SIGKILL)
            _reap(pids, codes)
            return False
        time.sleep(POLL_S)
    return False


def _reap(pids: dict[int, int], codes: list) -> None:
    for pid, rank in list(pids.items()):
        _, status = os.waitpid(pid, 0)
        codes[rank] = os.waitstatus_to_exitcode(status)
        del pids[pid]


def third_party_imports(entry: str) -> list[str]:
    """The torch and megatron modules ``entry`` imports at its top level (megatron_muon's not)."""
    tree = ast.parse(open(entry).read())
    names = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module]
    return [n for n in names if n.split(".")[0] in ("torch", "megatron")]


def serve(entry: str) -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the warm-up prints goes to stderr, never into the replies
    # megatron.training.training: what hooks.install() imports before it wraps its functions
    for name in [*third_party_imports(entry), "megatron.training.training"]:
        importlib.import_module(name)
    # A fork copies only the forking thread: another thread's locks would stay held in the ranks.
    ready = {"threads": _threads()}
    reply.write(json.dumps(ready) + "\n")
    reply.flush()
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids, codes = {}, [None] * job["nproc"]
        for rank in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(job, rank, reply.fileno())
            pids[pid] = rank
        timed_out = _wait(pids, codes, job["timeout"])
        reply.write(json.dumps({"codes": codes, "timed_out": timed_out}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
