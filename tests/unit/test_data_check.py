"""megatron_muon/megatron/data_check.py: a damaged or missing dataset is a one-line error at startup.

The datasets are real: written by scripts/prepare_data.py (uint16 tokens) and by megatron-core's
own IndexedDatasetBuilder (int32, and multimodal), then truncated, extended or deleted. The
namespaces come from Megatron's real parser (``yaml_config.build_parser``), as validate_args gets them.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_muon.megatron import data_check
from megatron_muon.megatron.data_check import (
    REBUILD_HINT,
    check_data_args,
    dataset_prefixes,
    expected_bin_bytes,
    read_index_header,
)

REPO = Path(__file__).resolve().parents[2]
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
MISMATCH = f"(truncated or mismatched; {REBUILD_HINT})"


def _prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts/prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parser():
    from megatron_muon.megatron.yaml_config import build_parser

    return build_parser()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """train/valid prefixes written by scripts/prepare_data.py from six small text files."""
    src = tmp_path_factory.mktemp("src")
    for i in range(6):
        (src / f"doc{i}.txt").write_text(f"document {i}\n" + "some text, " * (5 + 7 * i))
    out = tmp_path_factory.mktemp("pristine")
    manifest = _prepare_data().build(out, inputs=[src], exts=(".txt",), max_bytes=100_000, valid_fraction=0.34)
    assert manifest["splits"]["train"]["documents"] >= 2 and manifest["splits"]["valid"]["documents"] >= 1
    return out


@pytest.fixture
def data(pristine, tmp_path):
    """A fresh copy of the pristine dataset (each test damages its own)."""
    return Path(shutil.copytree(pristine, tmp_path / "data"))


def _args(parser, *argv):
    return parser.parse_args([str(a) for a in argv])


# --- the .idx reader -----------------------------------------------------------------------------


def test_format_constants_are_megatrons():
    from megatron.core.datasets import indexed_dataset

    assert data_check.INDEX_MAGIC == indexed_dataset._INDEX_HEADER
    assert data_check.DTYPE_ITEMSIZE == {d.value: indexed_dataset.DType.size(d.value) for d in indexed_dataset.DType}
    assert data_check._HEADER.size == HEADER_BYTES


def _megatron_built(prefix: Path, dtype, multimodal: bool) -> None:
    """A dataset written by megatron-core's IndexedDatasetBuilder: documents of 1-3 sequences."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    rng = np.random.default_rng(0)
    for doc in range(5):
        for _ in range(1 + doc % 3):
            builder.add_item(torch.from_numpy(rng.integers(0, 100, size=int(rng.integers(1, 40)))), mode=doc % 2)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype,multimodal", [(np.int32, False), (np.uint16, False), (np.int64, True)])
def test_expected_bin_bytes_is_the_bin_size_megatron_reads(tmp_path, pristine, dtype, multimodal):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "built"
    _megatron_built(prefix, dtype, multimodal)
    for p in (prefix, pristine / "train_text_document", pristine / "valid_text_document"):
        index = IndexedDataset(str(p), multimodal=multimodal and p == prefix)
        tokens = int(index.sequence_lengths.sum())
        itemsize = np.dtype(index.index.dtype).itemsize
        assert expected_bin_bytes(f"{p}.idx") == tokens * itemsize == Path(f"{p}.bin").stat().st_size
        header = read_index_header(f"{p}.idx")
        assert (header.itemsize, header.sequence_count) == (itemsize, len(index))
        assert header.document_count == len(index.document_indices)


def test_expected_bin_bytes_seeks_instead_of_reading_the_arrays(tmp_path, monkeypatch):
    """A sparse .idx claiming 50M sequences (1 GB of arrays): only the header and the last length
    and pointer may be read."""
    n, d = 50_000_000, 2
    idx = tmp_path / "huge.idx"
    with open(idx, "wb") as f:
        f.write(data_check.INDEX_MAGIC + struct.pack("<QBQQ", 1, 8, n, d))
        f.seek(HEADER_BYTES + 4 * (n - 1))
        f.write(struct.pack("<i", 7))  # the last length, in uint16 tokens
        f.seek(HEADER_BYTES + 4 * n + 8 * (n - 1))
        f.write(struct.pack("<q", 999_000))  # the last pointer
        f.truncate(HEADER_BYTES + 12 * n + 8 * d)
    bytes_read = []

    class Recording(io.FileIO):  # every way a FileIO hands out bytes, counted
        def read(self, size=-1):
            data = super().read(size)
            bytes_read.append(len(data))
            return data

        def readall(self):
            data = super().readall()
            bytes_read.append(len(data))
            return data

        def readinto(self, buffer):
            bytes_read.append(super().readinto(buffer))
            return bytes_read[-1]

    monkeypatch.setattr(data_check, "open", lambda path, mode: Recording(path, "r"), raising=False)
    assert expected_bin_bytes(idx) == 999_000 + 7 * 2
    assert sum(bytes_read) == HEADER_BYTES + 4 + 8  # the header, the last length, the last pointer


def _write_idx_header(path: Path, magic=None, version=1, dtype_code=8, n=0, d=1, extra=b"") -> None:
    magic = data_check.INDEX_MAGIC if magic is None else magic
    path.write_bytes(magic + struct.pack("<QBQQ", version, dtype_code, n, d) + extra)


def test_bad_index_headers_are_named(tmp_path):
    idx = tmp_path / "x.idx"
    for content, message in [
        (b"", f"{idx}: 0 bytes, shorter than the 34-byte index header (truncated; {REBUILD_HINT})"),
        (b"MMIDIDX", f"{idx}: 7 bytes, shorter than the 34-byte index header (truncated; {REBUILD_HINT})"),
        (b"PK\x03\x04 zip", f"{idx}: not a Megatron index file (starts with b'PK\\x03\\x04 zip', "
                            f"expected b'MMIDIDX\\x00\\x00')"),
    ]:
        idx.write_bytes(content)
        with pytest.raises(ValueError) as info:
            expected_bin_bytes(idx)
        assert str(info.value) == message
    for kwargs, message in [
        (dict(version=2, extra=bytes(8)), f"{idx}: index version 2, expected 1"),
        (dict(dtype_code=9, extra=bytes(8)),
         f"{idx}: unknown token dtype code 9, expected one of 1..8 (megatron.core.datasets.indexed_dataset.DType)"),
        (dict(n=3, d=2, extra=bytes(12 * 3 + 8 * 2 - 1)),  # one byte short
         f"{idx}: 85 bytes, but its header describes 3 sequences and 2 document indices (86 bytes) {MISMATCH}"),
        (dict(n=1, d=2, extra=struct.pack("<iqqq", -5, 0, 0, 1)),
         f"{idx}: corrupt index: the last sequence has length -5 at byte 0 of the .bin ({REBUILD_HINT})"),
    ]:
        _write_idx_header(idx, **kwargs)
        with pytest.raises(ValueError) as info:
            expected_bin_bytes(idx)
        assert str(info.value) == message


def test_an_empty_dataset_describes_an_empty_bin(tmp_path):
    _write_idx_header(tmp_path / "e.idx", n=0, d=1, extra=bytes(8))
    assert expected_bin_bytes(tmp_path / "e.idx") == 0


# --- check_data_args on Megatron's namespace -------------------------------------------------------


def test_good_datasets_pass_for_every_data_flag(parser, data, tmp_path):
    train, valid = data / "train_text_document", data / "valid_text_document"
    blend_file = tmp_path / "blend.txt"
    blend_file.write_text(f"0.7 {train}\n0.3 {valid}\n")
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": [str(train)], "valid": f"1 {valid}", "test": None}))
    for argv in [
        ("--train-data-path", train, "--valid-data-path", valid),
        ("--data-path", train),
        ("--data-path", "0.7", train, "0.3", valid),   # WEIGHT PREFIX pairs
        ("--data-path", train, valid),                 # prefixes only
        ("--data-args-path", blend_file),
        ("--per-split-data-args-path", splits),
        ("--data-path", "s3://bucket/corpus"),         # object storage: read by Megatron's clients, not here
        (),                                            # no data flags at all
    ]:
        check_data_args(_args(parser, *argv))


def test_blends_are_split_as_megatron_splits_them(parser, data, tmp_path):
    train, valid = str(data / "train_text_document"), str(data / "valid_text_document")
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": ["0.5", train, "0.5", valid], "valid": valid, "test": None}))
    args = _args(parser, "--data-path", "0.7", train, "0.3", valid, "--test-data-path", valid, train,
                 "--per-split-data-args-path", splits)
    assert list(dataset_prefixes(args)) == [
        ("--data-path", train), ("--data-path", valid),
        ("--test-data-path", valid), ("--test-data-path", train),
        (f"--per-split-data-args-path {splits} [train]", train),
        (f"--per-split-data-args-path {splits} [train]", valid),
        (f"--per-split-data-args-path {splits} [valid]", valid),
    ]


def test_mock_data_checks_nothing(parser, tmp_path):
    check_data_args(_args(parser, "--mock-data", "--train-data-path", tmp_path / "absent"))


def _error(args) -> str:
    with pytest.raises(ValueError) as info:
        check_data_args(args)
    return str(info.value)


def test_truncated_or_extended_bin_names_flag_and_both_files(parser, data):
    p = data / "valid_text_document"
    size = Path(f"{p}.bin").stat().st_size
    args = _args(parser, "--train-data-path", data / "train_text_document", "--valid-data-path", p)
    with open(f"{p}.bin", "r+b") as f:
        f.truncate(size - 2)  # one uint16 token short
    assert _error(args) == f"--valid-data-path: {p}.bin: {size - 2} bytes, but {p}.idx describes {size} {MISMATCH}"
    with open(f"{p}.bin", "ab") as f:
        f.write(bytes(10))
    assert _error(args) == f"--valid-data-path: {p}.bin: {size + 8} bytes, but {p}.idx describes {size} {MISMATCH}"


def test_damage_in_a_weighted_blend_names_that_prefix(parser, data):
    train, valid = data / "train_text_document", data / "valid_text_document"
    size = Path(f"{valid}.bin").stat().st_size
    Path(f"{valid}.bin").write_bytes(b"")
    args = _args(parser, "--data-path", "0.9", train, "0.1", valid)
    assert _error(args) == f"--data-path: {valid}.bin: 0 bytes, but {valid}.idx describes {size} {MISMATCH}"


def test_missing_files(parser, data):
    p = data / "train_text_document"
    args = _args(parser, "--train-data-path", p)
    Path(f"{p}.bin").unlink()
    assert _error(args) == f"--train-data-path: {p}.bin: no such file, though {p}.idx exists ({REBUILD_HINT})"
    Path(f"{p}.idx").rename(f"{p}.bin")  # only a .bin left (here: the old .idx renamed)
    assert _error(args) == f"--train-data-path: {p}.idx: no such file, though {p}.bin exists ({REBUILD_HINT})"
    Path(f"{p}.bin").unlink()
    assert _error(args) == f"--train-data-path: no dataset at prefix {p}: neither {p}.idx nor {p}.bin exists"


def test_a_file_name_for_a_prefix_gets_the_prefix(parser, data):
    p = data / "train_text_document"
    assert _error(_args(parser, "--data-path", f"{p}.bin")) == (
        f"--data-path: {p}.bin is a file of the dataset; give its prefix, without .bin: {p}")


def test_a_damaged_idx_names_the_flag(parser, data):
    p = data / "valid_text_document"
    Path(f"{p}.idx").write_bytes(b"\x00" * 40)
    assert _error(_args(parser, "--valid-data-path", p)) == (
        f"--valid-data-path: {p}.idx: not a Megatron index file (starts with {bytes(9)!r}, "
        f"expected b'MMIDIDX\\x00\\x00')")


def test_a_flag_given_without_prefixes(parser):
    assert _error(_args(parser, "--valid-data-path")) == (
        "--valid-data-path: no dataset given; expected PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...]")


def test_data_args_file(parser, data, tmp_path):
    p = data / "train_text_document"
    blend = tmp_path / "blend.txt"
    args = _args(parser, "--data-args-path", blend)
    assert _error(args) == f"--data-args-path {blend}: no such file"
    blend.write_text("\n")
    assert _error(args) == (f"--data-args-path {blend}: no dataset given; expected PREFIX [PREFIX ...] "
                            f"or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    blend.write_text(f"1 {p}\n2 {data / 'missing'}\n")
    assert _error(args) == (f"--data-args-path {blend}: no dataset at prefix {data / 'missing'}: "
                            f"neither {data / 'missing'}.idx nor {data / 'missing'}.bin exists")


def test_per_split_args_file(parser, data, tmp_path):
    train, valid = data / "train_text_document", data / "valid_text_document"
    splits = tmp_path / "splits.json"
    args = _args(parser, "--per-split-data-args-path", splits)
    flag = f"--per-split-data-args-path {splits}"
    expected = ("expected a JSON object with keys train, valid and test, each a list or a space-separated "
                "string of [WEIGHT] PREFIX, or null")
    assert _error(args) == f"{flag}: no such file"
    splits.write_text('{"train": ["a",\n  ]}')
    assert _error(args) == f"{flag}:2:3: not valid JSON: Expecting value"
    splits.write_text(json.dumps([str(train)]))
    assert _error(args) == f"{flag}: {expected}; got a JSON list"
    splits.write_text(json.dumps({"train": str(train)}))
    assert _error(args) == f"{flag}: {expected}; valid, test missing"
    splits.write_text(json.dumps({"train": str(train), "valid": {"path": str(valid)}, "test": None}))
    assert _error(args) == f'{flag}: {expected}; valid is {{"path": "{valid}"}}'
    splits.write_text(json.dumps({"train": [str(train)], "valid": str(valid), "test": None}))
    check_data_args(args)
    size = Path(f"{valid}.bin").stat().st_size
    with open(f"{valid}.bin", "r+b") as f:
        f.truncate(4)
    assert _error(args) == f"{flag} [valid]: {valid}.bin: 4 bytes, but {valid}.idx describes {size} {MISMATCH}"
