"""``python -m scripts.bench.muonbp_study --smoke`` end to end (about 1.5 minutes on 2 cores).

A byte-level dataset of this package's own sources (scripts/prepare_data.py, into tmp), then the
study as a subprocess at its smoke size: every phase (lr sweep, period × block-count ablation,
large lr, block lr multiplier) through Megatron's loop in single-process runs, 2 seeds. Checks that
each cell ran at every seed, that the block grid and the multiplier reached the runs (startup
report, log flags), that the parameter-norm curve was logged, and the tables and PNGs. The
report's statistics are checked on synthetic runs in ``tests/unit/test_muonbp_study.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from entry_harness import bench_script_env, sources_dataset

REPO = Path(__file__).resolve().parents[2]


def test_smoke_study_runs_every_phase(tmp_path):
    data, env = sources_dataset(tmp_path), bench_script_env()
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "scripts.bench.muonbp_study", "--smoke", "--data-dir", str(data),
           "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(out.glob("*.log"))[:3])
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}{logs}"

    runs = json.loads((out / "results.json").read_text())["runs"]
    # 4 sweep cells, 2 new ablation cells (P=2 at 2 blocks; BlockMuon at 2 blocks), 3 at 10× lr,
    # 1 new multiplier: 10 cells × 2 seeds.
    assert len(runs) == 20 and all(r["status"] == "ok" for r in runs), [r["status"] for r in runs]
    cells = {}
    for r in runs:
        cells.setdefault((r["slug"], r["lr"]), []).append(r["seed"])
    assert all(sorted(seeds) == [1, 2] for seeds in cells.values()), cells
    phases = {p for r in runs for p in r["phases"]}
    assert phases == {"sweep", "ablation", "large_lr", "dual_lr"}
    for r in runs:
        log = (out / r["log"]).read_text()
        assert f"--seed {r['seed']}" in log.splitlines()[0] and "--tensor-model-parallel-size 1" in log.splitlines()[0]
        assert all(math.isfinite(v) and 0 < v < 7 for _, v in r["train_loss"] + r["val_loss"]), r
        if r["variant"]["kind"] == "muonbp":
            rows, cols = {2: (2, 1), 4: (2, 2)}[r["variant"]["blocks"]]
            assert f"--muonbp-block-grid {rows}x{cols}" in log.splitlines()[0]
            assert f"block grid {rows}x{cols}" in log  # the startup report states the grid the run used
        if r["variant"]["kind"] != "adamw":
            assert [it for it, _ in r["param_norm"]] == [it for it, _ in r["train_loss"]] and r["param_norm"][0][1] > 0
        if r["variant"]["mult"] != 1.0:
            assert "--muonbp-block-lr-mult 0.5" in log.splitlines()[0]

    md = (out / "results.md").read_text()
    for heading in ("## 1. lr sweep", "## 2. Each at its best lr", "## 3. Ablation", "## 4. Large learning rates",
                    "## 5. Block learning rate", "## The paper's claims at this size"):
        assert heading in md
    assert "| MuonBP P=2, 4 blocks | 0.003 |" in md and "| ∞ | " in md
    assert "## The paper's claims" in proc.stdout  # printed too
    for name in ("ablation_heatmap.png", "large_lr.png", "comparison.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
