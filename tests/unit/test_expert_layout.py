"""The grouped-expert weight → per-expert matrix mapping (``core.expert_layout``), on plain tensors.

Transformer Engine's grouped GEMM kernels cannot run on this CPU machine, so the grouped layouts
are tested here through their mapping: every stacking round-trips, the rows-stacked ``RowSplit``
cuts the same matrices, and orthogonalizing a rows-stacked tensor through its ``MatrixLayout``
equals NS of each expert's (gate / up / fc2) matrix on its own — while NS of the fused tensor,
what a Muon that took the grouped weight as one matrix would do, is far from it.
"""

from __future__ import annotations

import pytest
import torch
from rounding_bounds import ns_bound
from step_harness import run_step

from megatron_muon.core.expert_layout import expert_matrices, expert_row_split, join_expert_matrices
from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.newton_schulz import newton_schulz
from megatron_muon.core.scaling import muon_scale

E, OUT, IN = 4, 12, 8


def _experts(gated: bool, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * OUT if gated else OUT
    return [torch.randn(rows, IN, generator=gen) for _ in range(E)]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("stacking", ["batch", "rows", "columns"])
def test_round_trip(stacking, gated):
    experts = _experts(gated)
    fused = {"batch": torch.stack(experts), "rows": torch.cat(experts),
             "columns": torch.cat([m.t() for m in experts], dim=1)}[stacking]
    mats = expert_matrices(fused, E, stacking, gated=gated)
    want = [h for m in experts for h in (m.split(OUT) if gated else (m,))]
    assert len(mats) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(mats, want))  # Linear orientation [out, in]
    assert torch.equal(join_expert_matrices(mats, E, stacking, gated=gated), fused)


@pytest.mark.parametrize("gated", [False, True])
def test_row_split_cuts_the_same_matrices(gated):
    fused = torch.cat(_experts(gated))
    layout = MatrixLayout("experts.fc1" if gated else "experts.fc2", tuple(fused.shape), None, 1,
                          expert_row_split(fused.shape[0], E, gated=gated))
    subs = layout.split_rows(fused)
    assert all(torch.equal(a, b) for a, b in zip(subs, expert_matrices(fused, E, "rows", gated=gated)))
    assert torch.equal(layout.join_rows(subs), fused)


@pytest.mark.parametrize("gated", [False, True])
def test_orthogonalized_per_expert_never_fused(gated):
    fused = torch.cat(_experts(gated, seed=1))
    layout = MatrixLayout("experts", tuple(fused.shape), None, 1, expert_row_split(fused.shape[0], E, gated=gated))
    got = run_step([fused.reshape(-1)], [layout], tp_mode="owner", coefficients="quintic",
                                ns_dtype=torch.float32, scale_mode="spectral")[0].view_as(fused)
    want = torch.cat([newton_schulz(m, 5, "quintic") * muon_scale(*m.shape, "spectral")
                      for m in expert_matrices(fused, E, "rows", gated=gated)])
    # The same NS on the same fp32 matrices in one process, batched in the step and one at a
    # time here, so the GEMMs may sum in another order: two fp32 NS roundings of each expert
    # matrix (rounding_bounds.ns_bound) times its scale, √12: 6.6e-4 (measured 0).
    matrices = expert_matrices(fused, E, "rows", gated=gated)
    bound = max(ns_bound(torch.float32, m, "quintic") * muon_scale(*m.shape, "spectral") for m in matrices)
    assert (got - want).abs().max().item() <= bound
    # NS of the fused tensor as one matrix mixes the experts: off by O(scale) (measured 0.2+),
    # far above that bound: the check above can fail.
    whole = newton_schulz(fused, 5, "quintic") * muon_scale(*fused.shape, "spectral")
    assert (whole - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(10, 8), 4, "rows"), "not a multiple of 4 experts"),
    ((torch.zeros(4, 8), 4, "batch"), "takes a 3-D tensor"),
    ((torch.zeros(3, 4, 8), 4, "batch"), "4 experts expected"),
    ((torch.zeros(8, 8), 4, "diagonal"), "must be one of"),
])
def test_bad_input_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        expert_matrices(*args)


def test_row_split_refuses_odd_gated_rows():
    with pytest.raises(ValueError, match="gate and up"):
        expert_row_split(12, 4, gated=True)
