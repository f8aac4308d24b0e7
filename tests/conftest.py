"""Fixtures shared by several test modules (a test module never imports another), and the tiers.

Every test file lives in one tier's directory, and each of its tests is marked with that tier's
name (the markers are registered in pyproject.toml): ``unit`` (no process group: Megatron at most
imported, and at most a quick helper process such as the linters), ``dist`` (gloo worlds of
``dist_harness.run_world`` whose ranks never initialize Megatron), ``megatron`` (run_world ranks
that initialize Megatron) and ``e2e`` (subprocesses: torchrun jobs, scripts, the dry run, Slurm).
The fast tier, ``bash scripts/run.sh test-fast``, is ``-m "not megatron and not e2e"``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TIERS = ("unit", "dist", "megatron", "e2e")
TESTS = Path(__file__).resolve().parent


def _tier(path: Path) -> str | None:
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:  # not under tests/
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config, items):
    """Mark each test with its directory's tier. A test outside the tier directories is an error:
    unmarked, it would run in every selection, the fast tier's included."""
    for item in items:
        tier = _tier(item.path)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def hooks_restored(monkeypatch):
    """check_command_line installs the hooks into megatron.training; put everything back after."""
    import importlib

    from megatron_muon.megatron.hooks import HOOKED

    for module_name, name in HOOKED:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as scripts/run.sh exports it


def pytest_sessionfinish(session, exitstatus):
    """The pooled ranks of dist_harness and the warm entry of entry_harness end with the session,
    not at interpreter exit."""
    harness = sys.modules.get("dist_harness")
    if harness is not None:
        harness.shutdown_pools()
    entries = sys.modules.get("entry_harness")
    if entries is not None:
        entries.shutdown_warm_entry()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The demo's byte-level indexed dataset, built once per session: ``scripts/prepare_data.py``
    over 300 KB of the stdlib's sources, ``train_text_document`` and ``valid_text_document`` in
    the returned directory. A test that runs a config naming ``data/...`` links it there
    (``(job / "data").symlink_to(demo_data)``). Read-only for the tests; Megatron's index caches
    go where each test's ``--data-cache-path`` says, or beside the data (the same for every run of
    one config, so a later run reads what an earlier one wrote)."""
    out = tmp_path_factory.mktemp("demo") / "data"
    subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "prepare_data.py"), "--out", str(out),
                    "--max-bytes", "300000"], check=True, capture_output=True, timeout=300)
    return out
