"""A resume's expert and virtual-pipeline layout against the checkpoint's: what changed, and how.

megatron-core's ``load_checkpoint`` compares TP and PP with the saved ones, and nothing else of the
layout: EP (``--expert-model-parallel-size``), expert-TP (``--expert-tensor-parallel-size``), the
expert-DP size they leave and the virtual pipeline stages (``--num-virtual-stages-per-pipeline-rank``
/ ``--num-layers-per-virtual-pipeline-stage``) may change without a word. What each change does
depends on how the optimizer state was saved (docs/checkpoints.md, "The changed-configuration
table"):

* kept per param (``fully_reshardable``, which the balanced layout writes; no distributed
  optimizer): exact. Experts are saved under their global number and layers under theirs, so the
  weights and every optimizer-state tensor reshard; an EP or expert-TP change can also change how
  many optimizers Megatron chains (``experts_chained``), which ``checkpoint.rechain_loaded_state``
  undoes at load. ``layout_lines`` says so in the startup report.
* one tensor per bucket of the saving layout (``dp_reshardable``) or a file per rank
  (``--ckpt-format torch``): not loadable; ``resume_config`` refuses it with
  ``resharding.layout_refusal``'s line, naming the first change ``layout_changes`` lists.

Pure functions of two ``args`` namespaces (the checkpoint's and this command line's, after
``validate_args``); imports nothing.
"""

from __future__ import annotations

__all__ = ["expert_dp", "expert_tp", "experts_chained", "layout_changes", "layout_lines", "virtual_stages"]


def expert_tp(run) -> int:
    """``run``'s expert-TP size (``validate_args`` makes a missing one the TP size, as megatron-core does)."""
    return getattr(run, "expert_tensor_parallel_size", None) or getattr(run, "tensor_model_parallel_size", 1)


def expert_dp(run) -> int | None:
    """megatron-core's expert-DP size (``initialize_model_parallel``): the world size over expert-TP
    x EP x PP x the expert weight-remat shards; None without a recorded world size."""
    world = getattr(run, "world_size", None)
    if not world:
        return None
    return world // (expert_tp(run) * getattr(run, "expert_model_parallel_size", 1)
                     * getattr(run, "pipeline_model_parallel_size", 1)
                     * (getattr(run, "expert_gtp_weight_remat_size", None) or 1))


def virtual_stages(run) -> int:
    """Virtual pipeline stages per PP rank, 1 for none (``validate_args`` derives it from either flag)."""
    return getattr(run, "virtual_pipeline_model_parallel_size", None) or 1


def experts_chained(run) -> bool:
    """Whether Megatron gives the experts an optimizer of their own (a chain of two): when they use
    the expert groups, at EP > 1 or an expert-TP size other than TP (megatron-core's linear layers
    mark them ``allreduce`` False); otherwise the dense optimizer holds them. Under Megatron-FSDP
    always: it shards every expert over the expert-DP group (``catalogue.tag_fsdp_experts``)."""
    return bool(getattr(run, "num_experts", None)) and (
        getattr(run, "use_megatron_fsdp", False)
        or getattr(run, "expert_model_parallel_size", 1) > 1
        or expert_tp(run) != getattr(run, "tensor_model_parallel_size", 1))


def layout_changes(saved_args, args) -> list[tuple[str, str, str]]:
    """(the flag with this command line's value, the saved layout, this one) for each of EP,
    expert-TP and the virtual stages that differs, in that order."""
    out = []
    for flag, label, size in (("--expert-model-parallel-size", "EP",
                               lambda run: getattr(run, "expert_model_parallel_size", 1)),
                              ("--expert-tensor-parallel-size", "expert-TP", expert_tp)):
        old, new = size(saved_args), size(args)
        if old != new:
            out.append((f"{flag} {new}", f"{label}{old}", f"{label}{new}"))
    old, new = virtual_stages(saved_args), virtual_stages(args)
    if old != new:
        layers = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        flag = (f"--num-layers-per-virtual-pipeline-stage {layers}" if layers else
                f"--num-virtual-stages-per-pipeline-rank {new}")
        pp = getattr(args, "pipeline_model_parallel_size", 1)
        out.append((flag, *(f"PP{pp} x VPP{v}" if v > 1 else f"PP{pp} without virtual stages" for v in (old, new))))
    return out


def layout_lines(saved_args, args) -> list[str]:
    """The startup report's lines for a change of the virtual stages, EP, expert-TP or expert-DP
    that reshards exactly (the caller has refused the formats that cannot); the expert ones for a
    MoE model only (a dense model's expert-TP follows its TP and means nothing)."""
    lines = []

    def change(label: str, old, new, how: str) -> bool:
        if old != new:
            lines.append(f"{label} {old} -> {new}: {how}")
        return old != new

    change("virtual stages per PP rank", virtual_stages(saved_args), virtual_stages(args),
           "resharded exactly (layers are saved under their global number)")
    if not (getattr(saved_args, "num_experts", None) and getattr(args, "num_experts", None)):
        return lines
    chain = {(True, False): "; the expert optimizer's state is read into the dense optimizer, which holds the "
                            "experts now",
             (False, True): "; the experts' state in the dense optimizer is read into an expert optimizer of "
                            "their own"}.get((experts_chained(saved_args), experts_chained(args)), "")
    experts = "resharded exactly (experts are saved under their global number"
    ep = (getattr(run, "expert_model_parallel_size", 1) for run in (saved_args, args))
    if change("EP", *ep, f"{experts}){chain}"):
        chain = ""  # said once
    change("expert-TP", expert_tp(saved_args), expert_tp(args), f"{experts}; only the order of sums changes){chain}")
    if expert_dp(saved_args) and expert_dp(args):
        change("expert-DP", expert_dp(saved_args), expert_dp(args),
               "resharded exactly (only the order of sums changes)")
    return lines
