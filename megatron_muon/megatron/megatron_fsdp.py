"""Muon under Megatron-FSDP (``--use-megatron-fsdp``): exact, through the DP owner exchange.

megatron-core 0.19.2 refuses an emerging optimizer with Megatron-FSDP. Its layout is what the
ZeRO-1 owner exchange already handles:

* Megatron-FSDP groups the params into buckets (one per ``TransformerLayer`` under
  ``optim_grads_params``), lays each bucket out flat (``build_data_parallel_buffer_index``:
  every param at its ``global_data_index``, padded to multiples of ``chunk_size_factor``) and
  cuts it into ``dp`` equal contiguous shards. A matrix is whole on one rank, cut between
  ranks (at a row boundary, so each rank's piece is a ``[rows, cols]`` DTensor shard), or absent.
* The optimizer is handed the fp32 main weights as DTensors (``dist_main_weight``), each
  rank's local tensor being its piece of the matrix: rows ``[r0, r1)`` of the TP-local shard,
  i.e. the flat range ``[r0·cols, r1·cols)`` — exactly ``MatrixLayout.dp_ranges``.

So ``MuonFSDPOptimizer`` is Megatron's own ``DistributedOptimizer`` in its Megatron-FSDP mode
(Megatron-FSDP reduces the grads, copies main weights into the model weights and gathers them;
Megatron's step does grad clipping and found-inf skipping) with a ``MuonWithAdamW`` inside and
every Muon matrix described by the flat range each DP rank holds of it, computed with
Megatron-FSDP's own shard arithmetic for every rank. The inner step then sends the pieces of a
cut matrix to one owner (planned to balance Newton–Schulz cost), orthogonalizes whole matrices
under the chosen TP mode and returns each rank's rows; a matrix whole on one rank never moves.
Momentum lives with the shards (a DTensor like the param).

The strategies: ``optim_grads_params`` and ``optim_grads`` shard the main weights the same way
(params, or only grads and optimizer state); ``optim`` shards the main weights and optimizer
state and keeps full grads; ``no_shard`` gives every rank whole matrices (no pieces travel; the
DP owner exchange shares the Newton–Schulz work out and sends each result to the other DP ranks,
as without the distributed optimizer).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

__all__ = ["MuonFSDPOptimizer", "check_own_range", "fsdp_dtensor_part", "fsdp_item_ranges", "is_fsdp_dtensor_state",
           "merge_fsdp_dtensor_states", "optimizer_buffer"]


def fsdp_item_ranges(bucket_start: int, bucket_size: int, item_start: int, item_size: int,
                     dp_size: int) -> tuple[tuple[int, int], ...]:
    """Per DP rank, the ``[start, end)`` range of one item (a param, flattened) that the rank's
    shard of its bucket holds, relative to the item's first element; ``(0, 0)`` when none.

    Megatron-FSDP's arithmetic (``_get_dp_buffer_shard_bucket_index``,
    ``DataParallelBuffer._get_item_slice_in_shard``): rank ``r``'s shard is
    ``[bucket_start + r·s, bucket_start + (r+1)·s)`` with ``s = bucket_size // dp_size``.
    """
    shard = bucket_size // dp_size
    out = []
    for r in range(dp_size):
        lo = max(item_start, bucket_start + r * shard)
        hi = min(item_start + item_size, bucket_start + (r + 1) * shard)
        out.append((lo - item_start, hi - item_start) if lo < hi else (0, 0))
    return tuple(out)


def optimizer_buffer(group):
    """The buffer whose shards are the optimizer's params (``_init_distributed_params``: the
    main weights when kept apart, else the model weights)."""
    return group.main_weight_buffer if group.main_weight_buffer is not None else group.model_weight_buffer


class MuonFSDPOptimizer(DistributedOptimizer):
    """Megatron's ``DistributedOptimizer`` for Megatron-FSDP, with a ``MuonWithAdamW`` inside.

    Args: Megatron's (``model_chunks`` wrapped in ``FullyShardedDataParallel``). The adapter then
    builds the inner optimizer on its DTensor main weights from ``catalogue.describe_megatron_fsdp``.

    With experts the adapter chains two of them, as for ZeRO-1: the dense params (DP over the
    dense DP group) and the expert params (Megatron-FSDP shards them over the expert-DP group),
    each with its own catalogue and plan. Megatron-FSDP installs the main weights into the model
    and all-gathers them per model chunk, dense and expert buffers together, so only the chain's
    last optimizer does it (``installs_model_weights``), after every inner step: an earlier
    install would gather the experts' old weights, and the later one could not undo a bucket
    already marked gathered.
    """

    installs_model_weights: bool = True
    """Whether this optimizer's step copies the main weights into the model and starts their
    all-gather (Megatron's ``_copy_main_params_to_model_params`` and ``start_param_sync``, for the
    whole model chunk); False on every optimizer of a chain but the last."""

    def _copy_main_params_to_model_params(self):
        if self.installs_model_weights:
            super()._copy_main_params_to_model_params()

    def step_with_ready_grads(self) -> bool:
        if self.installs_model_weights:
            return super().step_with_ready_grads()
        # the inner step alone (its copy into the model is skipped above), no param all-gather
        return MixedPrecisionOptimizer.step_with_ready_grads(self)

    # ---- checkpoints (--ckpt-format fsdp_dtensor) ---------------------------------------------

    def _init_optimizer_states_with_dummy_values(self):
        """Before a load Megatron makes every state exist by stepping on zero grads; for Muon
        (and AdamW) that step would still decay the weights and count a step. Create the state
        instead (``MuonWithAdamW.init_state``: zeros shaped like the DTensor params)."""
        self.optimizer.init_state()

    def param_names(self) -> set[str]:
        """The global names (``_param_name``: experts under their global numbers) of this
        optimizer's params: what its part of an ``fsdp_dtensor`` state dict is keyed by."""
        return {self._param_name(p) for g in self.optimizer.param_groups for p in g["params"]}

    def _muon_param_names(self) -> set[str]:
        return {self._param_name(p) for g in self.optimizer.param_groups if g["algorithm"] == "muon"
                for p in g["params"]}

    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        """Megatron's ``fsdp_dtensor`` optimizer state (per param name, DTensors sharded as the
        params), with Muon's momentum under Adam's keys, as ``checkpoint.py`` does for ZeRO-1:
        ``exp_avg`` is the momentum buffer itself (a load fills it in place) and ``exp_avg_sq`` a
        zero placeholder. Megatron's checkpoint code splits a SwiGLU fc1's ``exp_avg`` /
        ``exp_avg_sq`` into gate and up halves (``handle_swiglu_in_state_dict``) and nothing else,
        so any other key of an fc1 would fail there."""
        # Every param needs its entries on every rank: the save splits and re-shards them with
        # collectives per key, and a param whose shard is empty on this rank has had no grad
        # (hence no state) yet. init_state creates only what is missing.
        self.optimizer.init_state()
        state_dict = super().sharded_param_state_fsdp_dtensor(is_loading)
        muon = self._muon_param_names()
        steps = float(self.optimizer.muon_steps)
        # In param-group order, the same on every rank. Megatron's inherits the state's insertion
        # order, and a param whose shard is empty on a rank has its state made last there (by
        # init_state above, never having had a grad); the save's per-key collectives (the SwiGLU
        # split's chunk metadata, over the DP group) then pair different params across ranks
        # (found at EP2 x expert-DP2: an expert fc1 cut between the expert-DP ranks).
        order = [self._param_name(p) for g in self.optimizer.param_groups for p in g["params"]]
        state = state_dict["state"]
        state_dict["state"] = {name: _canonical(state[name], name in muon, steps) for name in order if name in state}
        return state_dict

    def load_state_dict(self, state_dict):
        """Megatron's, with the canonical keys of ``sharded_param_state_fsdp_dtensor`` mapped back
        (``exp_avg`` is the momentum buffer, already loaded in place; the placeholder is dropped).
        The model's own load restores the weights the forward uses (checked by
        ``tests/megatron/test_megatron_fsdp.py``'s resume from a differently initialized model)."""
        if "state" in state_dict and not self.is_stub_optimizer:
            muon = self._muon_param_names()
            state_dict = dict(state_dict)
            state_dict["state"] = {name: (_from_canonical(state) if name in muon else state)
                                   for name, state in state_dict["state"].items()}
        return super().load_state_dict(state_dict)


def is_fsdp_dtensor_state(state_dict) -> bool:
    """Whether ``state_dict`` is one optimizer's ``fsdp_dtensor`` state (``sharded_param_state_fsdp_dtensor``:
    per-param state and group settings keyed by param name)."""
    return isinstance(state_dict, dict) and "state" in state_dict and "param_to_group_meta" in state_dict


def merge_fsdp_dtensor_states(parts: list[dict]) -> dict:
    """The ``fsdp_dtensor`` states of a chain's optimizers (dense and expert) as one optimizer's: their
    params are disjoint, so the name-keyed entries are their union. Megatron's own fsdp_dtensor
    save and load read this one dict (``handle_swiglu_in_state_dict``), and a checkpoint keeps
    one key per param, whatever the chain."""
    merged = {"state": {}, "param_to_group_meta": {}}
    for part in parts:
        for key in merged:
            overlap = merged[key].keys() & part[key].keys()
            if overlap:
                raise RuntimeError(f"Megatron-FSDP checkpoint: {sorted(overlap)[:3]} in two optimizers of the chain")
            merged[key].update(part[key])
    return merged


def fsdp_dtensor_part(state_dict: dict, names: set[str]) -> dict:
    """The entries of a merged ``fsdp_dtensor`` state that belong to the params named ``names``
    (one optimizer of the chain): torch's ``load_state_dict`` would keep another optimizer's
    entries as state keyed by their names."""
    return {**state_dict,
            "state": {k: v for k, v in state_dict["state"].items() if k in names},
            "param_to_group_meta": {k: v for k, v in state_dict["param_to_group_meta"].items() if k in names}}


def _canonical(state: dict, muon: bool, steps: float) -> dict:
    """One param's state as saved. ``step``: the optimizer's applied steps, the same tensor value
    on every rank. The checkpoint keeps one copy of a plain (non-DTensor) tensor, rank 0's, and
    a rank whose shard of a param is empty has never stepped it (no grad there): its own counter
    would be 0. Every param is stepped on every applied step (Megatron hands zero grads to the
    unused ones), so the common count is each param's count. A fresh tensor per param: a load
    gives each param its own counter."""
    out = {k: v for k, v in state.items() if k != "momentum_buffer"}
    if "step" in state:
        out["step"] = torch.tensor(steps)  # device-rule: host scalar, as torch's AdamW keeps it
    if not muon:
        return out
    if "momentum_buffer" in state:
        out["exp_avg"] = state["momentum_buffer"]
        out["exp_avg_sq"] = torch.zeros_like(state["momentum_buffer"])  # Adam's key; never read back
    return out


def _from_canonical(state: dict) -> dict:
    out = {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq")}
    if "exp_avg" in state:
        out["momentum_buffer"] = state["exp_avg"]
    return out


def check_own_range(buffer, item_id: int, computed: tuple[int, int], name: str) -> None:
    """This rank's range as Megatron-FSDP itself computes it must be the one computed for it:
    the other ranks' ranges come from the same arithmetic, so a change in Megatron stops here."""
    start, end = buffer._get_item_slice_in_shard(item_id)
    if (start, end) != computed and not (start == end and computed[0] == computed[1]):
        raise RuntimeError(f"Megatron-FSDP layout: DP rank {buffer.dp_rank} holds [{start}, {end}) of {name}, "
                           f"computed {list(computed)}; Megatron changed?")
