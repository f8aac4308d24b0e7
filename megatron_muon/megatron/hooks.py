"""Ten hooks that let upstream Megatron-LM's training loop use megatron-muon (``pretrain_gpt.py``,
``pretrain_hybrid.py``).

Usage: call ``install()`` before Megatron first parses the command line
(``patches/pretrain_gpt.patch`` and ``patches/pretrain_hybrid.patch`` add exactly these two lines
to each entry)::

    import megatron_muon.megatron.hooks
    megatron_muon.megatron.hooks.install()

``install()`` (idempotent) replaces ten module attributes (``HOOKED``) of megatron-core 0.19.2's training
package, and ``sys.excepthook`` (``errors.py``: an uncaught ``UserInputError`` is one line and
exit code 2); each exists because Megatron itself would do something else:

1. ``megatron.training.arguments.add_megatron_arguments``: now also runs ``add_muon_args``.
   An ``extra_args_provider`` is not enough: Megatron parses ``sys.argv`` again without it
   (``inprocess_restart.maybe_wrap_for_inprocess_restart`` before ``parse_and_validate_args``,
   ``ft_integration.setup`` inside ``pretrain``), and those parsers would reject
   ``--muon-tp-mode owner``. Hooked here, every Megatron parser knows our flags.
2. ``megatron.training.arguments.validate_args`` (called by ``parse_and_validate_args``). For
   every optimizer but adam/sgd, Megatron rewrites ``--use-distributed-optimizer`` into its
   layer-wise distributed optimizer (``use_distributed_optimizer=False``), which also changes how
   the model's DDP buffers are built. megatron-muon runs inside Megatron's real ZeRO-1
   ``DistributedOptimizer``, so with ``--optimizer muon`` the wrapper shows ``validate_args``
   ``optimizer='adam'`` (every other check runs as for Adam) and restores ``'muon'`` after.
   Before, ``startup_checks.check_supported_args`` refuses what the plugin does not support and
   checks every ``--muon-*`` value (``MuonConfig``) and the values of Megatron's own flags that
   would fail later; after, ``check_resume`` refuses a ``--load`` that would silently start from
   scratch or names no iteration, ``resume_config`` a checkpoint whose recorded settings this
   command line cannot honour (model shapes, padded vocabulary, optimizer),
   ``check_save_writable`` (rank 0) a ``--save`` that cannot be written, and ``data_check`` the
   data files. With another optimizer only a megatron-muon checkpoint's optimizer state is
   refused (``resume_config.check_other_optimizer``). Megatron's own
   failed checks (``assert``s) become one line too. It records ``args.megatron_muon`` (True: the
   plugin runs). The parser's ``error`` prints one line instead of the 1,500-line usage.
3. ``megatron.training.training.get_megatron_optimizer`` (the name ``setup_model_and_optimizer``
   calls). A dispatcher: ``get_megatron_muon_optimizer`` when the plugin runs, else the original.
4. ``megatron.training.training.training_log``: with ``--muon-log-stats`` the iteration log line
   ends with what the last optimizer step did (``stats_text``: kind — muon, or MuonBP's full /
   block — bytes sent, orthogonalize time); and, every ``--tensorboard-log-interval``, Megatron's
   TensorBoard and W&B writers (when configured) get the same figures as ``muon/*`` scalars.

5. ``megatron.training.training.wrap_model_chunks_with_ddp`` (``get_model`` wraps the model
   chunks in DDP with it): with ``--use-distributed-optimizer`` and ``--muon-dp-layout balanced``
   (the default) it is handed ``layout.ddp_with_balanced_layout`` as its DDP class, so each
   chunk's buffer gets our layout (every Muon matrix whole in one DP shard) instead of
   ``DistributedOptimizer.compute_full_param_layout``'s. Megatron's own seam: DDP accepts a
   ``full_param_layout``, which is how its layer-wise optimizer lays out its buffers.
   With ``--use-torch-fsdp2`` it is handed ``fsdp2_experts.TorchFSDP2WithExpertMesh`` instead of
   megatron-core's ``TorchFullyShardedDataParallel``: each MoE layer's experts sharded over their
   expert-DP group, which makes experts exact at any EP and expert-TP size (2. shows Megatron's
   ``validate_args``, which refuses EP > 1 under FSDP2, EP1 for that, ``_hide_fsdp2_expert_parallelism``).
   ``megatron.training.models.dist_utils._ddp_wrap`` (10.) is the same seam on the other path.
   Before the optimizer is built, ``check_balanced_layout_applied`` refuses in one line a DDP
   chunk that neither hook laid out, so the layout asked for is never silently megatron-core's.

6. ``megatron.training.yaml_arguments.validate_yaml``: Megatron's experimental ``--yaml-cfg``
   validates with it instead of ``validate_args``, so none of the above would run; with
   ``--optimizer muon`` it is refused at startup, pointing at ``yaml_config``.
7. ``megatron.training.training.save_checkpoint``: a persistent synchronous save's files hashed
   as they are written, the checksums written after (``integrity``). A balanced-layout optimizer is saved
   ``fully_reshardable`` whatever was asked; the hook asks for it, so Megatron's own "Storing
   distributed optimizer sharded state of type ..." line names the format written.
8. ``megatron.training.training.load_checkpoint``: checksums verified (sizes before the load, each
   rank's reads as it reads them), a TP/PP change Megatron refuses explained in one line, and
   after it the loaded main params and optimizer state are checked finite and the main params
   against the same checkpoint's model weights (``integrity.check_main_params_match_weights``).
   Under ``--use-torch-fsdp2`` Megatron loads a torch_dist checkpoint in place and skips the
   optimizer's ``load_state_dict``; the counters and param-group settings it would restore are
   restored here from the common state (``checkpoint.restore_in_place_load``).
   ``--muon-reset-optimizer-state`` (fresh optimizer state, the LR schedule kept) and
   ``--muon-load-upstream-optimizer`` (megatron-core Muon's state carried over) replace the
   optimizer part of the load (``reset_state.py``); a checkpoint of the other implementation
   (megatron-core's Muon / megatron-muon) is refused in one line naming them. This hook also
   runs for upstream's optimizers (the reset serves them too).
9. ``megatron.training.training.clip_qk`` (``train_step`` calls it after ``optimizer.step()``
   with ``--qk-clip`` or ``--log-max-attention-logit``): with the plugin it clips nothing — the
   optimizer's step already clipped the main params (``qk_clip.py``) — and returns the max logit
   for the log. ``validate_args`` (2.) hides those two flags from Megatron's "TE >= 2.9" assert
   when Transformer Engine is older or absent (the local attention's logit is tracked by us).
   With ``--muon-log-stats`` the log line also gets the clipped heads and the max logit.

10. ``megatron.training.models.dist_utils._ddp_wrap``: when ``pretrain`` is given a
    ``ModelConfig`` (``GPTModelConfig`` / ``HybridModelConfig``: upstream's ``pretrain_gpt.py`` and
    ``pretrain_hybrid.py`` on core_r0.19.0 and main, and ``scripts/pretrain_gpt.py``),
    ``setup_model_and_optimizer`` builds the model with the config's builder and wraps it in DDP
    here, not in ``get_model``. For the call, the module's ``DistributedDataParallel`` is
    ``layout.ddp_with_balanced_layout`` (as 5.); under FSDP2 its ``TorchFullyShardedDataParallel`` is
    ``TorchFSDP2WithExpertMesh`` (as 5.); Megatron-FSDP and the layer-wise optimizer keep theirs.

``--optimizer dist_muon`` (deprecated upstream) and the other emerging optimizers keep upstream's
implementations, and none of the checks above applies to them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import traceback

import torch

from .cli import add_muon_args, muon_config_from_args
from .errors import UserInputError, install_excepthook, print_error
from .log_stats import norm_text, norms_for_log, plan_first_step, plan_next_step, stats_text, write_scalars
from .resume_config import check_other_optimizer, check_resume_config
from .startup_checks import check_data_files as check_data
from .startup_checks import (
    check_load_flags,
    check_model_shapes,
    check_resume,
    check_save_writable,
    check_supported_args,
    te_tracks_max_logit,
)

__all__ = ["install"]

ACTIVE = "megatron_muon"  # attribute on Megatron's args: True when --optimizer muon uses the plugin
_ORIGINAL = "__megatron_muon_original__"  # marks (and keeps the original of) a wrapped function


def _megatron_validation_error(err: Exception) -> UserInputError:
    """Megatron's own check failed (mostly ``assert``s): its message, or the failing line, as one line."""
    message = str(err).strip()
    if not message:  # a bare assert: name the check that failed
        frame = traceback.extract_tb(err.__traceback__)[-1]
        message = f"{type(err).__name__} at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line}"
    return UserInputError(f"Megatron's validate_args: {message}")


def _wrap_validate_args(validate_args):
    @functools.wraps(validate_args)
    def wrapper(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if args.optimizer != "muon":
            if getattr(args, "muon_tp_mode", None) in ("owner", "auto") and "muon" in args.optimizer:
                raise UserInputError(f"--muon-tp-mode {args.muon_tp_mode}: needs --optimizer muon "
                                     f"(megatron-muon), not {args.optimizer}")
            setattr(args, ACTIVE, False)
            check_load_flags(args)
            result = validate_args(args, defaults)
            check_other_optimizer(args)  # a megatron-muon checkpoint's state read by another optimizer
            return result
        check_supported_args(args)
        args.optimizer = "adam"  # keep --use-distributed-optimizer as Megatron's distributed optimizer
        # Megatron asserts TE >= 2.9 for --qk-clip / --log-max-attention-logit (only TE tracked the
        # logit); ours tracks it in the local attention too, and check_supported_args has made
        # Megatron's other two checks (alpha, threshold) and refused TE attention without 2.9.
        hidden = {name: True for name in ("qk_clip", "log_max_attention_logit") if getattr(args, name, False)}
        if hidden and te_tracks_max_logit():
            hidden = {}
        for name in hidden:
            setattr(args, name, False)
        expert_parallel = _hide_fsdp2_expert_parallelism(args)
        try:
            result = validate_args(args, defaults)
        except (AssertionError, ValueError, TypeError) as err:
            if isinstance(err, UserInputError):
                raise
            raise _megatron_validation_error(err) from err
        finally:
            args.optimizer = "muon"
            for name, value in hidden.items():
                setattr(args, name, value)
            if expert_parallel:
                args.expert_model_parallel_size = expert_parallel
        if expert_parallel:
            _check_fsdp2_expert_parallelism(args)
        check_model_shapes(args)  # needs the sizes validate_args fills in
        check_resume_config(args, check_resume(args))
        check_load_flags(args)
        if getattr(args, "rank", 0) == 0:  # one probe per job: when rank 0 exits 2, torchrun stops the others
            check_save_writable(args)
        check_data(args)
        setattr(args, ACTIVE, True)
        if getattr(args, "rank", 0) == 0:
            print("megatron-muon: --optimizer muon runs megatron_muon (validated as adam so that "
                  "--use-distributed-optimizer keeps Megatron's distributed optimizer)", flush=True)
        return result

    setattr(wrapper, _ORIGINAL, validate_args)
    return wrapper


def _hide_fsdp2_expert_parallelism(args) -> int:
    """``--use-torch-fsdp2`` with ``--expert-model-parallel-size`` > 1: set EP to 1 for Megatron's
    ``validate_args`` and return the EP size to restore after it (0: nothing hidden).

    megatron-core 0.19.2's ``validate_args`` asserts '--use-torch-fsdp2 is not supported with expert
    parallelism' because its ``TorchFullyShardedDataParallel`` shards experts over the DP-CP mesh;
    under megatron-muon the model is wrapped in ``TorchFSDP2WithExpertMesh`` (``fsdp2_experts``), which
    shards them over their expert-DP group. Nothing else in that ``validate_args`` derives a value
    from the EP size: it checks ``num_experts`` against it and, under FSDP2, adds ``ep_dp`` to
    ``high_priority_stream_groups``; ``_check_fsdp2_expert_parallelism`` does both after it."""
    ep = getattr(args, "expert_model_parallel_size", 1)
    if not getattr(args, "use_torch_fsdp2", False) or ep <= 1:
        return 0
    args.expert_model_parallel_size = 1
    return ep


def _check_fsdp2_expert_parallelism(args) -> None:
    """What Megatron's ``validate_args`` does with an EP size > 1 and did not see (the EP was hidden
    from it, ``_hide_fsdp2_expert_parallelism``): its two checks, in its words, and the expert-DP
    group among the high-priority stream groups of an FSDP run."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        raise UserInputError("Megatron's validate_args: num_experts must be non None to use expert model parallelism")
    if args.num_experts % ep:
        raise UserInputError("Megatron's validate_args: Number of experts should be a multiple of expert model "
                             "parallel_size.")
    groups = args.high_priority_stream_groups
    if groups is not None and "ep_dp" not in groups:
        groups.append("ep_dp")


def _wrap_validate_yaml(validate_yaml):
    """Megatron's experimental ``--yaml-cfg`` replaces ``validate_args`` by ``validate_yaml``:
    none of the plugin's checks would run, so ``--optimizer muon`` refuses it here, at startup."""
    @functools.wraps(validate_yaml)
    def wrapper(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if getattr(args, "optimizer", None) == "muon":
            raise UserInputError(
                "--yaml-cfg: Megatron's experimental YAML config skips validate_args and every "
                "megatron-muon check; pass the config as flags: python -m megatron_muon.megatron.yaml_config "
                "CONFIG.yaml (configs/README.md)")
        return validate_yaml(args, defaults)

    setattr(wrapper, _ORIGINAL, validate_yaml)
    return wrapper


def _wrap_get_megatron_optimizer(get_megatron_optimizer):
    @functools.wraps(get_megatron_optimizer)
    def dispatcher(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                   pg_collection=None, dump_param_to_param_group_map=None):
        if config.optimizer == "muon":
            from megatron.training import get_args

            from .optimizer import get_megatron_muon_optimizer

            args = get_args()
            active = getattr(args, ACTIVE, None)
            if active is None:
                raise RuntimeError(
                    "--optimizer muon: megatron_muon.megatron.hooks.install() must run before "
                    "parse_and_validate_args (and --yaml-cfg is not supported)"
                )
            if active:
                check_balanced_layout_applied(args, config, model_chunks)
                if getattr(args, "use_torch_fsdp2", False) and (args.save is not None or args.load is not None):
                    from megatron.core.utils import get_model_config

                    from .torch_fsdp2 import fsdp2_checkpoint_refusal

                    message = fsdp2_checkpoint_refusal(
                        ((n, p) for chunk in model_chunks for n, p in chunk.named_parameters()),
                        getattr(get_model_config(model_chunks[0]), "gated_linear_unit", False))
                    if message:  # at startup: the save would fail only after training up to it
                        raise UserInputError(message)
                optimizer = get_megatron_muon_optimizer(
                    config, model_chunks, muon_config_from_args(args),
                    config_overrides=config_overrides, pg_collection=pg_collection,
                    use_gloo_process_groups=use_gloo_process_groups,
                )
                _BUILT[:] = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [])]
                plan_first_step(_BUILT, args)
                _CLIPS[:] = [o.qk_clip for o in getattr(optimizer, "chained_optimizers", [])
                             if getattr(o, "qk_clip", None) is not None]
                return optimizer
        return get_megatron_optimizer(
            config, model_chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map,
        )

    setattr(dispatcher, _ORIGINAL, get_megatron_optimizer)
    return dispatcher


_BUILT: list = []  # the MuonWithAdamW optimizers the dispatcher built (for the log line)
_CLIPS: list = []  # their qk_clip.QKClip, with --qk-clip / --log-max-attention-logit


def _wrap_training_log(training_log):
    """With --muon-log-stats, Megatron's iteration line gets ``stats_text`` appended: the line
    is built inside ``training_log`` and printed by ``print_rank_last``, so that name is
    redirected for the duration of the call only."""
    from megatron.training import training

    @functools.wraps(training_log)
    def wrapper(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        on_log_iteration = iteration % max(1, getattr(margs, "tensorboard_log_interval", 1)) == 0
        active = getattr(margs, ACTIVE, False) and bool(_BUILT)
        first = kwargs.get("is_first_iteration", False)
        prints = iteration % margs.log_interval == 0 or first
        norms = {}
        if active:  # decided alike on every rank (the run's arguments and the iteration): collectives
            norms = norms_for_log(_BUILT, margs, iteration, first)
            plan_next_step(_BUILT, margs, iteration)  # whether the next step computes its norms
            if on_log_iteration:
                write_scalars(_BUILT, iteration, norms)
        args, kwargs = _max_logit_read(args, kwargs, on_log_iteration)
        if not (getattr(margs, ACTIVE, False) and getattr(margs, "muon_log_stats", False) and _BUILT):
            return training_log(*args, **kwargs)
        printer = training.print_rank_last
        qk_text = ""
        if _CLIPS and prints:
            # a reduction over the model-parallel group, on every rank, on the iterations that print
            # (training_log's own condition for the iteration line)
            qk_text = "".join(clip.log_text() for clip in _CLIPS)

        def print_with_stats(message):
            if " iteration " in message and message.rstrip().endswith("|"):
                message = message.rstrip() + stats_text(_BUILT) + norm_text(norms) + qk_text
            printer(message)

        training.print_rank_last = print_with_stats
        try:
            return training_log(*args, **kwargs)
        finally:
            training.print_rank_last = printer

    setattr(wrapper, _ORIGINAL, training_log)
    return wrapper


_MAX_LOGIT_ARG = 10
"""``training_log``'s positional index of ``max_attention_logit`` (megatron-core 0.19.2)."""


def _max_logit_read(args: tuple, kwargs: dict, on_log_iteration: bool) -> tuple[tuple, dict]:
    """``training_log``'s arguments with the max logit (a device tensor from ``_wrap_clip_qk``)
    read to the host on the iterations it is written (TensorBoard / W&B), and only then: the
    one host sync it costs falls where Megatron already syncs to print the losses."""
    value = kwargs.get("max_attention_logit", args[_MAX_LOGIT_ARG] if len(args) > _MAX_LOGIT_ARG else None)
    if not isinstance(value, torch.Tensor):
        return args, kwargs
    value = float(value) if on_log_iteration else 0.0  # not written on other iterations
    if "max_attention_logit" in kwargs:
        return args, {**kwargs, "max_attention_logit": value}
    return (*args[:_MAX_LOGIT_ARG], value, *args[_MAX_LOGIT_ARG + 1:]), kwargs


def _wrap_clip_qk(clip_qk):
    """``training.py`` calls ``clip_qk(model, log_max_only=not args.qk_clip)`` after
    ``optimizer.step()``. With the plugin, the clip has already run inside the step, on the main
    params (``qk_clip.py``), so this clips nothing: it returns this rank's max logit of the last
    step for ``--log-max-attention-logit``'s scalar (0.0 without it) as a device tensor, without
    the host sync upstream's makes every step; ``training_log``'s wrapper reads it on the
    iterations that write it (``_max_logit_read``)."""
    @functools.wraps(clip_qk)
    def wrapper(model, log_max_only=False):
        from megatron.training import get_args

        margs = get_args()
        if not getattr(margs, ACTIVE, False):
            return clip_qk(model, log_max_only=log_max_only)
        if not getattr(margs, "log_max_attention_logit", False):
            return 0.0
        values = [clip.last_max_logit.float() for clip in _CLIPS if clip.last_max_logit is not None]
        return torch.stack(values).max() if values else 0.0

    setattr(wrapper, _ORIGINAL, clip_qk)
    return wrapper


def _one_line_parser_error(parser):
    """argparse's ``error`` prints the whole usage first (about 1,500 lines for Megatron's parser)
    and does so on every rank; this prints the error alone, once, and exits 2 as argparse does."""
    def error(message):
        print_error(f"{parser.prog}: {message} (see --help)")
        sys.exit(2)

    return error


def _wrap_add_megatron_arguments(add_megatron_arguments):
    @functools.wraps(add_megatron_arguments)
    def wrapper(parser):
        parser = add_muon_args(add_megatron_arguments(parser))
        parser.error = _one_line_parser_error(parser)
        return parser

    setattr(wrapper, _ORIGINAL, add_megatron_arguments)
    return wrapper


def _wrap_save_checkpoint(save_checkpoint):
    """After Megatron has written a persistent, synchronous checkpoint: its checksums (integrity.py)."""
    @functools.wraps(save_checkpoint)
    def wrapper(iteration, *args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        optimizer = kwargs.get("optimizer", args[1] if len(args) > 1 else None)
        # A balanced-layout buffer is saved fully_reshardable whatever was asked
        # (MuonDistributedOptimizer.sharded_state_dict); asking for it here makes Megatron's own
        # "Storing distributed optimizer sharded state of type ..." line name the format written.
        switch = (getattr(margs, ACTIVE, False) and not margs.dist_ckpt_optim_fully_reshardable
                  and any(getattr(o, "saves_fully_reshardable", False) and not getattr(o, "is_stub_optimizer", False)
                          for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]))
        if switch:
            margs.dist_ckpt_optim_fully_reshardable = True
        from .integrity import hashing_writes, unchecked_async_save, write_checksums
        persistent = getattr(margs, ACTIVE, False) and margs.save and not kwargs.get("non_persistent_ckpt", False)
        checksummed = persistent and not getattr(margs, "async_save", False)
        try:  # the files' items hashed as megatron-core writes them: nothing is read back
            with hashing_writes() if checksummed else contextlib.nullcontext() as written:
                result = save_checkpoint(iteration, *args, **kwargs)
        finally:
            if switch:
                margs.dist_ckpt_optim_fully_reshardable = False
        if checksummed:
            from megatron.training.checkpointing import get_checkpoint_name, print_rank_0

            directory = get_checkpoint_name(margs.save, iteration, release=False, return_base_dir=True)
            if os.path.isdir(directory):
                print_rank_0(write_checksums(directory, written).report())
        elif persistent:  # --async-save
            from megatron.training.checkpointing import get_checkpoint_name, print_rank_0

            print_rank_0(unchecked_async_save(get_checkpoint_name(margs.save, iteration, release=False,
                                                                  return_base_dir=True)))
        return result

    setattr(wrapper, _ORIGINAL, save_checkpoint)
    return wrapper


def _wrap_load_checkpoint(load_checkpoint):
    """Around Megatron's load: checksums verified before (integrity.py), a TP/PP change under a
    format that cannot reshard explained in one line (resharding.py), and the loaded state
    checked finite after. ``--muon-reset-optimizer-state`` / ``--muon-load-upstream-optimizer``
    replace the optimizer part of the load (reset_state.py), and a checkpoint one implementation's
    optimizer cannot read from the other's (megatron-core's Muon and megatron-muon) is refused in
    one line naming them — with upstream's optimizers too, which load through this hook as well."""
    @functools.wraps(load_checkpoint)
    def wrapper(ddp_model, optimizer, opt_param_scheduler, *args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        active = getattr(margs, ACTIVE, False)
        reset = getattr(margs, "muon_reset_optimizer_state", False)
        upstream = getattr(margs, "muon_load_upstream_optimizer", False)
        load_arg = kwargs.get("load_arg", args[0] if args else "load")
        load_dir = getattr(margs, load_arg, None)
        has_tracker = bool(load_dir) and os.path.isfile(os.path.join(load_dir, "latest_checkpointed_iteration.txt"))
        if not (active or reset) and not (has_tracker and not margs.no_load_optim):
            return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *args, **kwargs)
        from megatron.training.checkpointing import get_load_checkpoint_path_by_args, print_rank_0

        from . import reset_state
        from .checkpoint import in_place_optimizer_load, restore_in_place_load
        from .integrity import check_finite_state, check_main_params_match_weights, verify_checksums
        from .resharding import explain_load_error

        directory = None
        if has_tracker:
            directory = get_load_checkpoint_path_by_args(margs, load_arg)  # collective (read_metadata)
        common = checked = None
        if directory is not None and os.path.isdir(directory):
            if active:  # sizes and the small files now; the .distcp items as Megatron reads them
                checked = verify_checksums(directory)
            # torch_dist's common state is small; a legacy checkpoint's rank-0 file is the whole
            # rank's state, read only when a flag needs it
            if reset or upstream or getattr(margs, "ckpt_format", "torch_dist") == "torch_dist":
                common = reset_state.load_common_state(margs, load_dir)
            _refuse_foreign_optimizer_state(margs, load_dir, common, reset or upstream)
            if upstream and not reset_state.is_upstream_muon_checkpoint(common):
                written = "megatron-muon" if reset_state.is_plugin_checkpoint(common) else \
                    f"--optimizer {getattr(common.get('args') if common else None, 'optimizer', '?')}"
                raise UserInputError(f"--muon-load-upstream-optimizer: --load {load_dir} was written by {written}, "
                                     "not by megatron-core's Muon; drop the flag")
            if not (active or reset):
                return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *args, **kwargs)
        try:
            with checked.reading() if checked else contextlib.nullcontext():
                if reset or upstream:
                    result = reset_state.load_with_fresh_optimizer(load_checkpoint, margs, ddp_model, optimizer,
                                                                   opt_param_scheduler, common, *args, **kwargs)
                else:
                    result = load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *args, **kwargs)
        except Exception as err:
            message = explain_load_error(err) if active else None
            if message is None:
                raise
            raise UserInputError(message) from err
        if checked:
            print_rank_0(checked.report())
        if directory is not None and common is not None and upstream:
            counts = reset_state.load_upstream_optimizer_state(optimizer, ddp_model, directory, common)
            notes = reset_state.settings_differences(margs, common["args"])
            fresh = counts["fresh"]
            print_rank_0(
                f"megatron-muon: --muon-load-upstream-optimizer: megatron-core Muon's state carried over from "
                f"{directory} (this rank: {counts['muon']} Muon momentum buffers, {counts['adamw']} Adam moment pairs, "
                f"{counts['main']} fp32 main params, step {counts['step']}); "
                + (f"fresh: {', '.join(fresh)}; " if fresh else "")
                + (f"settings changed: {'; '.join(notes)}" if notes else "Muon settings as saved"))
        elif reset and directory is not None:
            print_rank_0(f"megatron-muon: --muon-reset-optimizer-state: weights, iteration and LR/WD schedule from "
                         f"{directory}; optimizer state fresh (momentum and Adam moments zero, step 0)")
        if (active and directory is not None and optimizer is not None and not reset and not upstream
                and in_place_optimizer_load(margs, common)):
            restored = restore_in_place_load(optimizer, common["optimizer"])
            print_rank_0(f"megatron-muon: --use-torch-fsdp2: Megatron loaded the optimizer's tensors in place; its "
                         f"step {restored['step']} and muon_steps {restored['muon_steps']} restored from {directory}")
        if active and directory is not None and optimizer is not None and not margs.no_load_optim and not reset:
            check_finite_state(optimizer, ddp_model, directory)
            check_main_params_match_weights(optimizer, directory)
        return result

    setattr(wrapper, _ORIGINAL, load_checkpoint)
    return wrapper


def _upstream_name(ckpt_args) -> str:
    """The --optimizer a checkpoint's run was started with (validate_args saves dist_muon as muon
    with the layer-wise optimizer)."""
    return "dist_muon" if getattr(ckpt_args, "use_layer_wise_distributed_optimizer", False) else ckpt_args.optimizer


def _refuse_foreign_optimizer_state(margs, load_dir: str, common, replaced: bool) -> None:
    """One line instead of the error the other implementation's state would end in deep inside
    Megatron's load (plugin → upstream: "Expected 2 entries in state dict, but got 5"; upstream →
    plugin: "Could not find parameter group"), naming the flag that loads it."""
    from . import reset_state

    if margs.no_load_optim or getattr(margs, "finetune", False) or replaced or common is None:
        return
    if getattr(margs, ACTIVE, False) and reset_state.is_upstream_muon_checkpoint(common):
        raise UserInputError(
            f"--load {load_dir}: written by megatron-core's own Muon (--optimizer "
            f"{_upstream_name(common['args'])} without megatron-muon), whose optimizer state megatron-muon does not "
            "read as its own; add --muon-load-upstream-optimizer (momentum and Adam moments carried over) or "
            "--muon-reset-optimizer-state (fresh optimizer state); docs/checkpoints.md")
    if not getattr(margs, ACTIVE, False) and reset_state.is_plugin_checkpoint(common):
        # validate_args rewrites dist_muon into muon with the layer-wise optimizer
        optimizer = _upstream_name(margs)
        raise UserInputError(
            f"--load {load_dir}: written by megatron-muon (--optimizer muon with the plugin), whose optimizer "
            f"state megatron-core's --optimizer {optimizer} cannot read; add --muon-reset-optimizer-state "
            "(weights, iteration and LR schedule; fresh optimizer state) or resume with megatron-muon; "
            "docs/checkpoints.md")


def _wrap_wrap_model_chunks_with_ddp(wrap_model_chunks_with_ddp):
    @functools.wraps(wrap_model_chunks_with_ddp)
    def wrapper(model_chunks, config, ddp_config, *args, **kwargs):
        from megatron.training import get_args, training

        margs = get_args()
        dp_class = kwargs.get("DP", training.DDP)
        if getattr(margs, ACTIVE, False):  # the routing marks before DDP: the buffer layout reads them too
            from .catalogue import tag_routing

            tag_routing(model_chunks, muon_config_from_args(margs))
        if getattr(margs, ACTIVE, False) and training.HAVE_FSDP2 and dp_class is training.torch_FSDP:
            from .fsdp2_experts import TorchFSDP2WithExpertMesh

            kwargs["DP"] = TorchFSDP2WithExpertMesh
        if (getattr(margs, ACTIVE, False) and dp_class is training.DDP and ddp_config.use_distributed_optimizer
                and not kwargs.get("use_layer_wise_distributed_optimizer", False)):
            muon_config = muon_config_from_args(margs)
            if muon_config.dp_layout in ("balanced", "priced"):
                from .layout import ddp_with_balanced_layout

                kwargs["DP"] = ddp_with_balanced_layout(muon_config)
        return wrap_model_chunks_with_ddp(model_chunks, config, ddp_config, *args, **kwargs)

    setattr(wrapper, _ORIGINAL, wrap_model_chunks_with_ddp)
    return wrapper


def _wrap_ddp_wrap(ddp_wrap):
    """``megatron.training.models.dist_utils._ddp_wrap``: the DDP wrap of Megatron's
    ``ModelConfig`` builders (``GPTModelBuilder`` / ``HybridModelBuilder.build_distributed_models``,
    what ``setup_model_and_optimizer`` runs when ``pretrain`` is given a model config, as upstream's
    ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` do). It constructs the module-level
    ``DistributedDataParallel``; for the balanced layout that name is our factory for the call."""

    signature = inspect.signature(ddp_wrap)
    # what selects another wrapper than plain DDP (the last one only on Megatron-LM main)
    other_wrappers = ("use_megatron_fsdp", "use_torch_fsdp2", "use_layer_wise_distributed_optimizer")

    @functools.wraps(ddp_wrap)
    def wrapper(*args, **kwargs):
        from megatron.training import get_args
        from megatron.training.models import dist_utils

        call = signature.bind(*args, **kwargs).arguments
        margs = get_args()
        if getattr(margs, ACTIVE, False):  # the routing marks before DDP: the buffer layout reads them too
            from .catalogue import tag_routing

            tag_routing(call["model"], muon_config_from_args(margs))
        if getattr(margs, ACTIVE, False) and call.get("use_torch_fsdp2"):
            from .fsdp2_experts import TorchFSDP2WithExpertMesh

            megatron_fsdp2 = dist_utils.TorchFullyShardedDataParallel
            dist_utils.TorchFullyShardedDataParallel = TorchFSDP2WithExpertMesh
            try:
                return ddp_wrap(*args, **kwargs)
            finally:
                dist_utils.TorchFullyShardedDataParallel = megatron_fsdp2
        if (getattr(margs, ACTIVE, False) and call["ddp_config"].use_distributed_optimizer
                and not any(call.get(name) for name in other_wrappers)):
            muon_config = muon_config_from_args(margs)
            if muon_config.dp_layout in ("balanced", "priced"):
                from .layout import ddp_with_balanced_layout

                megatron_ddp = dist_utils.DistributedDataParallel
                dist_utils.DistributedDataParallel = ddp_with_balanced_layout(muon_config)
                try:
                    return ddp_wrap(*args, **kwargs)
                finally:
                    dist_utils.DistributedDataParallel = megatron_ddp
        return ddp_wrap(*args, **kwargs)

    setattr(wrapper, _ORIGINAL, ddp_wrap)
    return wrapper


def check_balanced_layout_applied(args, config, model_chunks) -> None:
    """``--muon-dp-layout balanced`` or ``priced`` (the default) with the distributed optimizer: the module every
    DDP chunk wraps must carry ``layout.BALANCED_MARK`` (set by ``balanced_full_param_layout``). A
    chunk without it was wrapped on a path neither DDP hook reaches, and would train on
    megatron-core's layout while the run says balanced."""
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return
    layout = muon_config_from_args(args).dp_layout
    if not getattr(config, "use_distributed_optimizer", False) or layout not in ("balanced", "priced"):
        return
    from .checkpoint import laid_out_by_muon

    for index, chunk in enumerate(model_chunks):
        if not laid_out_by_muon(chunk):
            raise UserInputError(
                f"--muon-dp-layout {layout}: model chunk {index} ({type(chunk).__name__}) was wrapped in DDP "
                "outside megatron.training's get_model / ModelConfig builders, so its buffers have "
                "megatron-core's layout; build it with full_param_layout=megatron_muon.megatron.layout."
                "balanced_full_param_layout(...), or pass --muon-dp-layout megatron")


_HOOKS = (
    ("megatron.training.arguments", "add_megatron_arguments", _wrap_add_megatron_arguments),
    ("megatron.training.arguments", "validate_args", _wrap_validate_args),
    ("megatron.training.yaml_arguments", "validate_yaml", _wrap_validate_yaml),
    ("megatron.training.training", "get_megatron_optimizer", _wrap_get_megatron_optimizer),
    ("megatron.training.training", "training_log", _wrap_training_log),
    ("megatron.training.training", "clip_qk", _wrap_clip_qk),
    ("megatron.training.training", "wrap_model_chunks_with_ddp", _wrap_wrap_model_chunks_with_ddp),
    ("megatron.training.models.dist_utils", "_ddp_wrap", _wrap_ddp_wrap),
    ("megatron.training.training", "save_checkpoint", _wrap_save_checkpoint),
    ("megatron.training.training", "load_checkpoint", _wrap_load_checkpoint),
)

HOOKED = tuple((module, name) for module, name, _ in _HOOKS)
"""Every ``(module, attribute)`` that ``install`` replaces (tests restore them after a test)."""


def install() -> None:
    """Install the hooks into ``megatron.training``; calling it again changes nothing."""
    import importlib

    for module_name, name, wrap in _HOOKS:
        module = importlib.import_module(module_name)
        if not hasattr(getattr(module, name), _ORIGINAL):
            setattr(module, name, wrap(getattr(module, name)))
    install_excepthook()
