"""scripts/gpu_check.py, in every part a CPU can run in this process: argument handling, the
training command and the report writer. The TP2 x DP2 equivalence over gloo with CPU tensors (the
same code the GPU run uses with CUDA ones) runs the script as a process:
``tests/e2e/test_gpu_check_cpu_rehearsal.py``. The GPU run itself goes into docs/performance.md
when a task is lent a GPU."""

from __future__ import annotations

import pytest

from scripts import gpu_check


@pytest.mark.parametrize("argv, message", [
    (["--parts", "bogus"], "--parts: expected a comma-separated subset"),
    (["--device", "cpu", "--parts", "ns", "--scale", "0"], "--scale must be >= 1, got 0"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible here"),
])
def test_bad_arguments_are_named(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)  # as on CI, also on a GPU box
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_train_command_is_megatrons_loop_on_one_gpu(tmp_path):
    cmd = gpu_check.train_command(50, 29500, device="cuda", te=False, apex=False, save=tmp_path)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"] and cmd[4] == "1"
    flags = " ".join(cmd)
    for flag in ("--bf16", "--muon-tp-mode owner", "--optimizer muon", "--train-iters 50",
                 "--tensor-model-parallel-size 1", "--transformer-impl local", "--muon-log-stats",
                 f"--save {tmp_path} --save-interval 25",
                 # without apex, Megatron's apex-backed defaults fail at model construction
                 "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                 "--no-rope-fusion"):
        assert flag in flags, flag
    assert "--distributed-backend" not in flags and "--load" not in flags  # Megatron's default: NCCL
    te_apex = " ".join(gpu_check.train_command(50, 29500, device="cuda", te=True, apex=True, save=tmp_path))
    assert "--transformer-impl transformer_engine" in te_apex
    assert "--no-gradient-accumulation-fusion" not in te_apex and "--no-rope-fusion" not in te_apex
    resumed = " ".join(gpu_check.train_command(50, 29500, device="cuda", te=True, apex=True, save=tmp_path,
                                               load_step=25))
    assert f"--load {tmp_path} --ckpt-step 25" in resumed
    cpu = " ".join(gpu_check.train_command(10, 29500, device="cpu", te=True, apex=True, save=tmp_path))
    assert "--distributed-backend gloo" in cpu and "--bf16" not in cpu and "--transformer-impl local" in cpu


def test_equivalence_needs_a_gpu_per_rank():
    assert gpu_check.equivalence_world("cuda", 8) == (4, None)
    assert gpu_check.equivalence_world("cuda", 2) == (2, None)
    ranks, reason = gpu_check.equivalence_world("cuda", 1)
    assert ranks == 0 and "needs 2 GPUs" in reason and "has 1" in reason
    assert gpu_check.equivalence_world("cpu", 0) == (4, None)


def test_versions_are_checked_against_the_declared_ranges():
    v = gpu_check.versions()
    assert v["torch"]["installed"] and v["torch"]["in_range"] is True  # this environment is the lock's
    assert v["megatron-core"]["in_range"] is True
    assert v["transformer-engine"]["installed"] is None and v["transformer-engine"]["in_range"] is None  # CPU


def test_the_report_has_every_part():
    results = dict(device="NVIDIA H200", torch="2.11.0", date="d", command="c",
                   versions={"torch": dict(installed="2.11.0", declared=">=2.11,<2.16", in_range=True)},
                   train=dict(ok=True, returncode=0, spec="local", wall_s=30.0, apex=False, loss_falls=True,
                              rows=[dict(iteration=10, loss=4.1, kind="muon", mb_sent=0.0, orth_ms=1.5,
                                         timing="cuda events")],
                              resume=dict(from_iteration=5, compared=[10], bitwise=True)),
                   equivalence=dict(ok=True, tolerance=1e-5, max_abs_error={"owner": 2e-6}, devices=["cuda:0"]),
                   ns=dict(rows=[dict(matrix="q", shape=[4096, 4096], ms=1.0, tflops=500.0, fraction_of_peak=0.5,
                                      gram_ms=0.5, gram_fp16_ms=0.45)],
                           layer=dict(owner_busiest_ms=1.0, duplicated_ms=4.0, ratio=0.25)))
    text = gpu_check.markdown(results)
    assert text.startswith("# GPU check (NVIDIA H200, torch 2.11.0, d)")
    assert "| 10 | 4.1000 | muon | 0.000 | 1.50 (cuda events) |" in text
    assert "| torch | 2.11.0 | >=2.11,<2.16 | yes |" in text and "NCCL, bf16" in text
    assert "iterations [10] bitwise equal to the uninterrupted run (grad norms" in text
    spent = "llama3-70b TP8 x PP1 x DP8 owner: the budget (--budget-s) was spent"
    real = dict(ok=True, wall_s=3.0, skipped_layouts=[spent],
                rows=[dict(model="llama3-405b", layout="TP8 x PP16 x DP64", tp_mode="auto", rank=5, scale=1,
                           matrices=28, modes={"distributed": 3, "owner": 20}, ns_gflop=3051.2, step_ms=12.5,
                           predicted_ns_ms=4.41, hardware="h200", busiest_step_ms_h100=627.0, step_gib=10.5,
                           dry_run_gib=10.25, max_allocated_gib=60.0, dry_run_errors=[])])
    text = gpu_check.markdown(dict(results, **{"real-step": real}))
    assert ("| llama3-405b | TP8 x PP16 x DP64 | auto | 5 | 1 | 28 | distributed 3, owner 20 | 3051.20 | 12.50 | "
            "4.41 (h200) | 627.0 | 10.50 | 10.25 | 60.00 |") in text
    assert "- skipped: llama3-70b TP8 x PP1 x DP8 owner: the budget (--budget-s) was spent" in text
    # a part that failed or never ran is one line, and the parts that ran keep their sections
    cut = gpu_check.markdown(dict(results, train=dict(ok=False, error="RuntimeError: boom"),
                                  ns=dict(ok=False, skipped="the budget (--budget-s) was spent before this part")))
    assert "## train: FAILED\n\nRuntimeError: boom" in cut and "## ns: skipped\n\nthe budget" in cut
    assert "## equivalence: orthogonalize_updates" in cut
    skipped = gpu_check.markdown(dict(results, equivalence=dict(ok=True, skipped="needs 2 GPUs ...")))
    assert "## equivalence: skipped\n\nneeds 2 GPUs ..." in skipped
    assert "| owner | 2.00e-06 |" in text and "tensors on cuda:0" in text
    assert "| q | 4096x4096 | 1.00 | 500.0 | 50% | 0.50 | 0.50 | 0.45 |" in text and "(0.25x)" in text
