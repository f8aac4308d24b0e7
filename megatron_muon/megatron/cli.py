"""Command-line flags: Megatron's ``--muon-*`` flags plus ours, translated into one ``MuonConfig``.

``add_muon_args(parser)`` is an ``extra_args_provider`` for Megatron's
``parse_and_validate_args``. Megatron (0.19.2) already defines the upstream ``--muon-*`` flags;
we keep every one with its upstream meaning and only

- accept ``owner`` and ``auto`` for ``--muon-tp-mode`` (the exact mode, and the cost model's
  per-matrix choice among the exact modes), and default it to ``owner``: upstream 0.19.2
  defaults to ``blockwise``, which at TP > 1 silently runs BlockMuon, a different algorithm
  whose update depends on the TP size; megatron-core's main branch now defaults to the exact
  ``duplicated``. ``owner`` computes the same update as ``duplicated`` with a fraction of its
  Newton-Schulz work per rank (docs/tp_modes.md); ``auto`` is not the default because its
  choice depends on a cost model's hardware constants, and a default should not,
- accept ``highest`` for ``--muon-fp32-matmul-prec`` (fp32 Newton–Schulz, like ``high``),
- default ``--muon-momentum`` to 0.95, the value of upstream's ``OptimizerConfig`` and of
  ``torch.optim.Muon`` (upstream's CLI alone says 0.9; we use 0.95 on every path),

and add our own flags in the argument group "megatron-muon". On a parser without Megatron's
flags (plain argparse) the upstream ones are defined here, with upstream 0.19.2's meaning.

``muon_config_from_args(args)`` is the only translation: flags → ``MuonConfig``; it raises
``ValueError`` naming the flag for a value the plugin cannot honour.
"""

from __future__ import annotations

import argparse

from ..config import MuonConfig
from ..core.newton_schulz import COEFFICIENT_SETS, DEFAULT_COEFFICIENTS
from ..plan.balanced_layout import DEFAULT_ALPHA

__all__ = ["add_muon_args", "muon_config_from_args"]

GROUP_TITLE = "megatron-muon"
MB = 2**20

_TP_MODE_HELP = (
    "How Newton-Schulz runs on tensor-parallel weights. "
    "owner (megatron-muon; exact and recommended): each TP-sharded matrix is orthogonalized whole "
    "on one owner rank, owners load-balanced across ranks, results identical for any TP size. "
    "duplicated / distributed: whole-matrix NS on every rank, or sharded NS with all-reduces "
    "(exact). auto (megatron-muon; exact): per matrix, the cheapest of owner, duplicated and "
    "distributed by the cost model on --muon-auto-hardware. "
    "blockwise: each shard orthogonalized on its own, so the update depends on the TP "
    "size (BlockMuon, not Muon). Default: owner, exact at every TP size (megatron-core 0.19.2 "
    "defaults to blockwise and its main branch to duplicated; owner gives duplicated's update "
    "with a fraction of its Newton-Schulz work)."
)

# Upstream megatron-core 0.19.2 flags (megatron/training/arguments.py), used only when the parser
# lacks them; --muon-momentum defaults to 0.95 (see the module docstring).
_UPSTREAM_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (("--muon-momentum",), dict(type=float, default=0.95)),
    (("--muon-no-split-qkv",), dict(action="store_false", default=True, dest="muon_split_qkv",
                                    help="Do not split fused QKV weights per query group for Muon.")),
    (("--muon-nesterov",), dict(action="store_true",
                                help="Use Nesterov-style momentum (orthogonalize G.lerp(B, momentum)).")),
    (("--muon-scale-mode",), dict(type=str, default="spectral",
                                  choices=["spectral", "unit_rms_norm", "shape_scaling"],
                                  help="Scale of the Muon update by matrix shape.")),
    (("--muon-fp32-matmul-prec",), dict(type=str, default="medium", choices=["low", "medium", "high"])),
    (("--muon-coefficient-type",), dict(type=str, default=DEFAULT_COEFFICIENTS,
                                        help="Newton-Schulz coefficient set: one of "
                                             f"{', '.join(sorted(COEFFICIENT_SETS))}.")),
    (("--muon-num-ns-steps",), dict(type=int, default=5, help="Number of Newton-Schulz steps.")),
    (("--muon-tp-mode",), dict(type=str, default="owner",
                               choices=["blockwise", "duplicated", "distributed", "owner", "auto"])),
    (("--muon-extra-scale-factor",), dict(type=float, default=1.0,
                                          help="Additional scale factor for the Muon update.")),
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
    parser.set_defaults(muon_tp_mode="owner")

    prec = _action(parser, "--muon-fp32-matmul-prec")
    _add_choice(prec, "highest")
    prec.help = (
        "Newton-Schulz precision. medium (default): bf16 matmuls, as upstream; high / highest: "
        "fp32. low is rejected with --optimizer muon: torch has no 'low' float32 matmul "
        "precision (upstream's low silently runs at whatever precision is already set)."
    )

    momentum = _action(parser, "--muon-momentum")
    parser.set_defaults(muon_momentum=0.95)
    momentum.help = (
        "Muon momentum (EMA of the gradient). Default 0.95, as upstream's OptimizerConfig and "
        "torch.optim.Muon (megatron-core 0.19.2's CLI alone defaulted to 0.9)."
    )

    group.add_argument(
        "--muon-split-fc1", action="store_true", default=True, dest="muon_split_fc1",
        help="Orthogonalize the gate and up halves of a fused SwiGLU fc1 weight separately "
             "(the default; upstream #6688).",
    )
    group.add_argument(
        "--muon-no-split-fc1", action="store_false", dest="muon_split_fc1",
        help="Orthogonalize a fused SwiGLU fc1 weight as one matrix (like --muon-no-split-qkv).",
    )
    group.add_argument(
        "--muon-auto-hardware", type=str, default=None, metavar="PROFILE_OR_JSON",
        help="Hardware constants of the cost model that --muon-tp-mode auto uses to pick each "
             "matrix's mode (refused with the other modes, which do not use it). detect (default): this "
             "device (H200: "
             "h200; any other CUDA GPU: h100-sxm; no GPU: cpu-gloo, an order-of-magnitude CPU/gloo "
             "default); a profile: h100-sxm, h200, cpu-gloo; or the path of a JSON file of the "
             "Hardware fields, as scripts/bench/calibrate_hardware.py writes it.",
    )
    group.add_argument(
        "--muon-dp-mode", type=str, default="owner", choices=["owner", "redundant"],
        help="How data-parallel ranks share Newton-Schulz. owner (default): each matrix is "
             "orthogonalized on one DP rank, owners load-balanced, results sent back (with "
             "--use-distributed-optimizer the rank's pieces are gathered to the owner first). "
             "redundant: every DP rank orthogonalizes every matrix (same result, more compute; "
             "for comparison; not with --use-distributed-optimizer).",
    )
    group.add_argument(
        "--muon-dp-layout", type=str, default=None, choices=["balanced", "megatron"],
        help="With --use-distributed-optimizer, how Megatron's DDP buffer is laid out. balanced "
             "(default): every Muon matrix lies whole inside one DP rank's shard of its bucket "
             "(Canzona's alpha-balanced partition; AdamW params fill in around them), so no matrix "
             "travels between DP ranks. megatron: megatron-core's own layout, which cuts matrices "
             "at shard boundaries; the cut ones are reassembled on one DP owner every step. Refused "
             "without --use-distributed-optimizer and under Megatron-FSDP or FSDP2 (which lay out their "
             "own buffers).",
    )
    group.add_argument(
        "--muon-layout-alpha", type=float, default=None, metavar="ALPHA",
        help="Balanced layout: weight in [0, 1] of Newton-Schulz balance across DP ranks against "
             "padding of the buffer (1: NS balance only, 0: no padding beyond alignment). Default "
             f"{DEFAULT_ALPHA}, from the Llama-3 layout table in docs/performance.md. Refused where the "
             "balanced layout is not used.",
    )
    group.add_argument(
        "--muon-owner-bucket-size-mb", type=float, default=256,
        help="Cap, in MiB of full matrices, on one micro-group of the owner pipeline, at the DP and "
             "the TP level (the pipeline keeps a few micro-groups alive, so this bounds the extra "
             "memory of the owner exchanges). Default 256.",
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
             "steps use the scheduled lr). Default 1.0: the paper's theory puts the optimal ratio "
             "between 1 and 1/sqrt(r·c) for an r×c block grid, and we found no ratio stated for its "
             "experiments; with block-shape RMS matching (--muon-scale-mode on the block's shape) "
             "equal rates give block and full updates the same per-entry RMS. Refused without "
             "--muonbp-period and with period 1 (no block steps).",
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
             "logging rank and the wall time of its orthogonalize step.",
    )
    return parser


def muon_config_from_args(args: argparse.Namespace) -> MuonConfig:
    """The ``MuonConfig`` the flags in ``args`` describe; ``ValueError`` names a bad flag.

    A flag missing from ``args`` takes its CLI default (upstream 0.19.2's, but momentum 0.95 and
    ``--muon-tp-mode owner``). The flags whose parser default is None (not given) are the ones
    ``startup_checks`` refuses where they would be ignored; None here means their default.
    """
    def get(dest: str, default):
        value = getattr(args, dest, None)
        return default if value is None else value

    if get("muon_scalar_optimizer", "adam") != "adam":
        raise ValueError(
            f"--muon-scalar-optimizer: megatron-muon updates non-matrix parameters with AdamW "
            f"only; expected adam, got {args.muon_scalar_optimizer!r}"
        )
    prec = get("muon_fp32_matmul_prec", "medium")
    if prec == "low":
        raise ValueError(
            "--muon-fp32-matmul-prec: 'low' is not supported (torch has no 'low' float32 matmul "
            "precision); use medium (bf16 Newton-Schulz) or high/highest (fp32)"
        )
    return MuonConfig(
        momentum=get("muon_momentum", 0.95),
        nesterov=get("muon_nesterov", False),
        split_qkv=get("muon_split_qkv", True),
        split_fc1=get("muon_split_fc1", True),
        scale_mode=get("muon_scale_mode", "spectral"),
        extra_scale_factor=get("muon_extra_scale_factor", 1.0),
        fp32_matmul_prec=prec,
        coefficient_type=get("muon_coefficient_type", DEFAULT_COEFFICIENTS),
        num_ns_steps=get("muon_num_ns_steps", 5),
        tp_mode=get("muon_tp_mode", "owner"),
        auto_hardware=get("muon_auto_hardware", "detect"),
        dp_mode=get("muon_dp_mode", "owner"),
        dp_layout=get("muon_dp_layout", "balanced"),
        layout_alpha=get("muon_layout_alpha", DEFAULT_ALPHA),
        owner_bucket_bytes=int(round(get("muon_owner_bucket_size_mb", 256) * MB)),
        muonbp_period=get("muonbp_period", None),
        muonbp_block_lr_mult=get("muonbp_block_lr_mult", 1.0),
        log_stats=get("muon_log_stats", False),
    )
