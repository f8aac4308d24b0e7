"""Three hooks that let upstream Megatron-LM's training loop (``pretrain_gpt.py``) use megatron-muon.

Usage: call ``install()`` before Megatron first parses the command line
(``patches/pretrain_gpt.patch`` adds exactly these two lines to ``pretrain_gpt.py``)::

    import megatron_muon.megatron.hooks
    megatron_muon.megatron.hooks.install()

``install()`` (idempotent) replaces five module attributes of megatron-core 0.19.2's training
package; each exists because Megatron itself would do something else:

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
   ``optimizer='adam'`` (every other check runs as for Adam) and restores ``'muon'`` after. It
   re-imposes the checks Megatron makes for emerging optimizers that this skips, rejects what the
   plugin does not support, and builds the ``MuonConfig`` once, so a bad flag fails at startup
   with a one-line error naming it. It records ``args.megatron_muon`` (True: the plugin runs).
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

``--optimizer dist_muon`` (deprecated upstream) and the other emerging optimizers keep upstream's
implementations. ``--yaml-cfg`` bypasses ``validate_args``; with it ``--optimizer muon`` is
refused by the dispatcher (the hook did not run).
"""

from __future__ import annotations

import functools

from .cli import add_muon_args, muon_config_from_args

__all__ = ["install"]

ACTIVE = "megatron_muon"  # attribute on Megatron's args: True when --optimizer muon uses the plugin
_ORIGINAL = "__megatron_muon_original__"  # marks (and keeps the original of) a wrapped function


def check_supported_args(args) -> None:
    """Reject, with ``ValueError`` naming the flag, what ``--optimizer muon`` cannot run with."""
    rejected = [
        (args.fp16, "--fp16: not supported with --optimizer muon (loss-scaled momentum is not handled); use --bf16"),
        (args.use_megatron_fsdp,
         "--use-megatron-fsdp: not supported with --optimizer muon; use --use-distributed-optimizer"),
        (args.use_torch_fsdp2,
         "--use-torch-fsdp2: not supported with --optimizer muon; use --use-distributed-optimizer"),
        (args.ckpt_format not in ("torch", "torch_dist"),
         f"--ckpt-format {args.ckpt_format}: --optimizer muon supports torch and torch_dist"),
        (getattr(args, "dump_param_to_param_group_map", None) is not None,
         "--dump-param-to-param-group-map: not supported with --optimizer muon"),
        (getattr(args, "muon_dp_mode", "owner") == "redundant" and args.use_distributed_optimizer,
         "--muon-dp-mode redundant: needs whole matrices on every DP rank; "
         "drop --use-distributed-optimizer or use owner"),
    ]
    for bad, message in rejected:
        if bad:
            raise ValueError(message)
    muon_config_from_args(args)  # every --muon-* value, checked by MuonConfig


def _wrap_validate_args(validate_args):
    @functools.wraps(validate_args)
    def wrapper(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if args.optimizer != "muon":
            if getattr(args, "muon_tp_mode", None) in ("owner", "auto") and "muon" in args.optimizer:
                raise ValueError(f"--muon-tp-mode {args.muon_tp_mode}: needs --optimizer muon (megatron-muon), "
                                 f"not {args.optimizer}")
            setattr(args, ACTIVE, False)
            return validate_args(args, defaults)
        check_supported_args(args)
        args.optimizer = "adam"  # keep --use-distributed-optimizer as Megatron's distributed optimizer
        try:
            result = validate_args(args, defaults)
        finally:
            args.optimizer = "muon"
        setattr(args, ACTIVE, True)
        if getattr(args, "rank", 0) == 0:
            print("megatron-muon: --optimizer muon runs megatron_muon (validated as adam so that "
                  "--use-distributed-optimizer keeps Megatron's distributed optimizer)", flush=True)
        return result

    setattr(wrapper, _ORIGINAL, validate_args)
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
                optimizer = get_megatron_muon_optimizer(
                    config, model_chunks, muon_config_from_args(args),
                    config_overrides=config_overrides, pg_collection=pg_collection,
                    use_gloo_process_groups=use_gloo_process_groups,
                )
                _BUILT[:] = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [])]
                return optimizer
        return get_megatron_optimizer(
            config, model_chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map,
        )

    setattr(dispatcher, _ORIGINAL, get_megatron_optimizer)
    return dispatcher


_BUILT: list = []  # the MuonWithAdamW optimizers the dispatcher built (for the log line)


def stats_text(optimizers) -> str:
    """`` muon mode: owner | muon step: full | muon bytes sent: 1.23 MB | muon orthogonalize: 4.5 ms |`` for the
    last step of every megatron-muon optimizer (one per model chunk group; usually one)."""
    parts = []
    for inner in optimizers:
        stats = getattr(inner, "last_step_stats", None)
        if stats:
            parts.append(
                f" muon mode: {inner.config.tp_mode} | muon step: {stats['kind']} |"
                f" muon bytes sent: {stats['bytes_sent'] / 1e6:.3f} MB |"
                f" muon orthogonalize: {stats['orthogonalize_ms']:.1f} ms ({stats['timing']}) |"
            )
    return "".join(parts)


def muon_scalars(optimizers) -> dict[str, float]:
    """The last step's figures as scalars: ``muon/bytes_sent_mb``, ``muon/orthogonalize_ms``,
    ``muon/ns_tflop`` and ``muon/full_step`` (1 for an exact step, 0 for a MuonBP block step)."""
    out: dict[str, float] = {}
    for k, inner in enumerate(optimizers):
        stats = getattr(inner, "last_step_stats", None)
        if not stats:
            continue
        tag = "muon" if len(optimizers) == 1 else f"muon{k}"
        out.update({f"{tag}/bytes_sent_mb": stats["bytes_sent"] / 1e6,
                    f"{tag}/orthogonalize_ms": stats["orthogonalize_ms"],
                    f"{tag}/ns_tflop": stats["ns_flops"] / 1e12,
                    f"{tag}/full_step": 0.0 if stats["kind"] == "block" else 1.0})
    return out


def write_scalars(optimizers, iteration: int) -> None:
    """Hand ``muon_scalars`` to Megatron's TensorBoard and W&B writers, where configured (Megatron
    creates them on the last rank only; elsewhere this does nothing and reads no CUDA event)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tensorboard is None and wandb is None:
        return
    scalars = muon_scalars(optimizers)
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
    if wandb is not None and scalars:
        wandb.log(scalars, iteration)


def _wrap_training_log(training_log):
    """With --muon-log-stats, Megatron's iteration line gets ``stats_text`` appended: the line
    is built inside ``training_log`` and printed by ``print_rank_last``, so that name is
    redirected for the duration of the call only."""
    from megatron.training import training

    @functools.wraps(training_log)
    def wrapper(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if getattr(margs, ACTIVE, False) and _BUILT:
            iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
            if iteration % max(1, getattr(margs, "tensorboard_log_interval", 1)) == 0:
                write_scalars(_BUILT, iteration)
        if not (getattr(margs, ACTIVE, False) and getattr(margs, "muon_log_stats", False) and _BUILT):
            return training_log(*args, **kwargs)
        printer = training.print_rank_last

        def print_with_stats(message):
            if " iteration " in message and message.rstrip().endswith("|"):
                message = message.rstrip() + stats_text(_BUILT)
            printer(message)

        training.print_rank_last = print_with_stats
        try:
            return training_log(*args, **kwargs)
        finally:
            training.print_rank_last = printer

    setattr(wrapper, _ORIGINAL, training_log)
    return wrapper


def _wrap_add_megatron_arguments(add_megatron_arguments):
    @functools.wraps(add_megatron_arguments)
    def wrapper(parser):
        return add_muon_args(add_megatron_arguments(parser))

    setattr(wrapper, _ORIGINAL, add_megatron_arguments)
    return wrapper


def _wrap_wrap_model_chunks_with_ddp(wrap_model_chunks_with_ddp):
    @functools.wraps(wrap_model_chunks_with_ddp)
    def wrapper(model_chunks, config, ddp_config, *args, **kwargs):
        from megatron.training import get_args, training

        margs = get_args()
        dp_class = kwargs.get("DP", training.DDP)
        if (getattr(margs, ACTIVE, False) and dp_class is training.DDP and ddp_config.use_distributed_optimizer
                and not kwargs.get("use_layer_wise_distributed_optimizer", False)):
            muon_config = muon_config_from_args(margs)
            if muon_config.dp_layout == "balanced":
                from .layout import ddp_with_balanced_layout

                kwargs["DP"] = ddp_with_balanced_layout(muon_config)
        return wrap_model_chunks_with_ddp(model_chunks, config, ddp_config, *args, **kwargs)

    setattr(wrapper, _ORIGINAL, wrap_model_chunks_with_ddp)
    return wrapper


def install() -> None:
    """Install the five hooks into ``megatron.training``; calling it again changes nothing."""
    from megatron.training import arguments, training

    hooks = [
        (arguments, "add_megatron_arguments", _wrap_add_megatron_arguments),
        (arguments, "validate_args", _wrap_validate_args),
        (training, "get_megatron_optimizer", _wrap_get_megatron_optimizer),
        (training, "training_log", _wrap_training_log),
        (training, "wrap_model_chunks_with_ddp", _wrap_wrap_model_chunks_with_ddp),
    ]
    for module, name, wrap in hooks:
        if not hasattr(getattr(module, name), _ORIGINAL):
            setattr(module, name, wrap(getattr(module, name)))
