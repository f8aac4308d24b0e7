"""docs/bad_inputs.md, row by row: each input gives exactly the line the table shows.

Rows of kind ``flags`` are run as written: the input is appended to the tiny CPU demo's config
(a copy of ``configs/tiny-cpu.yaml`` whose data and checkpoint paths point into a temporary
directory) and checked by ``preflight.check_command_line`` in this process, as rank 0 of 2 —
the same parser, hooks and checks the job runs on every rank. Rows of the other kinds set up
their scenario here, except the checkpoints, whose loads need a real torchrun job:
``tests/e2e/test_checkpoint_integrity.py`` and ``tests/e2e/test_resharding_training_loop.py`` check
those rows against this table (``expected_line``).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from bad_inputs_table import expected_line, rows

REPO = Path(__file__).resolve().parents[2]
CHECKED_ELSEWHERE = {  # rows checked by another test file (a torchrun job, a Megatron world), by row id
    # (each file by its path under tests/)
    "ckpt-overwritten": "e2e/test_checkpoint_integrity.py", "ckpt-truncated": "e2e/test_checkpoint_integrity.py",
    "ckpt-nan": "e2e/test_checkpoint_integrity.py", "ckpt-tp-change": "e2e/test_resharding_training_loop.py",
    "ckpt-lost-on-save": "e2e/test_balanced_resume.py",
    **{row: "e2e/test_resume_config.py" for row in ("resume-vocab", "resume-shape", "resume-muon-to-adam",
                                                     "resume-adam-to-muon")},
    "ckpt-upstream-muon": "e2e/test_migration.py", "ckpt-plugin-into-upstream": "e2e/test_migration.py",
    "resume-fsdp-no-optim": "e2e/test_fsdp_resume_config.py",
    **{row: "e2e/test_fsdp2_resume.py" for row in ("resume-fsdp2-to-zero1", "resume-zero1-to-fsdp2")},
    **{row: "e2e/test_layout_change_resume.py" for row in ("resume-ep-dp-reshardable", "resume-ep-torch-format")},
    "api-block-grid-divides": "dist/test_block_grid_steps.py", "api-plan-mismatch": "dist/test_step_setup.py",
    "api-ddp-outside-hooks": "megatron/test_model_config_ddp.py",
    "api-fsdp2-expert-mesh": "megatron/test_fsdp2_moe.py",
    # Python API rows: raised by the factory (in a Megatron world) or by MuonWithAdamW itself
    **{row: "megatron/test_api_inputs.py" for row in ("api-muon-config-type", "api-tp-mode", "api-3d-muon",
                                                       "api-algorithm", "api-negative-lr", "api-qk-clip-mla-cache")},
    # scripts/run.sh main's own argument checks (before the venv and the data), and its argument passing
    **{row: "e2e/test_preflight.py" for row in ("run-sh-directory", "run-sh-missing", "run-sh-not-yaml",
                                                 "run-sh-empty-argument")},
    # a real checkpoint (written by a torchrun job), damaged or resumed with another buffer layout
    **{row: "e2e/test_preflight.py" for row in ("ckpt-no-metadata-json", "ckpt-emptied", "ckpt-distcp-missing",
                                                 "ckpt-distcp-truncated", "resume-layout-balanced",
                                                 "resume-schedule-changed")}}


def test_table_has_enough_rows_and_every_row_is_tested():
    table = rows()
    assert len(table) >= 30, len(table)
    untested = {r for r, row in table.items() if row["kind"] != "flags"} - set(SCENARIOS) - set(CHECKED_ELSEWHERE)
    assert not untested, f"rows without a test: {sorted(untested)}"
    for row_id, test_file in CHECKED_ELSEWHERE.items():
        assert f'"{row_id}"' in (REPO / "tests" / test_file).read_text(), (row_id, test_file)


# --------------------------------------------------------------------------- the setting


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_data) -> Path:
    """TMP: the demo dataset and the demo config pointing at it (save = load = TMP/ckpt, absent)."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "data").symlink_to(demo_data)
    config = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    config.update(train_data_path=[str(tmp / "data" / "train_text_document")],
                  valid_data_path=[str(tmp / "data" / "valid_text_document")],
                  save=str(tmp / "ckpt"), load=str(tmp / "ckpt"))
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(config))
    return tmp


def _rejection(config: Path, extra: list[str]) -> str:
    from megatron_muon.megatron.preflight import check_command_line

    with pytest.raises(ValueError) as info:
        check_command_line(str(config), extra, 2)
    return str(info.value)


def test_the_demo_config_itself_passes(world, hooks_restored):
    from megatron_muon.megatron.preflight import check_command_line

    argv = check_command_line(str(world / "tiny.yaml"), ["--train-iters", "3", "--lr-warmup-iters", "1"], 2)
    assert argv[-4:] == ["--train-iters", "3", "--lr-warmup-iters", "1"]
    # Its own first run: --load is the (absent) --save directory, which is allowed; the --save
    # probe created that directory and removed it again.
    assert not (world / "ckpt").exists() and sorted(p.name for p in world.iterdir()) == ["data", "tiny.yaml"]


FLAG_ROWS = [r for r, row in rows().items() if row["kind"] == "flags"]


def _flag_setup(row_id: str, tmp: Path) -> None:
    if row_id == "load-no-tracker":
        (tmp / "ckpt" / "iter_0000100").mkdir(parents=True)
    if row_id in ("save-file", "save-under-file", "save-file-short-run"):
        (tmp / "file").write_text("not a directory")
    if row_id == "train-iters-below-load":  # check_resume refuses before anything reads the directory
        (tmp / "ckpt" / "iter_0000100").mkdir(parents=True)
        (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text("100")
    if row_id in ("ckpt-step", "load-tracker-garbage", "load-tracker-missing-iter", "ckpt-empty-dir"):
        (tmp / "ckpt" / "iter_0000003").mkdir(parents=True)
        tracker = {"load-tracker-garbage": "hello\n", "load-tracker-missing-iter": "7\n"}.get(row_id, "3")
        (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text(tracker)


@pytest.mark.parametrize("row_id", FLAG_ROWS)
def test_flag_row(row_id, world, hooks_restored, tmp_path):
    row = rows()[row_id]
    config = tmp_path / "tiny.yaml"  # the checkpoint directory is this test's own
    text = (world / "tiny.yaml").read_text().replace(str(world / "ckpt"), str(tmp_path / "ckpt"))
    config.write_text(text)
    _flag_setup(row_id, tmp_path)
    extra = shlex.split(row["input"].split("`")[1].replace("TMP", str(tmp_path)))
    if row_id == "ckpt-step":
        extra += ["--load", str(tmp_path / "ckpt")]
    line = _rejection(config, extra)
    assert expected_line(row_id, TMP=str(tmp_path)).fullmatch(line), f"\n{line}\n{rows()[row_id]['line']}"


def test_per_head_trains_below_tp_query_groups(world, hooks_restored):
    """The ``query-groups-tp`` row's input (1 query group at TP2) with ``--muon-split-qkv-per-head``
    passes: per head, every head is whole on its TP rank or gathered on one (docs/per_head.md;
    tests/megatron/test_per_head_below_query_groups.py trains it)."""
    from megatron_muon.megatron.preflight import check_command_line

    extra = shlex.split(rows()["query-groups-tp"]["input"].split("`")[1]) + ["--muon-split-qkv-per-head"]
    assert check_command_line(str(world / "tiny.yaml"), extra, 2)[-len(extra):] == extra


# --------------------------------------------------------------------------- yaml and data


def _yaml_empty(tmp: Path, world: Path) -> tuple[Path, list[str]]:
    (tmp / "c.yaml").write_text("")
    return tmp / "c.yaml", []


def _yaml_syntax(tmp: Path, world: Path):
    (tmp / "c.yaml").write_text("num_layers: 2\n  hidden_size: 64\n")
    return tmp / "c.yaml", []


def _yaml_twice(tmp: Path, world: Path):
    (tmp / "c.yaml").write_text("num_layers: 2\nnum_layers: 4\n")
    return tmp / "c.yaml", []


def _yaml_unknown_key(tmp: Path, world: Path):
    (tmp / "c.yaml").write_text("num_layerz: 2\n")
    return tmp / "c.yaml", []


def _yaml_missing(tmp: Path, world: Path):
    return tmp / "c.yaml", []


def _yaml_null(tmp: Path, world: Path):
    (tmp / "c.yaml").write_text("lr: null\n")
    return tmp / "c.yaml", []


def _damaged_data(tmp: Path, world: Path, damage) -> tuple[Path, list[str]]:
    import shutil

    shutil.copytree(world / "data", tmp / "data")
    damage(tmp / "data")
    text = (world / "tiny.yaml").read_text().replace(str(world), str(tmp))
    (tmp / "tiny.yaml").write_text(text)
    return tmp / "tiny.yaml", []


def _data_truncated(tmp: Path, world: Path):
    def damage(data: Path):
        path = data / "train_text_document.bin"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)

    return _damaged_data(tmp, world, damage)


def _data_no_idx(tmp: Path, world: Path):
    return _damaged_data(tmp, world, lambda data: (data / "valid_text_document.idx").unlink())


def _edited_demo(tmp: Path, world: Path, extra: list[str], drop: tuple[str, ...] = (), **changes):
    """The demo config with keys dropped or changed (what a flag cannot undo), and ``extra`` flags."""
    config = yaml.safe_load((world / "tiny.yaml").read_text())
    for key in drop:
        del config[key]
    config.update(changes)
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(config))
    return tmp / "tiny.yaml", extra


SCENARIOS = {"yaml-empty": _yaml_empty, "yaml-syntax": _yaml_syntax, "yaml-twice": _yaml_twice,
             "yaml-unknown-key": _yaml_unknown_key, "yaml-missing": _yaml_missing, "yaml-null": _yaml_null,
             "lr-missing": lambda tmp, world: _edited_demo(tmp, world, [], ("lr",)),
             "data-truncated": _data_truncated, "data-no-idx": _data_no_idx,
             "train-samples-zero": lambda tmp, world: _edited_demo(tmp, world, ["--train-samples", "0"],
                                                                   ("train_iters",)),
             "no-run-length": lambda tmp, world: _edited_demo(tmp, world, [], ("train_iters",)),
             "dp-layout-no-zero1": lambda tmp, world: _edited_demo(tmp, world, ["--muon-dp-layout", "megatron"],
                                                                   use_distributed_optimizer=False),
             "no-split-fc1-no-swiglu": lambda tmp, world: _edited_demo(tmp, world, ["--muon-no-split-fc1"],
                                                                       swiglu=False)}


@pytest.mark.parametrize("row_id", sorted(SCENARIOS))
def test_scenario_row(row_id, world, hooks_restored, tmp_path):
    config, extra = SCENARIOS[row_id](tmp_path, world)
    line = _rejection(config, extra)
    pattern = expected_line(row_id, TMP=str(tmp_path), CONFIG=str(config))
    assert pattern.fullmatch(line), f"\n{line}\n{rows()[row_id]['line']}"
