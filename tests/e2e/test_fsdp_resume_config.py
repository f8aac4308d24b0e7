"""A changed configuration on resume from a Megatron-FSDP checkpoint (``--ckpt-format fsdp_dtensor``):
exact and reported, or refused in one line (megatron/resume_config.py reads its ``args`` item).

One real checkpoint, written by ``scripts/pretrain_gpt.py`` under torchrun with the demo config
(``configs/tiny-cpu-fsdp.yaml``: TP1 x DP2, ``optim_grads_params``, bf16, no dropout, the byte
vocabulary 257 padded to 384 rows), 5 iterations saved after the 3rd. Every case resumes from
iteration 3 (``--ckpt-step 3``):

* through the preflight (``preflight.check_command_line``, in this process): what is refused and
  what the startup report lists as changed;
* through one real job: TP1 x DP2 -> TP2 x DP1 with ``--make-vocab-size-divisible-by 64`` (384
  rows at both sizes) logs the uninterrupted run's iteration 4 loss and grad norms. With the
  default divisor (512 rows at TP2) Megatron used to fail at load on every rank (``ValueError: Size
  mismatch between saved torch.Size([384, 64]) and current: torch.Size([512, 64])``).

About 40 s on 2 cores (two torchrun jobs).
"""

from __future__ import annotations

import re

import pytest
from bad_inputs_table import expected_line
from entry_harness import REPO, launch

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")
CONFIG = REPO / "configs" / "tiny-cpu-fsdp.yaml"


def _common(root) -> list[str]:
    return ["--train-iters", "5", "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--log-interval", "1",
            "--eval-iters", "0", "--train-data-path", str(root / "data" / "train_text_document"),
            "--valid-data-path", str(root / "data" / "valid_text_document"), "--save", str(root / "out")]


def _config() -> list[str]:
    """The demo config's flags without its --save / --load (each test names its own)."""
    from megatron_muon.megatron.yaml_config import load_yaml_args

    flags = load_yaml_args(CONFIG)
    drop = {i + d for i, word in enumerate(flags) if word in ("--save", "--load") for d in (0, 1)}
    return [word for i, word in enumerate(flags) if i not in drop]


def _job(root, *extra: str) -> str:
    job = launch([*_config(), *_common(root), *extra], root,
                 env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None))  # Megatron-FSDP refuses it
    assert job.returncode == 0, job.out[-4000:]
    return job.out


def _rows(out: str) -> dict[int, tuple[float, float]]:
    return {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(out)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, demo_data):
    """(root, the uninterrupted run's {iteration: (loss, grad norm)}); the checkpoint in root/ckpt."""
    root = tmp_path_factory.mktemp("fsdp_resume_config")
    (root / "data").symlink_to(demo_data)
    out = _job(root, "--save", str(root / "ckpt"), "--save-interval", "3")
    assert "in fsdp_dtensor format" in out and "resume from" not in out
    return root, _rows(out)


def _preflight(root, *extra: str, nproc: int = 2) -> list[str] | None:
    from megatron_muon.megatron import resume_config
    from megatron_muon.megatron.preflight import check_command_line

    check_command_line(str(CONFIG), [*_common(root), "--load", str(root / "ckpt"), "--ckpt-step", "3", *extra], nproc)
    return resume_config.report_lines()


def _refusal(root, *extra: str) -> str:
    with pytest.raises(ValueError) as info:
        _preflight(root, *extra)
    return str(info.value)


@pytest.fixture
def fsdp_env(hooks_restored, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def test_read_saved_reads_the_args_item_only(saved):
    from megatron_muon.megatron.resume_config import read_saved

    root, _ = saved
    got = read_saved(root / "ckpt" / "iter_0000003")
    assert got.content_metadata == {"distrib_optim_sharding_type": "fsdp_dtensor"}
    assert (got.get("ckpt_format"), got.get("tensor_model_parallel_size"), got.get("data_parallel_size"),
            got.get("data_parallel_sharding_strategy"), got.get("padded_vocab_size"),
            got.get("megatron_muon")) == ("fsdp_dtensor", 1, 2, "optim_grads_params", 384, True)


def test_same_settings_and_honoured_changes_are_reported(saved, fsdp_env):
    root, _ = saved
    head = f"  resume from {root}/ckpt/iter_0000003"
    assert _preflight(root) == [f"{head}: same settings as the checkpoint"]
    assert _preflight(root, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64") == [
        f"{head}: changed against the checkpoint's settings:",
        "    TP 1 -> 2: resharded exactly (only the order of sums changes); the padded vocabulary is 384 rows at "
        "both sizes",
        "    DP 2 -> 1: resharded exactly (only the order of sums changes)"]
    for strategy in ("optim", "optim_grads"):
        assert _preflight(root, "--data-parallel-sharding-strategy", strategy)[1:] == [
            f"    --data-parallel-sharding-strategy optim_grads_params -> {strategy}: resharded exactly (one DTensor "
            "per param in the checkpoint; only the order of sums changes)"]
    assert _preflight(root, nproc=1)[1:] == ["    DP 2 -> 1: resharded exactly (only the order of sums changes)"]


def test_what_megatron_would_fail_on_is_refused(saved, fsdp_env):
    root, _ = saved
    line = _refusal(root, "--tensor-model-parallel-size", "2")
    assert line.startswith("--tensor-model-parallel-size 2 with --make-vocab-size-divisible-by 128: the padded "
                           "vocabulary would be 512 rows, but ") and line.endswith(
        "padded to 384 (Megatron-FSDP's load would fail on a size mismatch on every rank); pass "
        "--make-vocab-size-divisible-by 64 (TP2 x 64 pads it to 384 rows again)"), line
    line = _refusal(root, "--no-load-optim")
    assert expected_line("resume-fsdp-no-optim").fullmatch(line), line
    assert _refusal(root, "--finetune").startswith("--finetune with --use-megatron-fsdp: "), line
    line = _refusal(root, "--data-parallel-sharding-strategy", "no_shard")
    assert expected_line("fsdp-no-shard-checkpoint").fullmatch(line), line
    line = _refusal(root, "--optimizer", "adam")
    assert line.endswith("resume with --optimizer muon (an fsdp_dtensor checkpoint loads only with its optimizer "
                         "state: neither --muon-reset-optimizer-state nor --no-load-optim reads one)"), line
    assert _refusal(root, "--hidden-size", "128").startswith("--hidden-size: this command line has hidden_size = 128")


def test_tp_and_dp_change_is_exact_in_the_job(saved):
    root, uninterrupted = saved
    out = _job(root, "--load", str(root / "ckpt"), "--ckpt-step", "3", "--tensor-model-parallel-size", "2",
               "--make-vocab-size-divisible-by", "64")
    assert "TP 1 -> 2: resharded exactly" in out and "DP 2 -> 1: resharded exactly" in out, out[-4000:]
    rows = _rows(out)
    assert sorted(rows) == [4, 5], out[-4000:]
    # measured: iteration 4 at 5.709785 vs 5.709832 uninterrupted (TP2's order of sums in bf16), the
    # grad norms within the printed 3 decimals' last digit
    assert rows[4][0] == pytest.approx(uninterrupted[4][0], rel=5e-5), (rows, uninterrupted)
    for it in (4, 5):
        assert rows[it][1] == pytest.approx(uninterrupted[it][1], abs=2e-3), (rows, uninterrupted)
