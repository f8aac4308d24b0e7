"""A resume whose optimizer state is not the checkpoint's own: fresh, or megatron-core's Muon's.

Megatron's ``load_checkpoint`` (megatron-core 0.19.2, ``training/checkpointing.py``) has one
switch for the optimizer, ``--no-load-optim``, and its "Optimizer." section guards the LR/WD
scheduler with it too: ``--no-load-optim`` loads the model weights, the iteration and the RNG
state, skips the optimizer *and* ``opt_param_scheduler``, and (bf16) refreshes the fp32 main
params from the loaded weights (``optimizer.reload_model_params()``). The scheduler then starts
at step 0 while the iteration continues: the LR goes back to warmup. Two flags build on it:

``--muon-reset-optimizer-state`` (``load_with_fresh_optimizer``): Megatron's load with
``no_load_optim`` set for its duration, then the scheduler's state from the checkpoint's
common state (the dict ``_load_base_checkpoint(rank0=True)`` returns, which Megatron itself
reads first), restored exactly as Megatron restores it. Invariants after the load: the model
weights, iteration, consumed samples, RNG and scheduler (so the LR and WD of iteration N+1) are
the checkpoint's; the optimizer holds what a new one holds — Muon momentum and Adam moments
zero (created at the first step), Adam's step 0 (its bias correction restarts with the
moments), ``muon_steps`` 0, so under MuonBP the first step after the reset is a full step
(the phase restarts with the momentum it orthogonalizes; ``docs/checkpoints.md``), and the fp32
main params equal the loaded weights. Nothing in it depends on the optimizer, so it serves
upstream's optimizers too (``--optimizer dist_muon`` resuming a megatron-muon checkpoint).

``--muon-load-upstream-optimizer`` (``load_upstream_optimizer_state``): the same load, then
megatron-core's Muon's per-param state read from the checkpoint into megatron-muon's optimizer.
Upstream (``--optimizer muon`` under DDP, and ``dist_muon``'s layer-wise optimizer) saves its
state keyed by model param, ``optimizer.state.<name>.<model param key>``
(``dist_checkpointing.optimizer.optim_state_to_sharding_state``): ``momentum_buffer`` for the
Muon matrices, ``exp_avg`` / ``exp_avg_sq`` for Adam's params, ``fp32_param`` for bf16 main
params, and Adam's step once (``common_step``) in the common state. Each is requested with the
model param's own sharding (``make_sharded_optimizer_tensor``, as Megatron builds the request),
so any TP / PP / DP layout of this run reads it, and copied into the state of the param's main
shard (under the distributed optimizer, its range of the flattened param). Invariants: a Muon
matrix's momentum is upstream's ``momentum_buffer``, an AdamW param's moments are upstream's
Adam moments, every step counter and ``muon_steps`` is upstream's Adam step; a param whose
upstream state is absent or of the other algorithm starts fresh and is named in the load line.
"""

from __future__ import annotations

import re

import torch

from .errors import UserInputError

__all__ = ["UPSTREAM_MUON_SETTINGS", "is_plugin_checkpoint", "is_upstream_muon_checkpoint", "load_common_state",
           "load_upstream_optimizer_state", "load_with_fresh_optimizer", "restore_scheduler", "routing_differences",
           "settings_differences"]

UPSTREAM_MUON_SETTINGS = ("muon_momentum", "muon_nesterov", "muon_coefficient_type", "muon_num_ns_steps",
                          "muon_scale_mode", "muon_extra_scale_factor", "muon_split_qkv", "muon_fp32_matmul_prec",
                          "muon_tp_mode")
"""The flags that define Muon's update in both implementations: a difference changes the next step."""

_STATE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(momentum_buffer|exp_avg_sq|exp_avg|fp32_param)\.(.+)$")
_ACTIVE = "megatron_muon"  # hooks.ACTIVE: saved with the args, True in every checkpoint the plugin wrote


def load_common_state(margs, load_dir: str):
    """The checkpoint's common (rank-0) state dict, or None: Megatron's own first read in
    ``load_checkpoint`` (``_load_base_checkpoint(rank0=True)``: torch_dist's common state, a
    legacy checkpoint's rank-0 file)."""
    from megatron.training.checkpointing import _load_base_checkpoint

    state_dict, _, release, _ = _load_base_checkpoint(load_dir, margs, rank0=True)
    return None if release else state_dict


def is_plugin_checkpoint(common) -> bool:
    return bool(getattr((common or {}).get("args"), _ACTIVE, False))


def is_upstream_muon_checkpoint(common) -> bool:
    """Written by megatron-core's own Muon (``--optimizer muon`` / ``dist_muon`` without the plugin)."""
    ckpt_args = (common or {}).get("args")
    return (ckpt_args is not None and getattr(ckpt_args, "optimizer", None) in ("muon", "dist_muon")
            and not is_plugin_checkpoint(common) and not getattr(ckpt_args, "no_save_optim", False))


def restore_scheduler(opt_param_scheduler, common) -> None:
    """What Megatron's load does with the scheduler when it loads the optimizer."""
    if opt_param_scheduler is None:
        return
    saved = common.get("lr_scheduler", common.get("opt_param_scheduler"))  # Megatron's backward compatibility
    if saved is not None:
        try:
            opt_param_scheduler.load_state_dict(saved)
        except AssertionError as err:  # Megatron's _check_and_set: a flag differs from the saved schedule
            raise UserInputError(f"the checkpoint's LR/WD schedule: {str(err).strip()}; pass the run's saved "
                                 "schedule flags, or --override-opt-param-scheduler (this run's settings, the "
                                 "checkpoint's step)") from err
    else:
        raise UserInputError("--muon-reset-optimizer-state: the checkpoint holds no opt_param_scheduler state "
                             "(saved with --no-save-optim?); load it with --no-load-optim (the LR schedule restarts)")


def load_with_fresh_optimizer(load_checkpoint, margs, ddp_model, optimizer, opt_param_scheduler, common,
                              *args, **kwargs):
    """Megatron's load without the optimizer (``no_load_optim`` set for the call), then the
    scheduler from ``common``; returns what ``load_checkpoint`` returns."""
    saved = margs.no_load_optim
    margs.no_load_optim = True
    try:
        result = load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *args, **kwargs)
    finally:
        margs.no_load_optim = saved
    if common is not None and not getattr(margs, "finetune", False):
        restore_scheduler(opt_param_scheduler, common)
    return result


def settings_differences(margs, ckpt_args) -> list[str]:
    """``flag: checkpoint value -> this run's`` for each Muon setting that differs."""
    out = []
    for name in UPSTREAM_MUON_SETTINGS:
        old, new = getattr(ckpt_args, name, None), getattr(margs, name, None)
        if name == "muon_tp_mode":  # the exact modes compute one update; blockwise (BlockMuon) another
            old, new = (None if v is None else "blockwise" if v == "blockwise" else "exact" for v in (old, new))
        if old is not None and old != new:
            out.append(f"--{name.replace('_', '-')}: {old} -> {new}")
    if getattr(margs, "swiglu", False) and getattr(margs, "muon_split_fc1", False):
        # megatron-core 0.19.2 orthogonalizes a fused SwiGLU fc1 whole; megatron-muon splits it by default
        out.append("fc1 gate and up orthogonalized apart (--muon-split-fc1; --muon-no-split-fc1 keeps upstream's)")
    out += routing_differences(margs, ckpt_args)
    return out


_IN_PROJ_DIFFERENCES = {
    "split": "Mamba in_proj split by role, z, x, B, C, dt orthogonalized apart (--muon-mamba-in-proj split; "
             "megatron-core 0.19.2: Muon whole, --muon-mamba-in-proj whole; upstream main: AdamW, "
             "--muon-mamba-in-proj adamw)",
    "whole": "Mamba in_proj: Muon whole, as megatron-core 0.19.2 (upstream main: AdamW, --muon-mamba-in-proj adamw)",
    "adamw": "Mamba in_proj: AdamW, as upstream main (megatron-core 0.19.2: Muon whole, --muon-mamba-in-proj whole)",
}
"""The migration line of each ``--muon-mamba-in-proj`` choice against the two upstream routings:
megatron-core 0.19.2 orthogonalizes a Mamba in_proj whole, its main branch after 0.19.2 sends it
to AdamW (PR #6074); every choice differs from one of them."""


def routing_differences(margs, ckpt_args) -> list[str]:
    """One line per routing of this run that differs from megatron-core 0.19.2's or from its main
    branch's (or from the checkpoint's recorded ``--moe-router-skip-muon``): a Mamba in_proj, an MoE
    router."""
    out = []
    if "M" in (getattr(margs, "hybrid_layer_pattern", None) or ""):
        out.append(_IN_PROJ_DIFFERENCES[getattr(margs, "muon_mamba_in_proj", None) or "split"])
    moe = getattr(margs, "num_experts", None) or "E" in (getattr(margs, "hybrid_layer_pattern", None) or "")
    skip, saved_skip = (bool(getattr(run, "moe_router_skip_muon", False)) for run in (margs, ckpt_args))
    if moe and (skip or saved_skip):
        out.append("MoE router: AdamW (--moe-router-skip-muon, as upstream main with it; megatron-core 0.19.2: Muon)"
                   if skip else "MoE router: Muon, as megatron-core 0.19.2 (the checkpoint's run had "
                   "--moe-router-skip-muon: AdamW)")
    return out


# --------------------------------------------------------------------------- upstream's state


def _main_shards(optimizer):
    """(model param, main param, (start, end) of the main param in the flattened model param,
    inner ``MuonWithAdamW``) for every param of every optimizer in the chain."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        inner = opt.optimizer
        inner.init_state()  # zeros where upstream has nothing; the tensors the copies go into
        if isinstance(opt, DistributedOptimizer):
            for model_param in opt.model_param_group_index_map:
                main, _, _ = opt._main_param_state_algorithm(model_param)
                rng = opt._get_model_param_range_map(model_param)["param"]
                yield model_param, main, (rng.start, rng.end), inner
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model_param, main in zip(models, mains):
                    yield model_param, main, (0, model_param.numel()), inner
            for group in opt.fp32_from_fp32_groups:
                for p in group:
                    yield p, p, (0, p.numel()), inner
        elif isinstance(opt, FP32Optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    yield p, p, (0, p.numel()), inner
        else:
            raise UserInputError(f"--muon-load-upstream-optimizer: {type(opt).__name__} is not supported (the "
                                 "distributed optimizer, bf16 and fp32 DDP are); resume with "
                                 "--muon-reset-optimizer-state")


def _common_steps(tree) -> set[float]:
    """Every ``common_step`` in upstream's saved optimizer state (one per torch optimizer with
    state: Adam's; emerging-optimizers' Muon keeps no step)."""
    found = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "common_step" and isinstance(value, torch.Tensor | int | float):
                found.add(float(value))
            else:
                found |= _common_steps(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            found |= _common_steps(value)
    return found


@torch.no_grad()
def load_upstream_optimizer_state(optimizer, ddp_model, directory: str, common) -> dict:
    """Copy megatron-core Muon's state in the torch_dist checkpoint ``directory`` into
    megatron-muon's ``optimizer`` (module docstring); returns counts for the load line:
    ``muon``, ``adamw`` (params carried over), ``main`` (main params from ``fp32_param``),
    ``fresh`` (names of params left fresh), ``step``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.utils import unwrap_model

    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise UserInputError(f"--muon-load-upstream-optimizer: {directory} is not a torch_dist checkpoint (the "
                             "legacy torch format keys optimizer state by position); resume with "
                             "--muon-reset-optimizer-state")
    saved = {}  # (state name, model param key) -> full key in the checkpoint
    for key in dist_checkpointing.load_tensors_metadata(directory):
        if match := _STATE_KEY.match(key):
            saved[(match[1], match[2])] = key
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    sharded_of = {}  # id(model param) -> its ShardedTensor / factory in the model's sharded state dict
    for chunk in unwrap_model(ddp_model):
        tensors, _ = extract_sharded_tensors_and_factories(chunk.sharded_state_dict(metadata=metadata))
        for ten in nested_values(tensors):
            sharded_of[id(ten.data)] = ten
    names = {id(p): n for chunk in unwrap_model(ddp_model) for n, p in chunk.named_parameters()}

    plan = []  # (state name, destination tensor, flat range, main param) per loaded tensor
    request = {}
    counts = {"muon": 0, "adamw": 0, "main": 0, "fresh": []}
    algorithm_of = {}  # id(main param) -> "muon" / "adamw"
    for model_param, main, (start, end), inner in _main_shards(optimizer):
        if id(inner) not in algorithm_of:
            algorithm_of[id(inner)] = {id(p): g["algorithm"] for g in inner.param_groups for p in g["params"]}
        state, algorithm = inner.state[main], algorithm_of[id(inner)][id(main)]
        sharded = sharded_of.get(id(model_param))
        wanted = (("momentum_buffer", state.get("momentum_buffer")),) if algorithm == "muon" else (
            ("exp_avg", state.get("exp_avg")), ("exp_avg_sq", state.get("exp_avg_sq")))
        key = sharded.key if sharded is not None else None
        if key is None or not all((name, key) in saved for name, _ in wanted):
            counts["fresh"].append(names.get(id(model_param), "param"))
            continue
        counts[algorithm] += 1
        if ("fp32_param", key) in saved:
            wanted = (*wanted, ("fp32_param", main))
            counts["main"] += 1
        for name, destination in wanted:
            full = saved[(name, key)]
            buffer = torch.empty(model_param.shape, dtype=torch.float32, device=main.device)
            item = f"{len(request)}"  # a key alone is not unique: stacked layers share it, at other offsets
            request[item] = make_sharded_optimizer_tensor(sharded, buffer, prefix=full[: -len(key) - 1])
            plan.append((item, destination, start, end))
    loaded = dist_checkpointing.load(request, directory) if request else {}
    for item, destination, start, end in plan:
        value = loaded[item]
        if isinstance(value, ShardedTensorFactory):  # pragma: no cover (load merges factories)
            raise RuntimeError(f"--muon-load-upstream-optimizer: {item} came back unmerged")
        destination.copy_(value.reshape(-1)[start:end].view_as(destination))
    steps = _common_steps(common.get("optimizer"))
    if len(steps) > 1:
        raise UserInputError(f"--muon-load-upstream-optimizer: the checkpoint's optimizers carry different steps "
                             f"{sorted(steps)}; resume with --muon-reset-optimizer-state")
    step = steps.pop() if steps else float(common.get("iteration", 0))
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        for s in opt.optimizer.state.values():
            s["step"] = torch.tensor(step)  # device-rule: host scalar, as torch's AdamW keeps it
        opt.optimizer.muon_steps = int(step)
    counts["step"] = int(step)
    return counts
