"""The update in sight: what ``--muon-log-stats`` reports per matrix class, as pure functions.

Three figures per class of matrix (``CLASSES``), all of the update *before* the learning rate,
``scale·O`` with ``O = NS(M)`` (so they read against AdamW's update RMS, about 0.2 to 0.4, which
recipes match; the applied update is ``lr`` times this):

* **update RMS**: ``sqrt(Σ (scale·O)² / n)`` over every element of the class's matrices;
* **matched RMS**: the same for an exactly orthogonal ``O`` (every singular value 1), i.e. what
  the configured ``--muon-scale-mode`` and ``--muon-extra-scale-factor`` aim at. An orthogonal
  m × n matrix has ``min(m, n)`` unit singular values, so ``‖O‖²_F = min(m, n)`` and its mean
  square per element is ``scale² · min(m, n) / (m·n) = scale² / max(m, n)`` (``matched_mean_square``).
  Spectral scaling (``scale = f·sqrt(max(m, n))``, Moonlight's match with f = 0.2, arXiv
  2502.16982 §2.2) gives ``f`` for every shape; shape_scaling gives ``1/sqrt(n)`` (n = fan-in);
  unit_rms_norm ``sqrt(min(m, n)) / n``. Update RMS over matched RMS is the RMS of NS's singular
  values, below 1 for the quintic coefficients (they leave σ in about [0.7, 1.1]);
* **orthogonality residual**: ``‖XᵀX − I_k‖_F / sqrt(k)`` of the NS output X, the Gram over the
  short side (k = min(m, n)): the RMS over X's singular values of ``σ² − 1`` (0 when X is
  orthogonal; ``orthogonality_residual``), on a fixed sample of matrices (``sample_weights``).

Pure: plain tensors and names, no process group, no Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .scaling import muon_scale

__all__ = ["CLASSES", "FIELDS", "class_figures", "matched_mean_square", "matrix_class", "orthogonality_residual",
           "residual_from_gram", "sample_weights", "unsplit_gram"]

CLASSES = ("attention", "attention_head", "mlp", "expert", "mamba", "other")
"""The matrix classes, in the order of the stats table's rows (the same on every rank: the table
is all-reduced as one tensor). ``attention_head`` is the class of the attention weights
orthogonalized head by head (``--muon-split-qkv-per-head``: ``MatrixLayout.per_head``, passed as
``matrix_class(..., per_head=True)``); a new class is appended here and returned by
``matrix_class``, nothing else changes."""

FIELDS = ("update_sq", "matched_sq", "elements", "residual_sum", "residual_count")
"""The stats table's columns, per class: Σ(scale·O)², Σ of the matched mean square over the same
elements, their count, the sum of the sampled matrices' residuals, and how many were sampled."""


def matrix_class(name: str, *, per_head: bool = False) -> str:
    """The class of a Muon matrix from its parameter name (Megatron's module path).

    ``experts`` (a routed expert, not ``shared_experts``) → expert; an attention module
    (``self_attention``, ``cross_attention``, ``attention``) → attention, or ``attention_head``
    with ``per_head`` (the weight's sub-matrices are its heads: ``MatrixLayout.per_head``); a Mamba ``mixer`` →
    mamba; ``mlp`` or ``shared_experts`` → mlp; anything else → other.
    """
    parts = name.split(".")
    if "experts" in parts:
        return "expert"
    if any(p in ("self_attention", "cross_attention", "attention") for p in parts):
        return "attention_head" if per_head else "attention"
    if "mixer" in parts:
        return "mamba"
    if "mlp" in parts or "shared_experts" in parts:
        return "mlp"
    return "other"


def matched_mean_square(rows: int, cols: int, scale_mode: str = "spectral", extra_scale_factor: float = 1.0) -> float:
    """Mean square per element of ``scale·O`` for an exactly orthogonal rows × cols ``O``:
    ``scale² · min(rows, cols) / (rows·cols)`` with the configured scale (``muon_scale``); 0 for
    an empty matrix."""
    if not rows or not cols:
        return 0.0
    scale = muon_scale(rows, cols, scale_mode, extra_scale_factor)
    return scale * scale * min(rows, cols) / (rows * cols)


def orthogonality_residual(x: torch.Tensor) -> torch.Tensor:
    """``‖XᵀX − I_k‖_F / sqrt(k)`` of a 2-D ``x`` (k = min(rows, cols), the Gram over the short
    side), as an fp32 0-d tensor on ``x``'s device (no host read). The Gram is formed in fp32
    whatever ``x``'s dtype. An empty matrix gives 0."""
    rows, cols = x.shape
    x = x.to(torch.float32)
    return residual_from_gram(x.mT @ x if rows >= cols else x @ x.mT)


def unsplit_gram(shard: torch.Tensor, partition_dim: int) -> torch.Tensor:
    """One TP shard's part of the Gram over the dimension TP does not split (fp32): ``XᵀX``
    (cols × cols) for a row shard (``partition_dim`` 0), ``XXᵀ`` (rows × rows) for a column shard.
    Summed over the TP ranks it is the whole matrix's Gram over that side."""
    x = shard.to(torch.float32)
    return x.mT @ x if partition_dim == 0 else x @ x.mT


def residual_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """``‖G − I_k‖_F / sqrt(k)`` of a k × k Gram over a matrix's short side (``XᵀX`` of a tall X,
    ``XXᵀ`` of a wide one), an fp32 0-d tensor: the RMS of ``σ² − 1`` over X's k singular values.
    (The Gram over the long side would add one per zero eigenvalue: never pass it.)"""
    k = gram.shape[0]
    if k == 0:
        return torch.zeros((), dtype=torch.float32, device=gram.device)
    eye = torch.eye(k, dtype=torch.float32, device=gram.device)
    return torch.linalg.matrix_norm(gram.to(torch.float32) - eye) / math.sqrt(k)


def sample_weights(classes: Sequence[str], per_class: int = 2) -> tuple[int, ...]:
    """The weights whose residual is measured: per class, the first and the last (and, with
    ``per_class`` > 2, evenly spaced ones between) in the given order, so the sample spans the
    stage's depth. A function of ``classes`` alone: the same weights on every rank and step."""
    chosen: set[int] = set()
    for cls in dict.fromkeys(classes):
        members = [i for i, c in enumerate(classes) if c == cls]
        n = min(per_class, len(members))
        if n == 1:
            chosen.add(members[0])
            continue
        chosen.update(members[round(j * (len(members) - 1) / (n - 1))] for j in range(n))
    return tuple(sorted(chosen))


def class_figures(table: Sequence[Sequence[float]]) -> dict[str, dict[str, float]]:
    """Per class with elements, from a reduced stats table (``CLASSES`` rows × ``FIELDS``
    columns): ``update_rms``, ``matched_rms`` and, where a matrix was sampled, ``residual``
    (the mean over the sampled matrices). Classes without elements are left out."""
    out: dict[str, dict[str, float]] = {}
    for cls, (update_sq, matched_sq, n, residual_sum, residual_count) in zip(CLASSES, table):
        if n <= 0:
            continue
        figures = {"update_rms": math.sqrt(max(update_sq, 0.0) / n), "matched_rms": math.sqrt(max(matched_sq, 0.0) / n)}
        if residual_count > 0:
            figures["residual"] = residual_sum / residual_count
        out[cls] = figures
    return out
