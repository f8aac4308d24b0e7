"""scripts/dry_run.py: our real optimizer step at Llama-3 production layouts, and at Mixtral-8x7B and
DeepSeek-V3 MoE layouts (issue 14), on the meta device, under torch's fake process group (about
45 s for the four Llama layouts on 2 cores, 30 s for the two MoE ones).

Each run builds megatron-core's GPTModel, DDP buffers and our ZeRO-1 optimizer for the chosen
ranks and runs the inner step; a tensor on another device, or collectives whose sizes do not
line up across the simulated ranks, make it exit 1. Before the device rule, the rank holding no
piece of the first matrix (CPU exchange buffers) and the DP owner whose TP group owns nothing
(a CPU shape-check header) both failed here; see tests/unit/test_device_rule.py for the rule itself.
``--fsdp`` (issue 15) runs the same step under Megatron-FSDP's own wrapper and layout (about 30 s),
with experts too (issue 44: its dense and expert optimizers, about 15 s).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from entry_harness import Job, launch

REPO = Path(__file__).resolve().parents[2]


DRY_RUN = REPO / "scripts" / "dry_run.py"


def _script(*args: str) -> Job:
    """``python scripts/dry_run.py args`` as one process, forked from the session's warm interpreter
    (entry_harness): the script's own process, without paying torch's and megatron's imports again."""
    return launch(list(args), REPO, nproc=1, entry=DRY_RUN, timeout=600)


PINNED_DOC = REPO / "docs" / "performance.md"
REPORT_LINES = re.compile(r"^  (DP \d+: .*|NS per full step on .*|bytes sent per rank per full step \(plan\): .*)$",
                          re.MULTILINE)


def _assert_report_lines_in_docs(stdout: str) -> None:
    """The startup report's DP, NS and bytes lines, each quoted to the letter in performance.md §10:
    the documented figures are the code's, and a change to either fails here."""
    lines = REPORT_LINES.findall(stdout)
    assert len(lines) == 3, stdout[:3000]
    doc = PINNED_DOC.read_text()
    missing = [line for line in lines if f"  {line}\n" not in doc]
    assert not missing, f"docs/performance.md §10 does not quote these startup-report lines: {missing}"


def _dry_run(tmp_path: Path, *args: str) -> tuple[Job, dict]:
    """The dry run of ``args``, in owner mode unless they name a TP mode (these checks were written
    for owner's plans, and the dry run's default follows the config's, auto)."""
    out = tmp_path / "dry.json"
    mode = () if "--tp-mode" in args else ("--tp-mode", "owner")
    proc = _script(*args, *mode, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b", "llama3-405b"])
def test_llama3_at_tp8_dp8(tmp_path, model):
    proc, report = _dry_run(tmp_path, "--model", model, "--tp", "8", "--dp", "8")
    assert report["errors"] == []
    ranks = report["ranks"]
    assert "0" in ranks and "63" in ranks  # first and last
    for rank, res in ranks.items():
        assert res["device"] == "meta" and res["trace"] > 0, rank
        # The step does on this rank exactly what its plans say (its optimizer.plan: the DP
        # owner and TP owner plans of the real layouts without running anything), and what the
        # planner table (scripts/bench/planner_quality: Megatron's buffer layout computed from the
        # model's shapes, PP = 1) says: FLOPs and bytes, to the unit. Before the planner emitted
        # params in Megatron's registration order (proj before qkv) its bytes were off by up to
        # 130 MiB per rank here.
        assert res["ns_flops"] == res["plan_ns_flops"] == res["planner_ns_flops"] > 0, rank
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"] == res["planner_bytes_sent"] > 0
        # the optimizer state (this rank's ZeRO-1 shard of momentum and Adam's moments) is made before
        # the measured step and reported apart: the step's peak is its transient memory only
        assert res["state_bytes"] > 0 and res["peak_extra_bytes"] > 0, rank
    assert f"Dry run: {model}, TP8 x PP1 x DP8 (64 ranks)" in proc.stdout
    layers = {"llama3-8b": 32, "llama3-70b": 80, "llama3-405b": 126}[model]
    # The startup report, printed once by (simulated) global rank 0, agrees with the step.
    assert proc.stdout.count(f"megatron-muon: Muon on {4 * layers} matrices, AdamW on {2 * layers + 3} tensors") == 1
    reported = re.search(r"NS per full step on this stage's 64 ranks: max ([0-9.]+) TFLOP", proc.stdout)
    assert reported and float(reported[1]) >= max(res["ns_flops"] for res in ranks.values()) / 1e12 - 0.005
    # the default buffer layout (--muon-dp-layout priced): at TP8 x DP8 the price picks megatron-core's own
    # buckets (their overlap outweighs the exchange of what they cut), laid out exactly as it packs them
    assert "megatron buffer layout" in proc.stdout
    assert "DDP buckets (bfloat16 params, float32 grads): megatron, " in proc.stdout
    assert any(res["cut_across_dp"] > 0 for res in ranks.values())
    assert "| 63 | last | 7/7/0 |" in proc.stdout
    # The cost model's own plan is a prediction (it differs at 8B: 11.00 against the step's 11.68
    # TFLOP on rank 0); it is printed beside the figures, not asserted equal.
    assert report["cost_model"]["ns_flops_max"] > 0 and report["cost_model"]["step_ms_h100"] > 0


def test_nemotron_h_hybrid_at_tp8_dp8(tmp_path):
    """A HybridModel (issue 28): Nemotron-H-8B's 52 layers (24 Mamba, 4 attention, 24 MLP) built by
    the entry's local hybrid stack spec on the meta device, its Mamba mixers without mamba_ssm's
    kernels (parameters only): the step equals its plan, every collective on the step device."""
    proc, report = _dry_run(tmp_path, "--model", "nemotron-h-8b", "--tp", "8", "--dp", "8")
    assert report["errors"] == []
    # The cost model lays the hybrid stage out by the optimizer's road (plan.stage_layouts) and
    # prices the plan it builds: the busiest rank's NS is the same figure.
    predicted = report["cost_model"]
    assert predicted["ns_flops_max"] == report["summary"]["dense"]["plan"]["ns_flops_max"]
    assert predicted["step_ms_h100"] > predicted["adam_step_ms_h100"] > 0
    for rank, res in report["ranks"].items():
        assert res["device"] == "meta" and res["trace"] > 0, rank
        assert res["matrices"] == 24 * 2 + 4 * 2 + 24 * 2, rank  # in/out_proj, qkv/proj, fc1/fc2
        assert res["ns_flops"] == res["plan_ns_flops"] > 0, rank
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"], rank
    out = proc.stdout
    assert out.count("megatron-muon: Muon on 104 matrices") == 1
    # in_proj by role at its global shapes (d_inner 8192; 8 groups x state 128; 128 heads), fc1 whole
    assert re.search(r"muon +decoder\.layers\.\*\.mixer\.in_proj\.weight +x24 +NS on 8192x4096 \+ 8192x4096 \+ "
                     r"1024x4096 \+ 1024x4096 \+ 128x4096 ", out)
    assert re.search(r"muon +decoder\.layers\.\*\.mlp\.linear_fc1\.weight +x24 +NS on 21504x4096 ", out)
    assert re.search(r"adamw +decoder\.layers\.\*\.mixer\.conv1d_weight +x24 +Mamba conv1d", out)


def test_nemotron_h_hybrid_at_tp8_pp8_dp8(tmp_path):
    """The hybrid model in a pipeline: the 52-layer pattern cut into 8 stages with megatron-core's
    ``|`` (5 + 6 x 7 + 5 layers), each stage's HybridModel with its own layers (two Muon matrices
    each: in/out_proj, qkv/proj or fc1/fc2), the embedding on the first and the output layer on the
    last; the step of the first rank of every stage equals its plan."""
    proc, report = _dry_run(tmp_path, "--model", "nemotron-h-8b", "--tp", "8", "--pp", "8", "--dp", "8",
                            "--ranks", "pp-stages")
    assert report["errors"] == []
    stages = {res["pp"]: res for res in report["ranks"].values()}
    assert sorted(stages) == list(range(8))
    for stage, res in stages.items():
        layers = 5 if stage in (0, 7) else 7
        assert res["device"] == "meta" and res["matrices"] == 2 * layers, (stage, res["matrices"])
        assert res["ns_flops"] == res["plan_ns_flops"] > 0, stage
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"], stage
    assert proc.stdout.count("megatron-muon: Muon on 10 matrices") == 1  # the first stage's report


def test_nemotron_h_hybrid_with_virtual_stages(tmp_path):
    """PP4 x VPP2: the pattern in 8 segments (5 + 6 x 7 + 5 layers), two chunks per rank, each its own
    DDP, one optimizer over both (as the interleaved schedule's get_model builds them): the first rank
    holds segments 0 and 4 (12 layers), the last segments 3 and 7 (12)."""
    proc, report = _dry_run(tmp_path, "--model", "nemotron-h-8b", "--tp", "8", "--pp", "4", "--vpp", "2",
                            "--dp", "4", "--ranks", "first,last")
    assert report["errors"] == []
    for res in report["ranks"].values():
        assert res["matrices"] == 2 * 12 and res["ns_flops"] == res["plan_ns_flops"] > 0, res["pp"]


def test_megatron_layout_cuts_matrices_and_moves_them(tmp_path):
    """--dp-layout megatron (megatron-core's buffer layout): matrices are cut, the DP exchange
    moves them, and the step still does what the plans and the planner table say."""
    proc, report = _dry_run(tmp_path, "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--dp-layout", "megatron",
                            "--ranks", "first,last")
    assert report["errors"] == [] and "megatron buffer layout" in proc.stdout
    for rank, res in report["ranks"].items():
        assert res["cut_across_dp"] == 65, rank  # the planner table's count
        assert res["ns_flops"] == res["plan_ns_flops"] == res["planner_ns_flops"] > 0, rank
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"] == res["planner_bytes_sent"]


def test_priced_layout_runs_what_the_plans_and_the_planner_table_say(tmp_path):
    """--dp-layout priced: at 8B TP8 x DP8 the price picks megatron-core's own 18 buckets
    (plan.layout_choice; the row-aligned cuts cut 80 matrices where its packing cuts 65, and the
    step plan prices their exchange higher); the step still does what the plans and the planner
    table (the same price, dry_run.layout_price) say, and the startup report prints the choice."""
    proc, report = _dry_run(tmp_path, "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--dp-layout", "priced",
                            "--ranks", "first,last")
    assert report["errors"] == []
    assert "DDP buckets (bfloat16 params, float32 grads): megatron, 18 buckets:" in proc.stdout
    for rank, res in report["ranks"].items():
        assert res["cut_across_dp"] == 65, rank  # megatron-core's packing, as under --dp-layout megatron
        assert res["ns_flops"] == res["plan_ns_flops"] == res["planner_ns_flops"] > 0, rank
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"] == res["planner_bytes_sent"]


def test_llama3_405b_at_tp8_pp16_dp64(tmp_path):
    proc, report = _dry_run(tmp_path, "--model", "llama3-405b", "--tp", "8", "--pp", "16", "--dp", "64",
                            "--ranks", "idle-dp-owner,last")
    assert report["errors"] == []
    by_kind = {k: res for res in report["ranks"].values() for k in res["kinds"]}
    idle, last = by_kind["idle-dp-owner"], by_kind["last"]
    # 126 layers over 16 stages: 8 layers (32 Muon matrices) on a middle stage, 7 on the first
    # and last; fewer matrices than the 64 DP ranks, so some DP owners own nothing and their TP
    # group still joins every collective, with empty buffers on the step's device.
    assert idle["pp"] == 0 and idle["dp_owned"] == 0 and idle["ns_flops"] == 0 and idle["trace"] > 0
    assert last["pp"] == 15 and last["tp"] == 7 and last["dp"] == 63 and last["matrices"] == 7 * 4
    for rank, res in report["ranks"].items():
        assert res["device"] == "meta", rank
        assert res["ns_flops"] == res["plan_ns_flops"], rank
        # balanced layout: a DP rank owning nothing on a stage sends nothing (no DP exchange)
        assert res["bytes_by_collective"].get("all_to_all", 0) == res["plan_bytes_sent"], rank
    assert "planner_ns_flops" not in idle  # the planner table covers PP = 1 layouts only


@pytest.mark.parametrize("vpp", [1, 2])
def test_llama3_405b_deep_pipeline_under_auto_meets_the_balance_goals(tmp_path, vpp):
    """Issue 24's goals at 405B TP8 x PP16 x DP64, on the real step: auto's joint schedule runs the
    large matrices distributed on their own TP groups. Measured: NS max/mean 2.40 (owner: 19.2),
    transient peak 3.07 GiB (owner: 15.98). With VPP2 (the embedding and the loss counted as
    layers: 32 virtual stages of 4) stage 0 holds two model chunks, 3 + 4 layers, in two DDP
    buffers under one optimizer: the same 28 matrices, the same 2.40. The cost model's predicted
    step, Muon's minus Adam's, <= 100 ms: 63 ms on issue 24's model; 107 ms once Newton-Schulz's
    own memory passes and Megatron's param copy were priced; 92 ms since the distributed mode sums
    its 16384-row Grams in chunks beside their GEMMs (2026-12-07, parallel.tp_modes._summed_gram)."""
    proc, report = _dry_run(tmp_path, "--model", "llama3-405b", "--tp", "8", "--pp", "16", "--vpp", str(vpp),
                            "--dp", "64", "--tp-mode", "auto", "--ranks", "busiest" if vpp > 1 else "busiest,tp-group")
    assert report["errors"] == [] and report["vpp"] == vpp
    if vpp == 1:  # every member of rank 0's TP group stepped side by side: their collectives compared
        assert set(range(8)) <= {int(r) for r in report["ranks"]}
        _assert_report_lines_in_docs(proc.stdout)
    if vpp > 1:
        assert "TP8 x PP16 x VPP2 x DP64" in proc.stdout
        assert all(res["matrices"] == 28 for res in report["ranks"].values())
    for rank, res in report["ranks"].items():
        assert res["ns_flops"] == res["plan_ns_flops"], rank  # the step ran the plan
        # the plan rounds the ring all-reduce's 2(t-1)/t share once per rank, comm.py per call: 1 byte in 7 GB
        sent = res["bytes_sent"] - res["bytes_by_collective"].get("shape_check", 0)
        assert sent == pytest.approx(res["plan_bytes_sent"], rel=1e-8), rank
        assert res["peak_extra_bytes"] <= 8 * 2**30, rank  # the goal: transient peak <= 8 GiB
        grid = res["plan_grid"]
        assert grid["ranks"] == 512 and grid["ns_flops_max"] / grid["ns_flops_mean"] <= 2.5
    cost = report["cost_model"]
    assert cost["step_ms_h100"] - cost["adam_step_ms_h100"] <= 100


def test_results_whole_on_every_dp_rank_travel_by_broadcast_within_the_bucket_cap(tmp_path):
    """Issue 24, item 3, at 8B TP1 x DP64 with every matrix whole on every DP rank (Megatron-FSDP
    no_shard, as DDP without the distributed optimizer): the owner's send buffer held dp - 1 copies
    of each result (one fc1 was a 14.8 GB buffer); now each result leaves its owner by one broadcast.
    Measured: largest buffer 112 MiB (one fc1 half), 224 MiB sent by rank 0."""
    _, report = _dry_run(tmp_path, "--model", "llama3-8b", "--tp", "1", "--dp", "64", "--fsdp", "no_shard",
                         "--ranks", "first")
    assert report["errors"] == []
    res = report["ranks"]["0"]
    assert res["largest_send_bytes"] <= 256 * 2**20  # the default owner bucket cap
    assert res["bytes_by_collective"].get("all_to_all", 0) == 0
    assert res["bytes_by_collective"]["broadcast"] == res["plan_bytes_sent"] > 0


@pytest.mark.parametrize("block", ["tp_shard", "local"])
def test_muonbp_local_block_step_sends_nothing_at_405b_pp16_dp64(tmp_path, block):
    """Issue 24, item 2: at TP8 x PP16 x DP64, 24 of 28 matrices are cut across DP; a block step on
    the TP shard reassembles them on their DP owners (117 MiB from the busiest rank, measured),
    a local block step orthogonalizes each rank's own rows: nothing sent, on any rank of the grid,
    and (the layout cutting matrices between rows) every block whole rows."""
    _, report = _dry_run(tmp_path, "--model", "llama3-405b", "--tp", "8", "--pp", "16", "--dp", "64",
                         "--ranks", "busiest", "--muonbp-period", "4", "--muonbp-block", block)
    assert report["errors"] == []
    for rank, res in report["ranks"].items():
        step = res["block_step"]
        assert step["bytes_sent"] == step["plan_bytes_sent"], rank
        assert step["ns_flops"] == step["plan_ns_flops"] > 0, rank
        if block == "local":
            assert step["bytes_sent"] == 0 and step["plan_bytes_max"] == 0, rank
            assert step["local_blocks"] > 0 and step["partial_row_blocks"] == 0, rank
        else:
            assert step["plan_bytes_max"] > 0, rank


def test_bad_arguments_are_named(tmp_path):
    proc = _script("--model", "llama3-8b", "--tp", "0")
    assert proc.returncode == 2 and "--tp must be >= 1, got 0" in proc.stderr
    proc = _script("--model", "llama3-8b", "--ranks", "middle")
    assert proc.returncode != 0 and "unknown kind 'middle'" in proc.stderr
    proc = _script("--model", "llama3-8b", "--ep", "2")
    assert proc.returncode == 2 and "llama3-8b has no experts" in proc.stderr
    proc = _script("--model", "mixtral-8x7b", "--tp", "1", "--dp", "4", "--ep", "8")
    assert proc.returncode == 2 and "must divide TP x DP = 4" in proc.stderr
    proc = _script("--model", "llama3-8b", "--vpp", "2")
    assert proc.returncode == 2 and "--vpp 2: virtual stages need --pp >= 2" in proc.stderr
    proc = _script("--model", "llama3-8b", "--pp", "2", "--vpp", "3")
    assert proc.returncode != 0 and "do not split into 2 x 3 virtual stages" in proc.stderr
    proc = _script("--model", "nemotron-h-8b", "--pp", "16")  # middle stages of 4 leave nothing for the ends
    assert proc.returncode == 2 and "--pp 16 --vpp 1: 52 layers do not split over 16 pipeline stages" in proc.stderr
    proc = _script("--model", "nemotron-h-8b", "--pp", "8", "--vpp", "2")
    assert proc.returncode == 2 and "--pp 8 --vpp 2: 52 layers do not split over 16 pipeline stages" in proc.stderr


def _moe_counts(model: str, ep: int, layers) -> tuple[int, int]:
    """(dense Muon matrices, expert matrices of one EP rank) of ``layers``, from the model's shape."""
    from megatron_muon.core.models import MOE_MODELS

    names = [name for name, *_ in MOE_MODELS[model].matrices() if int(name.split(".")[1]) in layers]
    experts = sum(".experts." in n for n in names)
    return len(names) - experts, experts // ep


def test_mixtral_experts_cut_across_expert_dp(tmp_path):
    """Mixtral-8x7B at TP2 x EP4 x DP8 (expert-TP 2, expert-DP 2) on megatron-core's buffer layout:
    expert matrices cut by the ZeRO-1 ranges of the expert-DP group go whole to one owner there,
    and every rank of rank 0's expert-DP and expert-TP groups is simulated, so the expert owner
    exchange is checked across its whole group."""
    proc, report = _dry_run(tmp_path, "--model", "mixtral-8x7b", "--tp", "2", "--ep", "4", "--dp", "8",
                            "--dp-layout", "megatron")
    assert report["errors"] == []
    assert "EP4 x expert-TP2 x expert-DP2" in proc.stdout
    dense, experts = _moe_counts("mixtral-8x7b", 4, range(32))
    assert (dense, experts) == (96, 128)  # qkv, proj, router per layer; 2 local experts x (fc1, fc2) x 32
    assert proc.stdout.count(f"megatron-muon: Muon on {dense + experts} matrices ({experts} expert matrices of this "
                             "EP rank)") == 1
    ranks = report["ranks"]
    assert {"0", "1", "8"} <= set(ranks)  # rank 0, its expert-TP peer, its expert-DP peer
    for rank, res in ranks.items():
        ex = res["experts"]
        assert res["matrices"] == dense and ex["matrices"] == experts, rank
        assert ex["device"] == "meta" and ex["cut_across_dp"] > 0, rank
        for part in (res, ex):  # the real step does what the plans say, for both optimizers
            assert part["ns_flops"] == part["plan_ns_flops"] > 0, rank
            assert part["bytes_by_collective"]["all_to_all"] == part["plan_bytes_sent"] > 0, rank
    groups = {tuple(g) for g in ranks["0"]["groups"]}
    assert (0, 8) in groups and (0, 1) in groups  # collectives on the expert-DP and the (expert-)TP group
    assert report["summary"]["experts"]["ranks"] == len(ranks)
    # the cost model prices both optimizers' plans (plan.stage_layouts lays out the experts' own
    # buffer over expert DP): its figures are the plans', over every rank of the stage
    cost, plans = report["cost_model"], report["summary"]
    assert (cost["ns_flops_max"], cost["bytes_sent_max"]) == (plans["dense"]["plan"]["ns_flops_max"],
                                                              plans["dense"]["plan"]["bytes_sent_max"])
    assert (cost["expert_ns_flops_max"], cost["expert_bytes_sent_max"]) == (
        plans["experts"]["plan"]["ns_flops_max"], plans["experts"]["plan"]["bytes_sent_max"])
    assert cost["expert_bytes_sent_max"] > 0 and "the experts' plan: NS" in proc.stdout


def test_deepseek_v3_first_moe_stage(tmp_path):
    """DeepSeek-V3 (MLA, 256 experts, first 3 layers dense) at TP1 x EP8 x PP16 x DP16: stage 0
    (layers 0-1) has no experts and no expert optimizer; the expert-DP group is taken on stage 1
    (layers 2-5: one dense, three MoE), 32 local experts per layer; at TP1 an expert matrix is
    whole on its EP rank and, on the balanced layout, on one expert-DP rank: nothing moves."""
    proc, report = _dry_run(tmp_path, "--model", "deepseek-v3", "--tp", "1", "--ep", "8", "--pp", "16", "--dp", "16",
                            "--ranks", "first,expert-dp-group")
    assert report["errors"] == []
    ranks = report["ranks"]
    assert ranks["0"]["experts"] is None and ranks["0"]["matrices"] == _moe_counts("deepseek-v3", 8, range(2))[0]
    assert "linear_kv_up_proj" in proc.stdout and "linear_qkv" not in proc.stdout  # MLA's projections
    dense, experts = _moe_counts("deepseek-v3", 8, range(2, 6))
    group = [r for r in ranks if r != "0"]
    assert sorted(map(int, group)) == [16, 24]  # stage 1 (ranks 16-31): EP8 x expert-DP2, EP fastest
    for rank in group:
        res = ranks[rank]
        assert res["pp"] == 1 and res["matrices"] == dense and res["experts"]["matrices"] == experts == 3 * 32 * 2
        assert res["experts"]["ns_flops"] == res["experts"]["plan_ns_flops"] > 0
        assert res["experts"]["bytes_sent"] == 0


def test_deepseek_v3_dense_stage_is_balanced_by_dp_teams(tmp_path):
    """Issue 24's DeepSeek-V3 row: TP1 x EP8 x PP16 x DP64, dense stage 0 (two dense layers, 14
    matrices for 64 DP ranks). There is no TP group to widen over, so owner left one rank a whole
    7168 x 18432 matrix (NS max/mean 8.03); auto gives the large units to teams of 8 DP ranks (a
    node), each member a row or column block, the Gram all-reduced over the team: 1.08 measured.
    The real step runs what the plan says on a team's first member and on the last DP rank."""
    proc, report = _dry_run(tmp_path, "--model", "deepseek-v3", "--tp", "1", "--ep", "8", "--pp", "16", "--dp", "64",
                            "--tp-mode", "auto", "--ranks", "first,63,team")  # 63: the stage's last DP rank
    assert report["errors"] == []
    ranks = report["ranks"]
    assert set(range(8)) <= {int(r) for r in ranks}  # rank 0's whole team, its collectives compared
    _assert_report_lines_in_docs(proc.stdout)
    grid = ranks["0"]["plan_grid"]
    assert grid["ns_flops_max"] / grid["ns_flops_mean"] <= 2.5  # the goal
    assert "tp mode team" in proc.stdout and "to a team of 8 DP ranks" in proc.stdout
    for rank in ("0", "63"):
        res = ranks[rank]
        assert res["ns_flops"] == res["plan_ns_flops"] > 0, rank
        # comm floors each all-reduce's 2(t-1)/t share to whole bytes, the plan rounds the sum
        assert abs(res["bytes_sent"] - res["plan_bytes_sent"]) < 64, rank
        assert res["bytes_by_collective"]["all_reduce"] > 0, rank  # the team's Gram all-reduces
    assert list(range(56, 64)) in ranks["63"]["groups"] and list(range(8)) in ranks["0"]["groups"]  # the teams


def test_megatron_fsdp_step_matches_plan_and_planner(tmp_path):
    """--fsdp optim_grads_params (issue 15): Megatron-FSDP's FullyShardedDataParallel wraps the
    meta model instead of DDP; MuonFSDPOptimizer steps its DTensor shards. Llama-3 8B at TP8 x DP8
    (about 20 s): each transformer layer is one bucket cut in 8 equal shards, 96 of the 128 Muon
    matrices cut between DP ranks (the planner table's count), and on every simulated rank the
    step does what the plans and the planner table's "ours (Megatron-FSDP)" row say, to the unit."""
    proc, report = _dry_run(tmp_path, "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--fsdp", "optim_grads_params",
                            "--ranks", "first,no-first-piece,last")
    assert report["errors"] == [] and report["fsdp"] == "optim_grads_params" and report["dp_layout"] is None
    assert "Megatron-FSDP optim_grads_params" in proc.stdout
    ranks = report["ranks"]
    assert {"0", "63"} <= set(ranks) and len(ranks) == 3
    for rank, res in ranks.items():
        assert res["device"] == "meta" and res["trace"] > 0, rank
        assert res["matrices"] == 128 and res["cut_across_dp"] == 96, rank
        assert res["ns_flops"] == res["plan_ns_flops"] == res["planner_ns_flops"] > 0, rank
        assert res["bytes_by_collective"]["all_to_all"] == res["plan_bytes_sent"] == res["planner_bytes_sent"] > 0
        # the momentum of this rank's shards, counted at the DTensor's local size (not its global
        # one): the state, made before the step and reported apart from the step's transient peak
        assert 0 < res["state_bytes"] < 4 * 2**30, rank
        assert 0 < res["peak_extra_bytes"] < 4 * 2**30, rank
    assert report["cost_model"] is None  # the cost model knows DDP's layouts only
    # --fsdp and --dp-layout (DDP's buffer layout) exclude each other
    proc = _script("--model", "llama3-8b", "--fsdp", "optim_grads_params", "--dp-layout", "megatron")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    # megatron-core 0.19.2's Megatron-FSDP cannot be built with PP > 1 (its mesh is every rank of the job)
    proc = _script("--model", "llama3-405b", "--pp", "16", "--dp", "64", "--fsdp", "optim_grads_params")
    assert proc.returncode == 2 and "cannot be built with pipeline parallelism" in proc.stderr


def test_megatron_fsdp_experts_step_over_the_expert_dp_group(tmp_path):
    """--fsdp optim_grads_params with experts (issue 44): Mixtral-8x7B at TP1 x EP8 x DP16
    (expert-DP 2; about 12 s). Megatron-FSDP's chain of two MuonFSDPOptimizers, dense over the DP
    group of 16 and experts over Megatron-FSDP's expert-DP group, both step on meta. Each layer's
    bucket holds one local expert (fc1: 2 units, fc2: 1) cut in two equal shards, so its fc1 is cut
    between the two expert-DP ranks and travels to one owner; both steps do what their plans say,
    and only the chain's last (expert) optimizer installs the model's weights."""
    proc, report = _dry_run(tmp_path, "--model", "mixtral-8x7b", "--tp", "1", "--ep", "8", "--dp", "16",
                            "--fsdp", "optim_grads_params", "--ranks", "first,expert-dp-group")
    assert report["errors"] == [] and report["fsdp"] == "optim_grads_params"
    assert "EP8 x expert-TP1 x expert-DP2" in proc.stdout and "Megatron-FSDP optim_grads_params" in proc.stdout
    ranks = report["ranks"]
    assert set(ranks) == {"0", "8"}  # rank 0 and its expert-DP peer (EP fastest)
    dense, experts = _moe_counts("mixtral-8x7b", 8, range(32))
    for rank, res in ranks.items():
        ex = res["experts"]
        assert res["matrices"] == dense and ex["matrices"] == experts == 64, rank
        assert ex["device"] == "meta" and ex["cut_across_dp"] == 32, rank  # every layer's fc1
        for part in (res, ex):
            assert part["ns_flops"] == part["plan_ns_flops"] > 0, rank
            assert part["bytes_by_collective"]["all_to_all"] == part["plan_bytes_sent"] > 0, rank
        assert (res["installs_model_weights"], ex["installs_model_weights"]) == (False, True), rank
        # the momentum of this rank's half of its local experts' fp32 main weights (DTensor local size)
        assert ex["state_bytes"] == pytest.approx(32 * 3 * 4096 * 14336 * 4 / 2, rel=0.01), rank
    groups = {tuple(g) for g in ranks["0"]["groups"]}
    assert (0, 8) in groups and tuple(range(16)) in groups  # the expert-DP group and the dense DP group
    assert report["cost_model"] is None


def test_megatron_fsdp_no_shard_exchanges_over_the_dp_group(tmp_path):
    """--fsdp no_shard at TP8 x DP8: every matrix whole on every DP rank; the owner exchange shares
    the Newton–Schulz work over the 8 DP ranks. MuonFSDPOptimizer used to hand the inner step no
    DP group under no_shard, so it planned owners over the whole world (64 ranks) and the startup
    report failed (IndexError); the Megatron-FSDP tests ran no_shard at TP1 only, where the world
    is the DP group."""
    _, report = _dry_run(tmp_path, "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--fsdp", "no_shard",
                         "--ranks", "last")
    assert report["errors"] == []
    res = report["ranks"]["63"]
    # 224 units (q, k, v, proj, gate, up, fc2 of 32 layers: one query group per rank at TP8) over 8 DP owners
    assert res["cut_across_dp"] == 0 and res["dp_owned"] == 28
    assert res["ns_flops"] == res["plan_ns_flops"] > 0
    # the TP owner exchange's all-to-alls and, every matrix being whole on every DP rank, the DP
    # owners' broadcasts of the results (one copy each, never dp - 1 in a send buffer)
    by = res["bytes_by_collective"]
    assert by["all_to_all"] + by.get("broadcast", 0) == res["plan_bytes_sent"] > 0
    assert by.get("broadcast", 0) > 0 or res["dp_owned"] == 0
    assert "planner_ns_flops" not in res  # the planner table emulates optim_grads_params only
    assert {len(g) for g in res["groups"]} == {8}  # the DP and TP groups, never the world
