"""The real optimizer step at production scale, on the meta device, under torch's fake process group.

    python scripts/dry_run.py --model llama3-405b --tp 8 --pp 16 --dp 64
    python scripts/dry_run.py --model llama3-8b --tp 8 --dp 64 --ranks first,no-first-piece,idle-dp-owner
    python scripts/dry_run.py --model llama3-70b --tp 8 --dp 8 --json out.json

For each chosen rank it builds what a Megatron job builds on that rank — the real megatron-core
``GPTModel`` (local spec, bf16) with meta parameters, Megatron's DDP buffers and ZeRO-1 ranges,
and our optimizer (``get_megatron_muon_optimizer``) — under ``dist.init_process_group("fake")``
with the layout's world size, then runs our inner optimizer step (momentum, the DP owner
exchange, the TP mode, Newton–Schulz, the update) on meta tensors. Nothing is computed and no
data moves; shapes propagate, and:

* a tensor on another device fails the step (meta mixed with CPU raises), and every collective's
  buffers must be on the step's device (``comm.observe_collectives``);
* every collective's sizes are checked against the plan: split sizes add up to the buffers, and
  for each pair of simulated ranks in one group the collectives line up in order and kind, and
  what one sends the other expects (``all_to_all`` splits, ``all_gather`` sizes).

Rank kinds (``--ranks``, comma-separated): ``first``, ``last``, ``no-first-piece`` (a DP rank
holding no piece of the first Muon matrix), ``idle-dp-owner`` (a DP rank that owns no matrix, so
its TP group has nothing to orthogonalize), ``pp-stages`` (the first rank of every pipeline
stage), or a number. Prints per rank: matrices owned, NS FLOPs, bytes per collective, the step's
peak extra bytes (live meta tensors created during the step), next to what the plans predict for
that rank (``parallel.step_plan``, on the real layouts), the planner table's figures
(``scripts.bench.planner_quality``, PP = 1) and the cost model's for the busiest rank.
"""

from __future__ import annotations

import os

# No device is used: hide any GPU before torch looks, so Megatron's CUDA-isms take the patched path
# (cpu_patches, viewing the meta device) on a GPU machine too, instead of allocating real buffers.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import json
import sys
import time
import warnings
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_muon.core.models import LLAMA3, ModelShape  # noqa: E402

MODELS = {f"llama3-{k.lower()}": v for k, v in LLAMA3.items()}
RANK_KINDS = ("first", "last", "no-first-piece", "idle-dp-owner", "pp-stages")


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created (and still alive) inside the block; views are free."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in seen and not t._is_view():
                nbytes = t.numel() * t.element_size()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out


def _layer_split(shape: ModelShape, pp: int) -> dict:
    """Megatron's uneven-pipeline flags when the layers do not split evenly (405B: 126 = 7 + 14·8 + 7)."""
    if shape.num_layers % pp == 0:
        return {}
    middle = -(-shape.num_layers // pp)
    edge = (shape.num_layers - middle * (pp - 2)) // 2
    if pp < 3 or edge < 1 or 2 * edge + middle * (pp - 2) != shape.num_layers:
        raise SystemExit(f"error: {shape.num_layers} layers do not split over --pp {pp}")
    return dict(num_layers_in_first_pipeline_stage=edge, num_layers_in_last_pipeline_stage=edge)


def build_rank(shape: ModelShape, tp: int, pp: int, dp: int, rank: int, tp_mode: str, dp_layout: str = "balanced"):
    """Megatron's state, model, DDP (on the ``dp_layout`` buffer layout, as ``--muon-dp-layout``
    gives it) and our optimizer for ``rank``, all on meta."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp * dp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=False)
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn_hidden,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **_layer_split(shape, pp),
    )
    # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (128) x TP.
    vocab = -(-shape.vocab // (128 * tp)) * 128 * tp
    with torch.device("meta"):  # the layers allocate on the default device under use_cpu_initialization
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=vocab, max_sequence_length=8192, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage())
    # Megatron's defaults for a large run: fp32 grad reduction, overlapped reduce-scatter buckets.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True)
    muon_config = MuonConfig(tp_mode=tp_mode, fp32_matmul_prec="medium", dp_layout=dp_layout)
    module = Float16Module(config, model)
    layout = None
    if dp_layout == "balanced":  # what the hook's DDP factory builds (megatron/layout.py), same bucket rule
        from megatron_muon.megatron.layout import balanced_full_param_layout

        bucket = max(40_000_000, 1_000_000 * dp) if ps.get_pipeline_model_parallel_rank() == 0 else None
        layout = balanced_full_param_layout(module, bucket, dp, ddp_config, muon_config=muon_config, tp_size=tp)
    model = DistributedDataParallel(config, ddp_config, module, full_param_layout=layout)
    optimizer = get_megatron_muon_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, clip_grad=1.0),
        [model], muon_config, use_gloo_process_groups=False)
    slot = dict(tp=ps.get_tensor_model_parallel_rank(), dp=ps.get_data_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank())
    return optimizer.chained_optimizers[0].optimizer, slot


def teardown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


class Recorder:
    """Checks each collective's buffers (device, split sums) and keeps a per-group trace."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.trace, self.errors = device, [], []

    def __call__(self, c) -> None:
        ranks = tuple(dist.get_process_group_ranks(c.group)) if c.group is not None else None
        for t in (*c.inputs, *c.outputs):
            if t.device != self.device:  # stop here: the rest would run on real CPU memory
                raise RuntimeError(f"{c.primitive} on a group of {len(ranks)}: a buffer on {t.device}, the "
                                   f"step's device is {self.device}")
        if c.primitive == "all_to_all":
            for splits, t, side in ((c.input_split_sizes, c.inputs[0], "send"), (c.output_split_sizes, c.outputs[0],
                                                                                 "receive")):
                if len(splits) != len(ranks) or sum(splits) != t.numel():
                    self.errors.append(f"all_to_all on {ranks}: {side} splits {sum(splits)} over {len(splits)} "
                                       f"ranks for a buffer of {t.numel()}")
        elif c.primitive != "all_reduce" and any(o.shape != c.inputs[0].shape for o in c.outputs):
            self.errors.append(f"{c.primitive} on {ranks}: outputs shaped unlike the input {tuple(c.inputs[0].shape)}")
        sizes = (c.inputs[0].numel(),) if c.input_split_sizes is None else (c.input_split_sizes, c.output_split_sizes)
        self.trace.append((ranks, c.primitive, sizes))


def cross_rank_errors(traces: dict[int, list]) -> list[str]:
    """For every pair of simulated ranks sharing a group: the same collectives, in the same order,
    with matching sizes (what one sends to the other is what the other expects from it)."""
    errors = []
    per_group: dict[tuple, dict[int, list]] = {}
    for rank, trace in traces.items():
        for ranks, primitive, sizes in trace:
            per_group.setdefault(ranks, {}).setdefault(rank, []).append((primitive, sizes))
    for ranks, by_rank in per_group.items():
        members = sorted(by_rank)
        for a in members:
            for b in members:
                if a >= b:
                    continue
                ca, cb = by_rank[a], by_rank[b]
                if [p for p, _ in ca] != [p for p, _ in cb]:
                    errors.append(f"group {ranks[:4]}...: ranks {a} and {b} issue different collectives")
                    continue
                ia, ib = ranks.index(a), ranks.index(b)
                for k, ((prim, sa), (_, sb)) in enumerate(zip(ca, cb)):
                    if prim == "all_to_all" and (sa[0][ib] != sb[1][ia] or sb[0][ia] != sa[1][ib]):
                        errors.append(f"all_to_all #{k} on group of {len(ranks)}: rank {a} sends {sa[0][ib]} to "
                                      f"{b}, which expects {sb[1][ia]} (or the reverse)")
                    elif prim != "all_to_all" and sa != sb:
                        errors.append(f"{prim} #{k} on group of {len(ranks)}: ranks {a} and {b} sizes {sa} vs {sb}")
    return errors


def run_rank(shape, tp, pp, dp, rank, tp_mode, dp_layout: str = "balanced") -> dict:
    from megatron_muon.parallel.comm import comm_stats, observe_collectives
    from megatron_muon.parallel.step_plan import plan_step

    inner, slot = build_rank(shape, tp, pp, dp, rank, tp_mode, dp_layout)
    try:
        for group in inner.param_groups:  # the reduce-scattered grads of this rank's ranges
            for p in group["params"]:
                p.grad = torch.empty_like(p)
        recorder = Recorder(inner.device)
        meter = LiveBytes()
        with observe_collectives(recorder), comm_stats() as stats, meter:
            try:
                inner.step()
            except (RuntimeError, ValueError) as e:  # a wrong device, or meta mixed with CPU
                recorder.errors.append(f"the step failed: {type(e).__name__}: {str(e).splitlines()[0]}")
        layouts = [m.layout for m in inner.matrices()]
        owned = sum(1 for o in inner._owners if o == slot["dp"])
        cfg = inner.config
        plan = plan_step(layouts, inner._owners, tp, dp, tp_mode=tp_mode, steps=cfg.num_ns_steps,
                         ns_bytes=cfg.ns_dtype.itemsize)
        here = slot["dp"] * tp + slot["tp"]
        cut = sum(1 for lay in layouts if lay.dp_ranges and len(lay.holders(dp)) > 1)
        return dict(rank=rank, **slot, matrices=len(layouts), dp_owned=owned, cut_across_dp=cut,
                    ns_flops=stats.ns_flops, bytes_by_collective=dict(stats.bytes_by_primitive),
                    bytes_sent=stats.bytes_sent, peak_extra_bytes=meter.peak, device=str(inner.device),
                    plan_ns_flops=plan.ns_flops[here], plan_bytes_sent=plan.bytes_sent[here],
                    errors=recorder.errors, trace=recorder.trace,
                    first_matrix_holders=sorted(layouts[0].holders(dp)) if layouts else [],
                    idle_dp_ranks=sorted(set(range(dp)) - set(inner._owners)))
    finally:
        teardown()


def choose_ranks(kinds: list[str], tp: int, pp: int, dp: int, probe: dict) -> dict[int, list[str]]:
    """Global rank → the kinds it stands for (Megatron's default order: TP fastest, then DP, then PP)."""
    at = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731
    chosen: dict[int, list[str]] = {}
    for kind in kinds:
        if kind == "first":
            ranks = [0]
        elif kind == "last":
            ranks = [tp * pp * dp - 1]
        elif kind == "no-first-piece":
            ranks = [at(0, d, 0) for d in range(dp) if d not in probe["first_matrix_holders"]][-1:]
        elif kind == "idle-dp-owner":
            ranks = [at(0, d, 0) for d in probe["idle_dp_ranks"]][:1]
        elif kind == "pp-stages":
            ranks = [at(0, 0, p) for p in range(pp)]
        elif kind.isdigit():
            ranks = [int(kind)]
        else:
            raise SystemExit(f"error: --ranks: unknown kind {kind!r}; expected a number or one of {RANK_KINDS}")
        if not ranks:
            print(f"note: no rank of kind {kind!r} at this layout", file=sys.stderr)
        for r in ranks:
            chosen.setdefault(r, []).append(kind)
    return chosen


def cost_model_row(shape: ModelShape, tp: int, pp: int, dp: int, tp_mode: str, dp_layout: str = "balanced") -> dict:
    from megatron_muon.parallel.cost_model import GPU_PROFILES, model_weights, optimizer_step_cost

    cost = optimizer_step_cost(model_weights(shape), optimizer="ours", tp=tp, dp=dp, pp=pp,
                               hw=GPU_PROFILES["h100-sxm"], tp_mode=tp_mode, ns_bytes=2, dp_layout=dp_layout,
                               bucket_numel=max(40_000_000, 1_000_000 * dp))
    return dict(ns_flops_max=cost.ns_flops_max, bytes_sent_max=cost.bytes_sent_max, step_ms_h100=cost.total_s * 1e3)


def planner_rows(model: str, tp: int, pp: int, dp: int, dp_layout: str = "balanced"
                 ) -> dict[int, tuple[float, float]] | None:
    """Per global rank (PP = 1 only), the planner table's NS FLOPs and bytes sent for the same
    layout (``scripts.bench.planner_quality``: the same plans, computed without running a step)."""
    if pp != 1:
        return None
    from scripts.bench import planner_quality as pq

    spec = pq.llama3_spec(model.removeprefix("llama3-").upper())
    plan = pq.plan_ours(pq.ours_layouts(spec, tp, dp, pq.default_bucket_size(dp), dp_layout=dp_layout), tp, dp)
    return {r: (plan.flops[r], plan.dp_bytes[r] + plan.tp_bytes[r]) for r in range(tp * dp)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--tp-mode", default="owner", choices=("owner", "duplicated", "distributed", "blockwise"))
    parser.add_argument("--dp-layout", default="balanced", choices=("balanced", "megatron"),
                        help="the DDP buffer layout (--muon-dp-layout); default balanced, as in training")
    parser.add_argument("--ranks", default="first,last,no-first-piece,idle-dp-owner,pp-stages",
                        help=f"comma-separated rank numbers or kinds {RANK_KINDS}")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "dp"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    shape = MODELS[args.model]
    warnings.filterwarnings("ignore")  # Megatron: no TE / Apex on this machine; GPTModel deprecation
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches, view_device

    apply_cpu_patches()
    started = time.perf_counter()
    with view_device(torch.device("meta")):  # Megatron's buffers: allocated on meta, not the CPU
        probe = run_rank(shape, args.tp, args.pp, args.dp, 0, args.tp_mode, args.dp_layout)
        chosen = choose_ranks(args.ranks.split(","), args.tp, args.pp, args.dp, probe)
        if not chosen:
            raise SystemExit(f"error: --ranks {args.ranks}: no such rank at this layout")
        results = {0: probe} if 0 in chosen else {}
        for rank in sorted(set(chosen) - set(results)):
            results[rank] = run_rank(shape, args.tp, args.pp, args.dp, rank, args.tp_mode, args.dp_layout)
    errors = [f"rank {r}: {e}" for r, res in results.items() for e in res["errors"]]
    errors += cross_rank_errors({r: res["trace"] for r, res in results.items()})
    predicted = cost_model_row(shape, args.tp, args.pp, args.dp, args.tp_mode, args.dp_layout)
    planned = (planner_rows(args.model, args.tp, args.pp, args.dp, args.dp_layout) if args.tp_mode == "owner"
               else None)
    for rank, res in results.items():
        if planned is not None:
            res["planner_ns_flops"], res["planner_bytes_sent"] = planned[rank]

    print(f"Dry run: {args.model}, TP{args.tp} x PP{args.pp} x DP{args.dp} ({args.tp * args.pp * args.dp} ranks), "
          f"tp_mode {args.tp_mode}, --muon-dp-layout {args.dp_layout}, bf16 NS, meta device, fake process group\n")
    print("| rank | kinds | TP/DP/PP rank | Muon matrices | cut across DP | DP-owned | NS TFLOP (plan) [planner table] "
          "| MiB sent (all_to_all / all_gather / all_reduce / shape check) | plan MiB [planner table] | "
          "peak extra GiB |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|---:|")
    for rank, res in sorted(results.items()):
        b = Counter(res["bytes_by_collective"])
        sent = " / ".join(f"{b[k] / 2**20:.1f}" for k in ("all_to_all", "all_gather", "all_reduce", "shape_check"))
        plan_flops = f" ({res['plan_ns_flops'] / 1e12:.2f})"
        plan_mib = f"{res['plan_bytes_sent'] / 2**20:.1f}"
        if "planner_ns_flops" in res:
            plan_flops += f" [{res['planner_ns_flops'] / 1e12:.2f}]"
            plan_mib += f" [{res['planner_bytes_sent'] / 2**20:.1f}]"
        print(f"| {rank} | {', '.join(chosen.get(rank, ['probe']))} | {res['tp']}/{res['dp']}/{res['pp']} | "
              f"{res['matrices']} | {res['cut_across_dp']} | {res['dp_owned']} | {res['ns_flops'] / 1e12:.2f}"
              f"{plan_flops} | {sent} | {plan_mib} | {res['peak_extra_bytes'] / 2**30:.2f} |")
    busiest = max(res["ns_flops"] for res in results.values())
    print(f"\nCost model, same layout (busiest rank of the job; h100-sxm constants): NS "
          f"{predicted['ns_flops_max'] / 1e12:.2f} TFLOP (busiest simulated rank here: {busiest / 1e12:.2f}), "
          f"{predicted['bytes_sent_max'] / 2**20:.1f} MiB sent (the whole step: Megatron's grad reduce-scatter "
          f"and param all-gather included), predicted step {predicted['step_ms_h100']:.1f} ms.")
    print(f"Checked {sum(len(r['trace']) for r in results.values())} collectives on {len(results)} ranks: "
          f"{'all on the step device, sizes consistent' if not errors else f'{len(errors)} problems'}; "
          f"{time.perf_counter() - started:.1f} s.")
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    if args.json:
        for res in results.values():
            res["trace"] = len(res["trace"])
        args.json.write_text(json.dumps(dict(model=args.model, tp=args.tp, pp=args.pp, dp=args.dp,
                                             tp_mode=args.tp_mode, ranks={str(r): dict(res, kinds=chosen.get(r, []))
                                                                          for r, res in results.items()},
                                             cost_model=predicted, errors=errors), indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
