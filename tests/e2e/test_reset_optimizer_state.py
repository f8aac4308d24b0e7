"""--muon-reset-optimizer-state through the real entry (``scripts/pretrain_gpt.py``, 2 gloo ranks,
TP2, the tiny GPT of ``test_pretrain``, cosine LR after 2 warmup iterations, so a restarted
schedule shows in the first resumed iteration's LR).

One run trains 6 iterations saving at 4 (the uninterrupted LRs of iterations 5 and 6). Loads of
its ``iter_0000004`` (``--ckpt-step 4``) then train iterations 5 and 6:

* ``--muon-reset-optimizer-state``: iterations 5, 6 with the uninterrupted run's LRs;
* the reference for "fresh": the same checkpoint with its optimizer state rewritten to what a new
  optimizer holds (every ``exp_avg`` / ``exp_avg_sq`` item zero — Muon's momentum sits in
  ``exp_avg`` — and the saved steps and ``muon_steps`` 0), resumed normally. Iteration 6 is the
  first whose loss depends on the optimizer state, and it must be the reset run's exactly;
* a plain resume (the saved state used) differs from both at iteration 6, so the check can fail;
* ``--no-load-optim``: iteration 5 logs the warmup LR of iteration 1 (Megatron skips the
  scheduler with the optimizer: the restart docs/checkpoints.md warns about).

About 2 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from entry_harness import RESUME, logged_rows, run_tiny

from megatron_muon.megatron.integrity import CHECKSUMS


def _rewrite_items(iteration: Path, rewrite) -> int:
    """Replace items of a torch_dist checkpoint: ``rewrite(fqn, obj)`` returns the new object or
    None; each new blob is appended to its file and the DCP metadata pointed at it (so its size
    may change). Returns the number of items rewritten."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iteration)).read_metadata()
    count = 0
    for index, info in list(metadata.storage_data.items()):
        path = iteration / info.relative_path
        blob = path.read_bytes()[info.offset:info.offset + info.length]
        new = rewrite(index.fqn, torch.load(io.BytesIO(blob), weights_only=False))
        if new is None:
            continue
        buffer = io.BytesIO()
        torch.save(new, buffer)
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(buffer.getvalue())
        metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
        count += 1
    with open(iteration / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return count


def _fresh_state(fqn: str, obj):
    """What a new optimizer holds: zero moments (Muon's momentum is ``exp_avg``), steps 0."""
    if re.match(r"optimizer\.state\.exp_avg(_sq)?\.", fqn) and isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if fqn.startswith("common_state"):
        optimizer = obj[0]["optimizer"]["optimizer"]
        optimizer["muon_steps"] = 0
        for group in optimizer["param_groups"]:
            group["step"] = 0.0
        return obj
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reset")
    out = run_tiny(["--train-iters", "6", "--log-interval", "1", "--save", str(root / "ckpt"),
                     "--save-interval", "4"], root)
    rows = logged_rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6], out[-3000:]
    return root, rows


def test_reset_keeps_schedule_and_starts_the_optimizer_afresh(saved, tmp_path):
    root, uninterrupted = saved
    out = run_tiny([*RESUME, "--load", str(root / "ckpt"), "--muon-reset-optimizer-state"], tmp_path)
    assert re.search(r"megatron-muon: --muon-reset-optimizer-state: weights, iteration and LR/WD schedule from "
                     r"\S+iter_0000004; optimizer state fresh", out), out[-3000:]
    reset = logged_rows(out)
    assert sorted(reset) == [5, 6], out[-3000:]  # the first resumed iteration is N+1
    for it in (5, 6):
        assert reset[it][0] == uninterrupted[it][0], (it, reset[it], uninterrupted[it])  # the LR, as printed

    zeroed = tmp_path / "zeroed"
    shutil.copytree(root / "ckpt", zeroed)
    (zeroed / "iter_0000004" / CHECKSUMS).unlink()  # rewritten on purpose: nothing to verify
    assert _rewrite_items(zeroed / "iter_0000004", _fresh_state) >= 19  # 9 params x 2 moments + the common state
    reference = logged_rows(run_tiny([*RESUME, "--load", str(zeroed)], tmp_path))
    plain = logged_rows(run_tiny([*RESUME, "--load", str(root / "ckpt")], tmp_path))
    assert reference == reset, (reference, reset)  # the same update from zeroed state: fresh state
    assert plain[5] == reset[5]  # iteration 5's loss and grad norm come before any step: same weights
    assert plain[6][1] != reset[6][1], (plain, reset)  # the saved momentum changes iteration 6


def test_no_load_optim_restarts_the_lr_schedule(saved, tmp_path):
    root, uninterrupted = saved
    rows = logged_rows(run_tiny([*RESUME, "--load", str(root / "ckpt"), "--no-load-optim"], tmp_path))
    assert sorted(rows) == [5, 6]
    assert rows[5][0] == uninterrupted[1][0] != uninterrupted[5][0], (rows, uninterrupted)  # warmup again
