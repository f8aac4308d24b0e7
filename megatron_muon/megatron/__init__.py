"""The Megatron adapter: the only part of megatron-muon that imports Megatron (megatron-core 0.19.2).

    optimizer     get_megatron_muon_optimizer, MuonDistributedOptimizer (ZeRO-1 with Muon inside)
    checkpoint    Muon state in Megatron's dist_checkpointing formats
    cli           the --muon-* flags → one MuonConfig (argparse only)
    hooks         install(): the hooks behind patches/pretrain_gpt.patch; Muon scalars to TensorBoard / W&B
    report        the startup report (rank 0, once): routing, modes, DP cuts, the step's plan
    yaml_config   YAML experiment configs → Megatron flags, checked by Megatron's own parser
    startup_checks  what --optimizer muon refuses at startup; --load that names no checkpoint
    preflight     the whole command line checked before torchrun starts (run.sh, sbatch)
    errors        UserInputError: one line from rank 0, exit code 2
    integrity     checkpoint checksums (save / load), finite state after a load
    resharding    Megatron's refusal of a TP/PP change, explained in one line
    data_check    every dataset's .bin as long as its .idx says
    cpu_patches   the CUDA-isms megatron-core needs shimmed on a machine without CUDA

The exports below load on first use (PEP 562), so ``import megatron_muon`` (which reaches
``megatron_muon.megatron.cli`` for ``add_muon_args``) still imports no Megatron.
"""

from __future__ import annotations

import importlib

__all__ = ["MuonDistributedOptimizer", "get_megatron_muon_optimizer", "install"]

_EXPORTS = {
    "MuonDistributedOptimizer": ".optimizer",
    "get_megatron_muon_optimizer": ".optimizer",
    "install": ".hooks",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
