"""Hidden 2-D weight shapes of Llama-3 8B / 70B / 405B, in Megatron's layout.

Pure data (no Megatron import), used to size planner and load-balance checks on real models.

Source: Meta's Llama-3 / Llama-3.1 model configs (``params.json`` / HF ``config.json``):

    model  layers  hidden  heads  kv_heads  head_dim  ffn_hidden
    8B     32      4096    32     8         128       14336
    70B    80      8192    64     8         128       28672
    405B   126     16384   128    8         128       53248

mapped onto Megatron-core's GPT layer (``TransformerLayer``), whose weights are stored as
``(out_features, in_features)``:

    linear_qkv   ColumnParallelLinear  (heads + 2·kv_heads)·head_dim × hidden   partition_dim 0
    linear_proj  RowParallelLinear     hidden × heads·head_dim                  partition_dim 1
    linear_fc1   ColumnParallelLinear  2·ffn_hidden × hidden (gate+up fused, SwiGLU)  partition 0
    linear_fc2   RowParallelLinear     hidden × ffn_hidden                      partition_dim 1

Shapes are full (unsharded); a TP rank holds ``1/tp`` of ``partition_dim``. Embeddings, the
output layer and norms are not hidden 2-D weights and are left out (Muon routes them to Adam).
"""

from __future__ import annotations

__all__ = ["LLAMA3_CONFIGS", "llama3_matrices"]

# model -> (num_layers, hidden, num_heads, num_kv_heads, head_dim, ffn_hidden)
LLAMA3_CONFIGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "8B": (32, 4096, 32, 8, 128, 14336),
    "70B": (80, 8192, 64, 8, 128, 28672),
    "405B": (126, 16384, 128, 8, 128, 53248),
}


def llama3_matrices(model: str) -> list[tuple[str, int, int, int]]:
    """Every hidden 2-D weight of a Llama-3 model, in forward (model-definition) order.

    Args:
        model: ``"8B"``, ``"70B"`` or ``"405B"``.

    Returns:
        ``(name, rows, cols, partition_dim)`` per matrix, full (unsharded) shape, names like
        ``"layers.0.linear_qkv"``; per layer: linear_qkv, linear_proj, linear_fc1, linear_fc2.
        ``partition_dim`` is 0 for ColumnParallel weights and 1 for RowParallel ones.
    """
    if model not in LLAMA3_CONFIGS:
        raise ValueError(
            f"llama3_matrices: unknown model {model!r}; expected one of {list(LLAMA3_CONFIGS)}"
        )
    layers, hidden, heads, kv_heads, head_dim, ffn = LLAMA3_CONFIGS[model]
    per_layer = (
        ("linear_qkv", (heads + 2 * kv_heads) * head_dim, hidden, 0),
        ("linear_proj", hidden, heads * head_dim, 1),
        ("linear_fc1", 2 * ffn, hidden, 0),
        ("linear_fc2", hidden, ffn, 1),
    )
    return [
        (f"layers.{i}.{name}", rows, cols, pdim)
        for i in range(layers)
        for name, rows, cols, pdim in per_layer
    ]
