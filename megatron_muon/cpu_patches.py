"""CPU shims that let megatron-core 0.19.2 train a GPTModel under gloo on a CUDA-less torch.

``apply_cpu_patches()`` returns the names of the patches it applied (``[]`` when CUDA is
available: nothing is touched then). It is idempotent. Each patch below names its call sites.

How the patches work, narrowest first:

* **Constant retargeting.** Megatron hard-codes CUDA in string literals: ``device='cuda'`` and
  ``param.type() == 'torch.cuda.FloatTensor'``. ``_retarget_constants`` rewrites those constants
  in the code object of the named functions only (``'cuda'`` -> ``'cpu'``,
  ``'torch.cuda.XTensor'`` -> ``'torch.XTensor'``, i.e. what ``Tensor.type()`` returns on CPU).
  Everything else in those functions runs unchanged, and the patch fails loudly if a constant it
  expects is not there (a different Megatron version).
* **A CPU view of ``torch``.** Calls such as ``torch.cuda.current_device()`` are looked up through
  the module global ``torch`` at call time. ``_install_cpu_torch`` replaces that global, in the
  listed Megatron modules only, by ``_CpuTorch``: the real ``torch`` except that ``.cuda`` answers
  ``current_device()`` with the CPU device, ``current_stream()`` with a stream whose waits are
  no-ops (CPU work is synchronous), and RNG calls with the CPU generator. ``torch.cuda`` itself,
  and every other module, are untouched.
* **Module functions.** The RNG tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` are
  module globals looked up at call time; they are replaced by CPU-generator versions.

On a CPU "device" the device generator *is* the CPU default generator, so the RNG tracker forks
the CPU generator the way it forks the CUDA one on GPUs (same per-TP-rank seeds).
"""

from __future__ import annotations

import importlib
import types
from contextlib import nullcontext

import torch

__all__ = ["apply_cpu_patches", "PATCHES"]

_APPLIED: list[str] | None = None


# --------------------------------------------------------------------------- mechanisms


class _NullStream:
    """Stands in for a CUDA stream: CPU kernels are synchronous, so every wait is already met."""

    def wait_event(self, event):  # noqa: D102 - mirrors torch.cuda.Stream
        pass

    def wait_stream(self, stream):  # noqa: D102
        pass

    def synchronize(self):  # noqa: D102
        pass


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module: device, stream and RNG calls go to the CPU."""

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def current_stream(device=None):
        return _NullStream()

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    def __getattr__(self, name):  # everything else is the real torch.cuda
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """The real ``torch`` module, except that ``.cuda`` is ``_CpuCuda``."""

    cuda = _CpuCuda()

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _install_cpu_torch(*module_names: str) -> None:
    """Rebind the global ``torch`` of each named Megatron module to the CPU view."""
    for name in module_names:
        module = importlib.import_module(name)
        if module.torch is not _CPU_TORCH:
            assert module.torch is torch, f"{name}.torch is not torch"
            module.torch = _CPU_TORCH


_CONST_MAP = {
    "cuda": "cpu",
    "torch.cuda.FloatTensor": "torch.FloatTensor",
    "torch.cuda.HalfTensor": "torch.HalfTensor",
    "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor",
}


def _map_const(value):
    if isinstance(value, str):
        return _CONST_MAP.get(value, value)
    if isinstance(value, tuple):  # `x in ['a', 'b']` compiles to a tuple constant
        return tuple(_map_const(v) for v in value)
    if isinstance(value, frozenset):
        return frozenset(_map_const(v) for v in value)
    if isinstance(value, types.CodeType):
        return _retarget_code(value)
    return value


def _retarget_code(code: types.CodeType) -> types.CodeType:
    return code.replace(co_consts=tuple(_map_const(c) for c in code.co_consts))


def _retarget_constants(owner, attr: str, expected: set[str]) -> None:
    """Rewrite the CUDA string constants of ``owner.attr`` in place (its ``__code__``).

    ``expected`` lists the constants that must be present; a mismatch means Megatron changed and
    the patch must be revisited, so it raises instead of silently doing nothing.
    """
    func = getattr(owner, attr)
    func = getattr(func, "__func__", func)  # classmethod / staticmethod
    func = getattr(func, "__wrapped__", func)
    code = func.__code__

    def consts(c):
        for v in c.co_consts:
            if isinstance(v, (tuple, frozenset)):
                yield from v
            elif isinstance(v, types.CodeType):
                yield from consts(v)
            else:
                yield v

    found = {v for v in consts(code) if isinstance(v, str)}
    if not (expected & found) and found.isdisjoint(_CONST_MAP.values()):
        raise RuntimeError(f"{owner.__name__}.{attr}: none of {sorted(expected)} found")
    func.__code__ = _retarget_code(code)
