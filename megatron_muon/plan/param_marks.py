"""The layout of one Muon matrix from the marks megatron-core puts on its parameter.

A Megatron parameter says how TP cut it and what it fuses through attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``partition_sizes``, and the
catalogue's ``is_qkv`` / ``qkv_split_shapes`` / ``gated_fc1`` tags). ``ParamMarks`` is those
attributes as one value, and ``matrix_layout`` turns a TP-local shape and its marks into the
``MatrixLayout`` the optimizer plans with. Both roads into a plan call it: the Megatron adapter
(``megatron.catalogue.layout_of``, reading a real parameter's attributes) and the planning road
from a model's shape (``plan.stage_params``), so the two cannot describe a matrix differently.
Pure: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.matrix_layout import MatrixLayout, RowSplit

__all__ = ["DEFAULT_SPLITS", "ParamMarks", "RowSplits", "matrix_layout"]


@dataclass(frozen=True)
class ParamMarks:
    """What a parameter's attributes say about its TP cut and its fused rows."""

    tensor_parallel: bool = False
    """``tensor_model_parallel``: TP cut the weight (else every TP rank holds it whole)."""
    partition_dim: int = -1
    """``partition_dim``: the dim TP cut (0 ColumnParallel, 1 RowParallel; -1 none)."""
    qkv_split: tuple[int, ...] | None = None
    """``qkv_split_shapes`` of a fused QKV (``is_qkv``): rows of q, k and v per query group."""
    gated: bool = False
    """a gated fc1 holding ``[gate; up]`` on every TP rank (``partition_stride`` 2, or the
    catalogue's ``gated_fc1`` on Transformer Engine's grouped experts)."""
    partition_sizes: tuple[int, ...] | None = None
    """``partition_sizes`` of a Mamba ``in_proj``: this TP rank's rows of z, x, B, C and dt."""
    embedding_or_output: bool = False
    """``is_embedding_or_output_parameter``: routed to AdamW whatever its shape."""


@dataclass(frozen=True)
class RowSplits:
    """Which fused weights Newton–Schulz runs on as their parts (``--muon-split-qkv`` and its
    siblings; ``MuonConfig.split_qkv``, ``split_fc1``, ``mamba_in_proj == "split"``)."""

    qkv: bool = True
    fc1: bool = True
    in_proj: bool = True


DEFAULT_SPLITS = RowSplits()
"""``MuonConfig``'s defaults: QKV, a gated fc1 and a Mamba in_proj split into their parts."""


def matrix_layout(name: str, local_shape: tuple[int, int], marks: ParamMarks, tp_size: int, splits: RowSplits,
                  dp_ranges: tuple[tuple[int, int], ...] | None = None) -> MatrixLayout:
    """The ``MatrixLayout`` of a Muon matrix of TP-local ``local_shape`` (rows, cols) with ``marks``
    on a TP group of ``tp_size``; ``dp_ranges``: every DP rank's flat range of it (None: whole on
    every DP rank). Raises ``ValueError`` naming the parameter when its marks do not describe its
    rows."""
    rows, cols = local_shape
    tensor_parallel = marks.tensor_parallel and tp_size > 1
    partition_dim = marks.partition_dim if tensor_parallel else None
    split = None
    if splits.qkv and marks.qkv_split is not None:
        sizes = tuple(marks.qkv_split)
        if rows % sum(sizes):
            raise ValueError(f"{name}: QKV rows {rows} are not a multiple of the query-group size {sum(sizes)}")
        split = RowSplit(rows // sum(sizes), sizes)
    elif splits.fc1 and marks.gated and partition_dim in (0, None):
        split = RowSplit(1, (rows // 2, rows // 2))  # a gated fc1 holds [gate; up] on every TP rank
    elif splits.in_proj and marks.partition_sizes is not None:
        # A Mamba in_proj: megatron-core shards each of z, x, B, C, dt over TP on its own and marks
        # this rank's rows per role (``partition_sizes``), so role k's whole matrix is the TP ranks'
        # k-th blocks in rank order, as for fc1's gate and up.
        sizes = tuple(int(n) for n in marks.partition_sizes)
        if sum(sizes) != rows or partition_dim not in (0, None):
            raise ValueError(f"{name}: partition_sizes {list(sizes)} do not describe its {rows} local rows")
        split = RowSplit(1, sizes)
    return MatrixLayout(name, (rows, cols), partition_dim if partition_dim in (0, 1) else None, tp_size, split,
                        dp_ranges)
