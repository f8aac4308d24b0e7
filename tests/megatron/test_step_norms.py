"""``MuonWithAdamW.step_norms`` and ``log_stats.norm_scalars``: the Muon parameters' global norm and
the applied update's RMS, summed over ranks, against the one-process reference's whole matrices.

One step from the same initial weights: the reference's θ1 − θ0·(1 − lr·wd) is the applied update
(lr·scale·O; weight decay is not in it). Every element of a Muon matrix must be counted on exactly
one rank of the groups the sums are reduced over (``norm_groups``: Megatron's grad-stats group,
the whole job with the distributed optimizer, TP x PP without it): shards cut over DP (the
distributed optimizer), matrices replicated over DP (plain DDP: each DP replica counts its own),
TP shards and TP-replicated matrices."""

from __future__ import annotations

import pytest
from dist_harness import run_world
from megatron_harness import GLOBAL_BATCH
from training_harness import LR, WD, Run, references, train_all

MUON_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _norms(model, optimizer) -> dict:
    """A ``Run.probe``: this rank's ``step_norms`` (lists), the ranks of the groups they are
    reduced over, and the reduced scalars."""
    import torch.distributed as dist

    from megatron_muon.megatron.log_stats import norm_scalars

    inners = [o.optimizer for o in optimizer.chained_optimizers]
    groups = [dist.get_process_group_ranks(g or dist.group.WORLD) for g in inners[0].norm_groups]
    return dict(local={k: v.tolist() for k, v in inners[0].step_norms.items()}, groups=groups,
                rank=dist.get_rank(), scalars=norm_scalars(inners))


# torch FSDP2: rows cut over DP under Megatron's TP x PP grad-stats group, so the sums are
# all-reduced over DP first (norm_groups), each DP rank's batch its own slice of the global batch
FSDP2 = dict(wrap="fsdp2", batch=GLOBAL_BATCH, split_batch=True, schedule=True)
RUNS = [Run(tp=2, dist_opt=True, steps=1, probe=_norms), Run(tp=2, dist_opt=False, steps=1, probe=_norms),
        Run(tp=1, dist_opt=True, steps=1, probe=_norms), Run(tp=2, steps=1, probe=_norms, **FSDP2)]


def _reached(traces, rank: int = 0) -> set[int]:
    """The ranks whose sums reach ``rank`` through its all-reduces over ``norm_groups``, in order."""
    reach = {rank}
    for level in range(len(traces[rank].probes[0]["groups"])):
        reach = {r for q in reach for r in traces[q].probes[0]["groups"][level]}
    return reach


@pytest.mark.parametrize("run", RUNS, ids=["tp2-dp2-distopt", "tp2-dp2-ddp", "tp1-dp4-distopt", "tp2-dp2-fsdp2"])
def test_norms_equal_the_reference_matrices(run):
    traces = [t for (t,) in run_world(4, train_all, [run])]
    ref = references([run])[run]
    names = [n for n in ref.full if n.endswith(MUON_WEIGHTS)]
    assert len(names) == 4 * 2  # 2 layers x qkv, proj, fc1, fc2
    param_sq = sum(float(ref.full[n].double().square().sum()) for n in names)
    update_sq = sum(float((ref.full[n].double() - ref.initial[n].double() * (1 - LR * WD)).square().sum())
                    for n in names)
    numel = sum(ref.full[n].numel() for n in names)
    domain = _reached(traces)
    # Megatron's grad-stats group: the whole job with the distributed optimizer, TP (x PP) without
    # (FSDP2: DP, then TP)
    assert sorted(domain) == ([0, 1] if run.tp == 2 and not run.dist_opt and run.wrap == "ddp" else [0, 1, 2, 3])
    assert len(traces[0].probes[0]["groups"]) == (2 if run.wrap == "fsdp2" else 1)
    summed = [sum(t.probes[0]["local"]["muon"][k] for t in traces if t.probes[0]["rank"] in domain) for k in range(3)]
    assert summed[2] == numel  # every element counted once over the group's ranks
    # fp32 sums of squares of O(1) values over ~10^5 elements, against the reference's weights
    # (which match this run's to ~1e-6, tests/megatron/test_megatron_optimizer.py): 1e-5 relative
    assert summed[0] == pytest.approx(param_sq, rel=1e-5)
    assert summed[1] == pytest.approx(update_sq, rel=1e-4)  # the update itself differs by ~1e-6 absolute
    for t in traces:  # the all-reduce gives every rank the same scalars
        assert t.probes[0]["scalars"]["muon/param_norm"] == pytest.approx(param_sq ** 0.5, rel=1e-5)
        assert t.probes[0]["scalars"]["muon/update_rms_muon"] == pytest.approx((update_sq / numel) ** 0.5, rel=1e-4)
        assert set(t.probes[0]["scalars"]) == {"muon/param_norm", "muon/update_rms_muon"}


def test_norm_text_formats_what_it_is_given():
    from megatron_muon.megatron.log_stats import norm_text

    assert norm_text({}) == ""
    assert norm_text({"muon/param_norm": 12.3456, "muon/update_rms_full": 1.2e-3, "muon/update_rms_block": 4.5e-4}) == (
        " muon param norm: 12.3456 | muon update rms: full 1.200E-03, block 4.500E-04 |")


def test_muonbp_reports_each_kind():
    """MuonBP (period 2): step 0 is a full step, step 1 a block step; after both, each kind has its
    own update RMS, and the parameter norm is the last (block) step's. Block and full updates of
    the same matrices count the same elements; a block step's orthogonalized TP halves have the
    same RMS scale as the full matrix's, so the two RMS agree to within a factor of two here."""
    run = Run(tp=2, dist_opt=True, steps=2, muon=dict(muonbp_period=2), probe=_norms)
    traces = [t for (t,) in run_world(4, train_all, [run])]
    for t in traces:
        first, second = t.probes[0]["scalars"], t.probes[1]["scalars"]
        assert set(first) == {"muon/param_norm", "muon/update_rms_full"}
        assert set(second) == {"muon/param_norm", "muon/update_rms_full", "muon/update_rms_block"}
        assert second["muon/update_rms_full"] == first["muon/update_rms_full"]  # the kept full step's
        assert 0.5 < second["muon/update_rms_block"] / second["muon/update_rms_full"] < 2.0
    locals_ = [t.probes[1]["local"] for t in traces]
    assert sum(x["full"][2] for x in locals_) == sum(x["block"][2] for x in locals_) > 0
