"""A tiny real Megatron GPT for gloo ranks: build, run one step, gather full weights.

Helpers for ``dist_harness.run_world`` children (and the one-process TP=1 reference), not pytest
fixtures; megatron-core 0.19.2 layout. ``init_megatron`` / ``destroy_megatron``: CPU patches,
parallel state, seeds. ``build_tiny_gpt``: ``GPTModel`` (local spec, RoPE, SwiGLU, GQA 4 heads /
2 groups, hidden 64, ffn 128, vocab 128, seq 16, 2 layers, untied output layer) in Megatron's
``DistributedDataParallel``. ``make_batch`` / ``forward_backward``: one step's grads, the way
``train_step`` makes them. ``gather_full_params``: full fp32 weights under layout-free names.

Full weights do not depend on the layout: each matrix is drawn from a generator seeded by (seed,
its global name) and each rank keeps its TP shard (``init="by_name"``, the default).
``init="megatron"`` keeps Megatron's ``use_cpu_initialization`` draws: full matrices from the
CPU generator in build order, TP-invariant but not PP-invariant (a later stage never draws the
earlier stages' weights).
"""

from __future__ import annotations

import gc
import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN, FFN, HEADS, GROUPS, VOCAB, SEQ, LAYERS = 64, 128, 4, 2, 128, 16, 2
MOE_FFN = 32  # an expert's hidden size: fc1 gate and up 32x64, fc2 64x32 (not square)
INIT_STD = 0.02


def init_megatron(tp: int, pp: int = 1, seed: int = 1234, vpp: int | None = None, ep: int = 1,
                  etp: int | None = None):
    """Patch for CPU, build Megatron's parallel state, seed; return the ProcessGroupCollection.

    Needs an initialized default (gloo) group whose size is a multiple of ``tp * pp``; the rest
    is data parallelism. Rank order is Megatron's default "tp-cp-ep-dp-pp" (TP fastest).
    ``vpp``: virtual pipeline stages per PP rank (``--virtual-pipeline-model-parallel-size``;
    needs ``pp > 1``), so that ``get_forward_backward_func`` picks the interleaved schedule.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    _freeze_imports()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    # The tracker forks the CPU generator after the patches; seeds per TP rank as on GPUs.
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)  # spawned ranks start with different CPU RNG states
    return ProcessGroupCollection.use_mpu_process_groups()


_FROZEN = False


def _freeze_imports() -> None:
    """Once per process, before the first run: move what is alive now (torch, megatron-core and
    the patches, about a million objects) out of the collector's reach. Every teardown runs
    ``gc.collect`` (see ``destroy_megatron``), and on the unfrozen heap each call took 0.34 s of a
    0.5 s tiny-GPT run (measured, one process); frozen, it scans only what runs created. Only
    once: a later freeze could pin a previous run's DDP and its gloo groups for good."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


def destroy_megatron(release_groups: bool = True) -> None:
    """Tear down Megatron's parallel state (the default group stays up).

    ``release_groups`` (default): also destroy every process group but the default one. Megatron's
    ``destroy_model_parallel`` only forgets its groups; c10d keeps them, with their gloo threads,
    until they are destroyed, so a world that re-initializes for run after run accumulates
    threads (measured on a TP1 x DP4 rank: 60 more per run, none with this) and, at a few thousand,
    slows every later run and the machine.
    """
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    from megatron_muon.parallel.team_groups import made_groups

    ps.destroy_model_parallel()
    if release_groups:
        # megatron-muon's DP teams are kept: every rank made them in one order at an optimizer's
        # construction (team_groups.make_team_groups) and later optimizers of this world reuse
        # them, as a training process would; destroyed, the registry would hand out dead groups
        kept = {id(g) for g in made_groups()}
        for group in list(c10d._world.pg_map):
            if group is not c10d.GroupMember.WORLD and id(group) not in kept:
                dist.destroy_process_group(group)
        _drop_dispatcher_graphs()
        _forget_cached_groups()
        gc.collect()  # a gloo group's threads end with its last reference (DDP, optimizer: in cycles)


def _drop_dispatcher_graphs() -> None:
    """Detach the autograd graph that megatron-core's MoE token dispatchers keep after a step.

    ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` (megatron/core/transformer/moe/
    token_dispatcher.py:328) keeps ``self.local_probs``, the router probs with their ``grad_fn``,
    after backward. That graph reaches the params' ``AccumulateGrad`` nodes, whose post hooks
    (DDP's ``_make_backward_post_hook``) close over the DDP wrapper, which owns the MoE layer and
    its dispatcher: a cycle ``gc`` cannot break, because it does not follow a tensor's C++
    ``grad_fn`` edge. The DDP and its process groups (gloo threads) would outlive the run (57
    threads per TP1 x EP2 run at world 4). The dispatchers are only reachable through that cycle
    once the model is deleted, so they are found among ``gc``'s tracked objects.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    for obj in gc.get_objects():
        if isinstance(obj, MoETokenDispatcher):
            for name, value in list(vars(obj).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(obj, name, None)


def _forget_cached_groups() -> None:
    """Drop the references to destroyed groups that outlive ``destroy_model_parallel``.

    Each pins a gloo group (and its threads) past the run that made it: parallel_state's
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO)``, which ``destroy_model_parallel`` does
    not reset; the ``lru_cache`` on ``RotaryEmbedding.forward`` (megatron/core/models/common/
    embeddings/rotary_pos_embedding.py:177), whose keys hold the module and so its ``cp_group``;
    and the exchanges ``orthogonalize_sharded``'s cached one-off plans have bound to the group
    they exchange over (an optimizer's own plans die with it; a training process keeps its groups
    for its whole life, so only a process that re-initializes, as these tests do, sees stale entries).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_muon.parallel import orthogonalize

    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    RotaryEmbedding.forward.cache_clear()
    orthogonalize._one_off_plan.cache_clear()  # their bound exchanges go with them (weakly keyed)


def _unwrap(module):
    while hasattr(module, "module"):  # DDP -> Float16Module -> GPTModel
        module = module.module
    return module


def global_name(model, name: str) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<global>.x``; other names unchanged.

    A stage's layers are numbered from 0 in its parameter names; ``layer_number`` is global.
    """
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    if "local_experts" in parts:  # an EP rank numbers its experts from 0 too
        from megatron.core import parallel_state as ps

        at = parts.index("local_experts") + 1
        # the layer this name is in (a hybrid stack's layer 0 may hold no experts)
        layer = model.decoder.layers[int(name.split(".")[2])]
        local = len(layer.mlp.experts.local_experts)
        parts[at] = str(ps.get_expert_model_parallel_rank() * local + int(parts[at]))
    return ".".join(parts)


def is_expert(param) -> bool:
    """Megatron's mark of an expert-parallel parameter (reduced over the expert-DP group); a
    Megatron-FSDP DTensor param carries it on the module param it replaced (``orig_param``)."""
    return not getattr(getattr(param, "orig_param", param), "allreduce", True)


def shard_of(full: torch.Tensor, param, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's piece of ``full``, laid out as Megatron lays out ``param``.

    A strided param (``partition_stride`` s > 1, the gated fc1 with s=2) is cut into s*tp equal
    chunks along ``partition_dim``; rank r holds chunks r, r+tp, ... in that order, so fc1 on
    rank r is [gate_r; up_r] while the full (TP=1) matrix is [gate; up].
    """
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, stride * tp, dim=dim)
    return torch.cat(chunks[tp_rank::tp], dim=dim)


def unshard(pieces: list[torch.Tensor], param) -> torch.Tensor:
    """Inverse of ``shard_of``: the full tensor from every TP rank's piece, in rank order."""
    if not getattr(param, "tensor_model_parallel", False) or len(pieces) == 1:
        return pieces[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_rank = [torch.chunk(p, stride, dim=dim) for p in pieces]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(pieces))], dim=dim)


def _init_by_name(model, seed: int, tp_rank: int, tp: int, num_layers: int) -> None:
    """Redraw every matrix from (seed, global name); 1-D params (norm weights, ones) are kept.
    Expert matrices take their shard over the expert-TP group.

    Standard deviations follow Megatron: ``INIT_STD``, and ``INIT_STD / sqrt(2 * layers)`` for
    the output projections (linear_proj, linear_fc2).
    """
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            gname = global_name(model, name)
            # experts: their own rank and size (never overwrite the dense tp_rank / tp: after the
            # first expert matrix, every later dense matrix would be drawn at the expert-TP size)
            rank, size = ((ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
                          if is_expert(param) else (tp_rank, tp))
            std = INIT_STD
            if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
                std = INIT_STD / math.sqrt(2.0 * num_layers)
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
            param.copy_(shard_of(torch.randn(shape, generator=gen) * std, param, rank, size))


def build_tiny_gpt(
    tp: int,
    pp: int = 1,
    *,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    bucket_size: int | None = None,
    seed: int = 1234,
    init: str = "by_name",
    num_layers: int = LAYERS,
    dp_layout: str = "megatron",
    muon_config=None,
    vpp: int | None = None,
    overlap: bool = False,
    layout_bucket_size: int | None = None,
    moe: dict | None = None,
    fsdp: str | None = None,
    mla: dict | None = None,
    fsdp2: bool = False,
    fsdp2_expert_mesh: bool = False,
    hybrid: str | None = None,
    attention: dict | None = None,
) -> list:
    """The tiny GPT on this rank's TP x PP slot, wrapped like ``megatron.training.get_model``.

    ``bf16``: bf16 params inside ``Float16Module`` (as ``--bf16`` does); grads reduce in fp32.
    Returns ``[DistributedDataParallel(...)]`` (one chunk, unless ``vpp`` is given).
    ``dp_layout``: with the distributed optimizer, ``megatron`` (DDP computes megatron-core's
    layout) or ``balanced`` (ours, ``megatron_muon.megatron.layout``, for ``muon_config``'s
    splits and α), as ``--muon-dp-layout`` selects in training — with every bucket kept
    whole-matrix (``max_padding=1.0``): this 2-layer model's buckets pad more than the 5 % above
    which training would pack a bucket as megatron-core does, and the tests exist to exercise the
    whole-matrix placement (the fallback is tested in ``test_balanced_layout.py``).
    ``vpp``: virtual pipeline stages (as given to ``init_megatron``): one chunk per stage, built
    as ``get_model`` builds them (``vp_stage=i``; only the first stage of PP rank 0 embeds, only
    the last of the last PP rank has the output layer), each in its own DDP, so the list holds
    ``vpp`` chunks; ``num_layers`` must be a multiple of ``pp * vpp``.
    ``overlap``: ``--overlap-grad-reduce`` (grads reduced bucket by bucket from backward hooks,
    and ``bucket_size`` takes effect) and, with the distributed optimizer,
    ``--overlap-param-gather`` (the step leaves the param all-gather to the next forward's
    pre-hooks; call ``chunk.disable_forward_pre_hook()`` before reading the params, as Megatron
    does before a checkpoint or an evaluation).
    ``layout_bucket_size``: with the distributed optimizer, the layout (megatron-core's own,
    ``DistributedOptimizer.compute_full_param_layout``, or the balanced one) with buckets of about
    this many elements, handed to DDP: DDP drops ``bucket_size`` without ``overlap_grad_reduce``, so this is
    how a test moves the DP boundaries (each bucket is split over DP) onto the matrix it wants cut.
    ``moe``: a mixture of experts in every layer (local spec, ``SequentialMLP``): ``experts``
    (4), ``topk`` (2), ``ffn`` (``MOE_FFN`` per expert), ``shared`` (None, or the shared expert's
    hidden size), ``dispatcher`` ("allgather", Megatron's default; "alltoall" makes CUDA
    streams); no load-balancing loss, no token dropping; sequence parallelism when ``tp > 1``.
    Call after ``init_megatron(tp, pp, ep=..., etp=...)``.
    ``fsdp``: Megatron-FSDP (``--use-megatron-fsdp``) with this ``--data-parallel-sharding-strategy``
    instead of DDP, wrapped as ``get_model`` wraps it (``FullyShardedDataParallel``, the
    distributed optimizer implied); ``gradient_reduce_div_fusion`` off, as gloo has no
    ``PREMUL_SUM`` (training on gloo asks for ``--no-gradient-reduce-div-fusion``).
    ``fsdp2``: torch FSDP2 (``--use-torch-fsdp2``) instead of DDP, wrapped as ``get_model`` wraps
    it: Megatron's ``TorchFullyShardedDataParallel`` with the config ``get_megatron_ddp_config``
    makes (``TorchFullyShardedDataParallelConfig``, reshard after forward), over the DP group;
    every param becomes a DTensor sharded along dim 0 (``fully_shard`` on each transformer layer
    and the embedding, then the root), and Megatron's optimizer is the non-distributed one.
    ``fsdp2_expert_mesh``: with ``fsdp2``, megatron-muon's ``TorchFSDP2WithExpertMesh`` (each MoE
    layer's experts sharded over the expert-DP group first; what the command line builds) instead
    of megatron-core's class as it is.
    ``mla``: multi-latent attention in every layer (``MLATransformerConfig``, the local spec's
    ``MLASelfAttention`` around ``mla_attention.MLACoreAttention``, plain RoPE), its sizes:
    ``q_lora_rank`` (None: one ``linear_q_proj``), ``kv_lora_rank``, ``qk_head_dim``,
    ``qk_pos_emb_head_dim``, ``v_head_dim`` (``MLA`` by default); ``HEADS`` heads, no query groups.
    ``hybrid``: a ``HybridModel`` of this layer pattern (``*`` attention, ``-`` MLP, ``E`` MoE with
    ``moe``'s experts; ``num_layers`` must be its length) built with megatron-muon's local hybrid
    stack spec (``megatron_muon.megatron.hybrid``), instead of the ``GPTModel``; PP1, no VPP.
    ``attention``: another self-attention shape than ``HEADS`` heads in ``GROUPS`` query groups of
    ``HIDDEN // HEADS``: ``heads``, ``groups``, ``head_dim`` (``kv_channels``; the attention's
    output projection takes ``heads x head_dim`` back to ``HIDDEN``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    shape = {"heads": HEADS, "groups": GROUPS, "head_dim": HIDDEN // HEADS, **(attention or {})}
    # fewer query groups than TP ranks: megatron-core gives each TP rank a 1/TP row slice of the QKV
    assert VOCAB % tp == 0 and FFN % tp == 0 and (shape["groups"] % tp == 0 or tp % shape["groups"] == 0), \
        "tiny GPT supports tp in 1, 2, and 4 below as many query groups"
    assert num_layers % (pp * (vpp or 1)) == 0
    assert init in ("by_name", "megatron")
    assert hybrid is None or (len(hybrid) == num_layers and mla is None), hybrid
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = (MLATransformerConfig if mla is not None else TransformerConfig)(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"] if mla is None else shape["heads"],
        **(dict(kv_channels=shape["head_dim"]) if mla is None else {}),
        gated_linear_unit=True,
        activation_func=F.silu,  # with gated_linear_unit: SwiGLU
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,  # dropout would make TP layouts draw different masks
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=dtype,
        bf16=bf16,
        params_dtype=dtype,
        use_cpu_initialization=True,  # draw full matrices, keep the shard: TP-invariant
        # The fused paths are CUDA kernels (or need apex); the unfused ones are plain torch.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # MoE with TP needs sequence parallelism (MoELayer.forward refuses training without it)
        sequence_parallel=bool(moe) and tp > 1,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        **_moe_config(moe),
        **_mla_config(mla),
        # the local spec is what --transformer-impl local builds; FSDP2's wrapper reads this to
        # skip wrapping ColumnParallelLinear (inside an already sharded TransformerLayer)
        **(dict(transformer_impl="local") if fsdp2 else {}),
        **(dict(is_hybrid_model=True) if hybrid else {}),
        **(MAMBA if hybrid and "M" in hybrid else {}),
    )
    def build_chunk(vp_stage):
        first = ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        if hybrid:
            model = _hybrid_model(config, hybrid, moe, pp * (vpp or 1), first, last, vp_stage)
        else:
            model = GPTModel(
                config=config,
                transformer_layer_spec=_layer_spec(config, moe, vp_stage, mla is not None),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=first,
                post_process=last,
                share_embeddings_and_output_weights=False,
                position_embedding_type="rope",
                vp_stage=vp_stage,
            )
        if init == "by_name":
            _init_by_name(model, seed, ps.get_tensor_model_parallel_rank(), tp, num_layers)
        if bf16:
            model = Float16Module(config, model)
        if fsdp2:
            from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

            _forget_dtensor_specs()

            wrapper = TorchFullyShardedDataParallel
            if fsdp2_expert_mesh:
                from megatron_muon.megatron.fsdp2_experts import TorchFSDP2WithExpertMesh as wrapper
            return wrapper(config=config, ddp_config=TorchFullyShardedDataParallelConfig(), module=model)
        if fsdp is not None:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            fsdp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
                data_parallel_sharding_strategy=fsdp, gradient_reduce_div_fusion=False,
                overlap_grad_reduce=overlap, overlap_param_gather=overlap, bucket_size=bucket_size)
            return FullyShardedDataParallel(config=config, ddp_config=fsdp_config, module=model,
                                            device=torch.device("cpu"),
                                            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap and use_distributed_optimizer,
            use_distributed_optimizer=use_distributed_optimizer,
            bucket_size=bucket_size,
        )
        layout = None
        if use_distributed_optimizer and dp_layout == "balanced":
            from megatron_muon.config import MuonConfig
            from megatron_muon.megatron.layout import balanced_full_param_layout

            # DDP's rule: no buckets without overlap_grad_reduce (it sets bucket_size None itself)
            layout = balanced_full_param_layout(
                model, bucket_size if ddp_config.overlap_grad_reduce else layout_bucket_size,
                ps.get_data_parallel_world_size(),
                ddp_config,
                muon_config=muon_config or MuonConfig(), tp_size=tp, max_padding=1.0)
        else:
            assert dp_layout == "megatron", dp_layout
            if use_distributed_optimizer and layout_bucket_size is not None:
                from megatron.core.optimizer import DistributedOptimizer

                layout = DistributedOptimizer.compute_full_param_layout(
                    [p for p in model.parameters() if p.requires_grad], layout_bucket_size,
                    ps.get_data_parallel_world_size(), ddp_config)
        return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, full_param_layout=layout)

    return [build_chunk(i) for i in range(vpp)] if vpp else [build_chunk(None)]


def _forget_dtensor_specs() -> None:
    """Empty DTensor's sharding-propagation cache before an FSDP2 model is built in a process that
    built one before. ``DeviceMesh`` equality ignores the process group (ranks, layout, device and
    names only), so a cached output spec of an earlier run carries that run's mesh: the params of
    a new model whose shapes an earlier model had would come out of ``fully_shard`` on the earlier
    run's DP group, the others on this run's (torch 2.11; one model per process never sees it)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's


MAMBA = dict(mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16)
"""A Mamba mixer at hidden 64 (``M`` in ``hybrid``): d_inner 128 (expand 2), 8 heads of 16, 2 groups,
state 16; in_proj rows [z 128; x 128; B 32; C 32; dt 8] (each TP2-divisible). Its construction needs
``mamba_stand_ins``: megatron-core's mixer refuses to build without mamba_ssm, and no forward runs."""


def _hybrid_model(config, pattern: str, moe: dict | None, stages: int, first: bool, last: bool, vp_stage):
    """This (virtual) pipeline stage's ``HybridModel`` of ``pattern`` with the local hybrid stack
    spec the entry script uses. With ``stages`` > 1 (PP x VPP) the pattern is cut into stages with
    megatron-core's separator (``staged_pattern``: ``*-*-`` at PP2 is ``*-|*-``, at PP2 x VPP2
    ``*|-|*|-``), as a user writes ``--hybrid-layer-pattern``; megatron-core derives the virtual
    stages from the segments, rank r's chunk v holding segment v x PP + r."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon.core.models import staged_pattern
    from megatron_muon.megatron.hybrid import local_hybrid_stack_spec

    assert not config.sequence_parallel, "the local spec's torch norm refuses sequence parallelism"
    return HybridModel(config=config, hybrid_stack_spec=local_hybrid_stack_spec(
        moe.get("experts", 4) if moe else None, "RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ,
        hybrid_layer_pattern=staged_pattern(pattern, stages), share_embeddings_and_output_weights=False,
        position_embedding_type="rope", pre_process=first, post_process=last, vp_stage=vp_stage,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


class SequenceParallelTorchNorm:
    """The local spec's torch RMSNorm under sequence parallelism (test harness only).

    ``WrappedTorchNorm`` refuses ``sequence_parallel`` because its weight would miss the TP
    all-reduce of its grad (each TP rank sees only its slice of the sequence); marking the weight
    ``sequence_parallel`` is what Megatron's own norms do, and ``finalize_model_grads`` then sums
    the grad over the TP group. MoE with TP needs sequence parallelism, and apex/TE norms are not
    on this machine.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(config=plain, hidden_size=hidden_size, eps=eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _layer_spec(config, moe: dict | None, vp_stage, mla: bool = False):
    """The local spec (MoE: ``SequentialMLP`` experts; MLA: ``MLACoreAttention``), its norms
    ``SequenceParallelTorchNorm`` under sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=moe.get("experts", 4) if moe else None,
                                    moe_grouped_gemm=False, multi_latent_attention=mla)
    if mla:
        from mla_attention import MLACoreAttention

        spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


def _moe_config(moe: dict | None) -> dict:
    """``TransformerConfig`` fields of ``build_tiny_gpt``'s ``moe``."""
    if moe is None:
        return {}
    return dict(num_moe_experts=moe.get("experts", 4), moe_router_topk=moe.get("topk", 2),
                moe_ffn_hidden_size=moe.get("ffn", MOE_FFN),
                moe_shared_expert_intermediate_size=moe.get("shared"),
                moe_token_dispatcher_type=moe.get("dispatcher", "allgather"),
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=False)


MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
"""``build_tiny_gpt``'s default MLA sizes (each TP2-divisible: 4 heads, kv_down 32 + 8 rows)."""


def _mla_config(mla: dict | None) -> dict:
    """``MLATransformerConfig`` fields of ``build_tiny_gpt``'s ``mla``: plain RoPE (YaRN, the default,
    builds on ``torch.cuda.current_device()``)."""
    if mla is None:
        return {}
    return dict(MLA, **mla, rope_type="rope")


def reference_param_groups(chunk, per_head: bool = False, whole_qkv: bool = False) -> tuple[list[dict], list, list]:
    """How the one-process references (TP1) split a tiny GPT's params, as megatron-muon routes them:
    Muon groups (a fused QKV split per query group into q, k and v, or with ``per_head`` into its
    heads, each query head and each group's k and v head of head_dim rows, contiguous in
    megatron-core's layout, and MLA's q projection per head, its kv up-projection per head into k
    nope and v; a gated fc1 into [gate; up]),
    AdamW params with weight decay, and AdamW params without (biases and 1-D params: Megatron's
    standard override, wd_mult 0). The attention's shape comes from the model's config (heads, query
    groups, ``kv_channels``)."""
    from megatron_muon.core.matrix_layout import RowSplit
    from megatron_muon.megatron.catalogue import is_muon_matrix

    config = _unwrap(chunk).config
    groups, kv = config.num_query_groups, config.kv_channels  # MLA: no fused QKV, kv_channels unused
    # whole_qkv (--muon-no-split-qkv): a fused QKV is one matrix
    muon_groups, decay, no_decay = [], [], []
    for name, p in chunk.named_parameters():
        if is_muon_matrix(p):
            split = (RowSplit(groups, (config.num_attention_heads // groups * kv, kv, kv)) if "linear_qkv" in name
                     else RowSplit(1, (p.shape[0] // 2,) * 2) if "linear_fc1" in name else None)
            if per_head and "linear_qkv" in name:
                split = RowSplit(1, (kv,) * (p.shape[0] // kv))
            if whole_qkv and "linear_qkv" in name:
                split = None
            if per_head and name.endswith(("linear_q_proj.weight", "linear_q_up_proj.weight")):
                cfg = chunk.config  # MLA: per head its [nope; rope] query rows, one matrix
                split = RowSplit(1, (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim,) * HEADS)
            if per_head and name.endswith("linear_kv_up_proj.weight"):
                cfg = chunk.config  # MLA: per head its k-nope rows, then its v rows, one matrix each
                split = RowSplit(1, (cfg.qk_head_dim, cfg.v_head_dim) * HEADS)
            muon_groups.append(dict(params=[p], row_split=split))
        elif name.endswith(".bias") or p.dim() == 1:
            no_decay.append(p)
        else:
            decay.append(p)
    return muon_groups, decay, no_decay

GLOBAL_BATCH = 4
"""sequences per step of the runs that split a batch over DP ranks (``dp_slice``; DP4: one each)."""


def dp_slice(batch: dict, dp_rank: int, dp: int) -> dict:
    """DP rank ``dp_rank``'s equal share of ``batch`` (every tensor cut along dim 0)."""
    n = batch["tokens"].shape[0] // dp
    return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in batch.items()}


def make_batch(seed: int, micro_batch_size: int = 2, seq_len: int = SEQ, vocab: int = VOCAB,
               dp_rank: int | None = None) -> dict:
    """A deterministic batch: ``tokens``, ``labels`` (next tokens), ``position_ids``, all [b, s].

    ``dp_rank=None`` gives every rank the same batch; an int gives each DP rank its own.
    No attention mask: the local spec's attention is causal by its mask type.
    """
    gen = torch.Generator().manual_seed(seed * 7919 + (0 if dp_rank is None else 1 + dp_rank))
    ids = torch.randint(0, vocab, (micro_batch_size, seq_len + 1), generator=gen)
    pos = torch.arange(seq_len).unsqueeze(0).expand(micro_batch_size, -1).contiguous()
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
            "position_ids": pos}


def _model_loss(model, batch) -> torch.Tensor:
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out.float().mean()  # GPTModel returns per-token cross entropy [b, s]


def forward_backward(model_chunks: list, batch: dict, *, pp: int, num_microbatches: int = 1,
                     optimizer=None, use_schedule: bool | None = None, before_reduce=None) -> float:
    """One forward/backward as ``train_step`` runs it; returns the global batch's mean token loss
    on every rank (the last PP stage's, averaged over DP ranks).

    Grads are zeroed first, as ``train_step`` does: DDP grad buffers, ``optimizer.zero_grad()``
    if given, and ``param.grad = None`` always: ``FP32Optimizer.prepare_grads`` leaves
    ``param.grad`` aliased to ``param.main_grad``, and the next backward would add every
    gradient twice. Afterwards ``param.main_grad`` holds the DP-averaged gradient
    (``finalize_model_grads`` -> ``finish_grad_sync``), which the Megatron optimizers consume.

    ``use_schedule`` (default ``pp > 1``): Megatron's ``get_forward_backward_func()`` schedule
    (1F1B; interleaved 1F1B when ``model_chunks`` holds virtual stages, which needs
    ``num_microbatches >= pp``; or no-pipelining at pp=1) over ``num_microbatches`` slices of the batch; it divides
    each micro-batch loss by their number and calls ``config.finalize_model_grads_func``.
    Otherwise (pp=1 only): one direct model call, ``loss.backward()``, ``finalize_model_grads``.

    ``before_reduce(model_chunks)``, if given, runs after the backward and before
    ``finalize_model_grads``: a ``main_grad`` then holds this rank's local gradient, not yet
    reduced over DP (without ``--overlap-grad-reduce``, whose buckets reduce during the backward).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None
    if optimizer is not None:
        optimizer.zero_grad()
    if use_schedule is None:
        use_schedule = pp > 1
    if not use_schedule:
        assert pp == 1 and num_microbatches == 1
        loss = _model_loss(model_chunks[0], batch)
        loss.backward()
        if before_reduce is not None:
            before_reduce(model_chunks)
        finalize_model_grads(model_chunks)
        return _dp_mean(loss.detach().reshape(1))

    config = get_model_config(model_chunks[0])
    config.finalize_model_grads_func = finalize_model_grads  # as megatron.training.train does
    if before_reduce is not None:
        def finalize(*args, **kwargs):
            before_reduce(model_chunks)
            return finalize_model_grads(*args, **kwargs)
        config.finalize_model_grads_func = finalize
    b = batch["tokens"].shape[0]
    assert b % num_microbatches == 0
    mbs = b // num_microbatches
    micro = [{k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()}
             for i in range(num_microbatches)]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            # The schedule divides `loss` by num_microbatches in place: report a copy.
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    # The interleaved schedule (several chunks: virtual stages) takes one iterator per chunk and
    # draws the micro-batches from each in order; a chunk that neither embeds nor computes the
    # loss ignores what it draws (it reads its input from the previous stage).
    data = [iter(micro) for _ in model_chunks] if len(model_chunks) > 1 else iter(micro)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=batch["tokens"].shape[1],
        micro_batch_size=mbs,
        forward_only=False,
    )
    loss = torch.zeros(1)
    if ps.is_pipeline_last_stage():
        loss[0] = sum(d["loss"] for d in losses) / num_microbatches
    if pp > 1:
        pp_group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(loss, src=dist.get_global_rank(pp_group, pp - 1), group=pp_group)
    return _dp_mean(loss)


def _dp_mean(loss: torch.Tensor) -> float:
    """The loss averaged over DP ranks: the global batch's mean (equal-sized DP batches)."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    loss = loss.clone()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)


def _named_weights(chunk, model):
    """The weights the optimizer steps: the model's params, or under Megatron-FSDP its DTensor
    main weights (the module's own params may be unsharded copies whose storage is released
    between forwards)."""
    if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False):
        for name, param in chunk.param_and_grad_buffer.optimizer_named_parameters:
            while name.startswith("module."):  # relative to what Megatron-FSDP wraps (Float16Module)
                name = name[len("module."):]
            yield name, param
    else:
        yield from model.named_parameters()


def gather_fsdp_rows(param, expert: bool | None = None) -> torch.Tensor:
    """The TP-local weight of a Megatron-FSDP (or torch FSDP2) DTensor param: every DP rank's rows
    (contiguous, in DP rank order, some possibly empty; an expert's over the expert-DP group),
    concatenated. Through ``all_gather_object``, as Megatron's ``uneven_dtensor_to_full_tensor``
    all-gathers uneven pieces, which gloo refuses. ``expert``: whether it is sharded over the
    expert-DP group (None: the param's own mark; an optimizer state tensor carries none)."""
    from megatron.core import parallel_state as ps
    from torch.distributed.tensor import Shard

    local = param._local_tensor.detach().to(torch.float32, copy=True)
    names = param.device_mesh.mesh_dim_names
    # torch FSDP2's mesh (``DeviceMesh.from_group`` of the DP group) is one unnamed DP dimension
    dp_dims = [i for i, n in enumerate(names) if n.startswith("dp")] if names else [0]
    if not any(isinstance(param.placements[i], Shard) for i in dp_dims):
        return local  # no_shard: every DP rank holds all of it
    group = (ps.get_expert_data_parallel_group() if (is_expert(param) if expert is None else expert)
             else ps.get_data_parallel_group(with_context_parallel=True))
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local, group=group)
    return torch.cat([p.reshape(-1, p.shape[-1]) if p.dim() > 1 else p for p in pieces])


def gather_full_params(model_chunks: list, tp_group, pp: int) -> dict[str, torch.Tensor]:
    """{global name: full fp32 tensor} for the whole model, returned on every rank.

    TP shards are all-gathered over ``tp_group`` (experts: the expert-TP group) and reassembled
    with ``unshard`` (undoing the gated fc1's per-rank [gate_r; up_r] interleave); experts are
    exchanged over the expert-parallel group, under their global expert numbers; PP stages are
    exchanged over the pipeline group and layer numbers made global, so the keys match the TP=1,
    PP=1 model's names.
    """
    from megatron.core import parallel_state as ps

    full = {}
    experts = {}
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for name, param in _named_weights(chunk, model):
            if hasattr(param, "_local_tensor"):  # Megatron-FSDP: this DP rank's rows of the TP-local weight
                local = gather_fsdp_rows(param)
            else:
                local = param.detach().to(torch.float32, copy=True)  # never alias the live param
            group = ps.get_expert_tensor_parallel_group() if is_expert(param) else tp_group
            tp = dist.get_world_size(group)
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                pieces = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(pieces, local, group=group)
                local = unshard(pieces, param)
            (experts if is_expert(param) else full)[global_name(model, name)] = local
    if experts and ps.get_expert_model_parallel_world_size() > 1:
        ranks = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(ranks, experts, group=ps.get_expert_model_parallel_group())
        experts = {k: v for rank in ranks for k, v in rank.items()}
    full.update(experts)
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, full, group=ps.get_pipeline_model_parallel_group())
        full = {k: v for stage in stages for k, v in stage.items()}
    return full
