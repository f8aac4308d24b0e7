"""torch FSDP2 (``--use-torch-fsdp2``) with MoE experts sharded over their own expert-DP group.

megatron-core 0.19.2's ``TorchFullyShardedDataParallel`` shards every param over its one DP-CP
mesh (``torch_fsdp2.py``'s docstring), right for experts only where their expert-DP group is that
group. ``TorchFSDP2WithExpertMesh`` first calls ``fully_shard`` on each MoE layer's ``experts``
module (``SequentialMLP``, ``TEGroupedMLP``: every local expert's params) over a mesh of the
expert-DP group, then lets megatron-core's wrapper shard the rest: FSDP2's ``fully_shard`` of a
``TransformerLayer`` (and of the root) leaves the params of a submodule already sharded alone, as
torchtitan shards its MoE experts over its ``edp`` mesh before their transformer block. Each expert
is then all-gathered over exactly the ranks that hold its rows, and its grads are reduce-scattered
over exactly the ranks whose tokens reached it.

The grads' mean: Megatron's DDP sums an expert's grads over the expert-DP group and scales them by
``1 / DP-CP size`` (``expert_gradient_scaling_factor`` in ``distributed_data_parallel.py``): the EP
all-to-all has already brought every DP rank of the expert-DP x EP block its tokens, so the sum
over expert-DP carries the tokens of every DP-CP rank, each rank's loss its own mean. FSDP2 would
divide by its mesh size, the expert-DP size; the experts' divide factor is set to the DP-CP size,
the factor FSDP2 divides the dense grads by (``FSDPModule.set_gradient_divide_factor``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch.distributed import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["TorchFSDP2WithExpertMesh", "expert_modules"]


def expert_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Each MoE layer's ``experts`` module whose params Megatron marks expert-parallel
    (``allreduce = False``: EP > 1 or an expert-TP size other than TP). At EP1 with the expert-TP
    size at TP Megatron treats experts as dense params, and so does FSDP2 here."""
    out = []
    for sub in module.modules():
        experts = getattr(sub, "experts", None) if isinstance(sub, MoELayer) else None
        params = list(experts.parameters()) if experts is not None else []
        if params and all(not getattr(p, "allreduce", True) for p in params):
            out.append(experts)
    return out


class TorchFSDP2WithExpertMesh(TorchFullyShardedDataParallel):
    """megatron-core's ``TorchFullyShardedDataParallel``, with each MoE layer's experts sharded
    over the expert-DP group (the module docstring) wherever its ranks are not the DP-CP group's;
    where they are, megatron-core's one mesh is already the experts' and nothing changes. Takes
    what megatron-core's class takes."""

    def __init__(self, config, ddp_config, module, **kwargs):
        dp_cp = kwargs.get("process_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        expert_dp = parallel_state.get_expert_data_parallel_group()
        same_ranks = sorted(dist.get_process_group_ranks(dp_cp)) == sorted(dist.get_process_group_ranks(expert_dp))
        experts = [] if same_ranks else expert_modules(module)
        if experts and config.fp16 and expert_dp.size() == 1:
            # torch 2.11's one-rank path divides an fp16 grad by the factor in its copy and again after it
            raise ValueError("--use-torch-fsdp2 with --fp16: an expert-DP group of one rank is not supported "
                             "(torch's FSDP2 divides its expert grads twice); use --bf16")
        # fully_shard swaps each param for a new DTensor param without Megatron's attributes
        # (``allreduce``, ``tensor_model_parallel``, ...; pytorch/pytorch#136929). megatron-core's
        # wrapper saves and restores them for the params it shards; these are saved here, before.
        saved = {name: dict(vars(p)) for e in experts for name, p in _named(module, e)}
        # the device type of megatron-core's mesh: "cuda", which cpu_patches makes "cpu" without CUDA
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = DeviceMesh.from_group(expert_dp, device_type) if experts else None
        for e in experts:
            fully_shard(e, mesh=mesh,
                        reshard_after_forward=getattr(ddp_config, "reshard_after_forward", True))
            e.set_gradient_divide_factor(float(dp_cp.size()))
            # FSDP2 divides by a factor other than its mesh size with NCCL's PreMulSum, which gloo
            # lacks; a SUM then the division is the same mean on both. One rank reduces nothing
            # and divides once in its copy (a forced SUM would divide there and again after).
            e.set_force_sum_reduction_for_comms(expert_dp.size() > 1)
        super().__init__(config, ddp_config, module, **kwargs)
        self.expert_device_mesh = mesh
        """The experts' FSDP2 mesh (the expert-DP group's), or None where megatron-core's is theirs."""
        params = dict(self.module.named_parameters())
        for name, attrs in saved.items():
            for key, value in attrs.items():
                setattr(params[name], key, value)
            params[name].is_torch_fsdp2_param = True  # megatron-core's mark of its own FSDP2 params


def _named(root: torch.nn.Module, sub: torch.nn.Module):
    """``sub``'s params under their names in ``root`` (what ``named_parameters`` of the wrapped
    module calls them)."""
    ids = {id(p) for p in sub.parameters()}
    return [(name, p) for name, p in root.named_parameters() if id(p) in ids]
