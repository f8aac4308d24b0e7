"""Balance and predicted step time of a pipeline stage at depth, owner against auto (on paper),
and against one GPU per NVSwitch domain doing the domain's Newton–Schulz for the others.

For each layout, the first pipeline stage of a Llama-3 model at TP8 (the busiest: its layers plus
the embedding), planned by the optimizer's own step plan (``plan.step_plan.build_step_plan``) in
``owner`` mode and in ``auto`` (the joint TP × DP schedule, ``plan.grid_schedule``) on the
h100-sxm constants, and timed by the cost model (``plan.step_cost.optimizer_step_cost``, Megatron's
default buffer layout) next to Adam's distributed optimizer on the same layout. The stage's weights
are laid out whole on every DP rank here (the cost model's convention); ``scripts/dry_run.py``
runs the real step on the real layouts.

    python -m scripts.bench.deep_pipelines [--model 405B] [--layouts 16x64,16x8,...]
"""

from __future__ import annotations

import argparse

from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.plan.cost_model import GPU_PROFILES, ns_time
from megatron_muon.plan.step_cost import _stage_layouts, _stage_weights, model_weights, optimizer_step_cost
from megatron_muon.plan.step_plan import PlanSettings, build_step_plan

TP = 8
HW = GPU_PROFILES["h100-sxm"]
LAYOUTS = ("1x8", "1x64", "4x64", "8x64", "16x8", "16x16", "16x32", "16x64", "32x64")


def row(model: str, pp: int, dp: int) -> dict:
    weights = model_weights(LLAMA3[model])
    layouts = _stage_layouts(_stage_weights(weights, pp), TP)
    out = dict(layout=f"TP{TP} x PP{pp} x DP{dp}", units=0)
    for mode in ("owner", "auto"):
        plan = build_step_plan(layouts, dp_size=dp, tp_size=TP,
                               settings=PlanSettings(mode, NSOptions(), hardware=HW if mode == "auto" else None))
        flops = plan.ns_flops
        out["units"] = len(plan.units)
        out[f"{mode} max"] = max(flops) / 1e12
        out[f"{mode} max/mean"] = max(flops) / (sum(flops) / len(flops))
        out[f"{mode} ms"] = optimizer_step_cost(weights, optimizer="ours", tp=TP, dp=dp, pp=pp, hw=HW,
                                                tp_mode=mode).total_s * 1e3
    out["adam ms"] = optimizer_step_cost(weights, optimizer="adam", tp=TP, dp=dp, pp=pp, hw=HW).total_s * 1e3
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
          "optimizer step ms (cost model, Megatron's buffer layout)\n")
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
