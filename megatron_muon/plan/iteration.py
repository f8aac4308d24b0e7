"""Predicted time of one training iteration: the pipeline's compute, Megatron's DDP communication
and the optimizer step, per pipeline stage and for the job.

Pure (no torch, no Megatron): the caller describes each stage by its DDP buckets (numel, and the
forward / backward FLOPs of the params each holds, ``linear_flops`` / ``attention_flops``) and its
optimizer step's seconds (``step_cost.optimizer_step_cost(...).total_s`` without Megatron's param
all-gather, which this model prices itself); ``scripts/bench/iteration_table.py`` reads the
buckets of the real DDP. ``docs/performance.md`` ("The iteration") has the numbers.

What runs when, as megatron-core 0.19.2 runs a non-interleaved 1F1B pipeline with the
distributed optimizer (``--overlap-grad-reduce --overlap-param-gather``, the defaults of
``--align-grad-reduce``; ``align_param_gather`` is forced off without virtual stages):

* **Time origin**: the optimizer step's global grad-norm all-reduce (``clip_grad``, over every
  rank): every stage leaves it together, so one iteration is the time from one to the next. The
  whole step is counted after it (its norm pass before it is a few elementwise reads).
* **Optimizer step**: stage s runs its own step (``Stage.step_s``) from the origin. Nothing of
  Megatron's overlaps it.
* **Param all-gather** (``--overlap-param-gather``): the step leaves it to the next forward.
  The first bucket group's all-gather is dispatched by the first forward pre-hook, that is when
  the stage's first micro-batch starts (after its input arrived: a stage's pipeline wait does not
  hide it), and each pre-hook that waits for group k dispatches group k + 1's. So group k + 1's
  all-gather overlaps the forward of group k only, and the first one is exposed on every stage;
  groups are gathered in forward order, the reverse of DDP's bucket order. Only the first
  micro-batch's forward waits (later ones find the params gathered). Without the flag: every
  bucket is all-gathered inside the step, after the update, and the stage's pipeline wait can
  hide it.
* **Grad reduce-scatter** (``--overlap-grad-reduce``): DDP reduces only in the last micro-batch
  (``no_sync`` before it). On the first stage (and on every stage with ``align_grad_reduce``
  off) bucket k's reduce-scatter starts once the last backward has produced all of bucket k's
  grads (buckets are in backprop order, each covering its params' share of the backward), and
  runs on the DP link after bucket k − 1's; what outlasts the backward is the tail. A later
  stage reduces all its buckets after its last backward (``grad_sync_func``: "other pipeline
  stages do grad reduction during pipeline bubble"), in the time its last backward leaves before
  the first stage's ends. Without the flag: every stage reduces after its last backward.
* **Pipeline**: 1F1B as ``forward_backward_pipelining_without_interleaving`` orders it (stage s:
  min(P − 1 − s, M) warm-up forwards, then one forward and one backward per micro-batch, then the
  cool-down backwards); forward m on stage s starts after forward m on s − 1 and backward m after
  backward m on s + 1 (P2P time is not counted). The schedule is simulated event by event, so
  stages of unequal compute (the first with the embedding, the last with the output layer) are
  exact within this model. Stage s's first forward waits about s forwards for its input, which
  hides its step (and, without ``--overlap-param-gather``, its all-gather) up to that wait; its
  last backward ends about s backwards before the first stage's, which hides its reduce-scatter
  up to that.
* **Compute**: FLOPs at ``Hardware.matmul_flops`` (the sustained GEMM rate of the profile, the
  same one Newton–Schulz is priced at): linear layers 2·numel·tokens forward and twice that
  backward, causal attention ``attention_flops``; no activation recomputation, no TP
  communication in the layers, no kernel overheads. Real layers run below that rate, so the
  compute here is a lower bound and the exposed communication an upper bound.
* **Experts** (a stage with an expert-parallel buffer): megatron-core keeps the experts' buckets
  in a DDP buffer of their own, reduced and gathered over the expert-DP group, with its own
  chain of param all-gathers (its first group gathered when the forward first reaches an expert,
  each then dispatching the next expert group). The caller merges both buffers' buckets in
  backprop order; an MoE layer's token all-to-alls (dispatch and combine) lengthen its forward
  and its backward, on the critical path (``Bucket.token_exchange_s``).
* **Links**: a bucket's reduce-scatter and all-gather move (DP − 1)/DP of its bytes (grad dtype,
  param dtype) per rank, priced as ``cost_model.collective_time``'s all-gather (a ring; the
  reduce-scatter is its mirror) on its DP group's link class (``dp_spans_nodes``, the expert
  buckets' ``expert_dp_spans_nodes``); the link is serial, one collective at a time, both
  buffers' collectives sharing it, and the reduce-scatters and all-gathers never meet (the
  former end before the step, the latter start after it). The token all-to-alls are taken as
  compute: what they share of a link with the DP collectives is not counted.

The iteration and what it exposes. With every stage's step, all-gather and reduce-scatter at
zero the simulation gives the pure pipeline (``pipeline_s``: compute plus bubble). Adding the
steps, then the all-gathers, then the reduce-scatters gives ``exposed_step_s``,
``exposed_all_gather_s`` and ``exposed_reduce_scatter_s`` as the three increments, so
``pipeline_s`` plus the three is ``iteration_s`` exactly. Per stage, the same increments with only
that stage's terms switched on: what the stage alone would cost the job. Since the iteration is
the time of the last stage to reach the next grad-norm all-reduce, and a stage's delay reaches
every stage after it along the pipeline, the iteration is at least the largest of the stages'
own (max over stages of compute + bubble + exposed DDP + exposed step); it is more where the
delays add along the pipeline: each stage's first all-gather starts when its input arrives, so
the first buckets' all-gathers of all stages line up one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import collective_time
from .hardware import Hardware

__all__ = ["Bucket", "Iteration", "IterationSettings", "Stage", "StageTime", "attention_flops", "iteration_time",
           "linear_flops"]


def linear_flops(numel: int, tokens: int) -> float:
    """Forward FLOPs of a linear layer's weight of ``numel`` elements on ``tokens`` tokens (one
    multiply-add per weight per token); its backward (input and weight grads) is twice this."""
    return 2.0 * numel * tokens


def attention_flops(seq: int, micro_batch: int, heads: int, head_dim: int, tp: int,
                    value_dim: int | None = None) -> float:
    """Forward FLOPs of one layer's causal attention core on one TP rank: QKᵀ (2·s²·``head_dim``)
    and AV (2·s²·``value_dim``, default ``head_dim``; MLA's query/key heads are wider than its
    value heads) for each of the ``heads / tp`` heads, halved by the causal mask (flash attention
    skips the masked blocks); its backward is priced at twice this."""
    value_dim = head_dim if value_dim is None else value_dim
    return 1.0 * micro_batch * seq * seq * heads * (head_dim + value_dim) / tp


@dataclass(frozen=True)
class Bucket:
    """One DDP bucket (group) of a stage, as one TP rank holds it."""

    numel: int
    """elements of the bucket's buffer, padding included: what its reduce-scatter and all-gather move."""
    forward_flops: float
    """forward FLOPs per micro-batch of the layers whose params the bucket holds."""
    backward_flops: float
    """backward FLOPs per micro-batch of the same layers."""
    expert: bool = False
    """a bucket of the expert-parallel buffer: reduced and gathered over the expert-DP group
    (``IterationSettings.expert_dp_size``), its param all-gathers chained apart from the dense
    buffer's (megatron-core links each buffer's bucket groups into a chain of its own)."""
    token_exchange_s: float = 0.0
    """seconds per micro-batch of the MoE token all-to-alls in the bucket's layers (dispatch and
    combine), on the layers' critical path in the forward and again in the backward (megatron-core
    0.19.2 without ``--overlap-moe-expert-parallel-comm`` waits for each)."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its buckets and its optimizer step."""

    buckets: tuple[Bucket, ...]
    """in DDP's order, which is backprop order: bucket 0's grads are produced first."""
    step_s: float
    """seconds of the stage's optimizer step, Megatron's param all-gather excluded (priced here)."""
    grad_bytes: int = 4
    """bytes per element reduce-scattered (4: ``--grad-reduce-in-fp32``, the DDP default of a large run)."""
    param_bytes: int = 2
    """bytes per element all-gathered (the model params' dtype: 2 for bf16)."""

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("Stage: no buckets; a stage's DDP holds at least one")
        if self.step_s < 0 or min(self.grad_bytes, self.param_bytes) < 1:
            raise ValueError(f"Stage: step_s {self.step_s}, grad_bytes {self.grad_bytes}, param_bytes "
                             f"{self.param_bytes}; expected step_s >= 0 and whole bytes >= 1")


@dataclass(frozen=True)
class IterationSettings:
    """The schedule and Megatron's DDP flags of one iteration."""

    micro_batches: int
    """M, micro-batches per iteration on each DP replica (global batch / (DP × micro-batch size))."""
    dp_size: int
    """ranks of the DP group the buckets are reduced over."""
    dp_spans_nodes: bool
    """whether the DP group crosses nodes (its link: ``Hardware.inter_node_bandwidth``)."""
    overlap_grad_reduce: bool = True
    """``--overlap-grad-reduce``."""
    overlap_param_gather: bool = True
    """``--overlap-param-gather``."""
    align_grad_reduce: bool = True
    """Megatron's ``--align-grad-reduce`` (on by default): a stage after the first reduces its grads
    after its last backward instead of bucket by bucket during it."""
    expert_dp_size: int | None = None
    """ranks of the expert-DP group the expert buckets are reduced over; None: no expert buckets."""
    expert_dp_spans_nodes: bool = False
    """whether the expert-DP group crosses nodes (it strides by EP × expert TP)."""

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.dp_size < 1 or (self.expert_dp_size is not None and self.expert_dp_size < 1):
            raise ValueError(f"IterationSettings: micro_batches {self.micro_batches}, dp_size {self.dp_size}, "
                             f"expert_dp_size {self.expert_dp_size}; expected >= 1 (expert_dp_size: or None)")


@dataclass(frozen=True)
class StageTime:
    """One stage's figures; the exposed ones are what this stage alone adds to the iteration."""

    forward_s: float
    """one micro-batch's forward, all-gathers not waited for."""
    backward_s: float
    """one micro-batch's backward."""
    compute_s: float
    """M × (forward + backward)."""
    reduce_scatter_s: float
    """the DP link's time of all its buckets' reduce-scatters."""
    all_gather_s: float
    """the DP link's time of all its buckets' param all-gathers."""
    exposed_step_s: float
    exposed_all_gather_s: float
    exposed_reduce_scatter_s: float
    iteration_s: float
    """the iteration if every other stage exposed nothing: pipeline + this stage's three."""


@dataclass(frozen=True)
class Iteration:
    """The job's iteration: ``pipeline_s + exposed_step_s + exposed_all_gather_s +
    exposed_reduce_scatter_s == iteration_s``."""

    stages: tuple[StageTime, ...]
    pipeline_s: float
    """compute and bubble alone: the iteration with no step and no DDP communication."""
    compute_s: float
    """the busiest stage's compute (M × its forward + backward); ``pipeline_s − compute_s`` is its bubble."""
    exposed_step_s: float
    exposed_all_gather_s: float
    exposed_reduce_scatter_s: float
    iteration_s: float

    @property
    def exposed_ddp_s(self) -> float:
        """Megatron's DDP communication on the critical path: reduce-scatter and param all-gather."""
        return self.exposed_all_gather_s + self.exposed_reduce_scatter_s

    @property
    def bubble_s(self) -> float:
        return self.pipeline_s - self.compute_s


@dataclass(frozen=True)
class _Timed:
    """A stage in seconds: forward / backward per micro-batch and per bucket, link times per bucket."""

    forward: float
    backward: float
    bucket_forward: tuple[float, ...]
    bucket_backward: tuple[float, ...]
    reduce_scatter: tuple[float, ...]
    all_gather: tuple[float, ...]
    step: float
    expert: tuple[bool, ...]


@dataclass(frozen=True)
class _Switches:
    """Which stages' terms are on in one simulation (a frozenset of stage indices each)."""

    step: frozenset[int] = frozenset()
    all_gather: frozenset[int] = frozenset()
    reduce_scatter: frozenset[int] = frozenset()


def _timed(stage: Stage, settings: IterationSettings, hw: Hardware) -> _Timed:
    if any(b.expert for b in stage.buckets) and settings.expert_dp_size is None:
        raise ValueError("iteration_time: a stage has expert buckets; expected IterationSettings.expert_dp_size")

    def link(nbytes: float, expert: bool) -> float:
        dp, spans = ((settings.expert_dp_size, settings.expert_dp_spans_nodes) if expert
                     else (settings.dp_size, settings.dp_spans_nodes))
        return collective_time("all_gather", nbytes * (dp - 1) / dp, 1, dp, hw, spans)

    fwd = tuple(b.forward_flops / hw.matmul_flops + b.token_exchange_s for b in stage.buckets)
    bwd = tuple(b.backward_flops / hw.matmul_flops + b.token_exchange_s for b in stage.buckets)
    return _Timed(sum(fwd), sum(bwd), fwd, bwd,
                  tuple(link(b.numel * stage.grad_bytes, b.expert) for b in stage.buckets),
                  tuple(link(b.numel * stage.param_bytes, b.expert) for b in stage.buckets), stage.step_s,
                  tuple(b.expert for b in stage.buckets))


def _first_forward(t: _Timed) -> float:
    """The first micro-batch's forward with ``--overlap-param-gather``: each buffer's (dense,
    experts) first group all-gathered when the forward first reaches it, then each group's
    forward while the next group of the same buffer is gathered (dispatched when the forward
    enters the group), waiting where the all-gather is the longer; the all-gathers of both
    buffers take turns on the one link."""
    order = range(len(t.bucket_forward) - 1, -1, -1)  # groups in forward order: DDP's buckets reversed
    following = {}
    for expert in (False, True):
        chain = [k for k in order if t.expert[k] == expert]
        following.update(zip(chain, chain[1:]))
    gathered: dict[int, float] = {}
    link = clock = 0.0

    def dispatch(k: int) -> None:
        nonlocal link
        link = gathered[k] = max(link, clock) + t.all_gather[k]

    for k in order:
        if k not in gathered:
            dispatch(k)
        clock = max(clock, gathered[k])
        if k in following and following[k] not in gathered:
            dispatch(following[k])
        clock += t.bucket_forward[k]
    return clock


def _schedule(stages: Sequence[_Timed], micro_batches: int, ready: Sequence[float],
              first_forward: Sequence[float]) -> list[tuple[float, float]]:
    """Simulate 1F1B: stage s starts no earlier than ``ready[s]``, its first forward takes
    ``first_forward[s]``; returns each stage's last backward as (start, end)."""
    pp, m = len(stages), micro_batches
    orders = []
    for s in range(pp):
        warmup = min(pp - 1 - s, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        orders.append(order + [("B", i) for i in range(m - warmup, m)])
    done: dict[tuple[str, int, int], float] = {}
    clock = list(ready)
    cursor = [0] * pp
    last: list[tuple[float, float]] = [(0.0, 0.0)] * pp
    while any(cursor[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                # forward i needs stage s − 1's forward i; backward i needs stage s + 1's backward i
                # (the last stage's backward i follows its own forward i, earlier in its order)
                dep = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i)
                if (kind == "F" and s == 0) or (kind == "B" and s == pp - 1):
                    dep_end = 0.0
                elif dep in done:
                    dep_end = done[dep]
                else:
                    break
                start = max(clock[s], dep_end)
                if kind == "F":
                    length = first_forward[s] if i == 0 else stages[s].forward
                else:
                    length = stages[s].backward
                clock[s] = done[(kind, s, i)] = start + length
                if kind == "B" and i == m - 1:
                    last[s] = (start, clock[s])
                cursor[s] += 1
                progressed = True
        if not progressed:  # 1F1B's order cannot deadlock; this guards the simulation itself
            raise RuntimeError("iteration_time: the 1F1B simulation made no progress")
    return last


def _reduced(t: _Timed, backward: tuple[float, float], during: bool) -> float:
    """When stage ``t``'s last reduce-scatter ends, its last backward spanning ``backward``;
    ``during``: bucket by bucket as the backward produces them, else all after it."""
    start, end = backward
    if not during:
        return end + sum(t.reduce_scatter)
    link = start
    produced = start
    for compute, rs in zip(t.bucket_backward, t.reduce_scatter):
        produced += compute
        link = max(link, produced) + rs
    return max(end, link)


def _simulate(stages: Sequence[_Timed], settings: IterationSettings, on: _Switches) -> float:
    """Seconds from one grad-norm all-reduce to the next, with ``on``'s terms."""
    ready, first = [], []
    for s, t in enumerate(stages):
        step = t.step if s in on.step else 0.0
        gather = s in on.all_gather
        if settings.overlap_param_gather:
            ready.append(step)
            first.append(_first_forward(t) if gather else t.forward)
        else:
            ready.append(step + (sum(t.all_gather) if gather else 0.0))
            first.append(t.forward)
    last = _schedule(stages, settings.micro_batches, ready, first)
    ends = []
    for s, t in enumerate(stages):
        if s not in on.reduce_scatter:
            ends.append(last[s][1])
            continue
        during = settings.overlap_grad_reduce and (s == 0 or not settings.align_grad_reduce)
        ends.append(_reduced(t, last[s], during))
    return max(ends)


def _increments(stages: Sequence[_Timed], settings: IterationSettings, which: frozenset[int],
                pipeline: float) -> tuple[float, float, float, float]:
    """(exposed step, all-gather, reduce-scatter, iteration) with the terms of ``which`` switched
    on one after another: step, then all-gather, then reduce-scatter."""
    with_step = _simulate(stages, settings, _Switches(step=which))
    with_gather = _simulate(stages, settings, _Switches(step=which, all_gather=which))
    full = _simulate(stages, settings, _Switches(step=which, all_gather=which, reduce_scatter=which))
    return with_step - pipeline, with_gather - with_step, full - with_gather, full


def iteration_time(stages: Sequence[Stage], settings: IterationSettings, hw: Hardware) -> Iteration:
    """The iteration of a pipeline of ``stages`` (stage 0 first; one entry per stage, so a
    16-stage pipeline passes 16), each DP replica running ``settings.micro_batches`` micro-batches.
    The module docstring states the model."""
    if not stages:
        raise ValueError("iteration_time: no stages; expected one Stage per pipeline stage")
    timed = [_timed(s, settings, hw) for s in stages]
    pipeline = _simulate(timed, settings, _Switches())
    per_stage = []
    for s, t in enumerate(timed):
        step, gather, reduce, alone = _increments(timed, settings, frozenset([s]), pipeline)
        per_stage.append(StageTime(t.forward, t.backward, settings.micro_batches * (t.forward + t.backward),
                                   sum(t.reduce_scatter), sum(t.all_gather), step, gather, reduce, alone))
    step, gather, reduce, full = _increments(timed, settings, frozenset(range(len(timed))), pipeline)
    return Iteration(tuple(per_stage), pipeline, max(s.compute_s for s in per_stage), step, gather, reduce, full)

