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

    ok = dict(optimizer="adamw", label="AdamW", lr=1e-3, seed=1234, status="ok", returncode=0, wall_s=10.0,
              best_val_loss=4.1, **parsed)
    failed = dict(optimizer="muon", label="Muon", lr=5e-3, seed=1234, status="failed", returncode=1, wall_s=3.0,
                  best_val_loss=None, train_loss=[], val_loss=[], ms_per_iteration=None)
    meta = dict(model="m", tokens_per_run=64, train_iters=4, global_batch_size=4, seq_length=4,
                schedule="s", validation="v", command="cmd")
    md = compare.markdown([ok, failed], meta, {"adamw": [1e-3, 3e-3], "muon": [5e-3]})
    assert "| AdamW | 0.001 (grid edge) | 4.1000 | 4.1000 | 4.0000 |" in md
    assert "| Muon | failed |" in md and "| Muon | 0.005 | 1234 | FAILED (rc 1) |" in md
    assert "Seeds: 1234." in md and "## Against" not in md
    assert compare.best_runs([ok, failed]) == {"adamw": ok}


def test_reuse_keeps_only_successful_runs_with_the_same_flags(tmp_path):
    results = tmp_path / "results.json"
    runs = [dict(optimizer="muon", lr=1e-3, status="ok", best_val_loss=2.0),
            dict(optimizer="adamw", lr=1e-3, status="failed", best_val_loss=None)]
    results.write_text(json.dumps(dict(meta=dict(megatron_flags=["--num-layers", "4"]), runs=runs)))
    kept = compare.previous_runs(results, ["--num-layers", "4"])
    assert list(kept) == [("muon", 1e-3, 1234)]  # the failed run is made again; no seed recorded: the default
    assert compare.previous_runs(results, ["--num-layers", "2"]) == {}  # other flags: nothing reused
    assert compare.previous_runs(tmp_path / "missing.json", []) == {}


def _run(name, lr, seed, best, final, status="ok"):
    ok = status == "ok"
    return dict(optimizer=name, label=compare.OPTIMIZERS[name][0], lr=lr, seed=seed, status=status,
                returncode=0 if ok else 1, wall_s=1.0, ms_per_iteration=100.0 if ok else None,
                best_val_loss=best if ok else None, train_loss=[(1, 5.0), (4, final)] if ok else [],
                val_loss=[(2, best), (4, final)] if ok else [])


def test_seeds_choose_the_lr_by_their_mean_and_pair_with_the_reference():
    runs = [_run("muon", 1e-3, 1, 2.0, 2.1), _run("muon", 1e-3, 2, 2.2, 2.3),
            _run("muon", 3e-3, 1, 1.9, 2.0), _run("muon", 3e-3, 2, 2.5, 2.6),  # mean 2.2 > 2.1
            _run("muon_gram", 1e-3, 1, 2.004, 2.1), _run("muon_gram", 1e-3, 2, 2.2, 2.31),
            _run("muon_gram", 3e-3, 1, 1.0, 1.0), _run("muon_gram", 3e-3, 2, 0, 0, status="failed")]
    best = compare.best_cells(runs)
    assert [r["lr"] for r in best["muon"]] == [1e-3, 1e-3]  # lowest mean, not the lowest single run
    assert [r["lr"] for r in best["muon_gram"]] == [1e-3, 1e-3]  # a cell with a failed seed is out
    meta = dict(model="m", tokens_per_run=64, train_iters=4, global_batch_size=4, seq_length=4,
                schedule="s", validation="v", command="cmd", reference="muon")
    md = compare.markdown(runs, meta, {"muon": [1e-3, 3e-3], "muon_gram": [1e-3, 3e-3]})
    assert "Seeds: 1, 2 (mean ± sample standard deviation over seeds)." in md
    assert "| Muon | 0.001 (grid edge) | 2.1000 ± 0.1414 | 2.2000 ± 0.1414 |" in md
    assert "## Against Muon (same lr, same seed)" in md
    assert "| Muon, Gram NS | 0.001 | 1 | 2.0000 | 2.0040 | +0.0040 | 2.1000 | 2.1000 | +0.0000 |" in md
    assert "| Muon, Gram NS | 0.003 | 1 | 1.9000 | 1.0000 | -0.9000 |" in md
    # The failed run is not paired; the largest |Δ| covers the three paired runs.
    assert "- Muon, Gram NS: largest |Δ| over its runs 1.0000 (3 runs paired)" in md


def test_bad_seeds_and_reference_are_one_line_errors(capsys):
    import pytest

    for argv, needle in ((["--seeds", "1,x"], "--seeds '1,x': expected comma-separated integers"),
                         (["--seeds", "1,1"], "--seeds [1, 1]: expected at least one seed, none repeated"),
                         (["--optimizers", "muon", "--reference", "adamw"], "--reference 'adamw': expected one of")):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)
        assert needle in capsys.readouterr().err
    args = compare.parse_args(["--seeds", "1234,1,2"])
    assert args.seeds == [1234, 1, 2] and args.optimizers == list(compare.DEFAULT_OPTIMIZERS)
    assert compare.run_name("muon", 1e-3, 1234) == "muon_lr0.001"
    assert compare.run_name("muon", 1e-3, 2) == "muon_lr0.001_seed2"
