"""Checkpoints of the tiny GPT as megatron.training writes and reads them, and read back offline.

``save_torch_dist`` / ``load_torch_dist``: ``--ckpt-format torch_dist`` through dist_checkpointing,
as ``save_checkpoint`` (``generate_state_dict``) and ``load_checkpoint`` do it (model, then
optimizer, then scheduler). ``save_fsdp_dtensor`` / ``load_fsdp_dtensor``: Megatron-FSDP's
``--ckpt-format fsdp_dtensor``. ``read_offline``: every tensor of a saved checkpoint, whole, in one
process without a process group (torch's DCP reader), so a test can compare what a save wrote with
the live state without trusting the loader that wrote it. ``zero1_full_state``: that live state.
``save_fully_reshardable`` and ``max_state_diff``: the resharding tests' save
(``--dist-ckpt-optim-fully-reshardable``) and comparison, shared by the dense and MoE ones.
"""

from __future__ import annotations

import re
import types

import torch
import torch.distributed as dist
from megatron_harness import gather_fsdp_rows, global_name, unshard

__all__ = ["LR", "MUON", "SMALL_BUCKET", "WD", "adam_config", "fsdp_optimizer_state", "load_fsdp_dtensor",
           "load_torch_dist", "load_torch_dist_in_place", "read_offline", "save_fsdp_dtensor", "save_torch_dist",
           "torch_dist_keys", "unwrap", "zero1_full_state", "fsdp_saved_beside_live"]


LR, WD, BETAS, EPS = 0.02, 0.1, (0.9, 0.95), 1e-8
MUON = dict(tp_mode="owner", momentum=0.9, nesterov=True, scale_mode="spectral", extra_scale_factor=0.2,
            fp32_matmul_prec="highest", coefficient_type="quintic", num_ns_steps=5)
SMALL_BUCKET = 4000  # elements: DP ranges cut matrices mid-way, several buckets


def adam_config(dist_opt: bool, bf16: bool):
    """Megatron's OptimizerConfig of the checkpoint tests (Adam's settings for the AdamW params)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                           adam_beta2=BETAS[1], adam_eps=EPS, bf16=bf16, clip_grad=0.0,
                           use_distributed_optimizer=dist_opt)


def unwrap(module):
    """DDP -> (Float16Module ->) GPTModel, as megatron.training's ``unwrap_model`` before
    ``sharded_state_dict``."""
    while hasattr(module, "module"):
        module = module.module
    return module


def torch_dist_metadata(sharding_type: str | None) -> dict:
    """What megatron.training's ``_build_sharded_state_dict_metadata`` builds."""
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding_type is not None:
        metadata["distrib_optim_sharding_type"] = sharding_type
        # True = the gloo gather (--distrib-optim-fully-reshardable-mem-efficient); the default
        # (False) all-gathers on the CUDA device, which this CPU build does not have.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def save_torch_dist(ckpt_dir: str, model, optimizer, scheduler, sharding_type: str | None) -> None:
    """As ``megatron.training.checkpointing.save_checkpoint`` (generate_state_dict) does."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    metadata = torch_dist_metadata(sharding_type)
    state = {"model": unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, ckpt_dir, content_metadata=_clean_metadata_for_serialization(metadata))


def load_torch_dist(ckpt_dir: str, model, optimizer, scheduler, *, load_model: bool = True) -> None:
    """As ``megatron.training.checkpointing.load_checkpoint`` does: the sharding type comes from
    the checkpoint's content metadata; model, then optimizer, then scheduler."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    metadata = dist_checkpointing.load_content_metadata(ckpt_dir) or {}
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    state = {"model": unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    if not load_model:
        del state["model"]
    loaded = dist_checkpointing.load(state, ckpt_dir)
    if load_model:
        model[0].load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])


def load_torch_dist_in_place(ckpt_dir: str, model, optimizer, scheduler, *, restore: bool = True) -> dict | None:
    """As ``load_checkpoint`` loads a torch_dist checkpoint under ``--use-torch-fsdp2``
    (``skip_load_to_model_and_opt``): dist_checkpointing fills the model's and the optimizer's
    tensors in place, the scheduler is loaded, and neither ``load_state_dict`` of the model nor of
    the optimizer is called. ``restore``: then what the ``load_checkpoint`` hook adds,
    ``checkpoint.restore_in_place_load`` from the checkpoint's common state (its return value)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.checkpoint import restore_in_place_load

    metadata = dist_checkpointing.load_content_metadata(ckpt_dir) or {}
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    state = {"model": unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    loaded = dist_checkpointing.load(state, ckpt_dir)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if not restore:
        return None
    return restore_in_place_load(optimizer, dist_checkpointing.load_common_state_dict(ckpt_dir)["optimizer"])


def _fsdp_state(model, optimizer, *, loading: bool):
    """What ``megatron.training.checkpointing`` saves and loads for ``--ckpt-format fsdp_dtensor``
    (``generate_state_dict``): the model's state dict, the optimizer's ``fsdp_dtensor`` state."""
    model_sd = model[0].state_dict_for_save_checkpoint()
    state = {"model": model_sd}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=loading, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    return state


def _fsdp_args(model):
    """What ``preprocess_fsdp_dtensor_state_dict`` reads of the arguments (the expert count renumbers
    the experts' model keys globally)."""
    from argparse import Namespace

    return Namespace(swiglu=True, num_experts=unwrap(model[0]).config.num_moe_experts)


def _fsdp_unwrapped(model):
    """What ``save_checkpoint`` / ``load_checkpoint`` hand the preprocessing: ``unwrap_model``'s
    result, Megatron-FSDP's own module (the fc1 lookups go through it)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)[0]


def save_fsdp_dtensor(path: str, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    state = preprocess_fsdp_dtensor_state_dict(_fsdp_args(model), _fsdp_state(model, optimizer, loading=False),
                                               _fsdp_unwrapped(model))
    dcp.save(state, checkpoint_id=path)


def load_fsdp_dtensor(path: str, model, optimizer) -> None:
    """As ``load_checkpoint`` -> ``_load_base_checkpoint`` does, except that a key of the current
    state missing from the checkpoint fails here (Megatron allows a partial load by default)."""
    import torch.distributed.checkpoint as dcp
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict
    from torch.distributed.checkpoint import default_planner

    state = _fsdp_state(model, optimizer, loading=True)
    raw_model, raw_optimizer = state["model"].copy(), state["optimizer"].copy()
    state = preprocess_fsdp_dtensor_state_dict(_fsdp_args(model), state, _fsdp_unwrapped(model))
    dcp.load_state_dict(state_dict=state, storage_reader=dcp.FileSystemReader(path),
                        planner=default_planner.DefaultLoadPlanner(allow_partial_load=False))
    model[0].load_state_dict(raw_model, strict=False)  # Megatron's strict=False with SwiGLU (the _w/_v keys)
    optimizer.load_state_dict(raw_optimizer)


def read_offline(ckpt_dir: str, scratch: str) -> dict[str, torch.Tensor]:
    """Every tensor a DCP-based checkpoint (torch_dist, fsdp_dtensor) holds, whole, by key (nested
    keys joined by '/'), read in this process alone: torch's own reader, not Megatron's loader.
    ``scratch``: a file path for the intermediate torch.save copy."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt_dir, scratch)
    flat = {}

    def walk(tree, prefix):
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            elif isinstance(value, torch.Tensor):
                flat[f"{prefix}{key}"] = value

    walk(torch.load(scratch, weights_only=False), "")
    return flat


def _plain(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def fsdp_saved_beside_live(ckpt_dir: str, scratch: str, live: dict) -> list[tuple]:
    """An ``fsdp_dtensor`` save read back by torch's DCP reader (``read_offline``), paired with the
    live optimizer state ``live`` (``fsdp_optimizer_state``'s, or a union of ranks' of it):
    ``(param name, state key, saved tensor, live tensor)`` per state tensor, the step counters left
    out. Muon's momentum is saved under ``exp_avg``; a SwiGLU fc1's state as its gate and up
    halves (``weight_w`` / ``weight_v``), put back together here."""
    saved = {}
    for key, value in read_offline(ckpt_dir, scratch).items():
        if key.startswith("optimizer/state/"):
            name, part = key[len("optimizer/state/"):].rsplit("/", 1)
            saved[(_plain(name), part)] = value
    out = []
    for key, value in live.items():
        if key.startswith("muon_steps") or key.endswith(".step"):
            continue
        name, part = key.rsplit(".", 1)
        name, part = _plain(name), "exp_avg" if part == "momentum_buffer" else part
        if (name, part) in saved:
            stored = saved[(name, part)]
        else:  # the gated fc1: [gate; up] saved as two halves
            stored = torch.cat([saved[(name + "_w", part)], saved[(name + "_v", part)]])
        out.append((name, part, stored, value))
    return out


def torch_dist_keys(model) -> dict[int, tuple[str, int | None]]:
    """``id(param) → (its torch_dist key, its layer along the stacked layer axis or None)``. The key
    comes from the model's own ``sharded_state_dict`` (which renames some params, e.g. a layer's
    input norm to ``self_attention.linear_qkv.layer_norm_weight``); a transformer layer's params
    are saved stacked over the layers (``decoder.layers.*``), at their global layer number."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    gpt = unwrap(model[0])
    keys = {id(item.data): item.key for item in nested_values(gpt.sharded_state_dict())
            if isinstance(getattr(item, "data", None), torch.Tensor) and hasattr(item, "key")}
    out = {}
    for name, param in gpt.named_parameters():
        layer = re.match(r"decoder\.layers\.(\d+)\.", global_name(gpt, name))
        out[id(param)] = (keys[id(param)], int(layer[1]) if layer else None)
    return out


def zero1_full_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The live state of a distributed (ZeRO-1) optimizer as a full-model checkpoint stores it,
    returned on every rank: ``{(torch_dist key, layer index or None): {"weight", "param",
    "exp_avg", "exp_avg_sq"}}``,
    each the whole (TP- and DP-gathered, TP=1-layout) fp32 tensor. ``param`` is the fp32 main
    param; Muon's momentum is ``exp_avg`` and ``exp_avg_sq`` its zero placeholder
    (``megatron_muon.megatron.checkpoint``)."""
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.catalogue import is_muon_matrix

    opt = optimizer.chained_optimizers[0]
    inner = opt.optimizer
    gpt = unwrap(model[0])
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    ckpt_keys = torch_dist_keys(model)
    out = {}
    for p in gpt.parameters():
        keys = ("momentum_buffer",) if is_muon_matrix(p) else ("exp_avg", "exp_avg_sq")
        local = {k: torch.zeros(p.numel()) for k in ("param", *keys)}
        if p in opt.model_param_group_index_map:
            gi, go = opt.model_param_group_index_map[p]
            main = inner.param_groups[gi]["params"][go]
            rng = opt._get_model_param_range_map(p)["param"]
            local["param"][rng.start:rng.end] = main
            for k in keys:
                local[k][rng.start:rng.end] = inner.state[main][k]
        state = {"weight": p.detach().float().clone()}
        for k, v in local.items():
            dist.all_reduce(v, group=dp_group)  # disjoint DP ranges: the sum is exact
            state["exp_avg" if k == "momentum_buffer" else k] = v.view(p.shape)
        if is_muon_matrix(p):
            state["exp_avg_sq"] = torch.zeros(p.shape)
        tp = dist.get_world_size(tp_group)
        for k, v in state.items():
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                pieces = [torch.empty_like(v) for _ in range(tp)]
                dist.all_gather(pieces, v.contiguous(), group=tp_group)
                v = unshard(pieces, p)
            state[k] = v
        out[ckpt_keys[id(p)]] = state
    return out


def fsdp_optimizer_state(optimizer) -> dict:
    """Every state tensor of the inner optimizer, by param name, gathered whole (DP shards
    concatenated), plus the step counters: the optimizer's, and each param's where this rank
    holds a piece of it (a rank never steps a param whose shard is empty there: no grad; a load
    sets its counter to the optimizer's, ``fsdp._canonical``)."""
    out = {}
    for i, inner in enumerate(optimizer.chained_optimizers):  # dense, then experts (MoE)
        out[f"muon_steps.{i}"] = inner.optimizer.muon_steps
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                name = inner._param_name(param)
                for key, value in sorted(inner.optimizer.state[param].items()):
                    if key == "step" and param._local_tensor.numel() == 0:
                        continue
                    if hasattr(value, "_local_tensor"):
                        out[f"{name}.{key}"] = gather_fsdp_rows(value, expert=".local_experts." in name)
                    else:
                        out[f"{name}.{key}"] = value.detach().clone()
    return out


def save_fully_reshardable(ckpt_dir: str, model, optimizer, scheduler) -> None:
    """As ``save_checkpoint`` writes model, optimizer and scheduler, with the metadata
    megatron.training builds for ``--dist-ckpt-optim-fully-reshardable`` alone."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata

    args = types.SimpleNamespace(use_distributed_optimizer=True, ckpt_format="torch_dist",
                                 dist_ckpt_optim_fully_reshardable=True,
                                 distrib_optim_fully_reshardable_mem_efficient=False)
    metadata = _build_sharded_state_dict_metadata(args, dp_cp_group=ps.get_data_parallel_group(
        with_context_parallel=True))
    assert metadata["distrib_optim_fully_reshardable_mem_efficient"] is False
    state = {"model": unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    # No CUDA: the optimizer switched to the gloo gather (Megatron's CUDA one would have raised).
    assert metadata["distrib_optim_fully_reshardable_mem_efficient"] is True
    state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, ckpt_dir, content_metadata=_clean_metadata_for_serialization(metadata))


def max_state_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| over every tensor of two full states (name -> key -> tensor), and where."""
    assert a.keys() == b.keys()
    worst = (0.0, "")
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            d = (a[name][k] - b[name][k]).abs().max().item()
            worst = max(worst, (d, f"{name} {k}"))
    return worst
