"""What the checkpoint checksums (``megatron_muon/megatron/integrity.py``) cost a save and a load.

Two gloo ranks on the CPU save and load a torch_dist checkpoint of about 1 GB through
megatron-core's own ``dist_checkpointing.save`` / ``load`` (the writer and reader Megatron's
``save_checkpoint`` / ``load_checkpoint`` use), with the integrity calls the save and load hooks
(``hooks.py``) make around them, three ways:

* ``megatron alone``: no checksums;
* ``re-read``: every file hashed after the save and again before the load, dealt round-robin to
  the ranks (the scheme before issue 41: what ``write_checksums`` / ``verify_checksums`` still do
  when nothing was hashed while writing);
* ``streamed``: each rank's files hashed as they are written (``hashing_writes``) and each rank's
  reads verified as they are read (``verify_checksums(...).reading()``), the hooks' scheme.

A load is timed from a cold page cache (every file evicted with ``posix_fadvise(DONTNEED)``, what a
resumed job on fresh nodes reads) and from a warm one; a save with its files in the page cache
(as written) and with them evicted before the re-read (what a rank re-reading files other nodes
wrote gets at scale). Each figure is the median over ``--runs`` runs (after one warm-up) of the
slower rank's time; the last column is what the checksums read back from storage: the files
hashed whole, once after the save and once before the load.
The checkpoint is deleted after each run and its directory at the end.

    .venv/bin/python -m scripts.bench.checkpoint_integrity --gigabytes 1 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SCHEMES = ("megatron alone", "re-read", "streamed")
ROWS = 4096  # each tensor: ROWS x COLS fp32, cut by rows over the ranks
COLS = 4096


def _evict(directory: Path) -> None:
    """Drop every file of ``directory`` from the page cache (its pages are clean: the writer fsyncs)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _state(rank: int, world: int, tensors: int, empty: bool) -> dict:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    rows = ROWS // world
    out = {"iteration": 7}  # the common state Megatron writes to common.pt
    for i in range(tensors):
        seeded = torch.Generator().manual_seed(i)
        local = torch.empty(rows, COLS) if empty else torch.randn(rows, COLS, generator=seeded)
        out[f"weight_{i}"] = ShardedTensor.from_rank_offsets(f"weight_{i}", local, (0, rank, world))
    return out


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, world: int, root: str, tensors: int, runs: int) -> None:
    """One rank (``torch.multiprocessing.spawn``: not a daemon, as megatron-core's writer starts a
    ``multiprocessing`` manager): its times, as JSON, to ``root/rank<r>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if not torch.cuda.is_available():  # megatron-core's writer synchronizes CUDA after its host copies
        from megatron_muon.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    try:
        times = _body(rank, world, str(Path(root) / "ckpt"), tensors, runs)
    finally:
        dist.destroy_process_group()
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(times))


def _body(rank: int, world: int, root: str, tensors: int, runs: int) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_muon.megatron import integrity

    times = {(scheme, what): [] for scheme in SCHEMES
             for what in ("save", "save, re-read cold", "load cold", "load warm", "re-read MB")}
    state = _state(rank, world, tensors, empty=False)
    for run in range(-1, runs):  # run -1: a warm-up (first collectives, imports), not recorded
        for scheme in SCHEMES:
            ckpt = Path(root) / f"run{run + 1}-{scheme.replace(' ', '_')}"
            if rank == 0:
                ckpt.mkdir(parents=True)
            dist.barrier()

            def save(evict_before_hashing: bool) -> None:
                if scheme == "streamed":
                    with integrity.hashing_writes() as written:
                        dist_checkpointing.save(state, str(ckpt))
                    integrity.write_checksums(ckpt, written)
                    return
                dist_checkpointing.save(state, str(ckpt))
                if scheme == "re-read":
                    if evict_before_hashing and rank == 0:
                        _evict(ckpt)
                    dist.barrier()
                    integrity.write_checksums(ckpt)

            def load() -> None:
                template = _state(rank, world, tensors, empty=True)
                check = integrity.verify_checksums(ckpt) if scheme != "megatron alone" else None
                if check is None:
                    dist_checkpointing.load(template, str(ckpt))
                    return
                with check.reading():
                    dist_checkpointing.load(template, str(ckpt))

            for label, evict in (("save", False), ("save, re-read cold", True)):
                if rank == 0 and ckpt.exists():
                    shutil.rmtree(ckpt)
                    ckpt.mkdir()
                dist.barrier()
                seconds = _timed(lambda: save(evict))
                if run >= 0:
                    times[(scheme, label)].append(seconds)
            for label, cold in (("load cold", True), ("load warm", False)):
                if cold and rank == 0:
                    _evict(ckpt)
                seconds = _timed(load)
                if run >= 0:
                    times[(scheme, label)].append(seconds)
            if rank == 0 and run >= 0:  # what the checksums read back: each whole-hashed file, at save and load
                table = json.loads((ckpt / integrity.CHECKSUMS).read_text())["files"] if scheme != SCHEMES[0] else {}
                times[(scheme, "re-read MB")].append(sum(e["bytes"] for e in table.values() if "sha256" in e) / 1e6)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
    return {f"{scheme}|{what}": values for (scheme, what), values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0, help="checkpoint size (fp32 tensors of 64 MiB)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    opts = parser.parse_args()
    tensors = max(1, round(opts.gigabytes * 2**30 / (ROWS * COLS * 4)))
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="mm-ckpt-bench-", dir=opts.dir)
    try:
        mp.spawn(_rank, args=(2, root, tensors, opts.runs), nprocs=2, join=True)
        results = [json.loads((Path(root) / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = tensors * ROWS * COLS * 4 / 1e9
    print(f"checkpoint: {size:.2f} GB ({tensors} fp32 tensors cut over 2 gloo ranks), median of {opts.runs} runs, "
          "the slower rank's seconds")
    columns = ("save", "save, re-read cold", "load cold", "load warm")
    print("| scheme | " + " | ".join(f"{c} (s)" for c in columns) + " | read back by the checksums, save + load |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for scheme in SCHEMES:
        cells = [statistics.median(max(r[f"{scheme}|{c}"][i] for r in results) for i in range(opts.runs))
                 for c in columns]
        reread = results[0][f"{scheme}|re-read MB"][0]
        print(f"| {scheme} | " + " | ".join(f"{v:.3f}" for v in cells) + f" | 2 x {reread:.3f} MB |")


if __name__ == "__main__":
    main()
