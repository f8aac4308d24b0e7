"""scripts/bench/bench_optimizer_step.py end to end at a tiny size (TP 2, gloo, 2 processes).

One run of the script (Llama-3-8B / 64: hidden 64, ffn 224, 8 heads / 2 groups, 1 layer, vocab
128, no warm-up) in a
temp dir; the tests read its JSON. Nothing here is a recorded number: bytes and FLOPs are
derived from the model shapes in the JSON, times only have to exist and be positive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.core.newton_schulz import method_flops, ns_flops

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 2
VOCAB = 128
FP32 = 4  # bytes: NS runs in fp32 on the CPU, so the owner exchange moves fp32
EXPECTED_LABELS = {
    "ours owner", "ours duplicated", "ours distributed", "ours blockwise", "ours owner balanced",
    "ours MuonBP P=5 full step", "ours MuonBP P=5 block step", "ours MuonBP P=5 period avg",
    "ours owner gram", "ours distributed gram",
    "megatron duplicated", "megatron distributed", "megatron blockwise",
    "megatron layer-wise (duplicated)", "megatron adam distopt",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "scripts.bench.bench_optimizer_step", "--layouts", "tp2", "--scale", "64",
           "--layers", "1", "--vocab", str(VOCAB), "--warmup", "0", "--repeats", str(REPEATS), "--out-dir", str(out),
           "--timeout", "240"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # -m scripts.bench from the temp dir
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "| ours owner |" in done.stdout  # the table goes to stdout too
    assert (out / "optimizer_step.md").read_text().startswith("Optimizer step")
    return json.loads((out / "optimizer_step.json").read_text())


def _rows(report):
    (layout,) = report["layouts"]
    assert (layout["name"], layout["tp"], layout["dp"], layout["world"]) == ("tp2", 2, 1, 2)
    return {r["label"]: r for r in layout["rows"]}


def _sub_matrices(report):
    """Full global shapes of what ours orthogonalizes: QKV as Q, K, V (each stacked over query
    groups), gated fc1 as gate and up, proj and fc2 whole; and what Megatron does (fc1 fused)."""
    m = report["model"]
    q, kv = m["heads"] * m["head_dim"], m["query_groups"] * m["head_dim"]
    ours, megatron = [], []
    for mat in report["muon_matrices"]:
        rows, cols = mat["rows"], mat["cols"]
        if mat["kind"] == "qkv":
            assert rows == q + 2 * kv
            split = [(q, cols), (kv, cols), (kv, cols)]
            ours += split
            megatron += split
        elif mat["kind"] == "fc1":
            ours += [(rows // 2, cols)] * 2
            megatron.append((rows, cols))
        else:
            ours.append((rows, cols))
            megatron.append((rows, cols))
    return ours, megatron


def test_every_row_with_positive_times(report):
    rows = _rows(report)
    assert set(rows) == EXPECTED_LABELS
    for r in rows.values():
        assert len(r["times_ms"]) == REPEATS and min(r["times_ms"]) > 0, r["label"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert len(r["bytes_sent_per_rank"]) == len(r["ns_flops_per_rank"]) == len(r["peak_mib_per_rank"]) == 2
        assert min(r["state_mib_per_rank"]) > 0 and min(r["peak_mib_per_rank"]) > 0, r["label"]
    assert rows["megatron duplicated"]["ratio_vs_megatron_duplicated"] == 1.0


def test_the_ranks_probed_the_machine_around_their_rounds(report, tmp_path):
    """The layout carries the cost model's constants its own ranks measured, and the validation
    predicts every row on them with no separate calibration file."""
    from megatron_muon.plan.hardware import Hardware

    (layout,) = report["layouts"]
    hw = Hardware(**layout["hardware"])  # every field present, nothing extra
    assert (hw.name, hw.ranks_per_node, hw.fused_adam) == ("cpu-gloo-2proc", 2, False)
    for value in (hw.matmul_flops, hw.memory_bandwidth, hw.intra_node_bandwidth, hw.collective_latency_s,
                  hw.kernel_overhead_s, hw.all_reduce_efficiency, hw.all_to_all_efficiency, hw.solo_gather_bandwidth):
        assert value > 0
    # the same latencies back to back, for the host floor's pricing (a step with next to no compute)
    assert set(layout["back_to_back"]) == {"collective_latency_s", "all_reduce_step_s"}
    assert min(layout["back_to_back"].values()) > 0
    bench = tmp_path / "optimizer_step.json"
    bench.write_text(json.dumps(report))
    out = tmp_path / "validation.json"
    done = subprocess.run([sys.executable, "-m", "scripts.bench.validate_cost_model", "--bench", str(bench),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["label"] for r in rows} == EXPECTED_LABELS and all(r["predicted_ms"] > 0 for r in rows)
    # the prediction is the model's figure plus the row's unpriced host path, never negative
    for r in rows:
        assert r["host_ms"] >= 0 and r["predicted_ms"] == pytest.approx(r["model_ms"] + r["host_ms"]), r["label"]
    assert "predicted: " in done.stdout and "the model alone: " in done.stdout


def test_every_row_has_its_host_floor(report):
    """Each row timed again on the host floor's tiny model (Llama-3-8B / 128 by default, the same
    layers), in every round, each step kind apart; its sizes are recorded beside the model's."""
    tiny, m = report["floor_model"], report["model"]
    assert (tiny["hidden"], tiny["ffn"], tiny["layers"]) == (4096 // 128, 14336 // 128, m["layers"])
    assert tiny["vocab"] == max(16, VOCAB * 64 // 128)
    for r in _rows(report).values():
        assert r["host_floor_ms"] > 0, r["label"]


def test_model_inventory(report):
    m = report["model"]
    assert (m["hidden"], m["ffn"], m["heads"], m["query_groups"], m["head_dim"], m["layers"]) == (64, 224, 8, 2, 8, 1)
    kinds = sorted(mat["kind"] for mat in report["muon_matrices"])
    assert kinds == ["fc1", "fc2", "proj", "qkv"]
    shapes = {mat["kind"]: (mat["rows"], mat["cols"], mat["partition_dim"]) for mat in report["muon_matrices"]}
    assert shapes == {"qkv": (96, 64, 0), "proj": (64, 64, 1), "fc1": (448, 64, 0), "fc2": (64, 224, 1)}
    assert sum(p["numel"] for p in report["adam_params"]) == 2 * VOCAB * 64 + 3 * 64  # embedding, output, 3 norms


def test_owner_bytes_are_the_exchange_and_nothing_else(report):
    rows = _rows(report)
    # owner_mode: at t = 2 each sub-matrix's non-owner shard (half of it) goes to the owner and
    # the owner's result for it comes back: the full matrix's bytes per matrix, summed over ranks.
    full_bytes = sum(mat["rows"] * mat["cols"] * FP32 for mat in report["muon_matrices"])
    assert sum(rows["ours owner"]["package_bytes_per_rank"]) == full_bytes
    assert rows["ours blockwise"]["package_bytes_per_rank"] == [0, 0]
    assert rows["ours MuonBP P=5 block step"]["package_bytes_per_rank"] == [0, 0]
    assert rows["ours MuonBP P=5 full step"]["package_bytes_per_rank"] == rows["ours owner"]["package_bytes_per_rank"]
    # at DP 1 the buffer layout moves no byte either way: the balanced row sends the TP exchange only
    assert rows["ours owner balanced"]["package_bytes_per_rank"] == rows["ours owner"]["package_bytes_per_rank"]
    # Every collective of the step is counted by the shim; Megatron's own (grad-norm all-reduces)
    # are the same for every ours row, so the difference to blockwise is exactly our traffic.
    for mode in ("owner", "duplicated", "distributed"):
        r, block = rows[f"ours {mode}"], rows["ours blockwise"]
        assert ([a - b for a, b in zip(r["bytes_sent_per_rank"], block["bytes_sent_per_rank"])]
                == r["package_bytes_per_rank"])
    assert rows["ours owner"]["bytes_by_primitive"]["all_to_all_single"] > 0
    assert rows["megatron duplicated"]["bytes_by_primitive"]["all_gather"] > 0


def test_ns_flops(report):
    rows = _rows(report)
    ours, megatron = _sub_matrices(report)
    expected_ours = sum(ns_flops(r, c, 5) for r, c in ours)
    assert rows["ours duplicated"]["ns_flops_per_rank"] == [expected_ours] * 2
    # Megatron's are counted by wrapping emerging_optimizers' newton_schulz: the same formula on
    # the shapes it runs (full fused fc1 on every rank in duplicated mode).
    assert rows["megatron duplicated"]["ns_flops_per_rank"] == [sum(ns_flops(r, c, 5) for r, c in megatron)] * 2
    # owner: NS once per sub-matrix somewhere in the TP group.
    assert sum(rows["ours owner"]["ns_flops_per_rank"]) == expected_ours
    assert rows["megatron adam distopt"]["ns_flops_max"] == 0
    # --muon-ns-method gram: the Gram iteration's FLOPs where the aspect takes it, fewer in all
    gram = sum(method_flops("gram", r, c, 5) for r, c in ours)
    assert sum(rows["ours owner gram"]["ns_flops_per_rank"]) == gram < expected_ours


def test_exactness_passed(report):
    (layout,) = report["layouts"]
    check = layout["exactness"]
    assert check["passed"] and check["tolerance"] == 1e-5
    checked = {k: v for k, v in check["max_abs_diff"].items() if "not checked" not in k}
    # 5 exact rows against ours owner, 6 against megatron duplicated (fc1 excluded), layer-wise's
    assert len(checked) == 12 and max(checked.values()) <= check["tolerance"]
    # fc1 really differs (split vs fused gate/up): the check would see a wrong update.
    fc1 = next(v for k, v in check["max_abs_diff"].items() if "not checked" in k)
    assert fc1 > 10 * check["tolerance"]
