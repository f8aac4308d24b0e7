"""Experts under Megatron-FSDP beside ZeRO-1 (issue 44, item 5): the table of docs/fsdp.md, from the
recorded dry runs (``docs/perf-results/dry_run_moe_*_dp64_auto{,_fsdp}.json``).

    python -m scripts.bench.fsdp_moe_table                # print the table
    python -m scripts.bench.record_dry_runs moe_mixtral_tp1_ep8_dp64_auto moe_dsv3_tp1_ep8_dp64_auto  # record again

Each run is ``scripts/dry_run.py`` at TP1 x EP8 x DP64 (expert-DP 8), default flags (``--tp-mode
auto``; ZeRO-1 on the default ``priced`` buffer layout), once under ``--fsdp optim_grads_params``.
Per optimizer of the chain (dense over DP 64, experts over expert-DP 8): NS FLOPs and bytes sent
per rank per step, max and mean over every rank of the (expert-)TP x (expert-)DP grid (the plans
the step ran: the dry run checks the step equals its plan on every simulated rank); the optimizer
state and the step's transient peak, largest over the simulated ranks (measured on meta).
"""

from __future__ import annotations

import json

from scripts.bench.record_dry_runs import path_of

PAIRS = (("Mixtral-8x7B", "moe_mixtral_tp1_ep8_dp64_auto"), ("DeepSeek-V3 (PP1)", "moe_dsv3_tp1_ep8_dp64_auto"))
"""(model, the ZeRO-1 run's record name); the Megatron-FSDP run's is the same with ``_fsdp``."""


def rows(label: str, run: dict) -> list[str]:
    """The table's two rows of one run, dense then experts."""
    out = []
    for part in ("dense", "experts"):
        plan = run["summary"][part]["plan"]
        ranks = [r if part == "dense" else r["experts"] for r in run["ranks"].values()]
        ranks = [r for r in ranks if r is not None]
        cut = max(r["cut_across_dp"] for r in ranks)
        gib = lambda key: max(r[key] for r in ranks) / 2**30  # noqa: E731
        out.append(f"| {label} | {part} | {max(r['matrices'] for r in ranks)} | {cut} | "
                   f"{plan['ns_flops_max'] / 1e12:.2f} / {plan['ns_flops_mean'] / 1e12:.2f} "
                   f"({plan['ns_flops_max'] / plan['ns_flops_mean']:.2f}) | "
                   f"{plan['bytes_sent_max'] / 2**20:.1f} / {plan['bytes_sent_mean'] / 2**20:.1f} | "
                   f"{gib('state_bytes'):.2f} | {gib('peak_extra_bytes'):.2f} | {len(ranks)} |")
    return out


def table() -> str:
    lines = ["| model, wrapper | optimizer | Muon matrices per rank | cut across (expert-)DP | "
             "NS TFLOP per rank max / mean (max/mean) | MiB sent per rank max / mean | state GiB | "
             "transient peak GiB | simulated ranks |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, name in PAIRS:
        for wrapper, suffix in (("ZeRO-1", ""), ("Megatron-FSDP", "_fsdp")):
            run = json.loads(path_of(name + suffix).read_text())
            lines += rows(f"{model}, {wrapper}", run)
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
