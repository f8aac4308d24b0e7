"""Muon under torch FSDP2 (``--use-torch-fsdp2``) on the tiny GPT, against one process.

Every run wraps the tiny GPT of ``megatron_harness`` in Megatron's ``TorchFullyShardedDataParallel``
(``fully_shard`` on each transformer layer, the embedding and the root, over the DP group) and
trains it K steps with ``get_megatron_muon_optimizer``, which under FSDP2 builds Megatron's
non-distributed ``FP32Optimizer`` over the DTensor params (``megatron_muon/megatron/torch_fsdp2.py``).
Each DP rank trains on its own slice of a global batch of 4 sequences through Megatron's schedule,
so a gradient that is not reduced (or averaged) over DP shows. The weights are then gathered
from the DP row shards (and TP ranks) and compared with one process at TP1 on the whole global
batch (``training_harness.reference``).

FSDP2 cuts every param by rows over DP, so at DP ≥ 2 every Muon matrix is cut (asserted): its
rows travel to one owner and back every step.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import WorldsOnDemand, run_world
from megatron_harness import GLOBAL_BATCH
from training_harness import (
    ATOL,
    ATOL_CLIP,
    BF16_DISTANCE,
    BF16_MIN_COSINE,
    BF16_NORM_RATIO,
    CLIP,
    NORM_RTOL,
    TIMEOUT,
    Run,
    references,
    train_all,
)

# FSDP2 over the DP group, each DP rank on its own slice of the global batch through Megatron's
# schedule. bf16: bf16 params in ``Float16Module``, fp32 DTensor main params in
# ``Float16OptimizerWithFloat16Params``, NS in bf16.
FSDP2 = dict(wrap="fsdp2", batch=GLOBAL_BATCH, split_batch=True, schedule=True)
BF16 = dict(bf16=True, muon=dict(fp32_matmul_prec="medium"))
RUNS = {
    2: [Run(tp=1, tp_mode="owner", **FSDP2), Run(tp=1, tp_mode="owner", microbatches=2, **FSDP2),
        Run(tp=1, tp_mode="owner", clip=CLIP, **FSDP2), Run(tp=1, tp_mode="owner", **BF16, **FSDP2)],
    4: [Run(tp=1, tp_mode="owner", **FSDP2)]
    + [Run(tp=2, tp_mode=m, **FSDP2) for m in ("owner", "duplicated", "distributed")],
}
CASES = [(w, i) for w, runs in RUNS.items() for i in range(len(runs))]


def _id(case):
    w, i = case
    r = RUNS[w][i]
    mb = f"-mb{r.microbatches}" if r.microbatches != 1 else ""
    mb += f"-clip{r.clip:g}" if r.clip else ""
    mb += "-bf16" if r.bf16 else ""
    return f"dp{w // r.tp}-tp{r.tp}-{r.tp_mode}{mb}"


@pytest.fixture(scope="module")
def reference():
    """{run: the TP1 one-process reference on the whole global batch (full and initial weights,
    the grad norm per step)}."""
    return references(run for runs in RUNS.values() for run in runs)


@pytest.fixture(scope="module")
def trained():
    return WorldsOnDemand(lambda world: run_world(world, train_all, RUNS[world], timeout=TIMEOUT))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_single_process_reference(trained, reference, case):
    """fp32: ATOL (training_harness, 5.9e-6; ATOL_CLIP 7.8e-6 with clipping): TP1 is off the
    reference by the update's own rounding and the DP mean's summation order (FSDP2's
    reduce-scatter), TP2 also by the cross entropy's and RowParallel's; measured max |diff|
    4.8e-7 at TP1 (DP2 and DP4), 6.0e-7 at TP2 x DP2. bf16: the update-delta checks of
    test_megatron_optimizer (size, direction, distance; their measured bounds, see there)."""
    world, index = case
    result = trained[world][0][index]
    run = RUNS[world][index]
    ref = reference[run]
    reference, initial, reference_norms = ref.full, ref.initial, ref.grad_norms
    full = result.full
    assert full.keys() == reference.keys()
    if run.bf16:
        for name in reference:
            if reference[name].dim() != 2 or "embedding" in name or "output_layer" in name:
                continue  # AdamW moves entries by ~±lr whatever the gradient's size
            want = (reference[name] - initial[name]).flatten()
            got = (full[name].float() - initial[name]).flatten()
            ratio = (got.norm() / want.norm()).item()
            cosine = (torch.dot(got, want) / (got.norm() * want.norm())).item()
            distance = ((got - want).norm() / want.norm()).item()
            assert abs(ratio - 1) <= BF16_NORM_RATIO, f"{name} update's size is {ratio:.4f}x the reference's"
            assert cosine >= BF16_MIN_COSINE, f"{name} update's cosine to the reference is {cosine:.4f}"
            assert distance <= BF16_DISTANCE, f"{name} update is {distance:.3f} away from the reference's"
        return
    if run.clip:  # clipping must have happened: Megatron clips when its norm exceeds clip_grad
        assert all(n > run.clip for n in result.grad_norms), result.grad_norms
    # Megatron's norm of FSDP2's DTensor grads (each rank's rows, summed over the mesh's group,
    # then over TP x PP) is the full model's: nothing missed, nothing counted twice
    for step, (got, want) in enumerate(zip(result.grad_norms, reference_norms)):
        assert abs(got - want) <= NORM_RTOL * want, f"step {step}: grad norm {got} vs {want}"
    atol = ATOL_CLIP if run.clip else ATOL
    for name, expected in reference.items():
        torch.testing.assert_close(full[name], expected, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dp_replicas_see_the_same_model(trained, case):
    """After the step FSDP2 all-gathers each layer's rows for the next forward: every rank's loss
    on one shared batch is bitwise the same (TP ranks compute the same loss)."""
    world, index = case
    losses = {r[index].loss for r in trained[world]}
    assert len(losses) == 1, losses


def test_every_matrix_is_cut_and_travels(trained):
    """FSDP2 shards every param by rows over DP: at DP ≥ 2 each Muon matrix is cut between ranks
    (its rows ≥ DP here), and the cut rows travel to their owner every step."""
    for world, results in ((w, trained[w]) for w in RUNS):
        for index, run in enumerate(RUNS[world]):
            assert len(results[0][index].layouts) > 0
            assert results[0][index].cut == len(results[0][index].layouts), (world, run)
            assert sum(sum(r[index].sent) for r in results) > 0, (world, run)


def test_fsdp2_row_ranges_follow_torch_chunk():
    """``torch.chunk`` semantics: ceil(rows / dp) rows per rank, the last ranks fewer or none."""
    from megatron_muon.megatron.torch_fsdp2 import fsdp2_row_ranges

    assert fsdp2_row_ranges(5, 3, 2) == ((0, 9), (9, 15))
    assert fsdp2_row_ranges(5, 3, 4) == ((0, 6), (6, 12), (12, 15), (0, 0))
    assert fsdp2_row_ranges(2, 4, 4) == ((0, 4), (4, 8), (0, 0), (0, 0))
    for rows, dp in ((7, 3), (64, 4), (1, 2)):
        pieces = torch.arange(rows * 2).reshape(rows, 2).chunk(dp)
        expected = [p.flatten().tolist() for p in pieces] + [[]] * (dp - len(pieces))
        got = [list(range(s, e)) for s, e in fsdp2_row_ranges(rows, 2, dp)]
        assert got == expected


def _ranges_of_dtensors(rank: int, world: int) -> dict:
    """``torch_fsdp2_ranges`` on DTensors sharded as FSDP2 shards (``Shard(0)``, uneven rows) and
    on one that is not (``Replicate``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron_muon.megatron.torch_fsdp2 import torch_fsdp2_ranges

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    out = {}
    for rows in (5, 1):
        ranges, group = torch_fsdp2_ranges("w", distribute_tensor(torch.zeros(rows, 3), mesh, [Shard(0)]))
        out[rows] = (ranges, group is mesh.get_group())
    try:
        torch_fsdp2_ranges("w", distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))
    except ValueError as err:
        out["replicated"] = str(err)
    return out


def test_ranges_are_checked_against_the_dtensor():
    for result in run_world(2, _ranges_of_dtensors):
        assert result[5] == (((0, 9), (9, 15)), True)
        assert result[1] == (((0, 3), (0, 0)), True)  # rank 1 holds no row
        assert result["replicated"].startswith("--use-torch-fsdp2: w has placements (Replicate(),)")
