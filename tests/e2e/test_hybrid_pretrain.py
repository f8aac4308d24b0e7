"""``HybridModel`` through Megatron's own loop (``scripts/pretrain_gpt.py --hybrid-layer-pattern``).

* The tiny GPT's flags with ``--hybrid-layer-pattern *-*-`` at TP2: 6 iterations saved at 3, then
  a resume from that checkpoint that logs bitwise the uninterrupted run's grad norms and final loss
  (the optimizer's bitwise resume at TP2 × DP2: ``tests/megatron/test_hybrid_model.py``).
* ``*-|*-`` at PP2 and ``*|-|*|-`` at PP2 × VPP2: the same save and bitwise resume;
* ``configs/hybrid-tiny-cpu.yaml`` as a user runs it (``*-*E``: attention, MLP, attention, MoE at
  EP2, QK-clip on the byte-level demo data): the same save and bitwise resume, the experts' own
  optimizer, the clip's 8 heads (2 attention layers × 4).

Dropout is off in both (the configs' choice): the comparison is of the optimizer's state.
"""

from __future__ import annotations

import re

import pytest
from entry_harness import REPO, TINY, launch

GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")


def _run(args, cwd, timeout=300) -> str:
    job = launch(args, cwd, timeout=timeout)
    assert job.returncode == 0, f"pretrain_gpt.py failed (rc={job.returncode}):\n{job.out[-6000:]}"
    return job.out


def _save_and_resume(args: list[str], tmp_path) -> tuple[str, str]:
    """6 iterations saved at 3, then 4-6 again from that checkpoint; asserts that the resumed
    iterations' grad norms and losses are the first run's."""
    ckpt = str(tmp_path / "ckpt")
    common = [*args, "--train-iters", "6", "--log-interval", "1", "--lr-warmup-iters", "1", "--eval-iters", "0"]
    first = _run([*common, "--save", ckpt, "--load", ckpt, "--save-interval", "3"], tmp_path)
    resumed = _run([*common, "--load", ckpt, "--ckpt-step", "3"], tmp_path)
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 3", resumed), resumed[-4000:]
    before = {it: (loss, norm) for it, loss, norm in GRAD_NORM.findall(first)}
    after = {it: (loss, norm) for it, loss, norm in GRAD_NORM.findall(resumed)}
    assert list(after) == ["4", "5", "6"], resumed[-4000:]
    for it, (_, norm) in after.items():
        assert before[it][1] == norm, f"iteration {it}: grad norm {before[it][1]} before, {norm} resumed"
    assert after["4"][0] == before["4"][0] and after["6"][0] == before["6"][0], (before, after)
    # Megatron logs a process's first iteration without resetting its loss accumulator
    # (training_log's is_first_iteration), so the line after it is the mean of the two: the
    # resumed iteration 5 logs (loss 4 + loss 5) / 2 of the first run's (which started at 1).
    # Each figure is printed to 7 significant digits: 1e-6 relative covers the rounding.
    mean = (float(before["4"][0]) + float(before["5"][0])) / 2
    assert abs(float(after["5"][0]) - mean) <= 1e-6 * mean, f"iteration 5: {after['5'][0]} resumed, mean {mean}"
    return first, resumed


def test_hybrid_pattern_trains_and_resumes_bitwise(tmp_path):
    args = [*TINY, "--hybrid-layer-pattern", "*-*-", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    first, _ = _save_and_resume(args, tmp_path)
    assert "GPTModel IS DEPRECATED" not in first  # a HybridModel was built
    assert "megatron-muon: Muon on 8 matrices" in first
    assert re.search(r"muon +decoder\.layers\.\*\.self_attention\.linear_qkv\.weight +x2 +NS on 64x64 \+ 64x64 \+ "
                     r"64x64", first)  # the QKV split into q, k and v (global shapes), as in the GPT
    assert re.search(r"adamw +decoder\.final_norm\.weight +x1", first)
    losses = [float(loss) for _, loss, _ in GRAD_NORM.findall(first)]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("pattern", ["*-|*-", "*|-|*|-"])
def test_hybrid_pipeline_stages_train_and_resume_bitwise(tmp_path, pattern):
    """At PP2 (TP1), megatron-core's stage separator: ``*-|*-`` one stage of two layers per rank;
    ``*|-|*|-`` four segments, so two virtual stages per rank (the interleaved schedule; Megatron
    refuses ``--num-virtual-stages-per-pipeline-rank`` with a pattern, the segments set it)."""
    tiny = list(TINY)
    tiny[tiny.index("--tensor-model-parallel-size") + 1] = "1"
    args = [*tiny, "--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", pattern,
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    first, _ = _save_and_resume(args, tmp_path)
    assert "megatron-muon: Muon on 4 matrices, AdamW on 3 tensors (pipeline stage 0 of 2)" in first
    losses = [float(loss) for _, loss, _ in GRAD_NORM.findall(first)]
    assert losses[-1] < losses[0], losses


def test_hybrid_demo_config_with_moe_and_qk_clip_resumes_bitwise(tmp_path, demo_data):
    from megatron_muon.megatron.yaml_config import load_yaml_args

    (tmp_path / "data").symlink_to(demo_data)
    config = load_yaml_args(REPO / "configs" / "hybrid-tiny-cpu.yaml")
    first, resumed = _save_and_resume(config, tmp_path)
    assert "(4 expert matrices of this EP rank)" in first and "experts: EP 2 x expert-TP 1" in first
    assert re.search(r"muon +decoder\.layers\.\*\.mlp\.router\.weight +x1", first)
    assert len(re.findall(r"qk-clip heads clipped: \d+/8 \(tau 1\)", first)) == 6
    assert len(re.findall(r"qk-clip heads clipped: \d+/8 \(tau 1\)", resumed)) == 3
