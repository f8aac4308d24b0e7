"""The CPU patches of Megatron-FSDP (``--use-megatron-fsdp``) and torch FSDP2
(``--use-torch-fsdp2``), and the dry run's for Megatron-FSDP on the meta device."""

from __future__ import annotations

import functools
import inspect

from .mechanisms import rename_method_call, retarget, retarget_device_view, unless_fake_backend


def patch_megatron_fsdp() -> None:
    """megatron/core/distributed/fsdp (``--use-megatron-fsdp``: Megatron-FSDP and its adapter).

    * mcore_fsdp_adapter.py ``FullyShardedDataParallel.__init__`` (``get_model`` passes no
      device) takes ``torch.device(f"cuda:{torch.cuda.current_device()}")``: CPU view, and the
      ``"cuda:"`` prefix becomes ``""`` (``torch.device("cpu")``);
      ``FullyShardedDataParallel._init_dist_index`` builds its
      ``DeviceMesh.from_group(..., device_type="cuda")``: the constant becomes ``"cpu"`` (a gloo
      mesh), so the DTensors Megatron-FSDP makes live on the CPU;
    * mcore_fsdp_adapter.py ``_get_rng_state_dict`` (``FullyShardedDataParallel.__init__`` ->
      ``sync_rng_states_across_tp_group``, TP > 1: TP rank 0 broadcasts its RNG states) reads
      ``torch.cuda.get_rng_state()``: CPU view. ``_load_rng_state_dict``'s
      ``torch.cuda.set_rng_state`` is queued lazily by torch and never runs without CUDA;
    * megatron_fsdp.py ``MegatronFSDP.__init__`` compares its device with
      ``torch.device(f"cuda:{torch.cuda.current_device()}")``: CPU view, and the ``"cuda:"``
      prefix becomes ``""`` (``torch.device("cpu")``); ``_init_fsdp_param_and_grad_buffer``
      makes two side streams (``torch.cuda.Stream()``): device view (null streams);
    * param_and_grad_buffer.py ``GradReducePipeline.__init__`` / ``AllGatherPipeline.__init__``
      (streams for the outer, hybrid-FSDP group), ``GradReducePipeline._bucket_group_gradient_reduce``
      (the reduce-scatter, on ``torch.cuda.stream(...)``, recording an event) and
      ``AllGatherPipeline.all_gather_params`` (the param all-gather, likewise): device view;
    * uneven_dtensor.py ``validate_uneven_dtensor`` (every DTensor Megatron-FSDP makes) moves
      its boundary flags to the GPU with ``Tensor.cuda()`` before all-reducing them over the
      mesh's (gloo) group: the method name is rewritten to ``cpu`` in that function only (it
      reads nothing else named ``cuda``).
    """
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    retarget(adapter.FullyShardedDataParallel, "__init__", consts=("cuda:",), view=True)
    retarget(adapter.FullyShardedDataParallel, "_init_dist_index", consts=("cuda",))
    retarget(adapter, "_get_rng_state_dict", view=True)
    retarget(fsdp.MegatronFSDP, "__init__", consts=("cuda:",), view=True)
    retarget_device_view(fsdp.MegatronFSDP, "_init_fsdp_param_and_grad_buffer", names=("Stream",))
    retarget_device_view(buffers.GradReducePipeline, "__init__", names=("Stream",))
    retarget_device_view(buffers.GradReducePipeline, "_bucket_group_gradient_reduce",
                          names=("stream", "current_stream"))
    retarget_device_view(buffers.AllGatherPipeline, "__init__", names=("Stream",))
    retarget_device_view(buffers.AllGatherPipeline, "all_gather_params", names=("stream", "current_stream"))
    rename_method_call(uneven_dtensor, "validate_uneven_dtensor", "cuda", "cpu")
    buffers.AllGatherPipeline.all_gather_params = _synchronous_param_gather(buffers.AllGatherPipeline.all_gather_params)


def _synchronous_param_gather(all_gather_params):
    """``AllGatherPipeline.all_gather_params`` with ``async_param_gather=False``: on the CPU every
    param all-gather completes before the call returns.

    On CUDA an overlapped all-gather writes its bucket on a side stream, and a bucket Megatron-FSDP
    frees (its storage resized to 0) is only reused once the stream has passed the gather. On the
    CPU the null streams order nothing: a prefetched bucket released while gloo still writes into
    it corrupts the heap (seen once in CI: ``malloc(): unaligned tcache chunk detected`` in the
    FSDP demo). Waiting at once removes the overlap, which the CPU does not have anyway."""
    signature = inspect.signature(all_gather_params)
    if "async_param_gather" not in signature.parameters:
        raise RuntimeError("cpu_patches: AllGatherPipeline.all_gather_params has no async_param_gather; "
                           "Megatron changed?")

    @functools.wraps(all_gather_params)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["async_param_gather"] = False
        return all_gather_params(*bound.args, **bound.kwargs)

    return wrapper


def patch_torch_fsdp2() -> None:
    """megatron/core/distributed/torch_fully_sharded_data_parallel.py (``--use-torch-fsdp2``).

    * ``TorchFullyShardedDataParallel.__init__`` builds its ``DeviceMesh.from_group(
      self.process_group, "cuda")``: the constant becomes ``"cpu"`` (a gloo mesh), so
      ``fully_shard`` keeps the params on the CPU and its DTensors live there.
    """
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp

    retarget(torch_fsdp.TorchFullyShardedDataParallel, "__init__", consts=("cuda",))


def patch_megatron_fsdp_dry_run() -> None:
    """For ``scripts/dry_run.py --fsdp`` only (not in ``PATCHES``): Megatron-FSDP over a model
    whose params are on the meta device, its buffers on meta too (``device=meta``), under torch's
    fake process group.

    * param_and_grad_buffer.py ``ParamAndGradBuffer._init_each_parameter_group_buffers`` asserts
      ``not p.is_meta`` on every param before copying it into its model-weight buffer (a param
      left uninitialized by ``init_model_with_meta_device`` would be copied as garbage). In the
      dry run every param and buffer is meta by design and the copies only propagate shapes, so
      in that function only ``is_meta`` is read as ``is_quantized`` (False for the dry run's
      bf16 / fp32 params). Its other reads of ``is_meta`` sit behind
      ``reset_parameters_for_meta_device_init_module`` (``init_model_with_meta_device``), off.
    * param_and_grad_buffer.py ``make_fsdp_dtensor`` (``_init_distributed_params``: every
      DTensor param, ``run_check=True``) calls ``validate_uneven_dtensor``, whose bounds check
      takes the other DP ranks' local shapes from ``dist.all_gather_object``; the fake backend
      gathers nothing real (each slot reads as this rank's own shape), so on DP rank > 0 a param
      held whole by one rank "ends" past its global shape. megatron-core already skips the
      function's second check under the fake backend for the same reason; here the call from
      ``make_fsdp_dtensor`` skips the whole check under the fake backend (elsewhere it runs).
    * mcore_fsdp_adapter.py ``FullyShardedDataParallel.sync_rng_states_across_tp_group`` (from
      ``__init__``, TP > 1): TP rank 0 sends its RNG states with ``broadcast_object_list``; under
      the fake backend a receiving rank reads an uninitialized object size and tries to allocate
      that (94 TB on TP rank 7 of Llama-3 8B at TP8). The dry run draws no random number: skipped
      under the fake backend.
    """
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    if getattr(buffers.validate_uneven_dtensor, "_skips_fake_backend", False):
        return  # applied
    rename_method_call(buffers.ParamAndGradBuffer, "_init_each_parameter_group_buffers", "is_meta", "is_quantized")
    buffers.validate_uneven_dtensor = unless_fake_backend(buffers.validate_uneven_dtensor)
    fsdp = adapter.FullyShardedDataParallel
    fsdp.sync_rng_states_across_tp_group = unless_fake_backend(fsdp.sync_rng_states_across_tp_group)
