"""``core.models.staged_pattern``: a hybrid layer pattern cut into pipeline stages with ``|``,
checked against megatron-core's own reading of the result (``select_pipeline_segment``)."""

from __future__ import annotations

import pytest

from megatron_muon.core.models import HYBRID_MODELS, staged_pattern


def test_even_and_uneven_splits():
    assert staged_pattern("*-*-", 1) == "*-*-"
    assert staged_pattern("*-*-", 2) == "*-|*-"
    assert staged_pattern("M-M*-M-", 3) == "M-|M*-|M-"  # 7 layers: middle ceil(7/3) = 3, the rest 2 + 2
    pattern = HYBRID_MODELS["nemotron-h-8b"].hybrid_pattern
    assert [len(s) for s in staged_pattern(pattern, 4).split("|")] == [13] * 4
    assert [len(s) for s in staged_pattern(pattern, 8).split("|")] == [5, *[7] * 6, 5]
    assert staged_pattern(pattern, 8).replace("|", "") == pattern  # nothing moved, nothing lost


@pytest.mark.parametrize("pattern, pp", [("*-*", 2), ("*-", 3), ("*|-", 2), ("*-", 0)])
def test_refused(pattern, pp):
    with pytest.raises(ValueError):
        staged_pattern(pattern, pp)


def test_megatron_core_reads_the_stages_back():
    """Each stage's layers as megatron-core selects them for that PP rank (a world of 8 under torch's
    fake process group, the whole world as the PP group), with their global offsets."""
    import torch.distributed as dist
    from megatron.core.models.hybrid.hybrid_layer_allocation import select_pipeline_segment
    from torch.testing._internal.distributed.fake_pg import FakeStore

    pattern = HYBRID_MODELS["nemotron-h-8b"].hybrid_pattern
    staged = staged_pattern(pattern, 8)
    offset = 0
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            world = dist.group.WORLD  # also as the TP and DP groups megatron-core logs the stage over
            layers, got_offset = select_pipeline_segment(staged, pp_group=world, vp_stage=None, tp_group=world,
                                                         dp_cp_group=world)
        finally:
            dist.destroy_process_group()
        assert got_offset == offset and "".join(layers) == staged.split("|")[rank]
        offset += len(layers)
    assert offset == len(pattern)
