"""Checkpointing ``MuonWithAdamW`` through Megatron's own optimizer wrappers and dist_checkpointing.

Megatron's checkpoint code was written for Adam. Four things make Muon fit it unchanged:

**Canonical state keys (distributed optimizer).** ``DistributedOptimizer`` saves, for every param
of a grad buffer, ``{"param": main shard, **every tensor of optimizer.state[main shard]}``; in the
``dp_reshardable`` format each key becomes ONE ``ShardedTensor`` over the whole bucket, in the
``fully_reshardable`` format one world buffer per key (later cut per model param), and both
formats, like the loaders and the dummy state Megatron allocates at load time, use the key list
``optimizer_state_keys`` = ``("exp_avg", "exp_avg_sq")``. Every param of a bucket must therefore
expose the same keys. So the distributed optimizer presents Muon's state under Adam's names:

    =================  ====================================  ===================================
    checkpoint key     AdamW param                           Muon param
    =================  ====================================  ===================================
    ``param``          fp32 main shard                       fp32 main shard
    ``exp_avg``        first moment ``exp_avg``              **momentum buffer** ``momentum_buffer``
    ``exp_avg_sq``     second moment ``exp_avg_sq``          **zeros** (placeholder, ignored on load)
    ``step``           per-param step (not persisted: it is saved once, in the param groups)
    =================  ====================================  ===================================

The placeholder costs checkpoint space (one fp32 value per Muon element) and, while a save is
being written, one transient zero tensor per Muon shard; it costs no optimizer memory. Because
the momentum sits under ``exp_avg`` exactly where Adam's first moment sits, Megatron moves it
between DP layouts (``fully_reshardable``: any DP size; ``dp_reshardable``: any DP size with the
same unpadded bucket layout, which Megatron asserts) and between TP/PP layouts
(``fully_reshardable`` keys it by the model param's sharding) the way it moves Adam state.
Without the distributed optimizer Megatron keys optimizer state per model param
(``optim_state_to_sharding_state``), so ``momentum_buffer`` is saved under its own name there;
it is shaped like the param, which is all that format needs.

**Distinct param groups.** Megatron pairs saved and current param groups by the identifier keys
``param_group_identifier_keys`` (lr/wd overrides, ``optimizer``, ...), not by ``algorithm``. The
Muon matrices' group and the AdamW group of the embedding / output layer have the same lr/wd
settings, so they collide: the non-distributed wrappers then fail to load ("loaded state dict
contains a parameter group that doesn't match the size of optimizer's group"), the distributed
one gives both current groups the saved group written last, ``algorithm`` included (the AdamW
params would be treated as Muon ones). ``tag_param_groups`` writes the per-group ``optimizer``
key Megatron itself uses for per-param optimizers (``"muon"`` / ``"adam"``), which is one of the
identifier keys and makes the groups distinct.

**Step counters.** ``MuonWithAdamW.muon_steps`` (optimizer steps applied) is saved next to the
param groups (``"muon_steps"`` in the inner state dict, by ``MuonWithAdamW``'s own state-dict
hooks) and restored on load. The per-param ``step`` tensors are saved once (Megatron keeps one common step)
and restored as one tensor per param: Megatron's own load gives every param the SAME tensor,
which the in-place ``step += 1`` of AdamW/Muon would then advance once per param per step.

**Post-load param sync** (upstream NVIDIA/Megatron-LM#6920). After a distributed-optimizer load
each DP rank holds only its own main shards; ``MuonCheckpointMixin.load_state_dict`` copies them
into the model param buffers and runs the param all-gather, so every DP replica holds the same,
loaded, model params — whether or not the model state dict was loaded too.

**A chain of another length** (an EP or expert-TP change). Megatron builds a second optimizer
for the expert params only when they use the expert groups (EP > 1, or an expert-TP size other
than TP; ``param.allreduce`` False), so an EP2 run chains two optimizers (dense, experts) and an
EP1 run one. Every optimizer-state tensor is keyed by its model param's sharded key (experts by
their global index), which the load finds whatever the chain; what follows the saved chain is the
common state (param groups, ``muon_steps``, the format name), which dist_checkpointing merges into
the current chain's tree unchanged: Megatron's load then fails (``KeyError: 'optimizer'`` from EP2
to EP1, "Expected 2 entries in state dict" from EP1 to EP2). ``rechain_loaded_state`` rebuilds one
state dict per current optimizer: each current param group takes the saved group with its
identifier keys (the expert and dense groups of one setting differ only in ``is_expert_parallel``,
the setting their values come from), the per-param tensors stay where the current chain's tree put
them.

Use: ``MuonDistributedOptimizer`` inherits ``MuonCheckpointMixin``; the factory calls
``prepare_for_checkpointing(inner)`` on every inner optimizer it builds; ``MuonChainedOptimizer``
calls ``rechain_loaded_state`` before Megatron's chained load.
"""

from __future__ import annotations

import torch

__all__ = [
    "BALANCED_MARK",
    "CANONICAL_STATE_KEYS",
    "MuonCheckpointMixin",
    "check_saved_extents",
    "in_place_optimizer_load",
    "laid_out_by_muon",
    "load_canonical_state",
    "prepare_for_checkpointing",
    "rechain_loaded_state",
    "restore_in_place_load",
    "tag_param_groups",
    "to_canonical_state",
]

CANONICAL_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""The distributed optimizer's per-param state keys in a checkpoint (Adam's, for every param)."""

_OPTIMIZER_TAG = {"muon": "muon", "adamw": "adam"}


# --------------------------------------------------------------------------- inner optimizer


def tag_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """Set Megatron's per-group ``optimizer`` key from ``algorithm`` (``"muon"`` / ``"adam"``).

    ``optimizer`` is one of Megatron's ``param_group_identifier_keys``, so a Muon group and an
    AdamW group with the same lr/wd settings stay distinct when a checkpoint's param groups are
    matched to the current ones. Idempotent.
    """
    for group in optimizer.param_groups:
        group["optimizer"] = _OPTIMIZER_TAG[group.get("algorithm", "adamw")]


def prepare_for_checkpointing(optimizer: torch.optim.Optimizer) -> None:
    """Make a ``MuonWithAdamW`` checkpointable through Megatron's wrappers. Idempotent.

    Tags the param groups (``tag_param_groups``). The step counter ``muon_steps`` needs nothing
    here: ``MuonWithAdamW`` saves and restores it in its own ``state_dict`` (``"muon_steps"``).
    """
    tag_param_groups(optimizer)


# --------------------------------------------------------------------------- canonical state


def to_canonical_state(param: torch.Tensor, state: dict, algorithm: str) -> dict:
    """``{"param", "step", "exp_avg", "exp_avg_sq"}`` for one param (see the module docstring)."""
    tensors = {"param": param}
    if "step" in state:
        tensors["step"] = state["step"]
    if algorithm == "muon":
        buf = state["momentum_buffer"]
        tensors["exp_avg"] = buf
        tensors["exp_avg_sq"] = torch.zeros_like(buf)  # placeholder: Adam's key, never read back
    else:
        tensors["exp_avg"] = state["exp_avg"]
        tensors["exp_avg_sq"] = state["exp_avg_sq"]
    return tensors


@torch.no_grad()
def load_canonical_state(
    param: torch.Tensor, state: dict, algorithm: str, tensors: dict, *, name: str = "param"
) -> None:
    """Copy a canonical state (``to_canonical_state``'s keys) into ``param`` and its ``state``.

    Muon: ``exp_avg`` → ``momentum_buffer``; ``exp_avg_sq`` is ignored. ``step`` is not read
    (it is restored from the param groups). Non-tensor values are skipped, as Megatron does.
    """
    if algorithm == "muon":
        dst = {"param": param, "exp_avg": state["momentum_buffer"]}
    else:
        dst = {"param": param, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    for key, target in dst.items():
        if key not in tensors:
            raise KeyError(f"{name}: the checkpoint has no {key!r} (has {sorted(tensors)})")
        src = tensors[key]
        if not isinstance(src, torch.Tensor):
            continue
        if src.numel() != target.numel():
            raise ValueError(
                f"{name}: checkpoint {key!r} has {src.numel()} elements, expected {target.numel()}"
            )
        target.copy_(src.view_as(target))


def mismatched_elements(main: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """How many elements of an fp32 main param are not the model weights' values (0-d tensor).

    The model param is the main param rounded to its dtype (Megatron copies main → model after
    every step and the reverse at a weights-only load), so the two differ by at most half an ulp
    of the model dtype; one ulp (``eps · |main|``) is allowed. A loss-free checkpoint has 0
    everywhere; a zero-filled tail (a checkpoint that lost elements on save) counts each of
    them, since real weights are not exactly 0.
    """
    ulp = torch.finfo(weights.dtype).eps
    main = main.reshape(-1).float()
    return ((weights.reshape(-1).float() - main).abs() > ulp * main.abs()).sum()


# --------------------------------------------------------------------------- a chain of another length


def _identifier(group: dict, *, expert_blind: bool = False) -> tuple:
    """Megatron's key pairing a saved param group with a current one (``param_group_identifier_keys``,
    a missing key read as None, NeMo's ``pre_`` aliases included); ``expert_blind``: without
    ``is_expert_parallel``, the one key in which a setting's expert group differs from its dense one."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys
                 if not (expert_blind and key == "is_expert_parallel"))


def _inner(part: dict) -> dict:
    """The inner optimizer's dict of one optimizer's state dict: under ``optimizer`` (the
    distributed and the fp16 wrappers), or the state dict itself (``FP32Optimizer``)."""
    return part["optimizer"] if isinstance(part.get("optimizer"), dict) else part


def _merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s entries added, dicts merged level by level (new dicts throughout)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def rechain_loaded_state(state_dict, current_groups: list[list[dict]]):
    """The optimizer state Megatron's ``load_checkpoint`` read, as ``ChainedOptimizer.load_state_dict``
    of ``len(current_groups)`` optimizers takes it (module docstring, "A chain of another length").

    ``state_dict``: the saved chain's common state (a chain's under the keys 0, 1, ...; one
    optimizer's at the top level) merged with the tensors of the current chain's sharded state dict,
    nested the current chain's way (the other way when the lengths differ). ``current_groups``:
    each current optimizer's param groups as its inner ``state_dict()`` lists them (identifier keys,
    ``params`` indices). Returned unchanged when the saved chain has the current length; otherwise
    one state dict per current optimizer (a list, or the state dict itself for one): the saved
    optimizer of the same kind (dense / experts) as its base, the current tensors merged in, and the
    current groups in their order, each with its saved counterpart's values and its own ``params``.
    Raises ``RuntimeError`` for a current group
    the checkpoint has no counterpart of, and for a saved chain whose ``muon_steps`` differ."""
    count = len(current_groups)
    if not isinstance(state_dict, dict):
        return state_dict  # a list (the torch format's chain): Megatron's own load
    chained = sorted(k for k in state_dict if isinstance(k, int))
    named = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
    if (count == 1 and not chained) or (count > 1 and not named):
        return state_dict  # the chain as saved
    if count == 1:  # saved by a chain (dense, experts), loaded by one optimizer
        saved, loaded = [state_dict[k] for k in chained], [named]
    else:  # saved by one optimizer, loaded by a chain
        saved, loaded = [named], [state_dict.get(i, {}) for i in range(count)]
    saved_groups = [g for part in saved for g in _inner(part)["param_groups"]]
    exact = {_identifier(g): g for g in saved_groups}
    blind: dict[tuple, dict] = {}
    for g in saved_groups:
        blind.setdefault(_identifier(g, expert_blind=True), g)
    steps = {_inner(part).get("muon_steps") for part in saved} - {None}
    if len(steps) > 1:  # the chain steps together (prepare_grads): one count
        raise RuntimeError(f"the checkpoint's optimizers were saved at different muon_steps {sorted(steps)}")

    def kind(groups) -> bool:
        return any(g.get("is_expert_parallel", False) for g in groups)

    out = []
    for groups, tensors in zip(current_groups, loaded):
        base = next((part for part in saved if kind(_inner(part)["param_groups"]) == kind(groups)), saved[0])
        state = _merged(base, tensors)
        matched = []
        for group in groups:
            twin = exact.get(_identifier(group)) or blind.get(_identifier(group, expert_blind=True))
            if twin is None:
                raise RuntimeError(f"the checkpoint has no param group matching the current one {_identifier(group)} "
                                   f"(saved: {sorted(map(str, exact))})")
            matched.append({**twin, "is_expert_parallel": group.get("is_expert_parallel", False),
                            "params": group["params"]})
        inner = {**_inner(state), "param_groups": matched, **({"muon_steps": min(steps)} if steps else {})}
        out.append({**state, "optimizer": inner} if isinstance(state.get("optimizer"), dict) else inner)
    return out[0] if count == 1 else out


# --------------------------------------------------------------------------- a load in place (FSDP2)


def in_place_optimizer_load(args, common) -> bool:
    """Megatron's ``load_checkpoint`` with these ``args`` loads the optimizer's tensors of a checkpoint
    whose common state is ``common`` in place, without its ``load_state_dict``: ``--use-torch-fsdp2``
    with ``torch_dist`` (training.py's ``skip_load_to_model_and_opt``), the optimizer state loaded
    (not ``--no-load-optim``, ``--finetune``, a release checkpoint or one saved without it)."""
    return (getattr(args, "use_torch_fsdp2", False) and getattr(args, "ckpt_format", None) == "torch_dist"
            and not getattr(args, "no_load_optim", False) and not getattr(args, "finetune", False)
            and common is not None and isinstance(common.get("optimizer"), dict))


def restore_in_place_load(optimizer, saved: dict) -> dict:
    """What ``load_state_dict`` would restore, after a load that filled the state tensors in place.

    With ``--use-torch-fsdp2`` and ``torch_dist`` Megatron's ``load_checkpoint`` is called with
    ``skip_load_to_model_and_opt``: dist_checkpointing writes every tensor of the optimizer's
    sharded state dict into the tensor it was built from (the momentum, Adam's moments, the fp32
    main params: the DTensors' local rows), and the optimizer's ``load_state_dict`` is never
    called. What that method restores from the common state is then lost: the per-param ``step``
    (Megatron saves one, ``common_step``; AdamW's bias correction reads it), ``muon_steps``
    (MuonBP's phase) and the param groups' settings. This restores them, as the wrappers'
    ``load_state_dict`` does: each current group takes the settings of the saved group with its
    identifier keys (``_identifier``, as ``_filter_and_reorder_param_groups`` pairs them) but the
    scheduler's lr and weight decay, each param its own step tensor.

    ``optimizer``: Megatron's ``FP32Optimizer`` or ``Float16OptimizerWithFloat16Params`` around a
    ``MuonWithAdamW``, or a chain of them; ``saved``: the checkpoint's common state of it
    (``common["optimizer"]``; a chain of several: one entry per optimizer, by index). Returns
    ``{"step", "muon_steps"}`` as restored (of the first optimizer of a chain; the step None when
    the checkpoint has none: Megatron writes ``common_step`` only once it is non-zero).
    """
    chain = getattr(optimizer, "chained_optimizers", None)
    if chain is not None:
        parts = [saved] if len(chain) == 1 else [saved[i] for i in range(len(chain))]
        return [restore_in_place_load(o, part) for o, part in zip(chain, parts)][0]
    inner = optimizer.optimizer
    saved_inner = saved["optimizer"] if isinstance(saved.get("optimizer"), dict) else saved  # Float16's nesting
    step = saved_inner.get("state", {}).get("common_step")
    saved_groups = {_identifier(g): g for g in saved_inner["param_groups"]}  # their params are not saved
    for current in inner.param_groups:
        group = saved_groups.get(_identifier(current))
        if group is None:
            raise RuntimeError(f"the checkpoint has no param group matching the current one {_identifier(current)} "
                               f"(saved: {sorted(map(str, saved_groups))})")
        # lr and weight_decay are the scheduler's: Megatron's load sets them after the optimizer's
        # (its scheduler's load_state_dict), so they stay as that load left them
        current.update({k: v for k, v in group.items() if k not in ("params", "lr", "weight_decay")})
    inner.init_state()
    if step is not None:
        for state in inner.state.values():  # one tensor per param, not one shared by all
            state["step"] = torch.tensor(float(step))  # device-rule: host scalar, as torch's AdamW keeps it
    muon_steps = saved_inner.get("muon_steps")
    inner.muon_steps = int(muon_steps) if muon_steps is not None else int(step or 0)
    return {"step": None if step is None else float(step), "muon_steps": inner.muon_steps}


# --------------------------------------------------------------------------- distributed optimizer


def check_saved_extents(buffers, names: dict[int, str], *, exact: bool = False) -> None:
    """Refuse a buffer whose checkpoints would lose part of a param.

    Megatron's distributed-optimizer checkpoints keep, of each bucket, its first
    ``bucket.numel_unpadded`` elements (``get_parameter_state_dp_zero``; both the
    ``fully_reshardable`` and the ``dp_reshardable`` formats) and zero-fill whatever a param
    has beyond them on save, with only a log warning. Invariant checked here, per bucket:
    every param ends at or before ``bucket.offset + bucket.numel_unpadded``. ``exact``: also
    that the count is exactly the last param's end (megatron-core's own definition), which a
    layout of ours must meet.

    ``buffers``: megatron-core ``_ParamAndGradBuffer``s; ``names``: ``id(param) → name``.
    Raises ``ValueError`` (one line) naming the param and the elements it would lose.
    """
    for b_index, buffer in enumerate(buffers):
        for k, bucket in enumerate(buffer.buckets):
            saved_end = bucket.offset + bucket.numel_unpadded
            last_end = max(buffer.param_index_map[p][1] for p in bucket.params_list)
            if last_end > saved_end:
                param = max(bucket.params_list, key=lambda p: buffer.param_index_map[p][1])
                raise ValueError(
                    f"full_param_layout: bucket {k} of buffer {b_index} saves {bucket.numel_unpadded} elements "
                    f"(per_bucket_numel_unpadded) but {names.get(id(param), tuple(param.shape))} ends "
                    f"{last_end - saved_end} elements later, which every checkpoint would zero; "
                    "per_bucket_numel_unpadded must be each bucket's last param end minus its start")
            if exact and last_end != saved_end:
                raise ValueError(
                    f"full_param_layout: bucket {k} of buffer {b_index} has per_bucket_numel_unpadded "
                    f"{bucket.numel_unpadded}, but its last param ends at {last_end - bucket.offset}")


class MuonCheckpointMixin:
    """Checkpointing for a Megatron ``DistributedOptimizer`` around a ``MuonWithAdamW``.

    Put it before ``DistributedOptimizer`` in the bases. It overrides the two methods every
    Megatron save/load format goes through for per-param state
    (``_get_main_param_and_optimizer_states`` / ``_set_main_param_and_optimizer_states``), the
    state key list, and ``state_dict`` / ``load_state_dict`` (steps, ``muon_steps``, real state
    instead of Adam dummies, the post-load param sync).
    """

    @property
    def optimizer_state_keys(self):
        # Megatron picks the keys from config.optimizer (e.g. ('exp_avg',) for lion); every
        # param here exposes both canonical keys whatever the config says.
        return CANONICAL_STATE_KEYS

    # ---- per-param state -------------------------------------------------------------------
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        """Megatron's, on world tensors in buffer coordinates (``get_parameter_state_dp_zero``)."""
        self._world_in_buffer_coordinates = True
        try:
            return super().sharded_param_state_fully_reshardable(*args, **kwargs)
        finally:
            self._world_in_buffer_coordinates = False

    def get_parameter_state_dp_zero(self, *args, **kwargs):
        """Megatron's; inside ``sharded_param_state_fully_reshardable``, each world tensor is laid
        out as its buffer is (bucket ``b``'s unpadded elements at ``bucket.offset``, zeros in the
        padding between buckets).

        megatron-core 0.19.2 gathers a buffer's state into one world tensor with the padding
        between buckets removed, and ``sharded_param_state_fully_reshardable`` then slices it
        with ``buffer.param_index_map``, whose offsets include that padding: with more than one
        bucket, every param after the first padded bucket end is saved shifted by the padding
        before it (and the last ones zero-filled, the "param range exceeds unpadded buffer"
        warning). Both DP layouts pad bucket ends at DP >= 2. The loader
        (``load_parameter_state_from_fully_reshardable``) reads each param's own tensor and needs
        nothing here.
        """
        state = super().get_parameter_state_dp_zero(*args, **kwargs)
        if state is None or not getattr(self, "_world_in_buffer_coordinates", False):
            return state
        for gbuf_idx, dtype_state in state.items():
            if not isinstance(gbuf_idx, int):
                continue  # "buckets_coalesced"
            buffer = self.buffers[gbuf_idx]
            for world in dtype_state.values():
                for key, packed in list(world.items()):
                    if not isinstance(packed, torch.Tensor):
                        continue  # "numel_unpadded"
                    laid = packed.new_zeros(buffer.numel)
                    cursor = 0
                    for bucket in buffer.buckets:
                        n = bucket.numel_unpadded
                        laid[bucket.offset:bucket.offset + n] = packed[cursor:cursor + n]
                        cursor += n
                    world[key] = laid
        return state

    def _main_param_state_algorithm(self, model_param):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise NotImplementedError("Muon: --use-precision-aware-optimizer is not supported")
        group_index, group_order = self.model_param_group_index_map[model_param]
        group = self.optimizer.param_groups[group_index]
        main_param = group["params"][group_order]
        if main_param not in self.optimizer.state or not self.optimizer.state[main_param]:
            self.optimizer.init_state()
        return main_param, self.optimizer.state[main_param], group["algorithm"]

    def _get_main_param_and_optimizer_states(self, model_param):
        """``{"param", "step", "exp_avg", "exp_avg_sq"}`` for every param (Muon: momentum in
        ``exp_avg``, zeros in ``exp_avg_sq``), the keys every Megatron format expects."""
        main_param, state, algorithm = self._main_param_state_algorithm(model_param)
        return to_canonical_state(main_param, state, algorithm)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        """Inverse of ``_get_main_param_and_optimizer_states``; also records how many elements of
        the checkpoint's fp32 main param disagree with the model weights (``weight_mismatches``)."""
        main_param, state, algorithm = self._main_param_state_algorithm(model_param)
        saved = tensors.get("param")
        if isinstance(saved, torch.Tensor):
            rng = self._get_model_param_range_map(model_param)["param"]
            weights = model_param.detach().view(-1)[rng.start:rng.end]
            self.weight_mismatches.append((self._model_param_name(model_param), mismatched_elements(saved, weights)))
        load_canonical_state(main_param, state, algorithm, tensors, name=self._model_param_name(model_param))

    def _model_param_name(self, model_param) -> str:
        """The param's name for messages: Megatron's (``_param_name``) with one model chunk;
        ``chunk{c}.{name}`` with several (virtual pipeline stages), whose names repeat from chunk
        to chunk (each numbers its layers from 0), which Megatron's ``_param_name`` refuses."""
        if len(self.model_chunks) == 1:
            return self._param_name(model_param)
        if "_chunk_param_names" not in self.__dict__:  # catalogue.param_names' form (a floor above this one)
            self._chunk_param_names = {id(p): f"chunk{c}.{n}" for c, chunk in enumerate(self.model_chunks)
                                       for n, p in chunk.named_parameters()}
        return self._chunk_param_names[id(model_param)]

    @property
    def weight_mismatches(self) -> list:
        """``(param name, 0-d count tensor)`` per main param set by the last load: elements of the
        checkpoint's fp32 main param that are not the model param's values up to its rounding.
        Meaningful when the model params hold the same checkpoint's weights at that moment, as in
        Megatron's ``load_checkpoint`` (model first, then optimizer); ``integrity`` reads it."""
        if "_weight_mismatches" not in self.__dict__:
            self._weight_mismatches = []
        return self._weight_mismatches

    # ---- non-tensor state --------------------------------------------------------------------
    def state_dict(self):
        """Megatron's layout (``optimizer.param_groups`` without params, each with ``step``;
        ``grad_scaler``), plus ``optimizer.muon_steps``; independent of TE/Apex being installed."""
        inner = self.optimizer
        steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(
                f"Muon checkpoint: per-param optimizer steps differ ({sorted(steps)}); Megatron "
                "checkpoints keep one common step"
            )
        step = steps.pop() if steps else float(inner.muon_steps)
        inner_sd = inner.state_dict()
        param_groups = []
        for group in inner_sd["param_groups"]:
            group = {k: v for k, v in group.items() if k != "params"}
            group["step"] = step
            param_groups.append(group)
        optimizer_sd = {k: v for k, v in inner_sd.items() if k not in ("state", "param_groups")}
        optimizer_sd["param_groups"] = param_groups
        optimizer_sd["muon_steps"] = int(inner.muon_steps)
        state_dict = {"optimizer": optimizer_sd}
        if self.grad_scaler:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict):
        """Megatron's ``load_state_dict`` around real Muon/AdamW state, then steps, ``muon_steps``
        and, when parameter state was loaded, the copy of main params to the model params and the
        param all-gather (upstream #6920)."""
        inner = self.optimizer
        self.weight_mismatches.clear()
        # Megatron would allocate Adam-named dummies (on the CUDA device) for an empty state;
        # create the real state instead, which Megatron then keeps and loads into.
        inner.init_state()
        saved = state_dict["optimizer"]
        steps = {g["step"] for g in saved["param_groups"] if g.get("step") is not None}
        if len(steps) > 1:
            raise RuntimeError(f"Muon checkpoint: param groups carry different steps {sorted(steps)}")
        step = steps.pop() if steps else None
        muon_steps = saved.get("muon_steps")
        super().load_state_dict(state_dict)
        for group in inner.param_groups:
            group.pop("step", None)  # Megatron's transport for the common step, not a group setting
        if step is not None:
            for s in inner.state.values():  # one tensor per param, not one shared by all
                s["step"] = torch.tensor(float(step))  # device-rule: host scalar, as torch's AdamW keeps it
        if muon_steps is not None:
            inner.muon_steps = int(muon_steps)
        elif step is not None:
            inner.muon_steps = int(step)
        if state_dict.get("param_state") is not None:
            self.sync_model_params_from_main_params()

    @torch.no_grad()
    def sync_model_params_from_main_params(self) -> None:
        """Copy this rank's main shards into the model param buffers and all-gather them over DP,
        as the step does: afterwards every DP replica holds the same model params."""
        if self.is_stub_optimizer:
            return
        self._copy_main_params_to_model_params()
        for model_chunk in self.model_chunks:
            model_chunk.start_param_sync(force_sync=True)


BALANCED_MARK = "megatron_muon_balanced_layout"
"""Attribute set (True) on a model chunk (the module DDP wraps) by ``balanced_full_param_layout``;
the training hooks refuse ``--muon-dp-layout balanced`` when a DDP chunk's module lacks it (its DDP
was built on a path the hooks do not reach, so the layout asked for would be silently
megatron-core's)."""


def laid_out_by_muon(module) -> bool:
    """Whether ``module`` (a DDP chunk, or what it wraps: DDP -> Float16Module -> the model) was laid
    out by ``balanced_full_param_layout`` (``BALANCED_MARK``), whichever layout it chose."""
    while module is not None:
        if getattr(module, BALANCED_MARK, False):
            return True
        module = getattr(module, "module", None)
    return False
