"""scripts/bench/compare_optimizers.py without running it: the log parsing, the failed-run rows
of its tables and the reuse of earlier results, checked on synthetic text, without Megatron.
The script itself runs end to end in ``tests/e2e/test_compare_optimizers_run.py``.
"""

from __future__ import annotations

import json
import math

from scripts.bench import compare_optimizers as compare

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
