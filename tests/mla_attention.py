"""A local core attention for multi-latent attention (MLA) on CPU: test harness only.

megatron-core 0.19.2's local ``DotProductAttention`` cannot be built for MLA: ``MLASelfAttention``
builds its core attention with ``k_channels`` (q/k head dim: ``qk_head_dim + qk_pos_emb_head_dim``)
and ``v_channels`` (``v_head_dim``), which ``DotProductAttention.__init__`` does not take, so MLA
runs on Transformer Engine's attention only. ``MLACoreAttention`` does the math of
``DotProductAttention`` — ``q·k × softmax_scale``, the causal mask, softmax (in fp32), ``× v`` —
with those two head dims, and keeps ``current_max_attn_logits`` as TE >= 2.9 does for
``--qk-clip``: fp32 ``[heads of this TP rank]``, the running max of the pre-softmax logits over the
unmasked positions of every forward since the clip last reset it, detached. Unlike TE it counts
training forwards only (as megatron-muon's tracking of ``DotProductAttention`` does).

It also corrects, at TP > 1, the gradient of MLA's shared rotary key, which megatron-core 0.19.2
gets wrong on the local spec's path (``linear_kv_down_proj`` a ``ColumnParallelLinear``, the only
one on a machine without Transformer Engine): each TP rank expands the rotary key over its own
heads only, and ``gather_from_tensor_model_parallel_region``'s backward (a split) never sums the
other ranks' heads' share (Megatron-LM issue #1699, open; the fix proposed in PR #6839 is
``copy_to_tensor_model_parallel_region`` on the rotary key). Here the same identity-forward,
all-reduce-backward op runs on the rotary slice of ``key``: summed over TP ranks slot by slot,
then over the local heads by the expand's backward, it is the sum over every head — the grad of
TP1. Without it a TP2 run drifts from TP1 by ~1e-2 in ``linear_kv_down_proj`` after 3 steps.

No dropout, no packed sequences, no sliding window, no attention bias, no context parallelism:
the tiny test GPTs use none of them, and each raises here rather than being ignored.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class MLACoreAttention(MegatronModule):
    """``core_attention`` for ``MLASelfAttentionSubmodules`` (local spec, CPU); module docstring."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"MLACoreAttention: {attn_mask_type.name} masks are not implemented")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0.0:
            raise NotImplementedError("MLACoreAttention: attention dropout is not implemented")
        if config.context_parallel_size != 1 or config.window_size is not None:
            raise NotImplementedError("MLACoreAttention: context parallelism / sliding windows are not implemented")
        # Attention.__init__ builds a core attention without them, which MultiLatentAttention.__init__
        # then replaces by one built with them.
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.rotary_dims = getattr(config, "qk_pos_emb_head_dim", 0) if config.multi_latent_attention else 0
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.k_channels ** -0.5
        self.current_max_attn_logits: torch.Tensor | None = None
        """fp32 ``[heads of this TP rank]``: the running max logit (TE's attribute); None after a reset."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None):
        """``query``/``key`` ``[s, b, heads, k_channels]``, ``value`` ``[s, b, heads, v_channels]``
        (MLA: one key per query head) -> ``[s, b, heads · v_channels]``."""
        if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
            raise NotImplementedError("MLACoreAttention: packed sequences, attention bias and explicit masks "
                                      "are not implemented (the causal mask is built here)")
        sq, b, heads, _ = query.shape
        sk = key.shape[0]
        if self.rotary_dims and self.tp_group is not None and self.tp_group.size() > 1:  # Megatron-LM #1699
            nope = key.shape[-1] - self.rotary_dims
            rotary = copy_to_tensor_model_parallel_region(key[..., nope:].contiguous(), group=self.tp_group)
            key = torch.cat([key[..., :nope], rotary], dim=-1)
        # [b, heads, sq, sk]
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * self.softmax_scale
        masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(diagonal=sk - sq + 1)
        scores = scores.masked_fill(masked, float("-inf"))
        if self.training:
            with torch.no_grad():
                head_max = scores.detach().amax(dim=(0, 2, 3)).float()
                previous = self.current_max_attn_logits
                self.current_max_attn_logits = head_max if previous is None else torch.maximum(previous, head_max)
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, heads, sq, v_channels]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * self.v_channels)
