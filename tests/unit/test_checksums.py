"""The pieces of ``megatron/integrity.py``'s checksums that need no process group: the write tee,
the hashed read, and ``write_checksums`` on one process (the whole flow, two ranks through the
real entry, is ``tests/e2e/test_checkpoint_integrity.py``)."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
import torch

from megatron_muon.megatron.errors import UserInputError
from megatron_muon.megatron.integrity import (
    CHECKSUMS,
    WrittenDigests,
    _HashingStream,
    _MemoryFile,
    _read_hashed,
    digest,
    verify_checksums,
    write_checksums,
)


def test_the_tee_hashes_exactly_what_reaches_the_file():
    sink = io.BytesIO()
    tee = _HashingStream(sink)
    torch.save(torch.randn(1024, 1024), tee)  # a 4 MiB storage: the threaded path; headers: the direct one
    assert tee.count == len(sink.getvalue()) and tee.sha.hexdigest() == hashlib.sha256(sink.getvalue()).hexdigest()
    assert tee.tell() == len(sink.getvalue())  # everything else is the file's


@pytest.mark.parametrize("size", [0, 1000, 40 * 2**20 + 7])  # nothing, under one chunk, three chunks and a tail
def test_a_hashed_read_returns_the_bytes_and_their_digest(size):
    data = os.urandom(size)
    buffer, sha = _read_hashed(io.BytesIO(data), size)
    assert bytes(buffer) == data and sha == hashlib.sha256(data).hexdigest()
    short, sha = _read_hashed(io.BytesIO(data[: size // 2]), size)  # a truncated file: what is there
    assert bytes(short) == data[: size // 2] and sha == hashlib.sha256(data[: size // 2]).hexdigest()


def test_what_was_read_loads_as_from_the_file():
    sink, tensor = io.BytesIO(), torch.randn(300, 7)
    torch.save(tensor, sink)
    memory = _MemoryFile(bytearray(sink.getvalue()))
    assert torch.equal(torch.load(memory, weights_only=True), tensor)
    memory.seek(0)
    assert memory.read(-1) == sink.getvalue() and memory.read(5) == b""  # DCP reads a pickled item whole


def test_files_the_writer_covered_go_by_item_the_rest_whole(tmp_path):
    covered, partial, small = tmp_path / "__0_0.distcp", tmp_path / "__0_1.distcp", tmp_path / "common.pt"
    items = [b"a" * 10, b"b" * 20]
    covered.write_bytes(b"".join(items))
    partial.write_bytes(b"c" * 30)
    small.write_bytes(b"small")
    written = WrittenDigests()
    written.add(str(covered), 10, 20, hashlib.sha256(items[1]).hexdigest())  # out of order, as threads add them
    written.add(str(covered), 0, 10, hashlib.sha256(items[0]).hexdigest())
    written.add(str(partial), 0, 10, hashlib.sha256(b"c" * 10).hexdigest())  # bytes 10..30 never seen: whole
    table = write_checksums(tmp_path, written)
    assert table[covered.name] == {"bytes": 30, "items": [[0, 10, hashlib.sha256(items[0]).hexdigest()],
                                                          [10, 20, hashlib.sha256(items[1]).hexdigest()]]}
    assert table[partial.name] == {"bytes": 30, "sha256": digest(partial)}
    assert table[small.name] == {"bytes": 5, "sha256": digest(small)}
    assert json.loads((tmp_path / CHECKSUMS).read_text()) == {"version": 2, "files": dict(sorted(table.items()))}
    assert "(1 hashed as they were written)" in table.report()
    check = verify_checksums(tmp_path)  # sizes, and the whole digests
    assert check.items == {covered.name: {0: (10, hashlib.sha256(items[0]).hexdigest()),
                                          10: (20, hashlib.sha256(items[1]).hexdigest())}}
    small.write_bytes(b"SMALL")  # same size, other bytes: a whole digest is checked before the load
    with pytest.raises(UserInputError, match=r"common\.pt: contents differ from when it was saved"):
        verify_checksums(tmp_path)


def test_an_async_save_says_it_is_not_checksummed(tmp_path, capsys):
    """``--async-save``: Megatron's save runs unwrapped (megatron-core's persistent worker writes
    the items, out of ``hashing_writes``' reach), no checksum file is written, and one line says so."""
    import argparse

    from megatron.training import global_vars

    from megatron_muon.megatron import hooks

    calls = []
    save = hooks._wrap_save_checkpoint(lambda iteration, *args, **kwargs: calls.append(iteration))
    args = argparse.Namespace(**{hooks.ACTIVE: True}, save=str(tmp_path), async_save=True,
                              dist_ckpt_optim_fully_reshardable=False)
    global_vars.set_args(args)
    try:
        save(3, None, None, None)
    finally:
        global_vars.unset_global_variables()
    assert calls == [3] and not list(tmp_path.rglob(CHECKSUMS))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"megatron-muon: checksums not written for {tmp_path}/iter_0000003: --async-save writes it in "
                     "megatron-core's persistent checkpoint worker, where items are not hashed; it loads unverified "
                     "(drop --async-save for checksummed saves)"], lines


def test_the_checksum_file_size_at_405b_is_the_documented_one():
    """``docs/checkpoints.md``'s figures at Llama-3 405B TP8 x PP16 x DP64: items and bytes per entry."""
    from megatron_muon.core.models import LLAMA3
    from scripts.bench.checksum_file_size import (
        entry_bytes,
        items_dp_reshardable,
        items_fully_reshardable,
        items_model,
    )

    shape = LLAMA3["405B"]
    assert (items_model(shape, 8, 16), items_fully_reshardable(shape, 8, 16),
            items_dp_reshardable(shape, 8, 16, 64)) == (4301, 8871, 420912)
    assert round(entry_bytes()) == 120  # 64 hex digits, two 12-digit numbers, JSON's indent and commas
