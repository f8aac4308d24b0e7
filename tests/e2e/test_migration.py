"""Checkpoints between megatron-core's own Muon and megatron-muon, both ways, through real runs.

2 gloo ranks, TP2, the tiny GPT of ``test_pretrain`` (fp32, cosine LR), ``tests/upstream_entry.py``
for megatron-core's side:

* upstream → plugin. ``UPSTREAM=ddp`` (the entry without the plugin's hooks, i.e. upstream's
  ``pretrain_gpt.py``): ``--optimizer muon`` under DDP — ``TensorParallelMuon`` (duplicated, exact)
  + Adam — trains 6 iterations saving at 4, and resumes its own ``iter_0000004`` (the reference).
  megatron-muon refuses that checkpoint in one line without a flag (row ``ckpt-upstream-muon``,
  instead of "ValueError: Could not find parameter group"); with ``--muon-load-upstream-optimizer``
  (distributed optimizer, owner mode, the same Muon settings, fc1 whole as upstream 0.19.2 has it)
  its iterations 5 and 6 must print upstream's resumed LR, loss and grad norm. Iteration 6 is the
  first that depends on the carried momentum and Adam moments.
* plugin → upstream. ``UPSTREAM=layer_wise``: ``--optimizer dist_muon`` (megatron-core's layer-wise
  optimizer, with the hooks installed, as through ``scripts/pretrain_gpt.py``) refuses a megatron-muon
  checkpoint in one line (row ``ckpt-plugin-into-upstream``, instead of "Expected 2 entries in state
  dict, but got 5"), and with ``--muon-reset-optimizer-state`` resumes it at iteration 5 with the
  saved LR schedule.

About 3 minutes on 2 cores.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bad_inputs_table import expected_line
from entry_harness import ENTRY, RESUME, TINY, launch, logged_rows

REPO = Path(__file__).resolve().parents[2]
UPSTREAM_ENTRY = REPO / "tests" / "upstream_entry.py"
PLUGIN_ENTRY = ENTRY
# The Muon settings both sides share (upstream's CLI defaults to momentum 0.9 and blockwise; fp32
# Newton-Schulz so that neither side's bf16 rounding is compared).
SAME_MUON = ["--muon-momentum", "0.95", "--muon-fp32-matmul-prec", "high"]
ERROR = re.compile(r"^megatron-muon: error: (.*)$", re.MULTILINE)


def _run(entry: Path, args: list[str], cwd: Path, upstream: str | None = None, tiny=TINY):
    job = launch([*tiny, *args], cwd, entry=entry, env=dict(UPSTREAM=upstream) if upstream else None)
    return job.returncode, job.out


def _ok(result) -> str:
    rc, out = result
    assert rc == 0, out[-6000:]
    return out


def _refused(result) -> str:
    rc, out = result
    assert rc != 0 and "iteration        5/" not in out, out[-3000:]
    errors = ERROR.findall(out)
    assert errors, out[-3000:]
    return errors[0]


def _upstream_tiny() -> list[str]:
    """TINY as upstream's parser takes it: no plugin flag, DDP, the exact duplicated mode."""
    tiny = [a for a in TINY if a not in ("--use-distributed-optimizer", "--muon-log-stats")]
    tiny[tiny.index("--muon-tp-mode") + 1] = "duplicated"
    return tiny


@pytest.fixture(scope="module")
def upstream_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    tiny = _upstream_tiny()
    out = _ok(_run(UPSTREAM_ENTRY, [*SAME_MUON, "--train-iters", "6", "--log-interval", "1", "--save",
                                    str(root / "ckpt"), "--save-interval", "4"], root, "ddp", tiny))
    assert "megatron-muon: Muon on" not in out  # megatron-core's optimizer, not the plugin's
    resumed = logged_rows(_ok(_run(UPSTREAM_ENTRY, [*SAME_MUON, *RESUME, "--load", str(root / "ckpt")], root, "ddp",
                             tiny)))
    assert sorted(resumed) == [5, 6]
    return root, resumed


def test_upstream_checkpoint_refused_without_a_flag(upstream_ckpt, tmp_path):
    root, _ = upstream_ckpt
    line = _refused(_run(PLUGIN_ENTRY, [*SAME_MUON, *RESUME, "--load", str(root / "ckpt")], tmp_path))
    assert expected_line("ckpt-upstream-muon", TMP=str(root)).fullmatch(line), line


def test_upstream_checkpoint_resumed_with_its_momentum(upstream_ckpt, tmp_path):
    root, upstream = upstream_ckpt
    out = _ok(_run(PLUGIN_ENTRY, [*SAME_MUON, "--muon-no-split-fc1", *RESUME, "--load", str(root / "ckpt"),
                                  "--muon-load-upstream-optimizer"], tmp_path))
    # every rank's 8 Muon matrices (TP shards) and 7 AdamW tensors; upstream's Adam step
    assert re.search(r"megatron-core Muon's state carried over from \S+iter_0000004 \(this rank: 8 Muon momentum "
                     r"buffers, 7 Adam moment pairs, 0 fp32 main params, step 4\); Muon settings as saved", out), \
        out[-3000:]
    plugin = logged_rows(out)
    # Equal as printed (7 digits): measured bitwise at this precision. Owner mode runs the same
    # fp32 Newton-Schulz on the same whole matrices as upstream's duplicated mode.
    assert plugin == upstream, (plugin, upstream)


def test_plugin_checkpoint_into_upstream_layer_wise(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = logged_rows(_ok(_run(PLUGIN_ENTRY, ["--train-iters", "6", "--log-interval", "1", "--save", str(ckpt),
                                          "--save-interval", "4"], tmp_path)))
    upstream = ["--optimizer", "dist_muon", "--muon-tp-mode", "duplicated", "--no-use-layer-wise-param-layout",
                *RESUME, "--load", str(ckpt)]
    line = _refused(_run(UPSTREAM_ENTRY, upstream, tmp_path, "layer_wise"))
    assert expected_line("ckpt-plugin-into-upstream", TMP=str(tmp_path)).fullmatch(line), line
    out = _ok(_run(UPSTREAM_ENTRY, [*upstream, "--muon-reset-optimizer-state"], tmp_path, "layer_wise"))
    assert "Using LayerWiseDistributedOptimizer" in out or "megatron-muon: Muon on" not in out
    rows = logged_rows(out)
    assert sorted(rows) == [5, 6] and all(rows[it][0] == saved[it][0] for it in (5, 6)), (rows, saved)
