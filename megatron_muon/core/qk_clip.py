"""QK-clip ("MuonClip", Kimi K2 technical report, arXiv 2507.20534, §2.1): the math, on plain tensors.

After an optimizer step, an attention head whose largest pre-softmax logit ``m = max q·k / √d``
(over the step's tokens, unmasked positions only) exceeded the threshold ``τ`` has its query and
key projections scaled so that the same logit would be ``τ``: ``η = τ / m``, query rows × ``η^α``,
key rows × ``η^(1−α)`` (``α = 0.5`` is Kimi K2's ``√η`` on both). Heads at or under ``τ`` are
untouched (``η = 1``; × 1.0 is exact, so they stay bitwise the same). Value rows are never touched.

**GQA** (megatron-core 0.19.2's rule, ``Attention.clip_qk``): a query group's key rows are shared
by all of its query heads, so η is taken per *query group*, from the largest ``m`` of the group's
heads, and every query head of the group is scaled by the same ``η^α``. Every head of the group
then has its logit bound by ``τ``; a head under ``τ`` in a group with a head over it is scaled too.
The Kimi K2 report describes per-head factors for MHA/MLA (and leaves MLA's shared rotary key
alone), which for MHA (one head per group) is the same rule.

The fused QKV weight, as Megatron lays it out on one TP rank (``SelfAttention.linear_qkv``,
``groups`` query groups of this rank, ``d`` = head dim, ``heads / groups`` query heads per group)::

    rows = groups × (q_rows + 2·kv_rows),   q_rows = heads / groups · d,   kv_rows = d
    per group g: [q rows of its heads (q_rows) | k rows (kv_rows) | v rows (kv_rows)]

The scale is a per-row vector (``qkv_row_scale``), applied either to the whole TP-local matrix
(``scale_rows_``) or to a flat range of it (``scale_rows_flat_``): the distributed optimizer's
fp32 shard holds elements ``[start, end)`` of the row-major flattened matrix, which may begin and
end mid-row. Both multiply each element by its row's fp32 factor, so they agree bitwise.

Nothing here imports Megatron; devices and dtypes come from the inputs.
"""

from __future__ import annotations

import torch

__all__ = ["group_eta", "qkv_row_scale", "scale_rows_", "scale_rows_flat_"]


def group_eta(max_logits: torch.Tensor, groups: int, threshold: float) -> torch.Tensor:
    """Per query group, ``η = τ / m_g`` where ``m_g`` is the largest max logit of its heads, and 1
    where ``m_g ≤ τ`` (or is NaN: nothing is clipped on a value that says nothing).

    ``max_logits``: ``[heads]`` (any float dtype), head ``h`` in group ``h // (heads // groups)`` —
    Megatron's order within a TP rank. Returns fp32 ``[groups]``, each in ``(0, 1]``.
    """
    if max_logits.dim() != 1 or max_logits.numel() % groups:
        raise ValueError(f"qk-clip: max logits of shape {tuple(max_logits.shape)} do not split into {groups} "
                         "query groups")
    if not threshold > 0:
        raise ValueError(f"qk-clip: threshold must be > 0, got {threshold}")
    m = max_logits.float().view(groups, -1).amax(dim=1)
    # where() selects, so τ / m of a group under τ (possibly 0 or negative) is computed but never used
    return torch.where(m > threshold, threshold / m, torch.ones_like(m))


def qkv_row_scale(eta: torch.Tensor, alpha: float, q_rows: int, kv_rows: int) -> torch.Tensor:
    """The per-row factor of a fused QKV weight: fp32 ``[groups · (q_rows + 2·kv_rows)]``.

    Group ``g``'s ``q_rows`` query rows get ``η_g^α``, its ``kv_rows`` key rows ``η_g^(1−α)``, its
    value rows 1. ``alpha`` in (0, 1) (``--qk-clip-alpha``).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk-clip: alpha must be in (0, 1), got {alpha}")
    eta = eta.float()
    groups = eta.numel()
    q = torch.pow(eta, alpha)[:, None].expand(groups, q_rows)
    k = torch.pow(eta, 1.0 - alpha)[:, None].expand(groups, kv_rows)
    v = torch.ones_like(eta)[:, None].expand(groups, kv_rows)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def scale_rows_(matrix: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """``matrix[r, :] *= row_scale[r]`` in place; ``matrix`` ``[rows, cols]``, ``row_scale`` ``[rows]``."""
    if matrix.dim() != 2 or row_scale.shape != (matrix.shape[0],):
        raise ValueError(f"qk-clip: row scale of shape {tuple(row_scale.shape)} does not fit a matrix of shape "
                         f"{tuple(matrix.shape)}")
    return matrix.mul_(row_scale[:, None])


def scale_rows_flat_(flat: torch.Tensor, start: int, row_scale: torch.Tensor, cols: int) -> torch.Tensor:
    """The same as ``scale_rows_`` on the piece of a matrix that ``flat`` holds, in place.

    ``flat``: 1-D, elements ``[start, start + flat.numel())`` of a row-major ``[rows, cols]`` matrix
    (rows = ``row_scale.numel()``); it may start and end mid-row, or hold nothing. Applied as at most
    three views — the partial first row, the whole rows, the partial last row — so nothing the size
    of the shard is allocated.
    """
    n = flat.numel()
    if flat.dim() != 1 or start < 0 or start + n > row_scale.numel() * cols:
        raise ValueError(f"qk-clip: a flat range [{start}, {start + n}) of shape {tuple(flat.shape)} does not fit a "
                         f"matrix of {row_scale.numel()} rows x {cols} columns")
    pos = 0
    if start % cols and n:  # the first row is cut: its tail (or a piece of its middle)
        pos = min(n, cols - start % cols)
        flat[:pos].mul_(row_scale[start // cols])
    whole = (n - pos) // cols
    if whole:
        row = (start + pos) // cols
        flat[pos:pos + whole * cols].view(whole, cols).mul_(row_scale[row:row + whole, None])
        pos += whole * cols
    if pos < n:  # the last row is cut: its head
        flat[pos:].mul_(row_scale[(start + pos) // cols])
    return flat
