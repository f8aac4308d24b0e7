"""scripts/bench/muonbp_study.py without running Megatron: the study's cells, every variant's flags
through Megatron's parser and ours into a valid MuonConfig, and the report's paired statistics,
verdicts and files on synthetic runs. The study itself runs (``--smoke``) in
``tests/e2e/test_muonbp_study_smoke.py``."""

from __future__ import annotations

import argparse
import math

import pytest

from megatron_muon.megatron.cli import add_muon_args, muon_config_from_args
from scripts.bench import compare_optimizers as compare
from scripts.bench import muonbp_study as study
from scripts.bench import muonbp_study_report as report


def _cells(size, lr_muon, lr_bp):
    return {(v, lr) for _, v, lr in study.sweep_jobs(size) + study.later_jobs(size, lr_muon, lr_bp)}


def test_full_study_cells_and_their_count():
    size = study.FULL
    cells = _cells(size, 2e-3, 4e-3)
    # 4 optimizers × 3 lrs; ablation 5 periods × 4 block counts + Muon, two of them sweep cells;
    # 3 optimizers × 2 large lrs; 5 block-lr multipliers, mult 1 a sweep cell.
    assert len(cells) == 12 + 18 + 6 + 4 == 40
    assert len(cells) * len(size.seeds) == 120 and len(size.seeds) >= 3
    assert (study.Variant("muonbp", 0, 16), 2e-3) in cells and (study.Variant("muonbp", 16, 2), 2e-3) in cells
    assert (study.Variant("muonbp", 0, 4), 2e-2) in cells  # BlockMuon at 10× Muon's lr
    # The claim-4 values: 1, (1/√(rc))^½, 1/√(rc) for rc = 4 blocks, and the sweep around them.
    assert study.dual_lr_mults(size) == [0.25, 0.5, 0.707107, 1.0, 1.414214]
    # Period 1 is Muon at every block count (a grid with period 1 is refused: it has no block steps).
    assert {study.ablation_variant(1, n) for n in size.block_counts} == {study.Variant("muon")}
    for n in size.block_counts:
        r, c = study.GRIDS[n]
        assert r * c == n


@pytest.fixture(scope="module")
def parser():
    from megatron.training import arguments

    return add_muon_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def test_every_variant_is_a_valid_run(parser):
    """Every variant's flags parse and make the MuonConfig they name (BlockMuon = period 0)."""
    size = study.FULL
    variants = {v for _, v, _ in study.sweep_jobs(size) + study.later_jobs(size, 2e-3, 2e-3)}
    for v in variants:
        args = parser.parse_args(v.flags())
        if v.kind == "adamw":
            assert args.optimizer == "adam"
            continue
        config = muon_config_from_args(args)
        assert config.tp_mode == "owner"
        if v.kind == "muon":
            assert config.muonbp_period is None and config.muonbp_block_grid is None
        else:
            assert config.muonbp_period == v.period and config.muonbp_block_grid == study.GRIDS[v.blocks]
            assert math.isclose(config.muonbp_block_lr_mult, v.mult, rel_tol=1e-5)
    assert study.Variant("muonbp", 0, 4).label == "BlockMuon, 4 blocks"
    assert study.Variant("muonbp", 4, 8, 0.5).slug == "muonbp_p4_b8_mult0.5"


def _record(variant, lr, seed, final, status="ok", norms=((1, 5.0), (10, 6.0))):
    ok = status == "ok"
    return dict(variant=vars(variant).copy(), slug=variant.slug, label=variant.label, lr=lr, seed=seed,
                status=status, returncode=0 if ok else 1, wall_s=1.0, ms_per_iteration=10.0 if ok else None,
                best_val_loss=final if ok else None, train_loss=[(1, 5.0), (10, final)] if ok else [(1, 5.0)],
                val_loss=[(5, final + 0.5), (8, final + 0.05), (10, final)] if ok else [],
                param_norm=list(norms) if ok else [], phases=["sweep"])


def test_paired_differences_and_what_counts_as_resolved():
    muon, bp = study.Variant("muon"), study.Variant("muonbp", 2, 4)
    a = [_record(bp, 1e-3, s, f) for s, f in ((1, 2.00), (2, 2.10), (3, 2.20))]
    b = [_record(muon, 1e-3, s, f) for s, f in ((1, 2.05), (2, 2.16), (3, 2.24))]
    mean, std, n = report.paired(a, b)
    # The seeds' spread (0.1) is far larger than the paired differences' (-0.05, -0.06, -0.04).
    assert n == 3 and math.isclose(mean, -0.05) and math.isclose(std, 0.01)
    assert report.resolved((mean, std, n)) and not report.resolved((0.01, 0.02, 3))
    assert not report.resolved((0.5, 0.0, 1))  # one seed resolves nothing
    # A failed seed is left out of the pairing; a cell with a failure has no mean.
    a[2] = _record(bp, 1e-3, 3, 0, status="failed")
    assert report.paired(a, b)[2] == 2 and report.mean_final(a) is None
    assert report.spread_text(a) == "diverged 1/3"


def test_best_lr_is_the_lowest_mean_over_complete_cells():
    muon = study.Variant("muon")
    runs = [_record(muon, 1e-3, 1, 2.0), _record(muon, 1e-3, 2, 2.2),
            _record(muon, 2e-3, 1, 1.9), _record(muon, 2e-3, 2, 2.5),  # mean 2.2 > 2.1
            _record(muon, 4e-3, 1, 1.0), _record(muon, 4e-3, 2, 0, status="failed")]
    assert report.best_lr(runs, muon, (1e-3, 2e-3, 4e-3)) == 1e-3
    assert report.best_lr(runs, study.Variant("adamw"), (1e-3,)) is None


def test_report_on_a_synthetic_smoke_study(tmp_path):
    """Every cell of the smoke study, with losses built so that each claim's verdict is known."""
    size = study.SMOKE
    lr = size.lrs[0]
    finals = {}
    for _, v, cell_lr in study.sweep_jobs(size) + study.later_jobs(size, lr, lr):
        big = cell_lr > lr  # the large-lr cells
        base = {"adamw": 2.3, "muon": 2.2}.get(v.kind, 2.19)  # MuonBP and BlockMuon below Muon (claim 3)
        if v.kind == "muonbp" and v.period == 0:
            base = 2.4 + 0.01 * v.blocks  # BlockMuon worst, more so with more blocks (claim 1)
        if v.mult != 1.0:
            base = 2.25  # the other multiplier is worse (claim 4 does not hold)
        finals[(v, cell_lr)] = base + (1.0 if big and v.period == 0 and v.kind == "muonbp" else 0.0)
    runs = [_record(v, cell_lr, s, f + 0.001 * s) for (v, cell_lr), f in finals.items() for s in size.seeds]
    meta = dict(model="m", tokens_per_run=640, train_iters=10, grids={"2": "2x1", "4": "2x2"}, command="cmd")
    md = report.write(runs, meta, size, tmp_path)
    # BlockMuon 2.42 / 2.44 against MuonBP P=2's 2.19; at 10× BlockMuon 3.44 against 2.2 and 2.19.
    assert "| 1. smaller P lowers the loss" in md
    assert ("P=∞ − P=2: 2: +0.2300 ± 0.0000; 4: +0.2500 ± 0.0000 | yes: lower at every block count (resolved); "
            "the gap grows with the block count |") in md
    assert "| 2. BlockMuon is unstable at a large lr |" in md
    assert "at 10×: +1.2400 ± 0.0000 / +1.2500 ± 0.0000 | yes (10×: yes) |" in md
    assert "MuonBP − Muon -0.0100 ± 0.0000 | yes |" in md
    assert ("best multiplier 1; the best other than 1 − mult 1: +0.0600 ± 0.0000 | optimum in [0.5, 1]: yes; "
            "two lrs beat one: no |") in md
    # The last quarter (iterations 8 → 10) made 0.05 of 3.35 of the improvement: 1.5% < 5%.
    assert "1.5% of the run's whole improvement" in md and "met." in md
    for name in ("ablation_heatmap.png", "large_lr.png", "comparison.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.md").read_text() == md
    # --report-only: the same tables again from results.json, nothing run
    import dataclasses
    import json

    (tmp_path / "results.md").unlink()
    meta["study"] = dataclasses.asdict(size)
    (tmp_path / "results.json").write_text(json.dumps(dict(meta=meta, runs=runs)))
    assert study.main(["--report-only", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == md


def test_param_norm_curve_is_parsed_from_the_stats_line():
    line = (" [t] iteration        2/       4 | consumed samples: 8 | elapsed time per iteration (ms): 10.0 | "
            "lm loss: 5.000000E+00 | loss scale: 1.0 | muon step: full | muon param norm: 12.3456 | "
            "muon update rms: full 1.0E-03 |\n"
            " [t] iteration        4/       4 | consumed samples: 16 | elapsed time per iteration (ms): 10.0 | "
            "lm loss: 4.000000E+00 | loss scale: 1.0 |\n")
    parsed = compare.parse_log(line)
    assert parsed["param_norm"] == [(2, 12.3456)]  # iteration 4 printed no norm: none invented
    assert parsed["train_loss"] == [(2, 5.0), (4, 4.0)]
