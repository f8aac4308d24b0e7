"""The Megatron adapter: Muon on megatron-core's own optimizer wrappers and buffers.

``get_megatron_muon_optimizer(config, model_chunks, muon_config)`` builds what
``megatron.core.optimizer.get_megatron_optimizer`` would build for Adam — param groups from
Megatron's ``_get_param_groups`` (so the LR scheduler, weight-decay multipliers, grad clipping
and found-inf skipping work unchanged), wrapped in Megatron's ``DistributedOptimizer``
(ZeRO-1: reduce-scatter, shard main params, param all-gather, all Megatron's) or in its
``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` — with one inner
``MuonWithAdamW`` instead of Adam, built once on the wrapper's main params from the catalogue
of every Muon matrix (``catalogue.py``: which params are Muon matrices and where each one's DP
pieces and TP shards live), so its step can orthogonalize whole matrices (``parallel/orthogonalize.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    _get_param_groups_and_buffers,
    get_standard_config_overrides,
)
from megatron.core.optimizer.grad_scaler import ConstantGradScaler
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_pg_rank

from ..config import MuonConfig
from ..optimizer import MuonWithAdamW, prepare_optimizers
from ..parallel.step_setup import broadcast_hardware
from .catalogue import (
    describe_megatron_fsdp,
    describe_whole,
    describe_zero1,
    is_muon_matrix,
    packed_in_backprop_order,
    param_names,
    tag_fsdp_experts,
    tag_grouped_experts,
    tag_qkv,
    tag_routing,
)
from .checkpoint import (
    MuonCheckpointMixin,
    check_saved_extents,
    laid_out_by_muon,
    prepare_for_checkpointing,
    rechain_loaded_state,
)
from .cli import muon_config_from_args
from .megatron_fsdp import MuonFSDPOptimizer, fsdp_dtensor_part, is_fsdp_dtensor_state, merge_fsdp_dtensor_states
from .qk_clip import build_qk_clip
from .report import print_startup_report
from .resharding import BALANCED_FROM_DP_RESHARDABLE
from .torch_fsdp2 import keep_fsdp2_expert_rows_main

__all__ = ["MuonChainedOptimizer", "MuonDistributedOptimizer", "get_megatron_muon_optimizer"]


class MuonDistributedOptimizer(MuonCheckpointMixin, DistributedOptimizer):
    """Megatron's ZeRO-1 ``DistributedOptimizer`` with a ``MuonWithAdamW`` inside.

    Megatron's buffers, reduce-scatter and param all-gather are untouched; each DP rank keeps
    momentum only for its own range (as it keeps Adam state). The inner optimizer is built on
    the main shards this class makes, from the catalogue of every Muon matrix
    (``catalogue.describe_zero1``: every DP rank's range of it, by Megatron's own range
    function), so the inner step can send cut matrices to one DP owner.

    Checkpointing (``MuonCheckpointMixin``, ``checkpoint.py``): Megatron's formats, with Muon's
    momentum stored as ``exp_avg`` (and a zero ``exp_avg_sq``) so it reshards like Adam state;
    after a load the model params are re-gathered from the main shards on every DP replica.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_saved_extents(self.buffers, param_names(self.model_chunks))  # any layout, ours or a caller's
        self.packed_like_megatron = all(packed_in_backprop_order(buffer) for buffer in self.buffers)
        """True when every bucket holds its params back to back in backprop order, padding only at
        its end (megatron-core's own layout): what the ``dp_reshardable`` checkpoint format assumes."""
        self.saves_fully_reshardable = not self.packed_like_megatron or any(
            laid_out_by_muon(chunk) for chunk in self.model_chunks)
        """Saves are written ``fully_reshardable`` whatever was asked: a layout ``dp_reshardable``
        cannot describe, or any layout ``--muon-dp-layout balanced`` / ``priced`` chose (even one
        packed as megatron-core packs it), so that its checkpoints reshard as they did when every
        such layout was whole matrices: across DP, EP and layout changes alike."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, sharding_type=None,
                           metadata=None):
        """Megatron's, except that a buffer not laid out as megatron-core lays it out (the
        balanced layout) cannot use ``dp_reshardable`` — that format stores each bucket as one
        flat range, assuming params back to back and padding only at the end. Such a save is
        written as ``fully_reshardable`` instead (per model param: any layout, any DP size
        loads it; megatron-core 0.19.2's other model-space format, ``fully_sharded_model_space``,
        fails its own ``flattened_range`` check); the checkpoint's metadata records the format,
        so ``load_checkpoint`` reads it back the same way. Loading a ``dp_reshardable``
        checkpoint into such a layout is refused in one line. Without CUDA a ``fully_reshardable``
        save always gathers through gloo (as ``--distrib-optim-fully-reshardable-mem-efficient``
        asks), since Megatron's default gather needs a CUDA device (``tests/megatron/test_resharding.py``)."""
        if metadata is None:  # Megatron's deprecated sharding_type argument becomes metadata, as upstream reads it
            metadata = {} if sharding_type is None else {"distrib_optim_sharding_type": sharding_type}
        kind = metadata.get("distrib_optim_sharding_type")
        if kind == "dp_reshardable" and not self.is_stub_optimizer:
            if is_loading and not self.packed_like_megatron:
                raise RuntimeError(BALANCED_FROM_DP_RESHARDABLE)  # the preflight says it first (resume_config)
            if not is_loading and self.saves_fully_reshardable:
                metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        if (metadata.get("distrib_optim_sharding_type") == "fully_reshardable" and not is_loading
                and not self.is_stub_optimizer and self.optimizer.device.type != "cuda"):
            # Megatron's default gather for this format (mem_efficient False:
            # get_parameter_state_dp_zero(use_gloo_comm=False)) allocates on
            # torch.cuda.current_device() and all-gathers `send_tensor.cuda()`, so a save without
            # CUDA raises "Found no NVIDIA driver" unless --distrib-optim-fully-reshardable-mem-efficient
            # is given. That variant gathers the same state through the gloo DP group (onto DP
            # rank 0, which writes it); Megatron loads either ("interchangeable", its docstring),
            # and the metadata written with the checkpoint records the variant used. Loading
            # gathers nothing (empty_data), so it needs neither.
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        return super().sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

class MuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ``ChainedOptimizer``, with the checkpoint format of its optimizer state decided
    once for the whole chain, before Megatron's own code reads it.

    ``MuonDistributedOptimizer.sharded_state_dict`` saves a buffer laid out by ``--muon-dp-layout
    balanced`` as ``fully_reshardable`` and records that in the checkpoint's metadata. Megatron's
    chain decides from the same metadata, before it asks its optimizers, whether their keys get a
    ``chained_<i>.`` prefix (not for ``fully_reshardable``): switched inside the first optimizer,
    a save with two optimizers (dense and experts) wrote prefixed keys that its own load, reading
    ``fully_reshardable`` back, looked for without the prefix. Here the switch happens first.

    Its found-inf check (``prepare_grads``, only with a grad scaler: ``--loss-scale``) is
    Megatron's: each optimizer's flag all-reduced over its grad-stats group, the chain's flags
    ORed. The Muon step's collectives span the DP group (the owner exchange), the expert DP group
    and the DP teams, so the decision must be the same on every rank (a rank that skipped would
    leave its peers waiting in an all-to-all), and it is, by what the flag reads: the grads
    after the DP reduction. Without the distributed optimizer DDP all-reduces every grad before
    the step (dense over the DP x CP group, experts over the expert DP group; Megatron-FSDP's
    ``no_shard`` likewise), so every DP replica holds the same reduced grads, and a sum with a
    NaN or inf term is NaN or inf: a non-finite local grad on any DP rank is non-finite on every
    DP rank. The grad-stats group (TP x PP; experts: expert TP x EP x PP) holds one rank of each
    model shard, so every DP replica's flag is the same (the grad norm's clip relies on the same
    invariant). Under torch FSDP2 each DP rank holds only its own rows of each grad, and
    DTensor's ``_amp_foreach_non_finite_check_and_unscale_`` reduces the flag over FSDP2's DP
    mesh itself (MAX over its ``Shard`` dimension) before Megatron's reduction over the
    grad-stats group: the two groups the grad norm reduces over. With the distributed optimizer
    the grad-stats group is every rank (``intra_dist_opt_group``). No collective over the
    default group is added (``tests/megatron/test_per_step_costs.py``)."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        metadata = kwargs.get("metadata")
        if (metadata or {}).get("distrib_optim_sharding_type") == "fsdp_dtensor" and len(self.chained_optimizers) > 1:
            # Megatron-FSDP's format is one optimizer's, keyed by global param name: Megatron's
            # fsdp_dtensor code (handle_swiglu_in_state_dict) reads its "state"; a chain's
            # {0: ..., 1: ...} would not be found there
            return merge_fsdp_dtensor_states([o.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
                                              for o in self.chained_optimizers])
        if (not is_loading and metadata is not None and metadata.get("distrib_optim_sharding_type") == "dp_reshardable"
                and any(getattr(o, "saves_fully_reshardable", False) and not getattr(o, "is_stub_optimizer", False)
                        for o in self.chained_optimizers)):
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"  # recorded with the checkpoint
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state_dict):
        """Megatron's, after ``checkpoint.rechain_loaded_state``: a checkpoint of a chain of another
        length (saved at EP2, dense and experts, loaded at EP1, one optimizer; or the reverse) is
        given to each optimizer as its own state dict; the same length passes through unchanged."""
        if is_fsdp_dtensor_state(state_dict) and len(self.chained_optimizers) > 1:
            for optimizer in self.chained_optimizers:  # each its own params' part, by name
                optimizer.load_state_dict(fsdp_dtensor_part(state_dict, optimizer.param_names()))
            return
        groups = [o.optimizer.state_dict()["param_groups"] if not getattr(o, "is_stub_optimizer", False) else []
                  for o in self.chained_optimizers]
        super().load_state_dict(rechain_loaded_state(state_dict, groups))


class MainParamGroups(torch.optim.Optimizer):
    """The param groups a Megatron wrapper turns into main params, held while it does.

    Megatron's ``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params`` and
    ``FP32Optimizer`` take an inner optimizer and replace its params with the main params they
    make. The Muon optimizer's plan needs those main params (which DP range of which matrix each
    one is), so this holds the groups during the wrapper's construction and the adapter then
    builds ``MuonWithAdamW`` once, on them. It is never stepped: the adapter replaces it before
    the wrapper is returned."""

    def __init__(self, param_groups) -> None:
        super().__init__(param_groups, {"algorithm": "adamw"})  # MuonWithAdamW's default, for describe()

    def step(self, closure=None):
        raise RuntimeError("MainParamGroups.step: this holds param groups during construction; "
                           "the adapter replaces it with MuonWithAdamW before anything steps")


def _check_supported(config: OptimizerConfig, model_chunks) -> None:
    if config.fp16:
        raise ValueError("--fp16: Muon does not support fp16 (loss-scaled momentum is not handled); use --bf16")
    ddp = model_chunks[0].ddp_config
    if getattr(ddp, "num_distributed_optimizer_instances", 1) > 1:
        raise ValueError("--num-distributed-optimizer-instances > 1: not supported with Muon yet")
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            # A depthwise convolution's filters ([channels, 1, kernel], a Mamba mixer's
            # conv1d_weight) are no stack of matrices: AdamW, as upstream routes every non-2-D tensor.
            depthwise = p.dim() == 3 and p.shape[1] == 1
            if p.requires_grad and p.dim() > 2 and not depthwise:
                # TE >= 2.14's single grouped weight holds every local expert's matrix in one
                # tensor; routed by dimension it would silently go to AdamW.
                raise ValueError(
                    f"{name} has shape {tuple(p.shape)}: Muon takes 2-D matrices; a grouped expert weight "
                    "(moe_single_grouped_weight) is not supported with Muon, use per-expert weights")


def _build(config: OptimizerConfig, model_chunks, param_groups, buffers, muon_config: MuonConfig, *,
           expert: bool, groups: dict, tp_group, data_parallel_group_idx: int, hardware=None):
    """One Megatron optimizer (ZeRO-1, Megatron-FSDP or whole-matrix) around one ``MuonWithAdamW``,
    for the dense params (``expert`` False) or the expert-parallel ones, with the groups Megatron's
    ``get_megatron_optimizer`` gives each: DP over ``intra_dp_cp_group`` or
    ``intra_expt_dp_group``, TP over the (expert) TP group."""
    # Megatron's wrappers make their main params (ZeRO-1 shards, fp32 copies, Megatron-FSDP's
    # DTensors) from an inner optimizer's param groups and write them back into it. They do that
    # on a ``MainParamGroups``; the one ``MuonWithAdamW`` is then built on those groups, with the
    # catalogue of their matrices, and takes its place before anything can step.
    main_params = MainParamGroups(param_groups)
    grad_scaler = ConstantGradScaler(config.loss_scale) if config.loss_scale else None
    dp_group = groups["intra_expt_dp_group" if expert else "intra_dp_cp_group"]
    ddp_config = model_chunks[0].ddp_config
    if getattr(ddp_config, "use_megatron_fsdp", False):
        strategy = ddp_config.data_parallel_sharding_strategy
        optimizer = MuonFSDPOptimizer(
            main_params, config, grad_scaler, _init_state,
            model_chunks=model_chunks,
            per_model_buffers=buffers,
            data_parallel_group=groups["dp_cp_group"],
            data_parallel_group_gloo=groups["intra_dp_cp_group_gloo"],
            data_parallel_group_idx=data_parallel_group_idx,
            distributed_optimizer_instance_id=0,
        )
        # Megatron's: no_shard's grads are whole on every DP rank, so their norm is over TP x PP
        # only; the experts' over expert-TP x EP x PP (Megatron's one optimizer would reduce them
        # over TP x PP and miss the other EP ranks' experts)
        no_shard = "expt_tp_pp_with_egtp_remat_group" if expert else "mp_group"
        optimizer.grad_stats_parallel_group = groups[no_shard if strategy == "no_shard" else "intra_dist_opt_group"]
        catalogue, matrix_of = describe_megatron_fsdp(optimizer, tp_group, muon_config)
    elif config.use_distributed_optimizer:
        optimizer = MuonDistributedOptimizer(
            main_params, config, grad_scaler, _init_state,
            model_chunks=model_chunks,
            per_model_buffers=buffers,
            data_parallel_group=dp_group,
            data_parallel_group_gloo=groups["intra_expt_dp_group_gloo" if expert else "intra_dp_cp_group_gloo"],
            data_parallel_group_idx=data_parallel_group_idx,
            distributed_optimizer_instance_id=0,
        )
        optimizer.grad_stats_parallel_group = groups["intra_dist_opt_group"]
        catalogue, matrix_of = describe_zero1(optimizer, tp_group, muon_config)
    else:
        if config.bf16:
            optimizer = Float16OptimizerWithFloat16Params(main_params, config, grad_scaler, _init_state)
        else:
            optimizer = FP32Optimizer(main_params, config, _init_state)
        # Megatron's: the model-parallel group the grads differ over (experts: TP x EP x PP)
        optimizer.grad_stats_parallel_group = groups["expt_tp_pp_with_egtp_remat_group" if expert else "mp_group"]
        catalogue, matrix_of = describe_whole(model_chunks, dp_group, tp_group, muon_config, expert=expert)
    optimizer.optimizer = MuonWithAdamW(
        main_params.param_groups, lr=config.lr, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, config=muon_config,
        decoupled_weight_decay=config.decoupled_weight_decay, catalogue=catalogue, hardware=hardware,
        prepare=False)  # prepared with the chain's other optimizer, in get_megatron_muon_optimizer
    prepare_for_checkpointing(optimizer.optimizer)
    optimizer.optimizer.norms_group = optimizer.get_grad_stats_parallel_group()  # the log's norms: as the grad norm
    optimizer.matrix_of_param = matrix_of
    """id(model param) → (its layout, this rank's main tensor of it): what QK-clip scales."""
    return optimizer


def get_megatron_muon_optimizer(
    config: OptimizerConfig,
    model_chunks: list,
    muon_config: MuonConfig | None = None,
    config_overrides: dict | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    use_gloo_process_groups: bool = True,
) -> ChainedOptimizer:
    """Muon for a Megatron model, in the style of ``get_megatron_optimizer``.

    ``config.use_distributed_optimizer`` selects ``MuonDistributedOptimizer`` (ZeRO-1);
    otherwise Megatron's ``Float16OptimizerWithFloat16Params`` (bf16) or ``FP32Optimizer``.
    Returns a ``ChainedOptimizer``, as Megatron's factory does: of one optimizer, or of two for
    a model with expert-parallel params (MoE experts under EP or an expert-TP size of their
    own), built as Megatron builds its expert optimizer — the ``expert_parallel_buffers``, ZeRO-1
    and the DP owner exchange over the expert-data-parallel group, the TP modes over the
    expert-TP group; every local expert's matrix (``SequentialMLP``: its own ``linear_fc1``, split
    into gate and up, and ``linear_fc2``) is orthogonalized on its own.

    The Muon settings: ``muon_config`` when given — it is explicit, so it wins over any
    ``config.muon_*`` field that differs from it (the training hooks pass the one built from
    the command line, where both come from the same flags). Without it they come from
    ``config``'s upstream fields (``muon_momentum``, ``muon_tp_mode``, ``muon_coefficient_type``,
    ...) through the CLI's own translation (``cli.muon_config_from_args``: ``OptimizerConfig``
    has the flags' attribute names), and the plugin's own settings that ``OptimizerConfig``
    lacks (``dp_mode``, ``dp_layout``, ``split_fc1``, ...) take their defaults.
    ``config.decoupled_weight_decay`` False gives L2 weight decay on both algorithms
    (``MuonWithAdamW``).
    """
    muon_config = _muon_config(config, muon_config)
    _check_supported(config, model_chunks)
    tag_fsdp_experts(model_chunks)
    keep_fsdp2_expert_rows_main(model_chunks)  # torch FSDP2 with experts: their checkpoint rows
    tag_qkv(model_chunks)
    tag_grouped_experts(model_chunks)
    tag_routing(model_chunks, muon_config)
    overrides = dict(get_standard_config_overrides(config) if config_overrides is None else config_overrides)
    overrides[ParamKey(predicate=ParamPredicate(name="muon_matrix", fn=is_muon_matrix))] = {"algorithm": "muon"}
    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
        pg_collection, model_chunks, use_gloo_process_groups
    )
    tp_group = pg_collection.tp if pg_collection is not None else _tp_group()
    expert_tp_group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else _tp_group(True)
    expert_tp_group = tp_group if expert_tp_group is None else expert_tp_group
    param_groups, buffers = _get_param_groups_and_buffers(
        model_chunks, 0, config, overrides, lambda g: not g["is_expert_parallel"], "buffers"
    )
    # auto's constants, resolved once: global rank 0's on every rank (the plans must agree)
    hardware = broadcast_hardware(muon_config.hardware()) if muon_config.tp_mode == "auto" else None
    optimizers = [_build(config, model_chunks, param_groups, buffers, muon_config, expert=False, groups=groups,
                         tp_group=tp_group, data_parallel_group_idx=get_pg_rank(groups["mp_group"]),
                         hardware=hardware)]
    expert_groups, expert_buffers = _get_param_groups_and_buffers(
        model_chunks, 0, config, overrides, lambda g: g["is_expert_parallel"], "expert_parallel_buffers"
    )
    if expert_groups:
        optimizers.append(_build(
            config, model_chunks, expert_groups, expert_buffers, muon_config, expert=True, groups=groups,
            tp_group=expert_tp_group,
            data_parallel_group_idx=get_pg_rank(groups["expt_tp_pp_with_egtp_remat_group"]), hardware=hardware))
    # Every group the steps use made (DP teams: by every rank, in one order), the plans checked
    # across each DP and TP group, the groups warmed up: once, here, for the whole chain (a stage
    # without experts has one optimizer, the others two; the call is the same on every rank).
    setup = prepare_optimizers([o.optimizer for o in optimizers],
                               labels=["the dense optimizer", "the expert optimizer"][:len(optimizers)],
                               timeout=_distributed_timeout(),
                               existing_groups=_reusable_groups(groups, tp_group, expert_tp_group, pg_collection))
    for optimizer in optimizers[:-1]:  # Megatron-FSDP: the last installs the model's weights
        if isinstance(optimizer, MuonFSDPOptimizer):
            optimizer.installs_model_weights = False
    for optimizer in optimizers:  # Megatron's two attributes, on every optimizer of the chain
        optimizer.tp_group = tp_group
        optimizer.expert_tp_group = expert_tp_group
        optimizer.qk_clip = None
        """``qk_clip.QKClip`` with ``--qk-clip`` / ``--log-max-attention-logit`` (the dense optimizer's:
        attention is dense): runs after every inner step."""
    dense = optimizers[0]
    dp_group = groups["intra_dp_cp_group"]
    dense.qk_clip = build_qk_clip(model_chunks, dense.matrix_of_param, dp_group, get_pg_rank(dp_group),
                                  log_group=groups["mp_group"])
    if dense.qk_clip is not None:
        # after the fp32 update, before Megatron copies main params into the model (and gathers them)
        dense.optimizer.register_step_post_hook(dense.qk_clip.after_step)
    experts = None
    if len(optimizers) > 1:
        experts = (optimizers[1].optimizer.plans, parallel_state.get_expert_model_parallel_world_size())
    print_startup_report(dense.optimizer.plans, model_chunks, muon_config,
                         pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                         pp=parallel_state.get_pipeline_model_parallel_world_size(), experts=experts, setup=setup)
    return MuonChainedOptimizer(optimizers)


def _distributed_timeout():
    """Megatron's ``--distributed-timeout-minutes`` as a timedelta, when its arguments are parsed
    (a training job, which has imported ``megatron.training``: not imported here for a caller
    without it); None otherwise (torch's default, what a caller's own groups get too)."""
    import sys
    from datetime import timedelta

    global_vars = sys.modules.get("megatron.training.global_vars")
    minutes = getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "distributed_timeout_minutes", None)
    return timedelta(minutes=minutes) if minutes else None


def _reusable_groups(groups: dict, tp_group, expert_tp_group, pg_collection) -> list:
    """Megatron's groups a DP team may be equal to (and then reuses): the optimizer's groups
    (not the gloo ones: the step's tensors are on the GPU), the TP groups, the EP group."""
    ep = (getattr(pg_collection, "ep", None) if pg_collection is not None
          else parallel_state.get_expert_model_parallel_group(check_initialized=False))
    return [g for key, g in groups.items() if not key.endswith("_gloo")] + [tp_group, expert_tp_group, ep]


def _muon_config(config: OptimizerConfig, muon_config: MuonConfig | None) -> MuonConfig:
    """``muon_config`` itself, or the one ``config``'s ``muon_*`` fields describe."""
    if muon_config is not None:
        if not isinstance(muon_config, MuonConfig):
            raise ValueError(f"get_megatron_muon_optimizer: muon_config: expected a MuonConfig or None, "
                             f"got {type(muon_config).__name__}")
        return muon_config
    try:
        return muon_config_from_args(config)
    except ValueError as err:  # the message names the flag; say where its value came from
        raise ValueError(f"get_megatron_muon_optimizer: no muon_config given, so the OptimizerConfig muon_* "
                         f"fields are used: {err}") from err


def _tp_group(expert: bool = False):
    if expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return parallel_state.get_tensor_model_parallel_group()


def _init_state(opt: MuonWithAdamW, config: Any = None) -> None:
    """Create every param's state before a checkpoint is written or read."""
    opt.init_state()
