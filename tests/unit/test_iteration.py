"""plan.iteration: the iteration model's properties, on hand-sized stages.

The hardware is a unit one (1 FLOP/s, 1 byte/s, no latency) and DP is 2, so a bucket's
reduce-scatter or all-gather takes numel × bytes / 2 seconds and a bucket's compute its FLOPs in
seconds. Every figure below is then a sum of integers and halves, exact in float64: the
comparisons are ``==`` (no tolerance to derive), except where a random case sums thousands of
fractional terms (``_ROUNDING``).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_muon.plan.hardware import Hardware
from megatron_muon.plan.iteration import (
    Bucket,
    IterationSettings,
    Stage,
    attention_flops,
    iteration_time,
    linear_flops,
)

UNIT = Hardware(name="unit", source="test", matmul_flops=1.0, memory_bandwidth=1.0, intra_node_bandwidth=1.0,
                inter_node_bandwidth=1.0, collective_latency_s=0.0, kernel_overhead_s=0.0, ranks_per_node=8)
# The random cases add up to ~10^3 terms of size ≤ 10^2 in another order than the bound they are
# compared with: float64 rounding of at most 10^3 · 10^2 · 2^-52 ≈ 2e-11; 1e-9 leaves room.
_ROUNDING = 1e-9


def _settings(micro_batches: int, **flags) -> IterationSettings:
    return IterationSettings(micro_batches, dp_size=2, dp_spans_nodes=False, **flags)


def _stage(*buckets: tuple[int, float], step: float = 0.0, grad_bytes: int = 1, param_bytes: int = 1) -> Stage:
    """Buckets as (numel, forward FLOPs), backward twice the forward."""
    return Stage(tuple(Bucket(n, f, 2 * f) for n, f in buckets), step, grad_bytes, param_bytes)


def test_hand_example_closed_form():
    # One stage, M = 2, step 1 s; buckets in backprop order b0 (4 elements, forward 2 s, backward
    # 4 s) and b1 (8 elements, 3 s / 6 s); one byte per element: RS and AG take 2 s (b0), 4 s (b1).
    # F = 5, B = 10. From the grad-norm all-reduce at t = 0:
    #   step [0, 1]; first forward: b1's all-gather [1, 5] (exposed 4), b1's forward [5, 8] while
    #   b0's all-gather runs [5, 7], b0's forward [8, 10]; B0 [10, 20]; F1 [20, 25]; B1 [25, 35];
    #   in B1 b0's grads are ready at 25 + 4 = 29, reduced [29, 31], b1's at 35, reduced [35, 39].
    # iteration 39 = M(F + B) 30 + step 1 + b1's all-gather 4 + b1's reduce-scatter 4.
    it = iteration_time([_stage((4, 2), (8, 3), step=1)], _settings(2), UNIT)
    assert (it.pipeline_s, it.compute_s, it.bubble_s) == (30, 30, 0)
    assert (it.exposed_step_s, it.exposed_all_gather_s, it.exposed_reduce_scatter_s) == (1, 4, 4)
    assert it.iteration_s == 39 and it.exposed_ddp_s == 8
    (stage,) = it.stages
    assert (stage.forward_s, stage.backward_s, stage.reduce_scatter_s, stage.all_gather_s) == (5, 10, 6, 6)
    assert stage.iteration_s == 39  # one stage: its own figures are the job's


def test_one_bucket_exposes_everything():
    # one bucket: its reduce-scatter starts when the backward has ended, its all-gather before the
    # forward can start, the step before both: every second of each is on the critical path
    for m in (1, 3):
        it = iteration_time([_stage((10, 7), step=2)], _settings(m), UNIT)
        assert it.pipeline_s == m * 21
        assert (it.exposed_step_s, it.exposed_all_gather_s, it.exposed_reduce_scatter_s) == (2, 5, 5)
        assert it.iteration_s == m * 21 + 12


def test_small_buckets_and_a_long_backward_expose_only_the_last_bucket():
    # ten buckets of 2 elements (1 s on the link) each covering 3 s of forward, 6 s of backward:
    # every reduce-scatter ends before the next bucket is produced, so only the last one's 1 s
    # outlasts the backward; every all-gather but the first hides under a 3 s forward
    it = iteration_time([_stage(*[(2, 3)] * 10)], _settings(4), UNIT)
    assert it.exposed_reduce_scatter_s == 1 and it.exposed_all_gather_s == 1
    assert it.iteration_s == it.pipeline_s + 2
    # the same bytes in one bucket: 10 s of each exposed
    one = iteration_time([_stage((20, 30))], _settings(4), UNIT)
    assert one.exposed_reduce_scatter_s == one.exposed_all_gather_s == 10


def test_reduce_scatter_slower_than_the_backward_exposes_the_difference():
    # the link cannot keep up: 4 buckets of 8 elements (4 s each) produced every 2 s of backward;
    # the last reduce-scatter ends at 2 + 4 · 4 = 18 s into the 8 s backward: 10 s exposed
    it = iteration_time([_stage(*[(8, 1)] * 4)], _settings(1), UNIT)
    assert it.exposed_reduce_scatter_s == 10


def test_uniform_pipeline_is_1f1b():
    # P equal stages, no communication: (M + P − 1)(F + B), the textbook 1F1B span
    for pp, m in ((2, 1), (4, 4), (4, 8), (8, 3)):
        stages = [_stage((0, 2))] * pp
        it = iteration_time(stages, _settings(m, overlap_grad_reduce=False, overlap_param_gather=False), UNIT)
        assert it.pipeline_s == (m + pp - 1) * 6, (pp, m)
        assert it.compute_s == m * 6 and it.bubble_s == (pp - 1) * 6


def test_pipeline_wait_hides_a_later_stage_step():
    # two stages, F = 4 s each, no DDP bytes; stage 1's first micro-batch arrives 4 s in, so a
    # step of up to 4 s on stage 1 costs nothing, and one of 6 s costs 2
    for step, exposed in ((3, 0), (4, 0), (6, 2)):
        stages = [_stage((0, 4)), _stage((0, 4), step=step)]
        it = iteration_time(stages, _settings(3), UNIT)
        assert it.exposed_step_s == exposed and it.stages[1].exposed_step_s == exposed, step
    # on the first stage nothing waits: all of it shows
    it = iteration_time([_stage((0, 4), step=3), _stage((0, 4))], _settings(3), UNIT)
    assert it.exposed_step_s == 3 and it.stages[0].exposed_step_s == 3


def test_later_stage_reduces_in_the_time_its_last_backward_leaves():
    # stage 1 of 2 ends its last backward B0 = 8 s before stage 0 does; with --align-grad-reduce
    # it reduces everything after it: 6 s of reduce-scatter hide, 12 s expose 4
    for numel, exposed in ((12, 0), (24, 4)):
        stages = [_stage((0, 4)), _stage((numel, 4))]
        it = iteration_time(stages, _settings(2, overlap_param_gather=False), UNIT)
        assert it.exposed_reduce_scatter_s == exposed and it.stages[1].exposed_reduce_scatter_s == exposed


def test_first_all_gathers_line_up_along_the_pipeline():
    # four stages of one bucket (AG 2 s, F 4 s): with --overlap-param-gather each stage starts
    # gathering when its input arrives, so the four all-gathers add up (8 s), more than any stage
    # alone (2 s); gathered inside the step instead, the later stages' wait hides theirs (2 s)
    stages = [_stage((4, 4))] * 4
    overlapped = iteration_time(stages, _settings(4, overlap_grad_reduce=False), UNIT)
    assert overlapped.exposed_all_gather_s == 8
    assert all(s.exposed_all_gather_s == 2 for s in overlapped.stages)
    assert overlapped.iteration_s > max(s.iteration_s for s in overlapped.stages)
    in_step = iteration_time(stages, _settings(4, overlap_grad_reduce=False, overlap_param_gather=False), UNIT)
    assert in_step.exposed_all_gather_s == 2


def test_expert_buckets_gather_in_a_chain_of_their_own_on_the_shared_link():
    # Backprop order d0 (dense, 4 elements, forward 2 s), e0 (expert, 8, 3 s), d1 (dense, 2, 1 s);
    # M = 1, no step. Forward order d1, e0, d0, two chains: dense d1 -> d0, experts e0 alone.
    #   d1 gathered [0, 1], which dispatches d0 [1, 3]; d1's forward [1, 2]; e0, the expert
    #   chain's first, dispatched at 2, waits for the link, [3, 7]; e0's forward [7, 10]; d0's,
    #   gathered at 3, [10, 12]: first forward 12 of 6 computed, AG exposed 6.
    #   Backward [12, 24]: d0's grads at 16, reduced [16, 18]; e0's at 22, [22, 26]; d1's at 24,
    #   [26, 27]: RS exposed 3. Iteration 27 = 6 + 12 + 6 + 3.
    stage = Stage((Bucket(4, 2, 4), Bucket(8, 3, 6, expert=True), Bucket(2, 1, 2)), 0.0, 1, 1)
    it = iteration_time([stage], _settings(1, expert_dp_size=2), UNIT)
    assert (it.pipeline_s, it.exposed_all_gather_s, it.exposed_reduce_scatter_s, it.iteration_s) == (18, 6, 3, 27)
    # the same buckets all dense: one chain, e0 dispatched by d1's pre-hook [1, 5] behind nothing,
    # d0 by e0's [5, 7]: d1 [1, 2], e0 waits to 5, [5, 8], d0 [8, 10]: AG 4
    dense = Stage(tuple(dataclasses.replace(b, expert=False) for b in stage.buckets), 0.0, 1, 1)
    assert iteration_time([dense], _settings(1), UNIT).exposed_all_gather_s == 4


def test_expert_buckets_use_the_expert_dp_groups_link():
    # expert DP 4 across nodes at half the bandwidth: an expert bucket of 8 one-byte elements
    # moves 8 · 3/4 = 6 bytes in 12 s; the dense one (DP 2, in a node) 4 · 1/2 = 2 bytes in 2 s
    hw = dataclasses.replace(UNIT, inter_node_bandwidth=0.5)
    stage = Stage((Bucket(4, 1, 2), Bucket(8, 1, 2, expert=True)), 0.0, 1, 1)
    settings = _settings(1, expert_dp_size=4, expert_dp_spans_nodes=True)
    (st,) = iteration_time([stage], settings, hw).stages
    assert (st.reduce_scatter_s, st.all_gather_s) == (14, 14)


def test_token_all_to_alls_lengthen_forward_and_backward():
    stage = Stage((Bucket(2, 3, 6, token_exchange_s=0.5), Bucket(2, 1, 2)), 0.0, 1, 1)
    (st,) = iteration_time([stage], _settings(2), UNIT).stages
    assert (st.forward_s, st.backward_s, st.compute_s) == (4.5, 8.5, 26)


def test_iteration_never_below_compute_and_adds_up():
    rng = random.Random(42)
    for _ in range(60):
        pp, m = rng.randint(1, 5), rng.randint(1, 6)
        stages = [_stage(*[(rng.randint(0, 40), rng.uniform(0, 10)) for _ in range(rng.randint(1, 5))],
                         step=rng.uniform(0, 20)) for _ in range(pp)]
        flags = dict(overlap_grad_reduce=rng.random() < 0.5, overlap_param_gather=rng.random() < 0.5,
                     align_grad_reduce=rng.random() < 0.5)
        it = iteration_time(stages, _settings(m, **flags), UNIT)
        assert it.pipeline_s >= it.compute_s - _ROUNDING
        assert min(it.exposed_step_s, it.exposed_all_gather_s, it.exposed_reduce_scatter_s) >= -_ROUNDING
        parts = it.pipeline_s + it.exposed_step_s + it.exposed_all_gather_s + it.exposed_reduce_scatter_s
        assert parts == pytest.approx(it.iteration_s, abs=_ROUNDING)
        # the job is at least as slow as any stage alone
        assert it.iteration_s >= max(s.iteration_s for s in it.stages) - _ROUNDING


def test_flops():
    assert linear_flops(10, 3) == 60
    # 2 · b · s² · heads · head_dim / tp: causal QKᵀ and AV
    assert attention_flops(seq=4, micro_batch=2, heads=8, head_dim=16, tp=2) == 2 * 2 * 16 * 8 * 16 / 2
    # MLA: QKᵀ at 192 channels (128 + 64 RoPE), AV at 128: s² · (192 + 128) per head and sequence
    assert attention_flops(seq=4, micro_batch=2, heads=8, head_dim=192, tp=2, value_dim=128) == 2 * 16 * 8 * 320 / 2


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="no buckets"):
        Stage((), 0.0)
    with pytest.raises(ValueError, match="micro_batches 0"):
        IterationSettings(0, 2, False)
    with pytest.raises(ValueError, match="no stages"):
        iteration_time([], _settings(1), UNIT)
    with pytest.raises(ValueError, match="expert_dp_size 0"):
        IterationSettings(1, 2, False, expert_dp_size=0)
    with pytest.raises(ValueError, match="expected IterationSettings.expert_dp_size"):
        iteration_time([Stage((Bucket(2, 1, 2, expert=True),), 0.0)], _settings(1), UNIT)
