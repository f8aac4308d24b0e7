"""The balanced buffer layout: every Muon matrix whole inside one DP rank's shard.

Megatron's distributed optimizer (ZeRO-1) gives DP rank r the r-th of ``DP`` equal slices of
every bucket of its flat grad/param buffer. With megatron-core's default layout (params packed
in backprop order) a slice boundary falls wherever it falls, so many matrices are cut and the
owner exchange must reassemble them every step (65 of 128 Llama-3-8B matrices at TP8 × DP8).
This module lays the buffer out so that no Muon matrix is cut, Canzona-style (arXiv 2602.06079,
§3: α-balanced static partitioning):

    one bucket, DP = 4, shard size S:
    |<---- shard 0 ---->|<---- shard 1 ---->|<---- shard 2 ---->|<---- shard 3 ---->|
    [fillers ....... ][A ][ B ][C ]pad[ D   ][E][ F  ][ G ]pad[ H  ][ I ][J ]pad....]
    fillers: the non-Muon params (embedding, norms, output layer, biases), packed first in
             backprop order; AdamW is elementwise, so a shard boundary may cut them;
    A..J:    Muon matrices, each whole inside one shard, so its DP owner is the rank that
             already holds it and the DP exchange moves nothing.

Buckets: as megatron-core forms them — contiguous runs of params in backprop order, closed once
they reach ``bucket_numel`` elements (``None``: one bucket), a shared (tied) embedding alone in
its own bucket — except that a bucket is also kept open until it holds ``BUCKET_SPAN`` × DP ×
its largest Muon matrix (a bucket needs at least DP matrices to give every rank one, and a few
more so that whole matrices can fill equal shards; megatron-core's layer-wise layout does the
same with 0.9 × DP).

Shards: every shard of a bucket has the same size S (Megatron's reduce-scatter needs equal
slices), the smallest multiple of ``shard_divisor`` that fits. Matrices are placed
largest-first, each on the rank (among those with room left) minimising

    α · (NS FLOPs the rank runs, all buckets so far, with this matrix) / (NS FLOPs per rank, ideal)
    + (1 − α) · (elements of the rank's shard, with this matrix) / S,

α = ``alpha``: 1 balances Newton–Schulz work only (may need a larger S, i.e. padding), 0 packs
elements only. The NS FLOPs term runs across buckets, so a rank whose shard is taken by the
output layer in one bucket gets more matrices in the next. If some matrix fits nowhere, S grows
by ``GROWTH`` and the bucket is packed again.

Row-aligned fallback: a bucket that cannot keep its matrices whole (a deep pipeline stage: 28
Llama-3-405B matrices for 64 DP ranks) is packed as megatron-core packs it, but a matrix that a
shard boundary cuts starts where every boundary inside it falls between two of its rows: S is
rounded up to a multiple of the row length (``LayoutItem.row``: the TP-local shard's columns) of
as many of the bucket's matrices as ``ROW_ROUNDING`` of padding allows, and each cut matrix's
start moves forward by less than one row. So each DP rank holds whole rows of every matrix it
shares, and a MuonBP local block (TP shard ∩ DP rows) is whole rows, as the paper defines it.

Pure Python arithmetic on sizes: no torch, no process group, no Megatron. The Megatron adapter
(``megatron_muon.megatron.layout``) turns the result into megatron-core's ``FullParamLayout``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions

__all__ = ["DEFAULT_ALPHA", "BufferLayout", "LayoutItem", "balanced_layout", "layout_item", "row_aligned_layout"]

DEFAULT_ALPHA = 0.1
"""``--muon-layout-alpha`` default: chosen from ``scripts/bench/planner_quality.py``'s layout
table (docs/performance.md): padding and NS max/mean on Llama-3 8B/70B/405B at TP8 × DP{8, 64}."""
PARAM_ALIGN = 64
"""every param starts at a multiple of 64 elements (megatron-core's ``pad_param_start``)."""
BUCKET_SPAN = 2.0
"""a bucket holds at least this × DP × its largest Muon matrix (see the module docstring)."""
WINDOW = 1.5
"""a bucket may grow to this × its threshold size to find an end with less padding."""
MAX_PADDING = 0.05
"""a bucket padding more than this under whole-matrix placement is packed as megatron-core packs
it instead (see ``balanced_layout``); 2.5 × the 2 % padding goal that Llama-3 layouts meet."""
GROWTH = 0.005
ROW_ROUNDING = 0.01
"""the padding (fraction of a fallback bucket) that rounding S to whole rows may add."""
MAX_SLACK = 0.1
"""the largest S tried is 1.1 × the smallest that fits (α > 0 only)."""
"""relative growth of S when a packing fails (0.5 %: the padding goal is 2 %)."""


@dataclass(frozen=True)
class LayoutItem:
    """One param of a buffer, as the layout sees it."""

    numel: int
    """elements."""
    ns_flops: float = 0.0
    """Newton–Schulz FLOPs its DP owner runs per step (0 for a non-Muon param)."""
    whole: bool = False
    """must lie inside one DP shard (a Muon matrix); False: may be cut (an AdamW param)."""
    own_bucket: bool = False
    """alone in its own bucket (megatron-core's rule for a shared, tied embedding)."""
    row: int = 0
    """elements per row (the TP-local shard's columns) of a ``whole`` item: where a shard must
    cut it (the fallback packing), the cut falls between rows when it can; 0: no rows."""


def layout_item(numel: int, matrix: MatrixLayout | None, ns: NSOptions, *, row: int = 0,
                own_bucket: bool = False) -> LayoutItem:
    """A param as the layout sees it (the adapter's and ``stage_layouts``' one rule): a Muon matrix
    (``matrix``: its layout) whole, costed by its sub-matrices' NS FLOPs at their global shapes,
    cut between rows of ``row`` elements if it must be cut; anything else (None) an AdamW filler."""
    if matrix is None:
        return LayoutItem(numel, own_bucket=own_bucket)
    flops = matrix.group_flops(ns.flops)
    return LayoutItem(numel, flops, whole=True, own_bucket=own_bucket, row=row)


@dataclass(frozen=True)
class BufferLayout:
    """Where every param of one buffer lies. Indices are elements of the flat buffer."""

    ranges: tuple[tuple[int, int, int], ...]
    """per item (input order): ``(start, end, bucket_id)``."""
    buckets: tuple[tuple[int, int], ...]
    """per bucket: ``[start, end)``; ``end − start`` is DP × its shard size."""
    numel_unpadded: tuple[int, ...]
    """per bucket: the end of its last-placed param minus the bucket start — megatron-core's
    ``per_bucket_numel_unpadded``. Megatron's checkpoints keep only this many elements of each
    bucket (``get_parameter_state_dp_zero``), so it must cover every param of the bucket, gaps
    between params included: a shorter count zero-fills the tail of the last param on save."""
    numel_params: tuple[int, ...]
    """per bucket: elements of its params (without alignment gaps or padding)."""
    dp_size: int
    """number of equal shards per bucket."""

    @property
    def numel(self) -> int:
        """the padded buffer length."""
        return self.buckets[-1][1] if self.buckets else 0

    @property
    def padding_fraction(self) -> float:
        """padding as a fraction of the buffer (alignment included)."""
        return 1.0 - sum(self.numel_params) / self.numel if self.numel else 0.0

    def holder(self, i: int) -> int | None:
        """DP rank whose shard holds item ``i`` wholly, or None when a shard boundary cuts it."""
        start, end, b = self.ranges[i]
        bucket_start, bucket_end = self.buckets[b]
        shard = (bucket_end - bucket_start) // self.dp_size
        first, last = (start - bucket_start) // shard, (max(end, start + 1) - 1 - bucket_start) // shard
        return first if first == last else None


def _aligned(n: int) -> int:
    return -(-n // PARAM_ALIGN) * PARAM_ALIGN


def balanced_layout(
    items: Sequence[LayoutItem],
    dp_size: int,
    bucket_numel: int | None,
    *,
    alpha: float = DEFAULT_ALPHA,
    shard_divisor: int = 128,
    max_padding: float = MAX_PADDING,
) -> BufferLayout:
    """Lay out one buffer so that every ``whole`` item lies inside one DP shard.

    A bucket that cannot keep its matrices whole without padding more than ``max_padding`` of
    it (fewer or larger matrices than its DP shards can share: e.g. one pipeline stage of 28
    Llama-3-405B matrices over 64 DP ranks would pad 78 %) is packed as megatron-core packs it
    instead (backprop order, aligned, cut wherever the shards fall): its cut matrices go through
    the DP owner exchange, and the buffer does not grow.

    Args:
        items: the buffer's params in model-definition (forward) order, as megatron-core's
            ``group_params_for_buffers`` lists them; the layout walks them in backprop order.
        dp_size: DP ranks sharing each bucket (>= 1).
        bucket_numel: megatron-core's bucket size in elements; ``None``: one bucket.
        alpha: the α of the module docstring, in [0, 1].
        shard_divisor: every shard size is a multiple of it (megatron-core: ``lcm(64,
            bucket_end_divisor(DP) / DP)``, so a bucket end meets its padding rule).

    Returns:
        a ``BufferLayout`` whose buckets are contiguous backprop runs with non-decreasing
        ``bucket_id`` in backprop order (the invariant megatron-core's buffer asserts).
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"balanced_layout: dp_size must be an integer >= 1, got {dp_size!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--muon-layout-alpha: expected a value in [0, 1], got {alpha!r}")
    if shard_divisor < 1 or shard_divisor % PARAM_ALIGN:
        raise ValueError(f"balanced_layout: shard_divisor must be a positive multiple of {PARAM_ALIGN}, "
                         f"got {shard_divisor}")
    total_flops = sum(it.ns_flops for it in items if it.whole)
    per_rank_flops = total_flops / dp_size or 1.0
    loads = [0.0] * dp_size  # NS FLOPs per DP rank, across buckets
    ranges: list[tuple[int, int, int] | None] = [None] * len(items)
    buckets: list[tuple[int, int]] = []
    extents: list[int] = []
    param_numels: list[int] = []

    def emit(chunk: list[int]) -> None:
        if not chunk:
            return
        start = buckets[-1][1] if buckets else 0
        trial = list(loads)
        placed, shard = _pack_bucket(items, chunk, dp_size, alpha, shard_divisor, trial, per_rank_flops)
        if 1 - sum(items[i].numel for i in chunk) / (dp_size * shard) > max_padding:
            placed, shard = _packed(items, chunk, dp_size, shard_divisor)
        else:
            loads[:] = trial
        for i, (s, e) in placed.items():
            ranges[i] = (start + s, start + e, len(buckets))
        buckets.append((start, start + dp_size * shard))
        extents.append(max(e for _, e in placed.values()))
        param_numels.append(sum(items[i].numel for i in chunk))

    # Backprop order, cut into runs at the params that take a bucket of their own.
    runs: list[list[int]] = [[]]
    for i in reversed(range(len(items))):
        if items[i].own_bucket:
            runs += [[i], []]
        else:
            runs[-1].append(i)
    for run in runs:
        if run and items[run[0]].own_bucket:
            emit(run)
            continue
        while run:
            cut = _bucket_end(items, run, dp_size, bucket_numel, alpha, shard_divisor, loads, per_rank_flops)
            emit(run[:cut])
            run = run[cut:]
    return BufferLayout(tuple(ranges), tuple(buckets), tuple(extents), tuple(param_numels),  # type: ignore[arg-type]
                        dp_size)


def row_aligned_layout(items: Sequence[LayoutItem], dp_size: int, bucket_numel: int | None, *,
                       shard_divisor: int = 128) -> BufferLayout:
    """megatron-core's buckets, each packed by the row-aligned fallback (``_packed``).

    A bucket closes, as megatron-core closes it, once its params reach ``bucket_numel`` elements
    from its start (64-aligned starts; ``None``: one bucket), a shared embedding alone in its own
    bucket; so the buckets hold the params megatron-core's would, and Megatron's overlap is as
    fine-grained as on its own layout. Inside a bucket matrices are cut where the shards fall,
    at row boundaries (the module docstring), and go through the DP owner exchange. Arguments as
    ``balanced_layout``'s; ``plan.layout_choice`` chooses between the two."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"row_aligned_layout: dp_size must be an integer >= 1, got {dp_size!r}")
    ranges: list[tuple[int, int, int] | None] = [None] * len(items)
    buckets: list[tuple[int, int]] = []
    extents: list[int] = []
    param_numels: list[int] = []

    def emit(chunk: list[int]) -> None:
        start = buckets[-1][1] if buckets else 0
        placed, shard = _packed(items, chunk, dp_size, shard_divisor)
        for i, (s, e) in placed.items():
            ranges[i] = (start + s, start + e, len(buckets))
        buckets.append((start, start + dp_size * shard))
        extents.append(max(e for _, e in placed.values()))
        param_numels.append(sum(items[i].numel for i in chunk))

    chunk: list[int] = []
    cursor = 0  # the open bucket's end, relative to its start, as megatron-core packs it
    for i in reversed(range(len(items))):  # backprop order
        if items[i].own_bucket and chunk:
            emit(chunk)
            chunk, cursor = [], 0
        chunk.append(i)
        cursor = _aligned(cursor) + items[i].numel
        if items[i].own_bucket or (bucket_numel is not None and cursor >= bucket_numel):
            emit(chunk)
            chunk, cursor = [], 0
    if chunk:
        emit(chunk)
    return BufferLayout(tuple(ranges), tuple(buckets), tuple(extents), tuple(param_numels),  # type: ignore[arg-type]
                        dp_size)


def _packed(items, chunk, dp_size, divisor):
    """megatron-core's packing of one bucket (params back to back in backprop order, 64-aligned,
    the end padded so that DP equal shards are multiples of ``divisor``), row-aligned: S a
    multiple of the rows of the matrices ``_row_unit`` picks, and a matrix a boundary cuts moved
    forward so that the cut falls between its rows (see the module docstring)."""
    plain, end = _place_packed(items, chunk, None)
    shard = -(-max(-(-end // dp_size), 1) // divisor) * divisor
    if not any(items[i].whole and items[i].row for i in chunk):
        return plain, shard
    unit = _row_unit(items, chunk, dp_size, divisor, shard)
    shard = -(-shard // unit) * unit
    while True:  # moving a matrix forward may push the end past DP x S: grow S and place again
        placed, end = _place_packed(items, chunk, shard)
        if end <= dp_size * shard:
            return placed, shard
        shard += unit


def _row_unit(items, chunk, dp_size: int, divisor: int, shard: int) -> int:
    """The multiple S is rounded to: ``divisor`` times the row lengths of as many of the bucket's
    cut matrices (by elements) as rounding within ``ROW_ROUNDING`` of the bucket allows."""
    rows: dict[int, int] = {}
    for i in chunk:
        if items[i].whole and items[i].row and items[i].numel > items[i].row:
            rows[items[i].row] = rows.get(items[i].row, 0) + items[i].numel
    unit = divisor
    for row in sorted(rows, key=lambda r: (-rows[r], r)):
        wider = math.lcm(unit, row)
        if dp_size * (-(-shard // wider) * wider - shard) <= ROW_ROUNDING * dp_size * shard:
            unit = wider
    return unit


def _place_packed(items, chunk, shard: int | None) -> tuple[dict[int, tuple[int, int]], int]:
    """Params back to back, 64-aligned; with ``shard``, a ``whole`` item with rows that a shard
    boundary would cut mid-row starts up to one row later, where the boundary falls between rows
    (``_row_start``). Returns the positions and the end."""
    placed, cursor = {}, 0
    for i in chunk:
        start = _aligned(cursor)
        if shard is not None and items[i].whole and items[i].row:
            start = _row_start(start, items[i].numel, items[i].row, shard)
        placed[i] = (start, start + items[i].numel)
        cursor = start + items[i].numel
    return placed, cursor


def _row_start(start: int, numel: int, row: int, shard: int) -> int:
    """The 64-aligned start, at or after ``start`` and less than one ``period`` later, from which
    the first shard boundary inside the item falls between two of its rows (``start`` when none
    falls inside). Boundaries are 64-aligned, so stepping by ``period`` (a multiple of both the
    row and 64) keeps both properties; the later boundaries fall between rows when S is a
    multiple of the row (``_row_unit``)."""
    boundary = (start // shard + 1) * shard
    if boundary >= start + numel:
        return start
    period = row * (PARAM_ALIGN // math.gcd(row, PARAM_ALIGN))
    return boundary - (boundary - start) // period * period


def _bucket_end(items, run, dp_size, bucket_numel, alpha, divisor, loads, per_rank_flops) -> int:
    """How many params of ``run`` (backprop order) the next bucket takes.

    The first point where the bucket reaches its threshold (``bucket_numel``, and
    ``BUCKET_SPAN`` × DP × its largest matrix) opens a window up to ``WINDOW`` × that size; the
    end in the window with the least padding wins (uniform layers pack without padding when the
    bucket holds a multiple of DP of them, which a fixed threshold rarely hits). If what would be
    left is below the threshold, the rest of the run joins this bucket instead.
    """
    if bucket_numel is None:
        return len(run)
    numel = largest = 0
    first = None
    for k, i in enumerate(run):
        numel += items[i].numel
        largest = max(largest, items[i].numel if items[i].whole else 0)
        threshold = max(bucket_numel, BUCKET_SPAN * dp_size * largest)
        if numel >= threshold:
            first, limit = k + 1, WINDOW * numel
            break
    if first is None or sum(items[i].numel for i in run[first:]) < threshold:
        return len(run)
    best, best_padding = first, None
    total = 0
    for k, i in enumerate(run):
        total += items[i].numel
        if k + 1 < first:
            continue
        if total > limit or sum(items[j].numel for j in run[k + 1:]) < threshold:
            break
        trial = list(loads)
        _, shard = _pack_bucket(items, run[:k + 1], dp_size, alpha, divisor, trial, per_rank_flops)
        padding = _cost(alpha, trial, 1 - total / (dp_size * shard))
        if best_padding is None or padding < best_padding - 1e-9:
            best, best_padding = k + 1, padding
    return best


def _pack_bucket(items, chunk, dp_size, alpha, divisor, loads, per_rank_flops, *, search=True):
    """Positions (bucket-relative ``[start, end)`` per item index) and the shard size S.

    S starts at the smallest size that fits (α-balanced placement, else best-fit decreasing);
    with ``search``, larger S up to ``MAX_SLACK`` are tried with the α-balanced placement and
    the one minimising ``α · (NS max/mean − 1) + (1 − α) · padding`` wins: α prices 1 % of
    Newton–Schulz imbalance (all buckets so far) against 1 % of this bucket's padding (extra
    reduce-scatter / all-gather bytes). Commits the chosen placement's NS FLOPs to ``loads``.
    """
    fillers = [i for i in chunk if not items[i].whole]  # backprop order
    need = sum(_aligned(items[i].numel) for i in chunk)
    numel = sum(items[i].numel for i in chunk)
    per_rank_numel = need / dp_size
    # largest first (LPT / first-fit decreasing), "large" in the same α-mix as the placement
    wholes = sorted((i for i in chunk if items[i].whole),
                    key=lambda i: (-(alpha * items[i].ns_flops / per_rank_flops
                                     + (1 - alpha) * items[i].numel / per_rank_numel), i))
    biggest = max((_aligned(items[i].numel) for i in wholes), default=0)

    def rounded(n: float) -> int:
        return -(-math.ceil(n) // divisor) * divisor

    def cost(shard: int, trial: list[float]) -> float:
        return _cost(alpha, trial, 1 - numel / (dp_size * shard))

    shard = rounded(max(-(-need // dp_size), biggest, 1))
    while True:
        packed = None
        for fit in ("balanced", "tightest"):
            packed = _try_pack(items, fillers, wholes, dp_size, shard, alpha, loads, per_rank_flops, fit)
            if packed is not None:
                break
        if packed is not None:
            break
        shard = rounded(shard * (1 + GROWTH))
    best = (cost(shard, packed[1]), shard, packed)
    if search and alpha > 0 and wholes:
        limit, trying = shard * (1 + MAX_SLACK), rounded(shard * (1 + GROWTH))
        while trying <= limit:
            packed = _try_pack(items, fillers, wholes, dp_size, trying, alpha, loads, per_rank_flops, "balanced")
            if packed is not None and cost(trying, packed[1]) < best[0] - 1e-12:
                best = (cost(trying, packed[1]), trying, packed)
            trying = rounded(trying * (1 + GROWTH))
    _, shard, (placed, trial) = best
    loads[:] = trial
    return placed, shard


def _cost(alpha: float, loads: Sequence[float], padding: float) -> float:
    """``α · (NS max/mean − 1) + (1 − α) · padding``: the price of a placement."""
    mean = sum(loads) / len(loads)
    imbalance = max(loads) / mean - 1 if mean > 0 else 0.0
    return alpha * imbalance + (1 - alpha) * padding


def _try_pack(items, fillers, wholes, dp_size, shard, alpha, loads, per_rank_flops, fit):
    """One placement at shard size S, or None if some matrix finds no shard with room.

    The fillers go first, contiguously, starting at the shard of the rank with the most NS
    FLOPs so far (so the AdamW params relieve the busiest rank; at the bucket start when they
    do not fit from there). ``fit``: ``balanced`` (the α score) or ``tightest`` (best fit).
    Returns ``(placed, loads after)``.
    """
    filler_numel = sum(_aligned(items[i].numel) for i in fillers)
    busiest = max(range(dp_size), key=lambda r: (loads[r], -r))
    cursor = busiest * shard if busiest * shard + filler_numel <= dp_size * shard else 0
    if cursor + filler_numel > dp_size * shard:
        return None
    placed: dict[int, tuple[int, int]] = {}
    filler_start = cursor
    for i in fillers:  # AdamW params, cut wherever the shards fall
        start = _aligned(cursor)
        placed[i] = (start, start + items[i].numel)
        cursor = start + items[i].numel
    filler_end = _aligned(cursor)
    # next free element per shard: after the fillers where they cover the shard's start
    free = [filler_end if filler_start <= r * shard < filler_end else r * shard for r in range(dp_size)]
    # a shard whose start precedes the fillers ends where they begin
    ends = [min((r + 1) * shard, filler_start) if r * shard < filler_start else (r + 1) * shard
            for r in range(dp_size)]
    trial = list(loads)
    for i in wholes:
        size = _aligned(items[i].numel)
        fits = [r for r in range(dp_size) if free[r] + size <= ends[r]]
        if not fits:
            return None

        def score(r: int) -> tuple[float, int]:
            if fit == "tightest":
                return (ends[r] - free[r], r)
            used = free[r] + size - r * shard
            return (alpha * (trial[r] + items[i].ns_flops) / per_rank_flops
                    + (1 - alpha) * used / shard, r)

        r = min(fits, key=score)
        placed[i] = (free[r], free[r] + items[i].numel)
        free[r] += size
        trial[r] += items[i].ns_flops
    return placed, trial
