"""QK-clip (``--qk-clip``) and ``--log-max-attention-logit`` under torch FSDP2, against one process.

FSDP2 gives each DP rank a ``Shard(0)`` DTensor of every weight: rows ``[r0, r1)`` of the fused
QKV (``torch.chunk`` over DP). The clip scales this rank's rows by the factors of the global rows
they are (``megatron_muon/megatron/qk_clip.py``: the start from the DTensor's global offset,
``torch_fsdp2.fsdp2_flat_start``), after the max logits are reduced over DP.

Gloo, TP1 × DP2 (world 2), each DP rank on its own half of the batch, through Megatron's schedule
(``test_torch_fsdp2``'s runs), the tiny GPT of ``megatron_harness`` with τ crossed by some heads
but not all at every step (asserted from the reference):

* the default attention (4 heads in 2 query groups of 16): the QKV's 128 rows are halved at row
  64, where group 1 begins;
* 3 heads in 3 groups of 16 (``HEAD_CUT``): 144 rows, halved at row 72, inside group 1's key
  head (rows 64-80), with α = 0.3 so that its query and key rows get different factors: one
  key head's rows are scaled on both ranks, each piece by the global rows' factor;
* the same with ``--log-max-attention-logit`` alone: reduced, reported, nothing clipped;
* the head cut in bf16: Megatron's ``Float16OptimizerWithFloat16Params`` steps fp32 DTensor
  clones of the bf16 FSDP2 params (``main_param``), which the clip scales before Megatron copies
  them into the model: the model's rows stay their main rows rounded.

And TP2 × DP2 (world 4): the default attention, one query group per TP rank, FSDP2 halving each
TP rank's 64 rows between its query and key heads (α = 0.3): each TP rank's logits are its own
heads', reduced over DP.

The reference: one process at TP1 on the whole batch, its max logits from q and k directly,
upstream's rule on the whole QKV matrices (``training_harness.reference``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import run_world
from megatron_harness import GLOBAL_BATCH, HIDDEN, LAYERS
from training_harness import ATOL, Run, references, train_all

from megatron_muon.optimizer import to_local

TAU = 0.09  # crossed by some heads, not all, at every step (asserted from the references)
HEAD_CUT = dict(heads=3, groups=3, head_dim=16)
"""The attention whose QKV (3 groups x [q 16 | k 16 | v 16] = 144 rows) FSDP2 cuts at DP2 at row
72: inside group 1's key head (rows 64-80)."""
TIMEOUT = 900
# fp32 weights vs the clipped reference: the same steps in another summation order (DP's
# reduce-scatter of the grads, the split batch), so training_harness.ATOL (5.9e-6, derived there
# from fp32's unit roundoff, the model's sizes and K steps); the clip multiplies each row by the
# same fp32 factor as the reference, computed from logits within LOGIT_RTOL of the reference's.
# The logits, reduced over DP (a max: exact), vs the reference's (an einsum of q and k at TP1 on
# the whole batch): each is an fp32 dot product of 16-term head vectors, q and k each a GEMM over
# HIDDEN = 64 terms. The worst-case bound gamma_n ~ n·u (u = 2^-24) for the forward's own
# rounding is 64u + 64u + 16u = 144u = 8.6e-6 relative; 1e-5 adds room for the QKV weights of
# steps 1 and 2, which differ from the reference's only by the optimizer's fp32 rounding. A
# planted row-index bug moves the weights by 1e-3 and more (test_matches_single_process_reference).
LOGIT_RTOL = 1e-5
# bf16, step 0 (the initial weights, before any bf16 update): the logits of bf16 q and k, each
# rounded to bf16 (relative 2^-9 = 2.0e-3) as the QKV GEMM's output, and the scores' GEMM output
# rounded again: 3 roundings, 5.9e-3, against a measured 3.9e-3; 1e-2 leaves room for the
# attention's input rounded too. Later steps are not compared with the fp32 reference: the bf16
# updates move this model's logits by up to 1.0e-1 relative at step 1 (8.6e-2 without the clip,
# measured under FSDP2 and under DDP alike), as much as the clip does. The bf16 weights are not
# compared either (test_torch_fsdp2 checks bf16 FSDP2 updates); the check is model = main rounded.
BF16_STEP0_RTOL = 1e-2


def _main_mismatches(model, optimizer) -> tuple[int, int]:
    """A ``Run.probe``: (params whose FSDP2 rows are not their main rows rounded to bf16, params
    checked), over ``Float16OptimizerWithFloat16Params``' pairs (the local rows of both DTensors)."""
    optimizer = optimizer.chained_optimizers[0]
    pairs = [(to_local(m).detach(), to_local(f)) for ms, fs in
             zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups) for m, f in zip(ms, fs)]
    return sum(not torch.equal(m, f.to(m.dtype)) for m, f in pairs), len(pairs)


FSDP2 = dict(tp=1, wrap="fsdp2", batch=GLOBAL_BATCH, split_batch=True, schedule=True)
RUNS = {"groups-cut": Run(qk_clip=(TAU, 0.5), **FSDP2),
        "head-cut": Run(qk_clip=(TAU, 0.3), attention=HEAD_CUT, **FSDP2),
        "log-only": Run(qk_clip=(TAU, 0.3), attention=HEAD_CUT, qk_log_only=True, **FSDP2),
        "head-cut-bf16": Run(qk_clip=(TAU, 0.3), attention=HEAD_CUT, bf16=True, probe=_main_mismatches,
                             muon=dict(fp32_matmul_prec="medium"), **FSDP2)}
NAMES = list(RUNS)


@pytest.fixture(scope="module")
def reference():
    """{name: (its reference, the same without QK-clip)}."""
    runs = list(RUNS.values())
    unclipped = [dataclasses.replace(r.reference_run, qk_clip=None, qk_log_only=False) for r in runs]
    refs = references(runs + unclipped, timeout=TIMEOUT)
    return {name: (refs[run], refs[plain]) for (name, run), plain in zip(RUNS.items(), unclipped)}


@pytest.fixture(scope="module")
def trained():
    """{name: every rank's Trace}."""
    ranks = run_world(2, train_all, list(RUNS.values()), timeout=TIMEOUT)
    return {name: [r[i] for r in ranks] for i, name in enumerate(NAMES)}


def _qkv_cuts(result) -> list[int]:
    """Per QKV matrix, the first row of DP rank 1's shard."""
    return [lay.dp_ranges[1][0] // lay.local_shape[1] for lay in result.layouts if "linear_qkv" in lay.name]


def test_the_cuts_fall_where_intended(trained):
    """At row 64 (a group's first row) of 128, and at row 72 of 144 (inside group 1's key head,
    rows 64-80): FSDP2's shards, read from the DTensors (``torch_fsdp2_ranges`` checks them)."""
    head_dim = HIDDEN // 4
    assert _qkv_cuts(trained["groups-cut"][0]) == [64] * LAYERS
    cuts = _qkv_cuts(trained["head-cut"][0])
    assert cuts == [72] * LAYERS and all(c % head_dim for c in cuts)


@pytest.mark.parametrize("name", NAMES)
def test_references_cross_tau_in_some_heads_and_not_others(reference, name):
    """Clipping fires at every step, on some heads only; it moves the weights far beyond ATOL,
    so the comparison below could fail. Log-only: heads are over τ at every step (all of them by
    step 2, as nothing pulls them back), and the weights are the unclipped reference's."""
    run, plain = reference[name]
    for step, head_max in enumerate(run.logits):
        over, heads = int((head_max > TAU).sum()), head_max.numel()
        assert 0 < over and (over < heads or RUNS[name].qk_log_only), f"{name} step {step}: {over} of {heads} over"
    worst = max((run.full[n] - plain.full[n]).abs().max().item() for n in run.full)
    if RUNS[name].qk_log_only:
        assert worst == 0.0, f"{name}: the log-only reference moved the weights by {worst:.2e}"
    else:
        assert worst > 100 * ATOL, f"{name}: clipping moves the weights by only {worst:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_logits_are_reduced_over_dp(trained, reference, name):
    """Every rank's max logits after the MAX over DP are the whole batch's, the same bitwise on
    both ranks; the heads over τ are counted from them (so the clip fired on this run too).
    bf16: against the fp32 reference at step 0 only (``BF16_STEP0_RTOL``)."""
    want = reference[name][0].logits
    bf16 = RUNS[name].bf16
    for result in trained[name]:
        for step in range(len(want)):
            got = result.logits[step]
            assert torch.equal(got, trained[name][0].logits[step])
            if not bf16 or step == 0:
                rtol = BF16_STEP0_RTOL if bf16 else LOGIT_RTOL
                torch.testing.assert_close(got, want[step].reshape(-1), rtol=rtol, atol=0)
            assert result.heads_over[step] == int((got > TAU).sum()) > 0


@pytest.mark.parametrize("name", [n for n in NAMES if not RUNS[n].bf16])
def test_matches_single_process_reference(trained, reference, name):
    """Every weight (gathered from both ranks' rows) within ATOL of the reference's."""
    run = reference[name][0]
    result = trained[name][0]
    worst = max(((result.full[n] - run.full[n]).abs().max().item(), n) for n in run.full)
    qkv = max((result.full[n] - run.full[n]).abs().max().item() for n in run.full if "linear_qkv" in n)
    print(f"\n{name}: max |run - reference| = {worst[0]:.3e} ({worst[1]}), {qkv:.3e} on QKV")
    assert worst[0] <= ATOL, f"{name}: {worst[1]} off by {worst[0]:.2e}"


@pytest.mark.parametrize("name", [n for n in NAMES if RUNS[n].bf16])
def test_bf16_model_rows_stay_their_main_rows_rounded(trained, name):
    for result in trained[name]:
        for step, (bad, checked) in enumerate(result.probes):
            assert checked > 0 and bad == 0, f"{name} step {step}: {bad} of {checked} params off their main"


@pytest.mark.parametrize("name", NAMES)
def test_dp_replicas_see_the_same_model(trained, name):
    """After the step FSDP2 all-gathers the clipped rows for the next forward: both ranks' loss
    on one shared batch is bitwise the same."""
    assert len({r.loss for r in trained[name]}) == 1


def test_log_values_count_the_whole_model(trained, reference):
    """``--muon-log-stats``' figures under FSDP2: the max logit and heads over τ of every layer."""
    for name in (n for n in NAMES if not RUNS[n].bf16):
        last = reference[name][0].logits[-1]
        for result in trained[name]:
            top, over, heads = result.qk_log
            assert (over, heads) == (int((last > TAU).sum()), last.numel())
            assert top == pytest.approx(last.max().item(), rel=LOGIT_RTOL)



# TP2 x DP2 (world 4): the default attention's 2 query groups, one per TP rank (64 rows: q 0-32,
# k 32-48, v 48-64), FSDP2 halving each TP rank's rows at row 32, between its query and key
# heads; alpha 0.3 gives them different factors, so each DP rank's rows need their own.
TP2 = Run(qk_clip=(TAU, 0.3), **{**FSDP2, "tp": 2})


@pytest.fixture(scope="module")
def trained_tp2():
    ranks = run_world(4, train_all, [TP2], timeout=TIMEOUT)
    return [r[0] for r in ranks]


@pytest.fixture(scope="module")
def reference_tp2():
    return references([TP2], timeout=TIMEOUT)[TP2]


def test_tp2_dp2_matches_single_process_reference(trained_tp2, reference_tp2):
    """QK-clip on TP- and FSDP2-cut QKV rows: the logits reduced over TP's heads and DP's batch,
    every weight within ATOL of the one-process reference, clipping at every step."""
    assert _qkv_cuts(trained_tp2[0]) == [32] * LAYERS  # each TP rank's 64 rows halved between q and k
    for step, want in enumerate(reference_tp2.logits):
        assert 0 < int((want > TAU).sum()) < want.numel(), f"step {step}: clipping must fire on some heads only"
    result = trained_tp2[0]
    worst = max(((result.full[n] - reference_tp2.full[n]).abs().max().item(), n) for n in reference_tp2.full)
    print(f"\ntp2-dp2: max |run - reference| = {worst[0]:.3e} ({worst[1]})")
    assert worst[0] <= ATOL, f"{worst[1]} off by {worst[0]:.2e}"
    # ranks 0, 1: TP ranks 0, 1 of DP replica 0 (ranks 2, 3 of replica 1); each holds its 2 heads of
    # each layer, reduced over DP: the reference's heads of that TP rank, and bitwise its replica's
    for step, want in enumerate(reference_tp2.logits):
        for tp_rank in (0, 1):
            got = trained_tp2[tp_rank].logits[step]
            assert torch.equal(got, trained_tp2[tp_rank + 2].logits[step])
            heads = want.reshape(LAYERS, -1)[:, 2 * tp_rank:2 * tp_rank + 2].reshape(-1)
            torch.testing.assert_close(got, heads, rtol=LOGIT_RTOL, atol=0)
        assert trained_tp2[0].heads_over[step] + trained_tp2[1].heads_over[step] == int((want > TAU).sum())
    assert len({r.loss for r in trained_tp2}) == 1
