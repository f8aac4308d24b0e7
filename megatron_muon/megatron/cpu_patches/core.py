"""The CPU patches of megatron-core (``megatron/core``): buffers, RNG, optimizer wrappers, grad
clipping, checkpoint writers, the pipeline schedules, MoE routing, sequence parallelism."""

from __future__ import annotations

import torch

from .mechanisms import retarget, retarget_device_view


def patch_rng_tracker() -> None:
    """megatron/core/tensor_parallel/random.py: the CUDA RNG tracker keeps CPU generator states.

    * module functions ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (called by
      ``CudaRNGStatesTracker.add`` and ``.fork``) read ``torch.cuda.random.get_rng_state`` /
      ``torch.cuda.default_generators``: replaced by ``torch.get_rng_state`` / ``set_rng_state``;
    * ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state()`` and
      ``torch.cuda.manual_seed(seed)``: CPU view, so each named state is the CPU generator
      seeded with that seed.

    ``model_parallel_cuda_manual_seed`` itself needs nothing: its ``torch.cuda.manual_seed`` is
    queued lazily by torch and never runs without CUDA; seed the CPU generator separately.
    As the forked generator is the CPU one, ``fork`` logs "CPU RNG state changed within GPU RNG
    context" whenever something random runs inside it (dropout in TP regions): expected here.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()  # a fresh tensor already, clone or not

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    retarget(mrandom.CudaRNGStatesTracker, "add", view=True)


def patch_grad_buffer() -> None:
    """megatron/core/distributed/param_and_grad_buffer.py (DDP's contiguous buffers): CPU view.

    * ``_ParamAndGradBuffer.__init__`` allocates ``param_data`` / ``grad_data`` with
      ``device=torch.cuda.current_device()``;
    * ``_ParamAndGradBucketGroup.start_grad_sync`` (from ``finish_grad_sync``) waits on
      CUDA-graph events through ``torch.cuda.current_stream()`` (there are none on CPU).
    """
    from megatron.core.distributed import param_and_grad_buffer as m

    retarget(m._ParamAndGradBuffer, "__init__", view=True)
    retarget(m._ParamAndGradBucketGroup, "start_grad_sync", view=True)


def patch_rotary() -> None:
    """megatron/core/models/common/embeddings/rotary_pos_embedding.py: CPU view.

    ``RotaryEmbedding.get_emb`` moves ``inv_freq`` (built on CPU under
    ``use_cpu_initialization``) to ``torch.cuda.current_device()`` on the first forward;
    ``RotaryEmbedding.__init__`` builds it there when not given ``use_cpu_initialization``, as
    MLA's attention (``MLASelfAttention``, ``rope_type="rope"``) builds it.
    """
    from megatron.core.models.common.embeddings import rotary_pos_embedding as m

    retarget(m.RotaryEmbedding, "get_emb", view=True)
    retarget(m.RotaryEmbedding, "__init__", view=True)


def patch_utils() -> None:
    """megatron/core/utils.py.

    * ``GlobalMemoryBuffer.get_tensor`` allocates with ``device=torch.cuda.current_device()``
      (CPU view); ``DotProductAttention.forward`` takes its QK^T buffer from it;
    * ``local_multi_tensor_l2_norm`` (the no-apex ``multi_tensor_l2norm`` that
      ``get_grad_norm_fp32`` uses) returns ``torch.tensor(..., device="cuda")``.
    """
    from megatron.core import utils as m

    retarget(m.GlobalMemoryBuffer, "get_tensor", view=True)
    retarget(m, "local_multi_tensor_l2_norm", consts=("cuda",))


def patch_grad_scaler() -> None:
    """megatron/core/optimizer/grad_scaler.py: ``MegatronGradScaler.__init__`` and
    ``DynamicGradScaler.__init__`` build their scale tensors with ``device='cuda'``; a loss scale
    (``--loss-scale``) is what makes ``MixedPrecisionOptimizer.prepare_grads`` check grads for
    inf/NaN and skip the step."""
    from megatron.core.optimizer import grad_scaler as m

    retarget(m.MegatronGradScaler, "__init__", consts=("cuda",))
    retarget(m.DynamicGradScaler, "__init__", consts=("cuda",))


def patch_dist_checkpointing() -> None:
    """megatron/core/dist_checkpointing/strategies: the torch_dist save path.

    * ``filesystem_async.FileSystemWriterAsync.preload_tensors`` ends with
      ``torch.cuda.synchronize()`` (CPU view: a no-op, CPU copies are synchronous);
    * ``state_dict_saver.save_state_dict_async_finalize`` broadcasts a flag made with
      ``device=torch.cuda.current_device()`` (CPU view: the CPU device).
    Both may be wrapped by a decorator; the function underneath is the one retargeted.
    """
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    for owner, attr in ((FileSystemWriterAsync, "preload_tensors"),
                        (state_dict_saver, "save_state_dict_async_finalize")):
        retarget(owner, attr, view=True)


def patch_async_save() -> None:
    """megatron/core/dist_checkpointing/strategies/async_utils.py: ``--async-save``
    (``--use-persistent-ckpt-worker --async-strategy mcore``; megatron-core 0.19.2's
    ``validate_args`` turns ``--async-save`` off without the persistent worker).

    * ``PersistentAsyncCaller.async_loop``, the persistent checkpoint worker's main, starts with
      ``torch.cuda.set_device(rank % torch.cuda.device_count())`` (a ZeroDivisionError without
      CUDA, after which every rank waits for the worker forever): device view (one device,
      ``set_device`` a no-op). The worker is a ``forkserver`` child: the fork server imports the
      entry script (``__main__``, ``scripts/pretrain_gpt.py``, which applies these patches at
      import) before it forks, so the worker runs the patched code and preloads tensors through
      the patched ``FileSystemWriterAsync.preload_tensors``;
    * ``AsyncCaller.sync_all_async_calls`` (are all ranks' writes done) and
      ``AsyncCallsQueue.maybe_finalize_async_calls`` (finalize, then check every rank finalized
      the same call) all-reduce flags made on ``torch.cuda.current_device()``: CPU view;
    * ``TemporalAsyncCaller.schedule_async_call`` (the non-persistent caller) calls
      ``torch.cuda.synchronize()`` after preloading: CPU view (a no-op);
    * state_dict_saver.py ``verify_global_md_reuse`` (``--ckpt-assume-constant-structure``)
      all-reduces a ``device='cuda'`` flag.
    """
    from megatron.core.dist_checkpointing.strategies import async_utils, state_dict_saver

    retarget_device_view(async_utils.PersistentAsyncCaller, "async_loop", names=("set_device", "device_count"))
    retarget(async_utils.AsyncCaller, "sync_all_async_calls", view=True)
    retarget(async_utils.AsyncCallsQueue, "maybe_finalize_async_calls", view=True)
    retarget(async_utils.TemporalAsyncCaller, "schedule_async_call", view=True)
    retarget(state_dict_saver, "verify_global_md_reuse", consts=("cuda",))


def patch_timers() -> None:
    """megatron/core/timers.py: ``Timer.start`` / ``Timer.stop`` call ``torch.cuda.synchronize()``
    (CPU view: a no-op, CPU kernels are synchronous) and
    ``Timers._get_elapsed_time_all_ranks`` gathers on ``torch.cuda.current_device()`` (CPU view):
    Megatron's training loop times every iteration with them."""
    from megatron.core import timers as m

    retarget(m.Timer, "start", view=True)
    retarget(m.Timer, "stop", view=True)
    retarget(m.Timers, "_get_elapsed_time_all_ranks", view=True)


def patch_causal_mask() -> None:
    """megatron/core/transformer/utils.py: ``get_default_causal_mask`` builds its mask with
    ``torch.ones(sq, sq, device="cuda")``; ``FusedScaleMaskSoftmax.forward_torch_softmax`` calls
    it when the batch carries no attention mask (causal mask type)."""
    from megatron.core.transformer import utils as m

    retarget(m, "get_default_causal_mask", consts=("cuda",))


def patch_moe_router() -> None:
    """megatron/core/transformer/moe/router.py: ``Router.gating`` (every MoE layer's forward)
    moves a CPU router weight to ``torch.cuda.current_device()``: CPU view (it stays put)."""
    from megatron.core.transformer.moe import router as m

    retarget(m.Router, "gating", view=True)


def patch_sequence_parallel() -> None:
    """megatron/core/tensor_parallel/mappings.py: the sequence-parallel gathers and
    reduce-scatters (MoE with TP needs ``--sequence-parallel``; the MoE allgather dispatcher
    gathers tokens over TP x EP with them) allocate their outputs on
    ``torch.cuda.current_device()``: ``_gather_along_last_dim``, ``_gather_along_first_dim``,
    ``_reduce_scatter_along_first_dim``, CPU view;
    ``tensor_parallel/layers.py``: ``LinearWithGradAccumulationAndAsyncCommunication.backward``
    all-gathers the sequence-parallel input into a buffer on ``torch.cuda.current_device()``:
    CPU view.
    """
    from megatron.core.tensor_parallel import layers, mappings

    for attr in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        retarget(mappings, attr, view=True)
    retarget(layers.LinearWithGradAccumulationAndAsyncCommunication, "backward", view=True)


def patch_optimizer() -> None:
    """megatron/core/optimizer/optimizer.py: ``device='cuda'`` literals.

    * ``MegatronOptimizer.has_grad_norm_group`` (from ``step`` -> ``get_grad_norm``): an
      all-reduced ``torch.tensor([flag], ..., device='cuda')``;
    * ``MixedPrecisionOptimizer.__init__`` (base of ``DistributedOptimizer`` and
      ``Float16OptimizerWithFloat16Params``): ``found_inf``, ``_dummy_overflow_buf``,
      ``_scale_one`` are ``torch.tensor(..., device='cuda')``;
    * ``Float16OptimizerWithFloat16Params.__init__`` sorts params with ``param.type() in
      ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` / ``== 'torch.cuda.FloatTensor'``
      (else TypeError);
    * ``FP32Optimizer.__init__``: ``self._scale = torch.tensor([1.0], ..., device='cuda')``.
    """
    from megatron.core.optimizer import optimizer as m

    retarget(m.MegatronOptimizer, "has_grad_norm_group", consts=("cuda",))
    retarget(m.MixedPrecisionOptimizer, "__init__", consts=("cuda",))
    types_ = ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor")
    retarget(m.Float16OptimizerWithFloat16Params, "__init__", consts=types_)
    retarget(m.FP32Optimizer, "__init__", consts=("cuda",))


def patch_clip_grads() -> None:
    """megatron/core/optimizer/clip_grads.py (called from ``MegatronOptimizer.step``).

    * ``get_grad_norm_fp32``: ``torch.zeros(1, ..., device='cuda')`` accumulators;
    * ``clip_grad_by_total_norm_fp32``: ``assert param.grad.type() == 'torch.cuda.FloatTensor'``
      and a ``device='cuda'`` overflow buffer (reached when ``clip_grad > 0``);
    * ``count_zeros_fp32``: a ``device='cuda'`` counter (reached with ``log_num_zeros_in_grad``).
    """
    from megatron.core.optimizer import clip_grads as m

    retarget(m, "get_grad_norm_fp32", consts=("cuda",))
    retarget(m, "clip_grad_by_total_norm_fp32", consts=("cuda", "torch.cuda.FloatTensor"))
    retarget(m, "count_zeros_fp32", consts=("cuda",))


def patch_distrib_optimizer() -> None:
    """megatron/core/optimizer/distrib_optimizer.py: ``Tensor.type()`` string checks.

    * ``DistributedOptimizer._build_model_and_main_param_groups`` sorts params with
      ``model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` (gets an
      fp32 main shard) and ``== 'torch.cuda.FloatTensor'`` (shard of itself), else TypeError;
    * ``DistributedOptimizer.__init__`` marks 16-bit params (``param.main_param = None``,
      ``main_param_sharded = True``) with the same ``in [...]`` check. Training runs without
      this one; it keeps that bookkeeping as on GPUs (``megatron.training``'s
      ``calc_params_l2_norm`` reads it).
    """
    from megatron.core.optimizer import distrib_optimizer as m

    half = ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor")
    retarget(m.DistributedOptimizer, "_build_model_and_main_param_groups",
              consts=(*half, "torch.cuda.FloatTensor"))
    retarget(m.DistributedOptimizer, "__init__", consts=half)


def patch_pipeline() -> None:
    """megatron/core/pipeline_parallel: the 1F1B schedule and its p2p exchange.

    * schedules.py ``forward_backward_no_pipelining``,
      ``forward_backward_pipelining_without_interleaving`` and (virtual pipeline stages,
      ``--virtual-pipeline-model-parallel-size``) ``forward_backward_pipelining_with_interleaving``:
      ``total_num_tokens = torch.zeros([], ..., device="cuda")``;
    * p2p_communication.py ``P2PCommunicator._communicate``: receive buffers allocated with
      ``device=torch.cuda.current_device()`` (in its inner ``create_tensor_recv_prev/next``) and
      ``torch.cuda.synchronize()`` after batched isend/irecv (CPU view; synchronize is a no-op).
    """
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    retarget(schedules, "forward_backward_no_pipelining", consts=("cuda",))
    retarget(schedules, "forward_backward_pipelining_without_interleaving", consts=("cuda",))
    retarget(schedules, "forward_backward_pipelining_with_interleaving", consts=("cuda",))
    retarget(p2p_communication.P2PCommunicator, "_communicate", view=True)


def patch_rerun_state_machine() -> None:
    """megatron/core/rerun_state_machine.py (``train_step`` runs each step through it).

    * ``RerunStateMachine._save_state`` (from ``should_run_forward_backward``, every step) keeps
      ``torch.cuda.get_rng_state()``: CPU view (the CPU generator state, its "device" one);
    * ``validate_result`` (the NaN / Inf / spiky-loss checks in the loss function) and
      ``_log_validation_error_to_file`` record ``torch.cuda.current_device()``: CPU view;
    * ``_reduce_any`` all-reduces its flags from ``device='cuda'`` tensors.
    ``_restore_state`` (only when a step is re-run) is left alone: its
    ``torch.cuda.set_rng_state`` is queued lazily by torch and never runs without CUDA, and
    the CPU state it would restore is restored by its ``torch.set_rng_state`` already.
    """
    from megatron.core.rerun_state_machine import RerunStateMachine as m

    retarget(m, "_save_state", view=True)
    retarget(m, "validate_result", view=True)
    retarget(m, "_log_validation_error_to_file", view=True)
    retarget(m, "_reduce_any", consts=("cuda",))


def patch_batch_broadcast() -> None:
    """megatron/core/utils.py: ``get_batch_on_this_tp_rank`` (a GPT ``forward_step``'s
    ``get_batch``: TP rank 0 broadcasts the micro-batch to its TP group) allocates the receive
    buffers, and the cu_seqlens / hybrid-CP lengths, on ``torch.cuda.current_device()``: CPU
    view."""
    from megatron.core import utils as m

    retarget(m, "get_batch_on_this_tp_rank", view=True)
