"""What ``--muon-log-stats`` adds to Megatron's training log (the training_log hook, ``hooks.py``).

* ``stats_text``: the iteration line's tail, what the last optimizer step did (its kind: muon, or
  MuonBP's full / block; bytes sent; orthogonalize time), for the dense optimizer and the experts';
* ``norm_scalars`` / ``norm_text``: the Muon parameters' global norm and each step kind's update
  RMS, reduced on logging iterations only, over the groups Megatron's grad norm is reduced over
  (``MuonWithAdamW.norm_groups``: its grad-stats group — the whole job with the distributed
  optimizer, TP x PP without it — plus DP where pieces are cut over DP);
* ``norm_scalars``, per matrix class (attention, mlp, expert, ...: ``core.update_stats``), from the
  last step that recorded norms: the RMS of the update before the learning rate, ``scale·NS(M)``,
  beside the RMS an exactly orthogonal ``NS(M)`` would give under ``--muon-scale-mode`` /
  ``--muon-extra-scale-factor`` (``matched``), and the orthogonality residual ``‖XᵀX − I‖_F/√k``
  of the NS output of a fixed sample of matrices (``parallel.step_stats``): ``muon/<class>/*``;
* ``muon_scalars`` / ``write_scalars``: the same figures as ``muon/*`` scalars for Megatron's
  TensorBoard and W&B writers;
* ``reads_norms`` / ``plan_next_step``: which iterations read the norms, and so which optimizer
  steps compute them (``MuonWithAdamW.record_norms``): no step computes norms that no log reads,
  and no iteration that does not log makes a collective or a host read for them.

Which steps compute the norms. Megatron's loop runs ``train_step`` for the iteration it then logs
as ``iteration`` (``args.curr_iteration`` + 1) and calls ``training_log`` after every step, on
every rank; the training_log hook decides there, from the run's arguments and the iteration
alone (so every rank decides alike), whether the *next* step records its norms
(``plan_next_step``). The first step of a process records them when the run logs them at all
(Megatron prints its first iteration). A log shows, for each step kind, the last such step's
update RMS: with MuonBP (period P) the steps of the P iterations up to a log iteration record,
which hold a step of each kind; without MuonBP the logged step alone. Only when a found-inf skip
(``--loss-scale``) falls inside those P iterations can a kind's figure be older than the one an
every-step count would show.
"""

from __future__ import annotations

import torch

from ..core.update_stats import CLASSES, FIELDS, class_figures

__all__ = ["muon_scalars", "norm_scalars", "norm_text", "norms_for_log", "plan_first_step", "plan_next_step",
           "reads_norms", "stats_text", "write_scalars"]

_STEP_KINDS = ("muon", "full", "block")


def norm_scalars(optimizers) -> dict[str, float]:
    """The Muon parameters' global norm after the last step (``muon/param_norm``), each step
    kind's update RMS (``muon/update_rms_<kind>``, kinds that have run), and per matrix class
    ``muon/<class>/update_rms``, ``muon/<class>/matched_rms`` and, where sampled,
    ``muon/<class>/residual`` (``core.update_stats``).

    Every optimizer's ``step_norms`` (a fixed kinds x 3 table) is all-reduced over its
    ``norm_groups`` and its ``class_stats`` (a fixed classes x 5 table) over ``stats_groups``, one
    all-reduce per group for the tables that share them (usually all: dense and experts under the
    distributed optimizer share Megatron's grad-stats group), then summed. A collective: every
    rank calls it on the same iterations (``reads_norms`` reads only the run's arguments and the
    iteration)."""
    import math

    import torch.distributed as dist

    from ..parallel.devices import group_device

    device = group_device(None)
    kinds, width = len(_STEP_KINDS) * 3, len(CLASSES) * len(FIELDS)
    tables: list[tuple[tuple, torch.Tensor]] = []  # (groups, [norms | classes]), in the chain's order on every rank

    def entry(groups: tuple) -> torch.Tensor:
        found = next((t for g, t in tables if len(g) == len(groups) and all(a is b for a, b in zip(g, groups))), None)
        if found is None:
            found = torch.zeros(kinds + width, dtype=torch.float32, device=device)
            tables.append((groups, found))
        return found

    for inner in optimizers:
        norms = entry(tuple(inner.norm_groups))[:kinds].view(len(_STEP_KINDS), 3)
        for kind, sums in inner.step_norms.items():
            norms[_STEP_KINDS.index(kind)] += sums.to(device)
        classes = entry(stats_groups(inner))[kinds:]
        if getattr(inner, "class_stats", None) is not None:
            classes += inner.class_stats.reshape(-1).to(device)
    for groups, table in tables:
        for group in groups:
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(table, group=group)
    # the one host read, on a logging iteration (no optimizer with norms: nothing to read)
    total = sum(table for _, table in tables).tolist() if tables else [0.0] * (kinds + width)
    rows = [total[3 * k:3 * k + 3] for k in range(len(_STEP_KINDS))]
    out = {}
    last = next((o.last_step_kind for o in optimizers if o.last_step_kind is not None), None)
    if last is not None:
        out["muon/param_norm"] = math.sqrt(rows[_STEP_KINDS.index(last)][0])
    out.update({f"muon/update_rms_{kind}": math.sqrt(update_sq / n)
                for kind, (_, update_sq, n) in zip(_STEP_KINDS, rows) if n > 0})
    per_class = [total[kinds + len(FIELDS) * c:kinds + len(FIELDS) * (c + 1)] for c in range(len(CLASSES))]
    out.update({f"muon/{cls}/{name}": value for cls, figures in class_figures(per_class).items()
                for name, value in figures.items()})
    return out


def stats_groups(inner) -> tuple:
    """The groups ``class_stats`` are all-reduced over: ``norm_groups``, preceded by the DP and the
    TP group where none of them holds it. The update sums are complete within ``norm_groups``
    (each replica counts its own copy), but a residual is measured on one DP owner and one TP rank
    (``parallel.step_stats``), so a replica without it must sum over DP too; a table's columns
    are sums and counts, so the figures stay the same for the sums the extra group multiplies."""
    import torch.distributed as dist

    groups = tuple(inner.norm_groups)
    if not dist.is_initialized():
        return groups
    world = dist.group.WORLD

    def ranks(group) -> set[int]:
        return set(dist.get_process_group_ranks(world if group is None else group))

    cat = inner.catalogue
    extra = tuple(g for g in (cat.dp_group, cat.tp_group)
                  if g is not None and dist.get_world_size(g) > 1 and not any(ranks(g) <= ranks(h) for h in groups))
    return (*extra, *groups)


def reads_norms(margs, iteration: int, first: bool = False) -> bool:
    """Whether ``training_log`` of ``iteration`` reads ``norm_scalars``: the iteration line with
    ``--muon-log-stats`` (every ``--log-interval``, and a process's first iteration, ``first``), or
    Megatron's TensorBoard / W&B writers when configured (every ``--tensorboard-log-interval``).
    The run's arguments and the iteration only: the same answer on every rank."""
    prints = getattr(margs, "muon_log_stats", False) and (iteration % margs.log_interval == 0 or first)
    writers = bool(getattr(margs, "tensorboard_dir", None) or getattr(margs, "wandb_project", None))
    return prints or (writers and iteration % max(1, getattr(margs, "tensorboard_log_interval", 1)) == 0)


def norms_for_log(optimizers, margs, iteration: int, first: bool = False) -> dict[str, float]:
    """``norm_scalars`` on the iterations that read them (``reads_norms``), else nothing (no
    collective, no host read)."""
    return norm_scalars(optimizers) if reads_norms(margs, iteration, first) else {}


def plan_first_step(optimizers, margs) -> None:
    """At build: a process's first step records its norms when the run logs them at all (its
    iteration, from the checkpoint, is not known yet; Megatron prints the first iteration)."""
    writers = bool(getattr(margs, "tensorboard_dir", None) or getattr(margs, "wandb_project", None))
    for inner in optimizers:
        inner.record_norms = bool(getattr(margs, "muon_log_stats", False) or writers)


def plan_next_step(optimizers, margs, iteration: int) -> None:
    """After ``training_log`` of ``iteration``: whether the next step (logged as the next iteration
    that is not in ``--iterations-to-skip``) records its norms — when a log reading them comes
    within the steps that it shows (one step; MuonBP: P, a step of each kind)."""
    skipped = set(getattr(margs, "iterations_to_skip", None) or ())
    for inner in optimizers:
        window = inner.config.muonbp_period or 1
        upcoming, candidate = [], iteration + 1
        while len(upcoming) < window:
            if candidate not in skipped:
                upcoming.append(candidate)
            candidate += 1
        inner.record_norms = any(reads_norms(margs, later) for later in upcoming)


def norm_text(norms: dict[str, float]) -> str:
    """`` muon param norm: 12.35 | muon update rms: full 1.2E-03, block 4.5E-04 |`` (empty without
    norms), then, with per-class figures, `` muon scale*NS rms / matched / residual: attention
    0.183 / 0.200 / 0.094, mlp 0.176 / 0.200 / - |`` (``-``: no sampled matrix measured)."""
    if not norms:
        return ""
    rms = ", ".join(f"{k.removeprefix('muon/update_rms_')} {v:.3E}" for k, v in norms.items()
                    if k.startswith("muon/update_rms_"))
    text = f" muon param norm: {norms.get('muon/param_norm', float('nan')):.4f} | muon update rms: {rms} |"
    classes = [c for c in CLASSES if f"muon/{c}/update_rms" in norms]
    if classes:
        def residual(c: str) -> str:
            value = norms.get(f"muon/{c}/residual")
            return "-" if value is None else f"{value:.3f}"

        text += " muon scale*NS rms / matched / residual: " + ", ".join(
            f"{c} {norms[f'muon/{c}/update_rms']:.3f} / {norms[f'muon/{c}/matched_rms']:.3f} / {residual(c)}"
            for c in classes) + " |"
    return text


def stats_text(optimizers) -> str:
    """`` muon mode: owner | muon step: full | muon bytes sent: 1.23 MB | muon orthogonalize: 4.5 ms |`` for the
    last step of the dense optimizer, and for a model with experts (the chain's second optimizer, over
    the expert-parallel params) `` muon experts bytes sent: 0.45 MB | muon experts orthogonalize: 2.1 ms |``."""
    parts = []
    for k, inner in enumerate(optimizers):
        stats = getattr(inner, "last_step_stats", None)
        if not stats:
            continue
        if k == 0:
            parts.append(
                f" muon mode: {inner.config.tp_mode} | muon step: {stats['kind']} |"
                f" muon bytes sent: {stats['bytes_sent'] / 1e6:.3f} MB |"
                f" muon orthogonalize: {stats['orthogonalize_ms']:.1f} ms ({stats['timing']}) |"
            )
        else:
            parts.append(
                f" muon experts bytes sent: {stats['bytes_sent'] / 1e6:.3f} MB |"
                f" muon experts orthogonalize: {stats['orthogonalize_ms']:.1f} ms ({stats['timing']}) |"
            )
    return "".join(parts)


def muon_scalars(optimizers) -> dict[str, float]:
    """The last step's figures as scalars: ``muon/bytes_sent_mb``, ``muon/orthogonalize_ms``,
    ``muon/ns_tflop`` and ``muon/full_step`` (1 for an exact step, 0 for a MuonBP block step)."""
    out: dict[str, float] = {}
    for k, inner in enumerate(optimizers):
        stats = getattr(inner, "last_step_stats", None)
        if not stats:
            continue
        tag = "muon" if k == 0 else "muon_experts"
        out.update({f"{tag}/bytes_sent_mb": stats["bytes_sent"] / 1e6,
                    f"{tag}/orthogonalize_ms": stats["orthogonalize_ms"],
                    f"{tag}/ns_tflop": stats["ns_flops"] / 1e12,
                    f"{tag}/full_step": 0.0 if stats["kind"] == "block" else 1.0})
    return out


def write_scalars(optimizers, iteration: int, norms: dict[str, float] | None = None) -> None:
    """Hand ``muon_scalars`` and ``norms`` (``norm_scalars``) to Megatron's TensorBoard and W&B
    writers, where configured (Megatron creates them on the last rank only; elsewhere this does
    nothing and reads no CUDA event)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tensorboard is None and wandb is None:
        return
    scalars = {**muon_scalars(optimizers), **(norms or {})}
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
    if wandb is not None and scalars:
        wandb.log(scalars, iteration)
