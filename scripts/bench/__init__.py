"""The benchmark machinery behind docs/performance.md and docs/tp_modes.md.

Run each from the repository root as a module, e.g. ``python -m scripts.bench.bench_optimizer_step``
(``bash scripts/run.sh perf`` runs the set); tests import them as ``scripts.bench.<name>``.

    bench_optimizer_step   whole optimizer.step()s, ours against megatron-core's Muon, in one run
    optimizer_step_setup   its model, optimizer rows and meters (times nothing)
    bench_tp_modes         orthogonalize_sharded per TP mode against TensorParallelMuon
    calibrate_hardware     micro-benchmarks → the cost model's hardware constants
    validate_cost_model    predicted against measured step times
    project_performance    the cost model on H100/H200 at Llama-3 layouts
    planner_quality        NS load balance and exchange bytes on Llama-3 layouts
    compare_optimizers     convergence: Muon / MuonBP / BlockMuon / AdamW through Megatron's loop
    tiny_gpt_step          the tiny GPT's optimizer step: MuonBP timings, per-primitive bytes (docs tables)
    iteration_table        the real DDP's buckets priced over a whole iteration (plan.iteration)
    ddp_overlap            Megatron's DDP overlap measured on this CPU: many buckets, one, none
    record_dry_runs        regenerates every docs/perf-results/dry_run_*.json (scripts/dry_run.py)
    fsdp_moe_table         experts under Megatron-FSDP beside ZeRO-1: the table of docs/fsdp.md (recorded dry runs)
    launch                 the one rank launcher (file:// rendezvous, gloo or NCCL)
    collectives            the one byte meter over every torch.distributed collective
"""
