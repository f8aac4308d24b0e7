"""Megatron's own training loop as a test runs it: ``scripts/pretrain_gpt.py`` on gloo ranks.

``TINY``: the tiny GPT's flags (2 gloo ranks, TP2, mock data, ``--optimizer muon``, owner mode,
the distributed optimizer, the CPU's ``--no-*`` fusions). ``launch(args, cwd, ...)`` runs a job
and returns its ``Job`` (exit code per rank, the ranks' output); ``run_tiny(args, cwd)`` runs 2
ranks on ``TINY + args`` and returns the output, failing the test on a non-zero exit.

Two launchers, one job: an entry script (``scripts/pretrain_gpt.py``, or a test's wrapper of it)
runs by fork from a warm interpreter (``tests/warm_entry.py``: torch's and megatron's imports done
once per session, then torchrun's environment per rank); a job whose ``env`` sets what only
interpreter start reads (``START_ENV``), ``torchrun=True``, or ``MEGATRON_MUON_TEST_TORCHRUN=1``
runs under ``python -m torch.distributed.run``. Megatron's loop, the plugin and the gloo world
are the same either way; the launcher is not what these tests check
(``test_pretrain_saves_and_resumes``, the Slurm and the preflight tests run the real launchers).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BASE_ENV", "ENTRY", "ITERATION", "Job", "REPO", "RESUME", "TINY", "free_port", "launch", "logged_rows",
           "run_tiny"]

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "scripts" / "pretrain_gpt.py"

TINY = [
    "--distributed-backend", "gloo", "--tensor-model-parallel-size", "2",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "0.02", "--min-lr", "0.002", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--lr-decay-iters", "20",
    "--optimizer", "muon", "--muon-tp-mode", "owner", "--use-distributed-optimizer",
    "--muon-log-stats",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
    "--eval-iters", "0", "--eval-interval", "1000",
    "--ckpt-format", "torch_dist",
]

# Megatron's iteration line (training_log), with megatron-muon's stats appended (--muon-log-stats).
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?learning rate: ([0-9.E+-]+) \|.*?"
    r"lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|.*?"
    r" muon step: (\w+) \| muon bytes sent: ([0-9.]+) MB \| muon orthogonalize: ([0-9.]+) ms \(host clock\) \|"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BASE_ENV = dict(
    CUDA_VISIBLE_DEVICES="",  # the CPU path (and its patches) wherever the test runs
    CUDA_DEVICE_MAX_CONNECTIONS="1",  # what Megatron asks for with TP > 1 before Blackwell
    OMP_NUM_THREADS="1",
    PYTHONWARNINGS="ignore",
)
# What a forked rank cannot change: variables read at interpreter start or when torch loads.
START_ENV = ("PYTHON", "OMP_", "MKL_", "LD_", "CUDA_VISIBLE_DEVICES", "TORCH_")


@dataclass(frozen=True)
class Job:
    """A finished job: ``returncode`` (0, or the first failing rank's code), ``rank_codes``
    (per rank; ``None`` under torchrun, which reports only the job's), ``stdout`` and ``stderr``
    (every rank's, rank by rank)."""

    returncode: int
    rank_codes: tuple[int, ...] | None
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr


def launch(args: list[str], cwd, *, nproc: int = 2, entry: Path = ENTRY, env: dict | None = None,
           timeout: int = 300, torchrun: bool = False) -> Job:
    """Run ``entry args`` on ``nproc`` gloo ranks in ``cwd`` with ``BASE_ENV`` updated by ``env``
    (a ``None`` value unsets the variable): the full command line, no ``TINY`` added here.
    ``torchrun``: under ``python -m torch.distributed.run`` whatever the entry."""
    env = dict(env or {})
    warm = not any(key.startswith(START_ENV) for key in env) and os.environ.get("MEGATRON_MUON_TEST_TORCHRUN") != "1"
    if warm and not torchrun:
        return _warm().run(Path(entry), args, Path(cwd), nproc, env, timeout)
    full_env = dict(os.environ, **BASE_ENV)
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(entry), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return Job(proc.returncode, None, proc.stdout, proc.stderr)


def bench_script_env() -> dict:
    """The environment of a ``python -m scripts.bench.X`` subprocess started from a tmp directory."""
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))


def sources_dataset(tmp_path: Path) -> Path:
    """A byte-level dataset of this package's own sources (scripts/prepare_data.py, 20% validation)
    in ``tmp_path / "data"``, for the benchmark scripts' end-to-end runs."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(data),
                    "--input", str(REPO / "megatron_muon"), "--valid-fraction", "0.2"],
                   check=True, capture_output=True, env=bench_script_env(), timeout=120)
    return data


def run_tiny(args: list[str], cwd: Path, torchrun: bool = False) -> str:
    job = launch([*TINY, *args], cwd, timeout=240, torchrun=torchrun)
    assert job.returncode == 0, f"pretrain_gpt.py failed (rc={job.returncode}):\n{job.out[-6000:]}"
    return job.out


class _WarmEntry:
    """The session's ``tests/warm_entry.py`` process; jobs run one at a time."""

    def __init__(self):
        env = dict(os.environ, **BASE_ENV)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("warm_entry.py")), str(ENTRY)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
        )
        ready = self.proc.stdout.readline()
        assert ready, "tests/warm_entry.py died while importing torch and megatron"
        threads = json.loads(ready)["threads"]
        assert threads == 1, f"the warm entry runs {threads} threads: a fork would copy their held locks"

    def run(self, entry: Path, args, cwd: Path, nproc: int, env: dict, timeout: int) -> Job:
        outdir = tempfile.mkdtemp(prefix="warm_entry_")
        try:
            job = dict(entry=str(entry), args=[str(a) for a in args], cwd=str(cwd), nproc=nproc, env=env,
                       port=free_port(), timeout=timeout, outdir=outdir)
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            assert line, "tests/warm_entry.py died"
            reply = json.loads(line)
            stdout, stderr = ("".join(Path(outdir, f"rank{r}.{stream}").read_text(errors="replace")
                                      for r in range(nproc) if Path(outdir, f"rank{r}.{stream}").exists())
                              for stream in ("out", "err"))
        finally:
            shutil.rmtree(outdir, ignore_errors=True)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(["warm_entry", *job["args"]], timeout, output=stdout + stderr)
        codes = tuple(reply["codes"])
        return Job(next((c for c in codes if c != 0), 0), codes, stdout, stderr)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_WARM: _WarmEntry | None = None


def _warm() -> _WarmEntry:
    global _WARM
    if _WARM is None or _WARM.proc.poll() is not None:
        _WARM = _WarmEntry()
    return _WARM


@atexit.register
def shutdown_warm_entry() -> None:
    global _WARM
    if _WARM is not None:
        _WARM.close()
        _WARM = None


ROW = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|"
                 r".*?grad norm: ([0-9.]+) \|")
RESUME = ["--train-iters", "6", "--log-interval", "1", "--ckpt-step", "4"]
"""a resume of a run saved at iteration 4 of 6: iterations 5 and 6, each logged."""


def logged_rows(out: str) -> dict[int, tuple[str, str, str]]:
    """iteration -> (lr, loss, grad norm) as Megatron prints them (compared as printed: bitwise
    at the log's precision)."""
    return {int(m[1]): (m[3], m[4], m[5]) for m in ROW.finditer(out)}
