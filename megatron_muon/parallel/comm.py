"""The collectives this package issues, and the accounting of what they move.

Every collective in megatron_muon goes through the wrappers below, so that
``with comm_stats() as stats:`` sees all of them (and nothing Megatron issues itself).

Byte convention (per calling rank, what leaves this rank over the network):
    all_to_all      the chunks addressed to *other* ranks (the chunk to self is a local copy);
    all_gather      its own input × (t − 1), the copies every other rank receives (the list
                    form and ``all_gather_into_tensor`` alike: the same bytes leave the rank);
    broadcast       the tensor's bytes, on the source only (one copy leaves it);
    all_reduce      2(t − 1)/t × the tensor's bytes, the ring algorithm's send volume.
Calls are counted per primitive; NS FLOPs run by the package on this rank are counted too, so a
benchmark can report compute balance next to traffic. An asynchronous collective is counted (and
shown to observers) when it is issued, exactly as its blocking twin.

The step overlaps its collectives with Newton–Schulz as a software pipeline over micro-groups
(``pipelined``): every micro-group is a generator that yields right after issuing a collective,
and the scheduler advances all live micro-groups one stage per round, so that while NS runs on
group k the gather of group k+1 and the return of group k−1 are in flight (the micro-group
scheduling of Canzona, arXiv 2602.06079, and the interleaving of microsoft/dion's AsyncRuntime).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "Collective",
    "Pending",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_async",
    "comm_stats",
    "group_rank",
    "group_size",
    "observe_collectives",
    "pipelined",
    "record_ns_flops",
    "uncounted",
]


@dataclass
class CommStats:
    """What this rank's package-issued collectives moved while the context was open."""

    calls: Counter = field(default_factory=Counter)
    """primitive name → number of calls."""
    bytes_sent: int = 0
    """bytes sent by this rank, by the convention in the module docstring."""
    bytes_by_primitive: Counter = field(default_factory=Counter)
    """primitive name → bytes sent; sums to ``bytes_sent``."""
    ns_flops: int = 0
    """Newton–Schulz FLOPs this rank computed (``ns_flops`` of what it actually ran)."""

    def _record(self, primitive: str, nbytes: int) -> None:
        self.calls[primitive] += 1
        self.bytes_sent += nbytes
        self.bytes_by_primitive[primitive] += nbytes


_active: list[CommStats] = []


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Record the package's collectives on this rank; contexts may nest (each sees all)."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        # by identity: CommStats compare by value, and a context opened inside this one holds the
        # same counts until one of them records something the other does not
        del _active[next(i for i, s in enumerate(_active) if s is stats)]


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Collectives issued inside are shown to observers but counted by no ``comm_stats`` context:
    the one-time setup at optimizer construction (``step_setup``: the team requests, the plan
    check, the warm-up) is no step's traffic, and a context open around a construction measures
    the step's plan alone."""
    global _active
    saved, _active = _active, []
    try:
        yield
    finally:
        _active = saved


def _record(primitive: str, nbytes: int) -> None:
    for stats in _active:
        stats._record(primitive, nbytes)


def record_ns_flops(flops: int) -> None:
    """Count Newton–Schulz work done on this rank (called by the modes, not by users)."""
    for stats in _active:
        stats.ns_flops += flops


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group`` (the default group when None); 1 when torch.distributed is not up."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def is_fake(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` runs on torch's fake backend (the dry run): its collectives move nothing."""
    return dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)) == "fake"


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not up."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass(frozen=True)
class Collective:
    """One collective as the package issues it, for an observer (``observe_collectives``)."""

    primitive: str
    """``all_gather`` (or its tag), ``all_reduce`` or ``all_to_all``."""
    group: dist.ProcessGroup | None
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    input_split_sizes: tuple[int, ...] | None = None
    output_split_sizes: tuple[int, ...] | None = None


_OBSERVERS: list = []


@contextlib.contextmanager
def observe_collectives(callback) -> Iterator[None]:
    """Call ``callback(Collective)`` before each collective the package issues, in order.

    The dry run (``scripts/dry_run.py``) checks with it that every buffer is on the step's device
    and that split sizes agree across ranks: under torch's fake process group nothing moves, so
    nothing else would notice.
    """
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def _observe(*args, **kwargs) -> None:
    if _OBSERVERS:
        event = Collective(*args, **kwargs)
        for callback in _OBSERVERS:
            callback(event)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group=None, *, tag: str = "all_gather") -> None:
    """``dist.all_gather`` with accounting; ``tag`` separates metadata from payload."""
    t = group_size(group)
    _record(tag, _nbytes(tensor) * (t - 1))
    _observe(tag, group, (tensor,), tuple(outputs))
    if t == 1:
        outputs[0].copy_(tensor)
        return
    dist.all_gather(outputs, tensor, group=group)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, *,
                           tag: str = "all_gather") -> None:
    """``dist.all_gather_into_tensor``: every rank's ``tensor`` into one contiguous ``output`` of
    t × its elements, rank r's at ``output.view(t, *tensor.shape)[r]``; the same accounting as
    ``all_gather`` (and the same ``tag`` in the counts). NCCL writes the pieces straight into
    ``output``, where for the list form it gathers into a hidden flat buffer of that size and
    copies out (gloo copies through such a buffer in both forms).

    Observers see the t pieces as views of ``output``, each shaped like ``tensor``, as they see
    the list form's outputs.
    """
    t = group_size(group)
    if not output.is_contiguous() or output.numel() != t * tensor.numel():
        raise ValueError(f"all_gather_into_tensor: output of {output.numel()} elements "
                         f"({'contiguous' if output.is_contiguous() else 'not contiguous'}) for {t} ranks' "
                         f"{tuple(tensor.shape)}; expected a contiguous {t} × {tensor.numel()}")
    _record(tag, _nbytes(tensor) * (t - 1))
    if _OBSERVERS:
        _observe(tag, group, (tensor,), tuple(output.view(t, *tensor.shape).unbind(0)))
    if t == 1:
        output.view_as(tensor).copy_(tensor)
        return
    # gloo wants the output's first dim to be t × the input's; NCCL only the element count
    dist.all_gather_into_tensor(output.view(t * tensor.shape[0], *tensor.shape[1:]) if tensor.ndim else output,
                                tensor.contiguous(), group=group)


def all_reduce(tensor: torch.Tensor, group=None) -> None:
    """In-place sum ``dist.all_reduce`` with ring accounting."""
    if _counted_all_reduce(tensor, group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_reduce_async(tensor: torch.Tensor, group=None) -> Pending:
    """``all_reduce`` issued with ``async_op=True``: ``tensor`` holds the sum after ``wait()``.
    Counted and observed now, when it is issued, as the blocking call is."""
    if _counted_all_reduce(tensor, group) == 1:
        return Pending(None)
    return Pending(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True), tensor)


def _counted_all_reduce(tensor: torch.Tensor, group) -> int:
    """Count and observe one all-reduce of ``tensor`` (ring accounting); returns the group size."""
    t = group_size(group)
    _record("all_reduce", (2 * (t - 1) * _nbytes(tensor)) // t)
    _observe("all_reduce", group, (tensor,), (tensor,))
    return t


def broadcast_async(tensor: torch.Tensor, src: int, group=None) -> Pending:
    """``dist.broadcast`` of ``tensor`` from group rank ``src``, in place, issued with
    ``async_op=True``: ``tensor`` is valid on every rank after ``wait()``.

    Counted on the source only, ``tensor``'s bytes: one copy leaves it, however many ranks receive
    (NCCL's ring forwards the same amount through the others), where scattering it in an
    all-to-all would put t − 1 copies in the source's send buffer. Observed when issued.
    """
    t = group_size(group)
    if group_rank(group) == src:
        _record("broadcast", _nbytes(tensor))
    _observe("broadcast", group, (tensor,), (tensor,))
    if t == 1:
        return Pending(None)
    root = src if group is None else dist.get_global_rank(group, src)
    return Pending(dist.broadcast(tensor, root, group=group, async_op=True), tensor)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group=None,
) -> None:
    """``dist.all_to_all_single`` on flat tensors with per-rank split sizes (in elements)."""
    all_to_all_single_async(output, input, output_split_sizes, input_split_sizes, group).wait()


def all_to_all_single_async(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group=None,
) -> Pending:
    """``all_to_all_single`` issued with ``async_op=True``: ``output`` is valid after ``wait()``.

    Counted and observed now, when it is issued, as the blocking call is. On a group of one the
    copy is made now and the handle is already complete.
    """
    t = group_size(group)
    me = group_rank(group)
    to_others = sum(n for r, n in enumerate(input_split_sizes) if r != me)
    _record("all_to_all", to_others * input.element_size())
    _observe("all_to_all", group, (input,), (output,), tuple(input_split_sizes), tuple(output_split_sizes))
    if t == 1:
        output.copy_(input)
        return Pending(None)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=True)
    return Pending(work, output, input)


class Pending:
    """A collective in flight. ``wait()`` before reading its output (idempotent).

    It holds the collective's buffers until ``wait()``: on NCCL the transfer reads and writes
    them on the communicator's stream after the call has returned, so a buffer freed (and
    reused by the caching allocator) before the wait would be overwritten under it.
    ``wait()`` on NCCL orders the current stream after the collective; it never blocks the host.
    """

    __slots__ = ("_buffers", "_work")

    def __init__(self, work, *buffers: torch.Tensor) -> None:
        self._work = work
        self._buffers = buffers

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._buffers = ()


_DONE = object()


def pipelined(tasks: Iterable[Iterator]) -> None:
    """Run micro-group tasks as a software pipeline; returns when every task has finished.

    A task is a generator: it yields right after issuing its asynchronous collective(s), and
    resumes by waiting on them and doing the next piece of work. Round r starts task r and then
    advances every started task by one stage, youngest first, so the collectives the younger
    tasks have just issued (the gathers of groups r and r−1) are in flight while an older task
    computes (Newton–Schulz of group r−2), and so are the returns the older tasks issued in the
    previous round. A task with S stages lives S rounds, so at most S micro-groups hold buffers
    at once.

    Invariant: every rank of a group runs the same tasks, each with the same stages (a stage
    that has nothing to send still yields), so every rank issues the same collectives in the
    same order. Whether a collective is issued is decided by the plan, which every rank shares
    (an exchange that moves nothing is skipped by all), never by one rank's data.
    """
    live: list[Iterator] = []
    for task in tasks:
        live = _advance([task, *live])
    while live:
        live = _advance(live)


def _advance(tasks: list[Iterator]) -> list[Iterator]:
    """One stage of every task, in the given order; the tasks that are not finished."""
    return [task for task in tasks if next(task, _DONE) is not _DONE]
