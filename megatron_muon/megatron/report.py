"""The startup report: what the optimizer will do, printed once by global rank 0 when it is built.

A misrouted parameter (a learned position embedding sent to Muon), a TP mode
that is not the one intended, or a DP layout that cuts most matrices are visible here before the
first step, by name pattern (layer numbers folded into ``*``). Llama-3 8B at TP8 x DP8
(``python scripts/dry_run.py --model llama3-8b --tp 8 --dp 8``)::

    megatron-muon: Muon on 128 matrices, AdamW on 67 tensors (pipeline stage 0 of 1)
      muon   decoder.layers.*.mlp.linear_fc2.weight             x32   NS on 4096x14336 (standard, bfloat16)  tp mode ...
      muon   decoder.layers.*.mlp.linear_fc1.weight             x32   NS on 14336x4096 + 14336x4096 (standard, ...
      muon   decoder.layers.*.self_attention.linear_qkv.weight  x32   NS on 4096x4096 + 1024x4096 + 1024x4096 ...
      muon   decoder.layers.*.self_attention.linear_proj.weight x32   NS on 4096x4096 (standard, bfloat16)  ...
      adamw  embedding.word_embeddings.weight                   x1
      adamw  decoder.layers.*.input_layernorm.weight            x32
      ...
      DP 8: megatron buffer layout (padding 0.0%): 65 of 128 matrices cut across DP ranks; each goes
        whole to one DP owner (owner exchange)
      DDP buckets (bf16 params, fp32 grads): row-aligned, 18 buckets: exposed DDP 61.2 ms + DP exchange 1.8 ms
        per iteration predicted (whole matrices: 4 buckets, 79.3 ms; megatron-core's layout: 18 buckets,
        61.1 ms), h100-sxm, M 64
      NS per full step on this stage's 64 ranks: max 11.68 TFLOP, mean 10.40 (max/mean 1.12)
      bytes sent per rank per full step (plan): max 796.8 MiB, mean 618.7 MiB
      MuonBP: off

A resumed run ends the report with what it changed against the checkpoint's recorded settings
(``resume_config``), e.g. ``resume from .../iter_0000003: changed against the checkpoint's
settings:`` then ``TP 2 -> 1: resharded exactly ...``, or ``same settings as the checkpoint``.

The figures come from the optimizer's step plans (``optimizer.plans``, ``plan.step_plan``): the
same plans the step executes, not a replay of them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

import torch

from ..config import MuonConfig
from ..core.newton_schulz import runs_gram
from ..plan.step_plan import StepPlan
from .catalogue import is_muon_matrix, packed_in_backprop_order
from .resume_config import report_lines

__all__ = ["CHOICE_MARK", "IN_PROJ_RULES", "MAMBA_RULES", "ROUTER_RULES", "layout_choice_lines", "name_pattern",
           "routing_note", "startup_report"]

# Parameter names that should never reach Muon; flagged when they do.
_SUSPICIOUS = ("position_embeddings", "embedding", "output_layer")

ROUTER_RULES = {
    False: "MoE router: Muon, as megatron-core 0.19.2 routes it (every 2-D weight that is not an embedding or the "
           "output layer); upstream main with --moe-router-skip-muon: AdamW",
    True: "MoE router: AdamW (--moe-router-skip-muon, as upstream main with it); megatron-core 0.19.2: Muon",
}
"""How the report marks an MoE router's weight (``[experts, hidden]``, 2-D), by
``MuonConfig.router_skip_muon``: megatron-core 0.19.2's emerging-optimizer path
(``_is_nonlinear_or_embedding`` in ``optimizer/emerging_optimizers.py``) sends it to Muon, and so
does ``is_muon_matrix``; megatron-core's main branch after 0.19.2 sends it to AdamW with
``--moe-router-skip-muon`` (PR #6504, off by default)."""

IN_PROJ_RULES = {
    "split": "Mamba in_proj: split by role, z, x, B, C, dt orthogonalized apart, five maps of different roles, as Q, "
             "K, V (megatron-core 0.19.2: whole; upstream main: AdamW; --muon-mamba-in-proj)",
    "whole": "Mamba in_proj: Muon whole (--muon-mamba-in-proj whole), as megatron-core 0.19.2 (upstream main: AdamW; "
             "megatron-muon's default: split by role)",
    "adamw": "Mamba in_proj: AdamW (--muon-mamba-in-proj adamw), as upstream main (megatron-core 0.19.2: Muon whole; "
             "megatron-muon's default: split by role)",
}
"""The report's note on a Mamba ``in_proj``, by ``MuonConfig.mamba_in_proj``: each choice beside
megatron-core 0.19.2's routing (Muon, whole) and the main branch's after it (AdamW, PR #6074)."""

MAMBA_RULES = {
    ".mixer.out_proj.": "Mamba out_proj: a hidden-to-hidden map, Muon as attention's linear_proj",
    ".mixer.conv1d_weight": "Mamba conv1d: a depthwise filter per channel (3-D), not a map between spaces: AdamW",
    ".mixer.conv1d_bias": "Mamba conv1d bias: AdamW",
    ".mixer.A_log": "Mamba A_log: per-head decay (1-D): AdamW",
    ".mixer.D": "Mamba D: per-head skip gain (1-D): AdamW",
    ".mixer.dt_bias": "Mamba dt_bias: per-head step bias (1-D): AdamW",
    ".mixer.norm.": "Mamba gated norm gain (1-D): AdamW",
}
"""Why each other Mamba mixer parameter goes where it goes (``is_muon_matrix``: 2-D and not an
embedding), the note the report puts on its line; ``in_proj``'s is ``IN_PROJ_RULES``'."""


def routing_note(pattern: str, config: MuonConfig | None = None) -> str:
    """The report's note on a name pattern's routing under ``config`` (None: the defaults); '' for none."""
    config = MuonConfig() if config is None else config
    if ".router." in pattern:
        return ROUTER_RULES[bool(config.router_skip_muon)]
    if ".mixer.in_proj." in pattern:
        return IN_PROJ_RULES[config.mamba_in_proj]
    return next((note for key, note in MAMBA_RULES.items() if key in pattern), "")


def name_pattern(name: str) -> str:
    """``chunk0.module.decoder.layers.11.mlp.linear_fc1.weight`` → ``decoder.layers.*.mlp.linear_fc1.weight``."""
    name = re.sub(r"^chunk\d+\.", "", name)
    name = re.sub(r"^(module\.)+", "", name)
    return re.sub(r"\.\d+\.", ".*.", name)


def buffer_layout(model_chunks, buffer_name: str = "buffers") -> str:
    """``balanced buffer layout (padding 0.4%)``: how the DDP buffers are laid out (megatron-core's
    packing or not) and their padding (alignment included) as a share of their elements."""
    ddp_config = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    if getattr(ddp_config, "use_megatron_fsdp", False):
        return (f"Megatron-FSDP {ddp_config.data_parallel_sharding_strategy} layout (each bucket cut in equal "
                "shards at row boundaries)")
    if any(getattr(p, "is_torch_fsdp2_param", False) for chunk in model_chunks for p in chunk.parameters()):
        return "torch FSDP2 layout (every param cut by rows over DP, torch.chunk)"
    buffers = [b for chunk in model_chunks for b in getattr(chunk, buffer_name, [])]
    if not buffers or not buffers[0].ddp_config.use_distributed_optimizer:
        return "no distributed optimizer (whole matrices on every DP rank)"
    name = "megatron" if all(packed_in_backprop_order(b) for b in buffers) else "balanced"
    # padding: what the buffer holds beyond its params (alignment gaps, shard and bucket ends)
    total = sum(b.numel for b in buffers)
    padded = total - sum(p.numel() for b in buffers for p in b.params)
    return f"{name} buffer layout (padding {100 * padded / total:.1f}%)"


CHOICE_MARK = "megatron_muon_layout_choices"
"""Attribute set on a model chunk by ``megatron.layout.balanced_full_param_layout``: megatron-core's ``BufferKey``
→ ``layout_choice.LayoutChoice`` of each priced buffer (empty without a price); the startup
report prints them (``layout_choice_lines``)."""


def layout_choice_lines(model_chunks) -> list[str]:
    """One line per priced DDP buffer (``megatron.layout.CHOICE_MARK``, set when the balanced layout
    was chosen on Megatron's args): the chosen layout's bucket count and predicted exposed DDP
    communication (and DP exchange), beside whole matrices' and megatron-core's own layout's."""
    lines = []
    for chunk in model_chunks:
        for key, c in getattr(getattr(chunk, "module", chunk), CHOICE_MARK, {}).items():
            param, grad = (str(d).removeprefix("torch.") for d in (key.param_dtype, key.grad_dtype))
            dtypes = f"{param} params, {grad} grads{', experts' if key.is_expert_parallel else ''}"
            chosen, whole, packed = c.priced, c.whole, c.megatron
            step = "Muon step" if chosen.step_s is not None else "DP exchange + NS"
            lines.append(f"  DDP buckets ({dtypes}): {c.chosen}, {_buckets(chosen.buckets)}: exposed DDP "
                         f"{1e3 * chosen.exposed_ddp_s:.1f} ms + {step} {1e3 * chosen.optimizer_s:.1f} ms per "
                         f"iteration predicted (whole matrices: {_buckets(whole.buckets)}, "
                         f"{1e3 * whole.total_s:.1f} ms; megatron-core's layout: {_buckets(packed.buckets)}, "
                         f"{1e3 * packed.total_s:.1f} ms), {c.price.hardware.name}, M {c.price.micro_batches}")
    return lines


def _buckets(n: int) -> str:
    return f"{n} bucket{'s' if n != 1 else ''}"


def _matrix_lines(plan: StepPlan, config: MuonConfig) -> list[str]:
    """One line per name pattern: its count, the shapes NS runs on, the TP mode(s) the plan gives it."""
    classes: dict[str, list[int]] = {}
    for i, lay in enumerate(plan.matrices):
        classes.setdefault(name_pattern(lay.name), []).append(i)
    lines = []
    for pattern, members in classes.items():
        lay = plan.matrices[members[0]]
        modes = sorted({m for i in members for m in plan.tp_modes_of(i)})
        flag = "  NOTE: this name usually belongs to AdamW" if any(s in pattern for s in _SUSPICIOUS) else ""
        if note := routing_note(pattern, config):
            flag = f"  {note}"
        shapes = " + ".join(f"{r}x{c}" for r, c in lay.sub_global_shapes())
        if lay.per_rank:  # --muon-split-qkv-per-head: every TP rank its own whole heads, run there
            kinds = " / ".join(f"{r}x{c}" for r, c in sorted(set(lay.sub_global_shapes())))
            shapes = f"{len(lay.sub_global_shapes())} heads of {kinds} per TP rank"
            modes = ["on its TP rank (per head, no TP traffic)"]
        if lay.tp_blocks is not None:  # per head at TP above the query groups: TP's row cut splits some heads
            subs = lay.sub_matrices()
            cut = sum(1 for sub in subs if sum(hi > lo for lo, hi in sub.tp_rows) > 1)
            shapes = f"{len(subs)} heads of {' / '.join(f'{r}x{c}' for r, c in sorted(set(lay.sub_global_shapes())))}"
            modes = [f"owner (per head: {len(subs) - cut} whole on their TP rank, {cut} cut by TP gathered on one)"]
        lines.append(f"  muon   {pattern:<50} x{len(members):<4} NS on {shapes} ({_ns_text(plan.settings.ns, lay)})  "
                     f"tp mode {'/'.join(modes)}{flag}")
    return lines


def _ns_text(ns, layout) -> str:
    """How this class's Newton–Schulz runs: the method (``gram`` only where it runs, by aspect,
    with its product dtype when that differs), the dtype and, in fp32, torch's matmul precision
    inside the call (high: TF32 on GPUs)."""
    gram = "gram" if ns.gram_dtype is None else f"gram in {str(ns.gram_dtype).removeprefix('torch.')}"
    methods = sorted({gram if runs_gram(ns.method, r, c) else "standard" for r, c in layout.sub_global_shapes()})
    dtype = str(ns.dtype).removeprefix("torch.")
    precision = f" at {ns.fp32_precision}" if ns.dtype == torch.float32 else ""
    return f"{'/'.join(methods)}, {dtype}{precision}"


def _plan_lines(plans: Mapping[str, StepPlan], config: MuonConfig, what: str) -> list[str]:
    """NS FLOPs and bytes per rank of a full (and a MuonBP block) step, read from the plans."""
    shown = {"full step": plans.get("muon") or plans["full"]}
    if "block" in plans and config.muonbp_period != 1:
        shown["block step"] = plans["block"]
    lines = []
    for kind, plan in shown.items():
        flops, sent = plan.ns_flops, plan.bytes_sent
        mean = sum(flops) / len(flops)
        lines.append(f"  NS per {kind} on {what}'s {len(flops)} ranks: max {max(flops) / 1e12:.2f} TFLOP, mean "
                     f"{mean / 1e12:.2f} (max/mean {max(flops) / mean if mean else 1:.2f})")
        if kind == "full step" and config.tp_mode == "owner" and mean and max(flops) > IMBALANCED * mean:
            lines += _auto_hint(plan, config)
        lines.append(f"  bytes sent per rank per {kind} (plan): max {megabytes(max(sent))}, mean "
                     f"{megabytes(sum(sent) / len(sent))}")
    return lines


def megabytes(nbytes: float) -> str:
    """``0.049 MB``: bytes as the iteration log's ``muon bytes sent`` prints them (10^6 bytes,
    three decimals), so that the report's plan and the log's step read alike (a tiny model's
    all-to-all of 0.047 MiB printed as ``0.0 MiB`` looked like no exchange at all)."""
    return f"{nbytes / 1e6:.3f} MB"


IMBALANCED = 2.0
"""NS max/mean of an owner plan above which the report says what ``auto`` would plan instead."""


def _auto_hint(plan: StepPlan, config: MuonConfig) -> list[str]:
    """One line when ``--muon-tp-mode auto`` would plan this stage with a lower NS max: owner keeps
    each matrix on one rank, which a deep pipeline (few matrices per DP group) cannot balance. Built
    on paper, once, only for an imbalanced plan; nothing about the run changes."""
    from dataclasses import replace

    from ..plan.hardware import hardware_profile
    from ..plan.step_plan import build_step_plan

    hardware = hardware_profile(config.auto_hardware)
    auto = build_step_plan(plan.matrices, dp_size=plan.dp_size, tp_size=plan.tp_size,
                           settings=replace(plan.settings, tp_mode="auto", hardware=hardware))
    flops, mean = auto.ns_flops, sum(auto.ns_flops) / len(auto.ns_flops)
    if max(flops) >= 0.9 * max(plan.ns_flops):
        return []
    return [f"  NOTE: tp mode owner gives one rank a whole matrix here; --muon-tp-mode auto (on {hardware.name}'s "
            f"constants, --muon-auto-hardware) plans this stage at max {max(flops) / 1e12:.2f} TFLOP (max/mean "
            f"{max(flops) / mean:.2f}), the large matrices distributed over their TP groups (at TP 1, over teams of "
            f"DP ranks); exact either way"]


def moved_units(plan: StepPlan) -> int:
    """Units that no DP rank cuts whose DP owner does not hold them: the exchange moves them whole
    (``auto`` and owner's LPT may do that to balance the NS work), so bytes move although
    nothing is cut."""
    if plan.dp_owners is None:
        return 0
    count = 0
    for u, unit in enumerate(plan.units):
        holders = unit.layout.holders(plan.dp_size)
        if plan.team_of(u) is None and len(holders) == 1 and plan.dp_owners[u] not in holders:
            count += 1
    return count


def _cut_line(plan: StepPlan, config: MuonConfig, layout_text: str, what: str = "DP") -> str:
    dp = plan.dp_size
    cut = sum(1 for lay in plan.matrices if lay.dp_ranges is not None and len(lay.holders(dp)) > 1)
    how = ("each goes whole to one DP owner (owner exchange)" if config.dp_mode == "owner"
           else "every DP rank computes every matrix (--muon-dp-mode redundant)")
    teamed = sum(1 for u in range(len(plan.units)) if plan.team_of(u) is not None)
    if teamed:
        how += (f", or by blocks to a team of {plan.team_size} DP ranks that runs it distributed "
                f"({teamed} of {len(plan.units)} units)")
    if moved := moved_units(plan):
        how += (f"; {moved} of {len(plan.units)} units held whole by one DP rank go to another DP rank's "
                "owner to balance NS (sent there and back)")
    return f"  {what} {dp}: {layout_text}: {cut} of {len(plan.matrices)} matrices cut across DP ranks; {how}"


def startup_report(plans: Mapping[str, StepPlan], model_chunks, config: MuonConfig, *, pp_rank: int = 0,
                   pp: int = 1, experts: tuple | None = None, resume: list[str] | None = None,
                   setup=None) -> str:
    """The report's text (see the module docstring) for this rank's pipeline stage.

    ``plans``: the dense optimizer's step plans (``MuonWithAdamW.plans``); TP and DP sizes are theirs.
    ``resume``: lines on what this run changed against the ``--load`` checkpoint's recorded
    settings (``resume_config.report_lines``), appended last; None when nothing is loaded.
    ``experts``: (expert optimizer's plans, EP size) when the model has expert-parallel params;
    their matrices are this EP rank's local experts.
    ``setup``: what preparing the steps did on this rank (``step_setup.SetupReport``); on CUDA its
    line says how much device memory the communicators' warm-up took.
    """
    plan = plans.get("muon") or plans["full"]
    expert_plan = (experts[0].get("muon") or experts[0]["full"]) if experts else None
    adam = Counter(name_pattern(n) for chunk in model_chunks for n, p in chunk.named_parameters()
                   if p.requires_grad and not is_muon_matrix(p))
    local = f" ({len(expert_plan.matrices)} expert matrices of this EP rank)" if experts else ""
    lines = [f"megatron-muon: Muon on {len(plan.matrices) + (len(expert_plan.matrices) if experts else 0)} "
             f"matrices{local}, AdamW on {sum(adam.values())} tensors (pipeline stage {pp_rank} of {pp})"]
    lines += _matrix_lines(plan, config)
    if experts:
        lines += _matrix_lines(expert_plan, config)
    for pattern, count in adam.items():
        note = routing_note(pattern, config)
        lines.append(f"  adamw  {pattern:<50} x{count}" + (f"  {note}" if note else ""))
    if plan.dp_size > 1:
        lines.append(_cut_line(plan, config, buffer_layout(model_chunks)))
        lines += layout_choice_lines(model_chunks)
    lines += _plan_lines(plans, config, "this stage")
    if experts:
        etp, edp, ep = expert_plan.tp_size, expert_plan.dp_size, experts[1]
        lines.append(f"  experts: EP {ep} x expert-TP {etp} x expert-DP {edp}; each expert's fc1 (gate, up) and "
                     "fc2 orthogonalized on its own, never the experts fused")
        if edp > 1:
            lines.append(_cut_line(expert_plan, config, buffer_layout(model_chunks, "expert_parallel_buffers"),
                                   "expert DP"))
        lines += _plan_lines(experts[0], config, "this stage's experts (one EP rank)")
    if config.tp_mode == "blockwise" and plan.tp_size > 1 and config.muonbp_period is None:
        lines.append("  BlockMuon: tp mode blockwise orthogonalizes each TP shard on its own, an update that "
                     "changes with the TP size (not Muon); --muon-tp-mode owner (muon_tp_mode='owner') is exact")
    if config.muonbp_period is None:
        lines.append("  MuonBP: off")
    elif config.muonbp_period == 0:  # t % 0 is undefined: say what step_kind does
        lines.append(f"  MuonBP: period 0: never a full step, every step a block step (BlockMuon: each TP shard "
                     f"orthogonalized on its own, not Muon), lr x {config.muonbp_block_lr_mult} (eta_block / eta_full)")
    elif config.muonbp_period == 1:
        lines.append("  MuonBP: period 1: every step a full step (exactly Muon)")
    else:
        lines.append(f"  MuonBP: period {config.muonbp_period} (a full step when t % P == 0), block-step lr x "
                     f"{config.muonbp_block_lr_mult} (eta_block / eta_full)")
    if config.muonbp_block_grid is not None:
        r, c = config.muonbp_block_grid
        lines.append(f"  MuonBP block grid {r}x{c}: a block step orthogonalizes each local matrix as {r * c} blocks "
                     f"({r} row bands x {c} column bands), each scaled by its own shape")
    if setup is not None and setup.device_bytes is not None:
        lines.append(f"  process groups made and warmed up at build: {setup.groups_warmed} groups of this rank, "
                     f"{setup.team_groups} DP team groups, {setup.seconds:.1f} s; device memory taken "
                     f"{setup.device_bytes / 1e6:.1f} MB ({(setup.device_bytes - setup.allocator_bytes) / 1e6:.1f} MB "
                     "outside PyTorch's caching allocator: NCCL's communicators and peer buffers)")
    return "\n".join(lines + list(resume or []))


def print_startup_report(plans: Mapping[str, StepPlan], model_chunks, config: MuonConfig, *, pp_rank: int = 0,
                         pp: int = 1, experts: tuple | None = None, setup=None) -> None:
    """Print the report once, on global rank 0 (Megatron's log is rank 0's stdout). ``experts``:
    (the expert optimizer's plans, EP size) or None."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(startup_report(plans, model_chunks, config, pp_rank=pp_rank, pp=pp, experts=experts,
                         resume=report_lines(), setup=setup), flush=True)
