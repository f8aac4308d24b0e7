"""megatron-muon: exact, load-balanced Muon for Megatron-LM under tensor and data parallelism.

Layers, each importing only the ones below it (``tests/unit/test_layers.py`` enforces it):

    core/      the math on plain tensors: Newton–Schulz, update scaling, the single-process
               ``Muon`` reference, shard/full shape arithmetic, model shapes, matrix layouts
    plan/      every decision of a step, made once and pure: owners, the balanced layout, the
               TP-mode choice (``auto`` and its cost model), the step plan with per-rank costs
    parallel/  the math across a process group: collectives and ``comm_stats``, the owner
               exchange, the TP modes, the one dispatcher that executes a rank's slice of a plan
    megatron/  everything that imports Megatron: the optimizer factory and
               ``MuonDistributedOptimizer``, checkpointing, the CLI flags, the training hooks,
               the YAML loader, the CPU patches

``config.py`` (``MuonConfig``) and ``optimizer.py`` (``MuonWithAdamW``, which builds its step
plans once) sit between ``parallel`` and ``megatron``. This top level exports what a user builds
with and imports no Megatron; the Megatron adapter is ``megatron_muon.megatron``.
"""

from .config import MuonConfig
from .core.muon import Muon
from .core.newton_schulz import newton_schulz, ns_flops
from .megatron.cli import add_muon_args, muon_config_from_args
from .optimizer import MuonWithAdamW
from .parallel.comm import comm_stats
from .parallel.orthogonalize import orthogonalize_sharded
from .plan.owners import plan_owners

__all__ = [
    "Muon",
    "MuonConfig",
    "MuonWithAdamW",
    "add_muon_args",
    "comm_stats",
    "muon_config_from_args",
    "newton_schulz",
    "ns_flops",
    "orthogonalize_sharded",
    "plan_owners",
]

__version__ = "0.1.0"
