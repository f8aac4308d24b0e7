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
  ``Stream()``, ``stream(...)``): ``_retarget_device_view`` gives such a function a wider view,
  ``_CpuDeviceTorch`` (the CPU is one device; null streams), under its own global name;
* a call that cannot be retargeted from inside (an assertion on ``torch.cuda.is_available()``,
  ``Module.cuda(...)``, a branch on ``device_count()``): the module attribute it is called
  through (looked up at call time) is replaced, as for the RNG tracker above: by a wrapper
  around the original, or by a stand-in where the CPU's answer is fixed (the GPU architecture)
  or there is nothing to do (the CUDA-fusion warm-up).

A patch raises if a constant or name it expects is missing, i.e. on another Megatron version.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import types

import torch

__all__ = ["PATCHES", "apply_cpu_patches"]

_APPLIED: list[str] | None = None
_VIEW = "_megatron_muon_cpu_torch"  # the global name patched functions use instead of `torch`


# --------------------------------------------------------------------------- mechanisms


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


def _strings(code: types.CodeType) -> set[str]:
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


def _retarget(owner, attr: str, *, consts: tuple[str, ...] = (), view: bool = False) -> None:
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
    missing = set(consts) - _strings(code)
    if missing:
        raise RuntimeError(f"cpu_patches: {where} has no {sorted(missing)}; Megatron changed?")
    if view:
        ops = {i.opname for c in _walk(code) for i in dis.get_instructions(c)
               if i.argval == "torch"}
        if ops != {"LOAD_GLOBAL"}:
            raise RuntimeError(f"cpu_patches: {where} uses `torch` as {sorted(ops)}")
        func.__globals__[_VIEW] = _CPU_TORCH
    func.__code__ = _rewrite(code, bool(consts), view)


# --------------------------------------------------------------------------- the patches


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
    _retarget(mrandom.CudaRNGStatesTracker, "add", view=True)


def patch_grad_buffer() -> None:
    """megatron/core/distributed/param_and_grad_buffer.py (DDP's contiguous buffers): CPU view.

    * ``_ParamAndGradBuffer.__init__`` allocates ``param_data`` / ``grad_data`` with
      ``device=torch.cuda.current_device()``;
    * ``_ParamAndGradBucketGroup.start_grad_sync`` (from ``finish_grad_sync``) waits on
      CUDA-graph events through ``torch.cuda.current_stream()`` (there are none on CPU).
    """
    from megatron.core.distributed import param_and_grad_buffer as m

    _retarget(m._ParamAndGradBuffer, "__init__", view=True)
    _retarget(m._ParamAndGradBucketGroup, "start_grad_sync", view=True)


def patch_rotary() -> None:
    """megatron/core/models/common/embeddings/rotary_pos_embedding.py: CPU view.

    ``RotaryEmbedding.get_emb`` moves ``inv_freq`` (built on CPU under
    ``use_cpu_initialization``) to ``torch.cuda.current_device()`` on the first forward;
    ``RotaryEmbedding.__init__`` builds it there when not given ``use_cpu_initialization``, as
    MLA's attention (``MLASelfAttention``, ``rope_type="rope"``) builds it.
    """
    from megatron.core.models.common.embeddings import rotary_pos_embedding as m

    _retarget(m.RotaryEmbedding, "get_emb", view=True)
    _retarget(m.RotaryEmbedding, "__init__", view=True)


def patch_utils() -> None:
    """megatron/core/utils.py.

    * ``GlobalMemoryBuffer.get_tensor`` allocates with ``device=torch.cuda.current_device()``
      (CPU view); ``DotProductAttention.forward`` takes its QK^T buffer from it;
    * ``local_multi_tensor_l2_norm`` (the no-apex ``multi_tensor_l2norm`` that
      ``get_grad_norm_fp32`` uses) returns ``torch.tensor(..., device="cuda")``.
    """
    from megatron.core import utils as m

    _retarget(m.GlobalMemoryBuffer, "get_tensor", view=True)
    _retarget(m, "local_multi_tensor_l2_norm", consts=("cuda",))


def patch_grad_scaler() -> None:
    """megatron/core/optimizer/grad_scaler.py: ``MegatronGradScaler.__init__`` and
    ``DynamicGradScaler.__init__`` build their scale tensors with ``device='cuda'``; a loss scale
    (``--loss-scale``) is what makes ``MixedPrecisionOptimizer.prepare_grads`` check grads for
    inf/NaN and skip the step."""
    from megatron.core.optimizer import grad_scaler as m

    _retarget(m.MegatronGradScaler, "__init__", consts=("cuda",))
    _retarget(m.DynamicGradScaler, "__init__", consts=("cuda",))


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
        _retarget(owner, attr, view=True)


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

    _retarget_device_view(async_utils.PersistentAsyncCaller, "async_loop", names=("set_device", "device_count"))
    _retarget(async_utils.AsyncCaller, "sync_all_async_calls", view=True)
    _retarget(async_utils.AsyncCallsQueue, "maybe_finalize_async_calls", view=True)
    _retarget(async_utils.TemporalAsyncCaller, "schedule_async_call", view=True)
    _retarget(state_dict_saver, "verify_global_md_reuse", consts=("cuda",))


def patch_timers() -> None:
    """megatron/core/timers.py: ``Timer.start`` / ``Timer.stop`` call ``torch.cuda.synchronize()``
    (CPU view: a no-op, CPU kernels are synchronous) and
    ``Timers._get_elapsed_time_all_ranks`` gathers on ``torch.cuda.current_device()`` (CPU view):
    Megatron's training loop times every iteration with them."""
    from megatron.core import timers as m

    _retarget(m.Timer, "start", view=True)
    _retarget(m.Timer, "stop", view=True)
    _retarget(m.Timers, "_get_elapsed_time_all_ranks", view=True)


def patch_training_log() -> None:
    """megatron/training: ``training.training_log`` (Megatron's iteration log line) starts and
    resets its loss accumulators with ``torch.tensor([0.0], device='cuda')``;
    ``utils.common_utils.reduce_max_stat_across_model_parallel_group`` see below. (Its memory report,
    ``torch.cuda.memory_stats``, runs only with --log-memory-to-tensorboard and is left alone.)"""
    from megatron.training import training as m
    from megatron.training.utils import common_utils

    _retarget(m, "training_log", consts=("cuda",))
    # The lr it logs is reduced over the model-parallel group from a tensor made on
    # ``torch.cuda.current_device()`` (CPU view).
    _retarget(common_utils, "reduce_max_stat_across_model_parallel_group", view=True)


def patch_causal_mask() -> None:
    """megatron/core/transformer/utils.py: ``get_default_causal_mask`` builds its mask with
    ``torch.ones(sq, sq, device="cuda")``; ``FusedScaleMaskSoftmax.forward_torch_softmax`` calls
    it when the batch carries no attention mask (causal mask type)."""
    from megatron.core.transformer import utils as m

    _retarget(m, "get_default_causal_mask", consts=("cuda",))


def patch_moe_router() -> None:
    """megatron/core/transformer/moe/router.py: ``Router.gating`` (every MoE layer's forward)
    moves a CPU router weight to ``torch.cuda.current_device()``: CPU view (it stays put)."""
    from megatron.core.transformer.moe import router as m

    _retarget(m.Router, "gating", view=True)


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
        _retarget(mappings, attr, view=True)
    _retarget(layers.LinearWithGradAccumulationAndAsyncCommunication, "backward", view=True)


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

    _retarget(m.MegatronOptimizer, "has_grad_norm_group", consts=("cuda",))
    _retarget(m.MixedPrecisionOptimizer, "__init__", consts=("cuda",))
    types_ = ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor")
    _retarget(m.Float16OptimizerWithFloat16Params, "__init__", consts=types_)
    _retarget(m.FP32Optimizer, "__init__", consts=("cuda",))


def patch_clip_grads() -> None:
    """megatron/core/optimizer/clip_grads.py (called from ``MegatronOptimizer.step``).

    * ``get_grad_norm_fp32``: ``torch.zeros(1, ..., device='cuda')`` accumulators;
    * ``clip_grad_by_total_norm_fp32``: ``assert param.grad.type() == 'torch.cuda.FloatTensor'``
      and a ``device='cuda'`` overflow buffer (reached when ``clip_grad > 0``);
    * ``count_zeros_fp32``: a ``device='cuda'`` counter (reached with ``log_num_zeros_in_grad``).
    """
    from megatron.core.optimizer import clip_grads as m

    _retarget(m, "get_grad_norm_fp32", consts=("cuda",))
    _retarget(m, "clip_grad_by_total_norm_fp32", consts=("cuda", "torch.cuda.FloatTensor"))
    _retarget(m, "count_zeros_fp32", consts=("cuda",))


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
    _retarget(m.DistributedOptimizer, "_build_model_and_main_param_groups",
              consts=(*half, "torch.cuda.FloatTensor"))
    _retarget(m.DistributedOptimizer, "__init__", consts=half)


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

    _retarget(schedules, "forward_backward_no_pipelining", consts=("cuda",))
    _retarget(schedules, "forward_backward_pipelining_without_interleaving", consts=("cuda",))
    _retarget(schedules, "forward_backward_pipelining_with_interleaving", consts=("cuda",))
    _retarget(p2p_communication.P2PCommunicator, "_communicate", view=True)


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
    _retarget(m, "initialize_megatron", view=True)
    training.initialize_megatron = _initialize_megatron_cpu
    m._set_random_seed = _set_random_seed_cpu
    if "cuda" not in _strings(m._warmup_jit_function.__code__):
        raise RuntimeError("cpu_patches: initialize._warmup_jit_function changed; Megatron changed?")
    m._warmup_jit_function = lambda tp_size=None: None


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


def _retarget_device_view(owner, attr: str, *, names: tuple[str, ...]) -> None:
    """``_retarget(view=True)`` with ``_CpuDeviceTorch`` as the view, under its own global name
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


def _rename_method_call(owner, attr: str, method: str, to: str) -> None:
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


def patch_initialize_distributed() -> None:
    """megatron/training/initialize.py: ``_initialize_distributed`` (from ``initialize_megatron``)
    builds Megatron's parallel state (``mpu.initialize_model_parallel``: TP / PP / DP groups) only
    ``if device_count > 0`` (``torch.cuda.device_count()``), after ``torch.cuda.set_device``:
    device view (the CPU is one device, ``set_device`` a no-op). The ``device_id`` it then
    builds, ``torch.device('cuda:<local rank>')``, is only used by
    ``inprocess_restart.maybe_force_nccl_backend_init``, which does nothing without
    ``--inprocess-restart``."""
    from megatron.training import initialize as m

    _retarget_device_view(m, "_initialize_distributed", names=("device_count", "set_device"))


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

    _retarget_device_view(m, "get_model", names=("Stream", "stream", "current_stream"))
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


def patch_pretrain() -> None:
    """megatron/training/training.py: ``pretrain`` all-reduces its start timestamps from
    ``torch.tensor([...], dtype=torch.double, device='cuda')`` (program start, train start):
    constants retargeted."""
    from megatron.training import training as m

    _retarget(m, "pretrain", consts=("cuda",))


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
        _retarget(m, attr, consts=("cuda",))


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

    _retarget(m, "_save_state", view=True)
    _retarget(m, "validate_result", view=True)
    _retarget(m, "_log_validation_error_to_file", view=True)
    _retarget(m, "_reduce_any", consts=("cuda",))


def patch_batch_broadcast() -> None:
    """megatron/core/utils.py: ``get_batch_on_this_tp_rank`` (a GPT ``forward_step``'s
    ``get_batch``: TP rank 0 broadcasts the micro-batch to its TP group) allocates the receive
    buffers, and the cu_seqlens / hybrid-CP lengths, on ``torch.cuda.current_device()``: CPU
    view."""
    from megatron.core import utils as m

    _retarget(m, "get_batch_on_this_tp_rank", view=True)


def patch_training_utils() -> None:
    """megatron/training/utils/common_utils.py, beyond ``patch_training_log``'s.

    * ``logical_and_across_model_parallel_group`` (``train_step``: did every model-parallel
      rank's optimizer step succeed) all-reduces a flag made on ``torch.cuda.current_device()``:
      CPU view;
    * ``_compute_norm_2`` and ``calc_dtensor_params_l2_norm`` (``calc_params_l2_norm``, the
      ``--log-params-norm`` column of the log line) accumulate in ``device='cuda'`` tensors.
    """
    from megatron.training.utils import common_utils as m

    _retarget(m, "logical_and_across_model_parallel_group", view=True)
    _retarget(m, "_compute_norm_2", consts=("cuda",))
    _retarget(m, "calc_dtensor_params_l2_norm", consts=("cuda",))


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

    _retarget(m, "get_rng_state", view=True)
    _retarget(m, "read_metadata", consts=("cuda",))


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

    _retarget(adapter.FullyShardedDataParallel, "__init__", consts=("cuda:",), view=True)
    _retarget(adapter.FullyShardedDataParallel, "_init_dist_index", consts=("cuda",))
    _retarget(adapter, "_get_rng_state_dict", view=True)
    _retarget(fsdp.MegatronFSDP, "__init__", consts=("cuda:",), view=True)
    _retarget_device_view(fsdp.MegatronFSDP, "_init_fsdp_param_and_grad_buffer", names=("Stream",))
    _retarget_device_view(buffers.GradReducePipeline, "__init__", names=("Stream",))
    _retarget_device_view(buffers.GradReducePipeline, "_bucket_group_gradient_reduce",
                          names=("stream", "current_stream"))
    _retarget_device_view(buffers.AllGatherPipeline, "__init__", names=("Stream",))
    _retarget_device_view(buffers.AllGatherPipeline, "all_gather_params", names=("stream", "current_stream"))
    _rename_method_call(uneven_dtensor, "validate_uneven_dtensor", "cuda", "cpu")


def patch_torch_fsdp2() -> None:
    """megatron/core/distributed/torch_fully_sharded_data_parallel.py (``--use-torch-fsdp2``).

    * ``TorchFullyShardedDataParallel.__init__`` builds its ``DeviceMesh.from_group(
      self.process_group, "cuda")``: the constant becomes ``"cpu"`` (a gloo mesh), so
      ``fully_shard`` keeps the params on the CPU and its DTensors live there.
    """
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp

    _retarget(torch_fsdp.TorchFullyShardedDataParallel, "__init__", consts=("cuda",))


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
    _rename_method_call(buffers.ParamAndGradBuffer, "_init_each_parameter_group_buffers", "is_meta", "is_quantized")
    buffers.validate_uneven_dtensor = _unless_fake_backend(buffers.validate_uneven_dtensor)
    fsdp = adapter.FullyShardedDataParallel
    fsdp.sync_rng_states_across_tp_group = _unless_fake_backend(fsdp.sync_rng_states_across_tp_group)


def _unless_fake_backend(func):
    """``func``, which does nothing under torch's fake process group."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake":
            return None
        return func(*args, **kwargs)

    wrapper._skips_fake_backend = True
    return wrapper


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
