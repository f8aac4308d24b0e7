"""The one place the package decides where a tensor it allocates lives.

On CUDA + NCCL every buffer handed to a collective must be on the rank's GPU; gloo forgives a
CPU tensor, so a device taken from the wrong place (a literal, "the first matrix", a rank that
happens to hold nothing) only fails at scale. The rule, applied everywhere:

* the optimizer: the device of the parameters Megatron gave it (its main-param shards);
* the pure API (``orthogonalize_sharded``, ``orthogonalize_updates``): the inputs' device —
  all inputs must agree;
* no input at all (a rank that holds nothing of a call): the group's device — the current CUDA
  device under NCCL, the CPU under gloo, ``meta`` under torch's fake process group (the dry run,
  where no data moves), the process's default device without torch.distributed.

``tests/unit/test_device_rule.py`` walks the package's source and fails on a device literal or a
``torch.device(...)`` built anywhere but here (and in the CPU patches of Megatron).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["group_device", "resolve_device"]


def group_device(group=None) -> torch.device:
    """The device a collective on ``group`` takes its buffers on (see the module docstring)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.get_default_device()
    backend = str(dist.get_backend(group))
    if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl" for a group with both
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "fake":
        return torch.device("meta")
    return torch.device("cpu")


def resolve_device(tensors: Iterable[torch.Tensor], group=None, *, what: str = "inputs") -> torch.device:
    """The one device of ``tensors``; the group's device when there are none.

    Raises ``ValueError`` naming ``what`` and the devices found when they disagree: a step that
    mixes devices would otherwise fail inside a collective, or silently copy every step.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{what}: tensors on several devices {sorted(map(str, devices))}; expected one")
    return devices.pop() if devices else group_device(group)
