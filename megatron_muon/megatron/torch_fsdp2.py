"""Muon under torch FSDP2 (``--use-torch-fsdp2``): exact, through the DP owner exchange.

Megatron wraps each transformer layer, the embedding and the root module in ``fully_shard``
(``TorchFullyShardedDataParallel``) over a 1-D mesh of the DP(-CP) group, and steps the params
with its non-distributed optimizer wrappers (``--use-torch-fsdp2`` forbids
``--use-distributed-optimizer``): ``FP32Optimizer`` on the DTensor params themselves, or
``Float16OptimizerWithFloat16Params`` on fp32 DTensor clones of them (``main_param``). FSDP2
reduce-scatters the grads in backward, so each rank's ``param.grad`` is a DTensor holding only
its own rows, already averaged over DP.

FSDP2 shards every param along dim 0 with ``torch.chunk`` semantics: ``c = ceil(rows / dp)``
rows per rank, rank ``r`` holding rows ``[min(r·c, rows), min((r+1)·c, rows))`` of the (TP-local)
matrix — the last ranks possibly fewer, or none. That is the flat range ``[r0·cols, r1·cols)``,
i.e. ``MatrixLayout.dp_ranges``, so every Muon matrix (all of them are cut at DP ≥ 2) goes to one
DP owner through the owner exchange, as under Megatron-FSDP and ZeRO-1 (``megatron_fsdp.py``).

With TP the module FSDP2 shards already holds TP-local weights: a param's DTensor shape is its
TP-local shape and its mesh is the DP mesh alone (TP stays outside DTensor), so the layout's
TP description comes from the param's Megatron attributes as without FSDP2.

Experts: megatron-core 0.19.2's ``TorchFullyShardedDataParallel`` calls ``fully_shard`` with its one
mesh, the DP-CP group's, on every ``TransformerLayer``, experts included; FSDP2 then all-gathers an
expert's rows and averages its grads over that mesh. That is right exactly where the mesh's ranks
are the expert-DP group's (expert-TP x EP = TP). Elsewhere the mesh's ranks hold other experts (TP1 x
EP2: the all-gathered weight of local expert 0 is rows of global experts 0 and 2 in turn, and the two
EP ranks' grads are averaged into it) or the expert-DP group has ranks the mesh lacks (TP2 x EP1 x
expert-TP1: the TP peer's tokens' grads never arrive); ``fsdp2_mesh_refusal`` refuses both at the
optimizer's build. ``TorchFSDP2WithExpertMesh`` (what the command line builds, through the hooks)
shards each MoE layer's experts over their own expert-DP group first, as torchtitan shards its
experts over its ``edp`` mesh, so that layout is then exact too.
"""

from __future__ import annotations

import torch

__all__ = ["fsdp2_checkpoint_refusal", "fsdp2_flat_start", "fsdp2_mesh_refusal", "fsdp2_row_ranges",
           "fsdp2_shard_rows", "keep_fsdp2_expert_rows_main", "torch_fsdp2_ranges"]


def fsdp2_row_ranges(rows: int, cols: int, dp_size: int) -> tuple[tuple[int, int], ...]:
    """Per DP rank, the flat ``[start, end)`` range of a ``rows × cols`` matrix that FSDP2's
    ``Shard(0)`` gives it (``torch.chunk`` over ``dp_size``); ``(0, 0)`` when it holds none."""
    chunk = -(-rows // dp_size)
    out = []
    for r in range(dp_size):
        r0, r1 = min(r * chunk, rows), min((r + 1) * chunk, rows)
        out.append((r0 * cols, r1 * cols) if r1 > r0 else (0, 0))
    return tuple(out)


def fsdp2_shard_rows(name: str, param: torch.Tensor) -> tuple[int, int]:
    """``[r0, r1)``: the rows of ``param``'s (TP-local) matrix that this DP rank's shard holds, read
    from the DTensor's own placement and global offset (``r0 == r1`` when it holds none). Refuses
    a param that is not FSDP2's ``Shard(0)`` over one mesh dimension."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        raise ValueError(f"--use-torch-fsdp2: {name} is marked an FSDP2 param but is a "
                         f"{type(param).__name__}, not a DTensor")
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"--use-torch-fsdp2: {name} has placements {placements} on a {mesh.ndim}-D mesh; "
                         "Muon expects FSDP2's Shard(0) over one DP mesh dimension (HSDP is not supported)")
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return (offset[0], offset[0] + shape[0]) if shape[0] else (0, 0)


def fsdp2_flat_start(name: str, param: torch.Tensor) -> int:
    """Where this DP rank's shard of the FSDP2 matrix ``param`` starts in the row-major flattened
    (TP-local) matrix: its first global row × columns, from the DTensor (``fsdp2_shard_rows``).
    What QK-clip needs to give each local row its global row's factor."""
    return fsdp2_shard_rows(name, param)[0] * param.shape[1]


def torch_fsdp2_ranges(name: str, param: torch.Tensor):
    """``(dp_ranges, dp_group)`` of an FSDP2 DTensor param: every DP rank's range, and the mesh's
    group. This rank's range is checked against the DTensor's own local shape and offset, so a
    change in FSDP2's sharding stops here instead of mixing up rows."""
    r0, r1 = fsdp2_shard_rows(name, param)
    mesh = param.device_mesh
    rows, cols = param.shape
    dp_size, dp_rank = mesh.size(), mesh.get_local_rank()
    ranges = fsdp2_row_ranges(rows, cols, dp_size)
    local_rows = param._local_tensor.shape[0] if param._local_tensor.dim() == 2 else 0
    start, end = ranges[dp_rank]
    if (r0 * cols, r1 * cols) != (start, end) or local_rows != r1 - r0:
        raise RuntimeError(f"--use-torch-fsdp2: DP rank {dp_rank} holds rows [{r0}, {r1}) "
                           f"({local_rows} local) of {name} {tuple(param.shape)}, computed flat range "
                           f"[{start}, {end}); FSDP2 changed?")
    return ranges, mesh.get_group()


def fsdp2_mesh_refusal(name: str, mesh_group, dp_group, expert: bool) -> str | None:
    """The line for an FSDP2 param whose mesh is not the DP group its grads must be averaged over
    (``dp_group``: Megatron's DP-CP group, or for an expert the expert-DP group), or None. Compared
    as sets of global ranks: the owner exchange runs over the mesh's own group either way."""
    import torch.distributed as dist

    mesh, want = dist.get_process_group_ranks(mesh_group), dist.get_process_group_ranks(dp_group)
    if sorted(mesh) == sorted(want):
        return None
    if expert:
        return (f"--use-torch-fsdp2: expert {name} is sharded by FSDP2 over global ranks {mesh} (megatron-core "
                f"0.19.2's TorchFullyShardedDataParallel: every param over its one DP-CP mesh), but its grads must be "
                f"averaged over its expert-DP group, global ranks {want}; FSDP2 holds experts exactly only where "
                "the two are the same ranks (expert-TP x EP = TP: EP1 with the expert-TP size at the TP size, or e.g. "
                "TP2 x EP2 x expert-TP1)")
    return (f"--use-torch-fsdp2: {name} is sharded by FSDP2 over global ranks {mesh}, but its grads must be averaged "
            f"over Megatron's DP-CP group, global ranks {want}; wrap the model over the DP-CP group")


def keep_fsdp2_expert_rows_main(model_chunks) -> None:
    """Make each ``SequentialMLP`` of an FSDP2 model save every DP rank's expert rows as a main replica.

    Under FSDP2 megatron-core 0.19.2 writes each DP rank's ``Shard(0)`` rows as a fragment of their
    own, each a main replica (``make_sharded_tensor_for_checkpoint``: "When using FSDP2, every DP
    shard is a main replica", DP replica id 0). ``SequentialMLP.sharded_state_dict``
    (transformer/moe/experts.py) then sets every expert tensor's DP replica id to the expert-DP
    rank, which is right for whole experts replicated over expert-DP, not for FSDP2's rows: the
    rows of DP ranks >= 1 have no main replica, and the torch_dist save fails at its validation
    ("Invalid access pattern for ShardedTensor(key='decoder.layers.mlp.experts.experts.
    linear_fc1.weight', ...)"), the optimizer state's keys too (they take the model's replica ids).
    Each instance's ``sharded_state_dict`` whose params are FSDP2's is wrapped to put id 0 back on
    every tensor it returns (a gated fc1's ``ShardedTensorFactory`` too: its gate and up halves take
    the factory's replica id when built; not the extra state's ``ShardedObject``s, whole on every
    DP rank), on this model only; a model without FSDP2 params is left as it is.

    The same wrapper describes the rows over the group FSDP2 sharded them over: megatron-core cuts
    each FSDP2 tensor into ``metadata['dp_cp_group']``'s size of fragments at that group's rank
    (``make_tp_sharded_tensor_for_checkpoint``, ``apply_swiglu_sharded_factory``), the DP-CP group
    unless told otherwise; experts that ``TorchFSDP2WithExpertMesh`` sharded over their expert-DP
    group are described with that group instead (the DP-CP group's own ranks where the two are
    the same, as under megatron-core's wrapper)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for chunk in model_chunks:
        for module in chunk.modules():
            if not isinstance(module, SequentialMLP) or "sharded_state_dict" in vars(module):
                continue
            if not all(getattr(p, "is_torch_fsdp2_param", False) for p in module.parameters()):
                continue
            mesh_group = next(module.parameters()).device_mesh.get_group()
            module.sharded_state_dict = _fsdp2_rows_main(module.sharded_state_dict, mesh_group)


def _fsdp2_rows_main(sharded_state_dict, mesh_group):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def wrapper(prefix="", sharded_offsets=(), metadata=None):
        metadata = {**(metadata or {}), "dp_cp_group": mesh_group}  # the rows' group, this module only
        out = sharded_state_dict(prefix, sharded_offsets, metadata)
        for item in out.values():  # not the ShardedObjects (extra state): those are replicas over DP
            if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                item.replica_id = (*item.replica_id[:2], 0)
        return out

    return wrapper


def fsdp2_checkpoint_refusal(named_params, gated: bool) -> str | None:
    """The line for an FSDP2 model whose torch_dist checkpoint megatron-core 0.19.2 cannot write, or None.

    Its save describes each DP rank's rows of a param as an equal fragment, ``1/DP`` of the rows at
    offset ``dp_rank`` (``make_tp_sharded_tensor_for_checkpoint`` / ``make_sharded_tensor_for_checkpoint``),
    which FSDP2's ``torch.chunk`` shards are only when DP divides the rows; and it splits a gated
    (SwiGLU) fc1 into its gate and up halves per DP shard (``apply_swiglu_sharded_factory``), which
    asserts that every shard lies inside one half: an even DP size (measured at DP3: "SwiGLU FC1 FSDP
    ShardedTensor requires each DP shard of linear_fc1 to be completely inside either the W or V
    half" at the first save, after training up to it). ``named_params``: ``(name, param)`` pairs;
    ``gated``: the model's ``gated_linear_unit``."""
    for name, param in named_params:
        if not getattr(param, "is_torch_fsdp2_param", False) or param.dim() == 0:
            continue
        dp, rows = param.device_mesh.size(), param.shape[0]
        if dp == 1:
            return None
        if rows % dp:
            return (f"--use-torch-fsdp2 with --save / --load at DP {dp}: {name} has {rows} rows (shape "
                    f"{tuple(param.shape)}), which FSDP2 cuts unevenly (torch.chunk), and megatron-core 0.19.2's "
                    f"torch_dist save writes each DP rank's rows as an equal 1/{dp} of them; use a DP size that "
                    "divides every param's rows, or drop --save and --load")
        if gated and dp % 2 and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            return (f"--use-torch-fsdp2 with --save / --load and --swiglu at DP {dp}: megatron-core 0.19.2's "
                    f"torch_dist save splits {name} into gate and up per DP shard and asserts that each shard lies "
                    "inside one half (an AssertionError at the first save); use an even DP size")
    return None
