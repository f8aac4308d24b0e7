"""The startup report: what the optimizer will do, printed once by global rank 0 when it is built.

A misrouted parameter (a learned position embedding sent to Muon), a TP mode
that is not the one intended, or a DP layout that cuts most matrices are visible here before the
first step, by name pattern (layer numbers folded into ``*``). Llama-3 8B at TP8 x DP8
(``python scripts/dry_run.py --model llama3-8b --tp 8 --dp 8``)::

    megatron-muon: Muon on 128 matrices, AdamW on 67 tensors (pipeline stage 0 of 1)
      muon   decoder.layers.*.mlp.linear_fc2.weight             x32   NS on 4096x14336  tp mode owner
      muon   decoder.layers.*.mlp.linear_fc1.weight             x32   NS on 14336x4096 + 14336x4096  tp mode owner
      muon   decoder.layers.*.self_attention.linear_qkv.weight  x32   NS on 4096x4096 + 1024x4096 + 1024x4096  ...
      muon   decoder.layers.*.self_attention.linear_proj.weight x32   NS on 4096x4096  tp mode owner
      adamw  embedding.word_embeddings.weight                   x1
      adamw  decoder.layers.*.input_layernorm.weight            x32
      ...
      DP 8: megatron buffer layout (padding 0.0%): 65 of 128 matrices cut across DP ranks; each goes
        whole to one DP owner (owner exchange)
      NS per full step on this stage's 64 ranks: max 11.68 TFLOP, mean 10.40 (max/mean 1.12)
      bytes sent per rank per full step (plan): max 796.8 MiB, mean 618.7 MiB
      MuonBP: off

A resumed run ends the report with what it changed against the checkpoint's recorded settings
(``resume_config``), e.g. ``resume from .../iter_0000003: changed against the checkpoint's
settings:`` then ``TP 2 -> 1: resharded exactly ...``, or ``same settings as the checkpoint``.

The figures come from the plans (``parallel.step_plan``), not from running a step.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from ..config import MuonConfig
from ..optimizer import MuonWithAdamW
from ..parallel import comm
from ..parallel.step_plan import plan_step, tp_modes_of

__all__ = ["name_pattern", "startup_report"]

# Parameter names that should never reach Muon; flagged when they do.
_SUSPICIOUS = ("position_embeddings", "embedding", "output_layer")

ROUTER_RULE = ("MoE router: Muon, as upstream megatron-core routes it (every 2-D weight that is not an "
               "embedding or the output layer)")
"""How the report marks an MoE router's weight (``[experts, hidden]``, 2-D): upstream's
emerging-optimizer path (``_is_nonlinear_or_embedding`` in megatron-core 0.19.2's
``optimizer/emerging_optimizers.py``) sends it to Muon, and so does ``is_muon_matrix``."""


def name_pattern(name: str) -> str:
    """``chunk0.module.decoder.layers.11.mlp.linear_fc1.weight`` → ``decoder.layers.*.mlp.linear_fc1.weight``."""
    name = re.sub(r"^chunk\d+\.", "", name)
    name = re.sub(r"^(module\.)+", "", name)
    return re.sub(r"\.\d+\.", ".*.", name)


def buffer_layout(model_chunks, buffer_name: str = "buffers") -> str:
    """``balanced buffer layout (padding 0.4%)``: how the DDP buffers are laid out (megatron-core's
    packing or not) and their padding (alignment included) as a share of their elements."""
    from .optimizer import _packed_in_backprop_order

    ddp_config = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    if getattr(ddp_config, "use_megatron_fsdp", False):
        return (f"Megatron-FSDP {ddp_config.data_parallel_sharding_strategy} layout (each bucket cut in equal "
                "shards at row boundaries)")
    if any(getattr(p, "is_torch_fsdp2_param", False) for chunk in model_chunks for p in chunk.parameters()):
        return "torch FSDP2 layout (every param cut by rows over DP, torch.chunk)"
    buffers = [b for chunk in model_chunks for b in getattr(chunk, buffer_name, [])]
    if not buffers or not buffers[0].ddp_config.use_distributed_optimizer:
        return "no distributed optimizer (whole matrices on every DP rank)"
    name = "megatron" if all(_packed_in_backprop_order(b) for b in buffers) else "balanced"
    # padding: what the buffer holds beyond its params (alignment gaps, shard and bucket ends)
    total = sum(b.numel for b in buffers)
    padded = total - sum(p.numel() for b in buffers for p in b.params)
    return f"{name} buffer layout (padding {100 * padded / total:.1f}%)"


def _matrix_lines(layouts, config: MuonConfig, tp: int, hardware) -> list[str]:
    """One line per name pattern: its count, the shapes NS runs on, the TP mode(s)."""
    classes: dict[str, list] = {}
    for lay in layouts:
        classes.setdefault(name_pattern(lay.name), []).append(lay)
    lines = []
    for pattern, members in classes.items():
        lay = members[0]
        subs = [(local, full, lay.partition_dim if tp > 1 else None)
                for local, full in zip(lay.sub_local_shapes(), lay.sub_global_shapes())]
        modes = sorted(set(tp_modes_of(subs, tp, config.tp_mode, config.num_ns_steps, config.ns_dtype.itemsize,
                                       hardware)))
        flag = "  NOTE: this name usually belongs to AdamW" if any(s in pattern for s in _SUSPICIOUS) else ""
        if ".router." in pattern:
            flag = f"  {ROUTER_RULE}"
        shapes = " + ".join(f"{r}x{c}" for r, c in lay.sub_global_shapes())
        lines.append(f"  muon   {pattern:<50} x{len(members):<4} NS on {shapes}  tp mode {'/'.join(modes)}{flag}")
    return lines


def _plan_lines(inner: MuonWithAdamW, config: MuonConfig, tp: int, dp: int, what: str) -> list[str]:
    """NS FLOPs and bytes per rank of a full (and a MuonBP block) step, from the plans."""
    layouts = [m.layout for m in inner.matrices()]
    ns_bytes = config.ns_dtype.itemsize
    owners = inner._owners if config.dp_mode == "owner" else None
    plans = {"full step": plan_step(layouts, owners, tp, dp, tp_mode=config.tp_mode, steps=config.num_ns_steps,
                                    ns_bytes=ns_bytes, hardware=inner._hardware)}
    if config.muonbp_period is not None and config.muonbp_period != 1:
        plans["block step"] = plan_step(layouts, owners, tp, dp, tp_mode="blockwise", steps=config.num_ns_steps,
                                        ns_bytes=ns_bytes)
    lines = []
    for kind, plan in plans.items():
        flops, sent = plan.ns_flops, plan.bytes_sent
        mean = sum(flops) / len(flops)
        lines.append(f"  NS per {kind} on {what}'s {tp * dp} ranks: max {max(flops) / 1e12:.2f} TFLOP, mean "
                     f"{mean / 1e12:.2f} (max/mean {max(flops) / mean if mean else 1:.2f})")
        lines.append(f"  bytes sent per rank per {kind} (plan): max {max(sent) / 2**20:.1f} MiB, mean "
                     f"{sum(sent) / len(sent) / 2**20:.1f} MiB")
    return lines


def _cut_line(layouts, config: MuonConfig, dp: int, layout_text: str, what: str = "DP") -> str:
    cut = sum(1 for lay in layouts if lay.dp_ranges is not None and len(lay.holders(dp)) > 1)
    how = ("each goes whole to one DP owner (owner exchange)" if config.dp_mode == "owner"
           else "every DP rank computes every matrix (--muon-dp-mode redundant)")
    return f"  {what} {dp}: {layout_text}: {cut} of {len(layouts)} matrices cut across DP ranks; {how}"


def startup_report(inner: MuonWithAdamW, model_chunks, config: MuonConfig, *, tp: int, dp: int,
                   pp_rank: int = 0, pp: int = 1, experts: tuple | None = None,
                   resume: list[str] | None = None) -> str:
    """The report's text (see the module docstring) for this rank's pipeline stage.

    ``resume``: lines on what this run changed against the ``--load`` checkpoint's recorded
    settings (``resume_config.report_lines``), appended last; None when nothing is loaded.

    ``experts``: (expert optimizer's ``MuonWithAdamW``, expert-TP size, expert-DP size, EP size)
    when the model has expert-parallel params; their matrices are this EP rank's local experts.
    """
    from .optimizer import is_muon_matrix  # the routing rule the factory applies

    layouts = [m.layout for m in inner.matrices()]
    expert_layouts = [m.layout for m in experts[0].matrices()] if experts else []
    adam = Counter(name_pattern(n) for chunk in model_chunks for n, p in chunk.named_parameters()
                   if p.requires_grad and not is_muon_matrix(p))
    local = f" ({len(expert_layouts)} expert matrices of this EP rank)" if experts else ""
    lines = [f"megatron-muon: Muon on {len(layouts) + len(expert_layouts)} matrices{local}, AdamW on "
             f"{sum(adam.values())} tensors (pipeline stage {pp_rank} of {pp})"]
    lines += _matrix_lines(layouts, config, tp, inner._hardware)
    if experts:
        lines += _matrix_lines(expert_layouts, config, experts[1], inner._hardware)
    for pattern, count in adam.items():
        lines.append(f"  adamw  {pattern:<50} x{count}")
    if dp > 1:
        lines.append(_cut_line(layouts, config, dp, buffer_layout(model_chunks)))
    lines += _plan_lines(inner, config, tp, dp, "this stage")
    if experts:
        expert_inner, etp, edp, ep = experts
        lines.append(f"  experts: EP {ep} x expert-TP {etp} x expert-DP {edp}; each expert's fc1 (gate, up) and "
                     "fc2 orthogonalized on its own, never the experts fused")
        if edp > 1:
            lines.append(_cut_line(expert_layouts, config, edp, buffer_layout(model_chunks, "expert_parallel_buffers"),
                                   "expert DP"))
        lines += _plan_lines(expert_inner, config, etp, edp, "this stage's experts (one EP rank)")
    if config.tp_mode == "blockwise" and tp > 1 and config.muonbp_period is None:
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
    return "\n".join(lines + list(resume or []))


def print_startup_report(inner: MuonWithAdamW, model_chunks, config: MuonConfig, *, tp_group, dp_group,
                         pp_rank: int = 0, pp: int = 1, experts: tuple | None = None) -> None:
    """Print the report once, on global rank 0 (Megatron's log is rank 0's stdout). ``experts``:
    (expert ``MuonWithAdamW``, expert-TP group, expert-DP group, EP size) or None."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    from .resume_config import report_lines

    if experts is not None:
        experts = (experts[0], comm.group_size(experts[1]), comm.group_size(experts[2]), experts[3])
    text = startup_report(inner, model_chunks, config, tp=comm.group_size(tp_group), dp=comm.group_size(dp_group),
                          pp_rank=pp_rank, pp=pp, experts=experts, resume=report_lines())
    print(text, flush=True)
