"""``scripts/pretrain_gpt.py`` as megatron-core runs its own Muon on CPU, for tests/e2e/test_migration.py.

``UPSTREAM=ddp``: the plugin's hooks are not installed, so this is upstream Megatron-LM's
``pretrain_gpt.py`` (the same model provider and data) with the CPU patches: ``--optimizer muon``
builds megatron-core's ``TensorParallelMuon`` + Adam under DDP, and its checkpoints are written
without megatron-muon. ``UPSTREAM=layer_wise``: the hooks are installed (the plugin's load hook
runs) and ``--optimizer dist_muon`` builds megatron-core's ``LayerWiseDistributedOptimizer``,
with the two shims its CPU run needs in 0.19.2, the benchmark's own
(``scripts/bench/optimizer_step_setup.py``): its ``has_grad_norm_group`` makes a flag with
``device='cuda'``, and without bf16 it chains raw torch optimizers (``config`` None, no
``get_loss_scale``), which ``fp32_layer_wise_workaround`` wraps in ``FP32Optimizer``.
"""

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if os.environ.get("UPSTREAM") == "ddp":
    import megatron_muon.megatron.hooks as hooks

    hooks.install = lambda: None  # upstream's pretrain_gpt.py, without patches/pretrain_gpt.patch
    runpy.run_path(str(REPO / "scripts" / "pretrain_gpt.py"), run_name="__main__")
else:
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches
    from scripts.bench.optimizer_step_setup import apply_layer_wise_cpu_patch, fp32_layer_wise_workaround

    apply_cpu_patches()
    apply_layer_wise_cpu_patch()
    with fp32_layer_wise_workaround():
        runpy.run_path(str(REPO / "scripts" / "pretrain_gpt.py"), run_name="__main__")
