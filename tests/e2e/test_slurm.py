"""scripts/slurm/*.sbatch under a real Slurm: a one-node cluster on this machine.

Needs slurm-wlm + munge: ``bash scripts/run.sh test`` installs them when missing (as root with
apt-get, as on CI, where a missing Slurm fails the test); it is skipped, saying why, only on a
machine without root or apt-get. It starts slurmctld + slurmd in a temp dir
(scripts/slurm/local_cluster.sh), and submits the CPU demo (configs/tiny-cpu.yaml, TP=2 gloo,
2 processes from one torchrun) twice:

1. ``train-single-node.sbatch``: 6 iterations, checkpoints at 3 and 6 (``--save``);
2. ``train.sbatch`` (the multi-node script, on 1 node: srun + torchrun --node-rank $SLURM_NODEID)
   with the same ``--save`` and 8 iterations: the script adds ``--load <save dir>``, so the job
   resumes at iteration 6, which is what a requeued job does.

The daemons are always stopped (fixture teardown). About 1 minute on 2 cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "scripts" / "slurm"
CLUSTER = SLURM_DIR / "local_cluster.sh"
CONFIG = REPO / "configs" / "tiny-cpu.yaml"

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*? muon step: (\w+) \| muon bytes sent: ([0-9.]+) MB")
JOB_TIMEOUT_S = 240


def _ensure_slurm() -> None:
    # Installing is setup, not a test: `bash scripts/run.sh test` (what CI runs) installs
    # slurm-wlm + munge first when they are missing and it can (root with apt-get).
    missing = [tool for tool in ("sbatch", "slurmctld", "munged") if not shutil.which(tool)]
    if not missing:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):  # CI and this project's machines: never a skip
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} not on PATH) although this machine can "
                    "install it: run the suite through `bash scripts/run.sh test`, which does")
    pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH) and installing it needs root with "
                "apt-get, which this machine lacks")


@pytest.fixture
def slurm_cluster(tmp_path):
    """A running one-node cluster; yields the environment for sbatch/squeue; always stops it."""
    _ensure_slurm()
    if os.geteuid() != 0:
        pytest.skip("the local Slurm daemons run as root")
    cdir = tmp_path / "slurm"
    env = dict(os.environ, SLURM_CONF=str(cdir / "slurm.conf"))
    try:
        proc = subprocess.run(["bash", str(CLUSTER), "start", str(cdir)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"local cluster did not start:\n{proc.stdout}\n{proc.stderr}"
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(cdir)], env=env,
                       capture_output=True, text=True, timeout=60)


def _sbatch(env: dict, script: str, log: Path, args: list[str], cwd: Path) -> str:
    cmd = ["sbatch", "--parsable", "--job-name", f"t-{script.split('.')[0]}",
           "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=0",
           "--time=10:00",
           f"--output={log}", str(SLURM_DIR / script), str(CONFIG), *args]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sbatch failed: {proc.stdout}{proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def _job_state(env: dict, job: str) -> str:
    proc = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    m = re.search(r"JobState=(\S+)", proc.stdout)
    return m[1] if m else "UNKNOWN"


def _wait(env: dict, job: str, log: Path) -> str:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = _job_state(env, job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job], env=env)
        text = log.read_text(errors="replace") if log.exists() else "<no log>"
        pytest.fail(f"job {job} not done after {JOB_TIMEOUT_S} s (state {state}):\n{text[-4000:]}")
    text = log.read_text(errors="replace") if log.exists() else ""
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text[-6000:]}"
    return text


def test_sbatch_cpu_demo_trains_saves_and_resumes(slurm_cluster, tmp_path, demo_data):
    env = dict(slurm_cluster, MEGATRON_MUON_ROOT=str(REPO), MEGATRON_MUON_PYTHON=sys.executable,
               NPROC_PER_NODE="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")

    data = demo_data

    ckpt = tmp_path / "ckpt"
    common = ["--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1",
              "--save", str(ckpt), "--train-data-path", str(data / "train_text_document"),
              "--valid-data-path", str(data / "valid_text_document"),
              "--data-cache-path", str(tmp_path / "cache")]

    # 1. the single-node script: 6 iterations from scratch, checkpoints at 3 and 6.
    log1 = tmp_path / "single-node.out"
    job1 = _sbatch(env, "train-single-node.sbatch", log1,
                   [*common, "--train-iters", "6", "--save-interval", "3", "--eval-interval", "3"], tmp_path)
    out = _wait(env, job1, log1)
    assert f"job {job1} (restart 0)" in out and "1 node x 2 proc(s)" in out
    assert f"resume from: {ckpt}" in out  # --load <save dir> was added
    assert "will not load any checkpoints and will start from random" in out
    rows = ITERATION.findall(out)
    assert [(int(i), int(n)) for i, n, *_ in rows] == [(i, 6) for i in range(1, 7)], out[-4000:]
    assert all(kind == "muon" and float(sent) > 0 for *_, kind, sent in rows)
    assert re.search(r"iteration\s+6/\s+6 \|", out)
    assert "successfully saved checkpoint from iteration       6" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    saved = ckpt / "iter_0000006"
    assert (saved / "metadata.json").is_file() and list(saved.glob("*.distcp")), list(saved.iterdir())
    assert "step finished with exit code 0" in out

    # 2. the multi-node script on one node (srun → torchrun --node-rank $SLURM_NODEID), the same
    #    --save: it resumes from iteration 6, as a requeued job would.
    log2 = tmp_path / "multi-node.out"
    job2 = _sbatch(env, "train.sbatch", log2,
                   [*common, "--train-iters", "8", "--save-interval", "8", "--eval-interval", "100",
                    "--override-opt-param-scheduler"], tmp_path)
    out = _wait(env, job2, log2)
    assert f"job {job2} (restart 0)" in out and "1 node(s) x 2 proc(s)" in out
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 6", out), out[-4000:]
    rows = ITERATION.findall(out)
    assert [(int(i), int(n)) for i, n, *_ in rows] == [(7, 8), (8, 8)], out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert "step finished with exit code 0" in out


def _wait_for(log: Path, pattern: str, env: dict, job: str) -> str:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job}: no {pattern!r} after {JOB_TIMEOUT_S} s:\n{text[-4000:]}")


@pytest.mark.parametrize("script", ["train.sbatch", "train-single-node.sbatch"])
def test_sbatch_time_limit_warning_saves_then_requeues(slurm_cluster, tmp_path, demo_data, script):
    """What Slurm does 5 minutes before the time limit (``--signal=B:USR1@300``), sent by hand
    (``scancel --signal=USR1 --batch``): the script hands Megatron's exit signal to the training
    processes, which finish the iteration in flight and save (``--exit-signal-handler``, which the
    scripts pass), the step exits 0, and only then is the job requeued."""
    env = dict(slurm_cluster, MEGATRON_MUON_ROOT=str(REPO), MEGATRON_MUON_PYTHON=sys.executable,
               NPROC_PER_NODE="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = _sbatch(env, script, log,
                  ["--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1", "--save", str(ckpt),
                   "--train-data-path", str(demo_data / "train_text_document"),
                   "--valid-data-path", str(demo_data / "valid_text_document"),
                   "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "5000",
                   "--save-interval", "5000", "--eval-interval", "5000"], tmp_path)
    try:
        _wait_for(log, r"iteration\s+3/\s*5000 \|", env, job)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
        out = _wait_for(log, r"requeueing job", env, job)
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    assert "USR1 (time limit near)" in out and "exiting program after receiving SIGTERM" in out, out[-4000:]
    assert "step finished with exit code 0" in out, out[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    last = max(int(i) for i, *_ in ITERATION.findall(out))
    assert 3 <= saved == last < 5000, (saved, last)  # the iteration in flight, then the save
    assert (ckpt / f"iter_{saved:07d}" / "metadata.json").is_file()
