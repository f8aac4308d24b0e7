"""A SIGTERM to ``bash scripts/run.sh main``: saved and resumed bitwise with
``--exit-signal-handler``, nothing saved without it (Megatron's rule, docs/checkpoints.md).

``run.sh main`` hands the signal to the training processes themselves (not to torchrun, which
would give them 30 s and then SIGKILL). With ``--exit-signal-handler`` Megatron's handler marks
the signal, the iteration in flight finishes, every rank agrees (an all-gather of the marks), the
checkpoint is saved and the job exits 0. The resumed run then ends in a checkpoint equal, tensor
for tensor as torch's own DCP reader reads it, to the one an uninterrupted run of the same
command saves: the same data position, weights, momentum, Adam moments and scheduler.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from checkpoint_harness import read_offline

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
ITERS = 10
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")


def _demo_data() -> None:
    if not (REPO / "data" / "train_text_document.bin").is_file():  # run.sh main builds it the same way
        subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", "data"], cwd=REPO, check=True,
                       capture_output=True)


def _run(ckpt: Path, *extra: str, stop_at: int | None = None) -> tuple[int, str]:
    """``run.sh main`` of the tiny demo for ``ITERS`` iterations saving to and loading from
    ``ckpt``; with ``stop_at``, SIGTERM to run.sh once iteration ``stop_at`` is logged."""
    args = ["bash", "scripts/run.sh", "main", "--save", str(ckpt), "--load", str(ckpt), "--train-iters", str(ITERS),
            "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--save-interval", "1000", *extra]
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        match = ITERATION.search(line)
        if stop_at is not None and match and int(match[1]) == stop_at:
            proc.send_signal(signal.SIGTERM)
            stop_at = None
    return proc.wait(timeout=600), "".join(lines)


def _saved_at(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def test_sigterm_with_exit_signal_handler_saves_and_resumes_bitwise(tmp_path):
    _demo_data()
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    rc, out = _run(whole, "--exit-signal-handler")
    assert rc == 0 and _saved_at(whole) == ITERS, out[-4000:]

    rc, out = _run(cut, "--exit-signal-handler", stop_at=3)
    assert rc == 0, out[-4000:]
    stopped = _saved_at(cut)
    assert 3 <= stopped < ITERS, out[-4000:]  # the iteration in flight when the signal came, then the save
    assert "exiting program after receiving SIGTERM" in out
    assert f"Checkpoint: {cut}. Running the same command again resumes from it" in out  # the run's own --save

    rc, out = _run(cut, "--exit-signal-handler")
    assert rc == 0 and _saved_at(cut) == ITERS, out[-4000:]
    assert re.search(rf"loading distributed checkpoint from \S+ at iteration {stopped}\b", out), out[-4000:]
    assert [int(m[1]) for m in ITERATION.finditer(out)][0] == stopped + 1

    name = f"iter_{ITERS:07d}"
    a = read_offline(str(whole / name), str(tmp_path / "a.pt"))
    b = read_offline(str(cut / name), str(tmp_path / "b.pt"))
    assert a.keys() == b.keys() and len(a) > 20, sorted(set(a) ^ set(b))
    # Bitwise: the same operations in the same order on the same data, split across two processes' lives.
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, differ


def test_sigterm_without_exit_signal_handler_saves_nothing(tmp_path):
    _demo_data()
    ckpt = tmp_path / "ckpt"
    rc, out = _run(ckpt, stop_at=3)
    assert rc != 0, out[-4000:]
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists(), out[-4000:]
