"""A damaged or non-finite checkpoint is refused at load with one line (megatron/integrity.py).

Through the real entry (``scripts/pretrain_gpt.py`` under torchrun, 2 gloo ranks, TP2, the tiny
GPT of ``test_pretrain``): one 3-iteration run saves a checkpoint, which must carry
``megatron_muon_checksums.json``; copies of it are then damaged the ways the issue found them
loading "successfully" or dying with a bare ``EOFError``, and each load must end with exit code 2
and one ``megatron-muon: error:`` line naming the file (or the tensor), before any training:

* 4 KB overwritten inside a ``.distcp`` file (same size: only the digest can tell);
* a ``.distcp`` file truncated;
* NaN written into an optimizer-state tensor of a checkpoint without a checksum file (one
  written by Megatron alone): caught by the finite check after the load.

The intact copy resumes and reports its verified checksums. About 2 minutes on 2 cores. The
checksums are hashed as the files are written and verified as they are read (version 2 of the
checksum file): the overwritten bytes are found by the ranks that read them, during the load.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from bad_inputs_table import expected_line
from entry_harness import TINY, launch, run_tiny

from megatron_muon.megatron.integrity import CHECKSUMS, digest

SAVE_ITERS = ["--train-iters", "3", "--log-interval", "1", "--save-interval", "3"]
RESUME = ["--train-iters", "4", "--log-interval", "1", "--save-interval", "100", "--override-opt-param-scheduler"]
ERROR = re.compile(r"^megatron-muon: error: (.*)$", re.MULTILINE)




@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    out = run_tiny([*SAVE_ITERS, "--save", str(root / "ckpt")], root)
    assert re.search(r"megatron-muon: checksums of \d+ files \([0-9.]+ MB\) written to \S+iter_0000003 in", out), \
        out[-3000:]
    return root / "ckpt"


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt, ckpt / "iter_0000003"


def _refused(ckpt: Path, cwd: Path) -> str:
    job = launch([*TINY, *RESUME, "--load", str(ckpt), "--save", str(ckpt)], cwd, timeout=240)
    out = job.out
    assert job.returncode != 0, out[-3000:]
    errors = ERROR.findall(out)
    assert errors, out[-3000:]
    assert "iteration        4/" not in out, "it trained before refusing"
    # Refused by us, not by whatever Megatron or torch hit first (the bare EOFError of old).
    assert not re.search(r"^(EOFError|RuntimeError|CheckpointingException)", out, re.MULTILINE), out[-3000:]
    return errors[0]


def test_checksum_file_lists_every_file(saved):
    """Every byte has a digest: the ``.distcp`` files item by item (hashed as they were written),
    back to back from the first byte to the last, one item per byte range the DCP metadata
    records (what a load reads and verifies); the other files whole."""
    from torch.distributed.checkpoint import FileSystemReader

    iteration = saved / "iter_0000003"
    checksums = json.loads((iteration / CHECKSUMS).read_text())
    table = checksums["files"]
    on_disk = sorted(str(p.relative_to(iteration)) for p in iteration.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    assert checksums["version"] == 2
    assert sorted(table) == on_disk and any(name.endswith(".distcp") for name in on_disk)
    for name, entry in table.items():
        data = (iteration / name).read_bytes()
        if not name.endswith(".distcp"):
            assert entry == {"bytes": len(data), "sha256": digest(iteration / name)}
            continue
        assert set(entry) == {"bytes", "items"} and entry["bytes"] == len(data)
        ends = [0] + [offset + length for offset, length, _ in entry["items"]]
        assert [offset for offset, _, _ in entry["items"]] == ends[:-1] and ends[-1] == len(data)
        for offset, length, sha in entry["items"]:
            assert hashlib.sha256(data[offset:offset + length]).hexdigest() == sha
    items = {(name, offset, length) for name, entry in table.items() for offset, length, _ in entry.get("items", [])}
    stored = FileSystemReader(str(iteration)).read_metadata().storage_data.values()
    assert {(info.relative_path, info.offset, info.length) for info in stored} == items


def test_intact_checkpoint_resumes_verified(saved, tmp_path):
    ckpt, _ = _copy(saved, tmp_path)
    out = run_tiny([*RESUME, "--load", str(ckpt), "--save", str(ckpt)], tmp_path)
    assert re.search(r"megatron-muon: checksums of \d+ files in \S+iter_0000003 verified in", out), out[-3000:]
    assert "iteration        4/" in out


def test_overwritten_bytes_refused(saved, tmp_path):
    ckpt, iteration = _copy(saved, tmp_path)
    victim = sorted(iteration.glob("*.distcp"))[0]
    with open(victim, "r+b") as f:  # 4 KB of zeros in the middle: same size, different bytes
        f.seek(victim.stat().st_size // 2)
        f.write(bytes(4096))
    line = _refused(ckpt, tmp_path)
    assert expected_line("ckpt-overwritten", TMP=str(tmp_path), FILE=str(victim)).fullmatch(line), line


def test_truncated_file_refused(saved, tmp_path):
    ckpt, iteration = _copy(saved, tmp_path)
    victim = sorted(iteration.glob("*.distcp"))[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 3)
    line = _refused(ckpt, tmp_path)
    expected = expected_line("ckpt-truncated", TMP=str(tmp_path), FILE=str(victim), THIRD=str(size // 3),
                             SIZE=str(size))
    assert expected.fullmatch(line), line


def _poison_optimizer_state(iteration: Path) -> str:
    """Write NaN over one fp32 ``exp_avg`` item of the checkpoint (in place, same length);
    returns its key. Each tensor item of a torch_dist file is a ``torch.save`` blob at the
    (file, offset, length) the DCP metadata records."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iteration)).read_metadata()
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if "exp_avg" not in index.fqn or "exp_avg_sq" in index.fqn:
            continue
        path = iteration / info.relative_path
        blob = path.read_bytes()[info.offset:info.offset + info.length]
        try:
            tensor = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception:  # noqa: BLE001 (not a tensor item)
            continue
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.numel() > 1):
            continue
        poisoned = io.BytesIO()
        torch.save(torch.full_like(tensor, float("nan")), poisoned)
        assert zipfile.is_zipfile(poisoned) and len(poisoned.getvalue()) == info.length, "blob size changed"
        with open(path, "r+b") as f:
            f.seek(info.offset)
            f.write(poisoned.getvalue())
        return index.fqn
    raise AssertionError("no fp32 exp_avg item in the checkpoint")


def test_non_finite_state_refused(saved, tmp_path):
    ckpt, iteration = _copy(saved, tmp_path)
    (iteration / CHECKSUMS).unlink()  # as Megatron alone writes it: nothing to verify the bytes
    _poison_optimizer_state(iteration)
    line = _refused(ckpt, tmp_path)
    assert expected_line("ckpt-nan", TMP=str(tmp_path)).fullmatch(line), line
    assert re.search(r" \((exp_avg|momentum_buffer)\) holds", line), line
