"""``scripts/bench/record_dry_runs.py`` regenerates every recorded dry run, and only those."""

from __future__ import annotations

from scripts.bench import record_dry_runs


def test_the_list_names_every_recorded_dry_run():
    recorded = {p.name for p in record_dry_runs.OUT.glob("dry_run_*.json")}
    listed = [record_dry_runs.path_of(name).name for name, _ in record_dry_runs.RUNS]
    assert len(listed) == len(set(listed))
    assert set(listed) == recorded


def test_each_run_names_its_model_and_mode():
    for name, args in record_dry_runs.RUNS:
        assert "--model" in args and "--tp-mode" in args, name  # the mode explicit: defaults move
