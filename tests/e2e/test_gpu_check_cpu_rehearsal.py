"""scripts/gpu_check.sh's CPU rehearsal of every part (``--device cpu``), run as a process: Megatron's loop with a
save and a bitwise resume (gloo, fp32), the TP2 x DP2 equivalence over gloo with CPU tensors (the
same code the GPU run uses with CUDA ones), the real step of production layouts' busiest rank on CPU
tensors under the fake process group (shapes / 64), and the Newton-Schulz timings.
Its argument handling and report writer are checked in this process by
``tests/unit/test_gpu_check.py``. The GPU run itself goes into docs/performance.md when a task
is lent a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_rehearsal_runs_every_part(tmp_path):
    out = tmp_path / "check"
    # the wrapper a GPU machine runs (scripts/gpu_check.sh), with this interpreter and --device cpu
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out))
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--train-iters", "10", "--scale", "64",
                           "--repeats", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    train = report["train"]
    assert train["ok"] and train["loss_falls"] and train["resume"]["bitwise"], train.get("log_tail")
    assert [r["iteration"] for r in train["rows"]] == [1, 5, 10] and train["resume"]["compared"] == [10]
    assert all(r["kind"] == "muon" for r in train["rows"])
    assert report["versions"]["torch"]["in_range"] is True
    real = report["real-step"]  # the first stage's busiest rank of each production layout, shapes / 64, CPU tensors
    assert real["ok"] and [(r["model"], r["tp_mode"]) for r in real["rows"]] == [
        ("llama3-405b", "owner"), ("llama3-405b", "auto"), ("llama3-8b", "owner"), ("llama3-70b", "owner")]
    assert [r["matrices"] for r in real["rows"]] == [28, 28, 128, 320]  # 405B's first stage; all 32 / 80 layers
    assert all(r["device"] == "cpu" and r["step_ms"] > 0 and r["ns_gflop"] > 0 and not r["dry_run_errors"]
               for r in real["rows"]), real["rows"]
    assert real["skipped_layouts"] == ["deepseek-v3 TP1 x PP16 x DP64 x EP8 auto: --scale 64: MLA shapes are not "
                                       "scaled (runs at --scale 1)"]
    # the parts ran in order of value, each reported as it finished
    assert [line.split(":")[0] for line in proc.stderr.splitlines() if line.startswith("[gpu_check] ")] == [
        "[gpu_check] ns", "[gpu_check] real-step", "[gpu_check] train", "[gpu_check] equivalence"]
    eq = report["equivalence"]
    assert eq["ok"] and eq["devices"] == ["cpu"] and set(eq["max_abs_error"]) == {"owner", "duplicated", "distributed",
                                                                        "optimizer (owner)"}
    assert all(0 <= err <= eq["tolerance"] for err in eq["max_abs_error"].values())
    assert len(report["ns"]["rows"]) == 5 and report["ns"]["rows"][0]["fraction_of_peak"] is None  # no CPU peak
    assert (out / "gpu_check.md").read_text().rstrip("\n") == proc.stdout.rstrip("\n")


def test_a_check_cut_short_keeps_the_parts_that_finished(tmp_path):
    """The lease can end mid-check: kill the rehearsal once its first part (ns) has reported and
    find that part's results in both files, written before the next part began."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out))
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--scale", "64", "--repeats", "1"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stderr:
            if line.startswith("[gpu_check] "):
                assert line.startswith("[gpu_check] ns: ok"), line
                break
        else:
            raise AssertionError(f"the check ended (rc {proc.wait()}) before its first part reported")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as the lease's end would: no chance to write anything more
        proc.wait(timeout=60)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ns"]["ok"] and len(report["ns"]["rows"]) == 5 and "real-step" not in report
    text = (out / "gpu_check.md").read_text()
    assert "## ns: bf16 Newton–Schulz" in text and "## real-step" not in text

