"""Startup check of the datasets a run names: every prefix has a readable .idx and a .bin of the size it describes.

Megatron's indexed dataset is a prefix P with two files (megatron/core/datasets/indexed_dataset.py):
``P.bin`` holds the tokens of every sequence back to back; ``P.idx`` is

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    8 bytes   version, little-endian uint64, always 1
    1 byte    token dtype code (indexed_dataset.DType: 1 uint8 ... 8 uint16)
    8 bytes   sequence count N          (uint64)
    8 bytes   document count D          (uint64)
    N int32   sequence lengths, in tokens
    N int64   sequence pointers, byte offsets into P.bin
    D int64   document indices
    N int8    sequence modes            (multimodal datasets only)

Megatron writes the pointers as the running sum of length x itemsize, so the .bin holds exactly
``pointer[N-1] + length[N-1] x itemsize`` bytes. Megatron never checks that: a truncated .bin is
memory-mapped as it is and fails only when a sample past its end is read, several iterations in,
with ``offset must be non-negative ...`` and no file named. ``check_data_args`` turns that into a
one-line ``ValueError`` at startup naming the flag and the file.

Cost: per prefix, two ``stat`` calls and three small reads of the .idx (header, last length, last
pointer; never its arrays, which are GBs for a real corpus). Object-storage prefixes (``s3://``,
``msc://``) are not checked (Megatron reads them through its own clients).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["IndexHeader", "read_index_header", "expected_bin_bytes", "check_data_args", "dataset_prefixes"]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document count: 9 + 8 + 1 + 8 + 8 = 34 bytes.
_HEADER = struct.Struct("<9sQBQQ")
# indexed_dataset.DType code → bytes per token (uint8, int8, int16, int32, int64, float64, float32, uint16).
DTYPE_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_OBJECT_STORAGE = ("s3://", "msc://")
REBUILD_HINT = "rebuild the dataset with the tool that wrote it, e.g. scripts/prepare_data.py or Megatron's " \
               "tools/preprocess_data.py"


@dataclass(frozen=True)
class IndexHeader:
    """The fixed 34-byte header of a Megatron .idx file (the arrays follow it)."""

    itemsize: int
    """Bytes per token in the .bin (from the dtype code)."""
    sequence_count: int
    """N: sequences in the dataset; the length and pointer arrays have N entries each."""
    document_count: int
    """D: entries of the document-index array (Megatron's builder writes one more than the documents)."""


def read_index_header(idx_path: str | os.PathLike) -> IndexHeader:
    """The header of ``idx_path``; ``ValueError`` naming the file if it is not a Megatron index
    (short file, wrong magic, version or dtype code, or a size other than the header describes).
    ``OSError`` if the file cannot be opened."""
    with open(idx_path, "rb") as stream:
        return _read_header(stream, idx_path, os.fstat(stream.fileno()).st_size)


def expected_bin_bytes(idx_path: str | os.PathLike) -> int:
    """The size in bytes of the .bin that ``idx_path`` describes: last pointer + last length x itemsize.

    Reads the header and the last sequence's length and pointer by seeking, never the arrays.
    ``ValueError`` (naming the file) for a file that is not a well-formed Megatron index.
    """
    with open(idx_path, "rb") as stream:
        header = _read_header(stream, idx_path, os.fstat(stream.fileno()).st_size)
        n = header.sequence_count
        if n == 0:
            return 0
        stream.seek(_HEADER.size + 4 * (n - 1))
        (length,) = struct.unpack("<i", stream.read(4))
        stream.seek(_HEADER.size + 4 * n + 8 * (n - 1))
        (pointer,) = struct.unpack("<q", stream.read(8))
    if length < 0 or pointer < 0:
        raise ValueError(f"{idx_path}: corrupt index: the last sequence has length {length} at byte {pointer} "
                         f"of the .bin ({REBUILD_HINT})")
    return pointer + length * header.itemsize


def _read_header(stream, idx_path, file_size: int) -> IndexHeader:
    raw = stream.read(_HEADER.size)
    magic = raw[:len(INDEX_MAGIC)]
    if magic != INDEX_MAGIC[:len(magic)]:
        raise ValueError(f"{idx_path}: not a Megatron index file (starts with {magic!r}, expected {INDEX_MAGIC!r})")
    if len(raw) < _HEADER.size:
        raise ValueError(f"{idx_path}: {file_size} bytes, shorter than the {_HEADER.size}-byte index header "
                         f"(truncated; {REBUILD_HINT})")
    _, version, dtype_code, n, d = _HEADER.unpack(raw)
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path}: index version {version}, expected {INDEX_VERSION}")
    if dtype_code not in DTYPE_ITEMSIZE:
        raise ValueError(f"{idx_path}: unknown token dtype code {dtype_code}, expected one of "
                         f"{min(DTYPE_ITEMSIZE)}..{max(DTYPE_ITEMSIZE)} (megatron.core.datasets.indexed_dataset.DType)")
    arrays = 4 * n + 8 * n + 8 * d  # lengths, pointers, document indices
    # A multimodal index appends one int8 mode per sequence; any other size is a damaged file.
    if file_size not in (_HEADER.size + arrays, _HEADER.size + arrays + n):
        raise ValueError(f"{idx_path}: {file_size} bytes, but its header describes {n} sequences and {d} document "
                         f"indices ({_HEADER.size + arrays} bytes) (truncated or mismatched; {REBUILD_HINT})")
    return IndexHeader(itemsize=DTYPE_ITEMSIZE[dtype_code], sequence_count=n, document_count=d)


# --------------------------------------------------------------------------- the run's datasets


def dataset_prefixes(args) -> Iterator[tuple[str, str]]:
    """``(where, prefix)`` for every dataset prefix the run's data flags name, in flag order.

    ``where`` is what an error names: the flag, and for the ``*-args-path`` flags also the file
    (and the split). Every data flag that is set is read, even those Megatron would ignore
    (validate_args refuses such combinations anyway). Blends are split by Megatron's own
    ``get_blend_from_list``, so weights are told from prefixes exactly as training does.
    ``ValueError`` for an args file that is missing or malformed, or a flag with no prefixes.
    """
    for flag, attr in (("--data-path", "data_path"), ("--train-data-path", "train_data_path"),
                       ("--valid-data-path", "valid_data_path"), ("--test-data-path", "test_data_path")):
        blend = getattr(args, attr, None)
        if blend is not None:
            yield from ((flag, prefix) for prefix in _blend_prefixes(blend, flag))
    path = getattr(args, "data_args_path", None)
    if path is not None:
        where = f"--data-args-path {path}"
        # Megatron reads this file as whitespace-separated words (get_blend_and_blend_per_split).
        yield from ((where, prefix) for prefix in _blend_prefixes(_read_args_file(path, where).split(), where))
    path = getattr(args, "per_split_data_args_path", None)
    if path is not None:
        for split, blend in _per_split_blends(path):
            where = f"--per-split-data-args-path {path} [{split}]"
            if blend is not None:
                yield from ((where, prefix) for prefix in _blend_prefixes(blend, where))


def _blend_prefixes(blend: list[str], where: str) -> list[str]:
    if not blend:  # Megatron's get_blend_from_list([]) dies unpacking an empty zip
        raise ValueError(f"{where}: no dataset given; expected PREFIX [PREFIX ...] "
                         f"or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    from megatron.core.datasets.utils import get_blend_from_list  # the adapter layer: Megatron's own parse

    prefixes, _ = get_blend_from_list(list(blend))
    return prefixes


def _read_args_file(path: str, where: str) -> str:
    try:
        with open(path) as stream:
            return stream.read()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except OSError as err:
        raise ValueError(f"{where}: cannot read: {err.strerror}") from None


def _per_split_blends(path: str) -> list[tuple[str, list[str] | None]]:
    """The train, valid and test blends of a --per-split-data-args-path JSON file, as Megatron reads
    them: each a list, a whitespace-separated string, or null."""
    flag = f"--per-split-data-args-path {path}"
    try:
        data = json.loads(_read_args_file(path, flag))
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
    expected = ("expected a JSON object with keys train, valid and test, each a list or a space-separated "
                "string of [WEIGHT] PREFIX, or null")
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: {expected}; got a JSON {type(data).__name__}")
    missing = [split for split in ("train", "valid", "test") if split not in data]
    if missing:
        raise ValueError(f"{flag}: {expected}; {', '.join(missing)} missing")
    blends = []
    for split in ("train", "valid", "test"):
        blend = data[split]
        if isinstance(blend, str):
            blend = blend.split()
        elif blend is not None and not (isinstance(blend, list) and all(isinstance(w, (str, int, float))
                                                                        for w in blend)):
            raise ValueError(f"{flag}: {expected}; {split} is {json.dumps(blend)}")
        blends.append((split, None if blend is None else [str(w) for w in blend]))
    return blends


def check_data_args(args) -> None:
    """``ValueError`` (one line: the flag, the file, what is wrong) unless every dataset the run names
    has a .idx that is a Megatron index and a .bin of exactly the size that index describes.

    ``args`` is Megatron's parsed namespace. With ``--mock-data`` nothing is read. Each prefix is
    checked once, named by the first flag that lists it.
    """
    if getattr(args, "mock_data", False):
        return
    checked = set()
    for where, prefix in dataset_prefixes(args):
        if prefix in checked or prefix.startswith(_OBJECT_STORAGE):
            continue
        checked.add(prefix)
        _check_prefix(prefix, where)


def _check_prefix(prefix: str, where: str) -> None:
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"  # megatron's get_idx_path / get_bin_path
    has_idx, has_bin = os.path.isfile(idx_path), os.path.isfile(bin_path)
    if not has_idx and not has_bin:
        stem, ext = os.path.splitext(prefix)
        if ext in (".bin", ".idx") and os.path.isfile(stem + ".idx"):
            raise ValueError(f"{where}: {prefix} is a file of the dataset; give its prefix, without {ext}: {stem}")
        raise ValueError(f"{where}: no dataset at prefix {prefix}: neither {idx_path} nor {bin_path} exists")
    if not has_idx:
        raise ValueError(f"{where}: {idx_path}: no such file, though {bin_path} exists ({REBUILD_HINT})")
    if not has_bin:
        raise ValueError(f"{where}: {bin_path}: no such file, though {idx_path} exists ({REBUILD_HINT})")
    try:
        expected = expected_bin_bytes(idx_path)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    except OSError as err:
        raise ValueError(f"{where}: {idx_path}: cannot read: {err.strerror}") from None
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise ValueError(f"{where}: {bin_path}: {actual} bytes, but {idx_path} describes {expected} "
                         f"(truncated or mismatched; {REBUILD_HINT})")
