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
* The preflight's resume report and refusals (``resume_config``) for an FSDP2 checkpoint.

About 90 s on 2 cores (four torchrun jobs).
"""

from __future__ import annotations

import re

import pytest
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


def _config() -> list[str]:
    from megatron_muon.megatron.yaml_config import load_yaml_args

    return load_yaml_args(CONFIG)


def _job(root, *extra: str, nproc: int = 2) -> str:
    job = launch([*_config(), *_common(root), *extra], root, nproc=nproc,
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
