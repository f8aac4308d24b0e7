"""megatron-core 0.19.2's own buffer layout, replayed on sizes (``--muon-dp-layout megatron``,
Adam's layout, and the layout ``plan.layout_choice`` prices the balanced one against).

Pure: no torch, no Megatron. ``tests/megatron/test_stage_layouts.py`` compares it with the real
DDP's (``DistributedOptimizer._compute_per_buffer_param_layout``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .balanced_layout import PARAM_ALIGN, BufferLayout

__all__ = ["megatron_packing"]


def megatron_packing(numels: Sequence[int], own_bucket: Sequence[bool], dp: int,
                     bucket_numel: int | None, bucket_divisor: int | None = None) -> BufferLayout:
    """megatron-core 0.19.2's buffer layout of params in registration order (``numels``), replayed
    on sizes: walked in backprop order (the reverse), each start 64-aligned, a bucket closed once
    it holds ``bucket_numel`` elements from its start (None: never), a shared embedding
    (``own_bucket``) alone in its own bucket, each bucket's end padded to a multiple of
    ``bucket_divisor`` (None: lcm(DP, 128), megatron-core's without
    ``--ddp-pad-buckets-for-high-nccl-busbw``)."""
    divisor = math.lcm(dp, 128) if bucket_divisor is None else bucket_divisor
    ranges: list[tuple[int, int, int] | None] = [None] * len(numels)
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = cursor = end = held = 0  # held: params in the open bucket

    def close(param_end: int) -> int:
        nonlocal held
        unpadded.append(param_end - bucket_start)
        buckets.append((bucket_start, -(-param_end // divisor) * divisor))
        held = 0
        return buckets[-1][1]

    for i in reversed(range(len(numels))):
        cursor = -(-cursor // PARAM_ALIGN) * PARAM_ALIGN
        if own_bucket[i] and held:
            bucket_start = cursor = close(cursor)
        end = cursor + numels[i]
        ranges[i] = (cursor, end, len(buckets))
        held += 1
        if (bucket_numel is not None and end - bucket_start >= bucket_numel) or own_bucket[i]:
            bucket_start = cursor = close(end)
        else:
            cursor = end
    if held:
        close(end)
    sizes = [0] * len(buckets)
    for (_, _, b), n in zip(ranges, numels):
        sizes[b] += n
    return BufferLayout(tuple(ranges), tuple(buckets), tuple(unpadded), tuple(sizes), dp)  # type: ignore[arg-type]
