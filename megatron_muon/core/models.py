"""Model shapes: the one description of a GPT model's weights that every layer above uses.

Pure data (no Megatron import): the planner checks, the cost model, the benchmarks and the dry
run size their work from a ``ModelShape``.

Llama-3 source: Meta's Llama-3 / Llama-3.1 model configs (``params.json`` / HF ``config.json``):

    model  layers  hidden  heads  kv_heads  head_dim  ffn_hidden  vocab
    8B     32      4096    32     8         128       14336       128256
    70B    80      8192    64     8         128       28672       128256
    405B   126     16384   128    8         128       53248       128256

mapped onto Megatron-core's GPT layer (``TransformerLayer``), whose weights are stored as
``(out_features, in_features)``:

    linear_qkv   ColumnParallelLinear  (heads + 2·kv_heads)·head_dim × hidden   partition_dim 0
    linear_proj  RowParallelLinear     hidden × heads·head_dim                  partition_dim 1
    linear_fc1   ColumnParallelLinear  2·ffn_hidden × hidden (gate+up fused, SwiGLU)  partition 0
    linear_fc2   RowParallelLinear     hidden × ffn_hidden                      partition_dim 1

Shapes are full (unsharded); a TP rank holds ``1/tp`` of ``partition_dim`` (``core.shapes``).
Embeddings, the output layer and norms are not hidden 2-D weights and are left out of
``matrices()`` (Muon routes them to AdamW).

Mixture-of-experts shapes (issue 14), from the models' public HF ``config.json``:

    Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1): 32 layers, hidden 4096, 32 heads / 8 kv heads of
      128, 8 experts top-2 (num_local_experts, num_experts_per_tok), expert SwiGLU 14336, vocab
      32000; every layer MoE, no shared expert.
    DeepSeek-V3 (deepseek-ai/DeepSeek-V3): 61 layers, hidden 7168, 256 routed experts top-8
      (n_routed_experts, num_experts_per_tok) of moe_intermediate_size 2048, 1 shared expert of
      the same size, first_k_dense_replace 3 (layers 0-2 dense, intermediate_size 18432), vocab
      129280; MLA attention: 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
      qk_rope_head_dim 64, v_head_dim 128. Left out: the multi-token-prediction module
      (num_nextn_predict_layers 1) and the router's 1-D score-correction bias (a buffer).

mapped onto megatron-core's MoE layer (``MoELayer``, local spec ``SequentialMLP``): per MoE layer
a ``router`` (experts × hidden, not TP-sharded), per expert ``linear_fc1`` (2·moe_ffn × hidden,
gate and up) and ``linear_fc2`` (hidden × moe_ffn), sharded over the expert-TP group like the dense
fc1 / fc2; a shared expert (``shared_experts.linear_fc1`` / ``linear_fc2``) is a dense MLP of
``shared_expert_ffn``. MLA (``MLASelfAttention``): ``linear_q_down_proj`` (q_lora × hidden),
``linear_q_up_proj`` (heads·(qk_head + rope) × q_lora), ``linear_kv_down_proj`` ((kv_lora + rope) ×
hidden), ``linear_kv_up_proj`` (heads·(qk_head + v_head) × kv_lora), ``linear_proj`` (hidden ×
heads·v_head); no fused QKV to split.

Hybrid shapes (issue 28): megatron-core's ``HybridModel``, one symbol per layer of
``hybrid_pattern`` (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE). Nemotron-H-8B, from
NVIDIA's Nemotron-H (arXiv 2504.03624) as Megatron-Bridge documents it (docs/models/llm/nemotronh.md)
and the HF ``config.json`` of nvidia/Nemotron-H-8B-Base-8K: 52 layers
``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` (24 Mamba-2, 4 attention, 24 MLP), hidden
4096, attention 32 heads / 8 kv heads of 128, MLP 21504 with squared ReLU (not gated: fc1 is one
matrix), Mamba-2 128 heads of 64 (d_inner 8192), 8 groups, state 128, conv kernel 4, vocab 131072.
A Mamba mixer holds ``in_proj`` ((2·d_inner + 2·groups·state + heads) × hidden, rows [z; x; B;
C; dt], ColumnParallel, each role sharded on its own) and ``out_proj`` (hidden × d_inner,
RowParallel); its conv1d, A_log, D, dt_bias and norm are not matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["HYBRID_MODELS", "LLAMA3", "MOE_MODELS", "MLAShape", "MambaShape", "ModelShape", "llama3_matrices",
           "staged_pattern"]


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's sizes (megatron-core's ``MLATransformerConfig`` fields)."""

    q_lora_rank: int
    """rank of the query down projection (``--q-lora-rank``)."""
    kv_lora_rank: int
    """rank of the key/value down projection (``--kv-lora-rank``)."""
    qk_head_dim: int
    """query/key channels per head without RoPE (``--qk-head-dim``)."""
    qk_pos_emb_head_dim: int
    """query/key RoPE channels per head (``--qk-pos-emb-head-dim``)."""
    v_head_dim: int
    """value channels per head (``--v-head-dim``)."""


@dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 mixer's sizes (megatron-core's ``mamba_*`` config fields)."""

    num_heads: int
    head_dim: int
    state_dim: int
    num_groups: int

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def in_proj_sub_rows(self) -> tuple[int, int, int, int, int]:
        """Rows of z, x, B, C and dt in ``in_proj`` (whole, all TP ranks)."""
        bc = self.num_groups * self.state_dim
        return self.d_inner, self.d_inner, bc, bc, self.num_heads


@dataclass(frozen=True)
class ModelShape:
    """A GPT (RoPE, RMSNorm, SwiGLU, untied embeddings): grouped-query attention or MLA, dense or
    with a mixture of experts (``num_experts`` > 0) after ``first_dense_layers`` dense layers."""

    name: str
    """for tables and error messages, e.g. ``"llama3-8b"``."""
    num_layers: int
    """transformer layers."""
    hidden: int
    """hidden size (``--hidden-size``)."""
    num_heads: int
    """query heads (``--num-attention-heads``)."""
    num_query_groups: int
    """key/value heads (``--num-query-groups``)."""
    head_dim: int
    """channels per head (``--kv-channels``)."""
    ffn_hidden: int
    """SwiGLU inner size (``--ffn-hidden-size``); fc1 holds gate and up, 2·ffn_hidden rows."""
    vocab: int
    """vocabulary size (the embedding and the untied output layer)."""
    num_experts: int = 0
    """routed experts per MoE layer (``--num-experts``); 0: a dense model."""
    moe_topk: int = 0
    """experts per token (``--moe-router-topk``)."""
    moe_ffn_hidden: int = 0
    """an expert's SwiGLU inner size (``--moe-ffn-hidden-size``)."""
    shared_expert_ffn: int = 0
    """the shared expert's inner size (``--moe-shared-expert-intermediate-size``); 0: none."""
    first_dense_layers: int = 0
    """leading dense layers (of ``ffn_hidden``) before the MoE layers (DeepSeek's first_k_dense_replace)."""
    mla: MLAShape | None = None
    """multi-latent attention's sizes; None: grouped-query attention."""
    hybrid_pattern: str | None = None
    """a ``HybridModel``'s layers, one symbol each (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E``
    MoE); None: a GPT (every layer attention + MLP). ``num_layers`` is its length."""
    mamba: MambaShape | None = None
    """the Mamba mixers' sizes (with ``M`` in ``hybrid_pattern``)."""
    gated_mlp: bool = True
    """SwiGLU fc1 (gate and up, 2·ffn_hidden rows); False: one ffn_hidden × hidden matrix (squared ReLU)."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) holds experts."""
        return self.num_experts > 0 and layer >= self.first_dense_layers

    @property
    def moe_layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` as a list: 1 for an MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    @property
    def qkv_sub_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v in ``linear_qkv`` (all groups together)."""
        kv = self.num_query_groups * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    def matrices(self) -> list[tuple[str, int, int, int]]:
        """Every hidden 2-D weight, in forward order.

        Returns ``(name, rows, cols, partition_dim)`` per matrix, full (unsharded) shape, names
        like ``"layers.0.linear_qkv"``; per layer: linear_qkv, linear_proj, linear_fc1,
        linear_fc2. ``partition_dim`` is 0 for ColumnParallel weights and 1 for RowParallel ones.
        Megatron *registers* (and lays out its buffers in) another order, linear_proj before
        linear_qkv; code that emulates Megatron's buffers must reorder (``planner_quality``).

        An MoE layer lists, after attention, ``router`` (partition_dim None: not TP-sharded),
        ``experts.{e}.linear_fc1`` / ``linear_fc2`` for every expert ``e`` (sharded over the
        expert-TP group) and the shared expert's ``shared_experts.linear_fc1`` / ``linear_fc2``;
        MLA layers list its five projections instead of linear_qkv and linear_proj.
        """
        if self.hybrid_pattern is not None:
            return self._hybrid_matrices()
        out = []
        for i in range(self.num_layers):
            mlp = [("linear_fc1", 2 * self.ffn_hidden, self.hidden, 0), ("linear_fc2", self.hidden, self.ffn_hidden, 1)]
            if self.is_moe_layer(i):
                mlp = [("router", self.num_experts, self.hidden, None)]
                for e in range(self.num_experts):
                    mlp += [(f"experts.{e}.linear_fc1", 2 * self.moe_ffn_hidden, self.hidden, 0),
                            (f"experts.{e}.linear_fc2", self.hidden, self.moe_ffn_hidden, 1)]
                if self.shared_expert_ffn:
                    mlp += [("shared_experts.linear_fc1", 2 * self.shared_expert_ffn, self.hidden, 0),
                            ("shared_experts.linear_fc2", self.hidden, self.shared_expert_ffn, 1)]
            out += [(f"layers.{i}.{name}", rows, cols, pdim) for name, rows, cols, pdim in (*self._attention(), *mlp)]
        return out

    def _hybrid_matrices(self) -> list[tuple[str, int, int, int]]:
        """``matrices`` of a hybrid model, layer by layer of its pattern: a Mamba layer's
        ``mixer.in_proj`` ([z; x; B; C; dt] rows, ColumnParallel) and ``mixer.out_proj``
        (RowParallel); an attention layer's QKV and projection; an MLP layer's fc1 (2·ffn rows
        when gated) and fc2. MoE layers (``E``) are not listed (as for a GPT's cost model: the dry
        run measures them)."""
        if "E" in self.hybrid_pattern:
            raise NotImplementedError(f"ModelShape.matrices: {self.name}: MoE layers in a hybrid pattern; "
                                      "scripts/dry_run.py measures them")
        m = self.mamba
        if m is None and "M" in self.hybrid_pattern:
            raise ValueError(f"ModelShape {self.name}: hybrid_pattern has Mamba layers (M); expected mamba sizes")
        fc1_rows = (2 if self.gated_mlp else 1) * self.ffn_hidden
        kinds = {"M": [("mixer.in_proj", sum(m.in_proj_sub_rows), self.hidden, 0),
                       ("mixer.out_proj", self.hidden, m.d_inner, 1)] if m is not None else [],
                 "*": self._attention(),
                 "-": [("linear_fc1", fc1_rows, self.hidden, 0), ("linear_fc2", self.hidden, self.ffn_hidden, 1)]}
        return [(f"layers.{i}.{name}", rows, cols, pdim) for i, symbol in enumerate(self.hybrid_pattern)
                for name, rows, cols, pdim in kinds[symbol]]

    def _attention(self) -> list[tuple[str, int, int, int]]:
        m = self.mla
        if m is None:
            q, k, v = self.qkv_sub_rows
            return [("linear_qkv", q + k + v, self.hidden, 0),
                    ("linear_proj", self.hidden, self.num_heads * self.head_dim, 1)]
        return [("linear_q_down_proj", m.q_lora_rank, self.hidden, 0),
                ("linear_q_up_proj", self.num_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim), m.q_lora_rank, 0),
                ("linear_kv_down_proj", m.kv_lora_rank + m.qk_pos_emb_head_dim, self.hidden, 0),
                ("linear_kv_up_proj", self.num_heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, 0),
                ("linear_proj", self.hidden, self.num_heads * m.v_head_dim, 1)]

    def scaled(self, divisor: int, *, num_layers: int | None = None, vocab: int | None = None,
               num_heads: int | None = None, num_query_groups: int | None = None) -> ModelShape:
        """The same architecture with hidden and ffn sizes divided by ``divisor``: a CPU-sized
        stand-in whose matrices keep the production aspect ratios. Head counts default to this
        model's; ``head_dim`` follows from the new hidden size."""
        if self.mla is not None:
            raise NotImplementedError(f"ModelShape.scaled: {self.name}: MLA shapes are not scaled")
        hidden, ffn = self.hidden // divisor, self.ffn_hidden // divisor
        heads = num_heads or self.num_heads
        groups = num_query_groups or self.num_query_groups
        if hidden % heads or heads % groups:
            raise ValueError(f"ModelShape.scaled: {self.name} / {divisor}: hidden {hidden} does not split "
                             f"into {heads} heads of {groups} query groups")
        return replace(self, name=f"{self.name}/{divisor}", hidden=hidden, ffn_hidden=ffn, num_heads=heads,
                       num_query_groups=groups, head_dim=hidden // heads,
                       num_layers=num_layers or self.num_layers, vocab=vocab or self.vocab,
                       moe_ffn_hidden=self.moe_ffn_hidden // divisor,
                       shared_expert_ffn=self.shared_expert_ffn // divisor)


LLAMA3: dict[str, ModelShape] = {
    "8B": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "70B": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "405B": ModelShape("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256),
}
"""Llama-3 / 3.1 dense models by size."""

MOE_MODELS: dict[str, ModelShape] = {
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, num_experts=8, moe_topk=2,
                               moe_ffn_hidden=14336),
    "deepseek-v3": ModelShape("deepseek-v3", 61, 7168, 128, 128, 128, 18432, 129280, num_experts=256, moe_topk=8,
                              moe_ffn_hidden=2048, shared_expert_ffn=2048, first_dense_layers=3,
                              mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                                           qk_pos_emb_head_dim=64, v_head_dim=128)),
}
"""Mixture-of-experts models (module docstring: sources; the DeepSeek-V3 shape has no MTP module)."""

_NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
HYBRID_MODELS: dict[str, ModelShape] = {
    "nemotron-h-8b": ModelShape("nemotron-h-8b", len(_NEMOTRON_H_8B_PATTERN), 4096, 32, 8, 128, 21504, 131072,
                                hybrid_pattern=_NEMOTRON_H_8B_PATTERN, gated_mlp=False,
                                mamba=MambaShape(num_heads=128, head_dim=64, state_dim=128, num_groups=8)),
}
"""Hybrid (Mamba + attention + MLP) models (module docstring: sources)."""


def llama3_matrices(model: str) -> list[tuple[str, int, int, int]]:
    """``LLAMA3[model].matrices()``, with a clear error for an unknown size."""
    if model not in LLAMA3:
        raise ValueError(f"llama3_matrices: unknown model {model!r}; expected one of {list(LLAMA3)}")
    return LLAMA3[model].matrices()


def staged_pattern(pattern: str, pp: int) -> str:
    """A hybrid layer pattern (one symbol per layer) cut into ``pp`` pipeline stages with
    megatron-core's ``|``, as a user writes ``--hybrid-layer-pattern`` at PP > 1 (megatron-core
    deprecates the pattern without separators there). Even when ``pp`` divides the layers; else
    middle stages of ceil(layers / pp) and the rest split between the first and last, the split
    the dry run gives a GPT (Nemotron-H-8B's 52 layers at PP4: 4 x 13; at PP8: 5 + 6 x 7 + 5).
    Raises ``ValueError`` when the layers cannot fill ``pp`` stages that way."""
    layers = len(pattern)
    if pp < 1 or "|" in pattern:
        raise ValueError(f"expected an unstaged pattern and pp >= 1, got {pattern!r} and {pp}")
    if layers % pp == 0:
        sizes = [layers // pp] * pp
    else:
        middle = -(-layers // pp)
        rest = layers - middle * (pp - 2)
        if pp < 3 or rest // 2 < 1:
            raise ValueError(f"{layers} layers do not split over {pp} pipeline stages")
        sizes = [rest // 2, *([middle] * (pp - 2)), rest - rest // 2]
    cuts = [sum(sizes[:i]) for i in range(pp + 1)]
    return "|".join(pattern[cuts[i]:cuts[i + 1]] for i in range(pp))
