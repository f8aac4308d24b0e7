"""The balanced buffer layout (``plan.balanced_layout``) and its Megatron adapter.

Pure layout arithmetic on sizes, then the adapter on a real (meta-device) Llama-shaped parameter
list through megatron-core's own buffer grouping. The end-to-end checks (exactness against the
single-process reference with the layout in Megatron's DDP, no DP traffic, checkpoints across
layouts) are in ``test_megatron_optimizer.py`` and ``test_checkpoint.py``.
"""

from __future__ import annotations

import random

import pytest

from megatron_muon.plan.balanced_layout import PARAM_ALIGN, LayoutItem, balanced_layout


def _check_invariants(items, layout, dp):
    """What megatron-core's buffer and distributed optimizer rely on, and what we promise."""
    # buckets tile the buffer, each DP equal shards of a multiple of 64 elements
    cursor = 0
    for start, end in layout.buckets:
        assert start == cursor and (end - start) % (dp * PARAM_ALIGN) == 0
        cursor = end
    # params: inside their bucket, 64-aligned starts, no overlaps
    spans = sorted((s, e) for s, e, _ in layout.ranges)
    for (_, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1
    for i, (s, e, b) in enumerate(layout.ranges):
        assert e - s == items[i].numel and s % PARAM_ALIGN == 0
        assert layout.buckets[b][0] <= s and e <= layout.buckets[b][1]
    # bucket ids never decrease in backprop order (the buffer asserts it)
    ids = [layout.ranges[i][2] for i in reversed(range(len(items)))]
    assert ids == sorted(ids)
    # the promise: every whole item inside one shard
    for i, item in enumerate(items):
        if item.whole:
            assert layout.holder(i) is not None, f"item {i} is cut"
    # per bucket: its params' elements, and what a checkpoint keeps (megatron-core's
    # per_bucket_numel_unpadded: up to the last param's end, or the tail of that param is lost)
    per_bucket = [0] * len(layout.buckets)
    ends = [0] * len(layout.buckets)
    for i, (_, e, b) in enumerate(layout.ranges):
        per_bucket[b] += items[i].numel
        ends[b] = max(ends[b], e - layout.buckets[b][0])
    assert list(layout.numel_params) == per_bucket
    assert list(layout.numel_unpadded) == ends


def _layer(hidden: int, ffn: int, ns=lambda n: n) -> list[LayoutItem]:
    """norm, proj, qkv, norm, fc1, fc2 — the order Megatron registers a layer's params."""
    sizes = [hidden * hidden, hidden * hidden * 3 // 2, 2 * ffn * hidden, ffn * hidden]
    mats = [LayoutItem(n, float(ns(n)), whole=True) for n in sizes]
    return [LayoutItem(hidden), mats[0], mats[1], LayoutItem(hidden), mats[2], mats[3]]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bucket", [None, 5_000, 40_000])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 1.0])
def test_invariants_on_a_small_gpt(dp, bucket, alpha):
    items = [LayoutItem(1000 * 64)]  # embedding
    for _ in range(6):
        items += _layer(64, 172)
    items += [LayoutItem(64), LayoutItem(1000 * 64)]  # final norm, output layer
    layout = balanced_layout(items, dp, bucket, alpha=alpha, max_padding=1.0)  # never fall back
    _check_invariants(items, layout, dp)
    fallback = balanced_layout(items, dp, bucket, alpha=alpha)  # the default: packed where it would pad
    _check_invariants_packed(items, fallback, dp)
    assert fallback.padding_fraction <= max(0.05, layout.padding_fraction) + 1e-12


def test_invariants_on_random_buffers():
    """Odd sizes, a shared embedding bucket, fillers larger than a shard."""
    rng = random.Random(0)
    for _ in range(60):
        dp = rng.choice([2, 3, 4, 5, 8, 16])
        items = []
        for _ in range(rng.randint(1, 40)):
            whole = rng.random() < 0.6
            n = rng.randint(1, 5000) if whole else rng.randint(1, 20000)
            items.append(LayoutItem(n, float(n * rng.uniform(0.5, 2.0)) if whole else 0.0, whole))
        if rng.random() < 0.3:
            items.insert(0, LayoutItem(rng.randint(100, 30000), own_bucket=True))
        bucket = rng.choice([None, 2000, 10000, 50000])
        layout = balanced_layout(items, dp, bucket, alpha=rng.choice([0.0, 0.1, 0.5, 1.0]),
                                 shard_divisor=rng.choice([64, 128, 256]), max_padding=1.0)
        _check_invariants(items, layout, dp)


def test_shared_embedding_gets_its_own_bucket():
    items = [LayoutItem(4096, own_bucket=True)] + _layer(32, 64) + _layer(32, 64)
    layout = balanced_layout(items, 2, 10**9, max_padding=1.0)
    bucket = layout.ranges[0][2]
    assert all(b != bucket for _, _, b in layout.ranges[1:])


def test_uniform_layers_pack_without_padding():
    """DP × k identical layers in one bucket: every shard gets k layers' worth, no padding
    beyond the 64-element alignment (these sizes are multiples of 64), equal NS per rank."""
    dp = 4
    items = [m for _ in range(2 * dp) for m in _layer(64, 128) if m.whole]
    layout = balanced_layout(items, dp, None, alpha=0.1)
    _check_invariants(items, layout, dp)
    assert layout.padding_fraction == 0.0
    loads = [0.0] * dp
    for i, item in enumerate(items):
        loads[layout.holder(i)] += item.ns_flops
    assert max(loads) == min(loads)


def test_alpha_trades_padding_for_balance():
    """One bucket whose fillers (an 'output layer') cover part of the shards: α = 0 packs
    elements (no shard grows), α = 1 may grow the shards to even out the NS FLOPs."""
    items = []
    for _ in range(5):
        items += [m for m in _layer(64, 128, ns=lambda n: n ** 1.5) if m.whole]
    items.append(LayoutItem(40_000))  # output layer (last in forward order, first in backprop)

    def imbalance(layout):
        loads = [0.0] * 4
        for i, item in enumerate(items):
            if item.whole:
                loads[layout.holder(i)] += item.ns_flops
        return max(loads) / (sum(loads) / 4)

    packed, balanced = (balanced_layout(items, 4, None, alpha=a, max_padding=1.0) for a in (0.0, 1.0))
    assert packed.padding_fraction <= balanced.padding_fraction
    assert imbalance(balanced) < imbalance(packed)


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match="--muon-layout-alpha: expected a value in \\[0, 1\\], got 1.5"):
        balanced_layout([LayoutItem(10, 1.0, True)], 2, None, alpha=1.5)
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1"):
        balanced_layout([LayoutItem(10, 1.0, True)], 0, None)
    with pytest.raises(ValueError, match="shard_divisor must be a positive multiple of 64"):
        balanced_layout([LayoutItem(10, 1.0, True)], 2, None, shard_divisor=100)


def test_adapter_matches_megatron_grouping_on_llama_shapes():
    """The adapter's ``FullParamLayout`` on a (meta) Llama-3-8B TP8 rank at DP8 through
    megatron-core's own grouping: same buffers and params as megatron-core's layout, every
    Muon matrix in one shard, padding within the 2 % goal."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        from megatron_muon.config import MuonConfig
        from megatron_muon.megatron.catalogue import is_muon_matrix
        from megatron_muon.megatron.layout import balanced_buffer_layouts
        from scripts.bench.planner_quality import default_bucket_size, llama3_spec, meta_params, stage_of

    named = meta_params(stage_of(llama3_spec("8B"), 8))
    params = [p for _, p in named]
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    ours = balanced_buffer_layouts(named, default_bucket_size(8), 8, ddp, muon_config=MuonConfig(), tp_size=8)
    theirs = DistributedOptimizer.compute_full_param_layout(params, default_bucket_size(8), 8, ddp)
    assert ours.keys() == theirs.layouts.keys()
    for key, (layout, full) in ours.items():
        assert full.param_index_map.keys() == theirs.layouts[key].param_index_map.keys()
        assert full.param_indices == theirs.layouts[key].param_indices and full.num_optimizer_shards == 8
        group = list(full.param_index_map)
        for k, p in enumerate(group):
            if is_muon_matrix(p):
                assert layout.holder(k) is not None
        assert layout.padding_fraction <= 0.02


def test_a_bucket_that_cannot_share_its_matrices_is_packed_instead():
    """Fewer matrices than DP shards (a pipeline stage of a large model at DP64): whole-matrix
    shards would pad most of the bucket, so it is packed as megatron-core packs it (matrices may
    be cut, the buffer does not grow)."""
    items = [LayoutItem(1 << 20, 1.0, True) for _ in range(6)] + [LayoutItem(4096)]
    layout = balanced_layout(items, 8, None, alpha=0.1)
    _check_invariants_packed(items, layout, 8)
    assert layout.padding_fraction < 0.01
    assert any(layout.holder(i) is None for i in range(6))  # some matrix is cut: it will travel


def _check_invariants_packed(items, layout, dp):
    cursor = 0
    for start, end in layout.buckets:
        assert start == cursor and (end - start) % (dp * PARAM_ALIGN) == 0
        cursor = end
    for i, (s, e, _) in enumerate(layout.ranges):
        assert e - s == items[i].numel and s % PARAM_ALIGN == 0


def _row_cuts(items, layout, dp):
    """(cuts of whole items by shard boundaries, how many of them fall between two rows)."""
    cuts = between = 0
    for i, item in enumerate(items):
        if not item.whole:
            continue
        s, e, b = layout.ranges[i]
        start, end = layout.buckets[b]
        shard = (end - start) // dp
        for boundary in range(start + shard, end, shard):
            if s < boundary < e:
                cuts += 1
                between += (boundary - s) % item.row == 0
    return cuts, between


def test_the_packed_fallback_cuts_matrices_between_rows():
    """A Llama-3-405B stage at TP8 x PP16 (7 layers: qkv 2560 x 16384, proj 16384 x 2048, fc1
    13312 x 16384, fc2 16384 x 6656) over DP64 cannot keep its matrices whole; the fallback packs
    it as megatron-core does but every boundary inside a matrix falls between two of its rows (so
    a DP rank holds whole rows: the MuonBP local block is the paper's), for under 1 % padding. The
    same sizes without rows are cut mid-row."""
    def stage(rows: bool):
        items = [LayoutItem(128256 * 16384 // 8)]  # the embedding's TP shard
        for _ in range(7):
            for r, c in ((2560, 16384), (16384, 2048), (13312, 16384), (16384, 6656)):
                items.append(LayoutItem(r * c, float(r * c), whole=True, row=c if rows else 0))
            items.append(LayoutItem(16384))
        return items

    items, dp = stage(rows=True), 64
    layout = balanced_layout(items, dp, 64_000_000)
    _check_invariants_packed(items, layout, dp)
    cuts, between = _row_cuts(items, layout, dp)
    assert cuts > 0 and between == cuts
    assert layout.padding_fraction < 0.01  # measured 0.42 % at DP64
    plain = balanced_layout(stage(rows=False), dp, 64_000_000)
    cuts, between = _row_cuts(items, plain, dp)
    assert cuts > 0 and between < cuts


@pytest.mark.parametrize("seed", range(20))
def test_row_alignment_keeps_the_packed_invariants(seed):
    """Random fallback buckets (rows not multiples of 64 included): still 64-aligned, in bucket,
    no overlap; each cut matrix whose rows divide the shard size is cut between rows only."""
    rng = random.Random(seed)
    dp = rng.choice([4, 8, 16])
    items = [LayoutItem(rng.randint(1, 5000))]
    for _ in range(rng.randint(1, 4)):
        row = rng.choice([64, 96, 100, 128, 10, 384])
        items.append(LayoutItem(row * rng.randint(50, 400), 1.0, whole=True, row=row))
    layout = balanced_layout(items, dp, None, alpha=0.1)
    _check_invariants_packed(items, layout, dp)
    spans = sorted((s, e) for s, e, _ in layout.ranges)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    shard = (layout.buckets[0][1] - layout.buckets[0][0]) // dp
    for i, item in enumerate(items):
        if item.whole and shard % item.row == 0 and layout.holder(i) is None:
            s, e, _ = layout.ranges[i]
            assert all((b - s) % item.row == 0 for b in range(shard, e, shard) if s < b), (seed, i)
