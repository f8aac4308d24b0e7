"""The CPU patches of Megatron's training package (``megatron/training``): ``pretrain`` and its
loop, argument validation, initialization, ``get_model``, checkpointing, the log line."""

from __future__ import annotations

import functools

import torch

from .mechanisms import code_strings, retarget, retarget_device_view


def patch_training_log() -> None:
    """megatron/training: ``training.training_log`` (Megatron's iteration log line) starts and
    resets its loss accumulators with ``torch.tensor([0.0], device='cuda')``;
    ``utils.common_utils.reduce_max_stat_across_model_parallel_group`` see below. (Its memory report,
    ``torch.cuda.memory_stats``, runs only with --log-memory-to-tensorboard and is left alone.)"""
    from megatron.training import training as m
    from megatron.training.utils import common_utils

    retarget(m, "training_log", consts=("cuda",))
    # The lr it logs is reduced over the model-parallel group from a tensor made on
    # ``torch.cuda.current_device()`` (CPU view).
    retarget(common_utils, "reduce_max_stat_across_model_parallel_group", view=True)


def patch_validate_args() -> None:
    """megatron/training/arguments.py: ``validate_args`` asks ``get_device_arch_version()`` (its
    module-level name, imported from megatron/training/utils/common_utils.py), which reads
    ``torch.cuda.get_device_properties("cuda:0")``, when TP or CP > 1 and for FSDP / GTP stream
    priorities. Replaced, in ``arguments``' namespace only, by one answering 0: no GPU
    architecture, so the pre-Blackwell rules apply (TP > 1 asks for
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment, as on Hopper)."""
    from megatron.training import arguments as m

    if not callable(getattr(m, "get_device_arch_version", None)):
        raise RuntimeError("cpu_patches: megatron.training.arguments has no get_device_arch_version; Megatron changed?")

    def _cpu_device_arch_version():
        return 0

    m.get_device_arch_version = _cpu_device_arch_version


def patch_initialize() -> None:
    """megatron/training/initialize.py (``pretrain`` -> ``initialize_megatron``,
    ``set_jit_fusion_options``).

    * ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``
      (its only use); ``pretrain`` calls it through the name ``training.initialize_megatron``,
      replaced there by the same function with ``allow_no_cuda=True``;
    * ``_set_random_seed`` (from ``initialize_megatron``) seeds the model-parallel RNG tracker
      (``model_parallel_cuda_manual_seed``) only ``if torch.cuda.device_count() > 0``; without it
      every ``get_cuda_rng_tracker().fork()`` (weight init, dropout in TP regions) fails. The
      module function is replaced by one calling it and then ``model_parallel_cuda_manual_seed``
      with the seed it gave ``torch.manual_seed`` (per pipeline / data-parallel rank), its
      tracker arguments and the per-TP-rank offsets of GPUs; the CPU generator is reseeded with
      that seed after (as ``_set_random_seed`` leaves it);
    * ``initialize_megatron``'s inner ``finish_mpu_init`` sets the MoE aux-loss scale with
      ``torch.ones(1, device=torch.cuda.current_device())``: CPU view;
    * ``_warmup_jit_function`` (from ``pretrain`` -> ``set_jit_fusion_options``) runs the
      ``torch.compile``d bias-GeLU / SwiGLU and bias-dropout-add fusions on ``device="cuda"``
      tensors, so that they are compiled before the first step. Retargeted to the CPU it works
      but costs about 30 s of inductor compilation on 2 cores, for kernels that the CPU model
      (``--no-bias-swiglu-fusion --no-bias-dropout-fusion``) never calls; it is replaced by a
      no-op (a fusion a model does use compiles on its first call).
    """
    from megatron.core import tensor_parallel
    from megatron.core.utils import get_pg_rank
    from megatron.training import initialize as m
    from megatron.training import training

    initialize_megatron = m.initialize_megatron
    set_random_seed = m._set_random_seed

    @functools.wraps(initialize_megatron)
    def _initialize_megatron_cpu(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    @functools.wraps(set_random_seed)
    def _set_random_seed_cpu(seed_, data_parallel_random_init=False, te_rng_tracker=False,
                             inference_rng_tracker=False, use_cudagraphable_rng=False,
                             pp_group=None, dp_group=None, tp_group=None, ep_group=None,
                             etp_group=None):
        set_random_seed(seed_, data_parallel_random_init, te_rng_tracker, inference_rng_tracker,
                        use_cudagraphable_rng, pp_group, dp_group, tp_group, ep_group, etp_group)
        seed = torch.initial_seed()  # seed_ + 100 * pp_rank (+ 10 * dp_rank)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
            tp_rank=get_pg_rank(tp_group) if tp_group is not None else None,
            ep_rank=get_pg_rank(ep_group) if ep_group is not None else None,
            etp_rank=get_pg_rank(etp_group) if etp_group is not None else None,
        )
        torch.manual_seed(seed)

    if "allow_no_cuda" not in initialize_megatron.__code__.co_varnames:
        raise RuntimeError("cpu_patches: initialize_megatron has no allow_no_cuda; Megatron changed?")
    if "device_count" not in set_random_seed.__code__.co_names:
        raise RuntimeError("cpu_patches: _set_random_seed no longer checks device_count; Megatron changed?")
    # Its inner finish_mpu_init, with MoE: MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1,
    # device=torch.cuda.current_device())): CPU view.
    retarget(m, "initialize_megatron", view=True)
    training.initialize_megatron = _initialize_megatron_cpu
    m._set_random_seed = _set_random_seed_cpu
    if "cuda" not in code_strings(m._warmup_jit_function.__code__):
        raise RuntimeError("cpu_patches: initialize._warmup_jit_function changed; Megatron changed?")
    m._warmup_jit_function = lambda tp_size=None: None


def patch_initialize_distributed() -> None:
    """megatron/training/initialize.py: ``_initialize_distributed`` (from ``initialize_megatron``)
    builds Megatron's parallel state (``mpu.initialize_model_parallel``: TP / PP / DP groups) only
    ``if device_count > 0`` (``torch.cuda.device_count()``), after ``torch.cuda.set_device``:
    device view (the CPU is one device, ``set_device`` a no-op). The ``device_id`` it then
    builds, ``torch.device('cuda:<local rank>')``, is only used by
    ``inprocess_restart.maybe_force_nccl_backend_init``, which does nothing without
    ``--inprocess-restart``."""
    from megatron.training import initialize as m

    retarget_device_view(m, "_initialize_distributed", names=("device_count", "set_device"))


def patch_get_model() -> None:
    """megatron/training/training.py: ``get_model`` (from ``setup_model_and_optimizer``).

    * it moves every model chunk to the GPU, ``model_module.cuda(torch.cuda.current_device())``
      (``Module.cuda`` refuses a CPU device): ``training.get_model`` is replaced by a wrapper
      whose model provider gives each built module an instance ``cuda`` that leaves it where
      it is (on the CPU: nothing to move);
    * it wraps the chunks in DDP on a side stream (``torch.cuda.Stream()``,
      ``torch.cuda.stream(...)``, ``current_stream().wait_stream``): device view (null streams).
    """
    from megatron.training import training as m

    retarget_device_view(m, "get_model", names=("Stream", "stream", "current_stream"))
    get_model = m.get_model

    def _stay_on_cpu(module):
        module.cuda = lambda device=None: module  # instance attribute: this module only
        return module

    @functools.wraps(get_model)
    def _get_model_cpu(model_provider_func, *args, **kwargs):
        @functools.wraps(model_provider_func)
        def provider(*p_args, **p_kwargs):
            built = model_provider_func(*p_args, **p_kwargs)
            for module in (built if isinstance(built, list) else [built]):
                _stay_on_cpu(module)
            return built

        return get_model(provider, *args, **kwargs)

    m.get_model = _get_model_cpu


def patch_model_builders() -> None:
    """megatron/training/models/dist_utils.py: ``_ddp_wrap``, the DDP wrap of the ``ModelConfig``
    builders (``setup_model_and_optimizer`` with a model config: ``GPTModelBuilder`` /
    ``HybridModelBuilder.build_distributed_models``), wraps the chunks on a side stream
    (``torch.cuda.Stream()``, ``torch.cuda.stream(...)``, ``current_stream().wait_stream``): device
    view (null streams). Its caller moves the chunks to the GPU only without
    ``use_cpu_initialization``, which every CPU run sets (the layers need it to build on the CPU)."""
    from megatron.training.models import dist_utils as m

    retarget_device_view(m, "_ddp_wrap", names=("Stream", "stream", "current_stream"))


def patch_pretrain() -> None:
    """megatron/training/training.py: ``pretrain`` all-reduces its start timestamps from
    ``torch.tensor([...], dtype=torch.double, device='cuda')`` (program start, train start):
    constants retargeted."""
    from megatron.training import training as m

    retarget(m, "pretrain", consts=("cuda",))


def patch_training_loop() -> None:
    """megatron/training/training.py: ``device='cuda'`` literals of the loop around
    ``train_step`` (``pretrain`` -> ``build_train_valid_test_data_iterators`` / ``train`` /
    ``evaluate_and_print_results``).

    * ``build_train_valid_test_data_loaders``: the do-train / valid / test flags broadcast from
      rank 0, ``torch.tensor(..., device='cuda')``;
    * ``build_train_valid_test_data_iterators``: the per-validation-set eval-iteration counts
      (``eval_iters_tensor``), all-reduced;
    * ``evaluate`` / ``evaluate_and_print_results``: loss accumulators and eval-iteration
      counts (reached with ``--eval-iters`` > 0); ``evaluate`` and
      ``checkpoint_and_decide_exit`` (from ``train``): the ``--exit-duration-in-mins`` flag
      all-reduced from a ``device='cuda'`` tensor.
    """
    from megatron.training import training as m

    for attr in ("build_train_valid_test_data_loaders", "build_train_valid_test_data_iterators",
                 "evaluate", "evaluate_and_print_results", "checkpoint_and_decide_exit"):
        retarget(m, attr, consts=("cuda",))


def patch_training_utils() -> None:
    """megatron/training/utils/common_utils.py, beyond ``patch_training_log``'s.

    * ``logical_and_across_model_parallel_group`` (``train_step``: did every model-parallel
      rank's optimizer step succeed) all-reduces a flag made on ``torch.cuda.current_device()``:
      CPU view;
    * ``_compute_norm_2`` and ``calc_dtensor_params_l2_norm`` (``calc_params_l2_norm``, the
      ``--log-params-norm`` column of the log line) accumulate in ``device='cuda'`` tensors.
    """
    from megatron.training.utils import common_utils as m

    retarget(m, "logical_and_across_model_parallel_group", view=True)
    retarget(m, "_compute_norm_2", consts=("cuda",))
    retarget(m, "calc_dtensor_params_l2_norm", consts=("cuda",))


def patch_checkpointing() -> None:
    """megatron/training/checkpointing.py (``save_checkpoint`` / ``load_checkpoint``).

    * ``get_rng_state`` (from ``save_checkpoint``) stores ``torch.cuda.get_rng_state()``: CPU
      view (the CPU generator state; the tracker's states are CPU states already);
    * ``read_metadata`` (``load_checkpoint`` reading ``latest_checkpointed_iteration.txt``)
      all-reduces the iteration from a ``device='cuda'`` tensor.
    ``load_checkpoint``'s ``torch.cuda.set_rng_state(...)`` is left alone: torch queues it
    lazily and never runs it without CUDA; the CPU generator is restored from
    ``torch_rng_state`` and the tracker from ``rng_tracker_states`` as on GPUs.
    """
    from megatron.training import checkpointing as m

    retarget(m, "get_rng_state", view=True)
    retarget(m, "read_metadata", consts=("cuda",))
