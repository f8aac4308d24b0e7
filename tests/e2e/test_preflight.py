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
* ``--yaml-cfg`` (Megatron's experimental YAML, which skips ``validate_args``) is refused;
* ``run.sh main`` hands the job every argument as given (an empty one, one with a newline: the
  preflight's list, NUL-terminated), so ``--hybrid-layer-pattern ''`` reaches the pattern check;
* a real checkpoint (the tiny GPT's, ``--muon-dp-layout megatron``) that lost files, or resumed
  with ``--muon-dp-layout balanced`` or a ``--train-iters`` below its iteration: one line before
  launch (the job refuses the layout change at startup too).
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


# --------------------------------------------------------------------------- scripts/run.sh main's arguments


def _recording_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv that is the real one but for ``torchrun``: a recorder that writes its arguments, each
    NUL-terminated, to the returned file and exits 0 (what run.sh hands the job is under test, not
    the job)."""
    real = Path(sys.executable).parent.parent
    venv, record = tmp_path / "venv", tmp_path / "torchrun-args"
    (venv / "bin").mkdir(parents=True)
    for entry in (real / "bin").iterdir():
        if entry.name != "torchrun":
            (venv / "bin" / entry.name).symlink_to(entry)
    (venv / "lib").symlink_to(real / "lib")
    for name in ("pyvenv.cfg", ".requirements-stamp"):  # the venv's own marker, and run.sh's "up to date"
        (venv / name).write_bytes((real / name).read_bytes())
    recorder = venv / "bin" / "torchrun"
    recorder.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shlex.quote(str(record))}\n")
    recorder.chmod(0o755)
    return venv, record


def test_run_sh_hands_the_job_every_argument_as_given(tmp_path, hooks_restored):
    """An empty argument (trailing or not) and one holding a newline reach torchrun unchanged, and
    the job's argument list is the preflight's (run.sh used to read it one per line: a trailing
    ``''`` was dropped, a newline split one argument in two)."""
    from megatron_muon.megatron.preflight import check_command_line

    venv, record = _recording_venv(tmp_path)
    if not (REPO / "data" / "train_text_document.bin").is_file():  # what run.sh main would build first
        subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", "data"], cwd=REPO, check=True,
                       capture_output=True)
    save = str(tmp_path / "ckpt")
    extra = ["--save", save, "--load", save, "--wandb-exp-name", "two\nlines", "--wandb-project", ""]
    proc = subprocess.run(["bash", "scripts/run.sh", "main", *extra], cwd=REPO,
                          env=dict(ENV, MEGATRON_MUON_VENV=str(venv)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = record.read_bytes().split(b"\0")
    assert words[-1] == b""  # every argument NUL-terminated
    job = [w.decode() for w in words[:-1]]
    assert job[:4] == ["--nproc-per-node", "2", "--master-addr", "127.0.0.1"] and job[6] == "scripts/pretrain_gpt.py"
    assert job[-4:] == ["--wandb-exp-name", "two\nlines", "--wandb-project", ""], job[-6:]
    assert job[7:] == check_command_line("configs/tiny-cpu.yaml", extra, 2)


@pytest.mark.parametrize("where", ["trailing", "middle"])
def test_run_sh_refuses_an_empty_hybrid_pattern(where):
    """Row run-sh-empty-argument: ``--hybrid-layer-pattern ''`` arrives as an empty argument,
    wherever it stands, and the pattern check refuses it before torchrun."""
    from bad_inputs_table import rows

    command = shlex.split(rows()["run-sh-empty-argument"]["input"].split("`")[1])
    assert command[-2:] == ["--hybrid-layer-pattern", ""]
    if where == "middle":
        command += ["--train-iters", "300"]
    proc = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[run.sh]")]
    assert (proc.returncode, lines) == (2, [f"megatron-muon: error: {rows()['run-sh-empty-argument']['line']}"]), \
        proc.stderr[-3000:]
    assert "torchrun" not in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- a real checkpoint, damaged or resumed


@pytest.fixture(scope="module")
def megatron_layout_checkpoint(tmp_path_factory) -> Path:
    """TMP/ckpt: the tiny GPT's iteration 3, saved by scripts/pretrain_gpt.py with ``--muon-dp-layout
    megatron`` (the distributed optimizer's default format, dp_reshardable; with checksums)."""
    from entry_harness import launch

    root = tmp_path_factory.mktemp("saved")
    job = launch([*TINY, "--muon-dp-layout", "megatron", "--train-iters", "3", "--save-interval", "3",
                  "--save", str(root / "ckpt")], root)
    assert job.returncode == 0, job.out[-4000:]
    return root / "ckpt"


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(saved, tmp_path / "ckpt")
    (tmp_path / "tiny.yaml").write_text("distributed_backend: gloo\n")  # the preflight's config; TINY follows
    return tmp_path / "ckpt" / "iter_0000003"


def _preflight_refusal(tmp_path: Path, *extra: str) -> str:
    from megatron_muon.megatron.preflight import check_command_line

    with pytest.raises(ValueError) as info:
        check_command_line(str(tmp_path / "tiny.yaml"), [*TINY, "--train-iters", "5", "--muon-dp-layout", "megatron",
                                                         "--load", str(tmp_path / "ckpt"), *extra], 2)
    return str(info.value)


def _damage(row_id: str, iteration: Path) -> None:
    """The row's damage: what a user's ``rm`` left (the hidden .metadata survives ``rm iter/*``)."""
    names = sorted(p.name for p in iteration.iterdir())
    assert {".metadata", "metadata.json", "megatron_muon_checksums.json", "__0_0.distcp", "__1_0.distcp"} <= set(names)
    gone = {"ckpt-no-metadata-json": ["metadata.json"],
            "ckpt-emptied": [n for n in names if not n.startswith(".")],
            "ckpt-distcp-missing": ["__1_0.distcp", "megatron_muon_checksums.json"],
            "ckpt-distcp-truncated": ["megatron_muon_checksums.json"]}[row_id]
    for name in gone:
        (iteration / name).unlink()
    if row_id == "ckpt-distcp-truncated":
        with open(iteration / "__1_0.distcp", "r+b") as f:
            f.truncate((iteration / "__1_0.distcp").stat().st_size // 3)


@pytest.mark.parametrize("row_id", ["ckpt-no-metadata-json", "ckpt-emptied", "ckpt-distcp-missing",
                                    "ckpt-distcp-truncated"])
def test_an_unreadable_checkpoint_is_one_line_before_launch(row_id, megatron_layout_checkpoint, tmp_path,
                                                            hooks_restored):
    """The preflight used to crash on the first two (torch's CheckpointException is a BaseException;
    rc 1 and a 54-line traceback); a job then failed on every rank at the load (FileNotFoundError)."""
    iteration = _copy(megatron_layout_checkpoint, tmp_path)
    _damage(row_id, iteration)
    line = _preflight_refusal(tmp_path)
    assert expected_line(row_id, TMP=str(tmp_path)).fullmatch(line), line
    proc = _preflight("--nproc", "2", str(tmp_path / "tiny.yaml"), *TINY, "--train-iters", "5", "--muon-dp-layout",
                      "megatron", "--load", str(tmp_path / "ckpt"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"megatron-muon: error: {line}\n")


def test_train_iters_below_the_loaded_iteration_is_refused(megatron_layout_checkpoint, tmp_path, hooks_restored):
    _copy(megatron_layout_checkpoint, tmp_path)
    line = _preflight_refusal(tmp_path, "--train-iters", "2", "--override-opt-param-scheduler")
    assert line.startswith("--train-iters 2: below iteration 3, which --load ") and "--train-iters 4 or more" in line


def test_a_layout_change_megatron_core_packing_cannot_load_is_refused_before_launch(megatron_layout_checkpoint,
                                                                                      tmp_path, hooks_restored):
    """A megatron-layout (dp_reshardable) checkpoint resumed with ``--muon-dp-layout balanced``: the
    preflight refuses it with the line the optimizer's load refuses it with, so the startup report
    never calls it "another buffer layout, the same update"; the job refuses it on every rank at
    startup, before any iteration (it used to be 8.5 s in, at the load)."""
    from megatron_muon.megatron.resharding import BALANCED_FROM_DP_RESHARDABLE

    _copy(megatron_layout_checkpoint, tmp_path)
    line = _preflight_refusal(tmp_path, "--muon-dp-layout", "balanced")
    assert line == BALANCED_FROM_DP_RESHARDABLE and expected_line("resume-layout-balanced").fullmatch(line), line
    from entry_harness import launch

    job = launch([*TINY, "--train-iters", "5", "--muon-dp-layout", "balanced", "--load", str(tmp_path / "ckpt")],
                 tmp_path)
    errors = [row for row in job.out.splitlines() if row.startswith("megatron-muon: error: ")]
    assert job.returncode != 0 and errors == [f"megatron-muon: error: {line}"], job.out[-4000:]
    assert " iteration " not in job.out, job.out[-4000:]
    # with fresh optimizer state nothing of the old layout is read: allowed, and the report says what changed
    from megatron_muon.megatron import resume_config
    from megatron_muon.megatron.preflight import check_command_line

    check_command_line(str(tmp_path / "tiny.yaml"), [*TINY, "--train-iters", "5", "--load", str(tmp_path / "ckpt"),
                                                     "--muon-reset-optimizer-state",
                                                     "--override-opt-param-scheduler"], 2)
    assert resume_config.report_lines() is not None


def test_a_changed_schedule_without_saying_which_is_refused(megatron_layout_checkpoint, tmp_path, hooks_restored):
    """Row resume-schedule-changed: a longer --train-iters (the saved run's 3, TINY's --lr-decay-iters 20
    both times) changes the weight decay schedule's length; Megatron's scheduler asserted after the
    load, on every rank. Either flag that says which schedule to keep lets it through, as does the
    saved length."""
    from megatron_muon.megatron.preflight import check_command_line

    _copy(megatron_layout_checkpoint, tmp_path)
    line = _preflight_refusal(tmp_path)  # --train-iters 5
    assert expected_line("resume-schedule-changed").fullmatch(line), line
    line = _preflight_refusal(tmp_path, "--lr", "0.03")
    assert line.startswith("--lr: this run's lr / weight decay schedule differs from the checkpoint's (learning rate: "
                           "0.02 -> 0.03)"), line
    load = [*TINY, "--muon-dp-layout", "megatron", "--load", str(tmp_path / "ckpt")]
    for extra in (["--train-iters", "5", "--override-opt-param-scheduler"],
                  ["--train-iters", "5", "--use-checkpoint-opt_param-scheduler"], ["--train-iters", "3"]):
        check_command_line(str(tmp_path / "tiny.yaml"), [*load, *extra], 2)
