"""How the Megatron adapter sees the grouped expert layouts (``TEGroupedMLP``), without their kernels.

Transformer Engine is not installable on this CPU machine, so the modules are stand-ins with the
attributes megatron-core 0.19.2's ``TEGroupedLinear`` gives its parameters
(``_set_expert_parameter_attributes``: ``weight0 .. weight{E-1}``, ``allreduce`` False,
``tensor_model_parallel``, ``partition_dim`` 0 for fc1 / 1 for fc2, ``partition_stride`` 1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import RowSplit
from megatron_muon.megatron.catalogue import layout_of, tag_grouped_experts
from megatron_muon.megatron.optimizer import _check_supported

E, HIDDEN, FFN, TP = 2, 16, 8, 2


class _GroupedLinear(torch.nn.Module):
    def __init__(self, rows: int, cols: int, partition_dim: int, single: bool = False):
        super().__init__()
        self.num_gemms = E
        self.single_grouped_weight = single
        for i in range(E):
            p = torch.nn.Parameter(torch.zeros(rows, cols))
            p.allreduce, p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, True, partition_dim, 1
            self.register_parameter(f"weight{i}", p)


def _chunk(gated: bool = True, single: bool = False) -> torch.nn.Module:
    chunk = torch.nn.Module()
    chunk.config = SimpleNamespace(gated_linear_unit=gated)
    chunk.ddp_config = SimpleNamespace()
    experts = torch.nn.Module()
    rows = (2 if gated else 1) * FFN // TP
    experts.linear_fc1 = _GroupedLinear(rows, HIDDEN, 0, single)  # TP-local [gate_r; up_r] per expert
    experts.linear_fc2 = _GroupedLinear(HIDDEN, FFN // TP, 1)
    chunk.experts = experts
    return chunk


def test_grouped_gated_fc1_split_into_gate_and_up_per_expert():
    chunk = _chunk()
    tag_grouped_experts([chunk])
    for i in range(E):
        fc1 = getattr(chunk.experts.linear_fc1, f"weight{i}")
        layout = layout_of(f"weight{i}", fc1, TP, MuonConfig())
        assert layout.split == RowSplit(1, (FFN // TP, FFN // TP))
        assert layout.sub_global_shapes() == [(FFN, HIDDEN), (FFN, HIDDEN)]  # gate and up, whole over TP
        fc2 = getattr(chunk.experts.linear_fc2, f"weight{i}")
        layout = layout_of(f"weight{i}", fc2, TP, MuonConfig())
        assert layout.split is None and layout.sub_global_shapes() == [(HIDDEN, FFN)]


def test_grouped_fc1_not_gated_is_one_matrix():
    chunk = _chunk(gated=False)
    tag_grouped_experts([chunk])
    assert layout_of("w", chunk.experts.linear_fc1.weight0, TP, MuonConfig()).split is None


def test_single_grouped_weight_refused_in_one_line():
    with pytest.raises(ValueError, match="^moe_single_grouped_weight .*set it False") as err:
        tag_grouped_experts([_chunk(single=True)])
    assert "\n" not in str(err.value)


def test_three_d_expert_weight_refused_in_one_line():
    chunk = _chunk()
    chunk.experts.stacked = torch.nn.Parameter(torch.zeros(E, FFN, HIDDEN))
    config = SimpleNamespace(fp16=False)
    with pytest.raises(ValueError, match=r"experts.stacked has shape \(2, 8, 16\).*moe_single_grouped_weight"):
        _check_supported(config, [chunk])


def test_balanced_layout_costs_grouped_fc1_as_its_gate_and_up_halves(monkeypatch):
    """The balanced ZeRO-1 layout is built when DDP wraps the chunk, before the optimizer tags
    anything: it must tag the grouped experts itself, or it costs each expert's fc1 as one
    2f × h matrix (2.25× the gate and up halves' FLOPs at DeepSeek-V3's 2048 × 7168). The
    costs are read off the items handed to ``balanced_layout`` (a spy; the layout still runs)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_muon.core.newton_schulz import ns_flops
    from megatron_muon.megatron import layout as layout_module

    seen = []
    real = layout_module.balanced_layout
    monkeypatch.setattr(layout_module, "balanced_layout",
                        lambda items, *a, **k: seen.append(items) or real(items, *a, **k))
    chunk = _chunk()  # untagged, as DDP receives it
    chunk.config = SimpleNamespace(gated_linear_unit=True, num_attention_heads=2, num_query_groups=2, kv_channels=8)
    layout_module.balanced_full_param_layout(chunk, None, 2, DistributedDataParallelConfig(
        use_distributed_optimizer=True), muon_config=MuonConfig(), tp_size=TP)
    costs = sorted(item.ns_flops for items in seen for item in items if item.whole)
    assert costs == sorted([2 * ns_flops(FFN, HIDDEN)] * E + [ns_flops(HIDDEN, FFN)] * E)
    assert 2 * ns_flops(FFN, HIDDEN) < ns_flops(2 * FFN, HIDDEN)  # what the untagged cost would be
