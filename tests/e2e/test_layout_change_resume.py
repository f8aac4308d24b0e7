"""A resume at another EP, expert-TP or virtual-stage layout: exact, or refused in one line (issue 40).

megatron-core compares TP and PP with the checkpoint's, and nothing else of the layout
(megatron/resume_layout.py). Through ``scripts/pretrain_gpt.py`` (``entry_harness``), 2 gloo ranks:

* **EP**, ``configs/moe-tiny-cpu.yaml`` as the user ran it (EP2: dense DP2, expert-DP1, a chain of
  two optimizers), 6 iterations saved after the 3rd, resumed with ``--expert-model-parallel-size 1``
  (expert-DP2: the experts' params are no longer expert-parallel, and one optimizer holds them).
  Before ``checkpoint.rechain_loaded_state`` both ranks died in the load with ``KeyError:
  'optimizer'`` (without the distributed optimizer: ``ValueError: Could not find parameter
  group``), after a report of "same settings as the checkpoint".

  - The round trip, with the distributed optimizer and without: an EP1 job loads iteration 3 and
    saves it again without training (``--train-iters 3``: Megatron's end-of-training save), an EP2
    job loads that: iterations 4 to 6 log the uninterrupted run's losses and grad norms to every
    printed digit. The arithmetic is the uninterrupted run's, in its order, on the state the EP1 job
    wrote, so any difference would be the state's: the EP1 load and save kept it bit for bit (what
    the Megatron world of ``tests/megatron/test_moe_resharding.py`` checks tensor by tensor). A lost
    momentum shows: resumed with fresh optimizer state, iteration 5's grad norm is 4.835 instead of
    4.760, iteration 6's loss 5.846172 instead of 5.844146.
  - The EP1 job trains on as well, within rounding of the uninterrupted run.
  - The startup report names the EP, expert-DP and expert-TP changes; the job prints it.
  - Refused in one line, before anything is built, where the state cannot move: the optimizer
    state in ``dp_reshardable`` (``--muon-dp-layout megatron``; Megatron's load fails on a missing
    bucket key), and a ``--ckpt-format torch`` checkpoint (a file per rank: Megatron prints 'could
    not load the checkpoint' and exits 0).
* **Virtual pipeline stages**: the tiny GPT at TP1 x PP2 x VPP2 (4 layers, one per chunk), saved
  with ``--dist-ckpt-optim-fully-reshardable``, round-tripped through PP2 without virtual stages the
  same way (the report names the change); saved in ``dp_reshardable`` (``--muon-dp-layout
  megatron``), the change is refused.

About 2 minutes on 2 cores (11 jobs of a few seconds each).
"""

from __future__ import annotations

import re

import pytest
import yaml
from bad_inputs_table import expected_line
from entry_harness import REPO, TINY, launch, logged_rows

ERROR = re.compile(r"^megatron-muon: error: (.*)$", re.MULTILINE)
RESUMED = [4, 5, 6]
# Megatron's training_log keeps its loss accumulator across a resumed process's first logged
# iteration, so iteration 5's line is the mean of iterations 4 and 5 (tests/e2e/test_hybrid_pretrain.py):
# the losses compared as printed are 4's and 6's; every grad norm is its own iteration's.
SAME_LOSS = (4, 6)
# The schedule the config trains with (200 iterations), so that 6 iterations and a resume of them
# agree; the LR is still warming up (3e-3 over 20 iterations).
SCHEDULE = ["--lr-decay-iters", "200", "--eval-iters", "0", "--log-interval", "1"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory, demo_data):
    """(root, the MoE config's argv, the uninterrupted EP2 run's logged rows); root/ep2 holds its
    checkpoints of iterations 3 and 6."""
    root = tmp_path_factory.mktemp("layout_change")
    (root / "data").symlink_to(demo_data)
    config = yaml.safe_load((REPO / "configs" / "moe-tiny-cpu.yaml").read_text())
    config.update(train_data_path=[str(root / "data" / "train_text_document")],
                  valid_data_path=[str(root / "data" / "valid_text_document")], save=None, load=None)
    (root / "moe.yaml").write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
    from megatron_muon.megatron.yaml_config import load_yaml_args

    argv = load_yaml_args(root / "moe.yaml")
    return root, argv, _uninterrupted(root, argv, "ep2")


@pytest.fixture(scope="module")
def moe_plain(moe):
    """``moe`` without the distributed optimizer (Megatron's FP32Optimizer, whose state dict is the
    inner optimizer's own): root/plain-ep2."""
    root, argv, _ = moe
    argv = [a for a in argv if a != "--use-distributed-optimizer"]
    return root, argv, _uninterrupted(root, argv, "plain-ep2")


def _uninterrupted(root, argv: list[str], name: str) -> dict:
    """The EP2 run of 6 iterations, saved after the 3rd and 6th in root/name: its logged rows."""
    job = launch([*argv, *SCHEDULE, "--train-iters", "6", "--save-interval", "3", "--save", str(root / name)], root)
    assert job.returncode == 0, job.out[-4000:]
    assert "experts: EP 2 x expert-TP 1 x expert-DP 1" in job.out and "resume from" not in job.out
    return logged_rows(job.out)


def _report(out: str) -> list[str]:
    """The startup report's resume lines, as the job printed them (rank 0)."""
    return [line.strip() for line in out.splitlines() if line.startswith("    ") and " -> " in line
            or line.startswith("  resume from ")]


def _assert_as_uninterrupted(rows: dict, uninterrupted: dict, out: str) -> None:
    """Every resumed iteration's grad norm, and the losses of ``SAME_LOSS``, as printed."""
    assert sorted(rows) == RESUMED, out[-4000:]
    for it in RESUMED:
        assert rows[it][2] == uninterrupted[it][2], (it, rows, uninterrupted)
    for it in SAME_LOSS:
        assert rows[it][1] == uninterrupted[it][1], (it, rows, uninterrupted)


@pytest.mark.parametrize("run", ["moe", "moe_plain"])
def test_ep_change_round_trip_is_bitwise(run, request):
    """EP2 -> EP1 (saved again at once) -> EP2: iterations 4-6 log the uninterrupted run's digits;
    with the distributed optimizer (``moe``) and without (``moe_plain``)."""
    root, argv, uninterrupted = request.getfixturevalue(run)
    saved, there_dir = ("ep2", "ep1") if run == "moe" else ("plain-ep2", "plain-ep1")
    # --override-opt-param-scheduler: the schedule from the flags (the same as saved), not the
    # checkpoint's, whose weight-decay horizon is --train-iters x batch (3 here, 6 in the next job)
    there = launch([*argv, *SCHEDULE, "--train-iters", "3", "--load", str(root / saved), "--ckpt-step", "3",
                    "--expert-model-parallel-size", "1", "--save", str(root / there_dir), "--save-interval", "1000",
                    "--override-opt-param-scheduler"], root)
    assert there.returncode == 0, there.out[-4000:]
    assert _report(there.out) == [
        f"resume from {root}/{saved}/iter_0000003: changed against the checkpoint's settings:",
        "EP 2 -> 1: resharded exactly (experts are saved under their global number); the expert optimizer's state "
        "is read into the dense optimizer, which holds the experts now",
        "expert-DP 1 -> 2: resharded exactly (only the order of sums changes)"], there.out[-4000:]
    assert (root / there_dir / "iter_0000003").is_dir() and not logged_rows(there.out), there.out[-4000:]
    back = launch([*argv, *SCHEDULE, "--train-iters", "6", "--load", str(root / there_dir),
                   "--override-opt-param-scheduler"], root)
    assert back.returncode == 0, back.out[-4000:]
    assert _report(back.out)[1:] == [
        "EP 1 -> 2: resharded exactly (experts are saved under their global number); the experts' state in the "
        "dense optimizer is read into an expert optimizer of their own",
        "expert-DP 2 -> 1: resharded exactly (only the order of sums changes)"], back.out[-4000:]
    _assert_as_uninterrupted(logged_rows(back.out), uninterrupted, back.out)


def test_ep_change_trains_on_as_uninterrupted_within_rounding(moe):
    """The user's resume: EP2's iteration 3 at EP1, trained on to iteration 6."""
    root, argv, uninterrupted = moe
    job = launch([*argv, *SCHEDULE, "--train-iters", "6", "--load", str(root / "ep2"), "--ckpt-step", "3",
                  "--expert-model-parallel-size", "1"], root)
    assert job.returncode == 0, job.out[-4000:]
    rows = logged_rows(job.out)
    assert sorted(rows) == RESUMED, job.out[-4000:]
    # fp32, u = 2^-24 = 6e-8. At EP1 every rank runs all 4 experts on its own tokens where EP2 ran 2
    # on both ranks' gathered tokens, and all-reduces the expert grads over expert-DP2: the same dot
    # products (over hidden 64, the experts' ffn 128, the 512 tokens of a grad) in GEMMs of other
    # shapes and sums in another order, each off by about 2·√n·u of its partial sums (Higham & Mary's
    # probabilistic bound, tests/rounding_bounds.py's model): ≤ 2.7e-6 relative for n = 512.
    # Iteration 4's loss is the loaded weights' (1-Lipschitz in each logit, which such errors reach
    # through 2 layers): 1e-5 relative. A grad norm is printed to 3 decimals (two prints 1e-3 apart
    # at most) and moves by the reordered sums' 2.7e-6 relative plus, after a step, the update's
    # rounding (lr 7.5e-4 x Newton-Schulz's fp32 error, ≤ 1e-3 per entry over five steps in that
    # model): 2e-3. A lost momentum moves iteration 5's grad norm by 0.075 (a fresh-state resume).
    assert float(rows[4][1]) == pytest.approx(float(uninterrupted[4][1]), rel=1e-5), (rows, uninterrupted)
    for it in RESUMED:
        assert float(rows[it][2]) == pytest.approx(float(uninterrupted[it][2]), abs=2e-3), (rows, uninterrupted)


def _preflight(root, argv_yaml: str, *extra: str) -> list[str]:
    """The preflight's startup-report lines for ``extra`` (rank 0 of 2, in this process)."""
    from megatron_muon.megatron import resume_config
    from megatron_muon.megatron.preflight import check_command_line

    check_command_line(argv_yaml, [*SCHEDULE, "--train-iters", "6", *extra], 2)
    return [line.strip() for line in resume_config.report_lines()]


def _refusal(root, argv_yaml: str, *extra: str) -> str:
    with pytest.raises(ValueError) as info:
        _preflight(root, argv_yaml, *extra)
    return str(info.value)


def test_expert_tp_change_is_reported(moe, hooks_restored):
    """EP2 -> EP1 with expert-TP 1 -> 2 (expert-DP stays 1): the experts keep an optimizer of their own."""
    root, _, _ = moe
    lines = _preflight(root, str(root / "moe.yaml"), "--load", str(root / "ep2"), "--ckpt-step", "3",
                       "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "2")
    assert lines[1:] == ["EP 2 -> 1: resharded exactly (experts are saved under their global number)",
                         "expert-TP 1 -> 2: resharded exactly (experts are saved under their global number; only the "
                         "order of sums changes)"], lines


def test_ep_change_of_a_dp_reshardable_state_is_refused(moe, hooks_restored):
    """--muon-dp-layout megatron saves dp_reshardable (buckets of the EP2 layout): refused before
    torchrun and, the same line, on every rank of the job before anything is built (megatron-core
    does not compare EP: its load would fail on a missing bucket key)."""
    root, argv, _ = moe
    saved = launch([*argv, *SCHEDULE, "--muon-dp-layout", "megatron", "--train-iters", "1", "--save-interval", "1",
                    "--save", str(root / "dp")], root)
    assert saved.returncode == 0, saved.out[-4000:]
    assert "Storing distributed optimizer sharded state of type dp_reshardable" in saved.out
    resume = ["--muon-dp-layout", "megatron", "--load", str(root / "dp"), "--expert-model-parallel-size", "1"]
    line = _refusal(root, str(root / "moe.yaml"), *resume)
    assert expected_line("resume-ep-dp-reshardable", TMP=str(root)).fullmatch(line), line
    job = launch([*argv, *SCHEDULE, "--train-iters", "6", *resume], root)
    errors = ERROR.findall(job.out)
    assert job.returncode != 0 and errors == [line] and not logged_rows(job.out), job.out[-4000:]
    # what it is said instead of: the state loads with fresh optimizer state (the longer run's schedule taken)
    assert _preflight(root, str(root / "moe.yaml"), *resume, "--muon-reset-optimizer-state",
                      "--override-opt-param-scheduler")[1].startswith("EP 2 -> 1")


def test_ep_change_of_a_torch_format_checkpoint_is_refused(moe, hooks_restored):
    """--ckpt-format torch: one file per rank, named by its EP rank at EP > 1 (mp_rank_00_001)."""
    root, argv, _ = moe
    saved = launch([*argv, *SCHEDULE, "--ckpt-format", "torch", "--train-iters", "1", "--save-interval", "1",
                    "--save", str(root / "legacy")], root)
    assert saved.returncode == 0, saved.out[-4000:]
    assert (root / "legacy" / "iter_0000001" / "mp_rank_00_001").is_dir()
    line = _refusal(root, str(root / "moe.yaml"), "--ckpt-format", "torch", "--load", str(root / "legacy"),
                    "--expert-model-parallel-size", "1")
    assert expected_line("resume-ep-torch-format", TMP=str(root)).fullmatch(line), line


# --------------------------------------------------------------------------- virtual pipeline stages

VPP_RUN = [*TINY, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
           "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1"]
"""The tiny GPT at TP1 x PP2 (DP1), 4 layers, no dropout; --global-batch-size 4 / --micro-batch-size 2:
the 2 micro-batches the interleaved schedule needs at PP2."""
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]


@pytest.fixture(scope="module")
def vpp(tmp_path_factory):
    """(root, the uninterrupted PP2 x VPP2 run's rows); root/ckpt (fully_reshardable) holds iterations 3 and 6."""
    root = tmp_path_factory.mktemp("vpp_change")
    job = launch([*VPP_RUN, *VPP2, "--train-iters", "6", "--save", str(root / "ckpt"), "--save-interval", "3",
                  "--dist-ckpt-optim-fully-reshardable"], root)
    assert job.returncode == 0, job.out[-4000:]
    assert "Number of virtual stages per pipeline stage: 2" in job.out, job.out[-4000:]
    (root / "tiny.yaml").write_text("distributed_backend: gloo\n")  # the preflight's config; VPP_RUN after it
    return root, logged_rows(job.out)


def test_vpp_change_round_trip_is_bitwise(vpp):
    """PP2 x VPP2 -> PP2 (saved again at once, reported) -> PP2 x VPP2: the uninterrupted digits."""
    root, uninterrupted = vpp
    there = launch([*VPP_RUN, "--train-iters", "3", "--load", str(root / "ckpt"), "--ckpt-step", "3",
                    "--save", str(root / "flat"), "--save-interval", "1000", "--override-opt-param-scheduler"], root)
    assert there.returncode == 0, there.out[-4000:]
    assert _report(there.out)[1:] == [
        "virtual stages per PP rank 2 -> 1: resharded exactly (layers are saved under their global number)"]
    back = launch([*VPP_RUN, *VPP2, "--train-iters", "6", "--load", str(root / "flat"),
                   "--override-opt-param-scheduler"], root)
    assert back.returncode == 0, back.out[-4000:]
    assert _report(back.out)[1:] == [
        "virtual stages per PP rank 1 -> 2: resharded exactly (layers are saved under their global number)"]
    _assert_as_uninterrupted(logged_rows(back.out), uninterrupted, back.out)


def test_vpp_change_of_a_dp_reshardable_state_is_refused(vpp, hooks_restored):
    """Megatron's load would fail on a global shape mismatch of a bucket (each chunk has its own)."""
    root, _ = vpp
    megatron = [*VPP_RUN, "--muon-dp-layout", "megatron"]
    saved = launch([*megatron, *VPP2, "--train-iters", "1", "--save", str(root / "dp"), "--save-interval", "1"], root)
    assert saved.returncode == 0, saved.out[-4000:]
    assert "Storing distributed optimizer sharded state of type dp_reshardable" in saved.out, saved.out[-4000:]
    line = _refusal(root, str(root / "tiny.yaml"), *megatron, "--load", str(root / "dp"))
    assert line.startswith(f"--num-virtual-stages-per-pipeline-rank 1: {root}/dp/iter_0000001 was saved at PP2 x VPP2 "
                           "with the distributed optimizer's state in the dp_reshardable format"), line
    assert "cannot be loaded at PP2 without virtual stages" in line, line
