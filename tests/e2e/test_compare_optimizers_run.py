"""scripts/bench/compare_optimizers.py end to end, at a size that runs in about a minute on 2 cores.

A byte-level dataset of this package's own sources (scripts/prepare_data.py, into tmp), then the
script as a subprocess: AdamW, MuonBP (P=5) and Muon with Gram Newton–Schulz at one lr each
(the last against MuonBP as ``--reference``, on seed 7), a 2-layer hidden-64 seq-64 GPT,
6 iterations logged every 2, 2 evaluations; checks results.json, results.md and loss_curves.png.
The log parsing and the failed-run rows are checked on synthetic text, without Megatron, in
``tests/unit/test_compare_optimizers.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from entry_harness import bench_script_env, sources_dataset

REPO = Path(__file__).resolve().parents[2]


def test_comparison_runs_and_writes_results(tmp_path):
    data, env = sources_dataset(tmp_path), bench_script_env()
    out = tmp_path / "compare"
    cmd = [sys.executable, "-m", "scripts.bench.compare_optimizers", "--optimizers", "adamw,muonbp,muon_gram",
           "--lr-grid", "adamw=3e-3", "--lr-grid", "muonbp=5e-3", "--lr-grid", "muon_gram=5e-3",
           "--seeds", "7", "--reference", "muonbp",
           "--model", "tiny", "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--evals", "2", "--eval-iters", "2", "--log-interval", "2",
           "--data-dir", str(data), "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}{logs}"

    results = json.loads((out / "results.json").read_text())
    meta, runs = results["meta"], results["runs"]
    assert meta["tokens_per_run"] == 6 * 4 * 64
    assert [(r["optimizer"], r["lr"], r["seed"]) for r in runs] == [("adamw", 3e-3, 7), ("muonbp", 5e-3, 7),
                                                                    ("muon_gram", 5e-3, 7)]
    for r in runs:
        assert r["status"] == "ok" and r["returncode"] == 0, r
        log = (out / r["log"]).read_text()
        assert r["log"].endswith("_seed7.log") and "--seed 7" in log.splitlines()[0]
        # Megatron logs iteration 1 and every 2nd; evaluates at 3 and at 6 (in the loop and after
        # training, averaged into one point).
        assert [it for it, _ in r["train_loss"]] == [1, 2, 4, 6] == meta["expected_train_iterations"]
        assert [it for it, _ in r["val_loss"]] == [3, 6] == meta["expected_val_iterations"]
        losses = [v for _, v in r["train_loss"] + r["val_loss"]]
        assert all(math.isfinite(v) and 0 < v < 7 for v in losses), r  # ln(257) ≈ 5.55 at init
        assert r["best_val_loss"] == min(v for _, v in r["val_loss"])
        assert r["wall_s"] > 0 and r["ms_per_iteration"] > 0

    md = (out / "results.md").read_text()
    for label in ("AdamW", "MuonBP (P=5)", "Muon, Gram NS"):
        assert f"| {label} | " in md
    assert "1,536" in md and "--optimizers adamw,muonbp,muon_gram" in md
    assert "## Against MuonBP (P=5) (same lr, same seed)" in md and "| Muon, Gram NS | 0.005 | 7 |" in md
    # The Gram run really ran Gram Newton–Schulz on its 4:1 MLP matrices (the startup report's NS column).
    gram_log = (out / "muon_gram_lr0.005_seed7.log").read_text()
    assert "(gram, float32)" in gram_log or "(gram, bfloat16)" in gram_log
    assert "## Full sweep" in proc.stdout  # the table is printed too
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
