"""Regenerate every recorded dry run, ``docs/perf-results/dry_run_*.json``, with one command.

    python -m scripts.bench.record_dry_runs            # all of them (about 20 minutes on 2 cores; DeepSeek-V3
                                                       # under Megatron-FSDP at PP1 about 6 of them)
    python -m scripts.bench.record_dry_runs 405b_tp8   # those whose name contains any of the words

``RUNS`` is the list: each recorded file's name and the ``scripts/dry_run.py`` arguments that write
it. ``tests/unit/test_dry_run_cost_model.py`` then checks each file's cost-model figures against
its plan's; ``tests/unit/test_record_dry_runs.py`` that the list names every recorded file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from scripts import dry_run

OUT = Path(__file__).resolve().parents[2] / "docs" / "perf-results"

_LLAMA = [(f"{size}_tp8_dp8", ["--model", f"llama3-{size}", "--tp", "8", "--dp", "8", "--tp-mode", "owner"])
          for size in ("8b", "70b", "405b")]
_FSDP = [(f"{name}_fsdp", [*argv, "--fsdp", "optim_grads_params"]) for name, argv in _LLAMA]
_DEEP = ["--model", "llama3-405b", "--tp", "8", "--pp", "16", "--dp", "64"]
_DSV3 = ["--model", "deepseek-v3", "--tp", "1", "--ep", "8", "--etp", "1", "--pp", "16", "--dp", "64"]
_MIXTRAL = ["--model", "mixtral-8x7b", "--ep", "8", "--dp", "64"]
_NEMOTRON = ["--model", "nemotron-h-8b", "--tp", "8"]
# Issue 44 item 5 (scripts/bench/fsdp_moe_table.py): default flags, ZeRO-1 and Megatron-FSDP, at PP1 (Megatron-FSDP
# has no pipeline). DeepSeek-V3 whole on one stage: about 3 minutes a simulated rank under Megatron-FSDP, so its
# first and last only.
_MOE_DP64 = [("moe_mixtral_tp1_ep8_dp64_auto", [*_MIXTRAL, "--tp", "1", "--tp-mode", "auto"]),
             ("moe_dsv3_tp1_ep8_dp64_auto", ["--model", "deepseek-v3", "--tp", "1", "--ep", "8", "--dp", "64",
                                             "--tp-mode", "auto", "--ranks", "first,last"])]

RUNS: tuple[tuple[str, list[str]], ...] = (
    *_LLAMA,
    *_FSDP,
    ("405b_tp8_pp16_dp64", [*_DEEP, "--tp-mode", "owner"]),
    ("405b_tp8_pp16_dp64_auto", [*_DEEP, "--tp-mode", "auto", "--ranks", "first,busiest,idle-dp-owner,last"]),
    ("moe_dsv3_tp1_ep8_pp16_dp64_duplicated", [*_DSV3, "--tp-mode", "duplicated"]),
    ("moe_dsv3_tp1_ep8_pp16_dp64_owner", [*_DSV3, "--tp-mode", "owner"]),
    ("moe_dsv3_tp1_ep8_pp16_dp64_owner_megatron", [*_DSV3, "--tp-mode", "owner", "--dp-layout", "megatron"]),
    ("moe_mixtral_tp1_ep8_dp64_owner", [*_MIXTRAL, "--tp", "1", "--etp", "1", "--tp-mode", "owner"]),
    ("moe_mixtral_tp1_ep8_dp64_owner_megatron", [*_MIXTRAL, "--tp", "1", "--etp", "1", "--tp-mode", "owner",
                                                 "--dp-layout", "megatron"]),
    ("moe_mixtral_tp2_ep8_dp64_duplicated", [*_MIXTRAL, "--tp", "2", "--tp-mode", "duplicated"]),
    ("moe_mixtral_tp2_ep8_dp64_owner", [*_MIXTRAL, "--tp", "2", "--tp-mode", "owner"]),
    ("moe_mixtral_tp2_etp1_ep8_dp64_duplicated", [*_MIXTRAL, "--tp", "2", "--etp", "1", "--tp-mode", "duplicated"]),
    ("moe_mixtral_tp2_etp1_ep8_dp64_owner", [*_MIXTRAL, "--tp", "2", "--etp", "1", "--tp-mode", "owner"]),
    *_MOE_DP64,
    *[(f"{name}_fsdp", [*argv, "--fsdp", "optim_grads_params"]) for name, argv in _MOE_DP64],
    ("nemotron-h-8b_tp8_dp8", [*_NEMOTRON, "--dp", "8", "--tp-mode", "owner"]),
    ("nemotron-h-8b_tp8_dp64", [*_NEMOTRON, "--dp", "64", "--tp-mode", "owner"]),
    ("nemotron-h-8b_tp8_dp64_auto", [*_NEMOTRON, "--dp", "64", "--tp-mode", "auto"]),
    ("nemotron-h-8b_tp8_pp8_dp8", [*_NEMOTRON, "--pp", "8", "--dp", "8", "--tp-mode", "owner"]),
    ("nemotron-h-8b_tp8_pp8_dp8_auto", [*_NEMOTRON, "--pp", "8", "--dp", "8", "--tp-mode", "auto"]),
)


def path_of(name: str) -> Path:
    return OUT / f"dry_run_{name}.json"


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    chosen = [(name, args) for name, args in RUNS if not words or any(w in name for w in words)]
    if not chosen:
        raise SystemExit(f"record_dry_runs: no recorded run matches {words}; names: {[n for n, _ in RUNS]}")
    failed = []
    for name, args in chosen:
        start = time.perf_counter()
        rc = dry_run.main([*args, "--json", str(path_of(name))])
        print(f"[record_dry_runs] {name}: rc {rc}, {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"[record_dry_runs] failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
