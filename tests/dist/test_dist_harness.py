"""The pooled worlds of ``dist_harness``: every job of a pool starts from the same process state, and
a job that fails or changes state the pool cannot restore never reaches the next one."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from dist_harness import ChildError, run_world


def _draw(rank: int, world: int) -> torch.Tensor:
    return torch.randn(4)  # unseeded: the process's starting generator state


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return os.getpid()


def _replace_excepthook(rank: int, world: int) -> int:
    sys.excepthook = _planted_hook
    return os.getpid()


def _planted_hook(*exc) -> None:
    pass


def _excepthook_name(rank: int, world: int) -> str:
    return sys.excepthook.__name__


def _set_megatron_args(rank: int, world: int) -> int:
    import argparse

    from megatron.training import global_vars

    global_vars._GLOBAL_ARGS = argparse.Namespace()  # as set_global_variables leaves it
    return os.getpid()


def _read_and_set_env(rank: int, world: int) -> tuple:
    seen = os.environ.get("DIST_HARNESS_PROBE"), os.environ.get("DIST_HARNESS_LEFT_BEHIND")
    os.environ["DIST_HARNESS_LEFT_BEHIND"] = "set by a job"
    return seen


def _megatron_imported(rank: int, world: int) -> bool:
    return "megatron.core.parallel_state" in sys.modules


def test_ranks_fork_from_the_preloaded_server():
    assert run_world(2, _megatron_imported) == [True, True]
    assert run_world(2, _megatron_imported, fresh=True) == [True, True]


def test_job_sees_the_submitters_environment_and_leaves_none_behind(monkeypatch):
    monkeypatch.setenv("DIST_HARNESS_PROBE", "from the test")
    assert run_world(2, _read_and_set_env) == [("from the test", None)] * 2
    monkeypatch.delenv("DIST_HARNESS_PROBE")
    assert run_world(2, _read_and_set_env) == [(None, None)] * 2


def test_unseeded_draws_repeat_in_every_job():
    first, second = run_world(2, _draw), run_world(2, _draw)
    assert run_world(2, _pid) == run_world(2, _pid)  # the same ranks drew both
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_pool_is_reused_between_jobs():
    assert run_world(2, _pid) == run_world(2, _pid)


def test_failed_job_reports_its_rank_and_retires_the_pool():
    before = run_world(2, _pid)
    with pytest.raises(ChildError, match=r"(?s)rank 1.*planted failure"):
        run_world(2, _fail_on_rank_1)
    after = run_world(2, _pid)
    assert set(after).isdisjoint(before)  # fresh ranks, none of the failed job's


def test_excepthook_is_put_back_and_the_pool_kept():
    ranks = run_world(2, _replace_excepthook)
    # the next job sees torch's own hook (init_process_group installs it), not the planted one
    assert run_world(2, _excepthook_name) == ["_distributed_excepthook"] * 2
    assert run_world(2, _pid) == ranks


def _set_harness_constant(rank: int, world: int) -> int:
    import megatron_harness

    megatron_harness.GROUPS = 4  # as a test of MHA might, for its own runs
    return os.getpid()


def test_job_that_changes_a_harness_constant_retires_the_pool():
    import megatron_harness

    ranks = run_world(2, _set_harness_constant)
    assert set(run_world(2, _pid)).isdisjoint(ranks)
    assert megatron_harness.GROUPS == 2  # this process's copy was never the job's


def _die_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # no report, as a segfault or the OOM killer leaves it
    return os.getpid()


def test_a_dead_rank_is_reported_without_waiting_for_the_timeout():
    with pytest.raises(ChildError, match=r"ranks \[1\] exited without reporting"):
        run_world(2, _die_on_rank_1, timeout=600)  # within DEAD_GRACE_S + the peers' wait, not 600 s


def test_job_that_sets_megatron_args_retires_the_pool():
    ranks = run_world(2, _set_megatron_args)  # its results still come back
    assert set(run_world(2, _pid)).isdisjoint(ranks)
