"""megatron-muon: exact, load-balanced Muon for Megatron-LM under tensor and data parallelism.

The math lives in pure modules that import no Megatron:
    newton_schulz   the iteration, coefficient sets, ``ns_flops``
    tp_modes        ``orthogonalize_sharded``: duplicated / distributed / blockwise / owner / auto
    auto_mode       ``choose_tp_modes``: auto's per-matrix choice by the cost model
    owner_mode      owner mode: plan, exchange there, batched NS, exchange back
    owner_exchange  the generic "pieces go to an owner and come back" all-to-all
    planner         ``plan_owners``: LPT on NS cost
    comm            the package's collectives and ``comm_stats`` accounting
    muon            single-process ``Muon``, the reference
"""

from .auto_mode import choose_tp_modes, hardware_profile
from .comm import CommStats, comm_stats
from .muon import Muon, adjusted_lr
from .newton_schulz import COEFFICIENT_SETS, newton_schulz, ns_flops
from .owner_exchange import OwnedMatrix, OwnerExchange, Piece
from .planner import plan_owners, rank_loads
from .tp_modes import MODES, orthogonalize_sharded

__all__ = [
    "COEFFICIENT_SETS",
    "CommStats",
    "MODES",
    "Muon",
    "OwnedMatrix",
    "OwnerExchange",
    "Piece",
    "adjusted_lr",
    "choose_tp_modes",
    "comm_stats",
    "hardware_profile",
    "newton_schulz",
    "ns_flops",
    "orthogonalize_sharded",
    "plan_owners",
    "rank_loads",
]

__version__ = "0.1.0"

# Command line (no Megatron import); Megatron hooks: ``megatron_muon.integration.install()``.
from .cli import add_muon_args, muon_config_from_args  # noqa: E402

__all__ += ["add_muon_args", "muon_config_from_args"]
