"""Fixtures shared by several test modules (a test module never imports another)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def hooks_restored(monkeypatch):
    """check_command_line installs the hooks into megatron.training; put everything back after."""
    from megatron.training import arguments, training, yaml_arguments

    for module, names in ((arguments, ("add_megatron_arguments", "validate_args")),
                          (yaml_arguments, ("validate_yaml",)),
                          (training, ("get_megatron_optimizer", "training_log", "clip_qk", "wrap_model_chunks_with_ddp",
                                      "save_checkpoint", "load_checkpoint"))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as scripts/run.sh exports it


def pytest_sessionfinish(session, exitstatus):
    """The pooled ranks of dist_harness end with the session, not at interpreter exit."""
    harness = sys.modules.get("dist_harness")
    if harness is not None:
        harness.shutdown_pools()
