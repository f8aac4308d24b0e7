"""scripts/pretrain_gpt.py end to end: Megatron's own training loop with --optimizer muon.

Two gloo ranks under torchrun (TP=2, the CPU patches, CUDA hidden), a tiny GPT on mock data:
6 iterations with ``--save`` (Megatron's ``pretrain -> train -> train_step -> training_log`` and
``save_checkpoint``, torch_dist), then a resume with ``--load`` for 2 more. About 30 s on 2 cores.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from entry_harness import ITERATION, REPO, TINY, launch, run_tiny


def _iterations(out: str) -> list[tuple]:
    return [(int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5]), m[6], float(m[7]))
            for m in ITERATION.finditer(out)]


def test_pretrain_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"

    # Under torchrun itself: the launcher a user runs (every other job here is forked warm).
    out = run_tiny(["--train-iters", "6", "--log-interval", "3", "--save", str(ckpt),
                    "--save-interval", "6"], tmp_path, torchrun=True)
    assert "cpu_patches applied" in out
    # The startup report, once (global rank 0): routing by name pattern, the mode, the plan.
    assert out.count("megatron-muon: Muon on 8 matrices, AdamW on") == 1, out[-6000:]
    assert re.search(r"muon +decoder\.layers\.\*\.self_attention\.linear_qkv\.weight +x2 .*tp mode owner", out)
    assert re.search(r"adamw +embedding\.word_embeddings\.weight +x1", out)
    assert "NS per full step on this stage's 2 ranks: max" in out and "MuonBP: off" in out
    rows = _iterations(out)
    # Megatron logs the first iteration, then every --log-interval.
    assert [(it, total) for it, total, *_ in rows] == [(1, 6), (3, 6), (6, 6)], out[-4000:]
    for _, _, lr, loss, grad_norm, kind, sent in rows:
        assert 0 < lr <= 0.02 and 0 < loss < 7 and grad_norm > 0
        assert kind == "muon" and sent > 0  # owner mode: TP shards travel to their owners
    assert rows[-1][3] < rows[0][3], "loss did not go down"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    saved = ckpt / "iter_0000006"
    assert (saved / "metadata.json").is_file() and list(saved.glob("*.distcp")), list(saved.iterdir())

    # Resume: more iterations, the scheduler extended to them (--override-opt-param-scheduler).
    out = run_tiny(["--train-iters", "8", "--log-interval", "1", "--load", str(ckpt),
                     "--save", str(ckpt), "--save-interval", "100",
                     "--override-opt-param-scheduler"], tmp_path)
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 6", out), out[-4000:]
    rows = _iterations(out)
    assert [(it, total) for it, total, *_ in rows] == [(7, 8), (8, 8)], out[-4000:]
    assert re.search(r"consumed samples:\s+28 \|", out)  # 6 * 4 before, +1 iteration of 4
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


def test_pretrain_with_virtual_pipeline_stages(tmp_path):
    """PP=2 with 2 virtual stages per rank (Megatron's interleaved 1F1B): 4 layers, one per chunk.

    Each rank holds two model chunks; forward_step finds a chunk's stage through the DDP wrapper,
    so only chunk 0 of rank 0 reads tokens and only chunk 1 of rank 1 reads labels (a chunk that
    read from the wrong iterator would fail on ``next(None)``: Megatron builds no dataset there).
    The optimizer's math under VPP is tests/megatron/test_virtual_pipeline.py; this is the entry script.
    """
    out = run_tiny(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                     "--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                     "--train-iters", "6", "--log-interval", "1"], tmp_path)
    assert "Number of virtual stages per pipeline stage: 2" in out, out[-4000:]
    rows = _iterations(out)
    assert [it for it, *_ in rows] == [1, 2, 3, 4, 5, 6], out[-4000:]
    for _, _, lr, loss, grad_norm, kind, _sent in rows:
        assert 0 < lr <= 0.02 and 0 < loss < 7 and grad_norm > 0 and kind == "muon"
    assert rows[-1][3] < rows[0][3], "loss did not go down"


def test_virtual_pipeline_stages_resume_at_dp2(tmp_path):
    """PP2 x VPP2 x DP2 (4 ranks), the default balanced layout: a save after iteration 3 and a
    resume from it. The balanced layout saves ``fully_reshardable``, whose load names every param;
    Megatron's ``_param_name`` refuses several chunks (each numbers its layers from 0), so the
    resume failed before the optimizer named them per chunk. The resumed grad norms and the
    iteration-4 and -6 losses are the uninterrupted run's (iteration 5's line is Megatron's mean of
    a process's first two iterations: tests/e2e/test_hybrid_pretrain.py)."""
    tiny = list(TINY)
    tiny[tiny.index("--tensor-model-parallel-size") + 1] = "1"
    tiny[tiny.index("--global-batch-size") + 1] = "8"  # 2 micro-batches per DP rank: the interleaved schedule
    common = [*tiny, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
              "--num-virtual-stages-per-pipeline-rank", "2", "--train-iters", "6", "--log-interval", "1",
              "--hidden-dropout", "0", "--attention-dropout", "0"]
    ckpt = str(tmp_path / "ckpt")
    first = launch([*common, "--save", ckpt, "--save-interval", "3"], tmp_path, nproc=4, timeout=300)
    assert first.returncode == 0, first.out[-6000:]
    assert "Storing distributed optimizer sharded state of type fully_reshardable" in first.out
    resumed = launch([*common, "--load", ckpt, "--ckpt-step", "3"], tmp_path, nproc=4, timeout=300)
    assert resumed.returncode == 0, resumed.out[-6000:]
    before = {row[0]: row for row in _iterations(first.out)}
    after = {row[0]: row for row in _iterations(resumed.out)}
    assert sorted(after) == [4, 5, 6], resumed.out[-4000:]
    for it in (4, 5, 6):
        assert after[it][4] == before[it][4], f"iteration {it}: grad norm {before[it][4]}, resumed {after[it][4]}"
    assert after[4][3] == before[4][3] and after[6][3] == before[6][3], (before, after)


QK_CLIP = re.compile(r"iteration\s+(\d+)/.* qk-clip heads clipped: (\d+)/(\d+) \(tau ([0-9.]+)\) \| "
                     r"max attention logit: ([0-9.-]+) \|")


def test_pretrain_with_qk_clip(tmp_path):
    """--qk-clip through Megatron's loop without Transformer Engine (the local attention's logit,
    megatron-muon's clip inside the step, upstream's clip_qk a no-op), on the log line with
    --muon-log-stats. τ is below this model's logits (about 0.1), so heads clip."""
    out = run_tiny(["--qk-clip", "--qk-clip-threshold", "0.05", "--log-max-attention-logit",
                     "--train-iters", "4", "--log-interval", "2"], tmp_path)
    rows = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])) for m in QK_CLIP.finditer(out)]
    assert [it for it, *_ in rows] == [1, 2, 4], out[-4000:]  # Megatron logs the first iteration too
    for _, clipped, heads, tau, top in rows:
        # 2 layers x 4 heads; the max logit is that of the step's forward, before its clip
        assert heads == 8 and tau == 0.05 and 0 < clipped <= heads and top > tau
    assert len(_iterations(out)) == 3, "the iteration line lost the muon stats"
    # --muon-log-stats also prints the Muon parameters' global norm and the update's RMS
    # (log_stats.norm_scalars, one all-reduce on the iterations that print)
    norms = re.findall(r"iteration\s+(\d+)/.* muon param norm: ([0-9.]+) \| muon update rms: muon ([0-9.E+-]+) \|", out)
    assert [int(i) for i, *_ in norms] == [1, 2, 4] and all(float(n) > 0 for _, n, _ in norms), norms
    # Megatron's warmup starts at lr 0: the first step applies nothing, the later ones do
    assert [float(u) == 0 for *_, u in norms] == [True, False, False], norms


def _config_job(name: str, tmp_path: Path, demo_data: Path, env: dict | None = None):
    """``run(*extra)``: configs/``name`` as a user runs it (the YAML loader's argv into the entry
    script) on the demo's data, saving to and loading from one checkpoint directory; its output."""
    from megatron_muon.megatron.yaml_config import load_yaml_args

    (tmp_path / "data").symlink_to(demo_data)
    config = load_yaml_args(REPO / "configs" / name)
    ckpt = str(tmp_path / "ckpt")

    def run(*extra: str) -> str:
        job = launch([*config, "--save", ckpt, "--load", ckpt, *extra], tmp_path, env=env, timeout=400)
        assert job.returncode == 0, job.out[-6000:]
        return job.out

    return run


def test_moe_demo_config_trains_and_resumes(tmp_path, demo_data):
    """configs/moe-tiny-cpu.yaml as a user runs it (the YAML loader's argv into the entry script):
    EP2 over 2 ranks, 4 experts top-2, QK-clip on, on the demo's byte-level data. 30 iterations
    with a save, then a resume for 3 more through Megatron's loop (both optimizers of the chain,
    the expert one's state in its own buffers)."""
    run = _config_job("moe-tiny-cpu.yaml", tmp_path, demo_data)

    # tau 0.2 (the config's 1.0 is for its 200 iterations): this model's logits start near 0.1
    # and pass 0.2 within these 30 steps, so the clip has to act
    out = run("--train-iters", "30", "--log-interval", "3", "--save-interval", "30", "--eval-iters", "0",
              "--qk-clip-threshold", "0.2")
    assert "(8 expert matrices of this EP rank)" in out and "experts: EP 2 x expert-TP 1 x expert-DP 1" in out
    losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert len(losses) == 11 and losses[-1] < losses[0] - 1.0, losses  # 5.9 -> 3.3 measured
    assert len(re.findall(r"muon experts bytes sent: [0-9.]+ MB \| muon experts orthogonalize", out)) == 11
    clips = [(int(a), int(b)) for a, b in re.findall(r"qk-clip heads clipped: (\d+)/(\d+) \(tau 0.2\)", out)]
    assert len(clips) == 11 and all(heads == 8 for _, heads in clips)
    assert clips[0][0] == 0 and clips[-1][0] >= 1, clips
    out = run("--train-iters", "33", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000",
              "--qk-clip-threshold", "0.2", "--override-opt-param-scheduler")
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 30", out), out[-4000:]
    assert [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*33", out)] == [31, 32, 33]


def test_per_head_demo_config_trains_and_resumes(tmp_path, demo_data):
    """configs/tiny-cpu-per-head.yaml as a user runs it: TP2, GQA (one query group of 2 heads per TP
    rank), --muon-split-qkv-per-head under the distributed optimizer. 30 iterations with a save, the
    loss falling, each layer's QKV as 4 heads of 16 x 64 on every TP rank with no TP traffic (the
    startup report) and logged as the attention_head class, then a resume for 3 more through
    Megatron's loop."""
    run = _config_job("tiny-cpu-per-head.yaml", tmp_path, demo_data)

    out = run("--train-iters", "30", "--log-interval", "3", "--save-interval", "30", "--eval-iters", "0")
    assert "4 heads of 16x64 per TP rank" in out and "(per head, no TP traffic)" in out, out[-6000:]
    # --muon-log-stats: QKV is the per-head class, its heads' residuals measured on their TP ranks
    assert re.search(r"attention [0-9.]+ / [0-9.]+ / [0-9.]+, attention_head [0-9.]+ / [0-9.]+ / [0-9.]+,", out), \
        out[-3000:]
    losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert len(losses) == 11 and losses[-1] < losses[0] - 1.0, losses
    out = run("--train-iters", "33", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000",
              "--override-opt-param-scheduler")
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 30", out), out[-4000:]
    assert [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*33", out)] == [31, 32, 33]


def test_fsdp_demo_config_trains_and_resumes(tmp_path, demo_data):
    """configs/tiny-cpu-fsdp.yaml as a user runs it: Megatron-FSDP (optim_grads_params) over 2
    ranks, bf16, its own checkpoint format (fsdp_dtensor). 30 iterations with a save, the loss
    falling (6.02 -> 3.64 measured), a QKV of each layer cut between the ranks (the startup
    report), then a resume for 3 more through Megatron's loop."""
    # no CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron-FSDP refuses it
    run = _config_job("tiny-cpu-fsdp.yaml", tmp_path, demo_data, env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None))

    out = run("--train-iters", "30", "--log-interval", "3", "--save-interval", "30", "--eval-iters", "0")
    assert "Megatron-FSDP optim_grads_params layout" in out and "2 of 8 matrices cut across DP ranks" in out
    losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert len(losses) == 11 and losses[-1] < losses[0] - 1.0, losses
    assert len(re.findall(r"muon bytes sent: 0\.0[0-9]+ MB", out)) == 11  # the cut QKVs' rows, every step
    assert "in fsdp_dtensor format" in out
    out = run("--train-iters", "33", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000",
              "--override-opt-param-scheduler")
    assert re.search(r"successfully loaded checkpoint from \S+ .* at iteration 30", out), out[-4000:]
    assert [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*33", out)] == [31, 32, 33]


def _logged(out: str, iters: int) -> dict[int, tuple[str, str]]:
    """{iteration: (lm loss, grad norm)} as Megatron's training_log printed them (strings: compared
    as printed)."""
    line = re.compile(rf"iteration\s+(\d+)/\s*{iters} \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")
    return {int(it): (loss, norm) for it, loss, norm in line.findall(out)}


def _assert_resumed_exactly(resumed: dict, straight: dict, out: str) -> None:
    """A resume from the checkpoint of iteration 3 of a 6-iteration run logs iterations 4 to 6 with
    the uninterrupted run's grad norms and its losses at 4 and 6, as printed. Megatron's
    training_log keeps its loss accumulator across a resumed process's first logged iteration, so
    the resumed line of iteration 5 is the mean of 4 and 5, printed to 7 digits: within 1 in the
    last."""
    assert sorted(resumed) == [4, 5, 6], out[-4000:]
    assert all(resumed[it][1] == straight[it][1] for it in (4, 5, 6)), (resumed, straight)
    assert resumed[4][0] == straight[4][0] and resumed[6][0] == straight[6][0], (resumed, straight)
    mean = (float(straight[4][0]) + float(straight[5][0])) / 2
    assert abs(float(resumed[5][0]) - mean) <= 1e-6 * mean, (resumed, straight)


def test_fsdp_moe_demo_config_resumes_exactly(tmp_path, demo_data):
    """configs/moe-tiny-cpu-fsdp.yaml as a user runs it: an MoE GPT under Megatron-FSDP
    (optim_grads_params, bf16, fsdp_dtensor checkpoints), the dense params and the experts' both
    sharded over the 2 ranks, a dense and an expert optimizer chained (the startup report). 6
    iterations with a save after the 3rd; a resume from it logs the uninterrupted run's
    iterations 4 to 6 exactly, as printed: every grad norm, and the losses of iterations 4 and 6
    (Megatron's training_log keeps its loss accumulator across a resumed process's first logged
    iteration, so the resumed line of iteration 5 is the mean of 4 and 5: checked as such); the
    experts' momentum restored from their own shards."""
    run = _config_job("moe-tiny-cpu-fsdp.yaml", tmp_path, demo_data, env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None))
    common = ("--train-iters", "6", "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "2")
    out = run(*common, "--save-interval", "3")
    assert "experts: EP 1 x expert-TP 1 x expert-DP 2" in out, out[-6000:]
    assert "expert DP 2: Megatron-FSDP optim_grads_params layout" in out, out[-6000:]
    assert "in fsdp_dtensor format" in out
    straight = _logged(out, 6)
    assert sorted(straight) == [1, 2, 3, 4, 5, 6], out[-4000:]
    out = run(*common, "--ckpt-step", "3", "--save-interval", "1000")
    assert re.search(r"successfully loaded checkpoint from \S+ .* at iteration 3", out), out[-4000:]
    _assert_resumed_exactly(_logged(out, 6), straight, out)


def test_fsdp2_demo_config_trains(tmp_path, demo_data):
    """configs/tiny-cpu-fsdp2.yaml as a user runs it: torch FSDP2 over 2 ranks (Megatron's
    ``TorchFullyShardedDataParallel``, its non-distributed bf16 optimizer over the DTensor shards),
    30 iterations through Megatron's loop: the loss falling (6.00 -> 3.23 measured), every matrix
    cut between the ranks (the startup report), the cut rows sent every step. Its checkpoints:
    tests/e2e/test_fsdp2_resume.py."""
    from megatron_muon.megatron.yaml_config import load_yaml_args

    (tmp_path / "data").symlink_to(demo_data)
    config = load_yaml_args(REPO / "configs" / "tiny-cpu-fsdp2.yaml")
    # no CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron refuses it with FSDP2
    job = launch([*config, "--train-iters", "30", "--log-interval", "3", "--eval-iters", "0"], tmp_path,
                 env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None), timeout=400)
    out = job.out
    assert job.returncode == 0, out[-6000:]
    assert "torch FSDP2 layout" in out and "8 of 8 matrices cut across DP ranks" in out
    losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert len(losses) == 11 and losses[-1] < losses[0] - 1.0, losses
    assert len(re.findall(r"muon bytes sent: 0\.0[0-9]+ MB", out)) == 11  # every matrix's rows, every step


def test_fsdp2_moe_expert_parallel_config_trains_and_resumes_exactly(tmp_path, demo_data):
    """configs/moe-tiny-cpu-fsdp2.yaml as a user runs it: torch FSDP2 at EP2 over 2 ranks, which
    megatron-core 0.19.2's validate_args refuses and megatron-muon runs (TorchFSDP2WithExpertMesh:
    the experts sharded over their expert-DP group, here each rank alone; the dense params cut by
    rows over both ranks). 6 iterations with a torch_dist save after the 3rd, every loss finite and
    falling; a resume from it logs the uninterrupted run's iterations 4 to 6 exactly (every grad
    norm; the losses of iterations 4 and 6, and 5 as the mean Megatron's first resumed log line
    prints, as in test_fsdp_moe_demo_config_resumes_exactly). Exactness against one process:
    tests/megatron/test_fsdp2_expert_parallel.py."""
    run = _config_job("moe-tiny-cpu-fsdp2.yaml", tmp_path, demo_data, env=dict(CUDA_DEVICE_MAX_CONNECTIONS=None))
    common = ("--train-iters", "6", "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "2")
    out = run(*common, "--save-interval", "3")
    assert "experts: EP 2 x expert-TP 1 x expert-DP 1" in out, out[-6000:]
    assert "DP 2: torch FSDP2 layout (every param cut by rows over DP, torch.chunk): 6 of 6 matrices cut" in out
    straight = _logged(out, 6)
    assert sorted(straight) == [1, 2, 3, 4, 5, 6], out[-4000:]
    losses = [float(straight[it][0]) for it in range(1, 7)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses
    out = run(*common, "--ckpt-step", "3", "--save-interval", "1000")
    assert re.search(r"loaded checkpoint from \S+ .* at iteration 3", out), out[-4000:]
    _assert_resumed_exactly(_logged(out, 6), straight, out)


def test_block_grid_through_megatrons_loop_resumes_bitwise(tmp_path):
    """--muonbp-period 2 --muonbp-block-grid 2x2 in Megatron's loop (TP2): block steps send
    nothing, and a resume from the checkpoint of iteration 3 logs bitwise the uninterrupted run's
    grad norms and final loss (the grid is a plan setting; the phase travels in the checkpoint)."""
    ckpt = tmp_path / "ckpt"
    # dropout off: the comparison is of the optimizer's state, not of the CPU dropout RNG's restore
    grid = ["--muonbp-period", "2", "--muonbp-block-grid", "2x2", "--log-interval", "1", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0"]
    out = first_out = run_tiny([*grid, "--train-iters", "6", "--save", str(ckpt), "--save-interval", "3"], tmp_path)
    rows = _iterations(out)
    assert [it for it, *_ in rows] == [1, 2, 3, 4, 5, 6], out[-4000:]
    assert [kind for *_, kind, _ in rows] == ["full", "block"] * 3
    assert all(sent == 0 for *_, kind, sent in rows if kind == "block")
    out = run_tiny([*grid, "--train-iters", "6", "--load", str(ckpt), "--ckpt-step", "3"], tmp_path)
    resumed = _iterations(out)
    assert [it for it, *_ in resumed] == [4, 5, 6], out[-4000:]
    norms = re.compile(r"iteration\s+(\d+)/.*?grad norm: ([0-9.]+) \|")
    first = dict(norms.findall(first_out))
    after = norms.findall(out)
    assert len(after) == 3 and all(first[it] == g for it, g in after), (first, after)
    assert resumed[-1][3] == rows[-1][3] and [r[5] for r in resumed] == [r[5] for r in rows[3:]]


def test_report_bytes_are_the_steps_under_auto_at_tp1(tmp_path):
    """At TP1 x DP2 under ``auto`` no matrix is cut across DP (the balanced layout), yet the plan
    moves whole units to the other DP rank to balance NS: the report must say so, and its bytes
    (printed as the log prints them, MB) bound what rank 0's step logs. That the plan's per-rank
    bytes equal the step's comm_stats exactly is tests/dist/test_step_plan.py's."""
    out = run_tiny(["--tensor-model-parallel-size", "1", "--muon-tp-mode", "auto", "--train-iters", "2",
                    "--log-interval", "1"], tmp_path)
    planned = re.search(r"bytes sent per rank per full step \(plan\): max ([0-9.]+) MB, mean ([0-9.]+) MB", out)
    assert planned, out[-6000:]
    most, mean = float(planned[1]), float(planned[2])
    moved = re.search(r"0 of 8 matrices cut across DP ranks; .*; (\d+) of \d+ units held whole by one DP rank go "
                      r"to another DP rank's owner", out)
    logged = [row[-1] for row in _iterations(out)]
    assert len(logged) == 2 and logged[0] == logged[1], logged
    if logged[0] > 0:  # rank 0 sent something: the report names the moved units and a nonzero plan
        assert moved and int(moved[1]) > 0 and 0 < mean <= most and logged[0] <= most, (planned[0], logged)
    else:
        assert most == 0 and not moved, (planned[0], logged)
