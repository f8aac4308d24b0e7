"""A changed configuration on resume is exact or refused in one line (megatron/resume_config.py).

One real checkpoint, written by ``scripts/pretrain_gpt.py`` under torchrun (2 gloo ranks, TP2 x
DP1, the tiny GPT of ``test_pretrain`` without dropout, the byte vocabulary 257 padded to 512
rows), 5 iterations saved after the 3rd; and one written with ``--optimizer adam`` (1 iteration).
Every case resumes from iteration 3 (``--ckpt-step 3``):

* through the preflight (``preflight.check_command_line``, in this process, rank 0 of 2: no
  torchrun): what is refused, with the line of docs/bad_inputs.md, and what the startup report will
  list as changed;
* through a real job, the two the issue measured: TP2 -> TP1 with ``--make-vocab-size-divisible-by
  256`` (512 rows at both sizes) logs the uninterrupted run's iteration 4 loss and grad norms, and
  TP1 with the default divisor (384 rows: the job used to log 5.0636 instead of 5.3351 at iteration
  4) is refused on every rank with one line and exit code 2 before any iteration.

About a minute on 2 cores (three torchrun jobs and the fixtures' two).
"""

from __future__ import annotations

import re
import types

import pytest
from bad_inputs_table import expected_line
from entry_harness import TINY, launch

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]  # iteration losses comparable across runs
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")
ERROR = re.compile(r"^megatron-muon: error: (.*)$", re.MULTILINE)


def _rows(out: str) -> dict[int, tuple[float, float]]:
    return {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(out)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, the uninterrupted run's {iteration: (loss, grad norm)})."""
    root = tmp_path_factory.mktemp("resume_config")
    job = launch([*TINY, *NO_DROPOUT, "--train-iters", "5", "--log-interval", "1", "--save-interval", "3",
                  "--save", str(root / "ckpt")], root)
    out = job.out
    assert job.returncode == 0, out[-4000:]
    assert "resume from" not in out  # a fresh run: nothing to compare
    (root / "tiny.yaml").write_text("distributed_backend: gloo\n")  # the preflight's config; TINY comes after
    return root, _rows(out)


@pytest.fixture(scope="module")
def adam_saved(saved):
    root = saved[0]
    job = launch([*TINY, *NO_DROPOUT, "--optimizer", "adam", "--train-iters", "1", "--save-interval", "1",
                  "--save", str(root / "adam")], root)
    assert job.returncode == 0, job.out[-4000:]
    return root / "adam"


def _resume(root, *extra: str, load: str = "ckpt", step: int = 3) -> list[str]:
    return [*TINY, *NO_DROPOUT, "--train-iters", "5", "--log-interval", "1", "--load", str(root / load),
            "--ckpt-step", str(step), *extra]


def _preflight(root, *extra: str, **kw) -> list[str] | None:
    """The preflight's check of a resume with ``extra``: the startup report's resume lines."""
    from megatron_muon.megatron import resume_config
    from megatron_muon.megatron.preflight import check_command_line

    check_command_line(str(root / "tiny.yaml"), _resume(root, *extra, **kw), 2)
    return resume_config.report_lines()


def _refusal(root, *extra: str, **kw) -> str:
    with pytest.raises(ValueError) as info:
        _preflight(root, *extra, **kw)
    return str(info.value)


def test_same_settings_pass_and_the_report_says_so(saved, hooks_restored):
    root, _ = saved
    assert _preflight(root) == [f"  resume from {root}/ckpt/iter_0000003: same settings as the checkpoint"]


def test_tp_change_with_unequal_padding_is_refused(saved, hooks_restored):
    root, _ = saved
    line = _refusal(root, "--tensor-model-parallel-size", "1")
    assert expected_line("resume-vocab", TMP=str(root)).fullmatch(line), line
    # the same padded size with another divisor at the same TP: 257 -> 384 at TP2 x 64
    line = _refusal(root, "--make-vocab-size-divisible-by", "64")
    assert "would be 384 rows" in line and "pass --make-vocab-size-divisible-by 128 (TP2 x 128" in line, line


def test_honoured_changes_are_listed(saved, hooks_restored):
    root, _ = saved
    lines = _preflight(root, "--tensor-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256")
    assert lines[1:] == ["    TP 2 -> 1: resharded exactly (only the order of sums changes); the padded vocabulary is "
                         "512 rows at both sizes",
                         "    DP 1 -> 2: resharded exactly (only the order of sums changes)"], lines
    lines = _preflight(root, "--muon-tp-mode", "duplicated", "--muon-dp-layout", "megatron", "--muonbp-period", "2",
                       "--muon-momentum", "0.9")
    assert lines == [
        f"  resume from {root}/ckpt/iter_0000003: changed against the checkpoint's settings:",
        "    --muon-dp-layout priced -> megatron: another buffer layout, the same update (the state is read per "
        "param)",
        "    --muon-tp-mode owner -> duplicated: how Newton-Schulz runs only, the same update",
        "    --muonbp-period off -> 2: from the checkpoint's step count t on, a full step when t % 2 == 0",
        "    --muon-momentum (muon_momentum) 0.95 -> 0.9: used from the next step on"], lines
    assert "blockwise orthogonalizes each TP shard on its own" in _preflight(root, "--muon-tp-mode", "blockwise")[1]


@pytest.mark.parametrize("flag,value", [("--ffn-hidden-size", "256"), ("--hidden-size", "128"),
                                        ("--num-layers", "4"), ("--num-attention-heads", "8")])
def test_model_shape_change_is_refused(saved, hooks_restored, flag, value):
    root, _ = saved
    line = _refusal(root, flag, value)
    if flag == "--ffn-hidden-size":
        assert expected_line("resume-shape", TMP=str(root)).fullmatch(line), line
    name = flag[2:].replace("-", "_")
    assert line.startswith(f"{flag}: this command line has {name} = {value}, but {root}/ckpt/iter_0000003 was saved "
                           f"with {name} = "), line


def test_optimizer_change_is_refused_unless_the_state_is_not_loaded(saved, adam_saved, hooks_restored):
    root, _ = saved
    line = _refusal(root, "--optimizer", "adam")
    assert expected_line("resume-muon-to-adam", TMP=str(root)).fullmatch(line), line
    line = _refusal(root, load="adam", step=1)
    assert expected_line("resume-adam-to-muon", TMP=str(root)).fullmatch(line), line
    assert _preflight(root, "--no-load-optim", load="adam", step=1) is not None
    _preflight(root, "--optimizer", "adam", "--no-load-optim")


def test_upstream_muon_checkpoint_points_at_the_migration(saved):
    """A checkpoint of megatron-core's own --optimizer muon records no megatron-muon settings: this
    checkpoint's real args without them."""
    from megatron_muon.megatron.errors import UserInputError
    from megatron_muon.megatron.resume_config import check_optimizer_change, read_saved

    root, _ = saved
    upstream = read_saved(root / "ckpt" / "iter_0000003")
    del upstream.args.megatron_muon
    args = types.SimpleNamespace(optimizer="muon", no_load_optim=None, finetune=False)
    with pytest.raises(UserInputError) as info:
        check_optimizer_change(args, upstream, plugin=True)
    assert expected_line("ckpt-upstream-muon", TMP=str(root)).fullmatch(str(info.value)), info.value
    check_optimizer_change(types.SimpleNamespace(optimizer="muon", no_load_optim=True), upstream, plugin=True)


def test_tp_change_with_equal_padding_is_exact_in_the_job(saved):
    root, uninterrupted = saved
    job = launch(_resume(root, "--tensor-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256"), root)
    out = job.out
    assert job.returncode == 0, out[-4000:]
    assert "TP 2 -> 1: resharded exactly" in out and "DP 1 -> 2: resharded exactly" in out, out[-4000:]
    rows = _rows(out)
    assert sorted(rows) == [4, 5], out[-4000:]
    # Iteration 4's loss is the loaded weights' (every vocabulary row included): observed equal to
    # all printed digits; grad norms to the printed 3 decimals. The refused padding was 0.27 off.
    assert rows[4][0] == pytest.approx(uninterrupted[4][0], rel=1e-5), (rows, uninterrupted)
    for it in (4, 5):
        assert rows[it][1] == pytest.approx(uninterrupted[it][1], abs=2e-3), (rows, uninterrupted)


def test_tp_change_with_unequal_padding_is_refused_in_the_job(saved):
    root, _ = saved
    job = launch(_resume(root, "--tensor-model-parallel-size", "1"), root)
    out = job.out
    errors = ERROR.findall(out)
    assert job.returncode != 0 and len(errors) == 1, out[-4000:]  # rank 0's line only
    assert expected_line("resume-vocab", TMP=str(root)).fullmatch(errors[0]), errors
    # Exit code 2 on rank 0, the rank that prints (the launcher stops the others, which wait for it)
    assert (job.rank_codes[0] == 2 if job.rank_codes else "exitcode  : 2" in out) and not _rows(out), out[-4000:]
