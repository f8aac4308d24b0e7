"""QK-clip (MuonClip) for multi-latent attention (MLA) with Muon: the rule, and a tiny MLA GPT under TP × DP.

Unit tests: ``core/qk_clip.py``'s MLA row scales on plain tensors (per-head blocks; heads under τ,
value rows untouched bitwise; a flat range cut anywhere equal to the whole matrix bitwise), and
against megatron-core 0.19.2's own ``MLASelfAttention.clip_qk`` on a real layer (bitwise).

Gloo: the tiny GPT of ``megatron_harness`` with MLA in every layer (local spec, core attention
``mla_attention.MLACoreAttention``; one ``linear_q_proj``, or a q LoRA rank: ``linear_q_down_proj``
+ ``linear_q_up_proj``), ``qk_clip=True`` and a threshold that a part of the heads cross at every
step, trained K steps with ``get_megatron_muon_optimizer`` at TP2 × DP2 (world 4), with the
distributed optimizer (q and kv up-projections cut between DP ranks) and without, each DP rank on
its own half of the batch; against one process at TP1 on the whole batch, Muon + AdamW at torch
level, then upstream's ``clip_qk`` on every MLA layer (whole matrices; ``training_harness.reference``).

TP2 needs ``MLACoreAttention``'s fix of megatron-core's rotary-key gradient at TP > 1 on the
local spec (Megatron-LM issue #1699, ``tests/mla_attention.py``); without it TP2 and TP1 differ
by ~1e-2 after 3 steps whatever the clip does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import run_world
from megatron_harness import HEADS, HIDDEN, LAYERS, MLA, build_tiny_gpt, destroy_megatron, init_megatron
from training_harness import ATOL, MUON, K, Run, _optimizer_config, mla_layers, references, train_all

from megatron_muon.core.qk_clip import group_eta, mla_kv_row_scale, mla_q_row_scale, scale_rows_, scale_rows_flat_

ALPHA = 0.5
BATCH = 4  # the global batch: 2 sequences per DP rank at DP2
NOPE, PE, V = MLA["qk_head_dim"], MLA["qk_pos_emb_head_dim"], MLA["v_head_dim"]
TIMEOUT = 900
# Two MLA models. τ: crossed by some heads, not all, at every step (asserted from the reference);
# with a q LoRA rank the query is the product of two small matrices and the logits are ~10x smaller.
# bucket: Megatron's layout of the TP2 shard in buckets of >= that many elements, each split over
# DP2 (asserted below): at 2000 both linear_q_proj (64 columns, cut at row 14) and
# linear_kv_up_proj (32 columns, cut between heads 0 and 1) are cut; at 6000 linear_q_up_proj
# (24 columns) is cut mid-row (element 320: row 13, column 8).
CASES = {"q_proj": dict(mla=dict(q_lora_rank=None), tau=0.055, bucket=2000),
         "q_lora": dict(mla=dict(q_lora_rank=24), tau=0.0053, bucket=6000)}

# ----------------------------------------------------------------------------- the pure rule


def _matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_mla_row_scales_by_head(alpha):
    """Head h: q_nope × η^α, q_pe × η, k_nope × η^(1−α), v × 1; heads under τ bitwise unchanged."""
    head_max = torch.tensor([0.7, 0.2, 0.3, 0.45])  # τ = 0.3: heads 0 and 3 over, 2 exactly at τ
    eta = group_eta(head_max, HEADS, 0.3)
    q, kv = _matrix(HEADS * (NOPE + PE), HIDDEN), _matrix(HEADS * (NOPE + V), 32, seed=1)
    q_out = scale_rows_(q.clone(), mla_q_row_scale(eta, alpha, NOPE, PE))
    kv_out = scale_rows_(kv.clone(), mla_kv_row_scale(eta, alpha, NOPE, V))
    q_heads, q_out_heads = q.view(HEADS, NOPE + PE, -1), q_out.view(HEADS, NOPE + PE, -1)
    kv_heads, kv_out_heads = kv.view(HEADS, NOPE + V, -1), kv_out.view(HEADS, NOPE + V, -1)
    for h, m in enumerate(head_max.tolist()):
        if m <= 0.3:
            assert torch.equal(q_out_heads[h], q_heads[h]) and torch.equal(kv_out_heads[h], kv_heads[h])
            continue
        e = 0.3 / torch.tensor(m)  # upstream's τ / m: fp32 (Tensor.__rtruediv__: τ × (1 / m), not τ ÷ m)
        # × the same fp32 factor (torch.pow of the same fp32 η): bitwise
        assert torch.equal(q_out_heads[h, :NOPE], q_heads[h, :NOPE] * torch.pow(e, alpha))
        assert torch.equal(q_out_heads[h, NOPE:], q_heads[h, NOPE:] * e)  # the rotary query takes all of η
        assert torch.equal(kv_out_heads[h, :NOPE], kv_heads[h, :NOPE] * torch.pow(e, 1 - alpha))
        assert torch.equal(kv_out_heads[h, NOPE:], kv_heads[h, NOPE:])  # value rows: untouched


def test_negative_and_nan_logits_leave_their_heads_alone():
    """Upstream's clamp(τ/m, max=1) would give a negative η (NaN η^α, a sign flip of q_pe) or NaN."""
    eta = group_eta(torch.tensor([-0.5, float("nan"), 0.0, 0.6]), HEADS, 0.3)
    assert eta.tolist()[:3] == [1.0, 1.0, 1.0] and eta[3].item() == pytest.approx(0.5)
    q = mla_q_row_scale(eta, 0.5, NOPE, PE).view(HEADS, -1)
    assert torch.equal(q[:3], torch.ones_like(q[:3]))


Q_ROWS, KV_ROWS, KV_COLS = HEADS * (NOPE + PE), HEADS * (NOPE + V), 32


@pytest.mark.parametrize("which", ["q", "kv"])
@pytest.mark.parametrize("start, end", [(0, 0), (0, None), (5, 17), (HIDDEN - 3, HIDDEN + 2), (320, 1000),
                                        (70, 70 + 5 * HIDDEN), (3 * HIDDEN, 9 * HIDDEN), (896, None), (1, -1)])
def test_flat_range_equals_the_whole_matrix_bitwise(which, start, end):
    """The distributed optimizer's shard: any [start, end) of the flattened matrix, mid-row cuts included."""
    eta = torch.tensor([0.5, 1.0, 0.8, 0.9])
    rows, cols, scale = ((Q_ROWS, HIDDEN, mla_q_row_scale(eta, 0.5, NOPE, PE)) if which == "q" else
                         (KV_ROWS, KV_COLS, mla_kv_row_scale(eta, 0.5, NOPE, V)))
    weight = _matrix(rows, cols)
    end = rows * cols if end is None else (end if end >= 0 else rows * cols + end)
    whole = scale_rows_(weight.clone(), scale)
    flat = weight.reshape(-1)[start:end].clone()
    scale_rows_flat_(flat, start, scale, cols)
    assert torch.equal(flat, whole.reshape(-1)[start:end])


def test_mla_bad_alpha_is_refused():
    for fn in (mla_q_row_scale, mla_kv_row_scale):
        with pytest.raises(ValueError, match="alpha must be in"):
            fn(torch.ones(2), 0.0, 4, 2)


# ----------------------------------------------------------------------------- upstream's clip_qk


def upstream_clip_cases(head_max: torch.Tensor, tau: float) -> dict:
    """In a one-rank Megatron world: for each q projection kind and α, a real ``MLASelfAttention``
    clipped by upstream's ``clip_qk`` (``current_max_attn_logits`` = ``head_max``) and by our row
    scales, on copies of the same weights."""
    out = {}
    for kind, case in CASES.items():
        for alpha in (0.5, 0.3):
            init_megatron(1, 1)
            model = build_tiny_gpt(1, 1, mla=case["mla"])
            layer = mla_layers(model[0])[0]
            layer.config.qk_clip, layer.config.qk_clip_threshold, layer.config.qk_clip_alpha = True, tau, alpha
            q_proj = layer.linear_q_proj if case["mla"]["q_lora_rank"] is None else layer.linear_q_up_proj
            before = q_proj.weight.detach().clone(), layer.linear_kv_up_proj.weight.detach().clone()
            eta = group_eta(head_max, HEADS, tau)
            ours = (scale_rows_(before[0].clone(), mla_q_row_scale(eta, alpha, NOPE, PE)),
                    scale_rows_(before[1].clone(), mla_kv_row_scale(eta, alpha, NOPE, V)))
            layer.core_attention.current_max_attn_logits = head_max.clone()
            with torch.no_grad():
                layer.clip_qk()
            upstream = q_proj.weight.detach().clone(), layer.linear_kv_up_proj.weight.detach().clone()
            out[(kind, alpha)] = dict(before=before, ours=ours, upstream=upstream)
            destroy_megatron()
    return out


# ----------------------------------------------------------------------------- the tiny MLA GPT


def _run(name: str, dist_opt: bool) -> Run:
    """``CASES[name]`` at TP2 over the world's DP ranks, qk-clip on, each DP rank on its half of the batch."""
    case = CASES[name]
    return Run(tp=2, dist_opt=dist_opt, mla=case["mla"], qk_clip=(case["tau"], ALPHA), batch=BATCH, split_batch=True,
               layout_bucket_size=case["bucket"] if dist_opt else None)


UPSTREAM_TAU = 0.3
UPSTREAM_HEAD_MAX = torch.tensor([0.7, 0.2, 0.3, 0.45])  # heads 0 and 3 over τ, 2 exactly at τ


def untracked_refusal() -> str:
    """``--log-max-attention-logit`` on an MLA model whose core attention keeps no max logit."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    init_megatron(1, 1)
    model = build_tiny_gpt(1, 1, mla=CASES["q_proj"]["mla"])
    model[0].config.log_max_attention_logit = True
    for layer in mla_layers(model[0]):
        del layer.core_attention.current_max_attn_logits
    try:
        get_megatron_muon_optimizer(_optimizer_config(False), model, MuonConfig(tp_mode="owner", **MUON))
        return ""
    except ValueError as err:
        return str(err)
    finally:
        destroy_megatron()


def one_process(rank: int, world: int) -> dict:
    return dict(upstream=upstream_clip_cases(UPSTREAM_HEAD_MAX, UPSTREAM_TAU), untracked=untracked_refusal())


NAMES = [c for c in CASES for _ in (True, False)]
RUNS = [_run(c, d) for c in CASES for d in (True, False)]


@pytest.fixture(scope="module")
def single():
    return run_world(1, one_process, timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def reference():
    """{(case, clip): one process at TP1 on the whole batch, with (clip True) and without upstream's clip_qk}."""
    keys = {(name, clip): _run(name, True).reference_run for name in CASES for clip in (True, False)}
    keys = {k: run if k[1] else dataclasses.replace(run, qk_clip=None) for k, run in keys.items()}
    refs = references(keys.values(), timeout=TIMEOUT)
    return {k: refs[run] for k, run in keys.items()}


@pytest.fixture(scope="module")
def trained():
    return run_world(4, train_all, RUNS, timeout=TIMEOUT)


def _holders(result) -> dict[str, int]:
    """Per q / kv up-projection (and ``linear_q_proj``), the DP ranks that hold a piece of it."""
    return {lay.name: len(lay.holders(result.dp_size)) for lay in result.layouts
            if "_up_proj" in lay.name or "linear_q_proj" in lay.name}


@pytest.mark.parametrize("key", [(k, a) for k in CASES for a in (0.5, 0.3)], ids=lambda key: f"{key[0]}-{key[1]}")
def test_row_scales_equal_upstream_clip_qk_bitwise(single, key):
    """megatron-core 0.19.2's own ``MLASelfAttention.clip_qk`` (``_clip_q_proj_weight``,
    ``_clip_kv_proj_weight``) on a real layer: the same fp32 factor per row, so bitwise equal."""
    case = single["upstream"][key]
    for ours, upstream, before in zip(case["ours"], case["upstream"], case["before"]):
        assert not torch.equal(upstream, before)  # heads over τ: the layer was clipped
        assert torch.equal(ours, upstream)


def test_an_mla_core_attention_that_does_not_track_is_refused(single):
    assert single["untracked"] == (
        "--log-max-attention-logit: MLACoreAttention (chunk0.module.decoder.layers.0.self_attention) does not "
        "track the max attention logit; use --transformer-impl transformer_engine (Transformer Engine >= 2.9)")


# fp32 runs against the clipped reference after K = 3 steps, the same with and without the
# distributed optimizer: TP2's GEMMs and reductions sum in another order than TP1's, and AdamW's
# 1/sqrt(v) amplifies that most on the rare-token rows of the embedding and output layer
# (training_harness's ATOL comment): its bound, ATOL = 5.9e-6, for every param and for the clipped
# matrices alike. Measured max |run - reference|: on the clipped matrices (q projection / q
# up-projection, kv up-projection) 2.3e-7; over all params 5.8e-7 (q_proj case, output layer) and
# 1.83e-6 (q_lora case, the embedding). The unclipped reference is 1.4e-2 (q_proj) and 2.9e-2
# (q_lora) away (asserted > 100 x ATOL).
CLIPPED_ATOL = ATOL
# The DP-reduced max logits vs the reference's (TP1 on the whole batch): measured max relative
# difference 5.6e-7 (q_proj) and 1.3e-6 (q_lora, whose logits are ~10x smaller): last bits of the
# q and kv GEMMs at TP2. 4e-6 leaves 3x margin; without the MAX over DP they would be half the
# batch's, off by percents.
LOGIT_RTOL = 4e-6


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_clips_some_heads_and_not_others(reference, name):
    clipped, unclipped = reference[(name, True)], reference[(name, False)]
    tau = CASES[name]["tau"]
    for step, head_max in enumerate(clipped.logits):
        over = int((head_max > tau).sum())
        assert 0 < over < head_max.numel(), f"{name} step {step}: {over} of {head_max.numel()} heads over {tau}"
    worst = max((clipped.full[n] - unclipped.full[n]).abs().max().item() for n in clipped.full)
    assert worst > 100 * ATOL, f"{name}: clipping moves the weights by only {worst:.2e}: the test could not fail"


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_every_layer_clips_its_q_and_kv_up_projections(trained, index):
    for result in (ranks[index] for ranks in trained):
        assert list(result.qk_weights) == [2] * LAYERS


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_logits_are_tracked_and_reduced_over_dp(trained, reference, index):
    """Each TP rank holds heads [2r, 2r + 2) of every layer; after the MAX over DP its logits are
    the whole batch's."""
    name = NAMES[index]
    reference = reference[(name, True)].logits
    for result in (ranks[index] for ranks in trained):
        r = result.tp_rank
        for step in range(K):
            got = result.logits[step]
            torch.testing.assert_close(got, reference[step][:, 2 * r:2 * r + 2].reshape(-1), rtol=LOGIT_RTOL, atol=0)
            assert result.heads_over[step] == int((got > CASES[name]["tau"]).sum())


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_matches_single_process_reference(trained, reference, index):
    run = RUNS[index]
    clipped = reference[(NAMES[index], True)]
    result = trained[0][index]
    worst = max(((result.full[n] - clipped.full[n]).abs().max().item(), n) for n in clipped.full)
    print(f"\n{run}: max |run - reference| = {worst[0]:.3e} ({worst[1]})")
    assert worst[0] <= ATOL, f"{run}: {worst[1]} off by {worst[0]:.2e}"
    for n in clipped.full:
        if n.endswith(("linear_q_proj.weight", "_up_proj.weight")):
            off = (result.full[n] - clipped.full[n]).abs().max().item()
            assert off <= CLIPPED_ATOL, f"{run}: {n} off by {off:.2e}"
    if run.dist_opt:
        assert any(h > 1 for ranks in trained for h in _holders(ranks[index]).values()), \
            f"{run}: no q / kv up-projection is cut across DP"


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_dp_replicas_bitwise_identical(trained, index):
    for r in (ranks[index] for ranks in trained):
        for q in (ranks[index] for ranks in trained):
            if q.tp_rank == r.tp_rank:
                for name, t in r.local.items():
                    assert torch.equal(t, q.local[name]), f"{RUNS[index]}: {name} differs across DP"


def test_log_values_count_the_whole_model(trained, reference):
    """``--muon-log-stats``' figures: max logit and heads over τ of all layers and TP ranks."""
    for index, name in enumerate(NAMES):
        last = reference[(name, True)].logits[-1]
        for result in (ranks[index] for ranks in trained):
            top, over, heads = result.qk_log
            assert heads == LAYERS * HEADS
            assert over == int((last > CASES[name]["tau"]).sum())
            assert top == pytest.approx(last.max().item(), rel=LOGIT_RTOL)
