"""The hooks behind experts at EP > 1 under ``--use-torch-fsdp2``, without a process group.

Both of Megatron's wrap paths hand a plugin run's FSDP2 wrap ``TorchFSDP2WithExpertMesh`` (the
experts sharded over their expert-DP group; ``tests/megatron/test_fsdp2_expert_parallel.py`` trains
it, ``tests/e2e/test_pretrain.py`` runs it from the command line), and leave Megatron's names as
they were; the ``validate_args`` hook shows Megatron EP1 under FSDP2 and then makes the checks
Megatron would have made of the EP size.
"""

from __future__ import annotations

import argparse

import pytest


@pytest.fixture
def plugin_run(monkeypatch):
    """Megatron's global args of a run the plugin drives (``args.megatron_muon``)."""
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(megatron_muon=True))


def test_get_model_path_wraps_in_the_expert_mesh_class(plugin_run):
    from megatron.training import training

    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.fsdp2_experts import TorchFSDP2WithExpertMesh

    seen = {}

    def wrap_model_chunks_with_ddp(model_chunks, config, ddp_config, **kwargs):
        seen["DP"] = kwargs["DP"]
        return model_chunks

    hooked = hooks._wrap_wrap_model_chunks_with_ddp(wrap_model_chunks_with_ddp)
    hooked([], None, argparse.Namespace(use_distributed_optimizer=False), DP=training.torch_FSDP)
    assert seen["DP"] is TorchFSDP2WithExpertMesh
    hooked([], None, argparse.Namespace(use_distributed_optimizer=False), DP=training.DDP)
    assert seen["DP"] is training.DDP  # plain DDP without the distributed optimizer: Megatron's own


def test_model_config_path_wraps_in_the_expert_mesh_class(plugin_run):
    from megatron.core.distributed import TorchFullyShardedDataParallel
    from megatron.training.models import dist_utils

    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.fsdp2_experts import TorchFSDP2WithExpertMesh

    seen = []

    def _ddp_wrap(model, ddp_config=None, use_megatron_fsdp=False, use_torch_fsdp2=False):
        seen.append(dist_utils.TorchFullyShardedDataParallel)  # what the builder constructs for FSDP2
        return model

    hooked = hooks._wrap_ddp_wrap(_ddp_wrap)
    hooked([], argparse.Namespace(use_distributed_optimizer=False), use_torch_fsdp2=True)
    assert seen == [TorchFSDP2WithExpertMesh]
    assert dist_utils.TorchFullyShardedDataParallel is TorchFullyShardedDataParallel  # put back after the call


def test_expert_parallelism_is_hidden_from_validate_args_and_checked_after():
    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.errors import UserInputError

    args = argparse.Namespace(use_torch_fsdp2=True, expert_model_parallel_size=2, num_experts=4,
                              high_priority_stream_groups=["dp_cp"])
    assert hooks._hide_fsdp2_expert_parallelism(args) == 2 and args.expert_model_parallel_size == 1
    args.expert_model_parallel_size = 2  # what the hook restores after Megatron's validate_args
    hooks._check_fsdp2_expert_parallelism(args)
    assert args.high_priority_stream_groups == ["dp_cp", "ep_dp"]
    # nothing hidden without FSDP2, or at EP1
    assert hooks._hide_fsdp2_expert_parallelism(argparse.Namespace(use_torch_fsdp2=False,
                                                                   expert_model_parallel_size=2)) == 0
    assert hooks._hide_fsdp2_expert_parallelism(argparse.Namespace(use_torch_fsdp2=True,
                                                                   expert_model_parallel_size=1)) == 0
    with pytest.raises(UserInputError, match="Number of experts should be a multiple of expert model"):
        hooks._check_fsdp2_expert_parallelism(argparse.Namespace(expert_model_parallel_size=2, num_experts=3,
                                                                 high_priority_stream_groups=[]))
    with pytest.raises(UserInputError, match="num_experts must be non None"):
        hooks._check_fsdp2_expert_parallelism(argparse.Namespace(expert_model_parallel_size=2, num_experts=None,
                                                                 high_priority_stream_groups=[]))
