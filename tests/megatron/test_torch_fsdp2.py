"""Muon under torch FSDP2 (``--use-torch-fsdp2``) on the tiny GPT, against one process.

Every run wraps the tiny GPT of ``megatron_harness`` in Megatron's ``TorchFullyShardedDataParallel``
(``fully_shard`` on each transformer layer, the embedding and the root, over the DP group) and
trains it K steps with ``get_megatron_muon_optimizer``, which under FSDP2 builds Megatron's
non-distributed ``FP32Optimizer`` over the DTensor params (``megatron_muon/megatron/fsdp2.py``).
Each DP rank trains on its own slice of a global batch of 4 sequences through Megatron's schedule,
so a gradient that is not reduced (or averaged) over DP shows. The weights are then gathered
from the DP row shards (and TP ranks) and compared with one process at TP1 on the whole global
batch (``test_megatron_optimizer.train_reference``).

FSDP2 cuts every param by rows over DP, so at DP ≥ 2 every Muon matrix is cut (asserted): its
rows travel to one owner and back every step.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import WorldsOnDemand, run_world
from megatron_harness import (
    GLOBAL_BATCH,
    build_tiny_gpt,
    destroy_megatron,
    dp_slice,
    forward_backward,
    gather_full_params,
    init_megatron,
    make_batch,
)
from training_harness import (
    ATOL,
    ATOL_CLIP,
    BF16_DISTANCE,
    BF16_MIN_COSINE,
    BF16_NORM_RATIO,
    CLIP,
    MUON,
    NORM_RTOL,
    TIMEOUT,
    K,
    _optimizer_config,
    _scheduler,
    train_reference,
)


def train_fsdp2(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Each run: ``tp``, ``tp_mode``, ``microbatches`` (1), ``clip`` (0.0), ``bf16`` (bf16 params in
    ``Float16Module``, fp32 DTensor main params in ``Float16OptimizerWithFloat16Params``, NS in
    bf16). Returns per run: the full weights (rank 0), the grad norm Megatron's step returned per
    step, this rank's loss on a batch every rank shares after the last step, the number of Muon
    matrices and of those cut between DP ranks, and the bytes this rank's Muon step sent."""
    from megatron.core import parallel_state as ps

    from megatron_muon import comm_stats
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    out = []
    for run in runs:
        tp = run["tp"]
        init_megatron(tp)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        bf16 = run.get("bf16", False)
        model = build_tiny_gpt(tp, fsdp2=True, bf16=bf16)
        muon = dict(MUON, fp32_matmul_prec="medium") if bf16 else MUON
        optimizer = get_megatron_muon_optimizer(_optimizer_config(False, bf16=bf16, clip_grad=run.get("clip", 0.0)),
                                                model, MuonConfig(tp_mode=run["tp_mode"], **muon))
        scheduler = _scheduler(optimizer)
        batch = dp_slice(make_batch(7, micro_batch_size=GLOBAL_BATCH), dp_rank, dp)
        sent, grad_norms = [], []
        for _ in range(K):
            forward_backward(model, batch, pp=1, num_microbatches=run.get("microbatches", 1), optimizer=optimizer,
                             use_schedule=True)
            with comm_stats() as stats:
                ok, grad_norm, _ = optimizer.step()
            assert ok
            scheduler.step(1)
            sent.append(stats.bytes_sent)
            grad_norms.append(float(grad_norm))
        full = gather_full_params(model, ps.get_tensor_model_parallel_group(), 1)
        with torch.no_grad():  # FSDP2 all-gathers each layer's rows for the forward, on every DP rank
            shared = make_batch(11)
            local_loss = model[0](shared["tokens"], shared["position_ids"], None, labels=shared["labels"]).mean()
        layouts = [m.layout for m in optimizer.chained_optimizers[0].matrix_of_param.values()]
        out.append(dict(run=run, full=full if rank == 0 else None, local_loss=float(local_loss), sent=sent,
                        grad_norms=grad_norms,
                        matrices=len(layouts),
                        cut=sum(1 for lay in layouts if lay.dp_ranges is not None and len(lay.holders(dp)) > 1)))
        # Groups stay alive: torch caches the DeviceMesh FSDP2 builds from the DP group, and a
        # later run's mesh would name a destroyed group
        destroy_megatron(release_groups=False)
    return out


RUNS = {
    2: [dict(tp=1, tp_mode="owner"), dict(tp=1, tp_mode="owner", microbatches=2),
        dict(tp=1, tp_mode="owner", clip=CLIP), dict(tp=1, tp_mode="owner", bf16=True)],
    4: [dict(tp=1, tp_mode="owner")] + [dict(tp=2, tp_mode=m) for m in ("owner", "duplicated", "distributed")],
}
CASES = [(w, i) for w, runs in RUNS.items() for i in range(len(runs))]


def _id(case):
    w, i = case
    r = RUNS[w][i]
    mb = f"-mb{r['microbatches']}" if r.get("microbatches") else ""
    mb += f"-clip{r['clip']:g}" if r.get("clip") else ""
    mb += "-bf16" if r.get("bf16") else ""
    return f"dp{w // r['tp']}-tp{r['tp']}-{r['tp_mode']}{mb}"


@pytest.fixture(scope="module")
def references():
    """{clip: (the TP1 one-process weights after K steps on the whole global batch, the initial
    weights, the grad norm per step)}."""
    clips = (0.0, CLIP)
    return dict(zip(clips, run_world(1, train_reference, [dict(clip=c, batch=GLOBAL_BATCH) for c in clips])[0]))


@pytest.fixture(scope="module")
def trained():
    return WorldsOnDemand(lambda world: run_world(world, train_fsdp2, RUNS[world], timeout=TIMEOUT))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_single_process_reference(trained, references, case):
    """fp32: ATOL (test_megatron_optimizer, 2e-6; ATOL_CLIP 4e-6 with clipping): TP1 is off the
    reference by the update's own rounding and the DP mean's summation order (FSDP2's
    reduce-scatter), TP2 also by the cross entropy's and RowParallel's; measured max |diff|
    4.8e-7 at TP1 (DP2 and DP4), 6.0e-7 at TP2 x DP2. bf16: the update-delta checks of
    test_megatron_optimizer (size, direction, distance; their measured bounds, see there)."""
    world, index = case
    result = trained[world][0][index]
    run = RUNS[world][index]
    reference, initial, reference_norms = references[run.get("clip", 0.0)]
    full = result["full"]
    assert full.keys() == reference.keys()
    if run.get("bf16"):
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
    if run.get("clip"):  # clipping must have happened: Megatron clips when its norm exceeds clip_grad
        assert all(n > run["clip"] for n in result["grad_norms"]), result["grad_norms"]
    # Megatron's norm of FSDP2's DTensor grads (each rank's rows, summed over the mesh's group,
    # then over TP x PP) is the full model's: nothing missed, nothing counted twice
    for step, (got, want) in enumerate(zip(result["grad_norms"], reference_norms)):
        assert abs(got - want) <= NORM_RTOL * want, f"step {step}: grad norm {got} vs {want}"
    atol = ATOL_CLIP if run.get("clip") else ATOL
    for name, expected in reference.items():
        torch.testing.assert_close(full[name], expected, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dp_replicas_see_the_same_model(trained, case):
    """After the step FSDP2 all-gathers each layer's rows for the next forward: every rank's loss
    on one shared batch is bitwise the same (TP ranks compute the same loss)."""
    world, index = case
    losses = {r[index]["local_loss"] for r in trained[world]}
    assert len(losses) == 1, losses


def test_every_matrix_is_cut_and_travels(trained):
    """FSDP2 shards every param by rows over DP: at DP ≥ 2 each Muon matrix is cut between ranks
    (its rows ≥ DP here), and the cut rows travel to their owner every step."""
    for world, results in ((w, trained[w]) for w in RUNS):
        for index, run in enumerate(RUNS[world]):
            assert results[0][index]["matrices"] > 0
            assert results[0][index]["cut"] == results[0][index]["matrices"], (world, run)
            assert sum(sum(r[index]["sent"]) for r in results) > 0, (world, run)


def test_fsdp2_row_ranges_follow_torch_chunk():
    """``torch.chunk`` semantics: ceil(rows / dp) rows per rank, the last ranks fewer or none."""
    from megatron_muon.megatron.fsdp2 import fsdp2_row_ranges

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

    from megatron_muon.megatron.fsdp2 import torch_fsdp2_ranges

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
