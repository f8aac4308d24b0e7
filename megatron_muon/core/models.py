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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["LLAMA3", "ModelShape", "llama3_matrices"]


@dataclass(frozen=True)
class ModelShape:
    """A dense GPT (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied embeddings)."""

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
        """
        q, k, v = self.qkv_sub_rows
        per_layer = (
            ("linear_qkv", q + k + v, self.hidden, 0),
            ("linear_proj", self.hidden, self.num_heads * self.head_dim, 1),
            ("linear_fc1", 2 * self.ffn_hidden, self.hidden, 0),
            ("linear_fc2", self.hidden, self.ffn_hidden, 1),
        )
        return [
            (f"layers.{i}.{name}", rows, cols, pdim)
            for i in range(self.num_layers)
            for name, rows, cols, pdim in per_layer
        ]

    def scaled(self, divisor: int, *, num_layers: int | None = None, vocab: int | None = None,
               num_heads: int | None = None, num_query_groups: int | None = None) -> ModelShape:
        """The same architecture with hidden and ffn sizes divided by ``divisor``: a CPU-sized
        stand-in whose matrices keep the production aspect ratios. Head counts default to this
        model's; ``head_dim`` follows from the new hidden size."""
        hidden, ffn = self.hidden // divisor, self.ffn_hidden // divisor
        heads = num_heads or self.num_heads
        groups = num_query_groups or self.num_query_groups
        if hidden % heads or heads % groups:
            raise ValueError(f"ModelShape.scaled: {self.name} / {divisor}: hidden {hidden} does not split "
                             f"into {heads} heads of {groups} query groups")
        return replace(self, name=f"{self.name}/{divisor}", hidden=hidden, ffn_hidden=ffn, num_heads=heads,
                       num_query_groups=groups, head_dim=hidden // heads,
                       num_layers=num_layers or self.num_layers, vocab=vocab or self.vocab)


LLAMA3: dict[str, ModelShape] = {
    "8B": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "70B": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "405B": ModelShape("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256),
}
"""Llama-3 / 3.1 dense models by size."""


def llama3_matrices(model: str) -> list[tuple[str, int, int, int]]:
    """``LLAMA3[model].matrices()``, with a clear error for an unknown size."""
    if model not in LLAMA3:
        raise ValueError(f"llama3_matrices: unknown model {model!r}; expected one of {list(LLAMA3)}")
    return LLAMA3[model].matrices()
