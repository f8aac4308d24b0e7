"""Balance and predicted step time of a pipeline stage at depth, owner against auto (on paper),
and against one GPU per NVSwitch domain doing the domain's Newton–Schulz for the others.

For each layout, the first pipeline stage of a Llama-3 model at TP8 (the busiest: its layers plus
the embedding), planned by the optimizer's own step plan (``plan.step_plan.build_step_plan``) in
``owner`` mode and in ``auto`` (the joint TP × DP schedule, ``plan.grid_schedule``) on the
h100-sxm constants, and timed by the cost model (``plan.step_cost.optimizer_step_cost``) next to
Adam's distributed optimizer on the same layout. The stage is laid out as the optimizer finds it
(``plan.stage_layouts``: the balanced buffer layout, DDP's default bucket on the first stage, every
matrix pinned to the DP rank holding it), the road the cost model and ``scripts/dry_run.py``'s
figures share.

    python -m scripts.bench.deep_pipelines [--model 405B] [--layouts 16x64,16x8,...]
"""

from __future__ import annotations

import argparse

from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.cost_model import ns_time
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.stage_layouts import BufferSettings
from megatron_muon.plan.stage_params import StageGrid
from megatron_muon.plan.step_cost import optimizer_step_cost, stage_plan
from megatron_muon.plan.step_plan import PlanSettings

TP = 8
HW = GPU_PROFILES["h100-sxm"]
LAYOUTS = ("1x8", "1x64", "4x64", "8x64", "16x8", "16x16", "16x32", "16x64", "32x64")


def bucket_numel(dp: int) -> int:
    """DDP's default bucket with ``--overlap-grad-reduce``: max(40M, 1M·DP) elements."""
    return max(40_000_000, 1_000_000 * dp)


def row(model: str, pp: int, dp: int) -> dict:
    shape = LLAMA3[model]
    out = dict(layout=f"TP{TP} x PP{pp} x DP{dp}", units=0)
    for mode in ("owner", "auto"):
        # the plan the cost model prices (same layouts, same settings)
        plan = stage_plan(shape, StageGrid(TP, dp, pp), PlanSettings(mode, NSOptions(), hardware=HW),
                          BufferSettings(bucket_numel=bucket_numel(dp)))
        flops = plan.ns_flops
        out["units"] = len(plan.units)
        out[f"{mode} max"] = max(flops) / 1e12
        out[f"{mode} max/mean"] = max(flops) / (sum(flops) / len(flops))
        out[f"{mode} ms"] = optimizer_step_cost(shape, optimizer="ours", tp=TP, dp=dp, pp=pp, hw=HW, tp_mode=mode,
                                                bucket_numel=bucket_numel(dp)).total_s * 1e3
    out["adam ms"] = optimizer_step_cost(shape, optimizer="adam", tp=TP, dp=dp, pp=pp, hw=HW).total_s * 1e3
    # The seed idea (issue 24, item 6): one GPU per NVSwitch domain (a node: HW.ranks_per_node GPUs)
    # runs the Newton-Schulz of its whole domain, the others wait. Its NS per step is the stage's
    # total over the domains, on one GPU, however the domain's work is split (whole matrices,
    # gathered over NVLink); the gathers and scatters are left out, in its favour.
    domains = TP * dp // HW.ranks_per_node
    out["domain max"] = sum(plan.ns_flops) / domains / 1e12
    out["domain ns ms"] = ns_time(sum(plan.ns_flops) / domains, 1, HW, 5) * 1e3
    out["auto ns ms"] = ns_time(max(plan.ns_flops), 1, HW, 5) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="405B", choices=sorted(LLAMA3))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated PPxDP pairs")
    args = parser.parse_args()
    print(f"Llama-3 {args.model}, first pipeline stage, h100-sxm constants; NS TFLOP per rank (plan), "
          "optimizer step ms (cost model; the balanced buffer layout, DDP's default bucket)\n")
    print("| layout | units | owner: NS max | max/mean | auto: NS max | max/mean | step ms: owner | auto | "
          "Adam | auto − Adam | one GPU per node: NS TFLOP | its NS ms | auto's NS ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pair in args.layouts.split(","):
        pp, dp = (int(x) for x in pair.split("x"))
        r = row(args.model, pp, dp)
        print(f"| {r['layout']} | {r['units']} | {r['owner max']:.2f} | {r['owner max/mean']:.2f} | "
              f"{r['auto max']:.2f} | {r['auto max/mean']:.2f} | {r['owner ms']:.1f} | {r['auto ms']:.1f} | "
              f"{r['adam ms']:.1f} | {r['auto ms'] - r['adam ms']:.1f} | {r['domain max']:.2f} | "
              f"{r['domain ns ms']:.1f} | {r['auto ns ms']:.1f} |")


if __name__ == "__main__":
    main()
