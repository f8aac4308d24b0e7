"""What the model flags describe, checked before anything is built: one line naming the flag.

* ``hybrid_pattern_refusal``: ``--hybrid-layer-pattern``, one symbol per layer. Megatron counts
  the layers from it and leaves the rest to the model build, where each mistake fails on every
  rank, or not at all: an empty pattern (0 layers: a ZeroDivisionError), a symbol the layer spec
  has no module for (megatron-core's ``HybridStackSubmodules`` defaults every kind to
  ``IdentityOp``: with ``--transformer-impl local`` a ``G``, ``D`` or ``+`` layer would be an
  identity without a word), ``E`` without ``--num-experts``, ``M`` without mamba_ssm (an
  ImportError from the Mamba mixer), an empty pipeline stage, or ``|`` at PP1 (Megatron's
  "interleaved schedule" assert, which names neither the pattern nor the fix).
* ``block_grid_refusal``: ``--muonbp-block-grid RxC`` must divide every local matrix of a block
  step; the optimizer checks it at build (``plan.step_plan``, ``core.block_grid.check_grid``), on
  every rank, with a traceback. Here the same check (``check_grid``, the same line) runs on the
  local shapes the flags give, derived as megatron-core shards the weights over TP (expert TP for
  experts) and as ``catalogue.layout_of`` splits them (QKV per query group, a gated fc1 into gate
  and up, a Mamba ``in_proj`` by role). Models this derivation does not cover (MLA, MTP layers, a
  custom ``--spec``, fewer query groups than TP ranks) are left to the optimizer's check.

Called from ``startup_checks`` (the pattern, before Megatron's ``validate_args``) and from the
``validate_args`` hook after it (the grid: the sizes Megatron fills in, ``--ffn-hidden-size``,
``--kv-channels``, are known then), on every rank and so by the preflight.
"""

from __future__ import annotations

from ..core.block_grid import check_grid, parse_grid
from ..core.matrix_layout import MatrixLayout, RowSplit
from ..core.shapes import shard_shape

__all__ = ["block_grid_refusal", "hybrid_pattern_refusal", "local_matrices"]

_LAYER_NAMES = {"M": "Mamba", "G": "gated delta net", "*": "attention", "D": "DeepSeek sparse attention",
                "+": "MLA", "-": "MLP", "E": "MoE"}
"""megatron-core 0.19.2's hybrid layer symbols (``hybrid_layer_allocation.Symbols.VALID_LAYERS``)."""
_LOCAL_SPEC_LAYERS = "M*-E"
"""the layers ``hybrid.local_hybrid_stack_spec`` (``--transformer-impl local``) has modules for."""


def hybrid_pattern_refusal(args) -> str | None:
    """The line for a ``--hybrid-layer-pattern`` the model build would fail on or ignore (module
    docstring), or None; runs before Megatron's ``validate_args``."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is None:
        return None
    flag = f"--hybrid-layer-pattern {pattern!r}"
    main = pattern.split(Symbols.MTP_SEPARATOR)[0]  # an MTP part after "/" is Megatron's to check
    layers = main.replace(Symbols.PIPE, "")
    kinds = ", ".join(f"{symbol} {name}" for symbol, name in _LAYER_NAMES.items())
    if not layers:
        return f"{flag}: expected one symbol per layer ({kinds}; | between pipeline stages), got no layer"
    for symbol in main:
        if symbol not in Symbols.VALID_LAYERS and symbol != Symbols.PIPE:
            return f"{flag}: {symbol!r} is no layer symbol; expected one per layer ({kinds}; | between pipeline stages)"
    if getattr(args, "transformer_impl", "transformer_engine") == "local" and not getattr(args, "spec", None):
        for symbol in layers:
            if symbol not in _LOCAL_SPEC_LAYERS:
                return (f"{flag}: {symbol} ({_LAYER_NAMES[symbol]} layers) has no module in the local hybrid layer "
                        f"spec (--transformer-impl local builds {', '.join(_LOCAL_SPEC_LAYERS[:-1])} and "
                        f"{_LOCAL_SPEC_LAYERS[-1]} layers; megatron-core would make these identities); use "
                        "--transformer-impl transformer_engine, or drop those layers")
    stages = main.split(Symbols.PIPE)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if "" in stages:
        return (f"{flag}: pipeline stage {stages.index('') + 1} of {len(stages)} is empty (| at an end, or two in a "
                "row); expected layers between the |")
    if len(stages) > 1 and pp == 1:
        return (f"{flag}: its | cut {len(stages)} pipeline stages, but --pipeline-model-parallel-size is 1; drop the "
                f"| (one stage), or pass --pipeline-model-parallel-size {len(stages)}")
    if len(stages) > 1 and len(stages) % pp:
        return (f"{flag}: its | cut {len(stages)} pipeline stages, which do not split over "
                f"--pipeline-model-parallel-size {pp}; expected a multiple of {pp} stages (more are virtual stages)")
    if "E" in layers and not getattr(args, "num_experts", None):
        return f"{flag}: E (MoE layers) needs --num-experts; add it, or drop the E layers"
    if "M" in layers:
        from megatron.core.ssm import mamba_mixer

        if not mamba_mixer.HAVE_MAMBA_SSM:
            return (f"{flag}: M (Mamba layers) needs mamba_ssm, which is not installed (the Mamba mixer runs "
                    "its kernels; megatron-core raises an ImportError on every rank at the model build); install "
                    "mamba-ssm on a CUDA machine, or drop the M layers")
    return None


def block_grid_refusal(args) -> str | None:
    """``check_grid``'s line for the first local matrix ``--muonbp-block-grid`` does not divide,
    or None (also when the flags give no grid, or ``local_matrices`` does not cover the model);
    after Megatron's ``validate_args``."""
    grid = getattr(args, "muonbp_block_grid", None)
    if grid is None or getattr(args, "muonbp_period", None) in (None, 1):
        return None  # no block steps: refused, or not checked, by MuonConfig
    matrices = local_matrices(args)
    for lay in matrices or ():
        shapes = lay.sub_local_shapes()
        for k, shape in enumerate(shapes):
            try:  # named as plan.step_plan names them
                check_grid(lay.name if len(shapes) == 1 else f"{lay.name} (sub-matrix {k})", shape, parse_grid(grid))
            except ValueError as err:
                return str(err)
    return None


def local_matrices(args) -> list[MatrixLayout] | None:
    """One layout per kind of Muon matrix of the model the (validated) flags describe, as a TP rank
    holds it (the first layer of each kind names it), with the fused-row splits the optimizer uses;
    None where the flags describe a model this does not cover (module docstring)."""
    if (getattr(args, "multi_latent_attention", False) or getattr(args, "mtp_num_layers", None)
            or getattr(args, "spec", None) or getattr(args, "heterogeneous_layers_config_path", None)):
        return None
    tp, hidden = args.tensor_model_parallel_size, args.hidden_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    heads, kv = args.num_attention_heads, args.kv_channels
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    if groups < tp or heads % groups:
        return None  # megatron-core replicates key/value heads then; refused with the QKV split (startup_checks)
    split_fc1 = getattr(args, "muon_split_fc1", True) and getattr(args, "swiglu", False)

    def matrix(name, rows, cols, pdim, size=tp, sizes=None, groups_local=1) -> MatrixLayout:
        local = shard_shape((rows, cols), pdim, size)
        return MatrixLayout(name, local, pdim if size > 1 else None, size,
                            RowSplit(groups_local, sizes) if sizes else None)

    def mlp(prefix, ffn, size=tp) -> list[MatrixLayout]:
        gated = 2 if getattr(args, "swiglu", False) else 1
        return [matrix(f"{prefix}.linear_fc1.weight", gated * ffn, hidden, 0, size,
                       (gated * ffn // size // 2,) * 2 if split_fc1 else None),
                matrix(f"{prefix}.linear_fc2.weight", hidden, ffn, 1, size)]

    def attention(i) -> list[MatrixLayout]:
        per_group = (heads // groups * kv, kv, kv)
        if getattr(args, "muon_split_qkv_per_head", False):  # every head its own block (param_marks.per_head_split)
            per_group = (kv,) * (heads // groups + 2) * (groups // tp)
        return [matrix(f"decoder.layers.{i}.self_attention.linear_qkv.weight", (heads + 2 * groups) * kv, hidden, 0,
                       sizes=per_group if getattr(args, "muon_split_qkv", True) else None,
                       groups_local=1 if getattr(args, "muon_split_qkv_per_head", False) else groups // tp),
                matrix(f"decoder.layers.{i}.self_attention.linear_proj.weight", hidden, heads * kv, 1)]

    def moe(i) -> list[MatrixLayout]:
        skip_router = getattr(args, "moe_router_skip_muon", False)  # the router on AdamW
        out = [] if skip_router else [matrix(f"decoder.layers.{i}.mlp.router.weight", args.num_experts, hidden, None,
                                             size=1)]
        out += mlp(f"decoder.layers.{i}.mlp.experts.local_experts.0", args.moe_ffn_hidden_size, etp)
        shared = getattr(args, "moe_shared_expert_intermediate_size", None)
        return out + (mlp(f"decoder.layers.{i}.mlp.shared_experts", shared) if shared else [])

    def mamba(i) -> list[MatrixLayout]:
        head_dim, state, mgroups = args.mamba_head_dim, args.mamba_state_dim, args.mamba_num_groups
        nheads = getattr(args, "mamba_num_heads", None) or 2 * hidden // head_dim  # MambaMixer's expand=2
        d_inner = nheads * head_dim
        roles = (d_inner // tp, d_inner // tp, mgroups * state // tp, mgroups * state // tp, nheads // tp)
        in_proj = getattr(args, "muon_mamba_in_proj", None) or "split"
        out_proj = [matrix(f"decoder.layers.{i}.mixer.out_proj.weight", hidden, d_inner, 1)]
        if in_proj == "adamw":
            return out_proj
        return [matrix(f"decoder.layers.{i}.mixer.in_proj.weight", 2 * d_inner + 2 * mgroups * state + nheads, hidden,
                       0, sizes=roles if in_proj == "split" else None), *out_proj]

    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:
        layers = pattern.split("/")[0].replace("|", "")
        if set(layers) - set(_LOCAL_SPEC_LAYERS):
            return None
        build = {"*": attention, "-": lambda i: mlp(f"decoder.layers.{i}.mlp", args.ffn_hidden_size), "E": moe,
                 "M": mamba}
        kinds = {symbol: layers.index(symbol) for symbol in dict.fromkeys(layers)}  # first layer of each kind
        return [lay for symbol, i in kinds.items() for lay in build[symbol](i)]
    out = attention(0)
    freq = getattr(args, "moe_layer_freq", 1)
    moe_layers = ([i for i in range(args.num_layers) if i % freq == 0] if isinstance(freq, int)
                  else [i for i, on in enumerate(freq) if on]) if getattr(args, "num_experts", None) else []
    dense = [i for i in range(args.num_layers) if i not in moe_layers]
    if dense:
        out += mlp(f"decoder.layers.{dense[0]}.mlp", args.ffn_hidden_size)
    return out + (moe(moe_layers[0]) if moe_layers else [])
