"""``core.update_stats`` (the per-class figures of ``--muon-log-stats``) and the fixed part of
``parallel.step_stats``' table, against direct float64 computations."""

from __future__ import annotations

import math

import pytest
import torch
from rounding_bounds import sum_bound, unit_roundoff

from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale
from megatron_muon.core.update_stats import (
    CLASSES,
    FIELDS,
    class_figures,
    matched_mean_square,
    matrix_class,
    orthogonality_residual,
    residual_from_gram,
    sample_weights,
    unsplit_gram,
)
from megatron_muon.parallel.step_stats import ClassStats

SHAPES = [(96, 40), (40, 96), (64, 64), (1, 7)]
MODES = [("spectral", 0.2), ("spectral", 1.0), ("shape_scaling", 1.0), ("unit_rms_norm", 0.5)]


def _orthogonal(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """An exactly (to float64) orthogonal rows x cols matrix: Q of a Gaussian's QR."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(max(rows, cols), min(rows, cols), generator=g, dtype=torch.float64))
    return q if rows >= cols else q.mT


@pytest.mark.parametrize("mode, extra", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matched_mean_square_is_an_orthogonal_updates(shape, mode, extra):
    rows, cols = shape
    scaled = muon_scale(rows, cols, mode, extra) * _orthogonal(rows, cols)
    direct = float(scaled.square().mean())
    # float64: QR's Q is orthogonal to ~n·u64, and the mean sums rows·cols squares: 1e-12 relative
    # is a thousand times the sum's bound at these sizes
    assert matched_mean_square(rows, cols, mode, extra) == pytest.approx(direct, rel=1e-12)


def test_matched_mean_square_per_mode():
    """The closed forms the flags doc quotes: spectral f², shape_scaling 1/cols, unit_rms_norm min/cols²."""
    for rows, cols in SHAPES:
        assert matched_mean_square(rows, cols, "spectral", 0.2) == pytest.approx(0.04, rel=1e-15)
        assert matched_mean_square(rows, cols, "shape_scaling") == pytest.approx(1 / cols, rel=1e-15)
        assert matched_mean_square(rows, cols, "unit_rms_norm") == pytest.approx(min(rows, cols) / cols ** 2, rel=1e-15)
    assert matched_mean_square(0, 5) == 0.0


def _direct_residual(x: torch.Tensor) -> float:
    """float64 RMS of σ² − 1 over the singular values: what ‖XᵀX − I‖_F / √k equals."""
    s = torch.linalg.svdvals(x.double())
    return float((s.square() - 1).square().mean().sqrt())


@pytest.mark.parametrize("shape", SHAPES)
def test_orthogonality_residual(shape):
    rows, cols = shape
    k, length = min(rows, cols), max(rows, cols)
    g = torch.Generator().manual_seed(1)
    # near-orthogonal, as NS leaves it: singular values spread over [0.7, 1.1]
    q = _orthogonal(rows, cols)
    spread = torch.linspace(0.7, 1.1, k, dtype=torch.float64)
    x = (q * spread if rows >= cols else spread[:, None] * q) + 1e-3 * torch.randn(rows, cols, generator=g,
                                                                                     dtype=torch.float64)
    got = float(orthogonality_residual(x.float()))
    # the fp32 Gram's entries are sums of `length` products below 1.2² in magnitude, each off by at
    # most sum_bound (one rounding path against the exact sum) plus the input's own rounding
    # (2u relative per product); the Frobenius norm of k² such errors over √k: √k times one entry's
    entry = sum_bound(torch.float32, length, 1.44, roundings=1) + 2 * unit_roundoff(torch.float32) * 1.44
    assert got == pytest.approx(_direct_residual(x), abs=math.sqrt(k) * entry)
    assert float(orthogonality_residual(q.float())) < math.sqrt(k) * entry  # orthogonal: 0 to rounding
    assert orthogonality_residual(x.float()).dtype == torch.float32 and orthogonality_residual(x.float()).ndim == 0


def test_residual_of_an_empty_matrix_is_zero():
    assert float(orthogonality_residual(torch.zeros(0, 5))) == 0.0


@pytest.mark.parametrize("partition_dim", [0, 1])
def test_unsplit_grams_summed_over_shards_are_the_whole_matrix_gram(partition_dim):
    """A TP group's shards' Grams over the unsplit side, summed (the all-reduce), give the whole
    matrix's residual when that side is the short one."""
    g = torch.Generator().manual_seed(2)
    rows, cols = (96, 24) if partition_dim == 0 else (24, 96)
    x = torch.randn(rows, cols, generator=g) / math.sqrt(max(rows, cols))
    gram = sum(unsplit_gram(s, partition_dim) for s in x.chunk(4, dim=partition_dim))
    assert gram.shape == (min(rows, cols),) * 2
    # the same products in another summation order (4 partial sums, then 4 terms), fp32: two
    # roundings of a 96-term sum of magnitude below 3 per entry, √k entries' worth in the norm
    bound = math.sqrt(24) * sum_bound(torch.float32, 96, 3.0)
    assert float(residual_from_gram(gram)) == pytest.approx(float(orthogonality_residual(x)), abs=bound)


@pytest.mark.parametrize("name, cls", [
    ("chunk0.module.decoder.layers.0.self_attention.linear_qkv.weight", "attention"),
    ("chunk0.module.decoder.layers.3.self_attention.linear_proj.weight", "attention"),
    ("chunk0.module.decoder.layers.1.mlp.linear_fc1.weight", "mlp"),
    ("chunk0.module.decoder.layers.1.mlp.shared_experts.linear_fc2.weight", "mlp"),
    ("chunk0.module.decoder.layers.1.mlp.experts.linear_fc1.weight3", "expert"),
    ("chunk0.module.decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", "expert"),
    ("chunk0.module.decoder.layers.2.mixer.in_proj.weight", "mamba"),
    ("param 0", "other"),
])
def test_matrix_class(name, cls):
    assert matrix_class(name) == cls
    assert matrix_class(name, per_head=True) == ("attention_head" if cls == "attention" else cls)
    assert cls in CLASSES


def test_sample_is_first_and_last_of_each_class():
    classes = ["attention", "attention", "mlp", "mlp", "attention", "mlp", "attention", "expert"]
    assert sample_weights(classes) == (0, 2, 5, 6, 7)
    # three per class: attention's members 0, 1, 4, 6 give the first, the middle (4) and the last
    assert sample_weights(classes, per_class=3) == (0, 2, 3, 4, 5, 6, 7)
    assert sample_weights(classes) == sample_weights(list(classes))  # a function of the classes alone


def test_class_figures():
    table = [[0.0] * len(FIELDS) for _ in CLASSES]
    table[CLASSES.index("mlp")] = [0.04 * 0.81 * 100, 0.04 * 100, 100, 0.3, 2]
    table[CLASSES.index("expert")] = [0.09 * 10, 0.04 * 10, 10, 0.0, 0]
    figures = class_figures(table)
    assert set(figures) == {"mlp", "expert"}  # classes without elements are left out
    assert figures["mlp"] == pytest.approx({"update_rms": 0.18, "matched_rms": 0.2, "residual": 0.15}, rel=1e-14)
    assert figures["expert"] == pytest.approx({"update_rms": 0.3, "matched_rms": 0.2}, rel=1e-14)  # none sampled


def test_fixed_part_counts_each_rows_sub_matrix():
    """A fused QKV (2 query groups of q 4, k 2, v 2 rows on this TP rank, unit_rms_norm: the
    sub-matrices' matched mean squares differ) whose DP ranges cut rows: the matched sum over each
    DP rank's range equals the element-by-element float64 sum."""
    split = RowSplit(groups=2, sizes=(4, 2, 2))
    ranges = ((0, 37), (37, 100), (100, 128))
    layout = MatrixLayout("decoder.layers.0.self_attention.linear_qkv.weight", (16, 8), 0, 2, split, ranges)
    per_sub = [matched_mean_square(r, c, "unit_rms_norm", 0.5) for r, c in layout.sub_global_shapes()]
    assert len(set(per_sub)) == 2  # q (8 x 8 global) against k and v (4 x 8)
    row_value = layout.row_values(per_sub, torch.get_default_device()).double()
    row = CLASSES.index("attention")
    for dp_rank, (start, end) in enumerate(ranges):
        stats = ClassStats([layout], [True], dp_rank, "unit_rms_norm", 0.5, torch.get_default_device())
        direct = sum(float(row_value[idx // 8]) for idx in range(start, end))
        table = stats.start().table
        # the table is fp32 (one rounding of a float64 sum)
        assert float(table[row, 1]) == pytest.approx(direct, rel=unit_roundoff(torch.float32))
        assert float(table[row, 2]) == end - start
        assert float(table[:, 0].abs().sum()) == float(table[:, 3:].abs().sum()) == 0.0  # filled by the step
    # a piece this rank does not count adds nothing
    assert float(ClassStats([layout], [False], 0, "spectral", 1.0, torch.get_default_device()).start().table.abs()
                 .sum()) == 0.0


@pytest.mark.parametrize("tp", [1, 2])
def test_per_head_weights_are_their_own_class(tp):
    """``--muon-split-qkv-per-head``: a QKV split into its heads (MHA, 4 heads of 8 rows) and an MLA
    kv up-projection into each head's k nope (8 rows) and v (4 rows) are ``attention_head``, the
    output projection stays ``attention``; the per-head class's matched sum is the heads' own
    (unit_rms_norm: it differs between a k-nope and a v block), element by element in float64,
    over DP ranges that cut heads."""
    from megatron_muon.plan.param_marks import ParamMarks, RowSplits, matrix_layout

    splits = RowSplits(qkv_per_head=True)
    qkv = matrix_layout("decoder.layers.0.self_attention.linear_qkv.weight", (96 // tp, 8),
                        ParamMarks(True, 0, qkv_split=(8, 8, 8), qkv_heads=(4 // tp, 1, 8)), tp, splits,
                        ((0, 77 // tp), (77 // tp, 768 // tp)))
    kv = matrix_layout("decoder.layers.0.self_attention.linear_kv_up_proj.weight", (48 // tp, 16),
                       ParamMarks(True, 0, mla_heads=(4 // tp, (8, 4))), tp, splits,
                       ((0, 300 // tp), (300 // tp, 768 // tp)))
    proj = matrix_layout("decoder.layers.0.self_attention.linear_proj.weight", (8, 32 // tp),
                         ParamMarks(True, 1), tp, splits, ((0, 256 // tp), (256 // tp, 256 // tp)))
    assert qkv.per_head and kv.per_head and not proj.per_head
    head, row = CLASSES.index("attention_head"), CLASSES.index("attention")
    for dp_rank in (0, 1):
        stats = ClassStats([qkv, kv, proj], [True] * 3, dp_rank, "unit_rms_norm", 0.5, torch.get_default_device())
        assert [CLASSES[c] for c in stats.class_of] == ["attention_head", "attention_head", "attention"]
        direct = elements = 0.0
        for lay in (qkv, kv):
            per_sub = [matched_mean_square(r, c, "unit_rms_norm", 0.5) for r, c in lay.sub_global_shapes()]
            row_value = lay.row_values(per_sub, torch.get_default_device()).double()
            start, end = lay.local_range(dp_rank)
            direct += sum(float(row_value[idx // lay.local_shape[1]]) for idx in range(start, end))
            elements += end - start
        table = stats.start().table
        # fp32 table: one rounding of the float64 sum
        assert float(table[head, 1]) == pytest.approx(direct, rel=unit_roundoff(torch.float32))
        assert float(table[head, 2]) == elements
        start, end = proj.local_range(dp_rank)
        assert float(table[row, 2]) == end - start
