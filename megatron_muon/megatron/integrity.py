"""Checkpoint integrity: a checksum per file at save, verified at load; finite state after load.

Megatron loads a checkpoint whose bytes were damaged (4 KB overwritten inside a ``.distcp``
file loaded as "successfully loaded" and trained to NaN), and loads NaN state without a word
(every resume of a run whose settings had made it NaN then died later with an unrelated error).
Two checks, both at checkpoint time only — nothing here runs in a training step:

* **Checksums.** After Megatron has written iteration ``N`` (``save_checkpoint`` returned; it
  ends with a barrier), every file under ``<save>/iter_000000N`` is hashed (SHA-256), the files
  dealt round-robin to the ranks so that each reads about 1/world of the bytes, and rank 0
  writes ``megatron_muon_checksums.json`` (name → size and digest) into that directory. At load,
  before Megatron reads anything, the same split re-hashes the files; a missing file, a size or
  a digest that differs is refused with one line naming the file, on every rank. A checkpoint
  without the file (written by Megatron alone, or by an async/non-persistent save, which this
  does not cover) loads as before. The file is written after Megatron's tracker: a crash in
  between leaves a checkpoint that loads unverified, never a false refusal.
* **Finite state.** After the load, every main param and every optimizer state tensor (Muon
  momentum, AdamW moments) is reduced to its largest absolute value, one fused reduction per
  tensor (``torch._foreach_norm`` with ord inf, which is NaN when the tensor holds a NaN), then
  one host read for the whole rank. A non-finite tensor is refused with one line naming the
  checkpoint directory and the tensor.
* **Main params equal the model weights.** A checkpoint holds every weight twice: the model
  param (bf16 or fp32) and the distributed optimizer's fp32 main param, the model param's
  source. While a load sets each main param (``MuonCheckpointMixin``), the model params already
  hold the same checkpoint's weights, so any element of the two that differs beyond the model
  dtype's rounding means the optimizer half lost data on save (megatron-muon before its fix of
  ``--muon-dp-layout balanced``'s ``per_bucket_numel_unpadded`` zero-filled the tail of a
  bucket's last param at DP >= 2). Such a checkpoint is refused in one line that names the
  param and the way out: ``--muon-reset-optimizer-state`` loads its (intact) weights with fresh
  optimizer state, keeping the iteration and the LR schedule.

Collectives: all on the default (world) group, called by every rank in the same order (the
save/load hooks run on every rank): a broadcast of the file list, an all-gather of the results.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .errors import UserInputError

__all__ = ["CHECKSUMS", "check_finite_state", "check_main_params_match_weights", "digest", "list_files",
           "verify_checksums", "write_checksums"]

CHECKSUMS = "megatron_muon_checksums.json"
"""Name of the checksum file inside an iteration directory."""

_CHUNK = 16 * 2**20  # read size: large enough for disk throughput, small enough for any host


def digest(path: str | Path) -> str:
    """SHA-256 of the file at ``path``, as hex (about 1.5 GB/s on one core with SHA extensions)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def list_files(checkpoint_dir: str | Path) -> list[str]:
    """Every regular file under ``checkpoint_dir`` (relative paths, sorted), but the checksum file."""
    root = Path(checkpoint_dir)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def _share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def _broadcast(dist, value):
    box = [value]
    if dist is not None:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(dist, world: int, value) -> list:
    if dist is None:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def write_checksums(checkpoint_dir: str | Path) -> dict:
    """Hash the files of a written checkpoint (split over the ranks) and, on rank 0, write
    ``CHECKSUMS`` into it (atomically). Collective over the world; returns the table."""
    dist, rank, world = _world()
    root = Path(checkpoint_dir)
    names = _broadcast(dist, list_files(root) if rank == 0 else None)
    mine = {name: {"bytes": os.path.getsize(root / name), "sha256": digest(root / name)}
            for name in _share(names, rank, world)}
    table = {}
    for part in _all_gather(dist, world, mine):
        table.update(part)
    if rank == 0:
        tmp = root / f".{CHECKSUMS}.tmp"
        tmp.write_text(json.dumps({"version": 1, "files": dict(sorted(table.items()))}, indent=1))
        os.replace(tmp, root / CHECKSUMS)
    return table


def _problem(root: Path, name: str, expected: dict) -> str | None:
    path = root / name
    if not path.is_file():
        return f"{path}: missing (the checkpoint's {CHECKSUMS} lists it)"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"{path}: {size} bytes, {expected['bytes']} when saved (truncated or overwritten)"
    if digest(path) != expected["sha256"]:
        return f"{path}: contents differ from when it was saved (SHA-256 mismatch; the file is corrupted)"
    return None


def verify_checksums(checkpoint_dir: str | Path) -> int:
    """Re-hash a checkpoint's files against its ``CHECKSUMS`` (split over the ranks). Collective.

    Returns the number of files verified (0 when the checkpoint has no ``CHECKSUMS``); raises
    ``UserInputError`` on every rank, naming the first bad file, when any file differs.
    """
    dist, rank, world = _world()
    root = Path(checkpoint_dir)
    table = None
    if rank == 0 and (root / CHECKSUMS).is_file():
        try:
            table = json.loads((root / CHECKSUMS).read_text())["files"]
        except (ValueError, KeyError, TypeError) as err:
            table = f"{root / CHECKSUMS}: unreadable ({err})"
    table = _broadcast(dist, table)
    if table is None:
        return 0
    if isinstance(table, str):
        raise UserInputError(table)
    names = sorted(table)
    mine = [p for name in _share(names, rank, world) if (p := _problem(root, name, table[name]))]
    problems = [p for part in _all_gather(dist, world, mine) for p in part]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserInputError(f"checkpoint {root} refused: {problems[0]}{more}")
    return len(names)


# --------------------------------------------------------------------------- finite state


def _named_state(optimizer, names: dict[int, str]):
    """(name, tensor) for every main param and optimizer state tensor of a Megatron optimizer
    (a ``ChainedOptimizer`` or one wrapper) around ``torch.optim`` optimizers."""
    wrappers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for wrapper in wrappers:
        inner = getattr(wrapper, "optimizer", wrapper)
        if getattr(wrapper, "is_stub_optimizer", False) or inner is None:
            continue
        for g, group in enumerate(inner.param_groups):
            for i, param in enumerate(group["params"]):
                name = names.get(id(param), f"param group {g} #{i} {tuple(param.shape)}")
                yield f"{name} (main param)", param
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1:
                        yield f"{name} ({key})", value


def main_param_names(optimizer, model_chunks) -> dict[int, str]:
    """``id(main param) → model param name`` for Megatron's wrappers (fp32 main copies included)."""
    names = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            names[id(param)] = name
            main = getattr(param, "main_param", None)
            if main is not None:
                names[id(main)] = name
    for wrapper in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for model_attr, main_attr in (("model_float16_groups", "shard_fp32_from_float16_groups"),
                                      ("model_fp32_groups", "shard_fp32_groups"),
                                      ("float16_groups", "fp32_from_float16_groups")):
            for models, mains in zip(getattr(wrapper, model_attr, []) or [], getattr(wrapper, main_attr, []) or []):
                for model_param, main_param in zip(models, mains):
                    if id(model_param) in names:
                        names[id(main_param)] = names[id(model_param)]
    return names


def check_finite_state(optimizer, model_chunks, checkpoint_dir: str | Path) -> int:
    """Refuse (``UserInputError`` on every rank) a loaded state holding NaN or inf. Collective.

    Returns the number of tensors checked on this rank.
    """
    from ..optimizer import to_local

    # Megatron-FSDP's params and state are DTensors: their local shards, some of them empty (inf
    # norm of nothing is undefined) on a rank that holds none of that matrix
    named = [(n, to_local(t)) for n, t in _named_state(optimizer, main_param_names(optimizer, model_chunks))]
    named = [(n, t) for n, t in named if t.numel() > 0]
    bad = []
    if named:
        tensors = [t.detach() for _, t in named]
        # ord=inf: the max |x| of each tensor in one fused reduction; NaN if the tensor has a NaN.
        largest = torch._foreach_norm(tensors, float("inf"))
        finite = torch.isfinite(torch.stack([x.float() for x in largest])).tolist()  # host-sync: load only
        bad = [name for (name, _), ok in zip(named, finite) if not ok]
    dist, rank, world = _world()
    found = [b for part in _all_gather(dist, world, bad) for b in part]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UserInputError(f"checkpoint {checkpoint_dir} refused: {found[0]} holds NaN or inf{more}")
    return len(named)


# --------------------------------------------------------------------------- main params vs weights


def check_main_params_match_weights(optimizer, checkpoint_dir: str | Path) -> int:
    """Refuse (``UserInputError`` on every rank) a load whose fp32 main params disagree with the
    same checkpoint's model weights beyond rounding (module docstring). Collective.

    Reads what the last load recorded (``MuonCheckpointMixin.weight_mismatches``), so call it
    right after a load that restored the model weights before the optimizer state (Megatron's
    ``load_checkpoint``). Returns the number of main params compared on this rank.
    """
    records = [r for wrapper in getattr(optimizer, "chained_optimizers", None) or [optimizer]
               for r in getattr(wrapper, "weight_mismatches", [])]
    bad = []
    if records:
        counts = torch.stack([count for _, count in records]).tolist()  # host-sync: load only
        bad = [f"{name} ({count} elements)" for (name, _), count in zip(records, counts) if count]
    dist, rank, world = _world()
    found = [b for part in _all_gather(dist, world, bad) for b in part]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UserInputError(
            f"checkpoint {checkpoint_dir} refused: its fp32 main params differ from its own model weights in "
            f"{found[0]}{more}, so its optimizer state lost data on save (megatron-muon's balanced layout before "
            "its per_bucket_numel_unpadded fix); resume with --muon-reset-optimizer-state to load the weights "
            "with fresh optimizer state, keeping the iteration and LR schedule")
    return len(records)
