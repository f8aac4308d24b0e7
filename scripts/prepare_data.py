#!/usr/bin/env python
"""Build a small, real Megatron indexed dataset (.bin/.idx) from local text files.

No downloads: the default corpus is the ``.py`` sources of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``, without site-packages, dist-packages,
test directories and __pycache__), walked in sorted order and capped by ``--max-bytes``.
``--input`` takes other files or directories instead (directories are searched for
``--ext`` files; files named explicitly are always taken).

Tokenizer (byte level, nothing to load):
    token id = the UTF-8 byte (0..255); EOD = 256; vocab size 257.
This is exactly Megatron's ``NullTokenizer`` with ``--vocab-size 257``: its EOD id defaults to
``vocab_size - 1`` = 256 (megatron/core/tokenizers/text/libraries/null_tokenizer.py), its pad
id defaults to -1 (never in the data), and Megatron pads the embedding to a multiple of
``--make-vocab-size-divisible-by`` x TP (128 -> 384 rows at TP 1; the extra rows are never
targets). Token dtype on disk is uint16, as Megatron's own preprocess_data.py picks for a
vocab this small (GPTDatasetConfig.token_dtype_code == 8).

Each source file is one document (one sequence), with EOD appended. A deterministic
``--valid-fraction`` of the documents (seeded choice, ``--seed``) is written as a separate
prefix, so the output is

    OUT/train_text_document.{bin,idx}
    OUT/valid_text_document.{bin,idx}
    OUT/manifest.json            (files per split, token counts, flags)

Train on it with (Megatron-LM pretrain_gpt.py, megatron-core 0.19):

    --tokenizer-type NullTokenizer --vocab-size 257
    --train-data-path OUT/train_text_document --valid-data-path OUT/valid_text_document
    --data-cache-path OUT/cache

Usage:
    python scripts/prepare_data.py --out data/stdlib
    python scripts/prepare_data.py --out data/mine --input src/ notes.txt --ext .py .txt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

VOCAB_SIZE = 257
EOD_ID = 256  # == VOCAB_SIZE - 1 == NullTokenizer's default eod
TOKEN_DTYPE = np.uint16
TRAIN_NAME = "train_text_document"
VALID_NAME = "valid_text_document"
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

# Directory names skipped when walking a directory (stdlib tests and installed packages).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


def megatron_flags(out_dir: str | os.PathLike) -> list[str]:
    """The Megatron-LM arguments that train on what ``build`` wrote to ``out_dir``."""
    out = Path(out_dir)
    return [
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB_SIZE),
        "--train-data-path", str(out / TRAIN_NAME),
        "--valid-data-path", str(out / VALID_NAME),
        "--data-cache-path", str(out / "cache"),
    ]


def encode(data: bytes) -> np.ndarray:
    """Byte-level encoding of one document: its bytes, then EOD."""
    ids = np.empty(len(data) + 1, dtype=TOKEN_DTYPE)
    ids[:-1] = np.frombuffer(data, dtype=np.uint8)
    ids[-1] = EOD_ID
    return ids


def decode(ids: Iterable[int]) -> bytes:
    """Inverse of ``encode``; EOD ids become ``b"\\n<EOD>\\n"``."""
    out = bytearray()
    for i in ids:
        i = int(i)
        if i == EOD_ID:
            out += b"\n<EOD>\n"
        elif 0 <= i < 256:
            out.append(i)
        else:
            raise ValueError(f"token id {i} outside the byte vocabulary")
    return bytes(out)


def default_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def iter_files(inputs: Sequence[Path], exts: Sequence[str]) -> Iterable[Path]:
    """Files in deterministic order: inputs as given; each directory walked sorted."""
    for root in inputs:
        if root.is_file():
            yield root
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"input not found: {root}")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if name.endswith(tuple(exts)):
                    path = Path(dirpath) / name
                    if path.is_file():  # skip dangling links
                        yield path


def collect_documents(inputs: Sequence[Path], exts: Sequence[str], max_bytes: int):
    """Read documents until the byte budget is used; returns (docs, skipped counts).

    Empty files and files that are not valid UTF-8 are skipped; the walk stops at the first
    file that would overflow ``max_bytes``, so the corpus is a deterministic prefix of the
    sorted file list.
    """
    docs, total = [], 0
    skipped = {"empty": 0, "not_utf8": 0, "over_cap": 0}  # over_cap: 1 if the cap cut the walk
    for path in iter_files(inputs, exts):
        data = path.read_bytes()
        if not data.strip():
            skipped["empty"] += 1
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if total + len(data) > max_bytes:
            skipped["over_cap"] = 1
            break
        docs.append((path, data))
        total += len(data)
    return docs, skipped


def split_documents(n_docs: int, valid_fraction: float, seed: int):
    """Deterministic train/valid index lists (each in corpus order)."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError("--valid-fraction must be in [0, 1)")
    if n_docs < 2:
        raise ValueError(f"need at least 2 documents, found {n_docs}")
    n_valid = int(round(valid_fraction * n_docs))
    if valid_fraction > 0:
        n_valid = min(max(n_valid, 1), n_docs - 1)
    valid = sorted(random.Random(seed).sample(range(n_docs), n_valid))
    valid_set = set(valid)
    train = [i for i in range(n_docs) if i not in valid_set]
    return train, valid


def write_indexed(prefix: Path, docs) -> int:
    """Write one .bin/.idx pair (one sequence per document); returns the token count."""
    import torch
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=TOKEN_DTYPE)
    tokens = 0
    for _, data in docs:
        ids = encode(data)
        # add_item takes a tensor; int32 holds the uint16 values, the builder casts back.
        builder.add_item(torch.from_numpy(ids.astype(np.int32)))
        builder.end_document()
        tokens += ids.size
    builder.finalize(get_idx_path(str(prefix)))
    return tokens


def build(
    out_dir: str | os.PathLike,
    inputs: Sequence[str | os.PathLike] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    valid_fraction: float = 0.05,
    seed: int = 1234,
    exts: Sequence[str] = (".py",),
) -> dict:
    """Build the train/valid prefixes under ``out_dir``; returns the manifest dict."""
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    roots = [Path(p) for p in inputs] if inputs else default_roots()
    docs, skipped = collect_documents(roots, exts, max_bytes)
    train_idx, valid_idx = split_documents(len(docs), valid_fraction, seed)

    manifest = {
        "tokenizer": {
            "kind": "byte-level (UTF-8 bytes 0..255) + EOD",
            "vocab_size": VOCAB_SIZE,
            "eod_id": EOD_ID,
            "token_dtype": "uint16",
            "megatron": "--tokenizer-type NullTokenizer --vocab-size 257 (eod = vocab_size - 1)",
        },
        "inputs": [str(r) for r in roots],
        "max_bytes": max_bytes,
        "valid_fraction": valid_fraction,
        "seed": seed,
        "skipped": skipped,
        "splits": {},
        "megatron_flags": megatron_flags(out),
    }
    for name, idx in ((TRAIN_NAME, train_idx), (VALID_NAME, valid_idx)):
        split_docs = [docs[i] for i in idx]
        prefix = out / name
        tokens = write_indexed(prefix, split_docs)
        manifest["splits"][name.split("_")[0]] = {
            "prefix": str(prefix),
            "documents": len(split_docs),
            "tokens": tokens,
            "files": [str(p) for p, _ in split_docs],
        }
    manifest["seconds"] = round(time.time() - t0, 3)
    with open(out / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def summary(manifest: dict) -> str:
    lines = [f"inputs: {', '.join(manifest['inputs'])} (cap {manifest['max_bytes']} bytes)"]
    sk = manifest["skipped"]
    lines.append(
        f"skipped files: {sk['empty']} empty, {sk['not_utf8']} not UTF-8; "
        + ("walk stopped at the byte cap" if sk["over_cap"] else "all inputs fit under the cap")
    )
    for split, s in manifest["splits"].items():
        lines.append(
            f"{split:5s}: {s['documents']:6d} documents {s['tokens']:10d} tokens -> "
            f"{s['prefix']}.bin/.idx"
        )
    lines.append(
        f"tokenizer: bytes 0..255 + EOD {EOD_ID}, vocab {VOCAB_SIZE} "
        f"(Megatron pads the embedding, e.g. to 384 at TP 1)"
    )
    lines.append("megatron flags: " + " ".join(manifest["megatron_flags"]))
    lines.append(f"built in {manifest['seconds']} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--input", nargs="+", default=None,
        help="files/directories to read (default: the interpreter's stdlib .py files)",
    )
    p.add_argument("--ext", nargs="+", default=[".py"],
                   help="file suffixes taken from directories (default: .py)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help=f"corpus size cap in bytes (default {DEFAULT_MAX_BYTES})")
    p.add_argument("--valid-fraction", type=float, default=0.05,
                   help="fraction of documents held out for validation (default 0.05)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the validation choice")
    args = p.parse_args(argv)
    manifest = build(
        args.out, args.input, args.max_bytes, args.valid_fraction, args.seed, args.ext
    )
    print(summary(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
