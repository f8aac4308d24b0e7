"""scripts/prepare_data.py builds a byte-level Megatron dataset that megatron-core reads.

Builds a ~200 KB corpus from the interpreter's stdlib, then reads it back through
megatron-core's own IndexedDataset and GPTDataset (via BlendedMegatronDatasetBuilder, the path
pretrain_gpt.py takes), with the tokenizer Megatron builds for
``--tokenizer-type NullTokenizer --vocab-size 257``.
"""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SEQ = 64


def _load_script():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts/prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["prepare_data"] = mod
    spec.loader.exec_module(mod)
    return mod


pd = _load_script()


def _megatron_tokenizer():
    """The tokenizer megatron/training builds for the documented flags."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = SimpleNamespace(
        tokenizer_type="NullTokenizer",
        vocab_size=pd.VOCAB_SIZE,
        null_tokenizer_eod_id=None,  # megatron's defaults for the two NullTokenizer options
        null_tokenizer_pad_id=-1,
        pad_vocab_size=True,
        padded_vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=0,
    )
    return build_tokenizer(args), args


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    manifest = pd.build(out, max_bytes=200_000, valid_fraction=0.1, seed=1234)
    return out, manifest


def _file_bytes(manifest, split):
    return [Path(f).read_bytes() for f in manifest["splits"][split]["files"]]


def test_manifest_and_cli_summary(built, capsys):
    out, manifest = built
    train, valid = manifest["splits"]["train"], manifest["splits"]["valid"]
    assert train["documents"] >= 5 and valid["documents"] >= 1
    assert not set(train["files"]) & set(valid["files"])
    n_bytes = sum(len(b) for s in ("train", "valid") for b in _file_bytes(manifest, s))
    assert n_bytes <= 200_000
    for s in ("train", "valid"):
        # one EOD per document
        assert manifest["splits"][s]["tokens"] == sum(len(b) + 1 for b in _file_bytes(manifest, s))
        assert all(f.endswith(".py") and "site-packages" not in f for f in manifest["splits"][s]["files"])
    assert json.loads((out / "manifest.json").read_text())["splits"] == manifest["splits"]
    for name in (pd.TRAIN_NAME, pd.VALID_NAME):
        assert (out / f"{name}.bin").stat().st_size > 0 and (out / f"{name}.idx").exists()

    # Deterministic: a second build of the same inputs gives identical files.
    out2 = out.parent / "again"
    assert pd.main(["--out", str(out2), "--max-bytes", "200000", "--valid-fraction", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "--tokenizer-type NullTokenizer --vocab-size 257" in text and "valid:" in text
    for name in (pd.TRAIN_NAME, pd.VALID_NAME):
        for ext in (".bin", ".idx"):
            assert (out / f"{name}{ext}").read_bytes() == (out2 / f"{name}{ext}").read_bytes()


def test_megatron_null_tokenizer_matches_byte_vocab():
    tok, args = _megatron_tokenizer()
    assert tok.vocab_size == pd.VOCAB_SIZE
    assert tok.eod == pd.EOD_ID == pd.VOCAB_SIZE - 1
    assert tok.pad == -1  # never a byte, never EOD: GPTDataset masks nothing real
    assert args.padded_vocab_size == 384  # what the embedding gets at TP 1
    assert pd.decode(pd.encode("é = 1\n".encode())) == "é = 1\n".encode() + b"\n<EOD>\n"


def test_indexed_dataset_roundtrip(built):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out, manifest = built
    for split, name in (("train", pd.TRAIN_NAME), ("valid", pd.VALID_NAME)):
        ds = IndexedDataset(str(out / name))
        files = _file_bytes(manifest, split)
        assert len(ds) == len(files) and len(ds.document_indices) == len(files) + 1
        assert ds.index.dtype == np.uint16
        for i, data in enumerate(files):
            ids = ds[i]
            assert ids[-1] == pd.EOD_ID and (ids[:-1] < 256).all()
            assert ids[:-1].astype(np.uint8).tobytes() == data
        # the first document is real Python source
        compile(ds[0][:-1].astype(np.uint8).tobytes(), manifest["splits"][split]["files"][0], "exec")


def test_gpt_dataset_reads_it(built):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    out, manifest = built
    tok, _ = _megatron_tokenizer()
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ,
        blend_per_split=[
            ([str(out / pd.TRAIN_NAME)], None),
            ([str(out / pd.VALID_NAME)], None),
            None,
        ],
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(out / "cache"),
    )
    n_train, n_valid = 96, 16
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        GPTDataset, [n_train, n_valid, 0], lambda: True, config
    ).build()
    assert test_ds is None
    assert len(train_ds) >= n_train and len(valid_ds) >= n_valid

    train_docs, valid_docs = _file_bytes(manifest, "train"), _file_bytes(manifest, "valid")
    assert not set(train_docs) & set(valid_docs)  # disjoint document contents

    def check(ds, own, other, n):
        saw_code = False
        for i in range(n):
            s = ds[i]
            tokens, labels = s["tokens"], s["labels"]
            assert tokens.shape == (SEQ,) and labels.shape == (SEQ,)
            assert (tokens[1:] == labels[:-1]).all()
            assert (s["loss_mask"] == 1).all()  # pad id -1 never matches a token
            text = np.concatenate([tokens.numpy(), labels[-1:].numpy()])
            assert text.min() >= 0 and text.max() <= pd.EOD_ID
            cuts = np.flatnonzero(text == pd.EOD_ID)
            pieces = [pd.decode(p) for p in np.split(text, cuts) if p.size]
            pieces = [p[len(b"\n<EOD>\n"):] if p.startswith(b"\n<EOD>\n") else p for p in pieces]
            for piece in pieces:
                if piece:
                    # every EOD-free stretch is real source bytes from this split's documents
                    assert any(piece in d for d in own), (i, piece[:80])
                    if len(piece) >= 48:
                        assert not any(piece in d for d in other), (i, piece[:80])
            saw_code |= any(k in b"".join(pieces) for k in (b"def ", b"import ", b"return", b"class "))
        assert saw_code

    check(train_ds, train_docs, valid_docs, n_train)
    check(valid_ds, valid_docs, train_docs, n_valid)

    # Over one epoch every document boundary shows up as id 256 in the inputs, once
    # (the last document's EOD may fall in the dropped partial sample).
    epoch = len(train_ds)
    assert epoch * SEQ <= manifest["splits"]["train"]["tokens"]
    n_eod = sum(int((train_ds[i]["tokens"] == pd.EOD_ID).sum()) for i in range(epoch))
    assert len(train_docs) - 1 <= n_eod <= len(train_docs)
