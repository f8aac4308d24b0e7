"""QK-clip (``--qk-clip``, MuonClip) for ``--optimizer muon``: the max logit, its reduction, the clip.

megatron-core 0.19.2 has the flags (``--qk-clip``, ``--qk-clip-threshold`` τ, ``--qk-clip-alpha`` α,
``--log-max-attention-logit``) but tracks the max logit only inside Transformer Engine (>= 2.9,
``TEDotProductAttention.current_max_attn_logits``), and its ``clip_qk`` (``training.py`` calls it
after ``optimizer.step()``) rescales ``linear_qkv.weight.main_param`` as one whole matrix — which
the distributed optimizer's flat fp32 shards are not. Here, with the same flags and meanings:

* **Tracking.** Transformer Engine's own tracking when the core attention is TE's; any other core
  attention that keeps ``current_max_attn_logits`` itself (TE's attribute and semantics) is taken
  as it is. Megatron's local ``DotProductAttention`` (``--transformer-impl local``) gets a
  forward pre-hook on its ``scale_mask_softmax`` (``track_max_logits``): the scores it is handed
  are the pre-softmax logits (``q·k`` × softmax scale; × the softmax's own ``scale`` when
  query-key layer scaling is on), masked as that softmax masks them (the given mask, or causal /
  sliding window), and ``amax`` over batch, query and key positions gives one value per head of
  this TP rank, kept as the running max in ``core_attention.current_max_attn_logits`` (TE's
  attribute and semantics: the max over every micro-batch's forward since the last step,
  detached). Only forwards in training mode count (evaluation does not move the clip; TE counts
  every forward). Recomputed forwards see the same scores, so the max is unchanged. Multi-latent
  attention cannot use it: megatron-core 0.19.2's ``DotProductAttention`` does not take the
  ``k_channels`` / ``v_channels`` that ``MLASelfAttention`` builds its core attention with, so
  MLA runs on TE's attention (the CPU tests bring their own, ``tests/mla_attention.py``).
* **Reduction and clip** (``QKClip``, run as a step post-hook of the inner ``MuonWithAdamW``:
  after the update of the fp32 main params, before Megatron copies them into the model's bf16
  params and, with the distributed optimizer, all-gathers those — so the model copy is
  ``main.to(bf16)`` as after any step, and nothing is clipped twice). Every layer's max logits
  go into one vector, all-reduced with MAX over the data-parallel × context-parallel group
  (upstream reduces over the same group, one collective per layer; here one per step); TP
  ranks hold different heads and PP stages different layers, so neither is reduced, except
  where a layer has fewer query groups than TP ranks: there a rank's rows of the whole QKV need
  the η of a group whose heads other TP ranks track, and one MAX all-reduce over the TP group
  per step (every such layer's heads) gives every rank the whole layer's (``_spread_attention``
  says how megatron-core 0.19.2 lays them out; its own ``clip_qk`` asserts there a head count
  that its core attention does not report). Then, per
  layer, ``core/qk_clip.py``'s rule on this rank's main param of each weight it scales —
  ``linear_qkv.weight`` (η per query group), or for MLA (``MLASelfAttention``, η per head) the
  q projection (``linear_q_proj``, or ``linear_q_up_proj`` with a q LoRA rank) and
  ``linear_kv_up_proj.weight``: the whole TP-local matrix (no distributed optimizer) or this DP
  rank's flat range of it (the ZeRO-1 shard, possibly cut mid-row; under Megatron-FSDP and torch
  FSDP2 the rows of its DTensor, FSDP2's first row read from the DTensor's global offset). Both MLA weights are
  column-parallel and split by heads, so a TP rank's rows are its heads'. The multiply runs
  every step (× 1.0 for groups under τ): no host sync decides whether to clip.
* **Upstream's call.** ``training.py``'s ``clip_qk`` is replaced by ``hooks.py`` for the plugin:
  it clips nothing (done above) and returns this rank's max logit, as upstream's does, for
  ``--log-max-attention-logit``'s TensorBoard scalar.

Per step the clipper keeps the largest logit and the number of heads over τ on this rank
(device tensors, no sync); ``log_text`` reduces them over the model-parallel group for the
``--muon-log-stats`` line, only on the iterations that print it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from ..core.qk_clip import (
    group_eta,
    mla_kv_row_scale,
    mla_q_row_scale,
    qkv_row_scale,
    scale_rows_,
    scale_rows_flat_,
)
from ..optimizer import to_local
from ..parallel.comm import group_rank
from ..parallel.devices import resolve_device
from .torch_fsdp2 import fsdp2_flat_start

__all__ = ["ClippedAttention", "ClippedWeight", "QKClip", "build_qk_clip", "track_max_logits"]

_TRACKED = "_megatron_muon_tracks_max_logit"  # set on a local core attention once its hook is in


def _record_max_logit(core: torch.nn.Module, softmax: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of a local ``DotProductAttention.scale_mask_softmax``: ``args`` =
    (scores ``[b, heads, sq, sk]``, mask or None, softmax offset or None)."""
    if not core.training:
        return
    scores, mask = args[0], args[1] if len(args) > 1 else None
    with torch.no_grad():
        sq, sk = scores.shape[-2], scores.shape[-1]
        # As FusedScaleMaskSoftmax.forward_torch_softmax builds its mask (True = masked out).
        if softmax.window_size is not None:
            left, right = softmax.window_size
            ones = torch.ones(sq, sk, dtype=torch.bool, device=scores.device)
            mask = ~torch.tril(torch.triu(ones, diagonal=sk - sq - left), diagonal=sk - sq + right)
        elif mask is None and sq > 1 and softmax.attn_mask_type.name == "causal":
            mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(diagonal=1)
        kept = scores.detach() if mask is None else scores.detach().masked_fill(mask, float("-inf"))
        head_max = torch.amax(kept, dim=(0, 2, 3)).float()
        if softmax.scale is not None:  # query-key layer scaling: the softmax multiplies by it
            head_max = head_max * softmax.scale
        previous = core.current_max_attn_logits
        core.current_max_attn_logits = head_max if previous is None else torch.maximum(previous, head_max)


def track_max_logits(core_attention: torch.nn.Module) -> None:
    """Make a local ``DotProductAttention`` keep ``current_max_attn_logits`` as TE's does (idempotent)."""
    if getattr(core_attention, _TRACKED, False):
        return
    core_attention.current_max_attn_logits = None
    core_attention.scale_mask_softmax.register_forward_pre_hook(
        lambda softmax, args: _record_max_logit(core_attention, softmax, args))
    setattr(core_attention, _TRACKED, True)


@dataclass
class ClippedWeight:
    """One weight a layer's clip scales, as this rank holds its fp32 main param."""

    name: str
    """the weight's name, for messages."""
    cols: int
    """columns of the weight."""
    main: torch.Tensor | None
    """the fp32 main param this rank updates: the whole TP-local matrix, or a flat range of it
    (``start`` not None); None when this DP rank holds none of it."""
    start: int | None
    """where ``main`` starts in the flattened TP-local matrix; None: ``main`` is the whole matrix."""
    row_scale: Callable[[torch.Tensor, float], torch.Tensor]
    """(η ``[groups]`` of this TP rank, α) → the fp32 factor of each TP-local row (``core/qk_clip.py``)."""


@dataclass
class ClippedAttention:
    """One self-attention layer as this rank's clipper sees it: its tracker and the weights it scales."""

    name: str
    """the layer's name, for messages."""
    core: torch.nn.Module
    """its core attention: holds ``current_max_attn_logits`` ``[heads]`` (None before a forward)."""
    heads: int
    """query heads on this TP rank."""
    groups: int
    """groups η is taken over on this TP rank: query groups (GQA), or ``heads`` (MHA, MLA)."""
    weights: list[ClippedWeight]
    """``linear_qkv.weight``; MLA: the q projection and ``linear_kv_up_proj.weight``."""
    spread: tuple[int, int] | None = None
    """fewer query groups than TP ranks: (this rank's first head among the layer's, the layer's
    query heads). Each TP rank tracks ``heads`` of them and holds a 1/TP row slice of the whole
    QKV; ``groups`` is then the layer's query groups, η taken over all its heads (``QKClip.step``
    gathers them over TP). None: this rank's heads and groups are its own."""


class QKClip:
    """The reduction and the clip of every self-attention layer of this rank (module docstring).

    Args:
        attentions: this rank's layers (the same list, in the same order, on every rank of ``group``).
        group: the data-parallel × context-parallel group whose ranks saw other tokens.
        threshold, alpha: τ and α (``--qk-clip-threshold``, ``--qk-clip-alpha``).
        clip: False for ``--log-max-attention-logit`` alone: reduce and report, change nothing.
        log_group: the model-parallel (TP × PP) group over which ``log_values`` sums the model's heads.
        tp_group: the TP group of the layers whose heads are ``spread`` over it (fewer query groups
            than TP ranks); None when there are none.
    """

    def __init__(self, attentions: list[ClippedAttention], group, threshold: float, alpha: float, clip: bool,
                 log_group=None, tp_group=None):
        if clip and not threshold > 0:
            raise ValueError(f"--qk-clip-threshold: expected a value > 0, got {threshold}")
        if clip and not 0.0 < alpha < 1.0:
            raise ValueError(f"--qk-clip-alpha: expected a value in (0, 1), got {alpha}")
        self.attentions = attentions
        self.group = group
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.clip = clip
        self.log_group = log_group
        self.tp_group = tp_group
        if any(a.spread is not None for a in attentions) and tp_group is None:
            raise ValueError("qk-clip: attention heads spread over TP ranks need the TP group")
        self.heads = sum(a.heads for a in attentions)
        """heads on this rank (all its layers)."""
        self.last_logits: torch.Tensor | None = None
        """fp32 ``[heads]``: the DP-reduced max logit of every head of this rank (layer by layer) at the last step."""
        self.last_max_logit: torch.Tensor | None = None
        """0-d fp32: the largest DP-reduced max logit of this rank's heads at the last step."""
        self.last_heads_over: torch.Tensor | None = None
        """0-d int64: how many of this rank's heads were over τ at the last step (clipped, if ``clip``)."""

    def after_step(self, optimizer=None, args=None, kwargs=None) -> None:
        """``torch.optim.Optimizer.register_step_post_hook``'s signature; see ``step``."""
        self.step()

    @torch.no_grad()
    def step(self) -> None:
        """Reduce this step's max logits, clip (when ``clip``), keep the stats, reset the trackers.

        Every rank of ``group`` calls it once per applied optimizer step: one all-reduce, the
        same size everywhere (a layer that saw no forward contributes -inf, which never wins).
        With layers whose heads are ``spread`` over TP ranks, every rank of ``tp_group`` then
        makes one more, MAX over TP of every such layer's whole head vector (each rank's own heads
        in place, -inf elsewhere; the same size on every TP rank: the stage's layers): the
        per-group max takes heads tracked on other TP ranks, exactly (MAX rounds nothing)."""
        if not self.attentions:
            return
        tracked = [a.core.current_max_attn_logits for a in self.attentions]
        device = resolve_device([t for t in tracked if t is not None], self.group, what="max attention logits")
        logits = torch.cat([
            t.float().to(device) if t is not None else torch.full((a.heads,), float("-inf"), device=device)
            for a, t in zip(self.attentions, tracked)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(logits, op=dist.ReduceOp.MAX, group=self.group)
        whole = self._whole_heads(logits) if self.clip else {}
        for i, (a, head_max) in enumerate(zip(self.attentions, logits.split([a.heads for a in self.attentions]))):
            a.core.current_max_attn_logits = None
            held = [w for w in a.weights if w.main is not None]
            if not self.clip or not held:
                continue
            eta = group_eta(whole.get(i, head_max), a.groups, self.threshold)
            for w in held:
                scale = w.row_scale(eta, self.alpha).to(w.main.device)
                if w.start is None:
                    scale_rows_(w.main, scale)
                else:
                    scale_rows_flat_(w.main, w.start, scale, w.cols)
        self.last_logits = logits
        self.last_max_logit = logits.max()
        self.last_heads_over = (logits > self.threshold).sum()

    def _whole_heads(self, logits: torch.Tensor) -> dict[int, torch.Tensor]:
        """{layer index: the layer's every head's max logit} for the layers ``spread`` over TP,
        from ``logits`` (this rank's heads of every layer, DP-reduced) and one MAX all-reduce over
        ``tp_group``; {} when there are none (and no collective)."""
        spread = [i for i, a in enumerate(self.attentions) if a.spread is not None]
        if not spread:
            return {}
        own = logits.split([a.heads for a in self.attentions])
        whole = torch.full((sum(self.attentions[i].spread[1] for i in spread),), float("-inf"), device=logits.device)
        at, out = 0, {}
        for i in spread:
            first, heads = self.attentions[i].spread
            whole[at + first:at + first + own[i].numel()] = own[i]
            out[i] = whole[at:at + heads]
            at += heads
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=self.tp_group)
        return out

    def log_values(self) -> tuple[float, int, int] | None:
        """(max logit, heads over τ, heads) of the whole model at the last step, reduced over the
        model-parallel group ``log_group`` (every rank of it must call this; host sync: for the log
        line only). None before the first step."""
        mp_group = self.log_group
        device = resolve_device([self.last_max_logit] if self.last_max_logit is not None else [], mp_group)
        have = self.last_max_logit is not None
        top = torch.full((1,), float("-inf"), device=device)
        counts = torch.zeros(3, dtype=torch.float64, device=device)  # heads over, heads, steps seen
        if have:
            top[0] = self.last_max_logit
            counts[0], counts[1], counts[2] = self.last_heads_over.double(), self.heads, 1.0
        if mp_group is not None and dist.get_world_size(mp_group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mp_group)
            dist.all_reduce(counts, group=mp_group)
        values = counts.tolist()
        if values[2] == 0:
            return None
        return top.item(), int(values[0]), int(values[1])

    def log_text(self) -> str:
        """`` qk-clip heads: 3/16 over 50 | max attention logit: 61.2 |`` (``log_values``)."""
        values = self.log_values()
        if values is None:
            return ""
        top, over, heads = values
        verb = "clipped" if self.clip else "over"
        return f" qk-clip heads {verb}: {over}/{heads} (tau {self.threshold:g}) | max attention logit: {top:.3f} |"


def _attention_layers(chunk):
    """(name, module) of every attention layer (a module with a core attention) in a model chunk."""
    for name, module in chunk.named_modules():
        if getattr(module, "core_attention", None) is not None:
            yield name, module


def qk_clip_settings(model_chunks) -> tuple[bool, bool, float, float]:
    """(clip, log, τ, α) from the model's ``TransformerConfig`` (what ``--qk-clip``,
    ``--log-max-attention-logit``, ``--qk-clip-threshold``, ``--qk-clip-alpha`` set)."""
    config = model_chunks[0].config
    return (bool(getattr(config, "qk_clip", False)), bool(getattr(config, "log_max_attention_logit", False)),
            float(getattr(config, "qk_clip_threshold", 100.0)), float(getattr(config, "qk_clip_alpha", 0.5)))


def build_qk_clip(model_chunks, matrix_of: dict, group, dp_rank: int, log_group=None) -> QKClip | None:
    """The clipper for ``model_chunks`` when their config asks for ``--qk-clip`` or
    ``--log-max-attention-logit``, else None; installs the local attention's tracking.

    ``matrix_of``: id(model param) → (its layout, this rank's main tensor or None) (``catalogue.MatrixOf``);
    ``dp_rank``: this rank's index in ``group``, whose flat range ``main`` holds under the
    distributed optimizer; ``log_group``: the model-parallel group (``QKClip``).
    Raises ``ValueError`` naming the flag for attention it cannot clip exactly.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    clip, log, threshold, alpha = qk_clip_settings(model_chunks)
    if not (clip or log):
        return None
    flag = "--qk-clip" if clip else "--log-max-attention-logit"
    attentions, tp_groups = [], []  # tp_groups: of the layers spread over TP (fewer query groups)
    for c, chunk in enumerate(model_chunks):
        for name, module in _attention_layers(chunk):
            name = f"chunk{c}.{name}"
            mla = isinstance(module, MLASelfAttention)
            if not mla and getattr(module, "linear_qkv", None) is None:
                raise ValueError(f"{flag}: {type(module).__name__} ({name}) is not supported with --optimizer muon "
                                 "(self-attention with a fused linear_qkv, or MLASelfAttention, only)")
            core = module.core_attention
            if isinstance(core, DotProductAttention):
                track_max_logits(core)
            elif not hasattr(core, "current_max_attn_logits"):
                use = ("--transformer-impl transformer_engine (Transformer Engine >= 2.9)" if mla else
                       "--transformer-impl local or transformer_engine (Transformer Engine >= 2.9)")
                raise ValueError(f"{flag}: {type(core).__name__} ({name}) does not track the max attention logit; "
                                 f"use {use}")
            heads = module.num_attention_heads_per_partition
            if mla:
                attentions.append(ClippedAttention(name, core, heads, heads, _mla_weights(
                    module, name, flag, matrix_of, dp_rank)))
                continue
            weight = module.linear_qkv.weight
            if module.config.num_query_groups < getattr(module, "world_size", 1):
                attentions.append(_spread_attention(module, name, flag, core, matrix_of, dp_rank))
                tp_groups.append(module.pg_collection.tp)
                continue
            groups = module.num_query_groups_per_partition
            head_dim = module.hidden_size_per_attention_head
            q_rows = heads // groups * head_dim
            shape = _tp_local_shape(weight, matrix_of)
            if len(shape) != 2 or shape[0] != groups * (q_rows + 2 * head_dim):
                raise ValueError(f"{flag}: {name}.linear_qkv.weight of shape {shape} is not "
                                 f"[q; k; v] x {groups} query groups (an attention output gate is not supported)")
            attentions.append(ClippedAttention(name, core, heads, groups, [_clipped(
                f"{name}.linear_qkv.weight", weight, matrix_of, dp_rank,
                partial(qkv_row_scale, q_rows=q_rows, kv_rows=head_dim))]))
    if any(g is not tp_groups[0] for g in tp_groups):
        raise ValueError(f"{flag}: the attention layers of this rank are not on one TP group")
    return QKClip(attentions, group, threshold, alpha, clip, log_group, tp_group=tp_groups[0] if tp_groups else None)


def _spread_attention(module, name: str, flag: str, core, matrix_of: dict, dp_rank: int) -> ClippedAttention:
    """A self-attention with fewer query groups than TP ranks, as megatron-core 0.19.2 lays it out
    (``Attention.get_query_key_value_tensors``): TP rank ``r`` holds rows ``[r·R/TP, (r+1)·R/TP)``
    of the whole QKV (``R = groups · (heads / groups + 2) · head_dim``, ``[q heads; k; v]`` per
    group), all-gathers the projection's output, and its core attention computes query heads
    ``[r·heads/TP, (r+1)·heads/TP)`` of its group (``num_attention_heads_per_partition`` reports
    the group's heads, not these), which its max logits are of. Refuses what does not fit that."""
    config = module.config
    tp, query_groups, heads = module.world_size, config.num_query_groups, config.num_attention_heads
    head_dim = module.hidden_size_per_attention_head
    weight_name = f"{name}.linear_qkv.weight"
    if tp % query_groups or heads % tp:
        raise ValueError(f"{flag}: {weight_name}: --num-query-groups {query_groups} and --num-attention-heads "
                         f"{heads} with --tensor-model-parallel-size {tp}: expected TP a multiple of the query "
                         "groups and the heads a multiple of TP (megatron-core's head split below the query groups)")
    q_rows = heads // query_groups * head_dim
    rows = query_groups * (q_rows + 2 * head_dim)
    shape = _tp_local_shape(module.linear_qkv.weight, matrix_of)
    if len(shape) != 2 or shape[0] * tp != rows:
        raise ValueError(f"{flag}: {weight_name} of shape {shape} is not 1/{tp} of the rows of [q; k; v] x "
                         f"{query_groups} query groups ({rows} rows; an attention output gate is not supported)")
    rank = group_rank(module.pg_collection.tp)
    local = heads // tp
    row_scale = partial(qkv_row_scale, q_rows=q_rows, kv_rows=head_dim, rows=(rank * shape[0], (rank + 1) * shape[0]))
    return ClippedAttention(name, core, local, query_groups,
                            [_clipped(weight_name, module.linear_qkv.weight, matrix_of, dp_rank, row_scale)],
                            spread=(rank * local, heads))


def _mla_weights(module, name: str, flag: str, matrix_of: dict, dp_rank: int) -> list[ClippedWeight]:
    """An ``MLASelfAttention``'s q projection and ``linear_kv_up_proj``, per head of this TP rank
    ``[q_nope | q_pe]`` and ``[k_nope | v]`` (``core/qk_clip.py``); refuses what the rule does not fit."""
    config = module.config
    if getattr(config, "cache_mla_latents", False):
        raise ValueError(f"{flag}: --cache-mla-latents ({name}) is not supported (absorption deletes "
                         "linear_kv_up_proj, whose key rows the clip scales; it is for inference only)")
    heads = module.num_attention_heads_per_partition
    nope, pe, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    q_name = "linear_q_proj" if config.q_lora_rank is None else "linear_q_up_proj"
    out = []
    for attr, rows, scale in ((q_name, nope + pe, partial(mla_q_row_scale, nope_rows=nope, pe_rows=pe)),
                              ("linear_kv_up_proj", nope + v, partial(mla_kv_row_scale, nope_rows=nope, v_rows=v))):
        weight = getattr(getattr(module, attr, None), "weight", None)
        shape = _tp_local_shape(weight, matrix_of) if isinstance(weight, torch.Tensor) else None
        if shape is None or len(shape) != 2 or shape[0] != heads * rows:
            raise ValueError(f"{flag}: {name}.{attr}.weight of shape {shape} is not {heads} heads x {rows} rows "
                             "on this TP rank")
        out.append(_clipped(f"{name}.{attr}.weight", weight, matrix_of, dp_rank, scale))
    return out


def _tp_local_shape(weight: torch.Tensor, matrix_of: dict) -> tuple[int, ...]:
    """This TP rank's shape of ``weight``: its Muon layout's when it has one (a Megatron-FSDP
    DTensor reports the TP-unsharded global shape)."""
    matrix = matrix_of.get(id(weight))
    return tuple(matrix[0].local_shape) if matrix is not None else tuple(weight.shape)


def _clipped(name: str, weight: torch.Tensor, matrix_of: dict, dp_rank: int, row_scale) -> ClippedWeight:
    """``weight`` as this rank's clipper holds it: its main param (whole, or this DP rank's flat
    range: a ZeRO-1 shard, or the local rows of a DTensor, flattened: under Megatron-FSDP and
    torch FSDP2)."""
    matrix = matrix_of.get(id(weight))
    if matrix is None:  # every Muon matrix has a layout on every rank, held there or not
        raise RuntimeError(f"qk-clip: {name} is not among the optimizer's Muon matrices (a wrapper replaced "
                           "the module's parameter?)")
    layout, param = matrix
    main, start = (to_local(param) if param is not None else None), None
    if layout.dp_ranges is not None:
        if getattr(weight, "is_torch_fsdp2_param", False):
            # FSDP2: the main param is a Shard(0) DTensor of the TP-local matrix (FP32Optimizer's
            # param itself, or Float16OptimizerWithFloat16Params' fp32 clone with its placement);
            # its global offset says which rows the local ones are
            start = fsdp2_flat_start(name, param)
        else:
            start = layout.local_range(dp_rank)[0]
        if main is not None and main.dim() != 1:  # a DTensor's rows [r0, r1) of the matrix, a contiguous view
            main = main.view(-1)
    return ClippedWeight(name, _tp_local_shape(weight, matrix_of)[1], main, start, row_scale)
