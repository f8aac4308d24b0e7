"""A ``--load`` checkpoint's recorded settings against this command line: exact, or refused in one line.

Megatron saves the run's ``args`` in every checkpoint, and resumes with whatever the new command
line says; only ``num_layers``, ``hidden_size`` and ``num_attention_heads`` are compared, after
the whole checkpoint has been read. So a changed setting either reshards exactly, or loads
something else without a word (measured on ``tests/e2e/test_resume_config.py``'s tiny GPT and the
CPU demo, docs/checkpoints.md "The changed-configuration table"):

* **TP size and the padded vocabulary.** Megatron pads the vocabulary to a multiple of
  ``--make-vocab-size-divisible-by`` x TP and loads the embedding and the output layer with a
  shape mismatch allowed: rows beyond the new size are dropped, missing ones stay as initialized.
  The demo's byte vocabulary (257) pads to 512 rows at TP2 and 384 at TP1, so its TP2 checkpoint
  resumed at TP1 lost 128 output rows (their logits sit in every softmax): the loss jumped. A
  change of the padded size is refused, naming the divisor that keeps it; equal sizes are exact.
* **The optimizer.** megatron-muon keeps Muon's momentum under Adam's ``exp_avg`` and zeros under
  ``exp_avg_sq`` (``checkpoint.py``), so the keys match Adam's: an Adam checkpoint resumed with
  ``--optimizer muon`` takes Adam's first moment as momentum, and a megatron-muon checkpoint
  resumed with ``--optimizer adam`` divides by sqrt(0) + eps. Both are refused unless the
  optimizer state is not loaded (``--no-load-optim``, ``--finetune``, a release checkpoint).
  A checkpoint of megatron-core's own ``--optimizer muon`` (no megatron-muon settings recorded)
  is named as such (``_from_upstream_muon``; docs/checkpoints.md#migration).
* **The routing.** ``--muon-mamba-in-proj`` to or from ``adamw`` and ``--moe-router-skip-muon``
  move a Mamba ``in_proj`` or an MoE router between Muon and AdamW, whose states differ as above
  (and megatron-core's load compares neither): refused the same way unless the optimizer state
  is not loaded (``_routing_refusal``; reported then, the moved params' state fresh). ``split``
  <-> ``whole`` keeps the weight on Muon and is reported.
* **Model shapes** (``--hidden-size``, ``--num-layers``, ``--ffn-hidden-size``, heads, ...):
  refused naming the first differing flag and both values, before any tensor is read (Megatron
  fails deep inside dist_checkpointing's load, or asserts after it).
* What reshards exactly (TP and PP with the equal padded vocabulary, DP, ``--muon-dp-layout``,
  an exact ``--muon-tp-mode``) and what the user changes on purpose (``--muonbp-period``, another
  Muon hyperparameter) is allowed, and the startup report (``report.py``) lists it.
* **EP, expert-TP, expert-DP and the virtual pipeline stages**: megatron-core compares none of
  them. Where the optimizer state is kept per param (``fully_reshardable``, the balanced layout's
  format, or no distributed optimizer) they reshard exactly: experts and layers are saved under
  their global numbers, and a chain of another length (EP2: a dense and an expert optimizer; EP1:
  one) is rebuilt at load (``checkpoint.rechain_loaded_state``; Megatron's own load raised
  ``KeyError: 'optimizer'``), reported. A ``dp_reshardable`` state (buckets of the saving layout:
  a missing key or a shape mismatch inside the load) and a ``--ckpt-format torch`` checkpoint (a
  file per rank: 'could not load the checkpoint', exit code 0) are refused here, in the preflight
  and in the job alike (``_layout_refusal``).

* **Megatron-FSDP** (``fsdp_dtensor``, one DTensor per param, resharded by torch's distributed
  checkpoint): TP (with the equal padded vocabulary), DP and ``--data-parallel-sharding-strategy``
  reshard exactly (reported). Without the padded vocabulary's size Megatron fails at load
  (``ValueError: Size mismatch``, refused as above); a load without the optimizer state in bf16
  fails in Megatron-FSDP (``NotImplementedError``, refused); ``no_shard`` with ``--swiglu`` cannot
  save or load at all (``startup_checks``).

Only metadata is read: the common state of a ``torch_dist`` checkpoint (one small pickled object
in the DCP files, ``dist_checkpointing.load_common_state_dict``), the ``args`` item of an
``fsdp_dtensor`` checkpoint (``torch.distributed.checkpoint.load`` of that key alone, as Megatron's
``load_args_from_checkpoint`` reads it), or the ``args`` of a ``torch`` checkpoint through a memory
map (its tensors are not read): ``saved_checkpoint.read_saved``, which refuses a directory that
is no readable checkpoint. Called from the ``validate_args`` hook on every rank and so by the
preflight (``check_resume_config``).

* **The DP buffer layout.** A ``dp_reshardable`` optimizer state of ``--muon-dp-layout megatron``
  resumed with ``balanced`` is refused with the line the optimizer's load refuses it with
  (``_dp_layout_refusal``), so the startup report never calls that change exact.
* **The lr / weight decay schedule.** Megatron loads the checkpoint's scheduler and asserts, after
  the load and on every rank, that this run's values equal it unless ``--override-opt-param-scheduler``
  or ``--use-checkpoint-opt_param-scheduler`` says which to keep; a longer ``--train-iters`` alone
  changes the weight decay's length. Refused here, naming the flag (``_schedule_refusal``).
"""

from __future__ import annotations

import contextlib
import io
import math
import types
from pathlib import Path

from .cli import flag_default
from .errors import UserInputError
from .resume_layout import layout_changes, layout_lines
from .saved_checkpoint import Saved, read_saved

__all__ = ["SHAPE_FLAGS", "Saved", "check_optimizer_change", "check_other_optimizer", "check_resume_config",
           "padded_vocab", "preflight_mode", "read_saved", "report_lines"]

SHAPE_FLAGS: tuple[tuple[str, str], ...] = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
    ("swiglu", "--swiglu"),
    ("add_bias_linear", "--disable-bias-linear"),
    ("add_qkv_bias", "--add-qkv-bias"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("normalization", "--normalization"),
    ("position_embedding_type", "--position-embedding-type"),
    ("num_experts", "--num-experts"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("multi_latent_attention", "--multi-latent-attention"),
    ("q_lora_rank", "--q-lora-rank"),
    ("kv_lora_rank", "--kv-lora-rank"),
)
"""(args attribute, flag): the settings that give the model's tensors their shapes (or their
presence), compared in this order; the first difference is refused."""

_HYPERPARAMETERS: tuple[tuple[str, str], ...] = (
    ("muon_momentum", "--muon-momentum"),
    ("muon_nesterov", "--muon-nesterov"),
    ("muon_num_ns_steps", "--muon-num-ns-steps"),
    ("muon_coefficient_type", "--muon-coefficient-type"),
    ("muon_ns_method", "--muon-ns-method"),
    ("muon_gram_fp16", "--muon-gram-fp16"),
    ("muon_scale_mode", "--muon-scale-mode"),
    ("muon_extra_scale_factor", "--muon-extra-scale-factor"),
    ("muon_fp32_matmul_prec", "--muon-fp32-matmul-prec"),
    ("muon_split_qkv", "--muon-no-split-qkv"),
    ("muon_split_qkv_per_head", "--muon-split-qkv-per-head"),
    ("muon_split_fc1", "--muon-split-fc1"),
    ("muonbp_block_lr_mult", "--muonbp-block-lr-mult"),
    ("muonbp_block", "--muonbp-block"),
    ("muonbp_block_grid", "--muonbp-block-grid"),
)
"""Muon settings a resume may change on purpose: the next steps use the new value (reported)."""

_DEFAULT_OF_NONE = {dest: flag_default(dest) for dest in ("muon_dp_layout", "muonbp_block_lr_mult", "muon_tp_mode",
                                                         "muonbp_block", "muon_ns_method")}
"""flags whose parser default is None (not given; refused where they would be ignored): the value
None stands for (their ``MuonConfig`` field's default, as in ``cli.muon_config_from_args``), so a
checkpoint of either version compares alike."""


def _setting(run, name: str):
    """``run``'s value of ``name`` (saved args or this command line), None read as its default."""
    value = getattr(run, name, None)
    return _DEFAULT_OF_NONE.get(name) if value is None else value

_EXACT_TP_MODES = ("owner", "duplicated", "distributed", "auto")

PLUGIN = "megatron_muon"  # hooks.ACTIVE: recorded in the saved args (True: megatron-muon ran the run)


_REPORT: list[str] | None = None  # this job's resume lines for the startup report (None: no resume)
_PREFLIGHT = False  # checking for preflight.py (one process, before torchrun), not inside the job


@contextlib.contextmanager
def preflight_mode():
    """While the preflight validates: what the job leaves to Megatron's load is refused here."""
    global _PREFLIGHT
    saved, _PREFLIGHT = _PREFLIGHT, True
    try:
        yield
    finally:
        _PREFLIGHT = saved


def report_lines() -> list[str] | None:
    """The startup report's lines about the resume this job checked (None when it loads nothing)."""
    return None if _REPORT is None else list(_REPORT)


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """Megatron's ``vocab_size_with_padding``: ``vocab`` rounded up to a multiple of ``divisor * tp``."""
    multiple = divisor * tp
    return math.ceil(vocab / multiple) * multiple


def _vocabularies(saved: Saved) -> range:
    """The unpadded vocabulary sizes consistent with the checkpoint's padded one (the tokenizer is
    the same; its size itself is not saved)."""
    multiple = saved.get("make_vocab_size_divisible_by", 128) * saved.get("tensor_model_parallel_size", 1)
    padded = saved.get("padded_vocab_size")
    return range(max(1, padded - multiple + 1), padded + 1)


def _tokenizer_vocab(args) -> int | None:
    """The tokenizer's own size, as ``build_tokenizer`` finds it in the job (on a copy of ``args``)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    probe = types.SimpleNamespace(**vars(args))
    probe.pad_vocab_size = False  # the size only: build_tokenizer would otherwise set padded_vocab_size
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return int(build_tokenizer(probe).vocab_size)
    except Exception:  # noqa: BLE001 (the job builds it again and reports its own error)
        return None


def _vocab_refusal(saved: Saved, args) -> tuple[str | None, int | None]:
    """(refusal or None, the padded vocabulary both runs have) for a change of TP or of
    ``--make-vocab-size-divisible-by``. Megatron pads only later (``build_tokenizer``, after
    ``validate_args``), so the new size is computed here: from the range of vocabularies the
    checkpoint's padding allows, and only if that leaves it open (the demo's 257 -> 512 at TP2
    allows 384 or 512 at TP1) from the tokenizer, built as the job builds it."""
    old = saved.get("padded_vocab_size")
    if not old:
        return None, None
    divisor, tp = args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    candidates = _vocabularies(saved)
    new = {padded_vocab(v, divisor, tp) for v in candidates}
    if len(new) > 1:
        vocab = _tokenizer_vocab(args)
        if vocab is None:
            return None, None
        candidates, new = [vocab], {padded_vocab(vocab, divisor, tp)}
    if new == {old}:
        return None, old
    got = min(new)
    keep = [d for d in range(1, old // tp + 1)
            if old % (d * tp) == 0 and all(padded_vocab(v, d, tp) == old for v in candidates)]
    saved_at = (f"TP{saved.get('tensor_model_parallel_size', 1)} with --make-vocab-size-divisible-by "
                f"{saved.get('make_vocab_size_divisible_by', 128)}")
    if keep:
        fix = f"pass --make-vocab-size-divisible-by {keep[0]} (TP{tp} x {keep[0]} pads it to {old} rows again)"
    else:
        fix = f"no --make-vocab-size-divisible-by pads it to {old} rows at TP{tp}; resume at a TP size dividing {old}"
    megatron = ("Megatron-FSDP's load would fail on a size mismatch on every rank" if _is_fsdp_dtensor(saved) else
                "Megatron would load the embedding and output layer with rows dropped or left as initialized, "
                "without a word")
    return (f"--tensor-model-parallel-size {tp} with --make-vocab-size-divisible-by {divisor}: the padded vocabulary "
            f"would be {got} rows, but {saved.directory} was saved at {saved_at}, padded to {old} ({megatron}); "
            f"{fix}"), None


def _dp_reshardable_refusal(saved: Saved, args) -> str | None:
    """resharding.py's line for a TP/PP change of a ``dp_reshardable`` optimizer state, found from
    the metadata (the job leaves it to Megatron's own refusal at load, explained the same way)."""
    from .resharding import tp_pp_refusal

    if saved.content_metadata.get("distrib_optim_sharding_type") != "dp_reshardable" or not _loads_optimizer(args):
        return None
    old = (saved.get("tensor_model_parallel_size", 1), saved.get("pipeline_model_parallel_size", 1))
    new = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if old == new or not saved.get("use_distributed_optimizer", False):
        return None
    return tp_pp_refusal(*old, *new, "dp_reshardable")


def _dp_layout_refusal(saved: Saved, args) -> str | None:
    """The line ``MuonDistributedOptimizer.sharded_state_dict`` refuses a load with, said before
    anything is built: a ``dp_reshardable`` optimizer state (each bucket one flat range of the saving
    run's buffer) written on megatron-core's packing (``--muon-dp-layout megatron``), loaded into the
    balanced layout, which places params elsewhere (a checkpoint saved before the flag existed has
    megatron-core's packing too). A balanced checkpoint saved in that format (its layout had fallen
    back to megatron-core's packing) is left to the load, which sees whether this run's buffers pack
    the same way. The load would let one more case through, a balanced layout that happens to pack
    every bucket as megatron-core does; it is refused here too (no such model is known, and
    ``--muon-dp-layout megatron`` gives that run the same buffers)."""
    from .resharding import BALANCED_FROM_DP_RESHARDABLE

    kind = saved.content_metadata.get("distrib_optim_sharding_type")
    if kind != "dp_reshardable" or not _loads_optimizer(args, saved):
        return None
    zero1 = (getattr(args, "use_distributed_optimizer", False) and not getattr(args, "use_megatron_fsdp", False)
             and not getattr(args, "use_torch_fsdp2", False))
    # a checkpoint from before --muon-dp-layout existed (no such arg saved) has megatron-core's packing
    saved_layout = _setting(saved.args, "muon_dp_layout") if hasattr(saved.args, "muon_dp_layout") else "megatron"
    layouts = (saved_layout, _setting(args, "muon_dp_layout"))
    return BALANCED_FROM_DP_RESHARDABLE if zero1 and layouts == ("megatron", "balanced") else None
    # (priced may lay a buffer out as megatron-core packs it; the optimizer's own check,
    # ``packed_like_megatron``, refuses the load where it does not)


def _schedule(run) -> list[tuple[str, str, object, int]] | None:
    """``(what Megatron's OptimizerParamScheduler.load_state_dict calls it, the flag, the value, the
    batch size its step counts are in)`` for each value it compares with the checkpoint's, as
    ``get_optimizer_param_scheduler`` derives them from a run's args; None for a run this does not
    cover (sample-based, a batch-size ramp, a WSD decay, a run that kept an older checkpoint's schedule)."""
    def arg(name: str, default=None):
        return getattr(run, name, default)

    iters, batch = arg("train_iters"), arg("global_batch_size")
    if not iters or not batch or arg("rampup_batch_size") or arg("lr_wsd_decay_iters") or arg(
            "use_checkpoint_opt_param_scheduler", False):
        return None
    decay = arg("lr_decay_iters") or iters  # the saved run's args hold it: Megatron sets it when it is None
    fraction = arg("lr_warmup_fraction")
    warmup = fraction * decay * batch if fraction is not None else (arg("lr_warmup_iters") or 0) * batch
    wd = "--weight-decay" if arg("weight_decay_incr_style", "constant") == "constant" else None
    return [("learning rate", "--lr", arg("lr"), 0), ("minimum learning rate", "--min-lr", arg("min_lr"), 0),
            ("warmup iterations", "--lr-warmup-fraction" if fraction is not None else "--lr-warmup-iters", warmup,
             batch),
            ("total number of iterations", "--lr-decay-iters" if arg("lr_decay_iters") else "--train-iters",
             decay * batch, batch),
            ("learning rate decay style", "--lr-decay-style", arg("lr_decay_style"), 0),
            ("start weight decay", wd or "--start-weight-decay", arg("start_weight_decay"), 0),
            ("end weight decay", wd or "--end-weight-decay", arg("end_weight_decay"), 0),
            ("total number of weight decay iterations", "--train-iters", iters * batch, batch),
            ("weight decay incr style", "--weight-decay-incr-style", arg("weight_decay_incr_style"), 0)]


def _schedule_refusal(saved: Saved, args) -> str | None:
    """A resume that changes the lr or weight decay schedule without saying which one to keep: Megatron
    loads the checkpoint's scheduler and asserts that every value it compares (``_schedule``) equals
    this run's (``OptimizerParamScheduler: class input value ... do not match``, on every rank after
    the load), unless ``--override-opt-param-scheduler`` or ``--use-checkpoint-opt_param-scheduler``.
    A new ``--train-iters`` alone changes the weight decay's length, whatever ``--lr-decay-iters``."""
    loads = not (getattr(args, "finetune", False) or getattr(args, "no_load_optim", False)
                 or saved.directory.name == "release")  # megatron.training.checkpointing.load_checkpoint's rule
    if (not loads or getattr(args, "override_opt_param_scheduler", False)
            or getattr(args, "use_checkpoint_opt_param_scheduler", False)):
        return None
    old, new = _schedule(saved.args), _schedule(args)
    if old is None or new is None:
        return None
    for (what, _, was, old_batch), (_, flag, now, batch) in zip(old, new):
        if was == now:
            continue
        if old_batch != batch:  # the step counts are in samples: a new batch size changes them all
            flag, shown = "--global-batch-size", f"{was} -> {now} samples"
        elif batch and was % batch == 0 and now % batch == 0:
            shown = f"{was // batch} -> {now // batch} iterations"
        else:
            shown = f"{was} -> {now}"
        return (f"{flag}: this run's lr / weight decay schedule differs from the checkpoint's ({what}: {shown}), "
                "which Megatron's load asserts equal (on every rank, after reading the checkpoint); add "
                "--override-opt-param-scheduler (this command line's schedule, from the checkpoint's iteration on) "
                "or --use-checkpoint-opt_param-scheduler (the checkpoint's)")
    return None


def _loads_optimizer(args, saved: Saved | None = None) -> bool:
    """Megatron's load_checkpoint reads the optimizer state (not --no-load-optim, --finetune, release)."""
    if getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return False
    if getattr(args, "muon_reset_optimizer_state", False) or getattr(args, "muon_load_upstream_optimizer", False):
        return False  # reset_state.py: fresh state, or megatron-core Muon's state converted on purpose
    return saved is None or saved.directory.name != "release"


def _is_fsdp_dtensor(saved: Saved) -> bool:
    return saved.content_metadata.get("distrib_optim_sharding_type") == "fsdp_dtensor"


def _fsdp_without_optimizer_refusal(saved: Saved, args) -> str | None:
    """An ``fsdp_dtensor`` checkpoint loaded without its optimizer state in bf16/fp16: Megatron's
    load then copies the loaded model weights into the main weights (``reload_model_params``),
    which Megatron-FSDP does not implement (``NotImplementedError`` at load, on every rank)."""
    if not _is_fsdp_dtensor(saved) or _loads_optimizer(args, saved) or not (
            getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return None
    if getattr(args, "muon_reset_optimizer_state", False) or getattr(args, "muon_load_upstream_optimizer", False):
        return None  # refused by check_load_flags (fsdp_dtensor), with its own line
    how = ("--no-load-optim" if getattr(args, "no_load_optim", False) else "--finetune"
           if getattr(args, "finetune", False) else f"--load {saved.directory} (a release checkpoint)")
    return (f"{how} with --use-megatron-fsdp: megatron-core 0.19.2 loads an fsdp_dtensor checkpoint without its "
            "optimizer state by copying the 16-bit weights into the main weights, which Megatron-FSDP does not "
            "implement (NotImplementedError at load); resume with the optimizer state, or start a new run")


def _kind(optimizer: str, plugin) -> str:
    if optimizer == "muon":
        return "megatron-muon" if plugin else "megatron-core's own Muon"
    return optimizer


def _state_words(kind: str) -> str:
    return {"megatron-muon": "Muon momentum under exp_avg, zeros under exp_avg_sq",
            "adam": "Adam's moments exp_avg and exp_avg_sq",
            "sgd": "SGD momentum"}.get(kind, "its own state")


def _from_upstream_muon(saved: Saved, args) -> str | None:
    """A checkpoint written by megatron-core's own ``--optimizer muon`` (megatron-muon not installed:
    no megatron-muon setting recorded), loaded by megatron-muon. The hook for the migration
    (docs/checkpoints.md#migration): until it converts the state, the optimizer state is refused."""
    if not _loads_optimizer(args, saved):
        return None
    name = "dist_muon" if getattr(saved.args, "use_layer_wise_distributed_optimizer", False) else "muon"
    # the same line as the load hook's refusal (hooks._refuse_foreign_optimizer_state), said before torchrun
    return (f"--load {saved.directory.parent}: written by megatron-core's own Muon (--optimizer {name} without "
            "megatron-muon), whose optimizer state megatron-muon does not read as its own; add "
            "--muon-load-upstream-optimizer (momentum and Adam moments carried over) or --muon-reset-optimizer-state "
            "(fresh optimizer state); docs/checkpoints.md")


def check_optimizer_change(args, saved: Saved, *, plugin: bool) -> None:
    """``UserInputError`` when the checkpoint's optimizer state would be read by another optimizer."""
    old = _kind(saved.get("optimizer", "adam"), saved.get(PLUGIN, False))
    new = _kind(args.optimizer, plugin)
    if old == new or not _loads_optimizer(args, saved):
        return
    if old == "megatron-core's own Muon" and new == "megatron-muon":
        message = _from_upstream_muon(saved, args)
        if message:
            raise UserInputError(message)
        return
    if old == "megatron-muon" and "muon" in args.optimizer:  # megatron-core's own Muon (validate_args
        # has made --optimizer dist_muon into muon with the layer-wise optimizer); the load hook's line
        name = "dist_muon" if getattr(args, "use_layer_wise_distributed_optimizer", False) else args.optimizer
        raise UserInputError(
            f"--load {saved.directory.parent}: written by megatron-muon (--optimizer muon with the plugin), whose "
            f"optimizer state megatron-core's --optimizer {name} cannot read; add --muon-reset-optimizer-state "
            "(weights, iteration and LR schedule; fresh optimizer state) or resume with megatron-muon; "
            "docs/checkpoints.md")
    was = f"--optimizer {saved.get('optimizer', 'adam')}"
    saved_by = f"by megatron-muon ({was})" if old == "megatron-muon" else f"with {was}"
    fix = (f"resume with {was} (an fsdp_dtensor checkpoint loads only with its optimizer state: neither "
           "--muon-reset-optimizer-state nor --no-load-optim reads one)" if _is_fsdp_dtensor(saved) else
           f"resume with {was}, or add --muon-reset-optimizer-state to load the weights, iteration and LR schedule "
           "with fresh optimizer state")
    raise UserInputError(
        f"--optimizer {args.optimizer}: {saved.directory} was saved {saved_by}, whose state ({_state_words(old)}) "
        f"{new} would read as its own; {fix}")


def check_other_optimizer(args) -> None:
    """With an optimizer other than megatron-muon's: refuse a megatron-muon checkpoint's state only
    (everything else is that optimizer's own business, and ``--load`` is not checked further)."""
    from .startup_checks import TRACKER, iteration_directory

    load = getattr(args, "load", None)
    if not load or not (Path(load) / TRACKER).is_file() or not _loads_optimizer(args):
        return
    text = (Path(load) / TRACKER).read_text(errors="replace").strip()
    step = getattr(args, "ckpt_step", None)
    if not (step or text.isdigit() or text == "release"):
        return
    directory = iteration_directory(load, step or (text if text == "release" else int(text)))
    saved = read_saved(directory) if directory.is_dir() else None
    if saved is not None and saved.get(PLUGIN, False):
        check_optimizer_change(args, saved, plugin=False)


def _in_proj(run) -> str | None:
    """``run``'s ``--muon-mamba-in-proj``; a checkpoint saved before the choice existed has its
    ``--muon-(no-)split-mamba-in-proj`` (split or whole), one saved before that flag None."""
    value = getattr(run, "muon_mamba_in_proj", None)
    if value is None and hasattr(run, "muon_split_mamba_in_proj"):
        value = "split" if run.muon_split_mamba_in_proj else "whole"
    return value


def _pattern(run) -> str:
    return getattr(run, "hybrid_layer_pattern", None) or ""


def _routing(saved: Saved, args) -> list[tuple[str, str, str, str]]:
    """``(flag, the checkpoint's value, this run's, the params)`` for each change of the algorithm
    (Muon or AdamW) some params of the saved model get: ``--muon-mamba-in-proj`` to or from adamw
    (a Mamba in_proj), ``--moe-router-skip-muon`` (an MoE router). Split and whole are both Muon."""
    out = []
    old, new = _in_proj(saved.args), _in_proj(args) or "split"
    if "M" in _pattern(saved.args) and old is not None and old != new and "adamw" in (old, new):
        out.append(("--muon-mamba-in-proj", old, new, "Mamba in_proj"))
    old_skip, new_skip = (bool(getattr(run, "moe_router_skip_muon", False)) for run in (saved.args, args))
    if (saved.get("num_experts") or "E" in _pattern(saved.args)) and old_skip != new_skip:
        out.append(("--moe-router-skip-muon", "on" if old_skip else "off", "on" if new_skip else "off", "MoE router"))
    return out


def _algorithm(value: str) -> str:
    """The algorithm a ``_routing`` value gives its params."""
    return "AdamW" if value in ("adamw", "on") else "Muon"


def _shown(flag: str, value: str) -> tuple[str, str, str]:
    """A ``_routing`` value as the refusal says it: (this run's, the checkpoint's, how to resume)."""
    if flag != "--moe-router-skip-muon":
        return f"{flag} {value}", f"with {flag} {value}", f"resume with {flag} {value}"
    given = value == "on"
    return (flag if given else f"{flag} not given", f"with{'' if given else 'out'} {flag}",
            f"resume with{'' if given else 'out'} {flag}")


def _routing_refusal(saved: Saved, args) -> str | None:
    """A resume that moves params between Muon and AdamW with the optimizer state loaded: a Muon
    matrix's state is its momentum under ``exp_avg`` and zeros under ``exp_avg_sq``
    (``checkpoint.py``), which AdamW would divide by sqrt(0) + eps, and AdamW's moments are no
    Muon momentum; megatron-core's load compares neither."""
    changes = _routing(saved, args)
    if not changes or not _loads_optimizer(args, saved):
        return None
    flag, old, new, what = changes[0]
    was, now = _algorithm(old), _algorithm(new)
    state = _state_words("megatron-muon") if was == "Muon" else _state_words("adam")
    fix = (" (an fsdp_dtensor checkpoint loads only with its optimizer state)" if _is_fsdp_dtensor(saved) else
           ", or add --muon-reset-optimizer-state to load the weights, iteration and LR schedule with fresh optimizer "
           "state")
    (subject, _, _), (_, saved_with, resume) = _shown(flag, new), _shown(flag, old)
    return (f"{subject}: {saved.directory} was saved {saved_with}, so its {what} state is {was}'s ({state}), which "
            f"{now} would read as its own; {resume}{fix}")


def _shape_value(run, name: str):
    """``run``'s value of ``name``; without --group-query-attention there are as many query groups
    as heads, whatever num_query_groups says (Megatron fills it in later, at any value)."""
    if name == "num_query_groups" and not getattr(run, "group_query_attention", False):
        return getattr(run, "num_attention_heads", None)
    return getattr(run, name)


def _shape_refusal(saved: Saved, args) -> str | None:
    for name, flag in SHAPE_FLAGS:
        if not hasattr(saved.args, name) or not hasattr(args, name):
            continue
        old, new = _shape_value(saved.args, name), _shape_value(args, name)
        if old != new:
            return (f"{flag}: this command line has {name} = {new}, but {saved.directory} was saved with {name} = "
                    f"{old} (its tensors have that model's shapes; Megatron would fail inside the load); resume with "
                    "the saved value, or point --load at a checkpoint of this model")
    return None


def _layout_refusal(saved: Saved, args) -> str | None:
    """An EP, expert-TP or virtual-stage change of a checkpoint whose format keeps the saving run's
    layout, which megatron-core does not check (only TP and PP): the distributed optimizer's
    ``dp_reshardable`` state (one tensor per bucket of the saving layout: a missing key or a shape
    mismatch inside the load), or ``--ckpt-format torch`` (one file per rank: no file for some ranks,
    and Megatron exits 0 with 'could not load the checkpoint')."""
    from .resharding import layout_refusal

    changes = layout_changes(saved.args, args)
    if not changes:
        return None
    if any(saved.directory.glob("mp_rank_*/model_optim_rng.pt")):  # read_saved's mark of the torch format
        return layout_refusal(*changes[0], saved.directory, "torch")
    if (saved.content_metadata.get("distrib_optim_sharding_type") == "dp_reshardable"
            and saved.get("use_distributed_optimizer", False) and _loads_optimizer(args, saved)):
        return layout_refusal(*changes[0], saved.directory, "dp_reshardable")
    return None


def _wrapper(run) -> str:
    """How a run's optimizer state is laid out in its torch_dist checkpoints, by its flags (a run's or
    a checkpoint's args): ``"megatron_fsdp"`` or ``"distributed"`` (the distributed optimizer's
    formats: Megatron-FSDP's, ZeRO-1's), ``"fsdp2"`` or ``"ddp"`` (both per model param,
    ``optim_state_to_sharding_state``: the same keys and shapes)."""
    if getattr(run, "use_megatron_fsdp", False):
        return "megatron_fsdp"
    if getattr(run, "use_distributed_optimizer", False):
        return "distributed"
    return "fsdp2" if getattr(run, "use_torch_fsdp2", False) else "ddp"


_WRAPPER_FLAGS = {"megatron_fsdp": "--use-megatron-fsdp", "distributed": "--use-distributed-optimizer",
                  "fsdp2": "--use-torch-fsdp2", "ddp": "DDP without --use-distributed-optimizer"}
_PER_PARAM = ("fsdp2", "ddp")


def _wrapper_refusal(saved: Saved, args) -> str | None:
    """The optimizer state of a checkpoint loaded by a run whose wrapper keeps it in the other form,
    which megatron-core 0.19.2 does not compare: a per-param state (``--use-torch-fsdp2``, or DDP without
    the distributed optimizer) read by the distributed optimizer, which takes a checkpoint without a
    sharding type for its ``fully_sharded_model_space`` format (``CheckpointingException:
    ShardedTensor.flattened_range is not supported`` on every rank, measured from an FSDP2 checkpoint);
    a distributed-optimizer state read per param (``KeyError: "optimizer.state.momentum_buffer...
    from model not in state dict"`` on every rank, measured under FSDP2 from a ZeRO-1 checkpoint).
    FSDP2 and DDP without the distributed optimizer read each other's (measured both ways)."""
    old, new = _wrapper(saved.args), _wrapper(args)
    if (_is_fsdp_dtensor(saved) or (old in _PER_PARAM) == (new in _PER_PARAM) or new == "megatron_fsdp"
            or not _loads_optimizer(args, saved)):
        return None  # a Megatron-FSDP run (it reads with --ckpt-format fsdp_dtensor) is not compared here
    how = ("reads it as its fully_sharded_model_space format and fails (CheckpointingException: "
           "ShardedTensor.flattened_range is not supported)" if new not in _PER_PARAM else
           "looks its optimizer state up per param and fails (KeyError: optimizer.state.momentum_buffer... not in "
           "state dict)")
    back = _WRAPPER_FLAGS[old]
    return (f"{_WRAPPER_FLAGS[new]}: {saved.directory} was saved with {back}, whose optimizer state is laid out "
            f"{'per param' if old in _PER_PARAM else 'by the distributed optimizer'}; megatron-core 0.19.2 {how} "
            f"on every rank. Resume with {back}, or add --muon-reset-optimizer-state (weights, iteration and LR "
            "schedule; fresh optimizer state)")


def _changes(saved: Saved, args, padded: int | None) -> list[str]:
    """One line per setting that differs from the checkpoint's and is honoured (the report's)."""
    lines = []

    def size(name: str, label: str, how: str) -> None:
        old, new = saved.get(name, 1), getattr(args, name, 1)
        if old != new:
            lines.append(f"{label} {old} -> {new}: {how}")

    vocab = f"; the padded vocabulary is {padded} rows at both sizes" if padded else ""
    size("tensor_model_parallel_size", "TP", f"resharded exactly (only the order of sums changes){vocab}")
    size("pipeline_model_parallel_size", "PP", "resharded exactly")
    size("data_parallel_size", "DP", "resharded exactly (only the order of sums changes)")
    lines += layout_lines(saved.args, args)  # virtual stages, EP, expert-TP, expert-DP (resume_layout.py)
    old_wrapper, new_wrapper = _wrapper(saved.args), _wrapper(args)
    if old_wrapper != new_wrapper and old_wrapper in _PER_PARAM and new_wrapper in _PER_PARAM:
        lines.append(f"{_WRAPPER_FLAGS[old_wrapper]} -> {_WRAPPER_FLAGS[new_wrapper]}: read exactly (both keep the "
                     "optimizer state per param; only the order of sums changes)")
    if _is_fsdp_dtensor(saved) and getattr(args, "use_megatron_fsdp", False):
        old_s = saved.get("data_parallel_sharding_strategy")
        new_s = getattr(args, "data_parallel_sharding_strategy", None)
        if old_s != new_s:
            lines.append(f"--data-parallel-sharding-strategy {old_s} -> {new_s}: resharded exactly (one DTensor per "
                         "param in the checkpoint; only the order of sums changes)")
    old_layout, new_layout = _setting(saved.args, "muon_dp_layout"), _setting(args, "muon_dp_layout")
    if old_layout != new_layout:
        lines.append(f"--muon-dp-layout {old_layout} -> {new_layout}: another buffer layout, the same update (the "
                     "state is read per param)")
    old_mode, new_mode = _setting(saved.args, "muon_tp_mode"), _setting(args, "muon_tp_mode")
    if old_mode != new_mode:
        same = old_mode in _EXACT_TP_MODES and new_mode in _EXACT_TP_MODES
        lines.append(f"--muon-tp-mode {old_mode} -> {new_mode}: " + (
            "how Newton-Schulz runs only, the same update" if same else
            "another update from here on (blockwise orthogonalizes each TP shard on its own: BlockMuon)"))
    old_period, new_period = saved.get("muonbp_period"), getattr(args, "muonbp_period", None)
    if old_period != new_period:
        now = ("plain Muon (a full step every step)" if new_period in (None, 1) else
               "no full step (BlockMuon)" if new_period == 0 else f"a full step when t % {new_period} == 0")
        lines.append(f"--muonbp-period {'off' if old_period is None else old_period} -> "
                     f"{'off' if new_period is None else new_period}: from the checkpoint's step count t on, {now}")
    old_in_proj, new_in_proj = _in_proj(saved.args), _in_proj(args) or "split"
    if "M" in _pattern(saved.args) and old_in_proj is not None and old_in_proj != new_in_proj:
        lines.append(f"--muon-mamba-in-proj {old_in_proj} -> {new_in_proj}: " + (
            "Mamba in_proj on Muon either way, " + ("by role" if new_in_proj == "split" else "whole") +
            " from the next step on" if "adamw" not in (old_in_proj, new_in_proj) else
            f"Mamba in_proj on {_algorithm(new_in_proj)} from the next step on, its optimizer state fresh"))
    for flag, old, new, what in _routing(saved, args):
        if flag == "--moe-router-skip-muon":
            lines.append(f"{flag} {old} -> {new}: {what} on {_algorithm(new)} from the next step on, its "
                         "optimizer state fresh")
    for name, flag in _HYPERPARAMETERS:
        if hasattr(saved.args, name) and _setting(saved.args, name) != _setting(args, name):
            lines.append(f"{flag} ({name}) {_setting(saved.args, name)} -> {_setting(args, name)}: used from "
                         "the next step on")
    return lines


def check_resume_config(args, directory: str | Path | None) -> None:
    """Compare the checkpoint in ``directory`` (the ``iter_N`` / ``release`` directory ``--load``
    resolves to, or None for a fresh start) with ``args`` (validated, ``--optimizer muon``);
    ``UserInputError`` for what cannot be honoured (module docstring). Records the report's lines.

    A TP/PP change of a ``dp_reshardable`` optimizer state is refused here by the preflight only
    (``preflight_mode``); in the job Megatron's load refuses it and ``resharding.explain_load_error``
    gives the same line (so that line keeps resting on Megatron's real error)."""
    global _REPORT
    _REPORT = None
    if directory is None:
        return
    saved = read_saved(directory)
    if saved is None:
        return
    if saved.get("optimizer") == "muon" and not hasattr(saved.args, PLUGIN):
        message = _from_upstream_muon(saved, args)
        if message:
            raise UserInputError(message)
    else:
        check_optimizer_change(args, saved, plugin=True)
    message = _shape_refusal(saved, args) or _fsdp_without_optimizer_refusal(saved, args)
    if message:
        raise UserInputError(message)
    message = _dp_reshardable_refusal(saved, args)
    if message:
        if not _PREFLIGHT:
            return  # Megatron's load refuses it; the load hook turns that into this line
        raise UserInputError(message)
    message = _layout_refusal(saved, args) or _wrapper_refusal(saved, args)  # megatron-core checks none of these
    if message:  # refused in the job too
        raise UserInputError(message)
    message = _dp_layout_refusal(saved, args) or _schedule_refusal(saved, args) or _routing_refusal(saved, args)
    if message:
        raise UserInputError(message)
    message, padded = _vocab_refusal(saved, args)
    if message:
        raise UserInputError(message)
    changes = _changes(saved, args, padded)
    _REPORT = ([f"  resume from {saved.directory}: changed against the checkpoint's settings:"]
               + [f"    {line}" for line in changes]) if changes else [
        f"  resume from {saved.directory}: same settings as the checkpoint"]
