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

**MLA** (multi-latent attention; megatron-core 0.19.2's ``MLASelfAttention.clip_qk``, Kimi K2's
rule with α = 0.5): no GQA, so η is per head (``group_eta`` with one head per group). A head's
logit is ``q_nope·k_nope + q_pe·k_pe``; the rotary key ``k_pe`` is one row block shared by every
head (in ``linear_kv_down_proj``) and is never scaled, so the rotary query takes all of η. Two
weights are scaled, laid out per head on one TP rank (``heads`` of this rank, column-parallel
split by heads)::

    q projection (linear_q_proj, or linear_q_up_proj with q_lora_rank):
        rows = heads × (nope_rows + pe_rows)    per head: [q_nope (nope_rows) | q_pe (pe_rows)]
        q_nope × η^α,  q_pe × η                 (mla_q_row_scale)
    linear_kv_up_proj:
        rows = heads × (nope_rows + v_rows)     per head: [k_nope (nope_rows) | v (v_rows)]
        k_nope × η^(1−α),  v × 1                (mla_kv_row_scale)

so ``q_nope·k_nope`` is scaled by η and ``q_pe·k_pe`` by η: the whole logit by η.

**Corner cases** (dense and MLA alike): a group or head whose max logit is negative or NaN is
left alone (η = 1). Upstream computes ``clamp(τ / m, max=1)`` for every group (head) as soon as
one of the layer is over τ: a negative ``m`` gives a negative η, whose ``η^α`` is NaN (and, for
MLA's rotary query rows, × η flips their sign); a NaN ``m`` gives NaN rows. For ``m ≥ 0``
both give the same factors, bitwise.

**Fewer query groups than TP ranks** (megatron-core 0.19.2, ``num_query_groups`` < TP): each TP
rank holds a contiguous 1/TP of the whole weight's rows above, which may cut a group's q block or
its k head, and computes 1/TP of the query heads (TP rank ``r``: heads ``[r·heads/TP,
(r+1)·heads/TP)``). The rule is the same on the whole weight: η per query group from all of the
group's heads (gathered from the TP ranks that hold them), and each rank multiplies its own rows by
their factors (``qkv_row_scale``'s ``rows``), bitwise what one process does to those rows.

The scale is a per-row vector (``qkv_row_scale``, ``mla_q_row_scale``, ``mla_kv_row_scale``),
applied either to the whole TP-local matrix (``scale_rows_``) or to a flat range of it
(``scale_rows_flat_``): the distributed optimizer's fp32 shard holds elements ``[start, end)`` of
the row-major flattened matrix, which may begin and end mid-row. Both multiply each element by
its row's fp32 factor, so they agree bitwise.

Nothing here imports Megatron; devices and dtypes come from the inputs.
"""

from __future__ import annotations

import torch

__all__ = ["group_eta", "mla_kv_row_scale", "mla_q_row_scale", "qkv_row_scale", "scale_rows_", "scale_rows_flat_"]


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


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk-clip: alpha must be in (0, 1), got {alpha}")


def _blocks(factors: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Per group, its row blocks in order: ``factors`` = [(fp32 [groups] factor, rows of the block)];
    returns fp32 ``[groups · Σ rows]``."""
    groups = factors[0][0].numel()
    return torch.cat([f[:, None].expand(groups, rows) for f, rows in factors], dim=1).reshape(-1)


def qkv_row_scale(eta: torch.Tensor, alpha: float, q_rows: int, kv_rows: int,
                  rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The per-row factor of a fused QKV weight: fp32 ``[groups · (q_rows + 2·kv_rows)]``.

    Group ``g``'s ``q_rows`` query rows get ``η_g^α``, its ``kv_rows`` key rows ``η_g^(1−α)``, its
    value rows 1. ``alpha`` in (0, 1) (``--qk-clip-alpha``). ``rows`` ``(lo, hi)``: only the
    factors of rows ``[lo, hi)`` of the weight (``eta`` still every group's): a TP rank's contiguous
    row slice of the whole QKV when there are fewer query groups than TP ranks.
    """
    _check_alpha(alpha)
    eta = eta.float()
    scale = _blocks([(torch.pow(eta, alpha), q_rows), (torch.pow(eta, 1.0 - alpha), kv_rows),
                     (torch.ones_like(eta), kv_rows)])
    if rows is None:
        return scale
    lo, hi = rows
    if not 0 <= lo <= hi <= scale.numel():
        raise ValueError(f"qk-clip: rows [{lo}, {hi}) are not rows of a QKV of {scale.numel()} rows")
    return scale[lo:hi]


def mla_q_row_scale(eta: torch.Tensor, alpha: float, nope_rows: int, pe_rows: int) -> torch.Tensor:
    """The per-row factor of MLA's q projection (``linear_q_proj`` / ``linear_q_up_proj``): fp32
    ``[heads · (nope_rows + pe_rows)]``, ``eta`` ``[heads]`` (one head per group: ``group_eta(m,
    heads, τ)``). Head ``h``'s ``nope_rows`` (``qk_head_dim``) rows get ``η_h^α``, its ``pe_rows``
    (``qk_pos_emb_head_dim``) rotary rows ``η_h`` itself (the shared rotary key is not scaled).
    """
    _check_alpha(alpha)
    eta = eta.float()
    return _blocks([(torch.pow(eta, alpha), nope_rows), (eta, pe_rows)])


def mla_kv_row_scale(eta: torch.Tensor, alpha: float, nope_rows: int, v_rows: int) -> torch.Tensor:
    """The per-row factor of MLA's ``linear_kv_up_proj``: fp32 ``[heads · (nope_rows + v_rows)]``,
    ``eta`` ``[heads]``. Head ``h``'s ``nope_rows`` (``qk_head_dim``) key rows get ``η_h^(1−α)``,
    its ``v_rows`` (``v_head_dim``) value rows 1.
    """
    _check_alpha(alpha)
    eta = eta.float()
    return _blocks([(torch.pow(eta, 1.0 - alpha), nope_rows), (torch.ones_like(eta), v_rows)])


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
