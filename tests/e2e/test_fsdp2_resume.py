"""torch FSDP2 checkpoints through Megatron's own loop (``scripts/pretrain_gpt.py`` under torchrun).

The FSDP2 demo config (``configs/tiny-cpu-fsdp2.yaml``: TP1 x DP2, bf16, no dropout) trains 6
iterations with ``--ckpt-format torch_dist``, saving after the 3rd. Megatron loads an FSDP2 torch_dist
checkpoint in place and never calls the optimizer's ``load_state_dict`` (``skip_load_to_model_and_opt``);
the ``load_checkpoint`` hook restores what that method would (``checkpoint.restore_in_place_load``).

* A resume from iteration 3 logs the uninterrupted run's losses and grad norms, to every printed digit
  (iteration 5's loss line excepted: Megatron logs a process's first iteration without resetting its
  loss accumulator, so the next line is the mean of two; docs/checkpoints.md). Before, iteration 5's
  update differed (measured 5.443 against 5.284 on the 3 + 3 demo).
* ``--muon-reset-optimizer-state``: iteration 4's forward runs on the loaded weights (its loss is the
  uninterrupted run's), and the update after it starts from fresh optimizer state (a different
  iteration 4 grad-norm-free result: iteration 6 differs).
* At DP1 (one process) the checkpoint of DP2 resumes: iteration 4's loss is the uninterrupted run's (the
  weights are; the loss of the whole batch in one process sums in another order).
* The preflight's resume report and refusals (``resume_config``) for an FSDP2 checkpoint, and a
  checkpoint of the distributed optimizer resumed under FSDP2 and the reverse (refused in one line;
  megatron-core 0.19.2 fails inside the load).

About 2.5 min on 2 cores (six torchrun jobs).
"""

from __future__ import annotations

import re

import pytest
from bad_inputs_table import expected_line
from entry_harness import REPO, launch

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")
CONFIG = REPO / "configs" / "tiny-cpu-fsdp2.yaml"
RESTORED = re.compile(r"megatron-muon: --use-torch-fsdp2: Megatron loaded the optimizer's tensors in place; its step "
                      r"(\S+) and muon_steps (\d+) restored from \S+")


def _common(root) -> list[str]:
    return ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--log-interval", "1",
            "--eval-iters", "0", "--ckpt-format", "torch_dist", "--muonbp-period", "3",
            "--train-data-path", str(root / "data" / "train_text_document"),
            "--valid-data-path", str(root / "data" / "valid_text_document"), "--save", str(root / "out"),
            "--save-interval", "100"]


def _config(config=CONFIG) -> list[str]:
    from megatron_muon.megatron.yaml_config import load_yaml_args

    return load_yaml_args(config)


def _wrapped(root, wrapper: str):
    """The demo config with another wrapper than FSDP2 (``use_distributed_optimizer: true`` or
    ``false``): the same model, data and schedule."""
    path = root / f"{wrapper}.yaml"
    text = CONFIG.read_text()
    assert "\nuse_torch_fsdp2: true\n" in text
    flag = "true" if wrapper == "zero1" else "false"
    path.write_text(text.replace("\nuse_torch_fsdp2: true\n", f"\nuse_distributed_optimizer: {flag}\n"))
    return path


def _job(root, *extra: str, nproc: int = 2, config=CONFIG) -> str:
    job = launch([*_config(config), *_common(root), *extra], root, nproc=nproc,
                 env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None), timeout=400)  # FSDP2 refuses the variable
    assert job.returncode == 0, job.out[-6000:]
    return job.out


def _rows(out: str) -> dict[int, tuple[str, str]]:
    """iteration -> (loss, grad norm) as printed (strings: compared to every printed digit)."""
    return {int(m[1]): (m[2], m[3]) for m in ITERATION.finditer(out)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, demo_data):
    """(root, the uninterrupted run's rows); the checkpoint of iteration 3 in root/ckpt."""
    root = tmp_path_factory.mktemp("fsdp2_resume")
    (root / "data").symlink_to(demo_data)
    out = _job(root, "--save", str(root / "ckpt"), "--save-interval", "3")
    assert "torch FSDP2 layout" in out and "resume from" not in out
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6], out[-4000:]
    return root, rows


def _resume(root, *extra: str, nproc: int = 2) -> str:
    return _job(root, "--load", str(root / "ckpt"), "--ckpt-step", "3", *extra, nproc=nproc)


def test_resume_logs_the_uninterrupted_run(saved):
    root, uninterrupted = saved
    out = _resume(root)
    restored = RESTORED.search(out)
    assert restored and (float(restored[1]), int(restored[2])) == (3.0, 3), out[-4000:]
    rows = _rows(out)
    assert sorted(rows) == [4, 5, 6], out[-4000:]
    for it in (4, 5, 6):  # grad norms: every iteration; losses: not 5 (the first-iteration accumulator)
        assert rows[it][1] == uninterrupted[it][1], (it, rows, uninterrupted)
    for it in (4, 6):
        assert rows[it][0] == uninterrupted[it][0], (it, rows, uninterrupted)


def test_reset_optimizer_state_keeps_the_weights_only(saved):
    root, uninterrupted = saved
    out = _resume(root, "--muon-reset-optimizer-state")
    assert "--muon-reset-optimizer-state: weights, iteration and LR/WD schedule from" in out, out[-4000:]
    assert not RESTORED.search(out)
    rows = _rows(out)
    assert rows[4] == uninterrupted[4]  # the loaded weights' forward and gradient
    assert rows[6] != uninterrupted[6]  # fresh momentum and Adam moments since


def test_dp_change_resumes(saved):
    root, uninterrupted = saved
    out = _resume(root, nproc=1)
    assert RESTORED.search(out), out[-4000:]
    rows = _rows(out)
    # the saved weights; the whole batch's loss in one process: another order of sums (bf16 model)
    assert float(rows[4][0]) == pytest.approx(float(uninterrupted[4][0]), rel=1e-5), (rows, uninterrupted)
    for it in (4, 5, 6):
        assert float(rows[it][1]) == pytest.approx(float(uninterrupted[it][1]), abs=2e-3), (rows, uninterrupted)


# ----------------------------------------------------------------------------- the preflight


def _preflight(root, *extra: str, nproc: int = 2, config=CONFIG, load: str = "ckpt"):
    from megatron_muon.megatron import resume_config
    from megatron_muon.megatron.preflight import check_command_line

    check_command_line(str(config), [*_common(root), "--load", str(root / load), "--ckpt-step", "3", *extra], nproc)
    return resume_config.report_lines()


def _refusal(root, *extra: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        _preflight(root, *extra, **kwargs)
    return str(info.value)


@pytest.fixture
def fsdp2_env(hooks_restored, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def test_preflight_reports_and_refuses_as_for_the_other_wrappers(saved, fsdp2_env):
    """resume_config reads an FSDP2 torch_dist checkpoint's args as any other: the same settings and a DP
    change reported, a TP change with the padded vocabulary kept reported, model shapes, another
    optimizer and another padded vocabulary refused; the optimizer state's form checked against the
    run's wrapper (DDP without the distributed optimizer reads FSDP2's: measured, iteration 4 logged
    the uninterrupted run's loss)."""
    root, _ = saved
    head = f"  resume from {root}/ckpt/iter_0000003"
    assert _preflight(root) == [f"{head}: same settings as the checkpoint"]
    assert _preflight(root, nproc=1)[1:] == ["    DP 2 -> 1: resharded exactly (only the order of sums changes)"]
    assert _preflight(root, config=_wrapped(root, "ddp"))[1:] == [
        "    --use-torch-fsdp2 -> DDP without --use-distributed-optimizer: read exactly (both keep the optimizer "
        "state per param; only the order of sums changes)"]
    assert _refusal(root, "--hidden-size", "128").startswith("--hidden-size: this command line has hidden_size = 128")
    assert _refusal(root, "--optimizer", "adam").startswith("--optimizer adam: ")
    assert _refusal(root, "--tensor-model-parallel-size", "2").startswith(
        "--tensor-model-parallel-size 2 with --make-vocab-size-divisible-by 128: the padded vocabulary would be 512")
    line = _refusal(root, config=_wrapped(root, "zero1"))
    assert expected_line("resume-fsdp2-to-zero1", TMP=str(root)).fullmatch(line), line
    assert _preflight(root, "--muon-reset-optimizer-state", config=_wrapped(root, "zero1"))[1:] == []


def test_zero1_checkpoint_under_fsdp2(saved, fsdp2_env):
    """A ZeRO-1 checkpoint of the same model resumed under FSDP2: refused in one line before the load
    (Megatron: ``KeyError: "optimizer.state.momentum_buffer... from model not in state dict"`` on
    every rank); with --muon-reset-optimizer-state its weights resume (iteration 4's loss is the
    ZeRO-1 run's)."""
    root, _ = saved
    out = _job(root, "--save", str(root / "zero1"), "--save-interval", "3", config=_wrapped(root, "zero1"))
    zero1 = _rows(out)
    line = _refusal(root, load="zero1")
    assert expected_line("resume-zero1-to-fsdp2", TMP=str(root)).fullmatch(line), line
    out = _job(root, "--load", str(root / "zero1"), "--ckpt-step", "3", "--muon-reset-optimizer-state")
    assert "--muon-reset-optimizer-state: weights, iteration and LR/WD schedule from" in out, out[-4000:]
    assert _rows(out)[4][0] == zero1[4][0]


def test_uneven_dp_is_refused_at_startup(tmp_path, demo_data):
    """DP3: the demo's 64-element norms (and 64-row matrices) cut unevenly; refused at the optimizer's
    build, before the first iteration (megatron-core 0.19.2's save would fail at the first save,
    after training up to it)."""
    (tmp_path / "data").symlink_to(demo_data)
    job = launch([*_config(), *_common(tmp_path), "--global-batch-size", "6"], tmp_path, nproc=3,
                 env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None), timeout=400)
    assert job.returncode == 2, job.out[-4000:]
    line = ("megatron-muon: error: --use-torch-fsdp2 with --save / --load at DP 3: "
            "module.module.decoder.layers.0.input_layernorm.weight has 64 rows (shape (64,))")
    assert line in job.out, job.out[-4000:]
    assert "iteration        1/" not in job.out
