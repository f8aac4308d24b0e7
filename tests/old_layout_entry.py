"""``scripts/pretrain_gpt.py`` with the balanced layout's bucket extents computed as megatron-muon
computed them before its fix, for ``tests/e2e/test_balanced_resume.py``.

The old arithmetic handed megatron-core, as each bucket's ``per_bucket_numel_unpadded``, the sum
of its params' sizes; megatron-core keeps that many elements of a bucket in every checkpoint, so
a bucket whose last param ends later (alignment and padding between whole matrices) lost that
param's tail on save. This entry reproduces such checkpoints so that the test can check that
the fixed code refuses them. The build-time checks that now reject the arithmetic are lifted here.
"""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import megatron_muon.megatron.checkpoint as checkpoint  # noqa: E402
import megatron_muon.megatron.layout as layout  # noqa: E402
import megatron_muon.megatron.optimizer as optimizer  # noqa: E402

fixed = layout.balanced_buffer_layouts


def old_arithmetic(*args, **kwargs):
    out = fixed(*args, **kwargs)
    for laid, per_buffer in out.values():
        per_buffer.per_bucket_numel_unpadded = list(laid.numel_params)
    return out


layout.balanced_buffer_layouts = old_arithmetic
layout.check_saved_extents = optimizer.check_saved_extents = checkpoint.check_saved_extents = lambda *a, **k: None
runpy.run_path(str(REPO / "scripts" / "pretrain_gpt.py"), run_name="__main__")
