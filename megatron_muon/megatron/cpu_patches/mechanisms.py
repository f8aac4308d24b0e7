"""The mechanisms behind the CPU patches: retarget a Megatron function to the CPU in place
(its constants, its global ``torch``), the CPU stand-ins for ``torch.cuda``, streams and events.
See the package docstring for what each mechanism is for."""

from __future__ import annotations

import contextlib
import dis
import functools
import types

import torch

_VIEW = "_megatron_muon_cpu_torch"  # the global name patched functions use instead of `torch`


class _NullEvent:
    """Stands in for a CUDA event recorded on a ``_NullStream``: already complete."""

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullStream:
    """Stands in for a CUDA stream: CPU kernels are synchronous, so every wait is already met."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return _NullEvent()


_VIEW_DEVICE = [torch.device("cpu")]  # what current_device() answers; the dry run sets meta


@contextlib.contextmanager
def view_device(device: torch.device):
    """Within the block, patched code allocates on ``device`` instead of the CPU.

    ``scripts/dry_run.py`` builds Megatron's DDP buffers and optimizer at production sizes on
    the ``meta`` device (no memory) under torch's fake process group.
    """
    before = _VIEW_DEVICE[0]
    _VIEW_DEVICE[0] = device
    try:
        yield
    finally:
        _VIEW_DEVICE[0] = before


class _CpuCuda:
    """``torch.cuda`` as seen by a patched function: device, stream, seed calls go to the CPU."""

    @staticmethod
    def current_device():
        return _VIEW_DEVICE[0]

    @staticmethod
    def current_stream(device=None):
        return _NullStream()

    @staticmethod
    def synchronize(device=None):
        pass  # CPU kernels have finished when they return

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    def __getattr__(self, name):  # anything else: the real torch.cuda (raises as before)
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """The real ``torch`` module, except that ``.cuda`` is ``_CpuCuda``."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch("torch")


class _HostTypeName(str):
    """A ``Tensor.type()`` name that also matches the meta device's (``torch.meta.FloatTensor``).

    Megatron sorts params by ``param.type() == 'torch.cuda.FloatTensor'`` and ``in [...]``; the
    rewritten constant must accept the CPU's name and, in the dry run, the meta device's. A str
    subclass's ``__eq__`` is tried first on both sides of ``==`` and inside ``in``.
    """

    def __eq__(self, other):
        return str.__eq__(self, other) or (isinstance(other, str) and other == self.replace("torch.", "torch.meta.", 1))

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


_CONSTANTS = {
    "cuda": "cpu",
    # f"cuda:{torch.cuda.current_device()}" with the CPU view: "" + "cpu", i.e. torch.device("cpu")
    "cuda:": "",
    "torch.cuda.FloatTensor": _HostTypeName("torch.FloatTensor"),
    "torch.cuda.HalfTensor": _HostTypeName("torch.HalfTensor"),
    "torch.cuda.BFloat16Tensor": _HostTypeName("torch.BFloat16Tensor"),
}


def _walk(code: types.CodeType):
    """``code`` and every code object nested in it (lambdas, inner functions)."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _walk(c)


def code_strings(code: types.CodeType) -> set[str]:
    """Every string constant of ``code``, inside tuple constants and nested code included."""
    found = set()
    for c in _walk(code):
        for v in c.co_consts:
            items = v if isinstance(v, (tuple, frozenset)) else (v,)
            found.update(x for x in items if isinstance(x, str))
    return found


def _map_const(value):
    if isinstance(value, str):
        return _CONSTANTS.get(value, value)
    if isinstance(value, (tuple, frozenset)):  # `x in ['a', 'b']` compiles to a tuple constant
        return type(value)(_map_const(v) for v in value)
    return value


def _rewrite(code: types.CodeType, consts: bool, view: bool) -> types.CodeType:
    co_consts = tuple(
        _rewrite(c, consts, view) if isinstance(c, types.CodeType)
        else (_map_const(c) if consts else c)
        for c in code.co_consts
    )
    co_names = tuple(_VIEW if (view and n == "torch") else n for n in code.co_names)
    return code.replace(co_consts=co_consts, co_names=co_names)


def retarget(owner, attr: str, *, consts: tuple[str, ...] = (), view: bool = False) -> None:
    """Retarget ``owner.attr`` (a function or method) to the CPU, in place.

    ``consts``: the CUDA string constants it must contain; they are all mapped by ``_CONSTANTS``.
    ``view``: its global ``torch`` becomes ``_CPU_TORCH`` (``torch`` must only be read as a
    global there: a local ``import torch`` or an attribute named ``torch`` would be renamed too).
    """
    func = getattr(owner, attr)
    func = getattr(func, "__func__", func)  # classmethod / staticmethod
    func = getattr(func, "__wrapped__", func)  # functools.wraps / lru_cache
    code = func.__code__
    where = f"{getattr(owner, '__name__', owner)}.{attr}"
    missing = set(consts) - code_strings(code)
    if missing:
        raise RuntimeError(f"cpu_patches: {where} has no {sorted(missing)}; Megatron changed?")
    if view:
        ops = {i.opname for c in _walk(code) for i in dis.get_instructions(c)
               if i.argval == "torch"}
        if ops != {"LOAD_GLOBAL"}:
            raise RuntimeError(f"cpu_patches: {where} uses `torch` as {sorted(ops)}")
        func.__globals__[_VIEW] = _CPU_TORCH
    func.__code__ = _rewrite(code, bool(consts), view)


class _CpuDeviceCuda(_CpuCuda):
    """``_CpuCuda`` for the setup code that counts and creates devices and streams: the CPU is
    one device (``device_count() == 1``; ``set_device`` has nothing to select), ``Stream()`` is
    a ``_NullStream`` and ``stream(s)`` a no-op context (CPU kernels run in program order)."""

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        pass

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (torch's name)
        return _NullStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _CpuDeviceTorch(types.ModuleType):
    """The real ``torch`` module, except that ``.cuda`` is ``_CpuDeviceCuda``."""

    cuda = _CpuDeviceCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


_DEVICE_VIEW = "_megatron_muon_cpu_device_torch"  # its global name, apart from _VIEW's


def retarget_device_view(owner, attr: str, *, names: tuple[str, ...]) -> None:
    """``retarget(view=True)`` with ``_CpuDeviceTorch`` as the view, under its own global name
    (so other patched functions of the module keep ``_CPU_TORCH``). ``names``: the attribute
    names it must use (e.g. ``device_count``), else Megatron changed."""
    func = getattr(owner, attr)
    func = getattr(func, "__wrapped__", func)
    code = func.__code__
    where = f"{getattr(owner, '__name__', owner)}.{attr}"
    ops = {i.opname for c in _walk(code) for i in dis.get_instructions(c) if i.argval == "torch"}
    found = {n for c in _walk(code) for n in c.co_names}
    if ops != {"LOAD_GLOBAL"} or not set(names) <= found:
        raise RuntimeError(f"cpu_patches: {where} changed (torch as {sorted(ops)}, "
                           f"missing {sorted(set(names) - found)}); Megatron changed?")

    def rename(c: types.CodeType) -> types.CodeType:
        consts = tuple(rename(x) if isinstance(x, types.CodeType) else x for x in c.co_consts)
        return c.replace(co_consts=consts,
                         co_names=tuple(_DEVICE_VIEW if n == "torch" else n for n in c.co_names))

    func.__globals__[_DEVICE_VIEW] = _CpuDeviceTorch("torch")
    func.__code__ = rename(code)


def rename_method_call(owner, attr: str, method: str, to: str) -> None:
    """In ``owner.attr`` only, every attribute or method named ``method`` is read as ``to``
    (``tensor.cuda()`` -> ``tensor.cpu()``). Refused if the function uses ``torch.<method>``
    (that would be renamed too) or no longer reads ``method``."""
    func = getattr(owner, attr)
    code = func.__code__
    where = f"{getattr(owner, '__name__', owner)}.{attr}"
    ins = [i for c in _walk(code) for i in dis.get_instructions(c)]
    after_torch = {b.argval for a, b in zip(ins, ins[1:]) if a.argval == "torch"}
    if method in after_torch or method not in {n for c in _walk(code) for n in c.co_names}:
        raise RuntimeError(f"cpu_patches: {where} changed (reads torch.{method}, or no .{method}); Megatron changed?")

    def rename(c: types.CodeType) -> types.CodeType:
        consts = tuple(rename(x) if isinstance(x, types.CodeType) else x for x in c.co_consts)
        return c.replace(co_consts=consts, co_names=tuple(to if n == method else n for n in c.co_names))

    func.__code__ = rename(code)


def unless_fake_backend(func):
    """``func``, which does nothing under torch's fake process group."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake":
            return None
        return func(*args, **kwargs)

    wrapper._skips_fake_backend = True
    return wrapper
