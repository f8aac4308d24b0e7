"""Count the bytes this rank sends through ``torch.distributed``, for Megatron's rows too.

The benchmarks' one collective meter (``bench_tp_modes.py``, ``bench_optimizer_step.py``): our
own collectives report themselves through ``megatron_muon.comm_stats``, Megatron's do not, so
every call is wrapped for one untimed step and counted by ``megatron_muon/parallel/comm.py``'s convention.
"""

from __future__ import annotations

import inspect
import sys

import torch.distributed as dist

__all__ = ["CollectiveCounter"]


# torch.distributed collective → (payload argument, bytes this rank sends for n payload bytes in
# a group of t), megatron_muon/parallel/comm.py's convention; all_to_all is handled separately.
_VOLUME = {
    "all_gather": ("tensor", lambda n, t: n * (t - 1)),
    "all_gather_into_tensor": ("input_tensor", lambda n, t: n * (t - 1)),
    "_all_gather_base": ("input_tensor", lambda n, t: n * (t - 1)),
    "all_reduce": ("tensor", lambda n, t: 2 * (t - 1) * n // t),
    "reduce_scatter_tensor": ("input", lambda n, t: (t - 1) * n // t),
    "_reduce_scatter_base": ("input", lambda n, t: (t - 1) * n // t),
    "reduce_scatter": ("input_list", lambda n, t: (t - 1) * n // t),
    "broadcast": ("tensor", None),  # the root sends n·(t − 1), the others nothing
    "all_to_all_single": ("input", None),
    "all_to_all": ("input_tensor_list", None),
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


class CollectiveCounter:
    """Counts the bytes this rank sends through ``torch.distributed`` while active.

    Megatron binds some collectives at import (``dist_all_gather_func =
    torch.distributed.all_gather_into_tensor`` in ``param_and_grad_buffer``), so besides the
    ``torch.distributed`` attributes every module global of megatron, emerging_optimizers and
    megatron_muon that *is* one of these functions is swapped for the counting wrapper too.
    """

    def __init__(self) -> None:
        self.bytes_by_primitive: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[object, str, object]] = []

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_primitive.values())

    def _wrapper(self, name, original):
        payload, volume = _VOLUME[name]
        signature = inspect.signature(original)

        def counting(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            t, me = dist.get_world_size(group), dist.get_rank(group)
            data = bound[payload]
            if name == "broadcast":
                src = bound.get("src")
                src = dist.get_group_rank(group, src) if group is not None and src is not None else src
                sent = _nbytes(data) * (t - 1) if src == me else 0
            elif name == "all_to_all_single":
                splits = bound.get("input_split_sizes")
                if splits:
                    row = data[0].numel() * data.element_size() if data.dim() > 1 else data.element_size()
                    sent = sum(n for r, n in enumerate(splits) if r != me) * row
                else:
                    sent = _nbytes(data) * (t - 1) // t
            elif name == "all_to_all":
                sent = sum(_nbytes(x) for r, x in enumerate(data) if r != me)
            else:
                sent = volume(_nbytes(data), t)
            self.bytes_by_primitive[name] = self.bytes_by_primitive.get(name, 0) + sent
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return counting

    def __enter__(self) -> CollectiveCounter:
        originals = {name: getattr(dist, name) for name in _VOLUME if hasattr(dist, name)}
        wrappers = {id(f): self._wrapper(name, f) for name, f in originals.items()}
        owners = [dist] + [m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in
                           ("megatron", "emerging_optimizers", "megatron_muon")]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if callable(value) and id(value) in wrappers:
                    self._restore.append((owner, attr, value))
                    setattr(owner, attr, wrappers[id(value)])
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, value in reversed(self._restore):
            setattr(owner, attr, value)
        self._restore.clear()
