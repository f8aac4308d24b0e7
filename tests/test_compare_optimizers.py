"""scripts/bench/compare_optimizers.py end to end, at a size that runs in about a minute on 2 cores.

A byte-level dataset of this package's own sources (scripts/prepare_data.py, into tmp), then the
script as a subprocess: AdamW and MuonBP (P=5) at one lr each, a 2-layer hidden-64 seq-64 GPT,
6 iterations logged every 2, 2 evaluations; checks results.json, results.md and loss_curves.png.
The log parsing and the failed-run rows are checked on synthetic text, without Megatron.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from scripts.bench import compare_optimizers as compare

REPO = Path(__file__).resolve().parents[1]


def test_comparison_runs_and_writes_results(tmp_path):
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))  # -m scripts.bench from tmp
    subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(data),
                    "--input", str(REPO / "megatron_muon"), "--valid-fraction", "0.2"],
                   check=True, capture_output=True, env=env, timeout=120)
    out = tmp_path / "compare"
    cmd = [sys.executable, "-m", "scripts.bench.compare_optimizers", "--optimizers", "adamw,muonbp",
           "--lr-grid", "adamw=3e-3", "--lr-grid", "muonbp=5e-3",
           "--model", "tiny", "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--evals", "2", "--eval-iters", "2", "--log-interval", "2",
           "--data-dir", str(data), "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}{logs}"

    results = json.loads((out / "results.json").read_text())
    meta, runs = results["meta"], results["runs"]
    assert meta["tokens_per_run"] == 6 * 4 * 64
    assert [(r["optimizer"], r["lr"]) for r in runs] == [("adamw", 3e-3), ("muonbp", 5e-3)]
    for r in runs:
        assert r["status"] == "ok" and r["returncode"] == 0, r
        assert (out / r["log"]).is_file()
        # Megatron logs iteration 1 and every 2nd; evaluates at 3 and at 6 (in the loop and after
        # training, averaged into one point).
        assert [it for it, _ in r["train_loss"]] == [1, 2, 4, 6] == meta["expected_train_iterations"]
        assert [it for it, _ in r["val_loss"]] == [3, 6] == meta["expected_val_iterations"]
        losses = [v for _, v in r["train_loss"] + r["val_loss"]]
        assert all(math.isfinite(v) and 0 < v < 7 for v in losses), r  # ln(257) ≈ 5.55 at init
        assert r["best_val_loss"] == min(v for _, v in r["val_loss"])
        assert r["wall_s"] > 0 and r["ms_per_iteration"] > 0

    md = (out / "results.md").read_text()
    for label in ("AdamW", "MuonBP (P=5)"):
        assert f"| {label} | " in md
    assert "1,536" in md and "--optimizers adamw,muonbp" in md
    assert "## Full sweep" in proc.stdout  # the table is printed too
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


LOG = (
    " [2026-01-01 00:00:00] iteration        1/       4 | consumed samples:  4 "
    "| elapsed time per iteration (ms): 900.0 | learning rate: 1.0E-03 | global batch size:     4 "
    "| lm loss: 5.600000E+00 | loss scale: 1.0 |\n"
    " [2026-01-01 00:00:01] iteration        2/       4 | consumed samples:  8 "
    "| elapsed time per iteration (ms): 100.0 | learning rate: 1.0E-03 | global batch size:     4 "
    "| lm loss: 5.000000E+00 | loss scale: 1.0 |\n"
    " validation loss at iteration 2 | lm loss value: 4.900000E+00 | lm loss PPL: 1.3E+02 |\n"
    " [2026-01-01 00:00:02] iteration        4/       4 | consumed samples: 16 "
    "| elapsed time per iteration (ms): 120.0 | learning rate: 1.0E-04 | global batch size:     4 "
    "| lm loss: 4.000000E+00 | loss scale: 1.0 |\n"
    " validation loss at iteration 4 | lm loss value: 4.200000E+00 | lm loss PPL: 66.7 |\n"
    " validation loss at iteration 4 on validation set | lm loss value: 4.000000E+00 | lm loss PPL: 54.6 |\n"
)


def test_parse_log_and_failed_rows():
    parsed = compare.parse_log(LOG)
    assert parsed["train_loss"] == [(1, 5.6), (2, 5.0), (4, 4.0)]
    assert [it for it, _ in parsed["val_loss"]] == [2, 4]
    assert math.isclose(parsed["val_loss"][1][1], 4.1)  # the two evaluations at 4, averaged
    assert parsed["ms_per_iteration"] == 110.0  # the first (warm-up) iteration left out
    assert compare.expected_train_points(4, 2) == [1, 2, 4]
    assert compare.expected_val_points(4, 2) == [2, 4]
    assert compare.expected_val_points(7, 3) == [3, 6, 7]

    ok = dict(optimizer="adamw", label="AdamW", lr=1e-3, status="ok", returncode=0, wall_s=10.0,
              best_val_loss=4.1, **parsed)
    failed = dict(optimizer="muon", label="Muon", lr=5e-3, status="failed", returncode=1, wall_s=3.0,
                  best_val_loss=None, train_loss=[], val_loss=[], ms_per_iteration=None)
    meta = dict(model="m", tokens_per_run=64, train_iters=4, global_batch_size=4, seq_length=4,
                schedule="s", validation="v", command="cmd")
    md = compare.markdown([ok, failed], meta, {"adamw": [1e-3, 3e-3], "muon": [5e-3]})
    assert "| AdamW | 0.001 (grid edge) | 4.1000 |" in md
    assert "| Muon | failed |" in md and "| Muon | 0.005 | FAILED (rc 1) |" in md
    assert compare.best_runs([ok, failed]) == {"adamw": ok}


def test_reuse_keeps_only_successful_runs_with_the_same_flags(tmp_path):
    results = tmp_path / "results.json"
    runs = [dict(optimizer="muon", lr=1e-3, status="ok", best_val_loss=2.0),
            dict(optimizer="adamw", lr=1e-3, status="failed", best_val_loss=None)]
    results.write_text(json.dumps(dict(meta=dict(megatron_flags=["--num-layers", "4"]), runs=runs)))
    kept = compare.previous_runs(results, ["--num-layers", "4"])
    assert list(kept) == [("muon", 1e-3)]  # the failed run is made again
    assert compare.previous_runs(results, ["--num-layers", "2"]) == {}  # other flags: nothing reused
    assert compare.previous_runs(tmp_path / "missing.json", []) == {}
