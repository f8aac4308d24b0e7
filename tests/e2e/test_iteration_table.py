"""scripts/bench/iteration_table.py end to end, on an 8B-shaped model with few layers (TP2 × DP4, and
TP2 × PP2 × DP4, under the fake process group on meta; about 15 s each on 2 cores).

What can fail: the buckets the script reads from the real DDP (``dry_run.build_rank``'s) against
the pure replay of the same buffers (``plan.stage_layouts``: megatron-core's packing, and the
default ``priced`` layout as the hook hands it to DDP, chosen on the dry run's price), bucket by
bucket and param by param; the table's
rows adding up (pipeline + exposed step, all-gather and reduce-scatter = the iteration) and
the command printed with it; and issue 42's iteration goals at Llama-3 405B TP8 × PP16 × DP64
with default flags (about a minute).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.core.models import LLAMA3, MOE_MODELS
from megatron_muon.plan.cost_model import collective_time
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.iteration import linear_flops
from megatron_muon.plan.layout_choice import ExpertRouting, job_price
from megatron_muon.plan.stage_layouts import BufferSettings, stage_layouts
from megatron_muon.plan.stage_params import StageGrid, stage_params

REPO = Path(__file__).resolve().parents[2]
# The rows add up by construction (iteration_time's increments), re-added here in another order,
# and the simulated pipeline sums its 2M compute terms one by one: a few hundred ulps of ~5 s
# (~1e-13 s each) at most, far below 1e-9 s.
_ROUNDING = 1e-9
# the dry run's price (``dry_run.layout_price``: a 4M-token job on h100-sxm, the default auto)
PRICE = lambda shape: job_price(shape, 2, 4, GPU_PROFILES["h100-sxm"], tp_mode="auto")  # noqa: E731


@pytest.mark.parametrize("pp, layers", [(1, 2), (2, 4)])
def test_buckets_are_the_real_ddps(tmp_path, pp, layers):
    out = tmp_path / "iteration.json"
    args = ["--model", "llama3-8b", "--tp", "2", "--pp", str(pp), "--dp", "4", "--layers", str(layers),
            "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.iteration_table", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    shape = dataclasses.replace(LLAMA3["8B"], num_layers=layers)
    for layout, stages in report["stages"].items():
        assert sorted(stages) == [str(s) for s in range(pp)], layout  # PP2: the first and the last stage
        for stage, real in stages.items():
            # megatron-core's default bucket (max(40M, 1M x DP)); the replay drops it after stage 0, as DDP does
            replay = stage_layouts(shape, StageGrid(2, 4, pp, int(stage)),
                                   BufferSettings(layout, 40_000_000, price=PRICE(shape)))
            assert [b["numel"] for b in real["buckets"]] == [end - start for start, end in replay.buffer.buckets]
            # every param of the stage in exactly one bucket, at its TP-local size
            assert sum(b["param_numel"] for b in real["buckets"]) == sum(p.numel for p in replay.params)
            held = [name for b in real["buckets"] for name in b["params"]]
            assert len(held) == len(set(held)) == len(replay.params)
    # the rows' bucket counts are the DDP's: megatron-core's layout cuts the first stage into several
    counts = {layout: [len(by_stage[str(s)]["buckets"]) for s in range(pp)]
              for layout, by_stage in report["stages"].items()}
    assert counts["megatron"][0] > 1
    assert [r["buckets"] for r in report["rows"]] == [counts["megatron"], counts["priced"], counts["megatron"]]
    for row in report["rows"]:
        it = row["iteration"]
        parts = it["pipeline_s"] + it["exposed_step_s"] + it["exposed_all_gather_s"] + it["exposed_reduce_scatter_s"]
        assert parts == pytest.approx(it["iteration_s"], abs=_ROUNDING)
        # the pipeline's M forward-backward pairs summed one by one against M x (F + B): rounding only
        assert it["iteration_s"] >= it["pipeline_s"] >= it["compute_s"] - _ROUNDING > 0
    # the default flags' row, then the baseline the default must never predict slower than
    assert [(r["label"], r["layout"]) for r in report["rows"]] == [
        ("Adam", "megatron"), ("Muon auto", "priced"), ("Muon owner", "megatron")]
    assert report["rows"][1]["iteration"]["iteration_s"] <= report["rows"][2]["iteration"]["iteration_s"] * (1 + 1e-9)
    assert "| Adam | megatron |" in proc.stdout
    assert "command: python -m scripts.bench.iteration_table " + " ".join(args) in proc.stdout


def test_the_default_meets_issue_42s_iteration_goals_at_405b_pp16_dp64(tmp_path):
    """Issue 42's goals at Llama-3 405B TP8 × PP16 × DP64 with default flags (h100-sxm, a 4M-token
    batch): what Muon adds to the predicted iteration over Adam on megatron-core's layout
    ≤ 1.5 % (2026-12-07: +1.20 %), its exposed DDP communication ≤ 1.1 × Adam's (1.00), and the
    default never predicted slower than ``--muon-dp-layout megatron --muon-tp-mode owner``
    (+6.38 %). Issue 24's bound on the step alone (Muon's step minus Adam's ≤ 100 ms) stands
    beside it in test_dry_run.py: the first stage's step is exposed whole in the iteration."""
    out = tmp_path / "iteration.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.iteration_table", "--model", "llama3-405b", "--tp",
                           "8", "--pp", "16", "--dp", "64", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    adam, default, baseline = (r["iteration"] for r in json.loads(out.read_text())["rows"])

    def exposed_ddp(it):
        return it["exposed_all_gather_s"] + it["exposed_reduce_scatter_s"]

    assert default["iteration_s"] <= 1.015 * adam["iteration_s"]
    assert exposed_ddp(default) <= 1.1 * exposed_ddp(adam)
    assert default["iteration_s"] <= baseline["iteration_s"]


@pytest.mark.parametrize("model, layers, tp, ep", [("mixtral-8x7b", 2, 1, 2), ("deepseek-v3", 4, 1, 4),
                                                   ("mixtral-8x7b", 2, 2, 2)])
def test_expert_buckets_are_the_real_ddps_and_reduce_over_expert_dp(tmp_path, model, layers, tp, ep):
    """A model with experts at TP × EP × DP4, expert TP1 (DeepSeek-V3: three dense layers, then
    one MoE layer with MLA; Mixtral at TP2, where an EP rank routes its own sequence-parallel half
    of the micro-batch): the table reads both of the real DDP's buffers. Each buffer's buckets keep
    DDP's order and sizes (the replay's), merged in backprop order; the spans cover every param
    once; and the stage's forward is its FLOPs at the profile's rate, computed here from the
    params the replay lays out (routed experts at the tokens one expert sees, MLA's attention at
    its own widths), plus each MoE layer's two token all-to-alls over EP."""
    out = tmp_path / "iteration.json"
    args = ["--model", model, "--tp", str(tp), "--ep", str(ep), "--etp", "1", "--dp", "4", "--layers", str(layers),
            "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.iteration_table", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"x EP{ep} (expert TP1)" in proc.stdout
    report = json.loads(out.read_text())
    shape = dataclasses.replace(MOE_MODELS[model], num_layers=layers)
    grid = StageGrid(tp, 4, 1, 0, ep, 1)
    hw = GPU_PROFILES["h100-sxm"]
    price = job_price(shape, tp, 4, hw, tp_mode="auto")
    for layout, stages in report["stages"].items():
        real = stages["0"]["buckets"]
        replay = stage_layouts(shape, grid, BufferSettings(layout, 40_000_000, price=price))
        for expert, laid in ((False, replay), (True, replay.experts)):
            mine = [b for b in real if b["expert"] == expert]
            assert [b["numel"] for b in mine] == [end - start for start, end in laid.buffer.buckets], (layout, expert)
            assert {n.removeprefix("module.") for b in mine for n in b["params"]} == {p.name for p in laid.params}
            assert all((".experts." in n) == expert for b in mine for n in b["params"])
        spans = [n for b in real for n in b["span"]]
        assert len(spans) == len(set(spans)) == len(replay.params) + len(replay.experts.params)
    # the forward from the replay's params (TP-local): 2 · numel · tokens per weight (the embedding
    # a lookup), a routed expert's at EP × (8192 / TP) × top-k / E tokens (expert TP1: each EP rank
    # routes its own sequence-parallel share), one attention core per layer over the rank's
    # 1/TP of the heads; the all-to-alls send the rank's 8192 / TP tokens' copies
    tokens = 8192
    routed = ExpertRouting(shape.num_experts, shape.moe_topk, ep).tokens_per_expert(tokens // tp)
    flops = sum(linear_flops(p.numel, routed if p.expert_parallel else tokens)
                for p in stage_params(shape, grid) if len(p.shape) >= 2 and "embedding" not in p.name)
    m = shape.mla
    width = 2 * shape.head_dim if m is None else m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim
    flops += layers * tokens * tokens * shape.num_heads * width / tp  # causal: half of 2 · s² per product
    moe_layers = sum(map(shape.is_moe_layer, range(layers)))
    sent = tokens // tp * shape.moe_topk * shape.hidden * 2 * (ep - 1) / ep
    a2a = collective_time("all_to_all", sent, 2, ep, hw, False)  # EP ranks 0 and 1 of 8 per node
    for row in report["rows"]:
        (stage,) = row["iteration"]["stages"]
        # the same sum in another order: a few ulps of ~0.1 s
        assert stage["forward_s"] == pytest.approx(flops / hw.matmul_flops + moe_layers * a2a, rel=1e-12)
        assert stage["backward_s"] == pytest.approx(2 * flops / hw.matmul_flops + moe_layers * a2a, rel=1e-12)


@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-8b", "--ep", "2"], "--ep 2 / --etp None: llama3-8b has no experts; expected neither"),
    (["--model", "mixtral-8x7b", "--tp", "1", "--dp", "6", "--ep", "3"],
     "--ep 3 x --etp 1: expected EP x expert TP to divide TP x DP = 6 and EP to divide the 8 experts"),
    (["--model", "mixtral-8x7b", "--ep", "0"], "--ep must be >= 1, got 0"),
])
def test_expert_flags_are_refused_in_one_line_before_anything_is_built(args, message):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.iteration_table", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], proc.stderr
    assert "meta builds" not in proc.stdout
