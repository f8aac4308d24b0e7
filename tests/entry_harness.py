"""Megatron's own training loop as a test runs it: ``scripts/pretrain_gpt.py`` under torchrun.

``TINY``: the tiny GPT's flags (2 gloo ranks, TP2, mock data, ``--optimizer muon``, owner mode,
the distributed optimizer, the CPU's ``--no-*`` fusions). ``torchrun(args, cwd)`` runs 2 ranks
on it with ``args`` appended and returns stdout + stderr (failing the test on a non-zero exit);
``free_port`` picks a loopback port for a rendezvous.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["ENTRY", "ITERATION", "REPO", "RESUME", "TINY", "free_port", "logged_rows", "torchrun"]

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


def torchrun(args: list[str], cwd: Path) -> str:
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # the CPU path (and its patches) wherever the test runs
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # what Megatron asks for with TP > 1 before Blackwell
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ENTRY), *TINY, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pretrain_gpt.py failed (rc={proc.returncode}):\n{out[-6000:]}"
    return out


ROW = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|"
                 r".*?grad norm: ([0-9.]+) \|")
RESUME = ["--train-iters", "6", "--log-interval", "1", "--ckpt-step", "4"]
"""a resume of a run saved at iteration 4 of 6: iterations 5 and 6, each logged."""


def logged_rows(out: str) -> dict[int, tuple[str, str, str]]:
    """iteration -> (lr, loss, grad norm) as Megatron prints them (compared as printed: bitwise
    at the log's precision)."""
    return {int(m[1]): (m[3], m[4], m[5]) for m in ROW.finditer(out)}
