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

__all__ = ["DEFAULT_SPLITS", "ParamMarks", "RowSplits", "matrix_layout", "per_head_split"]


@dataclass(frozen=True)
class ParamMarks:
    """What a parameter's attributes say about its TP cut and its fused rows."""

    tensor_parallel: bool = False
    """``tensor_model_parallel``: TP cut the weight (else every TP rank holds it whole)."""
    partition_dim: int = -1
    """``partition_dim``: the dim TP cut (0 ColumnParallel, 1 RowParallel; -1 none)."""
    qkv_split: tuple[int, ...] | None = None
    """``qkv_split_shapes`` of a fused QKV (``is_qkv``): rows of q, k and v per query group."""
    qkv_heads: tuple[int, int, int] | None = None
    """``qkv_heads`` of a fused QKV (the catalogue's ``tag_qkv``, from the attention module's
    per-partition counts, i.e. after TP sharding): (query groups on this TP rank, query heads per
    group, head dim), what ``--muon-split-qkv-per-head`` splits the local rows by."""
    qkv_groups: int | None = None
    """``qkv_groups`` of a fused QKV (the catalogue's ``tag_qkv``): the model's query groups. With
    fewer than TP ranks megatron-core reports one query group per TP rank (``qkv_heads``), yet
    each rank holds a contiguous 1/TP of the whole weight's interleaved rows, which may cut a head
    (``per_head_split``)."""
    mla_heads: tuple[int, tuple[int, ...]] | None = None
    """``mla_heads`` of an MLA up-projection (the catalogue's ``tag_qkv``: the head count from the
    attention module's per-partition count, i.e. after TP sharding, the widths from the model
    config): (heads on this TP rank, the row blocks of one head), each block its own matrix under
    ``--muon-split-qkv-per-head``: ``(qk_head_dim + qk_pos_emb_head_dim,)`` for the q projection
    (``linear_q_proj`` / ``linear_q_up_proj``), ``(qk_head_dim, v_head_dim)`` for
    ``linear_kv_up_proj`` (docs/per_head.md says why)."""
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
    qkv_per_head: bool = False
    """``--muon-split-qkv-per-head``: a split QKV further into its heads (each query head, and each
    query group's k and v head), and an MLA up-projection into its heads' blocks, every one its
    own matrix."""


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
    split = blocks = None
    per_rank = per_head = False
    if splits.qkv and splits.qkv_per_head and (marks.qkv_split is not None or marks.mla_heads is not None):
        split, blocks = per_head_split(name, rows, marks, tp_size if partition_dim == 0 else 1)
        # a column-parallel QKV or MLA up-projection gives every TP rank whole heads of its own,
        # unless TP's row cut falls inside heads (``blocks``: the whole weight's heads)
        per_rank, per_head = partition_dim == 0 and blocks is None, True
    elif splits.qkv and marks.qkv_split is not None:
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
                        dp_ranges, per_rank=per_rank, per_head=per_head, tp_blocks=blocks)


def per_head_split(name: str, rows: int, marks: ParamMarks, tp_size: int = 1
                   ) -> tuple[RowSplit | None, tuple[int, ...] | None]:
    """The ``RowSplit`` of a TP-local weight's ``rows`` into its heads (``--muon-split-qkv-per-head``),
    one contiguous block per matrix, so each is its own unit, placed and batched apart, and None;
    or, where TP's row cut falls inside heads, None and the whole weight's heads (``tp_blocks``):

    * a fused QKV (``marks.qkv_heads``: query groups on this TP rank, query heads per group, head
      dim): per query group each of its query heads, then its k head and its v head, ``head_dim``
      rows each; the counts must also agree with the per-group split (``marks.qkv_split``);
    * an MLA up-projection (``marks.mla_heads``: heads on this TP rank, one head's row blocks):
      per head its blocks, in megatron-core's order;
    * a fused QKV with fewer query groups (``marks.qkv_groups``) than ``tp_size`` TP ranks: the
      attention module reports one group per rank (``qkv_heads``: 1, the group's query heads,
      head dim), while the rank holds a contiguous 1/TP of the whole weight's ``[q heads; k; v]``
      per group (megatron-core's ``get_query_key_value_tensors``, num_query_groups < world size).
      Its heads are its ``rows / head_dim`` local ones when every rank's cut falls on a head
      boundary, else the whole weight's heads, some cut between TP ranks (``tp_blocks``).

    The counts are taken after TP sharding and must describe the local shard, else ``ValueError``
    naming the weight and the flag (counts taken before TP sharding would cut heads in halves or
    read past the shard: DeepSpeed #8384)."""
    flag = "--muon-split-qkv-per-head"
    if marks.mla_heads is not None:
        heads, blocks = marks.mla_heads
        if heads < 1 or not blocks or min(blocks) < 1 or heads * sum(blocks) != rows:
            raise ValueError(f"{name}: {flag}: {heads} heads x {sum(blocks)} rows (blocks {list(blocks)}) on this TP "
                             f"rank do not describe its {rows} local rows (head counts must be taken after TP "
                             "sharding)")
        return RowSplit(1, tuple(blocks) * heads), None
    if marks.qkv_heads is None:
        raise ValueError(f"{name}: {flag}: the QKV weight carries no per-rank head counts (qkv_heads)")
    groups, per_group, head_dim = marks.qkv_heads
    per_group_split = (per_group * head_dim, head_dim, head_dim)
    if marks.qkv_groups is not None and marks.qkv_groups < tp_size:
        whole = marks.qkv_groups * (per_group + 2)  # the whole weight's heads
        if per_group_split != tuple(marks.qkv_split) or groups != 1 or whole * head_dim != rows * tp_size:
            raise ValueError(f"{name}: {flag}: {groups} query group(s) x ({per_group} query + k + v heads) x head dim "
                             f"{head_dim} on this TP rank, {marks.qkv_groups} query groups over {tp_size} TP ranks, "
                             f"do not describe its {rows} local rows (1/{tp_size} of the weight's; head counts must "
                             "be taken after TP sharding)")
        if rows % head_dim == 0:  # every TP rank's cut on a head boundary: its own whole heads
            return RowSplit(1, (head_dim,) * (rows // head_dim)), None
        return None, (head_dim,) * whole
    if per_group_split != tuple(marks.qkv_split) or groups * (per_group + 2) * head_dim != rows:
        raise ValueError(f"{name}: {flag}: {groups} query groups x ({per_group} query + k + v heads) x head dim "
                         f"{head_dim} on this TP rank do not describe its {rows} local rows split "
                         f"{list(marks.qkv_split)} per query group (head counts must be taken after TP sharding)")
    return RowSplit(1, ((head_dim,) * per_group + (head_dim, head_dim)) * groups), None
