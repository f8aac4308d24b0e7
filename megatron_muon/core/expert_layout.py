"""Grouped MoE expert weights → one matrix per expert, on plain tensors.

Muon orthogonalizes each expert's matrices on its own (issue 14): fc1 as gate and up (SwiGLU),
fc2 whole. Never the experts' weights fused into one tensor as one matrix: NS of a stack is not
the stack of each expert's NS (the stack's singular vectors mix the experts).

Megatron holds a rank's local experts in three ways:

* ``SequentialMLP``: an ``MLP`` per expert, ``linear_fc1.weight`` / ``linear_fc2.weight`` each 2-D
  (``[out, in]``, as a Linear). Nothing to map; fc1 is split into gate and up as for dense.
* ``TEGroupedMLP`` (``--moe-grouped-gemm`` with Transformer Engine): ``weight0 .. weight{E-1}``,
  each a 2-D ``[out, in]`` matrix of one expert (TE's ``GroupedLinear``). Nothing to map either,
  but Megatron marks them ``partition_stride`` 1 even for a gated fc1 (whose per-TP-rank rows are
  ``[gate_r; up_r]``, as the dense fc1's): the split must come from the module, not the stride.
* one tensor for every local expert: TE >= 2.14's single grouped weight
  (``moe_single_grouped_weight``; ``[E, out, in]`` or ``[E * out, in]``), and the legacy
  ``GroupedMLP`` of older megatron-core (``weight1 [in, E * ffn]`` and ``weight2 [E * ffn, out]``:
  experts along columns of fc1, rows of fc2, each transposed relative to a Linear).

``expert_matrices`` maps any of these tensors to the per-expert matrices in Linear orientation
(``[out, in]``: the shape Muon's scale uses), ``join_expert_matrices`` is its inverse, and
``expert_row_split`` gives the ``RowSplit`` with which a ``MatrixLayout`` orthogonalizes a
rows-stacked tensor expert by expert (and gate/up by gate/up). Transposed orientations
(``layout="columns"``) have no ``MatrixLayout`` form yet: NS commutes with transposition, but
the DP ranges of a column block are not contiguous, so the Megatron adapter refuses them.
"""

from __future__ import annotations

import torch

from .matrix_layout import RowSplit

__all__ = ["EXPERT_STACKINGS", "expert_matrices", "expert_row_split", "join_expert_matrices"]

EXPERT_STACKINGS = ("batch", "rows", "columns")
"""How the experts are stacked in one tensor: ``batch`` ``[E, out, in]``; ``rows``
``[E * out, in]`` (expert e's rows e*out .. (e+1)*out); ``columns`` ``[in, E * out]``
(legacy GroupedMLP's fc1: expert e's matrix is the transpose of columns e*out .. (e+1)*out)."""


def _check(weight: torch.Tensor, num_experts: int, stacking: str) -> int:
    """The size of one expert's block along the stacked dimension."""
    if stacking not in EXPERT_STACKINGS:
        raise ValueError(f"expert stacking must be one of {EXPERT_STACKINGS}, got {stacking!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    want = 3 if stacking == "batch" else 2
    if weight.dim() != want:
        raise ValueError(f"expert stacking {stacking!r} takes a {want}-D tensor, got shape {tuple(weight.shape)}")
    dim = {"batch": 0, "rows": 0, "columns": 1}[stacking]
    size = weight.shape[dim]
    if stacking == "batch":
        if size != num_experts:
            raise ValueError(f"shape {tuple(weight.shape)}: {num_experts} experts expected along dimension 0")
        return 1
    if size % num_experts:
        raise ValueError(f"shape {tuple(weight.shape)}: dimension {dim} ({size}) is not a multiple of "
                         f"{num_experts} experts")
    return size // num_experts


def expert_matrices(weight: torch.Tensor, num_experts: int, stacking: str, *, gated: bool = False
                    ) -> list[torch.Tensor]:
    """Every expert's matrices in Linear orientation ``[out, in]``, expert by expert; with
    ``gated`` (a SwiGLU fc1 ``[gate; up]`` per expert) gate then up of each expert, so
    ``2 * num_experts`` matrices. Views of ``weight`` where the layout allows (not ``columns``,
    whose matrices are transposed views)."""
    block = _check(weight, num_experts, stacking)
    if stacking == "batch":
        per_expert = list(weight.unbind(0))
    elif stacking == "rows":
        per_expert = list(weight.split(block, dim=0))
    else:
        per_expert = [b.t() for b in weight.split(block, dim=1)]
    if not gated:
        return per_expert
    out = []
    for e, m in enumerate(per_expert):
        if m.shape[0] % 2:
            raise ValueError(f"expert {e}: a gated fc1 needs an even number of rows, got shape {tuple(m.shape)}")
        out += list(m.split(m.shape[0] // 2, dim=0))
    return out


def join_expert_matrices(matrices: list[torch.Tensor], num_experts: int, stacking: str, *, gated: bool = False
                         ) -> torch.Tensor:
    """The inverse of ``expert_matrices``: one tensor stacked as ``stacking``."""
    if gated:
        if len(matrices) != 2 * num_experts:
            raise ValueError(f"{len(matrices)} matrices for {num_experts} gated experts (expected gate and up each)")
        matrices = [torch.cat(matrices[2 * e:2 * e + 2], dim=0) for e in range(num_experts)]
    if len(matrices) != num_experts:
        raise ValueError(f"{len(matrices)} matrices for {num_experts} experts")
    if stacking == "batch":
        return torch.stack(matrices, dim=0)
    if stacking == "rows":
        return torch.cat(matrices, dim=0)
    if stacking == "columns":
        return torch.cat([m.t() for m in matrices], dim=1)
    raise ValueError(f"expert stacking must be one of {EXPERT_STACKINGS}, got {stacking!r}")


def expert_row_split(rows: int, num_experts: int, *, gated: bool = False) -> RowSplit:
    """The ``RowSplit`` that orthogonalizes a rows-stacked ``[E * out, in]`` tensor expert by expert
    (gate and up apart with ``gated``): ``groups`` 1 and one size per sub-matrix, so no two
    experts share a matrix. (A ``groups`` > 1 split would join the same slot of every expert
    into one matrix — right for QKV's query groups, wrong for experts.) Under TP, ``rows`` is the
    TP-local count: each TP rank holds the same rows of every expert."""
    if num_experts < 1 or rows % num_experts:
        raise ValueError(f"{rows} rows are not a multiple of {num_experts} experts")
    per = rows // num_experts
    if gated and per % 2:
        raise ValueError(f"a gated expert's {per} rows cannot be split into gate and up")
    sizes = (per // 2, per // 2) if gated else (per,)
    return RowSplit(1, sizes * num_experts)
