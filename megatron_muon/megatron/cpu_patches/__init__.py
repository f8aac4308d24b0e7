"""CPU shims that let megatron-core 0.19.2 train a GPTModel under gloo on a CUDA-less torch.

``apply_cpu_patches()`` applies them once and returns their names; it does nothing and returns
``[]`` when CUDA is available. Each patch names its call sites. Megatron hard-codes CUDA in three
ways; each patch retargets exactly the functions that need it, in place (their ``__code__``, so
every alias of a patched function, e.g. ``l2_norm_impl`` in clip_grads, sees the change):

* string literals ``device='cuda'`` and ``param.type() == 'torch.cuda.FloatTensor'``: these
  constants become ``'cpu'`` and ``'torch.FloatTensor'`` (what ``Tensor.type()`` gives on CPU);
* calls through the global ``torch`` (``torch.cuda.current_device()``, ``current_stream()``,
  ``synchronize()``, ``get_rng_state()``, ``manual_seed()``): inside the patched function only,
  ``torch`` resolves to ``_CPU_TORCH``, the real module except that ``.cuda`` answers those for
  the CPU (device ``cpu``; no-op stream waits and synchronize, CPU kernels being synchronous;
  the CPU generator). ``torch.cuda`` itself is never modified;
* the RNG tracker's module functions ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` are
  replaced (they are looked up at call time). On a CPU "device" the device generator is the CPU
  default generator, so the tracker forks that one, with the per-TP-rank seeds used on GPUs.

Megatron's training package (``pretrain`` and its loop) adds two more, in the later patches:

* setup code that counts devices and creates streams (``device_count()``, ``set_device``,
  ``Stream()``, ``stream(...)``): ``retarget_device_view`` gives such a function a wider view,
  ``_CpuDeviceTorch`` (the CPU is one device; null streams), under its own global name;
* a call that cannot be retargeted from inside (an assertion on ``torch.cuda.is_available()``,
  ``Module.cuda(...)``, a branch on ``device_count()``): the module attribute it is called
  through (looked up at call time) is replaced, as for the RNG tracker above: by a wrapper
  around the original, or by a stand-in where the CPU's answer is fixed (the GPU architecture)
  or there is nothing to do (the CUDA-fusion warm-up).

A patch raises if a constant or name it expects is missing, i.e. on another Megatron version.
"""

from __future__ import annotations

import torch

from .core import (
    patch_async_save,
    patch_batch_broadcast,
    patch_causal_mask,
    patch_clip_grads,
    patch_dist_checkpointing,
    patch_distrib_optimizer,
    patch_grad_buffer,
    patch_grad_scaler,
    patch_moe_router,
    patch_optimizer,
    patch_pipeline,
    patch_rerun_state_machine,
    patch_rng_tracker,
    patch_rotary,
    patch_sequence_parallel,
    patch_timers,
    patch_utils,
)
from .fsdp import patch_megatron_fsdp, patch_megatron_fsdp_dry_run, patch_torch_fsdp2
from .mechanisms import retarget, view_device
from .training import (
    patch_checkpointing,
    patch_get_model,
    patch_initialize,
    patch_initialize_distributed,
    patch_model_builders,
    patch_pretrain,
    patch_training_log,
    patch_training_loop,
    patch_training_utils,
    patch_validate_args,
)

__all__ = ["PATCHES", "apply_cpu_patches", "patch_megatron_fsdp_dry_run", "view_device"]
# retarget is used by scripts/bench/optimizer_step_setup.py for the benchmark's own CPU shims
_ = retarget

_APPLIED: list[str] | None = None


PATCHES = (
    patch_rng_tracker,
    patch_grad_buffer,
    patch_rotary,
    patch_utils,
    patch_causal_mask,
    patch_moe_router,
    patch_sequence_parallel,
    patch_optimizer,
    patch_grad_scaler,
    patch_clip_grads,
    patch_distrib_optimizer,
    patch_pipeline,
    patch_dist_checkpointing,
    patch_async_save,
    patch_timers,
    patch_training_log,
    patch_validate_args,
    patch_initialize,
    patch_initialize_distributed,
    patch_get_model,
    patch_model_builders,
    patch_pretrain,
    patch_training_loop,
    patch_rerun_state_machine,
    patch_batch_broadcast,
    patch_training_utils,
    patch_checkpointing,
    patch_megatron_fsdp,
    patch_torch_fsdp2,
)


def apply_cpu_patches() -> list[str]:
    """Apply every patch once (idempotent); return their names, or ``[]`` when CUDA is there."""
    global _APPLIED
    if torch.cuda.is_available():
        return []
    if _APPLIED is None:
        for patch in PATCHES:
            patch()
        _APPLIED = [p.__name__ for p in PATCHES]
    return list(_APPLIED)
