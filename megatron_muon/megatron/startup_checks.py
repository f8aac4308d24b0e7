"""What ``--optimizer muon`` checks before anything is built, each failure one line naming the flag.

Called by the ``validate_args`` hook (``hooks.py``) on every rank, and by ``preflight.py``
before torchrun starts, so a mistake costs seconds, not a job slot:

* ``check_supported_args``: combinations the plugin cannot run, refused by us rather than by
  whatever breaks first deep inside Megatron (``--num-distributed-optimizer-instances 2`` used
  to end in ``einops is not installed``, the precision-aware optimizer and CPU offload in
  Megatron's "only supported with adam"), and every ``--muon-*`` value (``MuonConfig``).
  Megatron's own values that its ``validate_args`` lets through and the job then fails on
  20-40 s in, with a traceback from every rank, are refused here too (``_training_rejections``).
* ``load_save_checks`` (re-exported here): ``--load``, ``--save`` and the load flags.
* the data files (``data_check.check_data_args``): every ``.bin`` as long as its ``.idx`` says.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from .cli import flag_default, flag_of, megatron_default, muon_config_from_args
from .errors import UserInputError
from .load_save_checks import (  # re-exported: the hooks and resume_config import them from here
    TRACKER,
    check_load_flags,
    check_resume,
    check_save_writable,
    checkpoints_in,
    iteration_directory,
    read_tracker,
)
from .model_shape_checks import block_grid_refusal, hybrid_pattern_refusal

__all__ = ["TRACKER", "check_load_flags", "check_model_shapes", "check_resume", "check_data_files",
           "check_save_writable", "check_supported_args", "checkpoints_in", "iteration_directory", "read_tracker",
           "te_tracks_max_logit"]


def check_supported_args(args) -> None:
    """Reject, with ``UserInputError`` naming the flag, what ``--optimizer muon`` cannot run with."""
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    rejected = [
        (args.fp16, "--fp16: not supported with --optimizer muon (loss-scaled momentum is not handled); use --bf16"),
        (not args.use_megatron_fsdp and args.ckpt_format not in ("torch", "torch_dist"),
         f"--ckpt-format {args.ckpt_format}: --optimizer muon supports torch and torch_dist "
         "(fsdp_dtensor with --use-megatron-fsdp)"),
        *_training_rejections(args),
        *_optimizer_flag_rejections(args),
        *_megatron_fsdp_rejections(args),
        *_torch_fsdp2_rejections(args),
        (getattr(args, "dump_param_to_param_group_map", None) is not None,
         "--dump-param-to-param-group-map: not supported with --optimizer muon"),
        (getattr(args, "muon_dp_mode", flag_default("muon_dp_mode")) == "redundant" and args.use_distributed_optimizer,
         "--muon-dp-mode redundant: needs whole matrices on every DP rank; "
         "drop --use-distributed-optimizer or use owner"),
        (instances != 1,
         f"--num-distributed-optimizer-instances {instances}: --optimizer muon supports 1 (one ZeRO-1 "
         "instance over the whole DP group); drop the flag"),
        (getattr(args, "use_precision_aware_optimizer", False),
         "--use-precision-aware-optimizer: not supported with --optimizer muon (Muon keeps fp32 main "
         "params and momentum); drop the flag"),
        (getattr(args, "optimizer_cpu_offload", False),
         "--optimizer-cpu-offload: not supported with --optimizer muon (Newton-Schulz runs on the GPU "
         "where the momentum lives); drop the flag"),
        # validate_args keeps --async-save only with --use-persistent-ckpt-worker, and its
        # default writer (nvrx) is a separate package: without it the worker's start fails
        # with an ImportError traceback on every rank.
        (getattr(args, "async_save", False) and getattr(args, "use_persistent_ckpt_worker", False)
         and getattr(args, "async_strategy", "mcore") == "nvrx"
         and importlib.util.find_spec("nvidia_resiliency_ext") is None,
         "--async-strategy nvrx (the default with --async-save): needs nvidia-resiliency-ext, which is not "
         "installed; pass --async-strategy mcore (megatron-core's own writer) or install it"),
    ]
    for bad, message in rejected + _qk_clip_rejections(args):
        if bad:
            raise UserInputError(message)
    message = hybrid_pattern_refusal(args)
    if message:
        raise UserInputError(message)
    try:
        muon_config_from_args(args)  # every --muon-* value, checked by MuonConfig
    except UserInputError:
        raise
    except ValueError as err:
        raise UserInputError(str(err)) from err
    for bad, message in _ignored_setting_rejections(args):  # after the values: a bad value is the first fix
        if bad:
            raise UserInputError(message)
    message = _not_a_number(args)
    if message:
        raise UserInputError(message)


def check_model_shapes(args) -> None:
    """After Megatron's ``validate_args`` (which fills in the sizes): ``--muonbp-block-grid``
    against every local matrix of the model (``model_shape_checks.block_grid_refusal``)."""
    message = block_grid_refusal(args)
    if message:
        raise UserInputError(message)


def _not_a_number(args) -> str | None:
    """A NaN in any float flag (ours or Megatron's) that no check above gave a range: NaN compares
    false with every bound, so range checks written as ``value < bound`` let it through
    (``--clip-grad nan`` would turn clipping off without a word; a NaN lr or decay spreads NaN)."""
    for dest, value in sorted(vars(args).items()):
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            shown = " ".join(str(v) for v in values)
            return f"{flag_of(dest)} {shown}: expected a number (NaN is no value of any setting)"
    return None


def _ignored_setting_rejections(args) -> list[tuple[bool, str]]:
    """Settings that the run would ignore without a word, given the rest of the command line: the
    user meant something that would not happen. "Given" is a value other than None, the parser
    default of our flags that can be ignored (``cli.py``); for Megatron's, a value other than the
    parser's default (``cli.megatron_default``)."""
    period, mult = getattr(args, "muonbp_period", None), getattr(args, "muonbp_block_lr_mult", None)
    block = getattr(args, "muonbp_block", None)
    mode = getattr(args, "muon_tp_mode", flag_default("muon_tp_mode"))
    hardware = getattr(args, "muon_auto_hardware", None)
    layout, alpha = getattr(args, "muon_dp_layout", None), getattr(args, "muon_layout_alpha", None)
    wrapper = ("--use-megatron-fsdp" if getattr(args, "use_megatron_fsdp", False) else
               "--use-torch-fsdp2" if getattr(args, "use_torch_fsdp2", False) else None)
    zero1 = getattr(args, "use_distributed_optimizer", False) and wrapper is None
    pattern = getattr(args, "hybrid_layer_pattern", None)
    unused_layout = (f"{wrapper} lays out its own buffers" if wrapper is not None else
                     "it lays out the buffers of --use-distributed-optimizer, which this run does not use")
    return [
        (mult is not None and period is None,
         f"--muonbp-block-lr-mult {mult}: needs --muonbp-period (it is the lr multiplier of MuonBP's block steps; "
         "without --muonbp-period MuonBP is off and every step is a full Muon step); add --muonbp-period P or "
         "drop the flag"),
        (mult is not None and period == 1,
         f"--muonbp-block-lr-mult {mult} with --muonbp-period 1: period 1 takes no block steps (every step is a "
         "full Muon step), so the multiplier would be ignored; drop it or use a period other than 1"),
        (block is not None and period is None,
         f"--muonbp-block {block}: needs --muonbp-period (it says what MuonBP's block steps orthogonalize; "
         "without --muonbp-period MuonBP is off); add --muonbp-period P or drop the flag"),
        (block is not None and period == 1,
         f"--muonbp-block {block} with --muonbp-period 1: period 1 takes no block steps, so the block would "
         "be ignored; drop it or use a period other than 1"),
        (hardware is not None and mode != "auto",
         f"--muon-auto-hardware {hardware}: only --muon-tp-mode auto uses it (the cost model's hardware "
         f"constants), and the mode is {mode}; drop the flag or pass --muon-tp-mode auto"),
        (layout is not None and not zero1,
         f"--muon-dp-layout {layout}: not used, since {unused_layout}; drop the flag"),
        (alpha is not None and not zero1,
         f"--muon-layout-alpha {alpha}: not used, since {unused_layout}; drop the flag"),
        (alpha is not None and zero1 and layout == "megatron",
         f"--muon-layout-alpha {alpha} with --muon-dp-layout megatron: alpha weights the balanced layout only; "
         "drop one of them"),
        (not getattr(args, "muon_split_fc1", True) and not getattr(args, "swiglu", False),
         "--muon-no-split-fc1: only a SwiGLU fc1 (--swiglu) has gate and up halves to split; drop the flag"),
        ((getattr(args, "muon_mamba_in_proj", None) or "split") != "split" and "M" not in (
            getattr(args, "hybrid_layer_pattern", None) or ""),
         f"--muon-mamba-in-proj {getattr(args, 'muon_mamba_in_proj', None)}"
         f"{' (--muon-no-split-mamba-in-proj)' if getattr(args, 'muon_mamba_in_proj', None) == 'whole' else ''}: "
         "only a Mamba layer (M in --hybrid-layer-pattern) has an in_proj to route; drop the flag"),
        (getattr(args, "moe_router_skip_muon", False) and not getattr(args, "num_experts", None) and "E" not in (
            getattr(args, "hybrid_layer_pattern", None) or ""),
         "--moe-router-skip-muon: only an MoE layer (--num-experts, or E in --hybrid-layer-pattern) has a router; "
         "drop the flag"),
        (not getattr(args, "muon_split_qkv", True) and (getattr(args, "multi_latent_attention", False) or (
            pattern is not None and "*" not in pattern)),
         "--muon-no-split-qkv: only an attention layer's fused linear_qkv has q, k and v to split, and this model "
         f"has none ({'multi-latent attention' if pattern is None else 'no * in --hybrid-layer-pattern'}); drop "
         "the flag"),
        (getattr(args, "muon_split_qkv_per_head", False) and pattern is not None and "*" not in pattern,
         "--muon-split-qkv-per-head: only an attention layer's linear_qkv (or MLA's up-projections) is split per "
         "head, and this model has none (no * in --hybrid-layer-pattern); drop the flag"),
        *[(not getattr(args, "qk_clip", False) and getattr(args, dest, None) != megatron_default(dest),
           f"--{dest.replace('_', '-')} {getattr(args, dest, None)}: only --qk-clip uses it ({what}), and this run "
           "does not clip; add --qk-clip or drop the flag")
          for dest, what in (("qk_clip_threshold", "the max attention logit above which query and key rows are "
                                                   "scaled down"),
                             ("qk_clip_alpha", "the share of the scaling on the query rows"))],
        (getattr(args, "optimizer", "muon") == "muon" and getattr(args, "sgd_momentum", None) != megatron_default(
            "sgd_momentum"),
         f"--sgd-momentum {getattr(args, 'sgd_momentum', None)}: only --optimizer sgd uses it (--optimizer muon has "
         "--muon-momentum, and AdamW for the other params); drop the flag"),
    ]


_FP32_NAMES = ("fp32", torch.float32)
"""a dtype flag's fp32, before and after Megatron's ``validate_args`` maps the name to a dtype."""


def _optimizer_flag_rejections(args) -> list[tuple[bool, str]]:
    """megatron-core 0.19.2 optimizer and DDP flags the Muon step cannot honour (the audit of every
    such flag, with each verdict: docs/megatron_optimizer.md#megatron-flags-and-the-muon-step)."""
    tp = getattr(args, "tensor_model_parallel_size", 1)
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp

    def cut_again(shards_dest: str, remat_dest: str, size: int) -> int | None:
        """the weight shards a GTP flag asks for, where it cuts a TP shard again (else None)."""
        shards, remat = getattr(args, shards_dest, None), getattr(args, remat_dest, 1) or 1
        if shards is not None and shards > size:
            return shards
        return size * remat if remat > 1 else None

    gtp, expert_gtp = (cut_again("tensor_parallel_num_weight_shards", "gtp_weight_remat_size", tp),
                       cut_again("expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size", etp))
    fsdp_main = getattr(args, "megatron_fsdp_main_params_dtype", "fp32")
    return [
        (getattr(args, "overlap_param_gather_with_optimizer_step", False),
         "--overlap-param-gather-with-optimizer-step: not supported with --optimizer muon (one Muon optimizer "
         "steps every model chunk, and Megatron's chained step asserts the first optimizer holds one chunk: it "
         "would fail at the first step); drop the flag"),
        (getattr(args, "optimizer_cuda_graph", False),
         "--optimizer-cuda-graph: not supported with --optimizer muon (the step reads the scheduled lr and "
         "weight decay, MuonBP's step kind and its step counters on the host; a captured graph would replay the "
         "capture iteration's values forever); drop the flag"),
        (gtp is not None,
         f"--tensor-parallel-num-weight-shards {gtp}: not supported with --optimizer muon (GTP weight sharding "
         "cuts each TP shard again across GTP peers, and megatron-muon would orthogonalize every slice on its "
         f"own); drop the flag or set it to --tensor-model-parallel-size {tp}"),
        (expert_gtp is not None,
         f"--expert-tensor-parallel-num-weight-shards {expert_gtp}: not supported with --optimizer muon (GTP "
         "weight sharding cuts each expert TP shard again, and megatron-muon would orthogonalize every slice on "
         f"its own); drop the flag or set it to the expert tensor-parallel size {etp}"),
        *[(getattr(args, dest, "fp32") not in _FP32_NAMES,
           f"--{dest.replace('_', '-')} {getattr(args, dest, None)}: not supported with --optimizer muon (a "
           "precision-aware-optimizer setting; Muon keeps fp32 main params, grads and state, and Megatron's "
           "OptimizerConfig would refuse it after the model is built); drop the flag")
          for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")],
        (getattr(args, "use_megatron_fsdp", False) and (fsdp_main not in (*_FP32_NAMES, "auto", None) or (
            fsdp_main in ("auto", None) and getattr(args, "bf16", False))),
         f"--megatron-fsdp-main-params-dtype {'auto' if fsdp_main is None else fsdp_main}: not supported with "
         "--optimizer muon (Muon keeps fp32 main weights and momentum; this gives 16-bit main weights"
         f"{', as the model is --bf16' if fsdp_main in ('auto', None) else ''}, and 16-bit momentum with them); "
         "pass fp32, the default"),
        (getattr(args, "freeze_all_layers", False),
         "--freeze-all-layers: not supported with --optimizer muon (no parameter is left to optimize, and "
         "megatron-muon builds no stub optimizer); drop the flag"),
    ]


def _training_rejections(args) -> list[tuple[bool, str]]:
    """Values Megatron's ``validate_args`` accepts and the job then fails on at model or optimizer
    build (megatron-core 0.19.2, measured on the tiny CPU demo): ``MuonWithAdamW`` refuses a
    negative lr or weight decay, the scheduler a run of no length, ``TransformerConfig`` heads
    that do not split over TP, and the per-group QKV split of the Muon step fewer query groups
    than TP ranks (megatron-core replicates each key/value head on several ranks then; with
    ``--muon-no-split-qkv`` or ``--muon-split-qkv-per-head`` such a run trains)."""
    def negative(value) -> bool:
        return value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0)

    lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", 0.0)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    iters, samples = getattr(args, "train_iters", None), getattr(args, "train_samples", None)
    train = not getattr(args, "skip_train", False)
    weight_decays = [(flag, getattr(args, dest, None)) for flag, dest in (
        ("--weight-decay", "weight_decay"), ("--start-weight-decay", "start_weight_decay"),
        ("--end-weight-decay", "end_weight_decay"))]
    return [
        *[(negative(value), f"{flag} {value}: expected a finite value >= 0 (the weights decay by lr x {flag})")
          for flag, value in weight_decays],
        (negative(lr), f"--lr {lr}: expected a finite value >= 0"),
        (lr is None, "--lr: not given; expected the peak learning rate (Megatron has no default for it, and the "
                     "optimizer and its lr schedule need one)"),
        # MuonWithAdamW refuses these at the optimizer build, on every rank; a NaN or negative
        # --clip-grad fails Megatron's "clip_grad > 0" and turns clipping off without a word.
        *[(negative(value) or (value is not None and value >= 1),
           f"{flag} {value}: expected a value in [0, 1) (AdamW's {what} moment decay)")
          for flag, value, what in (("--adam-beta1", getattr(args, "adam_beta1", None), "first"),
                                    ("--adam-beta2", getattr(args, "adam_beta2", None), "second"))],
        (negative(getattr(args, "adam_eps", None)), f"--adam-eps {getattr(args, 'adam_eps', None)}: expected a finite "
                                                    "value >= 0 (AdamW's denominator term)"),
        (getattr(args, "clip_grad", None) is not None and not args.clip_grad >= 0,
         f"--clip-grad {getattr(args, 'clip_grad', None)}: expected a value >= 0 (the gradient norm clipped to; 0 "
         "turns clipping off)"),
        (negative(min_lr), f"--min-lr {min_lr}: expected a finite value >= 0"),
        (lr is not None and not negative(lr) and not negative(min_lr) and min_lr > lr,
         f"--min-lr {min_lr}: expected a value <= --lr {lr} (the schedule decays from --lr to --min-lr)"),
        (train and iters is not None and iters < 1,
         f"--train-iters {iters}: expected an integer >= 1 (the run's length in iterations)"),
        (train and samples is not None and samples < 1,
         f"--train-samples {samples}: expected an integer >= 1 (the run's length in samples)"),
        (train and iters is None and samples is None,
         "--train-iters / --train-samples: expected one of them (the run's length); Megatron's lr scheduler "
         "needs it"),
        *_schedule_rejections(args, train),
        (heads is not None and tp > 1 and heads % tp != 0,
         f"--num-attention-heads {heads}: expected a multiple of --tensor-model-parallel-size {tp} (each TP "
         "rank holds whole heads)"),
        (groups is not None and heads is not None and (groups < 1 or heads % groups != 0),
         f"--num-query-groups {groups}: expected a divisor of --num-attention-heads {heads}"),
        # per head (--muon-split-qkv-per-head) trains there: each head whole on its TP rank or gathered
        # on one (param_marks.per_head_split, docs/per_head.md)
        (groups is not None and heads is not None and groups >= 1 and heads % groups == 0 and groups < tp
         and getattr(args, "muon_split_qkv", True) and not getattr(args, "muon_split_qkv_per_head", False),
         f"--num-query-groups {groups} with --tensor-model-parallel-size {tp}: expected a multiple of {tp}, or "
         "--muon-no-split-qkv (with fewer query groups than TP ranks megatron-core replicates each key/value head "
         "on several ranks, so no rank's linear_qkv shard holds whole groups for the per-group QKV split)"),
        (groups is not None and heads is not None and groups >= tp and groups % tp != 0,
         f"--num-query-groups {groups}: expected a multiple of --tensor-model-parallel-size {tp} (each TP rank "
         "holds whole query groups)"),
    ]


def _schedule_rejections(args, train: bool) -> list[tuple[bool, str]]:
    """The lr schedule's lengths: ``OptimizerParamScheduler`` asserts (bare) that the decay has at
    least one step and the warmup is shorter than the decay, after the model is built."""
    iters, samples = getattr(args, "train_iters", None), getattr(args, "train_samples", None)
    if not train or getattr(args, "lr_warmup_fraction", None) is not None:
        return []
    if iters:
        unit, length, decay_flag = "iterations", iters, "--lr-decay-iters"
        decay, warmup, warmup_flag = getattr(args, "lr_decay_iters", None), getattr(args, "lr_warmup_iters", 0), \
            "--lr-warmup-iters"
        default = f"--train-iters {iters}"
    elif samples:
        unit, length, decay_flag = "samples", samples, "--lr-decay-samples"
        decay, warmup, warmup_flag = getattr(args, "lr_decay_samples", None), getattr(args, "lr_warmup_samples", 0), \
            "--lr-warmup-samples"
        default = f"--train-samples {samples}"
    else:
        return []
    steps = length if decay is None else decay
    where = f"{decay_flag} {decay}" if decay is not None else f"{default}, as {decay_flag} is not given"
    return [
        (decay is not None and decay < 1, f"{decay_flag} {decay}: expected an integer >= 1"),
        (steps >= 1 and warmup >= steps,
         f"{warmup_flag} {warmup}: expected fewer warmup {unit} than the lr decay's {steps} ({where})"),
    ]


def _megatron_fsdp_rejections(args) -> list[tuple[bool, str]]:
    """``--use-megatron-fsdp`` under ``--optimizer muon`` (``megatron_fsdp.py``): every sharding strategy
    is exact; what is not supported yet is refused here, before Megatron-FSDP builds anything."""
    if not args.use_megatron_fsdp:
        return []
    return [
        (getattr(args, "pipeline_model_parallel_size", 1) > 1,
         f"--use-megatron-fsdp with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
         "megatron-core 0.19.2's Megatron-FSDP lays every rank of the job out as DP x TP (x EP) and fails on "
         "a pipeline (an einops shape error); use --use-distributed-optimizer"),
        (args.ckpt_format != "fsdp_dtensor",
         f"--use-megatron-fsdp: --ckpt-format {args.ckpt_format}; Megatron-FSDP saves with --ckpt-format "
         "fsdp_dtensor"),
        (getattr(args, "distributed_backend", "nccl") == "gloo" and getattr(args, "gradient_reduce_div_fusion", True),
         "--use-megatron-fsdp with --distributed-backend gloo: add --no-gradient-reduce-div-fusion (the fused "
         "division is NCCL's PREMUL_SUM, which gloo does not have)"),
        (getattr(args, "swiglu", False) and not (args.bf16 or args.fp16) and getattr(args, "save", None),
         "--use-megatron-fsdp with --swiglu in fp32: megatron-core 0.19.2's fsdp_dtensor save looks the fc1 "
         "weights up through the --bf16 wrapper (Float16Module) and fails without it; add --bf16"),
        (getattr(args, "data_parallel_sharding_strategy", None) == "no_shard" and getattr(args, "swiglu", False)
         and (getattr(args, "save", None) or getattr(args, "load", None)),
         "--data-parallel-sharding-strategy no_shard with --swiglu and --save / --load: megatron-core 0.19.2's "
         "fsdp_dtensor save and load split fc1 into gate and up through Megatron-FSDP's shard slice, which "
         "no_shard's params lack (an AttributeError at the first save or at the load); use optim, optim_grads or "
         "optim_grads_params (a checkpoint of one resumes under another)"),
    ]


def _torch_fsdp2_rejections(args) -> list[tuple[bool, str]]:
    """``--use-torch-fsdp2`` under ``--optimizer muon`` (``torch_fsdp2.py``): training is exact (every
    matrix cut by rows over DP, through the owner exchange; ``tests/megatron/test_torch_fsdp2.py``); what is
    not supported is refused here.

    Checkpoints: ``torch_dist`` saves and resumes bitwise (``tests/megatron/test_fsdp2_checkpoint.py``;
    Megatron loads it in place, the ``load_checkpoint`` hook restores the optimizer's counters,
    ``checkpoint.restore_in_place_load``). The legacy ``torch`` format cannot resume FSDP2 weights in
    megatron-core 0.19.2: its load hands them to ``TorchFullyShardedDataParallel.load_state_dict``, a
    no-op that expects torch_dist's in-place load (``torch_dcp`` is refused for every run,
    ``check_supported_args``). ``--muon-load-upstream-optimizer`` finds upstream's state by the model
    params' sharded tensors, which under FSDP2 hold the DTensors' local rows, not the params.

    Experts: exact at any EP and expert-TP size: the hooks wrap the model in
    ``TorchFSDP2WithExpertMesh``, which shards each MoE layer's experts over their expert-DP group
    (``fsdp2_experts.py``; ``tests/megatron/test_fsdp2_expert_parallel.py``), and the ``validate_args``
    hook hides EP > 1 from Megatron's own refusal of it under FSDP2."""
    if not getattr(args, "use_torch_fsdp2", False):
        return []
    checkpoints = getattr(args, "save", None) is not None or getattr(args, "load", None) is not None
    return [
        (getattr(args, "muon_dp_mode", flag_default("muon_dp_mode")) == "redundant",
         "--muon-dp-mode redundant with --use-torch-fsdp2: FSDP2 cuts every matrix by rows over DP, so no rank "
         "holds whole matrices; use owner"),
        (checkpoints and args.ckpt_format == "torch",
         "--use-torch-fsdp2 with --ckpt-format torch and --save / --load: megatron-core 0.19.2 restores FSDP2 "
         "weights only through torch_dist's in-place load (TorchFullyShardedDataParallel.load_state_dict is a "
         "no-op), so a resume would keep the new run's initial weights; use --ckpt-format torch_dist"),
        (getattr(args, "muon_load_upstream_optimizer", False),
         "--muon-load-upstream-optimizer with --use-torch-fsdp2: not supported (megatron-core's Muon does not run "
         "under FSDP2, and its state is not carried into FSDP2's row shards); use --muon-reset-optimizer-state"),
    ]


def te_tracks_max_logit() -> bool:
    """Transformer Engine >= 2.9 is installed (its attention returns the max logit)."""
    from megatron.core.utils import is_te_min_version

    return is_te_min_version("2.9.0")


def _qk_clip_rejections(args) -> list[tuple[bool, str]]:
    """``--qk-clip`` / ``--log-max-attention-logit`` under ``--optimizer muon`` (``qk_clip.py``):
    megatron-core's own checks (α in (0, 1), τ > 0) as one line, and what the plugin cannot clip.
    Without Transformer Engine >= 2.9 the local attention tracks the logit instead, so the
    ``validate_args`` hook hides the flags from Megatron's TE version assert."""
    clip, log = getattr(args, "qk_clip", False), getattr(args, "log_max_attention_logit", False)
    if not (clip or log):
        return []
    flag = "--qk-clip" if clip else "--log-max-attention-logit"
    alpha, threshold = getattr(args, "qk_clip_alpha", 0.5), getattr(args, "qk_clip_threshold", 100.0)
    impl = getattr(args, "transformer_impl", "local")
    fallback = ("upgrade (with --multi-latent-attention there is no local attention to fall back on: megatron-core "
                "0.19.2's cannot be built for MLA)" if getattr(args, "multi_latent_attention", False) else
                "use --transformer-impl local (megatron-muon tracks it there) or upgrade")
    return [
        (clip and not 0.0 < alpha < 1.0,
         f"--qk-clip-alpha {alpha}: expected a value in (0, 1) with --qk-clip (query rows get eta^alpha, key "
         "rows eta^(1-alpha))"),
        (clip and not threshold > 0, f"--qk-clip-threshold {threshold}: expected a value > 0 with --qk-clip"),
        (getattr(args, "attention_output_gate", False),
         f"{flag} with --attention-output-gate: not supported with --optimizer muon (the gate rows sit inside "
         "linear_qkv); drop one of them"),
        (impl == "transformer_engine" and not te_tracks_max_logit(),
         f"{flag} with --transformer-impl transformer_engine needs Transformer Engine >= 2.9 (it tracks the max "
         f"attention logit); {fallback}"),
    ]


def check_data_files(args) -> None:
    """``data_check.check_data_args`` (every ``.bin`` as long as its ``.idx`` says), one line."""
    from .data_check import check_data_args

    try:
        check_data_args(args)
    except UserInputError:
        raise
    except ValueError as err:
        raise UserInputError(str(err)) from err
