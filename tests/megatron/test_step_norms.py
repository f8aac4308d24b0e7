"""``MuonWithAdamW.step_norms`` and ``log_stats.norm_scalars``: the Muon parameters' global norm and
the applied update's RMS, summed over ranks, against the one-process reference's whole matrices.

One step from the same initial weights: the reference's θ1 − θ0·(1 − lr·wd) is the applied update
(lr·scale·O; weight decay is not in it). Every element of a Muon matrix must be counted on exactly
one rank of the groups the sums are reduced over (``norm_groups``: Megatron's grad-stats group,
the whole job with the distributed optimizer, TP x PP without it): shards cut over DP (the
distributed optimizer), matrices replicated over DP (plain DDP: each DP replica counts its own),
TP shards and TP-replicated matrices.

The same runs check the per-class figures (``core.update_stats``): the update before lr (scale·O)
per class, its matched RMS, and the orthogonality residual of the sampled weights' NS output,
measured on the TP owner (owner mode), from Grams or gathered shards summed over TP
(distributed, duplicated), and summed over DP where the grad-stats group does not hold it (DDP)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_world
from megatron_harness import FFN, GLOBAL_BATCH, GROUPS, HEADS, HIDDEN
from training_harness import LR, MUON, WD, Run, fp32_tolerances, references, train_all

from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.scaling import muon_scale
from megatron_muon.core.update_stats import matrix_class, sample_weights

MUON_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _norms(model, optimizer) -> dict:
    """A ``Run.probe``: this rank's ``step_norms`` (lists), the ranks of the groups they are
    reduced over, and the reduced scalars."""
    import torch.distributed as dist

    from megatron_muon.megatron.log_stats import norm_scalars

    inners = [o.optimizer for o in optimizer.chained_optimizers]
    groups = [dist.get_process_group_ranks(g or dist.group.WORLD) for g in inners[0].norm_groups]
    layouts = inners[0].catalogue.layouts
    names = [lay.name for lay in layouts]
    sampled = [names[i] for i in sample_weights([matrix_class(lay.name, per_head=lay.per_head) for lay in layouts])]
    return dict(local={k: v.tolist() for k, v in inners[0].step_norms.items()}, groups=groups,
                rank=dist.get_rank(), scalars=norm_scalars(inners), sampled=sampled)


def _class(name: str, per_head: bool) -> str:
    """A weight's class: a QKV split per head is ``attention_head``."""
    return matrix_class(name, per_head=per_head and name.endswith("linear_qkv.weight"))


def _sub_matrices(name: str, weight: torch.Tensor, per_head: bool) -> list[torch.Tensor]:
    """The reference's whole (TP1) weight cut into the matrices NS runs on: QKV's q, k, v rows of
    every query group stacked per role (``per_head``: every head's rows), fc1's gate and up, the
    others whole."""
    d = HIDDEN // HEADS
    if name.endswith("linear_qkv.weight") and per_head:
        split = RowSplit(1, (d,) * (weight.shape[0] // d))
    elif name.endswith("linear_qkv.weight"):
        split = RowSplit(GROUPS, (HEADS // GROUPS * d, d, d))
    elif name.endswith("linear_fc1.weight"):
        split = RowSplit(1, (FFN, FFN))
    else:
        return [weight]
    return MatrixLayout(name, tuple(weight.shape), None, 1, split).split_rows(weight)


def _residual(x: torch.Tensor) -> float:
    """float64 ‖XᵀX − I‖_F / √k: the RMS of σ² − 1 over X's singular values."""
    s = torch.linalg.svdvals(x.double())
    return float((s.square() - 1).square().mean().sqrt())


def _class_references(ref, names: list[str], sampled: list[str], per_head: bool) -> dict[str, dict[str, float]]:
    """Per class, from the one-process reference's first step: the RMS of scale·O (its applied
    update over lr), and the mean residual of O = update / (lr·scale) over the sampled weights'
    sub-matrices (the same weights, named by the run's catalogue)."""
    out = {}
    for cls in dict.fromkeys(_class(n, per_head) for n in names):
        members = [n for n in names if _class(n, per_head) == cls]
        update_sq = n_elements = 0.0
        residuals = []
        for n in members:
            delta = (ref.full[n].double() - ref.initial[n].double() * (1 - LR * WD)) / LR  # scale·O
            update_sq += float(delta.square().sum())
            n_elements += delta.numel()
            if any(s.endswith(n) for s in sampled):
                for sub in _sub_matrices(n, delta, per_head):
                    scale = muon_scale(*sub.shape, MUON["scale_mode"], MUON["extra_scale_factor"])
                    residuals.append((_residual(sub / scale), sub.shape))
        out[cls] = dict(update_rms=math.sqrt(update_sq / n_elements), matched_rms=MUON["extra_scale_factor"],
                        residual=sum(r for r, _ in residuals) / len(residuals), shapes=[s for _, s in residuals])
    return out


# torch FSDP2: rows cut over DP under Megatron's TP x PP grad-stats group, so the sums are
# all-reduced over DP first (norm_groups), each DP rank's batch its own slice of the global batch
FSDP2 = dict(wrap="fsdp2", batch=GLOBAL_BATCH, split_batch=True, schedule=True)
RUNS = [Run(tp=2, dist_opt=True, steps=1, probe=_norms), Run(tp=2, dist_opt=False, steps=1, probe=_norms),
        Run(tp=1, dist_opt=True, steps=1, probe=_norms), Run(tp=2, steps=1, probe=_norms, **FSDP2),
        Run(tp=2, dist_opt=True, steps=1, tp_mode="distributed", probe=_norms),
        Run(tp=2, dist_opt=True, steps=1, tp_mode="duplicated", probe=_norms),
        # --muon-split-qkv-per-head: QKV its own class, its heads' residuals measured on their TP rank
        Run(tp=2, dist_opt=True, steps=1, per_head=True, probe=_norms)]


def _reached(traces, rank: int = 0) -> set[int]:
    """The ranks whose sums reach ``rank`` through its all-reduces over ``norm_groups``, in order."""
    reach = {rank}
    for level in range(len(traces[rank].probes[0]["groups"])):
        reach = {r for q in reach for r in traces[q].probes[0]["groups"][level]}
    return reach


@pytest.mark.parametrize("run", RUNS, ids=["tp2-dp2-distopt", "tp2-dp2-ddp", "tp1-dp4-distopt", "tp2-dp2-fsdp2",
                                         "tp2-dp2-distributed", "tp2-dp2-duplicated", "tp2-dp2-per-head"])
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
    expected = _class_references(ref, names, traces[0].probes[0]["sampled"], run.per_head)
    # The residual against the reference's: |res(X) − res(Y)| ≤ ‖XᵀX − YᵀY‖_F/√k ≤ (‖X‖₂ + ‖Y‖₂)·‖X − Y‖_F/√k,
    # with ‖X‖₂ < 1.2 after NS and ‖X − Y‖_F ≤ √(mn)·ATOL/(lr·scale) (the harness's bound on a
    # param's difference after one step, carried back through θ1 = θ0(1 − lr·wd) − lr·scale·O);
    # the largest over the sampled sub-matrices (a mean moves by at most its largest term)
    atol = fp32_tolerances(steps=1)[0]
    for cls in expected.values():
        cls["residual_tol"] = max(2.4 * math.sqrt(m * n) * atol
                                  / (LR * muon_scale(m, n, MUON["scale_mode"], MUON["extra_scale_factor"]))
                                  / math.sqrt(min(m, n)) for m, n in cls["shapes"])
    for t in traces:  # the all-reduce gives every rank the same scalars
        scalars = t.probes[0]["scalars"]
        assert t.probes[0]["sampled"] == traces[0].probes[0]["sampled"]  # the same sample on every rank
        assert scalars["muon/param_norm"] == pytest.approx(param_sq ** 0.5, rel=1e-5)
        assert scalars["muon/update_rms_muon"] == pytest.approx((update_sq / numel) ** 0.5, rel=1e-4)
        assert set(scalars) == {"muon/param_norm", "muon/update_rms_muon"} | {
            f"muon/{c}/{f}" for c in expected for f in ("update_rms", "matched_rms", "residual")}
        for cls, ref_cls in expected.items():
            # the applied update over lr: the same sums as update_rms_muon's, 1e-4 relative
            assert scalars[f"muon/{cls}/update_rms"] == pytest.approx(ref_cls["update_rms"], rel=1e-4)
            # spectral × 0.2: 0.04 per element, summed in fp32 over < 1e5 elements (√n·u relative)
            assert scalars[f"muon/{cls}/matched_rms"] == pytest.approx(ref_cls["matched_rms"], rel=1e-5)
            assert scalars[f"muon/{cls}/residual"] == pytest.approx(ref_cls["residual"], abs=ref_cls["residual_tol"])


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
        first, second = ({k: v for k, v in x.items() if k.count("/") == 1} for x in (first, second))  # per kind
        assert set(first) == {"muon/param_norm", "muon/update_rms_full"}
        assert set(second) == {"muon/param_norm", "muon/update_rms_full", "muon/update_rms_block"}
        assert second["muon/update_rms_full"] == first["muon/update_rms_full"]  # the kept full step's
        assert 0.5 < second["muon/update_rms_block"] / second["muon/update_rms_full"] < 2.0
    locals_ = [t.probes[1]["local"] for t in traces]
    assert sum(x["full"][2] for x in locals_) == sum(x["block"][2] for x in locals_) > 0
