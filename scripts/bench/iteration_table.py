"""The iteration tables: the real DDP's buckets, priced over a whole training iteration.

    python -m scripts.bench.iteration_table --model llama3-405b --tp 8 --pp 16 --dp 64
    python -m scripts.bench.iteration_table --model llama3-70b --tp 8 --dp 8
    python -m scripts.bench.iteration_table --model llama3-8b --tp 8 --dp 8
    python -m scripts.bench.iteration_table --model llama3-405b --tp 8 --pp 16 --dp 64 --no-overlap-param-gather
    python -m scripts.bench.iteration_table --model deepseek-v3 --tp 1 --ep 8 --pp 16 --dp 64
    python -m scripts.bench.iteration_table --model mixtral-8x7b --tp 2 --ep 8 --etp 1 --dp 64

For each buffer layout (megatron-core's, ``--muon-dp-layout megatron``, and ours, ``balanced``)
it builds the stages' model, DDP and optimizer on the meta device the way ``scripts/dry_run.py``'s
``build_rank`` does (its function, called here; megatron-core's GPTModel, bf16, the fake process
group) and reads the DDP's buckets: each bucket's numel (padding included) and the params it
holds; with experts (``--ep``, ``--etp``) both of its buffers, the expert buckets reduced over
the expert-DP group and merged with the dense ones in backprop order, and each MoE layer's
token all-to-alls over EP (``Layout.token_exchange_s``). A pipeline's stages are built once
each of the first, a middle one (stage 1: every middle stage holds the same layers) and the
last. Each bucket's compute is the FLOPs per micro-batch of the params it spans
(``layout_choice.forward_flops``: 2·numel·tokens forward for a weight, a routed expert's at the
tokens one expert sees, the embedding a lookup; the attention core with each layer's QKV or
MLA's key/value up-projection), backward twice the forward.

The optimizer step's seconds are the cost model's (``step_cost.optimizer_step_cost`` on each
stage's weights, h100-sxm): Adam's distributed optimizer on megatron-core's layout, and ours on
each layout; Megatron's param all-gather, which the cost model counts in the step, is taken out
(``plan.iteration`` prices it with the buckets). Rows: Adam on megatron-core's layout; Muon with
the default flags (``--muon-dp-layout priced``: the layout ``plan.layout_choice`` chooses on the
dry run's price, ``--muon-tp-mode auto``; ``--dp-layout`` and ``--tp-mode`` change them); and
Muon at ``--muon-dp-layout megatron --muon-tp-mode owner``, the plan the default must never
predict slower than (issue 42, item 6); columns: buckets (first / last stage), the exposed
reduce-scatter, all-gather and step, the iteration, and Muon against Adam. The global batch
(default 4M tokens of 8192-token sequences) gives M = batch / (DP × micro-batch) micro-batches
per iteration.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as scripts/dry_run.py: Megatron's CUDA-isms take the meta path

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from megatron_muon.config import MuonConfig
from megatron_muon.core.models import ModelShape
from megatron_muon.plan.cost_model import collective_time
from megatron_muon.plan.hardware import GPU_PROFILES, Hardware
from megatron_muon.plan.iteration import (
    Bucket,
    Iteration,
    IterationSettings,
    Stage,
    iteration_time,
)
from megatron_muon.plan.layout_choice import ExpertRouting, LayoutPrice, job_price
from megatron_muon.plan.stage_params import StageGrid, group_topology
from megatron_muon.plan.step_cost import optimizer_step_cost
from megatron_muon.plan.topology import Topology

OURS_LAYOUTS = ("balanced", "priced")
BASELINE = ("megatron", "owner")
"""the third row's ``--muon-dp-layout`` and ``--muon-tp-mode``."""
"""``--dp-layout``: the layout of the "Muon (ours)" row (``--muon-dp-layout``; megatron-core's is always built)."""
GLOBAL_BATCH_TOKENS = 4 * 2**20


@dataclass(frozen=True)
class RealBucket:
    """One bucket of the real DDP, as one TP rank holds it."""

    numel: int
    """elements of its grad buffer, padding included."""
    params: tuple[tuple[str, int, int], ...]
    """(name, TP-local numel, ndim) of each param it holds, in the bucket's order."""
    grad_bytes: int
    param_bytes: int
    expert: bool = False
    """a bucket of the expert-parallel buffer (reduced over the expert-DP group)."""
    span: tuple[tuple[str, int, int], ...] = ()
    """(name, TP-local numel, ndim) of the module params from this bucket's first in forward
    order up to the next bucket's first, whichever buffer holds them: the layers the forward runs
    after entering this bucket's group and before the next, and the backward between the previous
    bucket's last grad and this one's (where one buffer's buckets cut the model into consecutive
    ranges, its own params)."""


@dataclass(frozen=True)
class RealStage:
    """What one pipeline stage's DDP holds: its buckets, its layers, its ends of the model."""

    stage: int
    buckets: tuple[RealBucket, ...]
    """DDP's buckets in backprop order: each buffer's bucket groups in DDP's order, the dense and
    the expert buffer's merged by when the backward completes them (``_backprop_order``)."""
    bucket_groups: int
    layers: int
    embedding: bool
    output_layer: bool
    build_s: float
    """seconds the meta build took (model, DDP, our optimizer and its plans)."""


@contextlib.contextmanager
def _recording_ddp():
    """Every megatron-core ``DistributedDataParallel`` built inside the block, in a list:
    ``build_rank`` returns the optimizers, the DDP it wraps the model in is read here."""
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    built = []
    cls = ddp_module.DistributedDataParallel
    init = cls.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    cls.__init__ = recording
    try:
        yield built
    finally:
        cls.__init__ = init


def real_stage(shape: ModelShape, tp: int, pp: int, dp: int, stage: int, dp_layout: str,
               tp_mode: str = "owner", ep: int = 1, etp: int | None = None) -> RealStage:
    """Build the first rank of pipeline stage ``stage`` on meta (``dry_run.build_rank``: the model,
    Megatron's DDP on ``dp_layout``, our optimizer in ``tp_mode``; with experts at EP ``ep`` and
    expert TP ``etp``) and read its DDP."""
    import torch

    from megatron_muon.megatron.cpu_patches import view_device
    from scripts import dry_run

    started = time.perf_counter()
    # the optimizer's startup report (printed by global rank 0) is the dry run's business, not this table's
    with _recording_ddp() as built, view_device(torch.device("meta")), contextlib.redirect_stdout(io.StringIO()):
        dry_run.build_rank(shape, tp, pp, dp, tp * dp * stage, tp_mode, dp_layout, ep=ep, etp=etp)
        try:
            (ddp,) = built
            named = list(ddp.module.named_parameters())
            names = {p: n for n, p in named}
            position = {p: i for i, (_, p) in enumerate(named)}

            def read(groups, expert: bool) -> list[tuple[int, RealBucket]]:
                return [(min(position[p] for p in bucket.params_list),
                         RealBucket(bucket.grad_data.numel(), tuple((names[p], p.numel(), p.dim())
                                                                    for p in bucket.params_list),
                                    bucket.grad_data.element_size(), bucket.param_data.element_size(), expert))
                        for group in groups for bucket in group.buckets]

            every = [(n, p.numel(), p.dim()) for n, p in named]
            buckets = _backprop_order(read(ddp.bucket_groups, False) + read(ddp.expert_parallel_bucket_groups, True),
                                      every)
            groups = len(ddp.bucket_groups) + len(ddp.expert_parallel_bucket_groups)
        finally:
            dry_run.teardown()
    held = [n for b in buckets for n, _, _ in b.params]
    layers = len({n.split("decoder.layers.")[1].split(".")[0] for n in held if "decoder.layers." in n})
    return RealStage(stage, buckets, groups, layers, any("embedding" in n for n in held),
                     any("output_layer" in n for n in held), time.perf_counter() - started)


def _backprop_order(buckets: list[tuple[int, RealBucket]], params: list[tuple[str, int, int]]
                    ) -> tuple[RealBucket, ...]:
    """Buckets keyed by the forward position (in ``params``, the module's) of their first param, in
    the order the backward completes them, each with its ``span``: DDP lays each buffer out over
    its params reversed, so within a buffer this is DDP's own order, and the two buffers' buckets
    interleave layer by layer. The first bucket in forward order spans from the first param."""
    forward = sorted(buckets, key=lambda kb: kb[0])
    starts = [0] + [k for k, _ in forward[1:]] + [len(params)]
    spanned = [dataclasses.replace(b, span=tuple(params[starts[i]:starts[i + 1]])) for i, (_, b) in enumerate(forward)]
    return tuple(spanned[::-1])


def bucket_compute(bucket: RealBucket, job: Layout, hw: Hardware) -> Bucket:
    """The bucket's forward / backward FLOPs per micro-batch over its ``span``
    (``layout_choice.forward_flops`` on the job's price, as the layout was chosen on: a weight's
    linear FLOPs, the embedding a lookup, norms none, each layer's attention core with its QKV),
    a routed expert's at the tokens one expert sees (``LayoutPrice.for_experts``); and with each
    MoE layer's router, that layer's token all-to-alls (``token_exchange_s``)."""
    from megatron_muon.plan.layout_choice import forward_flops

    price = job.price(hw)
    forward = sum(forward_flops(name, numel, ndim, job.expert_price(hw) if ".experts." in name else price)
                  for name, numel, ndim in bucket.span)
    routers = sum(name.endswith("router.weight") for name, _, _ in bucket.span)
    return Bucket(bucket.numel, forward, 2 * forward, bucket.expert, routers * job.token_exchange_s(hw))


@dataclass(frozen=True)
class StepSeconds:
    """One stage's optimizer step on h100-sxm, Megatron's param all-gather taken out."""

    adam: float
    ours: dict[tuple[str, str], float]
    """by (buffer layout, TP mode)."""


def step_seconds(job: Layout, stage: int, hw: Hardware) -> StepSeconds:
    """Stage ``stage``'s step by the cost model, for Adam and for ours in each of ``job.runs``."""
    tp, dp = job.tp, job.dp
    common = dict(tp=tp, dp=dp, pp=job.pp, stage=stage, hw=hw, ep=job.ep, etp=job.etp)
    # megatron-core's default bucket size; the cost model's layouts drop it after the first stage, as DDP does
    bucket = max(40_000_000, 1_000_000 * dp)

    def without_gather(cost) -> float:
        # the cost model's step ends with Megatron's param all-gather of each buffer, which
        # plan.iteration prices from the real buckets instead
        return cost.total_s - cost.param_gather_s

    adam = optimizer_step_cost(job.shape, optimizer="adam", **common)
    from scripts.dry_run import layout_price

    runs = job.runs
    shape = job.shape
    # priced's layout as build_rank's DDP chose it (plan.layout_choice, on the same price)
    price = layout_price(shape, tp, dp, runs[0][1])
    ours = {(layout, mode): without_gather(optimizer_step_cost(shape, optimizer="ours", tp_mode=mode, dp_layout=layout,
                                                               bucket_numel=bucket, layout_price=price, **common))
            for layout, mode in runs}
    return StepSeconds(without_gather(adam), ours)


@dataclass(frozen=True)
class Layout:
    """The job: model, parallel sizes, batch, DDP flags."""

    shape: ModelShape
    tp: int
    pp: int
    dp: int
    seq: int = 8192
    micro_batch: int = 1
    global_batch_tokens: int = GLOBAL_BATCH_TOKENS
    overlap_param_gather: bool = True
    tp_mode: str = MuonConfig().tp_mode
    """ours' ``--muon-tp-mode``."""
    ours_layout: str = MuonConfig().dp_layout
    """ours' ``--muon-dp-layout`` (``OURS_LAYOUTS``)."""
    ep: int = 1
    """``--expert-model-parallel-size``."""
    etp: int | None = None
    """``--expert-tensor-parallel-size``; None: TP, Megatron's default."""

    @property
    def grid(self) -> StageGrid:
        return StageGrid(self.tp, self.dp, self.pp, 0, self.ep, self.etp)

    def price(self, hw: Hardware) -> LayoutPrice:
        """The job's price inputs (``layout_choice.job_price``): its tokens, attention, DP link."""
        return job_price(self.shape, self.tp, self.dp, hw, seq=self.seq, micro_batch=self.micro_batch,
                         global_batch_tokens=self.global_batch_tokens, overlap_param_gather=self.overlap_param_gather)

    def expert_price(self, hw: Hardware) -> LayoutPrice:
        """The expert buffer's (``LayoutPrice.for_experts``: the tokens one expert sees, expert TP,
        the expert-DP group's node span)."""
        routing = ExpertRouting(self.shape.num_experts, self.shape.moe_topk, self.ep)
        return self.price(hw).for_experts(routing, expert_tp=self.grid.expert_tp,
                                          dp_spans_nodes=self.expert_dp_spans_nodes(hw))

    def expert_dp_spans_nodes(self, hw: Hardware) -> bool:
        return group_topology(self.grid, experts=True, ranks_per_node=hw.ranks_per_node).dp_spans_nodes

    def token_exchange_s(self, hw: Hardware) -> float:
        """One MoE layer's token all-to-alls per micro-batch, forward (the backward runs them
        again): dispatch and combine, each sending the (EP − 1)/EP of its tokens' top-k copies
        routed off the rank (a balanced router), hidden-wide in the params' dtype, over the EP
        group (its node span from its global ranks: in Megatron's expert grid EP rank j of the
        first group is global rank j × expert TP). The tokens are the rank's share of the
        micro-batch (sequence parallel at TP > 1)."""
        if self.ep == 1:
            return 0.0
        tokens = self.seq * self.micro_batch // self.tp
        sent = tokens * self.shape.moe_topk * self.shape.hidden * 2 * (self.ep - 1) / self.ep
        spans = len({j * self.grid.expert_tp // hw.ranks_per_node for j in range(self.ep)}) > 1
        return collective_time("all_to_all", sent, 2, self.ep, hw, spans)

    @property
    def layouts(self) -> tuple[str, str]:
        """the layouts built: megatron-core's, then ours."""
        return ("megatron", self.ours_layout)

    @property
    def runs(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """Muon's two rows' (layout, TP mode): ours, then the baseline."""
        return ((self.ours_layout, self.tp_mode), BASELINE)

    @property
    def micro_batches(self) -> int:
        sequences = self.global_batch_tokens // self.seq
        if sequences % (self.dp * self.micro_batch):
            raise SystemExit(f"error: --global-batch-tokens {self.global_batch_tokens}: {sequences} sequences of "
                             f"{self.seq} do not split into DP {self.dp} x micro-batch {self.micro_batch}")
        return sequences // (self.dp * self.micro_batch)

    def built_stages(self) -> list[int]:
        """The stages built: the first, one middle stage, the last."""
        return sorted({0, min(1, self.pp - 1), self.pp - 1})

    def stand_in(self, stage: int) -> int:
        """The built stage that stands for ``stage`` (every middle stage holds the same layers)."""
        return stage if stage in (0, self.pp - 1) else 1


@dataclass(frozen=True)
class Row:
    label: str
    layout: str
    iteration: Iteration
    buckets: tuple[int, ...]
    """bucket count of each built stage."""


def price(job: Layout, reals: dict[str, dict[int, RealStage]], hw: Hardware) -> list[Row]:
    """The three rows: Adam on megatron-core's layout, ours, and the baseline (``Layout.runs``)."""
    experts = job.shape.num_experts > 0
    settings = IterationSettings(job.micro_batches, job.dp,
                                 Topology.contiguous(job.dp, job.tp, hw.ranks_per_node).dp_spans_nodes,
                                 overlap_param_gather=job.overlap_param_gather,
                                 expert_dp_size=job.grid.expert_dp if experts else None,
                                 expert_dp_spans_nodes=experts and job.expert_dp_spans_nodes(hw))
    # the cost model lays each run's stage out itself (the same layouts, stage_layouts): one per stage
    steps = {s: step_seconds(job, s, hw) for s in job.built_stages()}

    def stages(layout: str, mode: str | None) -> list[Stage]:
        out = []
        for s in range(job.pp):
            real = reals[layout][job.stand_in(s)]
            step = steps[job.stand_in(s)]
            buckets = tuple(bucket_compute(b, job, hw) for b in real.buckets)
            out.append(Stage(buckets, step.adam if mode is None else step.ours[layout, mode],
                             real.buckets[0].grad_bytes, real.buckets[0].param_bytes))
        return out

    rows = []
    (ours_layout, ours_mode), (base_layout, base_mode) = job.runs
    for label, layout, mode in (("Adam", "megatron", None), (f"Muon {ours_mode}", ours_layout, ours_mode),
                                (f"Muon {base_mode}", base_layout, base_mode)):
        rows.append(Row(label, layout, iteration_time(stages(layout, mode), settings, hw),
                        tuple(len(reals[layout][s].buckets) for s in job.built_stages())))
    return rows


def table(job: Layout, rows: list[Row]) -> str:
    adam = rows[0].iteration
    stages = job.built_stages()
    head = "buckets (stage " + " / ".join(str(s) for s in stages) + ")" if job.pp > 1 else "buckets"
    lines = [f"| optimizer | layout | {head} | exposed RS ms | exposed AG ms | exposed step ms | exposed DDP ÷ Adam's "
             "| iteration ms | iteration − Adam's |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        it = r.iteration
        ratio = it.exposed_ddp_s / adam.exposed_ddp_s if adam.exposed_ddp_s else float("nan")
        extra = (it.iteration_s - adam.iteration_s) / adam.iteration_s
        lines.append(f"| {r.label} | {r.layout} | {' / '.join(map(str, r.buckets))} | "
                     f"{1e3 * it.exposed_reduce_scatter_s:.1f} | {1e3 * it.exposed_all_gather_s:.1f} | "
                     f"{1e3 * it.exposed_step_s:.1f} | {ratio:.2f} | {1e3 * it.iteration_s:.1f} | {extra:+.2%} |")
    return "\n".join(lines)


def stage_table(job: Layout, rows: list[Row]) -> str:
    """The built stages' own figures: what each alone would expose."""
    lines = ["| optimizer | layout | stage | fwd / bwd ms per micro-batch | RS / AG ms on the link | exposed RS ms "
             "| exposed AG ms | exposed step ms |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for s in job.built_stages():
            st = r.iteration.stages[s]
            lines.append(f"| {r.label} | {r.layout} | {s} | {1e3 * st.forward_s:.1f} / {1e3 * st.backward_s:.1f} | "
                         f"{1e3 * st.reduce_scatter_s:.1f} / {1e3 * st.all_gather_s:.1f} | "
                         f"{1e3 * st.exposed_reduce_scatter_s:.1f} | {1e3 * st.exposed_all_gather_s:.1f} | "
                         f"{1e3 * st.exposed_step_s:.1f} |")
    return "\n".join(lines)


def build_all(job: Layout) -> dict[str, dict[int, RealStage]]:
    warnings.filterwarnings("ignore")  # Megatron: no TE / Apex here; GPTModel deprecation
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    return {layout: {s: real_stage(job.shape, job.tp, job.pp, job.dp, s, layout, job.tp_mode, job.ep, job.etp)
                     for s in job.built_stages()}
            for layout in job.layouts}


def main(argv: list[str] | None = None) -> int:
    from scripts.dry_run import MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(m for m, s in MODELS.items() if s.hybrid_pattern is None),
                        required=True)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=1, help="--expert-model-parallel-size (a model with experts)")
    parser.add_argument("--etp", type=int, default=None,
                        help="--expert-tensor-parallel-size (default: --tp, Megatron's default)")
    parser.add_argument("--layers", type=int, default=None, help="build the model with this many layers (tests)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--global-batch-tokens", type=int, default=GLOBAL_BATCH_TOKENS)
    parser.add_argument("--hardware", default="h100-sxm", choices=sorted(GPU_PROFILES))
    parser.add_argument("--no-overlap-param-gather", action="store_true",
                        help="the param all-gather inside the step (Megatron without --overlap-param-gather)")
    parser.add_argument("--tp-mode", default=MuonConfig().tp_mode,
                        choices=("owner", "duplicated", "distributed", "auto"),
                        help=f"ours' --muon-tp-mode (default {MuonConfig().tp_mode}, as in training; auto plans on "
                             "the h100-sxm constants)")
    parser.add_argument("--dp-layout", default=MuonConfig().dp_layout, choices=OURS_LAYOUTS,
                        help=f"ours' --muon-dp-layout (default {MuonConfig().dp_layout}, as in training; priced: "
                             "chosen on the dry run's price, dry_run.layout_price)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "dp", "ep", "seq", "micro_batch", "global_batch_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    shape = MODELS[args.model]
    etp = args.tp if args.etp is None else args.etp
    if not shape.num_experts and (args.ep > 1 or args.etp is not None):
        parser.error(f"--ep {args.ep} / --etp {args.etp}: {args.model} has no experts; expected neither")
    if shape.num_experts and (etp < 1 or (args.tp * args.dp) % (args.ep * etp) or shape.num_experts % args.ep):
        parser.error(f"--ep {args.ep} x --etp {etp}: expected EP x expert TP to divide TP x DP = {args.tp * args.dp} "
                     f"and EP to divide the {shape.num_experts} experts")
    if args.layers is not None:
        if args.layers < args.pp:
            parser.error(f"--layers {args.layers}: fewer layers than --pp {args.pp} stages")
        shape = dataclasses.replace(shape, num_layers=args.layers)
    job = Layout(shape, args.tp, args.pp, args.dp, args.seq, args.micro_batch, args.global_batch_tokens,
                 not args.no_overlap_param_gather, args.tp_mode, args.dp_layout, args.ep, args.etp)
    hw = GPU_PROFILES[args.hardware]
    started = time.perf_counter()
    reals = build_all(job)
    rows = price(job, reals, hw)
    command = " ".join(["python -m scripts.bench.iteration_table", *(sys.argv[1:] if argv is None else argv)])
    flags = "--overlap-grad-reduce" + ("" if args.no_overlap_param_gather else " --overlap-param-gather")
    experts = f" x EP{args.ep} (expert TP{etp})" if shape.num_experts else ""
    print(f"Iteration: {args.model} ({shape.num_layers} layers), TP{args.tp} x PP{args.pp} x DP{args.dp}{experts}, "
          f"{args.global_batch_tokens / 2**20:g}M-token global batch of {args.seq}-token sequences, micro-batch "
          f"{args.micro_batch}: M = {job.micro_batches} micro-batches, 1F1B; {flags}; {hw.name}; Muon "
          f"--muon-dp-layout {args.dp_layout} --muon-tp-mode {args.tp_mode}, and the baseline --muon-dp-layout "
          f"{BASELINE[0]} --muon-tp-mode {BASELINE[1]}\n")
    print(table(job, rows))
    if job.pp > 1:
        print("\nEach built stage alone (the other stages exposing nothing):\n")
        print(stage_table(job, rows))
    builds = [f"{layout} stage {s} {r.build_s:.1f} s" for layout, by in reals.items() for s, r in by.items()]
    print(f"\nmeta builds: {', '.join(builds)}; total {time.perf_counter() - started:.1f} s\ncommand: {command}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            model=args.model, layers=shape.num_layers, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, etp=etp,
            micro_batches=job.micro_batches, overlap_param_gather=job.overlap_param_gather, hardware=hw.name,
            stages={layout: {str(s): dict(buckets=[dict(numel=b.numel, expert=b.expert,
                                                        params=[n for n, _, _ in b.params],
                                                        span=[n for n, _, _ in b.span],
                                                        param_numel=sum(k for _, k, _ in b.params))
                                                   for b in r.buckets],
                                          bucket_groups=r.bucket_groups, layers=r.layers, build_s=r.build_s)
                             for s, r in by.items()} for layout, by in reals.items()},
            rows=[dict(label=r.label, layout=r.layout, buckets=r.buckets, iteration=dataclasses.asdict(r.iteration))
                  for r in rows], command=command), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
