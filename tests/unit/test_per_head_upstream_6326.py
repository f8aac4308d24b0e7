"""``--muon-split-qkv-per-head`` against megatron-core PR #6326's definition (same flag, open upstream).

The PR's definition, as read from its branch (NVIDIA/Megatron-LM commit febf2f185b, 2026-08-19, "Address QKV layout
review feedback": ``QKVLayout`` in ``megatron/core/transformer/attention.py``, ``_get_qkv_split_shapes`` and
``TensorParallelMuon._orthogonalize_qkv_per_head`` in ``megatron/core/optimizer/emerging_optimizers.py``), written
out here in our words, never its code:

* **rows.** The whole fused QKV (all TP ranks' rows; the PR all-gathers them over TP when a rank's
  slice cuts a head) is cut, query group after query group, into ``kv_channels``-row blocks: the
  group's ``heads / groups`` query heads, (with ``attention_output_gate``: as many gate heads,)
  its key head, its value head. MLA: per head, ``linear_q_proj`` / ``linear_q_up_proj`` into a
  ``qk_head_dim`` block and a ``qk_pos_emb_head_dim`` block, ``linear_kv_up_proj`` into a
  ``qk_head_dim`` block and a ``v_head_dim`` block.
* **update.** Each block's momentum is orthogonalized alone (emerging-optimizers' ``newton_schulz``,
  the PR's ``scaled_orthogonalize_fn`` with no TP group), multiplied by
  ``get_muon_scale_factor(block rows, cols, --muon-scale-mode)`` × ``--muon-extra-scale-factor``,
  and the blocks are put back in place.

Where the definitions overlap (a fused QKV without a gate, MHA and GQA; MLA's ``linear_kv_up_proj``)
our per-head update, from the optimizer's own road (``param_marks.matrix_layout`` with the counts
the catalogue tags, one step plan, ``orthogonalize_updates``, one process), equals the PR's. Where
they differ (docs/per_head.md, "Upstream"): the gate rows (the PR splits them per head; here a gated
QKV is refused) and MLA's query heads (the PR orthogonalizes a head's nope and rope rows apart; here
they are one matrix): the last is pinned below, so that either side changing shows.
"""

from __future__ import annotations

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as eo_newton_schulz
from rounding_bounds import ns_bound

from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.parallel.orthogonalize import orthogonalize_updates
from megatron_muon.plan.param_marks import ParamMarks, RowSplits, matrix_layout
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan

COLS = 48  # the hidden size (a QKV's input), or the kv LoRA rank
STEPS, COEFFICIENTS = 5, "quintic"  # the PR's defaults: --muon-num-ns-steps, --muon-coefficient-type


def pr6326_qkv_blocks(heads: int, groups: int, head_dim: int, gate: bool = False) -> list[int]:
    """Row counts of the PR's per-head blocks of a whole fused QKV, top to bottom."""
    per_group = heads // groups
    return ([head_dim] * per_group + [head_dim] * (per_group if gate else 0) + [head_dim, head_dim]) * groups


def pr6326_update(momentum: torch.Tensor, blocks: list[int], scale_mode: str, extra: float) -> torch.Tensor:
    """The PR's per-head update of ``momentum``: each block of ``blocks`` rows orthogonalized alone by
    emerging-optimizers' Newton–Schulz and scaled by its own shape."""
    assert sum(blocks) == momentum.shape[0]
    out = [eo_newton_schulz(block, STEPS, COEFFICIENTS) * get_muon_scale_factor(block.shape[0], block.shape[1],
                                                                                  scale_mode) * extra
           for block in momentum.split(blocks, dim=0)]
    return torch.cat(out, dim=0)


def ours(momentum: torch.Tensor, marks: ParamMarks, scale_mode: str, extra: float) -> torch.Tensor:
    """megatron-muon's per-head update of the same matrix on one process: the layout the optimizer
    builds from the parameter's marks, one step plan, the step's own orthogonalize entry."""
    layout = matrix_layout("layers.0.weight", tuple(momentum.shape), marks, 1, RowSplits(qkv_per_head=True))
    settings = PlanSettings("owner", NSOptions(STEPS, COEFFICIENTS, dtype=torch.float32), scale_mode=scale_mode,
                            extra_scale_factor=extra)
    plan = build_step_plan((layout,), dp_size=1, tp_size=1, settings=settings)
    (update,) = orthogonalize_updates([momentum.reshape(-1)], plan)
    return update.view(momentum.shape)


def bound(momentum: torch.Tensor, blocks: list[int], scale_mode: str, extra: float) -> float:
    """Two fp32 NS results of the same block whose roundings differ (another normalization kernel,
    other GEMMs: test_newton_schulz's bound against emerging-optimizers), times the block's scale;
    the scale itself is the same float on both sides (exact). Measured: at most 6.0e-7 (bound
    1.6e-5 to 4.1e-4 here; 0 in some cases, the same rounding)."""
    return max(ns_bound(torch.float32, block, COEFFICIENTS) * get_muon_scale_factor(*block.shape, scale_mode) * extra
               for block in momentum.split(blocks, dim=0))


@pytest.fixture(autouse=True)
def fp32_matmuls():
    """Both sides' NS in fp32 (emerging-optimizers' drops to bf16 at "medium": the PR's default
    --muon-fp32-matmul-prec, which this package carries as the same flag)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling", "unit_rms_norm"])
@pytest.mark.parametrize("heads, groups, head_dim", [(4, 4, 8), (8, 2, 8), (6, 1, 16), (12, 3, 4)],
                         ids=["mha", "gqa", "gqa-one-group", "gqa-3-groups"])
def test_fused_qkv_equals_pr6326(heads, groups, head_dim, scale_mode):
    blocks = pr6326_qkv_blocks(heads, groups, head_dim)
    momentum = torch.randn(sum(blocks), COLS, generator=torch.Generator().manual_seed(heads * 10 + groups))
    per_group = heads // groups
    # what catalogue.tag_qkv marks on a TP1 linear_qkv: the per-group split and the head counts
    marks = ParamMarks(tensor_parallel=True, partition_dim=0, qkv_split=(per_group * head_dim, head_dim, head_dim),
                       qkv_heads=(groups, per_group, head_dim), qkv_groups=groups)
    extra = 0.2
    theirs = pr6326_update(momentum, blocks, scale_mode, extra)
    diff = (ours(momentum, marks, scale_mode, extra) - theirs).abs().max().item()
    assert diff <= bound(momentum, blocks, scale_mode, extra), f"max |ours - PR #6326| = {diff:.2e}"
    # the test could fail: the per-group blocks (q of a group, k, v) give another update
    per_group_blocks = [per_group * head_dim, head_dim, head_dim] * groups
    if per_group > 1:
        far = (pr6326_update(momentum, per_group_blocks, scale_mode, extra) - theirs).abs().max().item()
        assert far > 100 * bound(momentum, blocks, scale_mode, extra)


def test_mla_kv_up_projection_equals_pr6326():
    """MLA's ``linear_kv_up_proj``: per head a k-nope block and a v block, both sides."""
    heads, nope, v = 4, 8, 12
    blocks = [nope, v] * heads
    momentum = torch.randn(sum(blocks), COLS, generator=torch.Generator().manual_seed(7))
    marks = ParamMarks(tensor_parallel=True, partition_dim=0, mla_heads=(heads, (nope, v)))
    theirs = pr6326_update(momentum, blocks, "spectral", 0.2)
    diff = (ours(momentum, marks, "spectral", 0.2) - theirs).abs().max().item()
    assert diff <= bound(momentum, blocks, "spectral", 0.2), f"max |ours - PR #6326| = {diff:.2e}"


def test_mla_query_heads_differ_from_pr6326():
    """Not the overlap, pinned: the PR orthogonalizes a query head's nope rows and rope rows apart;
    here they are one matrix (docs/per_head.md says why). Ours equals one block per head."""
    heads, nope, rope = 4, 8, 4
    momentum = torch.randn(heads * (nope + rope), COLS, generator=torch.Generator().manual_seed(8))
    marks = ParamMarks(tensor_parallel=True, partition_dim=0, mla_heads=(heads, (nope + rope,)))
    got = ours(momentum, marks, "spectral", 0.2)
    one_block = [nope + rope] * heads
    assert (got - pr6326_update(momentum, one_block, "spectral", 0.2)).abs().max().item() <= bound(
        momentum, one_block, "spectral", 0.2)
    pr = pr6326_update(momentum, [nope, rope] * heads, "spectral", 0.2)
    assert (got - pr).abs().max().item() > 100 * bound(momentum, one_block, "spectral", 0.2)
