"""scripts/bench/tiny_gpt_step.py, the script behind the tiny-GPT tables of docs/muonbp.md and
docs/megatron_optimizer.md, runs end to end at a small size (gloo, CPU).

Nothing here pins a recorded number: the tests check the table's rows and columns, and relations
that hold on any machine (a blockwise step moves nothing over TP; the period average lies between
the block and full medians).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "scripts.bench.tiny_gpt_step", *args, "--json", str(out), "--timeout", "240"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout, json.loads(out.read_text())


def test_muonbp_table(tmp_path):
    # period 2 after 1 warm-up step (a full step): timed steps 1 and 2 are one block and one full.
    stdout, report = _run(tmp_path, "muonbp", "--period", "2", "--steps", "2")
    assert "| optimizer | step kind | steps | median ms | TP bytes/step (ours, comm_stats) |" in stdout
    rows = {(r["label"], r["kind"]): r for r in report["rows"]}
    assert set(rows) == {("ours, owner", "muon"), ("ours, MuonBP P=2", "full"), ("ours, MuonBP P=2", "block"),
                         ("ours, MuonBP P=2", "period average of medians"),
                         ("megatron-core TensorParallelMuon duplicated", "—")}
    assert all(r["median_ms"] > 0 for r in rows.values())
    full, block = rows[("ours, MuonBP P=2", "full")], rows[("ours, MuonBP P=2", "block")]
    assert full["steps"] == block["steps"] == 1 and rows[("ours, owner", "muon")]["steps"] == 2
    assert block["bytes"] == 0 and full["bytes"] == rows[("ours, owner", "muon")]["bytes"] > 0
    avg = rows[("ours, MuonBP P=2", "period average of medians")]
    assert min(full["median_ms"], block["median_ms"]) <= avg["median_ms"] <= max(full["median_ms"], block["median_ms"])
    assert rows[("megatron-core TensorParallelMuon duplicated", "—")]["bytes"] is None


def test_bytes_table(tmp_path):
    stdout, report = _run(tmp_path, "bytes", "--tp-modes", "owner,blockwise")
    assert "| optimizer | tp_mode | dp_mode |" in stdout and "| total |" in stdout
    rows = {(r["optimizer"], r["tp_mode"], r["dp_mode"]): r for r in report["rows"]}
    assert set(rows) == {("DDP", "owner", "owner"), ("DDP", "owner", "redundant"), ("DDP", "blockwise", "owner"),
                         ("distributed", "owner", "—"), ("distributed", "blockwise", "—")}
    for r in rows.values():
        per_primitive = [v for k, v in r.items() if k not in ("optimizer", "tp_mode", "dp_mode", "total")]
        assert all(isinstance(v, int) and v >= 0 for v in per_primitive)
        assert max(per_primitive, default=0) <= r["total"] <= sum(per_primitive)
        assert "shape_check" not in r  # the measured step is the second: no one-time shape check
    assert rows[("distributed", "owner", "—")]["total"] > 0
    # blockwise moves nothing over TP; without the distributed optimizer the DP owner still sends
    # the results to the other replica, with it nothing is cut here so nothing moves at all.
    assert rows[("distributed", "blockwise", "—")]["total"] == 0
    assert rows[("DDP", "blockwise", "owner")]["total"] > 0
