"""What a checkpoint directory holds, read without its tensors; a directory that is no readable checkpoint refused.

``read_saved`` gives ``resume_config`` what the run that wrote a checkpoint recorded (its
``args`` and the optimizer format's metadata). It tells the format as Megatron's
``_get_checkpoint_format`` does (``metadata.json``: torch_dist; ``mp_rank_*``: torch;
``.metadata``: a torch DCP checkpoint, fsdp_dtensor), and refuses in one line naming the directory
and what is missing what Megatron's load would fail on with a traceback from every rank (or, for
torch's ``CheckpointException``, a ``BaseException``, the preflight itself): a directory with no
checkpoint file, a torch_dist checkpoint without its ``metadata.json`` (``rm iter/*`` leaves the
hidden ``.metadata``), a data file that its ``.metadata`` names gone or, without megatron-muon's
checksum file (whose sizes and digests ``integrity`` verifies at load), shorter than the bytes
placed in it, and an item that cannot be read.
"""

from __future__ import annotations

import contextlib
import io
import types
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserInputError

__all__ = ["Saved", "read_saved"]


@dataclass
class Saved:
    """What a checkpoint recorded of the run that wrote it."""

    directory: Path
    args: types.SimpleNamespace
    content_metadata: dict = field(default_factory=dict)

    def get(self, name: str, default=None):
        return getattr(self.args, name, default)



def read_saved(directory: str | Path) -> Saved | None:
    """The saved ``args`` (and the optimizer format's metadata) of the checkpoint in ``directory``
    (an ``iter_N`` or ``release`` directory), reading no tensor; None when it records none.
    ``UserInputError`` for a directory that is no readable checkpoint (module docstring)."""
    directory = Path(directory)
    legacy = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    if (directory / "metadata.json").is_file():  # torch_dist
        from megatron.core import dist_checkpointing

        _check_dcp_files(directory, _dcp_metadata(directory), torch_dist=True)
        # dist_checkpointing prints a deprecation warning for some checkpoints; not the user's business.
        with contextlib.redirect_stdout(io.StringIO()), _unreadable(directory, "its common state"):
            common = dist_checkpointing.load_common_state_dict(str(directory))
        if not isinstance(common, dict) or common.get("args") is None:
            return None
        return Saved(directory, common["args"], dict(common.get("content_metadata") or {}))
    if legacy:  # torch: one pickle per rank; mmap maps the tensors without reading them
        import torch

        with _unreadable(directory, legacy[0].relative_to(directory)):
            state = torch.load(legacy[0], map_location="cpu", mmap=True, weights_only=False)
        return Saved(directory, state["args"]) if state.get("args") is not None else None
    if (directory / ".metadata").is_file():  # fsdp_dtensor: one torch DCP checkpoint for all ranks
        return _read_dcp(directory)
    entries = sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
    held = f"it holds {', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''}" if entries else "it is empty"
    raise UserInputError(f"checkpoint {directory} refused: it holds no checkpoint (no metadata.json, .metadata or "
                         f"mp_rank_*/model_optim_rng.pt; {held}); {_RESTORE}")


_ELSEWHERE = "resume from another checkpoint (--ckpt-step N, or another --load)"
_RESTORE = f"restore it from a copy, or {_ELSEWHERE}"
_COMMON_STATE = "common_state/shard_0_1"  # megatron-core's ShardedObject("common_state", ...).unique_key
_CHECKSUMS = "megatron_muon_checksums.json"  # integrity.CHECKSUMS (a module of this floor: not imported)


@contextlib.contextmanager
def _unreadable(directory: Path, what):
    """Any failure to read ``what`` of the checkpoint (torch's ``CheckpointException`` derives
    from ``BaseException``, megatron-core's from ``Exception``) as one refusal naming both."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:  # noqa: BLE001 (whatever the readers raise: one line)
        text = " ".join(str(err).split())
        reason = f"{type(err).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}" if text else type(err).__name__
        raise UserInputError(f"checkpoint {directory} refused: {what} cannot be read ({reason}); "
                             f"{_RESTORE}") from None


def _dcp_metadata(directory: Path):
    """The torch DCP ``.metadata`` of ``directory``: its items and the file and bytes of each."""
    import torch.distributed.checkpoint as dcp

    if not (directory / ".metadata").is_file():
        raise UserInputError(f"checkpoint {directory} refused: .metadata is missing (the index of its tensors); "
                             f"{_RESTORE}")
    with _unreadable(directory, ".metadata"):
        return dcp.FileSystemReader(str(directory)).read_metadata()


def _check_dcp_files(directory: Path, metadata, *, torch_dist: bool) -> None:
    """Every file ``metadata`` places bytes in is there, and (without megatron-muon's checksum file,
    whose sizes the load verifies first) as long as those bytes reach; a torch_dist checkpoint
    (``torch_dist``, or a DCP index holding its common state) has its ``metadata.json``."""
    reach: dict[str, int] = {}
    for info in metadata.storage_data.values():
        reach[info.relative_path] = max(reach.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in reach if not (directory / name).is_file())
    marker = not torch_dist and (_COMMON_STATE in metadata.state_dict_metadata or (directory / "common.pt").is_file())
    if marker or missing:
        names = (["metadata.json"] if marker else []) + missing
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        recognised = "its .metadata is a torch_dist checkpoint's, which Megatron recognises by metadata.json"
        placed = f"places tensors in {'the others' if marker else 'it' if len(missing) == 1 else 'them'}"
        why = (f"{recognised}; it {placed}" if missing else recognised) if marker else f"its .metadata {placed}"
        verb, them = ("is", "it") if len(names) == 1 else ("are", "them")
        raise UserInputError(f"checkpoint {directory} refused: {listed} {verb} missing ({why}); restore "
                             f"{them} from a copy, or {_ELSEWHERE}")
    if (directory / _CHECKSUMS).is_file():
        return
    for name, end in sorted(reach.items()):
        size = (directory / name).stat().st_size
        if size < end:
            raise UserInputError(f"checkpoint {directory} refused: {name} is {size} bytes, but its .metadata places "
                                 f"tensors up to byte {end} (truncated); {_RESTORE}")


def _read_dcp(directory: Path) -> Saved | None:
    """The ``args`` of a torch DCP checkpoint (``fsdp_dtensor``): a pickled non-tensor item of its
    own, read as Megatron's ``load_args_from_checkpoint`` reads it (``_load_base_checkpoint`` with
    ``rank0``: ``torch.distributed.checkpoint.load`` of ``{'args': None}``), which reads that item's
    bytes only (the planner asks for the keys given). Without collectives (``no_dist``): every rank
    of the job reads it on its own, and the preflight has no process group. Its files are checked
    first (``_check_dcp_files``: a torch_dist checkpoint that lost its ``metadata.json`` is refused
    here, as torch's load would raise ``CheckpointException``, a ``BaseException``)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    metadata = _dcp_metadata(directory)
    _check_dcp_files(directory, metadata, torch_dist=False)
    if "args" not in metadata.state_dict_metadata:
        raise UserInputError(f"checkpoint {directory} refused: its .metadata holds no args item (every checkpoint "
                             f"Megatron writes records its args); {_RESTORE}")
    state = {"args": None}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _unreadable(directory, "its args"):
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    if state["args"] is None:
        return None
    return Saved(directory, state["args"], {"distrib_optim_sharding_type": "fsdp_dtensor"})
