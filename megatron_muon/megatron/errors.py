"""One-line errors for a user's mistake, wherever the run is when it finds it.

A bad flag, a missing checkpoint or a corrupted file is the user's input, not a bug: it deserves
one line naming the flag or the file and what was expected, not a 100-line traceback from every
rank. ``UserInputError`` (a ``ValueError``, so callers and tests that catch ``ValueError`` keep
working) marks such an error. ``install_excepthook()`` makes an uncaught one print
``megatron-muon: error: <message>`` once (from rank 0, or from the rank that alone found it) and
end the process with exit code 2, the exit code of a usage error, without a traceback. Any
other exception keeps Python's traceback.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["EXIT_CODE", "UserInputError", "install_excepthook", "one_line", "print_error"]

EXIT_CODE = 2
"""Exit code of a rejected input (argparse's, and what scripts/run.sh and the sbatch scripts pass on)."""


SILENT_RANK_DELAY_S = 5.0
"""How long a rank that does not print waits before it exits (see ``_excepthook``)."""


class UserInputError(ValueError):
    """An input the user can fix (flag, config, data or checkpoint file): printed as one line.

    ``every_rank_knows``: True when every rank raised the same error (a flag seen by all), so
    only rank 0 prints it; False when this rank alone found it (a corrupted shard), so it prints.
    """

    def __init__(self, message: str, *, every_rank_knows: bool = True) -> None:
        super().__init__(one_line(message))
        self.every_rank_knows = every_rank_knows


def one_line(message: str) -> str:
    """``message`` with its whitespace runs (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 (printing an error must not fail on the way)
        pass
    return int(os.environ.get("RANK", "0"))


def print_error(message: str, *, every_rank_knows: bool = True, stream=None) -> None:
    """Print ``megatron-muon: error: <message>`` on ``stream`` (default ``sys.stderr``), once per
    job when every rank knows."""
    if every_rank_knows and _rank() != 0:
        return
    sys.stdout.flush()
    print(f"megatron-muon: error: {one_line(message)}", file=stream or sys.stderr, flush=True)


def _excepthook(previous):
    def hook(kind, value, traceback):
        if isinstance(value, UserInputError):
            # The process's own stderr: by the time an exception is uncaught, sys.stderr may be
            # a capture left behind by library code (seen: a StringIO during Megatron's load).
            print_error(str(value), every_rank_knows=value.every_rank_knows, stream=sys.__stderr__)
            if value.every_rank_knows and _rank() != 0:
                # torchrun stops every rank as soon as one exits: the silent ranks give rank 0,
                # the one that prints, a moment to do so.
                time.sleep(SILENT_RANK_DELAY_S)
            # os._exit: the interpreter's shutdown would join gloo/NCCL worker threads that
            # wait for peers that are exiting too; nothing is left to flush or save.
            os._exit(EXIT_CODE)
        previous(kind, value, traceback)

    hook.megatron_muon = True
    return hook


def install_excepthook() -> None:
    """Print an uncaught ``UserInputError`` as one line and exit 2. Idempotent."""
    if not getattr(sys.excepthook, "megatron_muon", False):
        sys.excepthook = _excepthook(sys.excepthook)
