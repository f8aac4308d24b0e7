"""``HybridModel`` (``--hybrid-layer-pattern``), megatron-core 0.19.2's successor of ``GPTModel``.

The pattern gives one symbol per layer: ``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba (a
Llama-style 2-layer GPT is ``*-*-``). ``hybrid_model_config`` describes it as upstream's
``pretrain_hybrid.py`` does, for Megatron's ``HybridModelBuilder``, with the layer specs:

* ``--transformer-impl transformer_engine``: upstream's default stack spec (Transformer
  Engine linears, attention and norms, fused pre-norms; Mamba via mamba_ssm), or ``--spec``;
* ``--transformer-impl local``: ``local_hybrid_stack_spec`` below, the local GPT layer spec's
  parts per layer kind (what ``get_gpt_layer_local_spec`` gives a ``GPTModel``), and a Mamba layer
  of megatron-core's ``MambaMixer`` between ``ColumnParallelLinear`` / ``RowParallelLinear``.
  Upstream's ``HybridStack`` hard-codes Transformer Engine's norm for its final norm;
  ``TorchNormHybridStack`` makes the same norm with the local spec's torch norm, under the same
  name (``decoder.final_norm``), so checkpoints keep their keys.

Mamba layers need mamba_ssm's kernels (CUDA) to run a forward; attention, MLP and MoE layers run
anywhere. Routing of a Mamba mixer's parameters (docs/megatron_optimizer.md, "Model classes"):
``in_proj`` and ``out_proj`` are Muon matrices, ``in_proj`` split by role into z, x, B, C and dt
(``partition_sizes``, set by megatron-core; ``--muon-mamba-in-proj whole`` keeps it whole, ``adamw``
sends it to AdamW, as megatron-core's main branch after 0.19.2 does);
``conv1d_weight`` (3-D), ``A_log``, ``D``, ``dt_bias`` and the norms go to AdamW.
"""

from __future__ import annotations

__all__ = ["TorchNormHybridStack", "hybrid_model_config", "local_hybrid_stack_spec", "mamba_mixer_without_kernels"]

import contextlib

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec


class TorchNormHybridStack(HybridStack):
    """``HybridStack`` whose final norm is the torch norm of the local spec (``WrappedTorchNorm``:
    LayerNorm or RMSNorm as ``config.normalization`` says) instead of Transformer Engine's."""

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm  # forward applies final_norm when this is set
        if self.post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)


def local_hybrid_stack_spec(num_experts: int | None, normalization: str, qk_layernorm: bool = False) -> ModuleSpec:
    """The hybrid stack of local (non-Transformer-Engine) layers: each layer kind takes its parts
    of the local GPT layer spec (attention: input norm + self-attention; MLP and MoE: pre-MLP norm
    + MLP or MoE), and Mamba the local mixer."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm).submodules
    attention = TransformerLayerSubmodules(input_layernorm=dense.input_layernorm,
                                           self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda)
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp,
                                     mlp_bda=dense.mlp_bda)
    layers = dict(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
    )
    if num_experts:
        moe = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization,
                                       qk_layernorm=qk_layernorm).submodules
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    return ModuleSpec(module=TorchNormHybridStack, submodules=HybridStackSubmodules(**layers))


def hybrid_model_config(args):
    """Megatron's ``HybridModelConfig`` for the parsed flags, as upstream's ``pretrain_hybrid.py``
    makes it (``hybrid_config_from_args``: the pattern, ``--spec MODULE NAME`` if given), and
    ``setup_model_and_optimizer`` builds it with ``HybridModelBuilder``. Its default stack spec is
    Transformer Engine's; with ``--transformer-impl local`` and no ``--spec`` it is
    ``local_hybrid_stack_spec``."""
    from megatron.training.argument_utils import hybrid_config_from_args

    config = hybrid_config_from_args(args)
    if config.hybrid_stack_spec is None and args.transformer_impl == "local":
        config.hybrid_stack_spec = local_hybrid_stack_spec(args.num_experts, args.normalization, args.qk_layernorm)
    return config


class _GatedNormParams(torch.nn.Module):
    """mamba_ssm's ``RMSNormGated`` as the optimizer sees it: one gain of ``hidden_size`` entries."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))


@contextlib.contextmanager
def mamba_mixer_without_kernels(device):
    """Build megatron-core's ``MambaMixer`` where mamba_ssm is not installed, for what needs only its
    parameters (the dry run on the meta device, the routing tests on CPU); no forward can run.

    Inside the block: the mixer's mamba_ssm check passes, its ``torch.cuda.current_device()``
    allocations go to ``device``, and mamba_ssm's gated RMSNorm is a module with the same one
    parameter (``weight``, d_inner / TP). Every other parameter, shape and TP attribute is
    megatron-core's own. Restored on exit."""
    from megatron.core.ssm import mamba_mixer

    saved = (mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm, torch.cuda.current_device)
    mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm = True, _GatedNormParams
    torch.cuda.current_device = lambda: device
    try:
        yield
    finally:
        mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm, torch.cuda.current_device = saved
