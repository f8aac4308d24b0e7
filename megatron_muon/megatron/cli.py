"""Command-line flags: Megatron's ``--muon-*`` flags plus ours, translated into one ``MuonConfig``.

``add_muon_args(parser)`` is an ``extra_args_provider`` for Megatron's
``parse_and_validate_args``. Megatron (0.19.2) already defines the upstream ``--muon-*`` flags;
we keep every one with its upstream meaning and only

- accept ``owner`` and ``auto`` for ``--muon-tp-mode`` (the exact mode, and the cost model's
  per-matrix choice among the exact modes),
- accept ``highest`` for ``--muon-fp32-matmul-prec`` (fp32 Newton–Schulz, like ``high``),
- give every flag the default of its ``MuonConfig`` field (``FIELD_OF_DEST``), on Megatron's
  parser too: two of them differ from upstream 0.19.2's CLI, ``--muon-tp-mode`` and
  ``--muon-momentum``, and the fields ``MuonConfig.tp_mode`` and ``MuonConfig.momentum`` say how
  and why,

and add our own flags in the argument group "megatron-muon". On a parser without Megatron's
flags (plain argparse) the upstream ones are defined here, with upstream 0.19.2's meaning.

``muon_config_from_args(args)`` is the only translation: flags → ``MuonConfig``; it raises
``ValueError`` naming the flag for a value the plugin cannot honour.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

from ..config import DP_LAYOUTS, MAMBA_IN_PROJ, MUONBP_BLOCKS, MuonConfig
from ..core.block_grid import parse_grid
from ..core.newton_schulz import COEFFICIENT_SETS, NS_METHODS

__all__ = ["FIELD_OF_DEST", "add_muon_args", "flag_default", "flag_of", "full_parser", "megatron_default",
           "muon_config_from_args"]

GROUP_TITLE = "megatron-muon"
MB = 2**20
MAX_NS_STEPS = 100
"""``--muon-num-ns-steps`` above this is refused: published Muon recipes run 5 (Keller Jordan's,
megatron-core's default) to 10 steps, and the iteration has converged long before 100, so a larger
value is a typo that costs three matrix products per matrix per step (100000 steps made 4
iterations of the tiny demo take 229 s). The ``MuonConfig`` API itself takes any count >= 1."""

FIELD_OF_DEST = {
    "muon_momentum": "momentum",
    "muon_nesterov": "nesterov",
    "muon_split_qkv": "split_qkv",
    "muon_split_qkv_per_head": "split_qkv_per_head",
    "muon_split_fc1": "split_fc1",
    "muon_mamba_in_proj": "mamba_in_proj",
    "moe_router_skip_muon": "router_skip_muon",
    "muon_scale_mode": "scale_mode",
    "muon_extra_scale_factor": "extra_scale_factor",
    "muon_fp32_matmul_prec": "fp32_matmul_prec",
    "muon_coefficient_type": "coefficient_type",
    "muon_num_ns_steps": "num_ns_steps",
    "muon_ns_method": "ns_method",
    "muon_gram_fp16": "gram_fp16",
    "muon_tp_mode": "tp_mode",
    "muon_auto_hardware": "auto_hardware",
    "muon_dp_mode": "dp_mode",
    "muon_dp_layout": "dp_layout",
    "muon_layout_alpha": "layout_alpha",
    "muon_owner_bucket_size_mb": "owner_bucket_bytes",  # MiB on the command line, bytes in the field
    "muonbp_period": "muonbp_period",
    "muonbp_block_lr_mult": "muonbp_block_lr_mult",
    "muonbp_block": "muonbp_block",
    "muonbp_block_grid": "muonbp_block_grid",
    "muon_log_stats": "log_stats",
}
"""The ``args`` attribute (argparse dest) of each flag → the ``MuonConfig`` field it sets: every
field has one."""

_NONE_UNTIL_GIVEN = ("muon_auto_hardware", "muon_dp_layout", "muon_layout_alpha", "muonbp_period",
                     "muonbp_block_lr_mult", "muonbp_block", "muonbp_block_grid")
"""dests whose parser default is None (not given), so that ``startup_checks`` can refuse them where
they would be ignored; None stands for the field's default (``muon_config_from_args``)."""

_FIELD_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                   for f in dataclasses.fields(MuonConfig)}


def _default(name: str):
    """``MuonConfig``'s default of field ``name``, the one place it is written; cli.py writes none."""
    return _FIELD_DEFAULTS[name]


def _mib(size_bytes: int) -> int | float:
    return size_bytes // MB if size_bytes % MB == 0 else size_bytes / MB


def flag_default(dest: str):
    """The value flag ``dest`` stands for when not given: its ``MuonConfig`` field's default, in
    the flag's unit (MiB for ``--muon-owner-bucket-size-mb``)."""
    field = FIELD_OF_DEST[dest]
    return _mib(_default(field)) if field == "owner_bucket_bytes" else _default(field)


def _on_off(name: str) -> str:
    return "on" if _default(name) else "off"


_TP_MODE_HELP = (
    "How Newton-Schulz runs on tensor-parallel weights. "
    "auto (megatron-muon; exact): plans the stage's TP x DP grid with the exact modes (owner, "
    "duplicated, distributed), per matrix, on the cost model's --muon-auto-hardware constants. "
    "owner (megatron-muon; exact): each TP-sharded matrix is orthogonalized whole on one owner "
    "rank, owners balanced by FLOPs, no cost model. "
    "duplicated / distributed: whole-matrix NS on every rank, or sharded NS with all-reduces "
    "(exact). blockwise: each shard orthogonalized on its own, so the update depends on the TP "
    f"size (BlockMuon, not Muon). Default: {_default('tp_mode')} (MuonConfig.tp_mode says why, and "
    "how it differs from megatron-core's)."
)

# Upstream megatron-core 0.19.2 flags (megatron/training/arguments.py), used only when the parser
# lacks them. Their defaults, as those of our flags, are MuonConfig's (set in add_muon_args).
_UPSTREAM_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (("--muon-momentum",), dict(type=float)),
    (("--muon-no-split-qkv",), dict(action="store_false", dest="muon_split_qkv",
                                    help="Do not split fused QKV weights per query group for Muon.")),
    (("--muon-nesterov",), dict(action="store_true",
                                help="Use Nesterov-style momentum (orthogonalize G.lerp(B, momentum)).")),
    (("--muon-scale-mode",), dict(type=str, choices=["spectral", "unit_rms_norm", "shape_scaling"],
                                  help="Scale of the Muon update by matrix shape.")),
    (("--muon-fp32-matmul-prec",), dict(type=str, choices=["low", "medium", "high"])),
    (("--muon-coefficient-type",), dict(type=str,
                                        help="Newton-Schulz coefficient set: one of "
                                             f"{', '.join(sorted(COEFFICIENT_SETS))}.")),
    (("--muon-num-ns-steps",), dict(type=int, help="Number of Newton-Schulz steps.")),
    (("--muon-tp-mode",), dict(type=str, choices=["blockwise", "duplicated", "distributed", "owner", "auto"])),
    (("--muon-extra-scale-factor",), dict(type=float, help="Additional scale factor for the Muon update.")),
    (("--muon-scalar-optimizer",), dict(type=str, default="adam", choices=["adam", "lion"],
                                        help="Optimizer for non-matrix parameters (megatron-muon: "
                                             "adam only, as AdamW).")),
]


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return parser._option_string_actions.get(flag)


def _add_choice(action: argparse.Action, choice: str) -> None:
    if action.choices is not None and choice not in action.choices:
        action.choices = [*action.choices, choice]


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Extend Megatron's ``--muon-*`` flags and add megatron-muon's; returns ``parser``.

    Idempotent: a second call on the same parser changes nothing.
    """
    if _action(parser, "--muon-dp-mode") is not None:
        return parser
    group = parser.add_argument_group(GROUP_TITLE, "Muon optimizer plugin (--optimizer muon)")

    for flags, kwargs in _UPSTREAM_FLAGS:  # all already there under Megatron's parser
        if _action(parser, flags[0]) is None:
            group.add_argument(*flags, **kwargs)

    tp_mode = _action(parser, "--muon-tp-mode")
    _add_choice(tp_mode, "owner")
    _add_choice(tp_mode, "auto")
    tp_mode.help = _TP_MODE_HELP

    prec = _action(parser, "--muon-fp32-matmul-prec")
    _add_choice(prec, "highest")
    prec.help = (
        "Newton-Schulz precision. medium: bf16 matmuls, as upstream; high / highest: fp32. Default: "
        f"{_default('fp32_matmul_prec')}. low is rejected with --optimizer muon: torch has no 'low' "
        "float32 matmul precision (upstream's low silently runs at whatever precision is already set)."
    )

    _action(parser, "--muon-num-ns-steps").help = (
        f"Newton-Schulz steps per Muon update, 1 to {MAX_NS_STEPS} (published recipes run 5 to 10). Default "
        f"{_default('num_ns_steps')}."
    )

    _action(parser, "--muon-momentum").help = (
        f"Muon momentum (EMA of the gradient). Default {_default('momentum')} (MuonConfig.momentum says "
        "how it differs from megatron-core's CLI)."
    )

    group.add_argument(
        "--muon-split-fc1", action="store_true", dest="muon_split_fc1",
        help="Orthogonalize the gate and up halves of a fused SwiGLU fc1 weight separately "
             f"(upstream #6688). Default: {_on_off('split_fc1')}.",
    )
    group.add_argument(
        "--muon-split-qkv-per-head", action="store_true", dest="muon_split_qkv_per_head",
        help="Orthogonalize each head of a fused QKV weight on its own (upstream PR #6326's flag): every "
             "query head and each query group's k and v head is a head_dim x hidden matrix, its update scaled "
             "by that shape. Under TP each rank holds whole heads, so they run on their TP rank with no TP "
             "traffic in any mode; with fewer query groups than TP ranks a head TP's row cut splits is gathered "
             "on one of its holders by the owner exchange. MLA's up-projections alike: per head its q rows "
             "(nope and rope) one matrix, its k-nope rows and its v rows one each. Needs the per-group QKV "
             f"split. Default: {_on_off('split_qkv_per_head')}.",
    )
    group.add_argument(
        "--muon-no-split-qkv-per-head", action="store_false", dest="muon_split_qkv_per_head",
        help="Orthogonalize Q, K and V per query group, not per head (the default).",
    )
    group.add_argument(
        "--muon-no-split-fc1", action="store_false", dest="muon_split_fc1",
        help="Orthogonalize a fused SwiGLU fc1 weight as one matrix (like --muon-no-split-qkv).",
    )
    group.add_argument(
        "--muon-mamba-in-proj", type=str, choices=list(MAMBA_IN_PROJ),
        help="What a Mamba mixer's fused in_proj gets. split: Muon by role, z, x, B, C and dt "
             "orthogonalized apart (megatron-core's partition_sizes), five maps of different roles as Q, K "
             "and V are. whole: Muon on the fused matrix, as megatron-core 0.19.2 does. adamw: AdamW, as "
             "megatron-core's main branch after 0.19.2 does (use_muon=False, upstream PR #6074). Default: "
             f"{_default('mamba_in_proj')}.",
    )
    group.add_argument(
        "--muon-split-mamba-in-proj", action="store_const", const="split", dest="muon_mamba_in_proj",
        help="The same as --muon-mamba-in-proj split (the flag before the choice existed).",
    )
    group.add_argument(
        "--muon-no-split-mamba-in-proj", action="store_const", const="whole", dest="muon_mamba_in_proj",
        help="The same as --muon-mamba-in-proj whole (the flag before the choice existed).",
    )
    if _action(parser, "--moe-router-skip-muon") is None:  # megatron-core's main branch defines it itself
        group.add_argument(
            "--moe-router-skip-muon", action="store_true",
            help="Send MoE router weights to AdamW instead of Muon: upstream's flag and meaning (megatron-core's "
                 "main branch after 0.19.2, PR #6504; 0.19.2 lacks it and orthogonalizes the router's "
                 "[experts, hidden] weight as any hidden matrix). Default: "
                 f"{_on_off('router_skip_muon')}, as upstream. Refused without MoE layers.",
        )
    group.add_argument(
        "--muon-auto-hardware", type=str, default=None, metavar="PROFILE_OR_JSON",
        help="Hardware constants of the cost model that --muon-tp-mode auto uses to pick each "
             "matrix's mode (refused with the other modes, which do not use it). detect: this device "
             "(H200: h200; any other CUDA GPU: h100-sxm; no GPU: cpu-gloo, an order-of-magnitude "
             "CPU/gloo default); a profile: h100-sxm, h200, cpu-gloo; or the path of a JSON file of the "
             "Hardware fields, as scripts/bench/calibrate_hardware.py writes it. Default: "
             f"{_default('auto_hardware')}.",
    )
    group.add_argument(
        "--muon-ns-method", type=str, choices=list(NS_METHODS),
        help="How Newton-Schulz runs. standard: the quintic on the matrix. gram: Gram Newton-Schulz "
             "(Dao AI Lab; DeepSpeed's default), the same polynomial on the short side's Gram matrix, "
             "restarted once, on matrices at least 1.75 times as long as wide (the standard iteration "
             "on the others); with --muon-tp-mode distributed it all-reduces the Gram once per "
             f"restart block instead of once per step. Default: {_default('ns_method')}.",
    )
    group.add_argument(
        "--muon-gram-fp16", action="store_true",
        help="Run Gram Newton-Schulz's products in fp16 instead of bf16 (DeepSpeed's choice: 8x finer "
             "rounding; after normalization every value is O(1), well inside fp16's range). Only with "
             "--muon-ns-method gram and --muon-fp32-matmul-prec medium.",
    )
    group.add_argument(
        "--muon-dp-mode", type=str, choices=["owner", "redundant"],
        help="How data-parallel ranks share Newton-Schulz. owner: each matrix is orthogonalized on "
             "one DP rank, owners load-balanced, results sent back (with --use-distributed-optimizer "
             "the rank's pieces are gathered to the owner first). redundant: every DP rank "
             "orthogonalizes every matrix (same result, more compute; for comparison; not with "
             f"--use-distributed-optimizer). Default: {_default('dp_mode')}.",
    )
    group.add_argument(
        "--muon-dp-layout", type=str, default=None, choices=list(DP_LAYOUTS),
        help="With --use-distributed-optimizer, how Megatron's DDP buffer is laid out. balanced: "
             "every Muon matrix lies whole inside one DP rank's shard of its bucket (Canzona's "
             "alpha-balanced partition; AdamW params fill in around them), so no matrix travels "
             "between DP ranks. megatron: megatron-core's own layout, which cuts matrices at shard "
             "boundaries; the cut ones are reassembled on one DP owner every step. priced: per buffer, "
             "whichever of balanced, megatron and megatron-core's buckets with cuts at row boundaries "
             "the iteration model predicts cheapest: exposed DDP reduce-scatter / all-gather plus the "
             "Muon step's plan, on --muon-auto-hardware's profile (the startup report prints the "
             "figures; whole matrices when Megatron's args give no batch to price). Default: "
             f"{_default('dp_layout')}. Refused without --use-distributed-optimizer and under "
             "Megatron-FSDP or FSDP2 (which lay out their own buffers).",
    )
    group.add_argument(
        "--muon-layout-alpha", type=float, default=None, metavar="ALPHA",
        help="Balanced layout: weight in [0, 1] of Newton-Schulz balance across DP ranks against "
             "padding of the buffer (1: NS balance only, 0: no padding beyond alignment). Default "
             f"{_default('layout_alpha')}, from the Llama-3 layout table in docs/performance.md. Refused "
             "where the balanced layout is not used.",
    )
    group.add_argument(
        "--muon-owner-bucket-size-mb", type=float,
        help="Cap, in MiB of full matrices, on one micro-group of the owner pipeline, at the DP and "
             "the TP level (the pipeline keeps a few micro-groups alive, so this bounds the extra "
             f"memory of the owner exchanges). Default {flag_default('muon_owner_bucket_size_mb')}.",
    )
    group.add_argument(
        "--muonbp-period", type=int, default=None, metavar="P",
        help="MuonBP (Khaled et al., arXiv 2510.16981): orthogonalize each rank's TP block (no TP "
             "traffic) on most steps and the whole matrix, with --muon-tp-mode, when the applied-"
             "step count t (0-based) has t %% P == 0. Default: off (plain Muon). 1 is exactly Muon, "
             "0 never takes a full step (BlockMuon). The paper found P=5 best.",
    )
    group.add_argument(
        "--muonbp-block-lr-mult", type=float, default=None,
        help="Learning rate of MuonBP's block steps as a multiple of --lr (η_block / η_full; full "
             f"steps use the scheduled lr). Default {_default('muonbp_block_lr_mult')}: the paper's theory "
             "puts the optimal ratio between 1 and 1/sqrt(r·c) for an r×c block grid, and we found no "
             "ratio stated for its experiments; with block-shape RMS matching (--muon-scale-mode on the "
             "block's shape) equal rates give block and full updates the same per-entry RMS. Refused "
             "without --muonbp-period and with period 1 (no block steps).",
    )
    group.add_argument(
        "--muonbp-block", type=str, default=None, choices=list(MUONBP_BLOCKS),
        help="What a MuonBP block step orthogonalizes. tp_shard: each rank's TP shard (BlockMuon's block; "
             "a matrix the distributed optimizer cuts across DP ranks is reassembled on one DP rank "
             "first). local: the paper's block, the TP shard intersected with this DP rank's range "
             "(per sub-matrix its whole rows, each partial row apart), so a block step sends nothing. "
             f"Default {_default('muonbp_block')}: its update does not depend on where the DP layout "
             "cuts a matrix; the two agree where matrices lie whole on one DP rank. Refused without "
             "--muonbp-period and with period 1 (no block steps).",
    )
    group.add_argument(
        "--muonbp-block-grid", type=str, default=None, metavar="RxC",
        help="With --muonbp-period and --muonbp-block tp_shard: on block steps, orthogonalize each "
             "local matrix (a TP shard, or a matrix every TP rank holds whole) as R x C blocks, each "
             "scaled by its own shape, still without communication: any block count at TP1, finer "
             "blocks than the layout's at TP > 1. R and C must divide every local matrix (the "
             "split QKV and fc1 parts included). Default: the local matrix itself (BlockMuon's block).",
    )
    group.add_argument(
        "--muon-reset-optimizer-state", action="store_true",
        help="With --load: load the checkpoint's model weights, iteration, LR/WD schedule and RNG "
             "state, and start the optimizer state afresh (Muon momentum and Adam moments zero, Adam's "
             "step 0, the MuonBP phase 0, fp32 main params from the loaded weights). Megatron's "
             "--no-load-optim also skips the LR schedule, which then restarts from warmup. Works with "
             "upstream's optimizers too (e.g. --optimizer dist_muon loading a megatron-muon checkpoint). "
             "For one resume: drop it once the run has saved again (docs/checkpoints.md).",
    )
    group.add_argument(
        "--muon-load-upstream-optimizer", action="store_true",
        help="With --optimizer muon and --load: resume a checkpoint written by megatron-core's own Muon "
             "(--optimizer muon or dist_muon without megatron-muon): weights, iteration, LR/WD schedule "
             "and RNG as a resume, Muon's momentum buffers and Adam's moments and step carried over into "
             "megatron-muon's optimizer (docs/checkpoints.md#migration-from-megatron-cores-muon).",
    )
    group.add_argument(
        "--muon-log-stats", action="store_true",
        help="Append to Megatron's iteration log line what the last optimizer step did: the TP "
             "mode, its kind (muon, or MuonBP's full / block), the bytes megatron-muon sent from the "
             "logging rank, the wall time of its orthogonalize step, the Muon parameters' global norm "
             "and the applied update's RMS per kind of step, and per matrix class (attention, mlp, "
             "expert, ...) the RMS of scale * NS(M) before the learning rate beside the RMS the scale "
             "mode gives an orthogonal update, and the orthogonality residual of a fixed sample's NS "
             "output (docs/flags.md, last section; one all-reduce on the iterations that print; "
             "TensorBoard / W&B get the same scalars as muon/param_norm, muon/update_rms_<kind>, "
             "muon/<class>/update_rms, matched_rms, residual).",
    )
    # Every default, of upstream's flags (Megatron's parser or the fallback above) and of ours:
    # MuonConfig's, but None for the flags that must tell "not given" apart.
    parser.set_defaults(**{dest: flag_default(dest) for dest in FIELD_OF_DEST if dest not in _NONE_UNTIL_GIVEN})
    return parser


@functools.lru_cache(maxsize=1)
def full_parser() -> argparse.ArgumentParser:
    """Megatron's full parser (as ``parse_args`` builds it) with megatron-muon's flags: every flag a
    run can take, its option strings and its default (``yaml_config`` checks configs against it)."""
    from megatron.training import arguments

    # add_muon_args is idempotent, so this is right whether or not hooks.install() has run.
    return add_muon_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def flag_of(dest: str) -> str:
    """The option string that sets ``args.<dest>`` (its first; ``layernorm_epsilon``: ``--norm-epsilon``)."""
    for action in full_parser()._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")


def megatron_default(dest: str):
    """The parser's default of ``args.<dest>``: what a run that does not give the flag has."""
    return full_parser().get_default(dest)


def muon_config_from_args(args: argparse.Namespace) -> MuonConfig:
    """The ``MuonConfig`` the flags in ``args`` describe; ``ValueError`` names a bad flag.

    A flag missing from ``args``, or None there, takes its field's default (``MuonConfig``'s,
    which are the CLI's). The flags whose parser default is None (not given) are the ones
    ``startup_checks`` refuses where they would be ignored. ``args`` may be any object with these
    attributes: ``get_megatron_muon_optimizer`` passes an upstream ``OptimizerConfig``, whose own
    ``muon_*`` values (its defaults included) are then the ones used.
    """
    if getattr(args, "muon_scalar_optimizer", None) not in (None, "adam"):
        raise ValueError(
            f"--muon-scalar-optimizer: megatron-muon updates non-matrix parameters with AdamW "
            f"only; expected adam, got {args.muon_scalar_optimizer!r}"
        )
    if getattr(args, "muon_fp32_matmul_prec", None) == "low":
        raise ValueError(
            "--muon-fp32-matmul-prec: 'low' is not supported (torch has no 'low' float32 matmul "
            "precision); use medium (bf16 Newton-Schulz) or high/highest (fp32)"
        )
    steps = getattr(args, "muon_num_ns_steps", None)
    if isinstance(steps, int) and steps > MAX_NS_STEPS:
        raise ValueError(f"--muon-num-ns-steps: expected an integer in [1, {MAX_NS_STEPS}], got {steps} (published "
                         "Muon recipes run 5 to 10 steps; each step costs three matrix products per matrix)")
    given = {}
    for dest, field in FIELD_OF_DEST.items():
        value = getattr(args, dest, None)
        if value is not None:
            if field == "owner_bucket_bytes":
                if not math.isfinite(value):  # int(round(...)) would raise, naming no flag
                    raise ValueError(f"--muon-owner-bucket-size-mb: expected a finite positive size in MiB, "
                                     f"got {value}")
                value = int(round(value * MB))
            elif field == "muonbp_block_grid" and isinstance(value, str):
                value = parse_grid(value)  # "RxC"; a one-line ValueError naming the flag
            given[field] = value
    return MuonConfig(**given)
