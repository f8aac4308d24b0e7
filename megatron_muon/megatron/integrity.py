"""Checkpoint integrity: checksums hashed as the files are written and verified as they are read;
finite state after load.

Megatron loads a checkpoint whose bytes were damaged (4 KB overwritten inside a ``.distcp``
file loaded as "successfully loaded" and trained to NaN), and loads NaN state without a word
(every resume of a run whose settings had made it NaN then died later with an unrelated error).
Two checks, both at checkpoint time only — nothing here runs in a training step:

* **Checksums, without reading the checkpoint twice.** While Megatron writes a persistent,
  synchronous torch_dist save (``hashing_writes``), every item megatron-core's writer streams
  into a ``.distcp`` file (a tensor's ``torch.save`` blob or a pickled object, at the offset and
  length the checkpoint's DCP metadata records) is hashed (SHA-256) on its way to the file, by
  the rank and thread that writes it. After Megatron has written iteration ``N``
  (``save_checkpoint`` returned), ``write_checksums`` gathers those digests and hashes the few
  files that were not streamed (``.metadata``, ``common.pt``, ``metadata.json``: small), dealt
  round-robin to the ranks; rank 0 writes ``megatron_muon_checksums.json`` into that directory.
  At load, before Megatron reads anything (``verify_checksums``), every listed file's size is
  checked (a ``stat``, split over the ranks) and the small files are hashed whole; then, while
  megatron-core's reader loads (``ChecksumCheck.reading``), each rank hashes the items it reads
  and compares them with the save's digests: every byte a rank uses is verified, and nothing is
  read only to be hashed. A missing file, a size or a digest that differs is refused with one
  line naming the file, on every rank (the ranks compare their findings in one all-gather after
  each read, before any of them uses what it read). A checkpoint without the file (written by
  Megatron alone, or by an async/non-persistent save, which this does not cover) loads as before;
  an ``--async-save`` save says so in one line (``unchecked_async_save``);
  one written by an earlier megatron-muon (version 1: a digest per whole file) is verified whole,
  as it was then. The file is written after Megatron's tracker: a crash in between leaves a
  checkpoint that loads unverified, never a false refusal. Items no rank reads (the optimizer
  state under ``--no-load-optim``) are size-checked only: nothing uses them.
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
save/load hooks run on every rank): a broadcast of the file list and an all-gather of the results
(save and before a load), and one all-gather of the problems after each ``read_data`` of
megatron-core's torch_dist reader, which every rank calls once per load of a state dict.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import torch

from .errors import UserInputError

__all__ = ["CHECKSUMS", "ChecksumCheck", "SavedChecksums", "WrittenDigests", "check_finite_state",
           "check_main_params_match_weights", "digest", "hashing_writes", "list_files", "unchecked_async_save",
           "verify_checksums", "write_checksums"]

CHECKSUMS = "megatron_muon_checksums.json"
"""Name of the checksum file inside an iteration directory."""

VERSION = 2
"""2: ``.distcp`` files by item (``items``: [offset, length, SHA-256]), the others whole; 1: every
file whole (megatron-muon before its checksums were hashed while writing)."""

_CHUNK = 16 * 2**20  # read size: large enough for disk throughput, small enough for any host
_OVERLAP = 4 * 2**20  # a write at least this large is hashed on a second thread while it is written


def digest(path: str | Path) -> str:
    """SHA-256 of the file at ``path``, as hex (about 1 GB/s on one core of this machine)."""
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


# --------------------------------------------------------------------------- save: hashed as written


class WrittenDigests:
    """The items ``hashing_writes`` saw this process write: absolute file path → [offset,
    length, SHA-256] per item, in the order written (the writer's threads add concurrently)."""

    def __init__(self) -> None:
        self.files: dict[str, list[list]] = {}
        self._lock = threading.Lock()

    def add(self, path: str, offset: int, length: int, sha256: str) -> None:
        with self._lock:
            self.files.setdefault(os.path.abspath(path), []).append([offset, length, sha256])

    def under(self, root: Path) -> dict[str, list[list]]:
        """Relative name → items (by offset) of the files written under ``root`` whose items
        cover the file from its first byte to its last, back to back (anything else is hashed whole)."""
        out = {}
        for path, items in self.files.items():
            name = os.path.relpath(path, os.path.abspath(root))
            items = sorted(items)
            ends = [0] + [offset + length for offset, length, _ in items]
            if (not name.startswith("..") and os.path.isfile(path)
                    and all(item[0] == end for item, end in zip(items, ends)) and ends[-1] == os.path.getsize(path)):
                out[name] = items
        return out


class _HashingStream:
    """A file object for megatron-core's ``_write_item``: every byte written also goes to one
    SHA-256 (the item's); everything else is the file's."""

    def __init__(self, stream) -> None:
        self._stream, self.sha, self.count = stream, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.count += view.nbytes
        if view.nbytes < _OVERLAP:
            self.sha.update(view)
            return self._stream.write(data)
        # a tensor's storage: hashed on a second thread while this one writes it (both release the
        # GIL), so the hash costs the save what it costs beyond the write, not all of it
        hasher = threading.Thread(target=self.sha.update, args=(view,))
        hasher.start()
        try:
            return self._stream.write(data)
        finally:
            hasher.join()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def hashing_writes():
    """While open, every item megatron-core's torch_dist writer (``filesystem_async``, what a
    synchronous save runs in this process) writes is hashed on its way to the file; yields the
    ``WrittenDigests``. Other formats write nothing through it (their files are hashed whole)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item
    written = WrittenDigests()

    @functools.wraps(original)  # megatron-core reads its signature (serialization_format)
    def write_item(*args, **kwargs):
        *head, stream, data, item, key = args  # megatron-core 0.19.2: (*transforms, stream, data, item, key)
        tee = _HashingStream(stream)
        result = original(*head, tee, data, item, key, **kwargs)
        info = result.storage_data
        if tee.count == info.length and getattr(stream, "name", None):  # else: not covered, hashed whole
            written.add(stream.name, info.offset, info.length, tee.sha.hexdigest())
        return result

    filesystem_async._write_item = write_item
    try:
        yield written
    finally:
        filesystem_async._write_item = original


def unchecked_async_save(checkpoint_dir: str | Path) -> str:
    """The line an ``--async-save`` save prints instead of ``SavedChecksums.report``: megatron-core
    0.19.2 writes it in its persistent checkpoint worker (``--async-save`` needs
    ``--use-persistent-ckpt-worker``; started by ``forkserver`` at initialization), a process where
    ``hashing_writes`` does not wrap ``_write_item`` and whose only results (DCP ``WriteResult``s)
    become the checkpoint's metadata, so no digest reaches this process."""
    return (f"megatron-muon: checksums not written for {checkpoint_dir}: --async-save writes it in megatron-core's "
            "persistent checkpoint worker, where items are not hashed; it loads unverified (drop --async-save "
            "for checksummed saves)")


class SavedChecksums(dict):
    """``write_checksums``' table (name → entry), with what the save's log line says."""

    def __init__(self, table: dict, root: Path, seconds: float) -> None:
        super().__init__(table)
        self.root, self.seconds = root, seconds

    def report(self) -> str:
        streamed = sum("items" in entry for entry in self.values())
        megabytes = sum(entry["bytes"] for entry in self.values()) / 1e6
        return (f"megatron-muon: checksums of {len(self)} files ({megabytes:.1f} MB) written to {self.root} in "
                f"{self.seconds:.3f} s ({streamed} hashed as they were written)")


def write_checksums(checkpoint_dir: str | Path, written: WrittenDigests | None = None) -> SavedChecksums:
    """After a save, on rank 0, write ``CHECKSUMS`` into ``checkpoint_dir`` (atomically): the items
    each rank hashed while writing (``written``, from ``hashing_writes``), and every other file
    hashed now, dealt round-robin to the ranks (without ``written``: every file, re-read).
    Collective over the world; returns the table (name → entry)."""
    start = time.perf_counter()
    dist, rank, world = _world()
    root = Path(checkpoint_dir)
    names = _broadcast(dist, list_files(root) if rank == 0 else None)
    streamed = written.under(root) if written is not None else {}
    # a .distcp file is hashed by its writer; when nothing was hashed while writing, every file now
    whole = [n for n in names if written is None or not n.endswith(".distcp")]
    mine = {name: {"bytes": os.path.getsize(root / name), "sha256": digest(root / name)}
            for name in _share(whole, rank, world)}
    mine.update({name: {"bytes": items[-1][0] + items[-1][1] if items else 0, "items": items}
                 for name, items in streamed.items() if name in names})
    table = {}
    for part in _all_gather(dist, world, mine):
        table.update(part)
    if rank == 0:
        for name in names:  # a .distcp file no writer covered (another writer): hashed whole here
            table.setdefault(name, {"bytes": os.path.getsize(root / name), "sha256": digest(root / name)})
        tmp = root / f".{CHECKSUMS}.tmp"
        tmp.write_text(json.dumps({"version": VERSION, "files": dict(sorted(table.items()))}, indent=1))
        os.replace(tmp, root / CHECKSUMS)
    return SavedChecksums(table, root, time.perf_counter() - start)


# --------------------------------------------------------------------------- load: verified as read


def _mismatch(path: Path) -> str:
    return f"{path}: contents differ from when it was saved (SHA-256 mismatch; the file is corrupted)"


def _read_hashed(file, length: int) -> tuple[bytearray, str]:
    """Up to ``length`` bytes of ``file`` from where it is, and their SHA-256: each chunk hashed on
    a second thread while the next one is read (both release the GIL)."""
    buffer, sha = bytearray(length), hashlib.sha256()
    view, done, hasher = memoryview(buffer), 0, None
    while done < length:
        got = file.readinto(view[done:done + _CHUNK])
        if not got:
            break
        if hasher is not None:
            hasher.join()
        hasher = threading.Thread(target=sha.update, args=(view[done:done + got],))
        hasher.start()
        done += got
    if hasher is not None:
        hasher.join()
    del view  # a bytearray with a live view cannot be resized
    if done < length:
        del buffer[done:]
    return buffer, sha.hexdigest()


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes already read: ``torch.load`` copies a storage out of
    it once, as out of the file (an ``io.BytesIO`` of a bytearray would copy it twice)."""

    def __init__(self, data: bytearray) -> None:
        self._view, self._pos = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = offset + (0 if whence == io.SEEK_SET else self._pos if whence == io.SEEK_CUR else len(self._view))
        return self._pos

    def tell(self) -> int:
        return self._pos


def _problem(root: Path, name: str, expected: dict) -> str | None:
    path = root / name
    if not path.is_file():
        return f"{path}: missing (the checkpoint's {CHECKSUMS} lists it)"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"{path}: {size} bytes, {expected['bytes']} when saved (truncated or overwritten)"
    if "sha256" in expected and digest(path) != expected["sha256"]:
        return _mismatch(path)
    return None


def _refuse(root: Path, problems: list[str]) -> None:
    problems = list(dict.fromkeys(problems))  # two ranks reading one damaged item say it once
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserInputError(f"checkpoint {root} refused: {problems[0]}{more}")


class _Damaged(Exception):
    """This rank read an item whose digest differs: it stops reading (the problem is recorded)."""


class ChecksumCheck:
    """A checkpoint's checksums after ``verify_checksums``' checks before the load: the items of
    its ``.distcp`` files, verified as megatron-core reads them inside ``reading()``."""

    def __init__(self, root: Path, table: dict, seconds: float) -> None:
        self.root, self.files = root, len(table)
        self.whole = sum("sha256" in entry for entry in table.values())
        self.items = {name: {offset: (length, sha) for offset, length, sha in entry["items"]}
                      for name, entry in table.items() if "items" in entry}
        self.seconds, self.read_bytes = seconds, 0

    def report(self) -> str:
        """The log line after the load (rank 0's figures)."""
        return (f"megatron-muon: checksums of {self.files} files in {self.root} verified in {self.seconds:.3f} s "
                f"(every size, {self.whole} whole before the load, {self.read_bytes / 1e6:.1f} MB of items as this "
                "rank read them)")

    def _slice(self, reader, original, problems: list[str]):
        """``FileSystemReader._slice_file`` for this checkpoint: an item with a digest is read
        whole, hashed and handed on as an in-memory file; any other read is the reader's own."""
        def slice_file(file, sinfo):
            expected = self.items.get(sinfo.relative_path, {}).get(sinfo.offset)
            if expected is None:
                return original(reader, file, sinfo)
            start = time.perf_counter()
            file.seek(sinfo.offset)
            data, sha = _read_hashed(file, sinfo.length)
            ok = (len(data), sha) == expected
            self.seconds += time.perf_counter() - start
            self.read_bytes += len(data)
            if not ok:
                problems.append(_mismatch(self.root / sinfo.relative_path))
                raise _Damaged
            return _MemoryFile(data)
        return slice_file

    @contextlib.contextmanager
    def reading(self):
        """While open, megatron-core's torch_dist reader verifies each item of this checkpoint it
        reads, and after each ``read_data`` the ranks refuse together (``UserInputError`` on
        every rank) if any read a damaged item. A refusal the reader wraps (DCP's
        ``CheckpointException``) comes out as that one line."""
        from torch.distributed.checkpoint import FileSystemReader

        dist, _, world = _world()
        read_data, slice_file = FileSystemReader.read_data, FileSystemReader._slice_file
        root = self.root.resolve()

        def verified_read_data(reader, plan, planner):
            if Path(reader.path).resolve() != root:
                return read_data(reader, plan, planner)
            problems: list[str] = []
            reader._slice_file = self._slice(reader, slice_file, problems)
            try:
                result = read_data(reader, plan, planner)
            except _Damaged:
                result = None
            finally:
                del reader._slice_file
            _refuse(self.root, [p for part in _all_gather(dist, world, problems) for p in part])
            return result

        FileSystemReader.read_data = verified_read_data
        try:
            yield self
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            refusal = _refusal_in(err)
            if refusal is None or refusal is err:
                raise
            raise refusal from None
        finally:
            FileSystemReader.read_data = read_data


def _refusal_in(err: BaseException) -> UserInputError | None:
    """A ``UserInputError`` raised inside a load, however the reader wrapped it (DCP's
    ``CheckpointException`` keeps each rank's exception in ``failures``)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserInputError):
            return e
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values() if isinstance(pair, tuple)]
    return None


def verify_checksums(checkpoint_dir: str | Path) -> ChecksumCheck | None:
    """Before a load: every file ``CHECKSUMS`` lists exists with its size, and those with a whole
    digest (the small ones; every file of a version-1 checkpoint) hash to it; split over the
    ranks. Collective. Returns the ``ChecksumCheck`` whose ``reading()`` verifies the rest as it
    is read, or None when the checkpoint has no ``CHECKSUMS``; raises ``UserInputError`` on every
    rank, naming the first bad file, when any file differs.
    """
    dist, rank, world = _world()
    start = time.perf_counter()
    root = Path(checkpoint_dir)
    table = None
    if rank == 0 and (root / CHECKSUMS).is_file():
        try:
            table = json.loads((root / CHECKSUMS).read_text())["files"]
        except (ValueError, KeyError, TypeError) as err:
            table = f"{root / CHECKSUMS}: unreadable ({err})"
    table = _broadcast(dist, table)
    if table is None:
        return None
    if isinstance(table, str):
        raise UserInputError(table)
    names = sorted(table)
    mine = [p for name in _share(names, rank, world) if (p := _problem(root, name, table[name]))]
    _refuse(root, [p for part in _all_gather(dist, world, mine) for p in part])
    return ChecksumCheck(root, table, time.perf_counter() - start)


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
