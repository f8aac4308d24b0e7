"""Which resumes ``resume_config._dp_layout_refusal`` refuses before launch, on the checkpoint's metadata.

The line is the optimizer's own load refusal (``resharding.BALANCED_FROM_DP_RESHARDABLE``); the
real checkpoint and the job are ``tests/e2e/test_preflight.py``'s. Here every branch, on ``Saved``
records built as ``saved_checkpoint.read_saved`` builds them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_muon.megatron.resharding import BALANCED_FROM_DP_RESHARDABLE
from megatron_muon.megatron.resume_config import _dp_layout_refusal
from megatron_muon.megatron.saved_checkpoint import Saved

ZERO1 = dict(use_distributed_optimizer=True, use_megatron_fsdp=False, use_torch_fsdp2=False)


def _saved(kind: str, **saved_args) -> Saved:
    return Saved(Path("/ckpt/iter_0000003"), SimpleNamespace(**saved_args), {"distrib_optim_sharding_type": kind})


def _run(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{**ZERO1, "muon_dp_layout": None, **changes})  # None: the default, priced


@pytest.mark.parametrize("saved, run, refused", [
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(muon_dp_layout="balanced"), True),
    # saved before --muon-dp-layout existed: megatron-core's packing
    (_saved("dp_reshardable"), _run(muon_dp_layout="balanced"), True),
    # the default, priced, may pack a buffer as megatron-core does (row-aligned cuts that fall where
    # its shards do) or not: only the built buffers tell, so the load's own check decides
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(), False),
    (_saved("dp_reshardable"), _run(), False),
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(muon_dp_layout="megatron"), False),
    # a balanced layout that fell back to megatron-core's packing: the load sees whether this run's does too
    (_saved("dp_reshardable", muon_dp_layout="balanced"), _run(), False),
    (_saved("dp_reshardable", muon_dp_layout=None), _run(), False),
    (_saved("fully_reshardable", muon_dp_layout="megatron"), _run(), False),  # per param: any layout loads it
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(muon_dp_layout="balanced",
                                                                 muon_reset_optimizer_state=True), False),
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(muon_dp_layout="balanced", no_load_optim=True), False),
    (_saved("dp_reshardable", muon_dp_layout="megatron"), _run(muon_dp_layout="balanced",
                                                                 use_distributed_optimizer=False), False),
])
def test_refused_exactly_where_the_load_would_refuse(saved, run, refused):
    assert _dp_layout_refusal(saved, run) == (BALANCED_FROM_DP_RESHARDABLE if refused else None)
