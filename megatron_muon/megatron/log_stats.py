"""What ``--muon-log-stats`` adds to Megatron's training log (the training_log hook, ``hooks.py``).

* ``stats_text``: the iteration line's tail, what the last optimizer step did (its kind: muon, or
  MuonBP's full / block; bytes sent; orthogonalize time), for the dense optimizer and the experts';
* ``norm_scalars`` / ``norm_text``: the Muon parameters' global norm and each step kind's update
  RMS, reduced over every rank by one all-reduce on logging iterations;
* ``muon_scalars`` / ``write_scalars``: the same figures as ``muon/*`` scalars for Megatron's
  TensorBoard and W&B writers.
"""

from __future__ import annotations

import torch

__all__ = ["muon_scalars", "norm_scalars", "norm_text", "stats_text", "write_scalars"]

_STEP_KINDS = ("muon", "full", "block")


def norm_scalars(optimizers) -> dict[str, float]:
    """The Muon parameters' global norm after the last step (``muon/param_norm``) and each step
    kind's update RMS (``muon/update_rms_<kind>``, kinds that have run): every optimizer's
    ``step_norms`` summed over all ranks by one all-reduce of a fixed kinds x 3 table. A
    collective: every rank calls it on the same iterations (``_wrap_training_log``'s condition
    reads only the run's arguments)."""
    import math

    import torch.distributed as dist

    from ..parallel.devices import group_device

    device = group_device(None)
    table = torch.zeros(len(_STEP_KINDS), 3, dtype=torch.float32, device=device)
    for inner in optimizers:
        for kind, sums in inner.step_norms.items():
            table[_STEP_KINDS.index(kind)] += sums.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    rows = table.tolist()  # the one host read, on a logging iteration
    out = {}
    last = next((o.last_step_kind for o in optimizers if o.last_step_kind is not None), None)
    if last is not None:
        out["muon/param_norm"] = math.sqrt(rows[_STEP_KINDS.index(last)][0])
    out.update({f"muon/update_rms_{kind}": math.sqrt(update_sq / n)
                for kind, (_, update_sq, n) in zip(_STEP_KINDS, rows) if n > 0})
    return out


def norm_text(norms: dict[str, float]) -> str:
    """`` muon param norm: 12.35 | muon update rms: full 1.2E-03, block 4.5E-04 |`` (empty without norms)."""
    if not norms:
        return ""
    rms = ", ".join(f"{k.removeprefix('muon/update_rms_')} {v:.3E}" for k, v in norms.items()
                    if k.startswith("muon/update_rms_"))
    return f" muon param norm: {norms.get('muon/param_norm', float('nan')):.4f} | muon update rms: {rms} |"


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
