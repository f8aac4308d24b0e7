"""Resharding a Muon checkpoint across TP through Megatron's own training loop (split from
``tests/megatron/test_resharding.py``, whose Megatron world checks the loads across TP, PP and DP).

``scripts/pretrain_gpt.py`` under torchrun, 2 ranks: the default format's refusal of a TP change
(the real exception, for ``explain_load_error``) and the fix it names.
"""

from __future__ import annotations

import os
import pickle
import re

import pytest
from bad_inputs_table import expected_line
from entry_harness import ENTRY, TINY, launch

from megatron_muon.megatron.resharding import FULLY_RESHARDABLE_FLAG, explain_load_error

PERIOD = 3  # MuonBP's period, as in tests/megatron/test_resharding.py

_RECORDING_DRIVER = """
import functools, os, pickle, runpy, sys
from megatron.training import training
entry, out = sys.argv.pop(1), sys.argv.pop(1)
load_checkpoint = training.load_checkpoint  # Megatron's own, before the plugin's hook wraps it
@functools.wraps(load_checkpoint)
def recording(*args, **kwargs):
    try:
        return load_checkpoint(*args, **kwargs)
    except BaseException as err:
        with open(os.path.join(out, "load_error.rank%s.pkl" % os.environ["RANK"]), "wb") as f:
            pickle.dump(err, f)
        raise
training.load_checkpoint = recording
sys.argv[0] = entry
runpy.run_path(entry, run_name="__main__")
"""
"""Runs scripts/pretrain_gpt.py, keeping what Megatron's ``load_checkpoint`` raised (per rank)."""

_STEP_KIND = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?muon step: (\w+)")


def _pretrain(tmp_path, tp: int, *args: str) -> tuple[int, str]:
    """scripts/pretrain_gpt.py on 2 gloo ranks at ``tp`` (DP = 2 / tp): (exit code, output)."""
    driver = tmp_path / "driver.py"
    driver.write_text(_RECORDING_DRIVER)
    # A driver of its own: it wraps Megatron's load before the plugin's hook does.
    job = launch([str(ENTRY), str(tmp_path), *TINY, "--tensor-model-parallel-size", str(tp),
                  "--muon-dp-layout", "megatron",
                  # 257 tokens pad to 512 rows at TP2 and TP1 alike (the default 128 gives 384 at TP1: refused)
                  "--make-vocab-size-divisible-by", "256",
                  "--muonbp-period", str(PERIOD), "--log-interval", "1", *args], tmp_path, entry=driver)
    return job.returncode, job.out


def test_tp_change_through_megatron_training(tmp_path, hooks_restored):
    """Saved at TP2 in Megatron's default optimizer format (dp_reshardable: --muon-dp-layout
    megatron), a load at TP1 is refused by Megatron with advice that does not help;
    ``explain_load_error`` names the fix, and the fix works: resume at TP2 with
    ``--dist-ckpt-optim-fully-reshardable`` (on CPU, without
    ``--distrib-optim-fully-reshardable-mem-efficient``), save, load that at TP1 and train on,
    MuonBP's phase intact."""
    default, reshardable = tmp_path / "default", tmp_path / "reshardable"
    rc, out = _pretrain(tmp_path, 2, "--train-iters", "2", "--save", str(default), "--save-interval", "2")
    assert rc == 0, out[-6000:]
    assert [kind for _, kind in _STEP_KIND.findall(out)] == ["full", "block"], out[-4000:]

    rc, out = _pretrain(tmp_path, 1, "--train-iters", "3", "--load", str(default), "--override-opt-param-scheduler")
    assert rc != 0, "a dp_reshardable checkpoint loaded at another TP"
    # What the user sees: the plugin's load hook turns Megatron's refusal into one line, rank 0's.
    lines = [line.removeprefix("megatron-muon: error: ") for line in out.splitlines()
             if line.startswith("megatron-muon: error: ")]
    assert len(lines) == 1 and expected_line("ckpt-tp-change").fullmatch(lines[0]), out[-4000:]
    for rank in (0, 1):  # every rank refuses
        with open(tmp_path / f"load_error.rank{rank}.pkl", "rb") as f:
            error = pickle.load(f)
        assert type(error) is RuntimeError and "--ckpt-fully-parallel-save" in str(error), repr(error)
        message = explain_load_error(error)
        assert message is not None, repr(error)
        assert "TP2 x PP1" in message and "TP1 x PP1" in message and FULLY_RESHARDABLE_FLAG in message
        assert "\n" not in message
        os.remove(tmp_path / f"load_error.rank{rank}.pkl")
    # The preflight says it before torchrun starts, from the checkpoint's metadata (resume_config).
    from megatron_muon.megatron.preflight import check_command_line

    (tmp_path / "tiny.yaml").write_text("distributed_backend: gloo\n")
    with pytest.raises(ValueError) as info:
        check_command_line(str(tmp_path / "tiny.yaml"), [
            *TINY, "--tensor-model-parallel-size", "1", "--muon-dp-layout", "megatron",
            "--make-vocab-size-divisible-by", "256", "--muonbp-period", str(PERIOD), "--train-iters", "3",
            "--load", str(default), "--override-opt-param-scheduler"], 2)
    assert str(info.value) == lines[0], info.value

    rc, out = _pretrain(tmp_path, 2, "--train-iters", "3", "--load", str(default), "--save", str(reshardable),
                        "--save-interval", "3", FULLY_RESHARDABLE_FLAG, "--override-opt-param-scheduler")
    assert rc == 0, out[-6000:]
    assert _STEP_KIND.findall(out) == [("3", "block")], out[-4000:]

    rc, out = _pretrain(tmp_path, 1, "--train-iters", "5", "--load", str(reshardable),
                        "--override-opt-param-scheduler")
    assert rc == 0, out[-6000:]
    # What Megatron logs of the checkpoint's metadata: written through gloo although not asked to.
    assert ("'distrib_optim_sharding_type': 'fully_reshardable', "
            "'distrib_optim_fully_reshardable_mem_efficient': True") in out, out[-4000:]
    # Steps 4 and 5 are t = 3 (full) and t = 4 (block): the phase came through both loads.
    assert _STEP_KIND.findall(out) == [("4", "full"), ("5", "block")], out[-4000:]
    assert not list(tmp_path.glob("load_error.rank*.pkl"))
