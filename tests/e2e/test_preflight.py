"""Mistakes end a run in one line, before it can do harm (preflight.py, errors.py, startup_checks.py).

* ``bash scripts/run.sh main --load <typo>`` — the issue's resume-chain accident: refused with
  one line and exit code 2 before torchrun starts, the real save directory untouched.
* ``bash scripts/run.sh main`` refuses a first argument that is no YAML config (a directory, a
  missing file, another file) in one line and exit 2 before the venv, the data or the preflight;
* the preflight command itself: one stderr line and exit 2 for a bad flag; the argument list
  (one per line) for a good command line;
* a job started without the launchers (torchrun on ``scripts/pretrain_gpt.py``) refuses the same
  ``--load`` on every rank, with rank 0's one line, before any iteration;
* an uncaught ``UserInputError`` is one line and exit code 2 in any script after ``install()``;
* ``--yaml-cfg`` (Megatron's experimental YAML, which skips ``validate_args``) is refused.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from bad_inputs_table import expected_line
from entry_harness import ENTRY, TINY, free_port

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")


def test_run_sh_refuses_a_load_typo_before_starting(tmp_path):
    real = tmp_path / "real"  # a run's checkpoints, which the typo must not touch
    (real / "iter_0000100").mkdir(parents=True)
    (real / "latest_checkpointed_iteration.txt").write_text("100")
    before = sorted(p.name for p in real.iterdir())
    proc = subprocess.run(["bash", "scripts/run.sh", "main", "--load", str(tmp_path / "tiny_cpu"), "--save", str(real)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[run.sh]")]
    assert lines == [f"megatron-muon: error: --load {tmp_path}/tiny_cpu: does not exist (no "
                     "latest_checkpointed_iteration.txt); Megatron would train from scratch and its saves would "
                     f"go to --save {real}. Fix the path, or drop --load to start a new run (a run may name its "
                     "own empty --save as --load)"], proc.stderr
    assert "torchrun" not in proc.stdout + proc.stderr and "iteration" not in proc.stdout
    assert sorted(p.name for p in real.iterdir()) == before
    assert (real / "latest_checkpointed_iteration.txt").read_text() == "100"


@pytest.mark.parametrize("row_id", ["run-sh-directory", "run-sh-missing", "run-sh-not-yaml"])
def test_run_sh_refuses_a_config_that_is_no_yaml_file(row_id, tmp_path):
    """The rows of docs/bad_inputs.md of kind launcher: a bash test each, no Python started (so no
    venv is built and no dataset written, wherever the checkout is)."""
    from bad_inputs_table import rows

    command = shlex.split(rows()[row_id]["input"].split("`")[1])
    env = dict(ENV, MEGATRON_MUON_VENV=str(tmp_path / "no-venv"))  # refused before the venv is looked at
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.splitlines() == [f"megatron-muon: error: {rows()[row_id]['line']}"]
    assert not (tmp_path / "no-venv").exists()


def _preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_muon.megatron.preflight", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_preflight_is_one_line_and_exit_2(tmp_path):
    proc = _preflight("--nproc", "2", "configs/tiny-cpu.yaml", "--muon-extra-scale-factor", "nan",
                      "--save", str(tmp_path / "c"), "--load", str(tmp_path / "c"))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == ["megatron-muon: error: --muon-extra-scale-factor: expected a finite value "
                                        "> 0, got nan"], proc.stderr
    usage = _preflight("--nproc", "two", "configs/tiny-cpu.yaml")
    assert usage.returncode == 2 and usage.stderr.startswith("megatron-muon: error: --nproc: expected")


def test_preflight_prints_the_job_arguments(tmp_path):
    data = REPO / "data" / "train_text_document.bin"
    if not data.is_file():  # the demo's data (scripts/run.sh main builds it the same way)
        subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", "data"], cwd=REPO, check=True,
                       capture_output=True)
    save = str(tmp_path / "ckpt")
    proc = _preflight("--nproc", "2", "--lines", "--resume-from-save", "configs/tiny-cpu.yaml", "--save", save,
                      "--train-iters", "3", "--lr-warmup-iters", "1")
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[-4:] == ["--lr-warmup-iters", "1", "--load", save] and "--optimizer" in argv
    assert proc.stderr == ""  # Megatron's warnings and argument dump are held back


def test_a_job_without_the_launchers_refuses_the_same_load(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ENTRY), *TINY, "--train-iters", "3", "--save-interval", "3",
           "--load", str(tmp_path / "tiny_cpu"), "--save", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(ENV, PYTHONWARNINGS="ignore"), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("megatron-muon: error: ")]
    assert proc.returncode != 0 and len(errors) == 1, out[-3000:]  # rank 0 only
    pattern = expected_line("load-typo", TMP=str(tmp_path))
    assert pattern.fullmatch(errors[0].removeprefix("megatron-muon: error: ")), errors
    assert "exitcode  : 2" in out and " iteration " not in out and not (tmp_path / "ckpt").exists()


def test_uncaught_user_input_error_is_one_line_exit_2():
    code = ("import megatron_muon.megatron.hooks as h; h.install(); "
            "from megatron_muon.megatron.errors import UserInputError; "
            "raise UserInputError('--flag: expected\\n  something')")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=dict(ENV, RANK="0"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.startswith("megatron-muon")] == [
        "megatron-muon: error: --flag: expected something"]
    assert "Traceback" not in proc.stderr


def test_yaml_cfg_is_refused_with_muon():
    from types import SimpleNamespace

    from megatron_muon.megatron.errors import UserInputError
    from megatron_muon.megatron.hooks import _wrap_validate_yaml

    calls = []
    wrapped = _wrap_validate_yaml(lambda args, defaults: calls.append(args) or args)
    with pytest.raises(UserInputError, match=r"^--yaml-cfg: Megatron's experimental YAML config skips"):
        wrapped(SimpleNamespace(optimizer="muon"))
    other = SimpleNamespace(optimizer="adam")
    assert wrapped(other) is other and calls == [other]
