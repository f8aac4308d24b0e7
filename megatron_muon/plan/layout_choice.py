"""Which buffer layout a DDP buffer gets under ``--muon-dp-layout priced`` (the default): whole
matrices, megatron-core's own layout, or megatron-core's buckets cut at rows (issue 42, item 4).

The balanced layout (``balanced_layout``) keeps every Muon matrix whole on one DP rank, so the
optimizer's DP exchange moves nothing, but to do so a bucket stays open until it holds
``BUCKET_SPAN`` × DP × its largest matrix: at Llama-3 405B TP8 × PP16 × DP64 stage 0 that is one
bucket where megatron-core forms 22, and Megatron's grad reduce-scatter and param all-gather,
which overlap the backward and the next forward bucket by bucket, are exposed whole. The other
candidates cut matrices where megatron-core's buckets' shards fall, the cut ones sent to their DP
owner and back every step: megatron-core's own packing (``megatron_packing``), and
``row_aligned_layout``, the same buckets with every cut moved between two rows of its matrix
(which a MuonBP local block step and a resharded checkpoint read in whole rows, but which can cut
more matrices: 80 of 128 where megatron-core's cuts 65 at Llama-3 8B TP8 × DP8). Each is priced
in seconds on the hardware profile and the cheapest wins (ties in the order whole, megatron,
row-aligned: fewer bytes moved, then megatron-core's own layout; with ``LayoutPrice.whole_rows``,
``--muonbp-block local``, a candidate that cuts a row is priced but not chosen):

    price = exposed DDP communication of its buckets  +  the optimizer's Muon step on it

The step is the step plan's own price wherever the caller can describe the candidate's matrices
(``step_s``: ``build_step_plan`` on the matrices with the candidate's DP ranges, in the job's TP
mode, priced by ``pricing.plan_cost``; the adapter and ``stage_layouts`` do), so the layout is
chosen on the price the plan is built on. Without it (``LayoutPrice.tp_mode`` None, or a caller
with sizes only) two closed forms stand in: the DP exchange of what the layout cuts, and
Newton–Schulz on its busiest DP rank.

* **Exposed DDP**: ``plan.iteration`` on this buffer as a one-stage pipeline (its buckets, each
  bucket's forward and backward FLOPs per micro-batch at the profile's GEMM rate, M
  micro-batches, the DDP overlap flags): the exposed reduce-scatter and all-gather. That is
  exact, within the iteration model, for the first pipeline stage (the only one megatron-core
  buckets, and the one with no pipeline wait to hide them); a later stage has one bucket in
  either layout, and pricing it without its wait overstates what padding costs there.
* **DP exchange** (a closed form of ``pricing.dp_exchange`` and ``plan_cost``'s DP term): each
  matrix a shard boundary cuts goes to one DP owner, owners balanced by bytes, every other
  holder sending its piece and receiving the result back; the busiest rank's bytes (its busier
  direction) as one all-to-all each way on the DP link (``collective_time``), of which
  ``hw.comm_overlap`` hides under Newton–Schulz as in ``plan_cost``. The real owners are planned
  by NS FLOPs, not bytes; the first stage's step is exposed whole, so what is not hidden counts.
* **Newton–Schulz**: the DP owners of the layout (``owners.plan_owners`` on the items' NS FLOPs,
  a matrix lying wholly in one shard pinned there, a cut one preferring its largest piece's
  holder, as ``owners.dp_pins`` pins them), the busiest DP rank's FLOPs spread evenly over its
  ``tp`` TP ranks, at the profile's GEMM rate. The step runs it after the backward and before
  the next forward's all-gather, so none of it is hidden on the first stage. An even TP spread
  is the planner's best case (``auto`` spreads a DP rank's matrices over its TP ranks by FLOPs);
  every candidate is priced alike, so what it leaves out shifts them all.

Deterministic: every DP rank calls ``choose_layout`` on the same items and the same
``LayoutPrice`` (sizes, flags, one hardware profile) and gets the same layout; no process group.
Without a ``LayoutPrice`` (a Python API user wrapping DDP without Megatron's args: batch and
sequence unknown) the caller keeps the balanced layout as before (``megatron.layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..core.matrix_layout import MatrixLayout
from ..core.models import ModelShape
from ..core.newton_schulz import NSOptions
from .balanced_layout import DEFAULT_ALPHA, MAX_PADDING, BufferLayout, LayoutItem, balanced_layout, row_aligned_layout
from .cost_model import collective_time
from .hardware import Hardware
from .iteration import Bucket, IterationSettings, Stage, attention_flops, iteration_time, linear_flops
from .megatron_packing import megatron_packing
from .owners import plan_owners, rank_loads
from .pricing import plan_cost
from .step_plan import PlanSettings, build_step_plan
from .topology import Topology

__all__ = ["CHOICES", "ExpertRouting", "LayoutChoice", "LayoutPrice", "Priced", "choose_layout", "forward_flops",
           "job_price", "step_seconds"]

GLOBAL_BATCH_TOKENS = 4 * 2**20
"""``job_price``'s default global batch: 4M tokens (the iteration tables', docs/performance.md §12)."""

CHOICES = ("whole", "megatron", "row-aligned")
"""``LayoutChoice.chosen``, in the order ties go: the balanced layout, megatron-core's own, or
megatron-core's buckets cut at rows."""


@dataclass(frozen=True)
class LayoutPrice:
    """What the price of a buffer layout needs from the job, beyond the buffer itself."""

    micro_batches: int
    """M, micro-batches per iteration per DP replica (global batch / (DP × micro-batch size))."""
    tokens: int
    """tokens per micro-batch (sequence length × micro-batch size): a weight's linear FLOPs."""
    dp_spans_nodes: bool
    """whether the DP group crosses nodes (its link class)."""
    hardware: Hardware
    """the profile the seconds are priced on (``--muon-auto-hardware``'s)."""
    attention_flops: float = 0.0
    """forward FLOPs of one layer's attention core per micro-batch on one TP rank
    (``iteration.attention_flops``), charged to the layer's QKV weight; 0: not counted."""
    grad_bytes: int = 4
    """bytes per element reduce-scattered (4 with ``--grad-reduce-in-fp32``)."""
    param_bytes: int = 2
    """bytes per element all-gathered (the params' dtype)."""
    exchange_bytes: int = 2
    """bytes per element of the DP exchange (the NS dtype)."""
    tp: int = 1
    """TP ranks sharing each DP rank's Newton–Schulz (the NS term's divisor)."""
    tp_mode: str | None = None
    """the job's ``--muon-tp-mode``, which the step plan of each candidate is built in (``step_s``);
    None: the closed forms."""
    whole_rows: bool = False
    """every cut must fall between two rows of its matrix (``--muonbp-block local``: a block step
    orthogonalizes each DP rank's own rows, and a row cut in two would be a block of its own): a
    candidate that cuts a row (megatron-core's packing; the row-aligned one where its buckets are
    too small to round every shard to the rows) is priced but not chosen, and whole matrices are
    kept where every candidate does."""
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.tokens < 1 or self.tp < 1:
            raise ValueError(f"LayoutPrice: micro_batches {self.micro_batches}, tokens {self.tokens}, tp {self.tp}; "
                             "expected >= 1")

    def for_experts(self, routing: ExpertRouting, *, expert_tp: int, dp_spans_nodes: bool) -> LayoutPrice:
        """The price of the stage's expert-parallel buffer, from the job's: an expert weight's FLOPs
        at the tokens one expert sees per micro-batch on average (``routing.tokens_per_expert`` of
        the tokens one EP rank routes: its expert-TP group's, each TP rank holding 1/TP of the
        micro-batch's under sequence parallelism, so ``tokens`` × expert TP / TP), no attention
        core, its Newton–Schulz over expert TP, its links over the expert-DP group
        (``dp_spans_nodes``: that group's node span, which strides by EP × expert TP).

        The buffer is priced alone, as a one-stage pipeline of its own buckets: the dense layers'
        backward, which runs between two experts' buckets too and can hide their reduce-scatter,
        is left out, as is the dense buckets' traffic on the same links. Both act on every
        candidate; the first makes a many-bucket candidate look less overlapped than it is."""
        routed = max(1, self.tokens * expert_tp // self.tp)
        return replace(self, tokens=routing.tokens_per_expert(routed), attention_flops=0.0, tp=expert_tp,
                       dp_spans_nodes=dp_spans_nodes)


@dataclass(frozen=True)
class ExpertRouting:
    """How a job routes its tokens to experts (what an expert weight's FLOPs depend on)."""

    num_experts: int
    """``--num-experts``, over the whole EP group."""
    topk: int
    """``--moe-router-topk``: experts each token goes to."""
    ep: int
    """``--expert-model-parallel-size``: EP ranks whose tokens one expert receives."""

    def __post_init__(self) -> None:
        if min(self.num_experts, self.topk, self.ep) < 1 or self.topk > self.num_experts:
            raise ValueError(f"ExpertRouting: num_experts {self.num_experts}, topk {self.topk}, ep {self.ep}; "
                             "expected >= 1 and topk <= num_experts")

    def tokens_per_expert(self, tokens: int) -> int:
        """Tokens one expert sees per micro-batch on average, ``tokens`` per EP rank: EP × tokens × topk
        routed assignments over ``num_experts`` experts (a balanced router's mean; at least 1)."""
        return max(1, round(self.ep * tokens * self.topk / self.num_experts))


@dataclass(frozen=True)
class Priced:
    """One candidate layout's price."""

    buckets: int
    exposed_ddp_s: float
    """exposed reduce-scatter + all-gather of its buckets (``plan.iteration``, one stage)."""
    exchange_s: float
    """the DP exchange of the matrices it cuts (0 for whole matrices)."""
    ns_s: float = 0.0
    """Newton–Schulz on the busiest DP rank (its FLOPs over ``tp`` ranks at the GEMM rate)."""
    step_s: float | None = None
    """the step plan's price of the Muon step on this layout (``choose_layout``'s ``step_s``); None:
    the two closed forms above stand for it."""

    @property
    def optimizer_s(self) -> float:
        """the Muon step's seconds the choice counts: the plan's price, else the closed forms'."""
        return self.step_s if self.step_s is not None else self.exchange_s + self.ns_s

    @property
    def total_s(self) -> float:
        return self.exposed_ddp_s + self.optimizer_s


@dataclass(frozen=True)
class LayoutChoice:
    """The chosen layout of one buffer and what decided it."""

    layout: BufferLayout
    chosen: str
    """one of ``CHOICES``."""
    whole: Priced
    row_aligned: Priced
    megatron: Priced
    """megatron-core's own layout (``megatron_packing``)."""
    price: LayoutPrice
    """what it was priced on."""

    @property
    def priced(self) -> Priced:
        """the chosen candidate's price."""
        return {"whole": self.whole, "megatron": self.megatron, "row-aligned": self.row_aligned}[self.chosen]


def forward_flops(name: str, numel: int, ndim: int, price: LayoutPrice) -> float:
    """Forward FLOPs per micro-batch of one param: a weight (2-D or more, not an embedding, which
    is a lookup) its linear FLOPs, a QKV weight (MLA: the key/value up-projection) its layer's
    attention core too; norms and biases none. Backward is twice this (``iteration.linear_flops``)."""
    if ndim < 2 or "embedding" in name:
        return 0.0
    flops = linear_flops(numel, price.tokens)
    return flops + price.attention_flops if name.endswith(_ATTENTION_WEIGHTS) else flops


_ATTENTION_WEIGHTS = ("linear_qkv.weight", "linear_kv_up_proj.weight")
"""the one weight per attention layer its core's FLOPs are charged to: GQA's QKV, MLA's key/value
up-projection (every MLA layer has one, with or without a query LoRA)."""


def job_price(shape: ModelShape, tp: int, dp: int, hw: Hardware, *, seq: int = 8192, micro_batch: int = 1,
              global_batch_tokens: int = GLOBAL_BATCH_TOKENS, ranks_per_node: int | None = None,
              overlap_param_gather: bool = True, tp_mode: str | None = None,
              whole_rows: bool = False) -> LayoutPrice:
    """The ``LayoutPrice`` of a planned job (the dry run, the iteration tables, the cost model):
    ``shape`` at TP × DP on ``hw``, the DP group on Megatron's default rank order
    (``Topology.contiguous``, ``ranks_per_node`` or the profile's), fp32 grad reduction, bf16
    params and NS, ``--overlap-grad-reduce``; ``tp_mode`` and ``whole_rows``: the job's
    (``LayoutPrice``'s fields)."""
    # a batch too small for DP x micro-batch still runs one micro-batch per replica (a planning tool's
    # very wide DP); Megatron itself would refuse it
    micro_batches = max(1, global_batch_tokens // seq // (dp * micro_batch))
    topology = Topology.contiguous(dp, tp, ranks_per_node or hw.ranks_per_node)
    m = shape.mla  # MLA: QKᵀ over a head's no-RoPE and RoPE channels, AV over its value channels
    qk, v = (shape.head_dim, None) if m is None else (m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim)
    return LayoutPrice(micro_batches, seq * micro_batch, topology.dp_spans_nodes, hw,
                       attention_flops(seq, micro_batch, shape.num_heads, qk, tp, value_dim=v),
                       tp=tp, tp_mode=tp_mode, whole_rows=whole_rows, overlap_param_gather=overlap_param_gather)


def choose_layout(items: Sequence[LayoutItem], flops: Sequence[float], dp_size: int, bucket_numel: int | None,
                  price: LayoutPrice, *, alpha: float = DEFAULT_ALPHA, shard_divisor: int = 128,
                  max_padding: float = MAX_PADDING, bucket_divisor: int | None = None,
                  step_s: Callable[[BufferLayout], float] | None = None) -> LayoutChoice:
    """The cheapest of the balanced, megatron-core's and the row-aligned layout of one buffer
    (module docstring).

    ``items`` and the keyword arguments but the last are ``balanced_layout``'s; ``flops``: per
    item (same order) its forward FLOPs per micro-batch (``forward_flops``); ``bucket_numel``:
    megatron-core's bucket size (None: one bucket); ``bucket_divisor``: megatron-core's bucket-end
    padding (``megatron_packing``'s); ``step_s``: the Muon step's seconds on a candidate layout
    (``step_seconds`` on its matrices; None: the closed forms)."""
    if len(flops) != len(items):
        raise ValueError(f"choose_layout: {len(flops)} FLOP counts for {len(items)} items; expected one per item")
    whole = balanced_layout(items, dp_size, bucket_numel, alpha=alpha, shard_divisor=shard_divisor,
                            max_padding=max_padding)
    cut = row_aligned_layout(items, dp_size, bucket_numel, shard_divisor=shard_divisor)
    packed = megatron_packing([it.numel for it in items], [it.own_bucket for it in items], dp_size, bucket_numel,
                              bucket_divisor)
    layouts = {"whole": whole, "megatron": packed, "row-aligned": cut}
    prices = {name: Priced(len(lay.buckets), _exposed_ddp_s(lay, flops, price), _exchange_s(items, lay, price),
                           _ns_s(items, lay, price), None if step_s is None else step_s(lay))
              for name, lay in layouts.items()}
    # min keeps the first of equal totals: CHOICES' order
    allowed = [name for name in CHOICES if not price.whole_rows or _cuts_between_rows(items, layouts[name])]
    chosen = min(allowed or ["whole"], key=lambda name: prices[name].total_s)
    return LayoutChoice(layouts[chosen], chosen, prices["whole"], prices["row-aligned"], prices["megatron"], price)


def step_seconds(matrices: Sequence[MatrixLayout], dp_size: int, price: LayoutPrice, ns: NSOptions) -> float:
    """The Muon step's seconds on the busiest rank of a candidate layout: the step plan of its
    ``matrices`` (with the candidate's DP ranges) in ``price.tp_mode``, as the optimizer would
    build it, priced by ``pricing.plan_cost`` on ``price.hardware``."""
    if price.tp_mode is None:
        raise ValueError("step_seconds: the LayoutPrice has no tp_mode (the step plan's --muon-tp-mode)")
    settings = PlanSettings(price.tp_mode, ns, hardware=price.hardware)
    plan = build_step_plan(matrices, dp_size=dp_size, tp_size=price.tp, settings=settings)
    return plan_cost(plan, price.hardware).total_s


def _exposed_ddp_s(layout: BufferLayout, flops: Sequence[float], price: LayoutPrice) -> float:
    forward = [0.0] * len(layout.buckets)
    for (_, _, b), f in zip(layout.ranges, flops):
        forward[b] += f
    # DDP's buckets in its order, which is the layout's: backprop order
    buckets = tuple(Bucket(end - start, f, 2 * f) for (start, end), f in zip(layout.buckets, forward))
    settings = IterationSettings(price.micro_batches, layout.dp_size, price.dp_spans_nodes,
                                 price.overlap_grad_reduce, price.overlap_param_gather)
    stage = Stage(buckets, 0.0, price.grad_bytes, price.param_bytes)
    return iteration_time([stage], settings, price.hardware).exposed_ddp_s


def _exchange_s(items: Sequence[LayoutItem], layout: BufferLayout, price: LayoutPrice) -> float:
    """The busiest DP rank's exposed seconds of the exchange of ``layout``'s cut matrices: owners
    balanced by bytes (largest matrix first, to the rank whose link gains least: LPT, ties to the
    lowest rank), each holder's piece to the owner and the result back, as one all-to-all each way;
    ``hw.comm_overlap`` of it hidden under Newton–Schulz, as ``pricing.plan_cost`` hides the owner
    pipeline's communication (a cut matrix's NS outlasts its exchange many times at these sizes)."""
    dp = layout.dp_size
    link = [0] * dp  # elements over each rank's busier direction
    cut = [i for i, it in enumerate(items) if it.whole and layout.holder(i) is None]
    for i in sorted(cut, key=lambda i: (-items[i].numel, i)):
        pieces = _pieces(layout, i)
        numel = sum(pieces.values())
        owner = min(range(dp), key=lambda r: (link[r] + numel - pieces.get(r, 0), r))
        for r, n in pieces.items():
            if r != owner:
                link[r] += n  # sends its piece, receives the result: n each way
                link[owner] += n
    busiest = max(link, default=0) * price.exchange_bytes
    if not busiest:
        return 0.0
    hw = price.hardware
    return (1 - hw.comm_overlap) * collective_time("all_to_all", busiest, 2, dp, hw, price.dp_spans_nodes)


def _ns_s(items: Sequence[LayoutItem], layout: BufferLayout, price: LayoutPrice) -> float:
    """Seconds of Newton–Schulz on the busiest DP rank of ``layout`` (module docstring)."""
    muon = [i for i, it in enumerate(items) if it.whole]
    fixed, prefer = {}, []
    for k, i in enumerate(muon):
        holder = layout.holder(i)
        if holder is not None:
            fixed[k] = holder
        pieces = _pieces(layout, i)
        prefer.append(max(pieces, key=lambda r: (pieces[r], -r)) if pieces else None)
    costs = [items[i].ns_flops for i in muon]
    loads = rank_loads(costs, plan_owners(costs, layout.dp_size, fixed=fixed, prefer=prefer), layout.dp_size)
    return max(loads, default=0.0) / (price.tp * price.hardware.matmul_flops)


def _cuts_between_rows(items: Sequence[LayoutItem], layout: BufferLayout) -> bool:
    """Whether every shard boundary inside a Muon matrix of ``layout`` falls between two of its rows."""
    for i, it in enumerate(items):
        if not it.whole or not it.row:
            continue
        start, end, b = layout.ranges[i]
        bucket_start, bucket_end = layout.buckets[b]
        shard = (bucket_end - bucket_start) // layout.dp_size
        first = bucket_start + ((start - bucket_start) // shard + 1) * shard
        if any((boundary - start) % it.row for boundary in range(first, end, shard)):
            return False
    return True


def _pieces(layout: BufferLayout, i: int) -> dict[int, int]:
    """DP rank → elements of item ``i`` its shard holds (ranks holding none left out)."""
    start, end, b = layout.ranges[i]
    bucket_start, bucket_end = layout.buckets[b]
    shard = (bucket_end - bucket_start) // layout.dp_size
    out = {}
    for r in range((start - bucket_start) // shard, (end - 1 - bucket_start) // shard + 1):
        lo, hi = max(start, bucket_start + r * shard), min(end, bucket_start + (r + 1) * shard)
        if hi > lo:
            out[r] = hi - lo
    return out
