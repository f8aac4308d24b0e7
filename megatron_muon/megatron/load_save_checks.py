"""The ``--load`` and ``--save`` directories and the load flags, checked before anything is built.

Called by the ``validate_args`` hook (``hooks.py``) on every rank, and by ``preflight.py`` before
torchrun starts (re-exported by ``startup_checks``):

* ``check_save_writable``: a ``--save`` that cannot be written would fail at the first save,
  after ``--save-interval`` iterations of training; a probe file is written there and removed.
* ``check_resume``: a ``--load`` that points at no checkpoint. Megatron warns and trains from
  scratch, and its first save then overwrites the real run's checkpoints and its
  ``latest_checkpointed_iteration.txt`` when ``--save`` is the real directory; a typo in
  ``--load`` destroyed a resume chain that way. The one exception is a run's own first start:
  ``--load`` equal to ``--save`` and that directory holding no checkpoint yet (absent or
  empty of checkpoints), which is how the sbatch scripts start a job and requeue it. Also a
  tracker file that holds no iteration (Megatron exits 0 on it), or names one whose directory is
  missing; what the checkpoint itself recorded is ``resume_config``'s (what its directory holds:
  ``saved_checkpoint``). And ``--train-iters`` below the iteration resumed from (a job that trains
  nothing; ``_check_run_length``).
* ``check_load_flags``: ``--muon-reset-optimizer-state`` / ``--muon-load-upstream-optimizer`` need a
  checkpoint to apply to, and neither goes with the flags that already decide what the load skips.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .errors import UserInputError

__all__ = ["TRACKER", "check_load_flags", "check_resume", "check_save_writable", "checkpoints_in",
           "iteration_directory", "read_tracker"]

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file: a directory holds a checkpoint for ``--load`` when it has this."""

_NON_PERSISTENT_SUBDIR = "non_persistent"  # megatron.training.checkpointing._NON_PERSISTENT_CKPT_SUBDIR


def checkpoints_in(directory: str | Path) -> list[str]:
    """The names in ``directory`` that belong to a Megatron checkpoint (the tracker file, the
    ``iter_*`` / ``release`` directories, the non-persistent subdirectory); [] when absent."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir()
                  if entry.name in (TRACKER, "release", _NON_PERSISTENT_SUBDIR) or entry.name.startswith("iter_"))


def _same_directory(a: str, b: str) -> bool:
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def read_tracker(load: str) -> int | str:
    """The iteration ``<load>/latest_checkpointed_iteration.txt`` names: an integer >= 0 or
    ``"release"``; anything else is refused. Megatron's ``read_metadata`` prints "Invalid metadata
    file ... Exiting" and calls ``sys.exit()``, exit code 0: the launcher then sees a finished job
    (``run.sh`` reports a checkpoint to resume from, a scheduler counts the job done)."""
    path = Path(load) / TRACKER
    text = path.read_text(errors="replace").strip()
    if text == "release":
        return text
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise UserInputError(
            f"--load {load}: {path} holds {shown!r}; expected an iteration number or 'release' (Megatron would "
            "print \"Invalid metadata file\" and exit with code 0, as if the job had finished); write the iteration "
            "to resume from into it")
    return iteration


def iteration_directory(load: str, iteration: int | str) -> Path:
    """Megatron's directory of ``iteration`` under ``load`` (``get_checkpoint_name``'s base dir)."""
    return Path(load) / ("release" if iteration == "release" else f"iter_{iteration:07d}")


def check_resume(args) -> Path | None:
    """``UserInputError`` when ``--load`` would silently start from scratch, or names an iteration
    that is not there (module docstring); the checkpoint directory the job will load, else None."""
    load = getattr(args, "load", None)
    if load is None:
        return None
    # Megatron reads the tracker even with --ckpt-step
    tracked = read_tracker(load) if (Path(load) / TRACKER).is_file() else None
    step = getattr(args, "ckpt_step", None)
    if step:  # Megatron loads iter_<step> whatever the tracker says
        if (Path(load) / f"iter_{step:07d}").is_dir():
            _check_run_length(args, load, step)
            return Path(load) / f"iter_{step:07d}"
        raise UserInputError(f"--ckpt-step {step}: {load} has no iter_{step:07d}")
    if tracked is not None:
        directory = iteration_directory(load, tracked)
        if not directory.is_dir():
            found = [name for name in checkpoints_in(load) if name != TRACKER]
            have = f"it holds {', '.join(found[:3])}" if found else "it holds no checkpoint directory"
            raise UserInputError(
                f"--load {load}: {TRACKER} names iteration {tracked}, but {directory} does not exist ({have}); "
                f"write an iteration that is there into {Path(load) / TRACKER}, or point --load elsewhere")
        _check_run_length(args, load, tracked)
        return directory  # what it holds: saved_checkpoint (files, args), integrity.py (bytes, at load)
    non_persistent = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(load, _NON_PERSISTENT_SUBDIR)
    if getattr(args, "non_persistent_ckpt_type", None) == "global" and (Path(non_persistent) / TRACKER).is_file():
        return None  # Megatron's non-persistent checkpoint: not compared (resume_config)
    save = getattr(args, "save", None)
    found = checkpoints_in(load)
    if save is not None and _same_directory(save, load) and not found:
        return None  # this run's own first start: nothing to resume yet, nothing to overwrite
    if found:
        raise UserInputError(
            f"--load {load}: holds {', '.join(found[:3])} but no {TRACKER}, so Megatron would start "
            f"from scratch and overwrite them; write the iteration to resume into {load}/{TRACKER} "
            "(an interrupted first save leaves this state) or point --load elsewhere")
    where = "does not exist" if not Path(load).exists() else "holds no checkpoint"
    after = (f" and its saves would go to --save {save}" if save is not None else "")
    raise UserInputError(
        f"--load {load}: {where} (no {TRACKER}); Megatron would train from scratch{after}. Fix the "
        "path, or drop --load to start a new run (a run may name its own empty --save as --load)")


def _check_run_length(args, load: str, iteration: int | str) -> None:
    """``--train-iters`` below the iteration the job resumes from: Megatron's loop would run no
    iteration; its lr scheduler asserts after the load that the schedule's length changed, or with
    ``--override-opt-param-scheduler`` the job writes that iteration's checkpoint again with this
    command line's args and exits 0. (Equal is a finished run started again, which trains nothing.)
    A release checkpoint and ``--finetune`` count from 0."""
    iters = getattr(args, "train_iters", None)
    if (iteration == "release" or iters is None or getattr(args, "finetune", False)
            or getattr(args, "skip_train", False) or iters >= iteration):
        return
    raise UserInputError(
        f"--train-iters {iters}: below iteration {iteration}, which --load {load} resumes from, so the job would "
        f"train nothing (Megatron's lr scheduler asserts after the load, or with --override-opt-param-scheduler "
        f"iteration {iteration} is saved again); pass --train-iters {iteration + 1} or more (with "
        "--override-opt-param-scheduler, which stretches the lr schedule to it), or --finetune to count from 0")


def check_save_writable(args) -> None:
    """``UserInputError`` naming ``--save`` when a checkpoint cannot be written there: the missing
    directories are created, a probe file written and removed, and what was created removed again,
    so the check leaves the file system as it found it. Megatron would find out at its first save,
    after ``--save-interval`` iterations of training."""
    save = getattr(args, "save", None)
    if save is None:
        return
    target = Path(os.path.expanduser(save))
    missing = []
    existing = target
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    # Megatron saves every --save-interval iterations and once more when training ends, so a run
    # from scratch first saves at the smaller of the two (a resumed run: at most that many later).
    first = min((v for v in (getattr(args, "save_interval", None), getattr(args, "train_iters", None)) if v),
                default=None)
    late = f"; the first save (iteration {first}) would fail after training that long" if first else ""
    if not existing.is_dir():
        what = "is a file" if existing == target else f"{existing} is a file"
        raise UserInputError(f"--save {save}: {what}, not a directory{late}. Point --save at a writable directory")
    probe = target / f".megatron-muon-write-probe-{os.getpid()}"
    try:
        try:
            target.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        finally:
            for directory in missing:  # deepest first; rmdir leaves anything another process put there
                with contextlib.suppress(OSError):
                    directory.rmdir()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserInputError(f"--save {save}: cannot write a checkpoint there ({reason}: {err.filename}){late}. "
                             "Point --save at a writable directory") from None


def check_load_flags(args) -> None:
    """``--muon-reset-optimizer-state`` / ``--muon-load-upstream-optimizer`` (``reset_state.py``):
    each changes how one checkpoint is loaded, so each needs a ``--load`` that holds one, and
    neither goes with the flags that already decide what the load skips. Runs for upstream's
    optimizers too (the reset serves them)."""
    reset = getattr(args, "muon_reset_optimizer_state", False)
    upstream = getattr(args, "muon_load_upstream_optimizer", False)
    if not (reset or upstream):
        return
    flag = "--muon-reset-optimizer-state" if reset else "--muon-load-upstream-optimizer"
    load = getattr(args, "load", None)
    if reset and upstream:
        raise UserInputError("--muon-reset-optimizer-state with --muon-load-upstream-optimizer: choose one (fresh "
                             "optimizer state, or megatron-core Muon's carried over)")
    if upstream and args.optimizer != "muon":
        raise UserInputError(f"--muon-load-upstream-optimizer: needs --optimizer muon (megatron-muon loads the "
                             f"state), not {args.optimizer}")
    if load is None:
        raise UserInputError(f"{flag}: needs --load (the checkpoint whose weights, iteration and LR schedule it loads)")
    if getattr(args, "ckpt_format", "torch_dist") not in ("torch_dist", "torch"):
        # Megatron's first read of an fsdp_dtensor checkpoint holds its args and iteration only
        raise UserInputError(f"{flag}: supports --ckpt-format torch_dist and torch, not {args.ckpt_format}")
    for bad, name in ((getattr(args, "no_load_optim", False), "--no-load-optim"),
                      (getattr(args, "finetune", False), "--finetune")):
        if bad:
            raise UserInputError(f"{flag} with {name}: {name} also restarts the LR schedule (--finetune the "
                                 f"iteration too), which {flag} keeps; drop one of them")
    step = getattr(args, "ckpt_step", None)
    if not (Path(load) / TRACKER).is_file() and not (step and (Path(load) / f"iter_{step:07d}").is_dir()):
        raise UserInputError(f"{flag}: --load {load} holds no checkpoint to resume from; the flag is for one "
                             "resume from a saved checkpoint, drop it (a requeued job would apply it again)")
