"""Changing TP or PP between save and load: Megatron's refusal, explained in one line.

Megatron's distributed optimizer writes its state in ``dp_reshardable`` format unless
``--dist-ckpt-optim-fully-reshardable`` is given (``_build_sharded_state_dict_metadata`` in
megatron/training/checkpointing.py). That format stores each grad-buffer bucket as one flat range
of the saving run's TP x PP layout, so it reshards DP only. Loading it at another TP or PP,
megatron-core 0.19.2's ``load_checkpoint`` raises::

    RuntimeError: (TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): not supported
    for DistributedOptimizer with sharding type dp_reshardable. Please use `--ckpt-fully-parallel-save`
    flag during checkpoint saving.

Its advice is wrong for this Megatron: ``--ckpt-fully-parallel-save`` is deprecated and has no effect
(fully parallel save is already the default, ``--no-ckpt-fully-parallel-save`` turns it off), and it
never chose the optimizer format. ``explain_load_error`` turns that error into the fix: save in
``fully_reshardable`` format (``--dist-ckpt-optim-fully-reshardable``), which keys every optimizer
state tensor, Muon's momentum included (as ``exp_avg``, ``checkpoint.py``), by its model param's
sharding, so any TP, PP or DP size loads it (``tests/megatron/test_resharding.py``). Without CUDA no second
flag is needed: ``MuonDistributedOptimizer.sharded_state_dict`` gathers through gloo
(``--distrib-optim-fully-reshardable-mem-efficient``) by itself. See docs/checkpoints.md.

An EP, expert-TP or virtual-stage change megatron-core does not check at all (only TP and PP):
with ``dp_reshardable`` its load fails inside dist_checkpointing (measured: EP2 -> EP1 a
``KeyError`` for a missing bucket key, PP2 x VPP2 -> PP2 a global shape mismatch of a bucket),
and a ``--ckpt-format torch`` checkpoint (one file per rank of the saving layout) is not found for
some ranks, where Megatron prints 'could not load the checkpoint' and exits 0. ``layout_refusal``
is the line ``resume_config`` refuses both with, in the preflight and in the job.

Imports nothing from Megatron: it reads the error's text.
"""

from __future__ import annotations

import re

__all__ = ["BALANCED_FROM_DP_RESHARDABLE", "FULLY_RESHARDABLE_FLAG", "explain_load_error", "layout_refusal",
           "tp_pp_refusal"]

FULLY_RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"
"""The save flag that makes the distributed optimizer's checkpoint loadable at any TP, PP, DP."""

# megatron/training/checkpointing.py (megatron-core 0.19.2), load_checkpoint: mismatch_msg, then
# the refusal for a sharding type outside DistributedOptimizer.checkpoint_fully_reshardable_formats.
_TP_PP_REFUSAL = re.compile(
    r"\(TP, PP\) mismatch after resume \(\((?P<run_tp>\d+), (?P<run_pp>\d+)\) vs "
    r"\((?P<ckpt_tp>\d+), (?P<ckpt_pp>\d+)\) from checkpoint\): not supported for DistributedOptimizer "
    r"with sharding type (?P<kind>\w+)\."
)


BALANCED_FROM_DP_RESHARDABLE = (
    "--muon-dp-layout balanced: this checkpoint's optimizer state is in the dp_reshardable format, written on "
    "megatron-core's packing (--muon-dp-layout megatron, or a balanced layout that fell back to it before its fallback "
    "cut matrices between rows); resume with --muon-dp-layout megatron (and save once with "
    "--dist-ckpt-optim-fully-reshardable to change layouts), or load the weights alone with "
    "--muon-reset-optimizer-state")
"""A ``dp_reshardable`` optimizer state loaded into a balanced layout: the line of
``MuonDistributedOptimizer.sharded_state_dict`` (optimizer.py) at load, and of ``resume_config``
before anything is built, where the checkpoint's metadata tells (its layout was megatron-core's)."""
_BALANCED_REFUSAL = BALANCED_FROM_DP_RESHARDABLE.split(",")[0]


def explain_load_error(error: BaseException) -> str | None:
    """One line saying how to load a checkpoint Megatron refused for a TP/PP change, or None.

    ``error``: what ``megatron.training.checkpointing.load_checkpoint`` raised. Only Megatron's
    ``RuntimeError`` for a (TP, PP) change under a format that reshards DP only is explained;
    anything else gives None (the caller re-raises it unchanged).
    """
    if not isinstance(error, RuntimeError):
        return None
    if str(error).startswith(_BALANCED_REFUSAL):
        return str(error)  # already the line; raised as RuntimeError on every rank, shown once (errors.py)
    match = _TP_PP_REFUSAL.search(str(error))
    if match is None:
        return None
    return tp_pp_refusal(int(match["ckpt_tp"]), int(match["ckpt_pp"]), int(match["run_tp"]), int(match["run_pp"]),
                         match["kind"])


def tp_pp_refusal(saved_tp: int, saved_pp: int, run_tp: int, run_pp: int, kind: str) -> str:
    """The line for a checkpoint saved at ``saved_tp`` x ``saved_pp`` with its distributed optimizer
    state in ``kind`` (a format that reshards DP only), loaded at ``run_tp`` x ``run_pp``; also
    what the preflight says, from the checkpoint's metadata (``resume_config``)."""
    saved = f"TP{saved_tp} x PP{saved_pp}"
    wanted = f"TP{run_tp} x PP{run_pp}"
    return (
        f"this checkpoint was saved at {saved} with the distributed optimizer's state in the "
        f"{kind} format, which reshards DP only, so it cannot be loaded at {wanted} "
        f"(Megatron's hint, --ckpt-fully-parallel-save, is a deprecated no-op). Resume at {saved} "
        f"with {FULLY_RESHARDABLE_FLAG}, save once, and load that checkpoint at {wanted}; or load "
        f"it with fresh optimizer state (--muon-reset-optimizer-state: weights, iteration and LR schedule "
        f"kept; momentum, Adam moments and the MuonBP phase start afresh). See docs/checkpoints.md"
    )


def layout_refusal(flag: str, saved_at: str, wanted: str, directory, kind: str) -> str:
    """The line for a checkpoint in ``directory`` saved at ``saved_at`` (``EP2``, ``PP2 x VPP2``, ...)
    and loaded at ``wanted`` (``flag``: the command line's flag and value that asks for it), where
    ``kind`` is ``dp_reshardable`` (the distributed optimizer's state) or ``torch`` (the format)."""
    if kind == "torch":
        return (f"{flag}: {directory} is a --ckpt-format torch checkpoint saved at {saved_at} (one file per rank of "
                "that layout, which Megatron does not reshard: it finds no file for some ranks, prints 'could not load "
                f"the checkpoint' and exits 0); resume at {saved_at}, and save with --ckpt-format torch_dist "
                f"{FULLY_RESHARDABLE_FLAG} to change layouts later")
    return (f"{flag}: {directory} was saved at {saved_at} with the distributed optimizer's state in the {kind} format, "
            f"whose buckets are the saving run's layout, so it cannot be loaded at {wanted} (Megatron's load fails "
            f"inside dist_checkpointing on a missing key or a shape mismatch); resume at {saved_at} with "
            f"{FULLY_RESHARDABLE_FLAG}, save once, and load that checkpoint at {wanted}; or load it with fresh "
            "optimizer state (--muon-reset-optimizer-state: weights, iteration and LR schedule kept)")
