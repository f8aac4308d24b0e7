"""The one typed configuration of the plugin.

Every ``--muon-*`` flag (upstream's and ours) lands in one field here; the CLI layer only
translates flags into a ``MuonConfig`` and the optimizer only reads this object.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from .core.newton_schulz import COEFFICIENT_SETS, DEFAULT_COEFFICIENTS, NS_METHODS, NSOptions
from .core.scaling import SCALE_MODES
from .plan.balanced_layout import DEFAULT_ALPHA
from .plan.stage_layouts import DEFAULT_DP_LAYOUT, DP_LAYOUTS
from .plan.step_plan import DEFAULT_BUCKET_BYTES, DP_MODES, TP_MODES, PlanSettings

if TYPE_CHECKING:
    from .plan.hardware import Hardware
    from .plan.topology import Topology

__all__ = ["DP_LAYOUTS", "MAMBA_IN_PROJ", "MUONBP_BLOCKS", "MuonConfig", "NS_PRECISIONS", "finite"]

MUONBP_BLOCKS = ("tp_shard", "local")
MAMBA_IN_PROJ = ("split", "whole", "adamw")
"""``MuonConfig.mamba_in_proj``'s choices: Muon by role (ours), Muon whole (megatron-core 0.19.2),
AdamW (megatron-core's main branch after 0.19.2)."""

# Upstream --muon-fp32-matmul-prec: "medium" runs NS in bf16 (emerging-optimizers casts to bf16
# explicitly), "high"/"highest" keep fp32, with torch's float32 matmul precision set to the flag's
# value inside each NS call only (NSOptions.matmul_precision: TF32 for high on GPUs, IEEE for
# highest, whatever the launcher set globally).
NS_PRECISIONS = {"medium": torch.bfloat16, "high": torch.float32, "highest": torch.float32}


def finite(value) -> bool:
    """A real number, not NaN or ±inf (a non-finite setting would train to NaN and save it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Shown(str):
    """A value shown as is in an error message (``repr`` without quotes)."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class MuonConfig:
    """Muon settings, and the one place each default is written: the command line's are these
    (``cli.py`` reads them from here). They are upstream megatron-core 0.19.2's ``OptimizerConfig``
    muon_* ones but ``tp_mode``'s (see there)."""

    momentum: float = 0.95
    """EMA momentum μ: B ← μB + (1−μ)G. The default is upstream ``OptimizerConfig``'s (and
    ``torch.optim.Muon``'s) on every path, the command line's included (--muon-momentum):
    megatron-core 0.19.2's CLI alone defaults to 0.9."""
    nesterov: bool = False
    """use G.lerp(B, μ) instead of B as the matrix to orthogonalize (upstream: --muon-nesterov).
    Off, as upstream Megatron's flag is; ``torch.optim.Muon`` (and ``core.muon.Muon``, which
    mirrors it) default to on. The difference is on purpose: a Megatron command line keeps its
    meaning."""
    split_qkv: bool = True
    """orthogonalize Q, K and V of a fused QKV weight separately, per query group."""
    split_qkv_per_head: bool = False
    """orthogonalize a split QKV per head (--muon-split-qkv-per-head, upstream PR #6326's flag):
    each query head and each query group's k and v head its own head_dim x hidden matrix, scaled by
    that shape; a column-parallel QKV gives every TP rank whole heads, so they run on their TP rank
    with no TP traffic in any mode (docs/per_head.md). MLA's q and kv up-projections alike: each head's
    q rows (nope and rope together) one matrix, its k-nope rows one and its v rows one. Needs split_qkv."""
    split_fc1: bool = True
    """orthogonalize the gate and up halves of a fused SwiGLU fc1 separately (upstream #6688)."""
    mamba_in_proj: str = "split"
    """what a Mamba mixer's fused ``in_proj`` gets (--muon-mamba-in-proj, ``MAMBA_IN_PROJ``):
    ``split``, Muon by role, z, x, B, C and dt apart (the rows megatron-core's ``partition_sizes``
    marks): five different linear maps, as Q, K and V are; ``whole``, Muon on the fused matrix, as
    megatron-core 0.19.2 orthogonalizes it; ``adamw``, AdamW, as megatron-core's main branch (after
    0.19.2) routes it (``use_muon=False`` on the weight, upstream PR #6074)."""
    router_skip_muon: bool = False
    """send an MoE router's weight to AdamW instead of Muon (--moe-router-skip-muon, upstream PR
    #6504's flag and meaning; off, as there). megatron-core 0.19.2 has no such flag and
    orthogonalizes the router's [experts, hidden] weight as any hidden matrix."""
    scale_mode: str = "spectral"
    """update scale by shape: spectral, shape_scaling or unit_rms_norm (``scaling.py``)."""
    extra_scale_factor: float = 1.0
    """multiplies the scale (0.2 with spectral matches AdamW's update RMS, Moonlight)."""
    fp32_matmul_prec: str = "medium"
    """NS precision: medium = bf16 (upstream default), high = fp32 GEMMs at torch's "high" float32
    precision (TF32 on GPUs), highest = IEEE fp32; set inside each Newton–Schulz call and
    restored after it, never globally (``NSOptions.matmul_precision``)."""
    coefficient_type: str = DEFAULT_COEFFICIENTS
    """Newton–Schulz coefficient set: quintic, upstream Megatron's default and the package's
    (``newton_schulz.DEFAULT_COEFFICIENTS``); ``torch.optim.Muon`` uses jordan (= simple)."""
    num_ns_steps: int = 5
    """Newton–Schulz iterations."""
    ns_method: str = "standard"
    """how each Newton–Schulz call runs (--muon-ns-method): ``standard``, the quintic on the
    matrix, or ``gram``, the same polynomial on its short side's Gram matrix with one restart
    (``core.newton_schulz``, Gram Newton–Schulz; the standard iteration where the aspect is under
    ``GRAM_MIN_ASPECT``). In the distributed TP mode ``gram`` all-reduces the Gram once per block
    (2 a step, from 5) and every rank runs the Gram iteration whole. Default standard: see
    docs/performance.md §11 for the measurements that decide it."""
    gram_fp16: bool = False
    """run Gram Newton–Schulz's products in fp16 instead of bf16 (--muon-gram-fp16, DeepSpeed's
    choice): 8× finer rounding at the same range of O(1) values after normalization. Only with
    ``ns_method="gram"`` and ``fp32_matmul_prec="medium"`` (elsewhere it would be ignored, or
    lower an fp32 NS's precision); the standard-iteration fallback stays bf16, and the exchanged
    pieces stay ``ns_dtype``."""
    tp_mode: str = "auto"
    """how NS runs across TP shards: auto, owner, duplicated, distributed or blockwise
    (``plan/step_plan.py`` decides, ``parallel/`` runs them; docs/tp_modes.md). auto, the default
    on every path (the command line's too, --muon-tp-mode), is exact whatever it picks: it plans
    the whole stage's TP × DP grid with the exact modes only (owner, duplicated, distributed), per
    sub-matrix, on the cost model's ``auto_hardware`` constants (``plan/grid_schedule.py``), so
    the constants move the plan's cost, never its math. At Llama-3 405B TP8 × PP16 × DP64 it
    balances NS at max/mean 2.40 where owner leaves 19.24 (docs/choosing-a-mode.md); on a
    standard PP1 stage it reproduces owner. Every rank plans on the same constants: the Megatron
    factory resolves them on global rank 0 and broadcasts them, and the plan digest is compared
    across every DP and TP group at construction. owner (each TP-sharded matrix orthogonalized
    whole on one owner rank, owners balanced by FLOPs, no cost model) is the choice for a plan
    that must not depend on hardware constants. This differs from upstream: megatron-core
    0.19.2's ``OptimizerConfig`` and CLI default to blockwise, which at TP > 1 runs BlockMuon
    (each shard orthogonalized on its own), a different algorithm whose update depends on the TP
    size; megatron-core's main branch defaults to the exact duplicated. A config built from an
    upstream ``OptimizerConfig`` (``get_megatron_muon_optimizer`` without ``muon_config``) takes
    that config's ``muon_tp_mode``, blockwise unless set (at TP > 1 the startup report then says
    BlockMuon)."""
    auto_hardware: str = "detect"
    """with tp_mode auto (the default): the cost model's hardware constants (--muon-auto-hardware):
    ``detect`` (this device: H200 → h200, other CUDA GPUs → h100-sxm, CPU → cpu-gloo), a profile
    name (h100-sxm, h200, cpu-gloo) or the path of a JSON file of ``hardware.Hardware`` fields
    (``scripts/bench/calibrate_hardware.py``). Not used by the other modes, but checked in every
    mode; the command line refuses it with them (``startup_checks``)."""
    dp_mode: str = "owner"
    """without the distributed optimizer: owner (NS once per DP group, results exchanged) or
    redundant (every DP rank computes everything; for comparison)."""
    dp_layout: str = DEFAULT_DP_LAYOUT
    """with the distributed optimizer, the DDP buffer layout (--muon-dp-layout): ``priced``, the
    default (per buffer, whichever of whole matrices, megatron-core's own layout and its buckets
    cut at rows the iteration model prices cheapest: exposed DDP communication plus the step
    plan's price of the Muon step on it, ``plan.layout_choice``, from Megatron's args at DDP-wrap
    time; whole matrices without them: a Python API user's own DDP), ``balanced`` (every Muon
    matrix whole inside one DP rank's shard, placed by ``plan.balanced_layout``: no DP exchange,
    but a bucket held open to 2 × DP × its largest matrix, which gives up Megatron's overlap on
    the first stage) or ``megatron`` (megatron-core's own layout, which cuts matrices at shard
    boundaries; the owner exchange reassembles them). Ignored without the distributed optimizer (every DP rank then
    holds every matrix whole)."""
    layout_alpha: float = DEFAULT_ALPHA
    """α of the balanced layout (--muon-layout-alpha): the weight of Newton–Schulz balance
    against padding when whole matrices are placed in DP shards (``balanced_layout``)."""
    owner_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """cap on full-matrix bytes per micro-group of the owner pipeline, DP and TP level alike
    (--muon-owner-bucket-size-mb)."""
    muonbp_period: int | None = None
    """MuonBP (arXiv 2510.16981): None = off (plain Muon); P >= 1 = a full (exact, ``tp_mode``)
    step when the applied-step counter t (0-based) has t % P == 0, a block step otherwise;
    0 = never a full step (BlockMuon). P = 1 is exactly Muon."""
    muonbp_block_lr_mult: float = 1.0
    """η_block / η_full: the learning-rate multiplier of MuonBP's block steps."""
    muonbp_block: str = "tp_shard"
    """what a MuonBP block step orthogonalizes (--muonbp-block): ``tp_shard``, each rank's TP shard
    (BlockMuon's block; a DP-cut matrix is reassembled on its DP owner first), or ``local``, the
    paper's block, the TP shard ∩ this DP rank's range (``plan.local_blocks``): no byte moves.
    tp_shard is the default because its update does not depend on where the DP layout cuts a
    matrix, and ``local``'s blocks, cut at flat-range boundaries, have no convergence measurement
    yet; the two agree wherever matrices lie whole on one DP rank (the balanced layout, DDP)."""
    muonbp_block_grid: tuple[int, int] | None = None
    """MuonBP's block grid (--muonbp-block-grid RxC): on block steps each local matrix (a TP shard,
    or a matrix every TP rank holds whole) is orthogonalized as R x C blocks, scaled by the block's
    shape, still with no communication (``core.block_grid``). None: the local matrix is the block
    (BlockMuon's). Makes any block count reachable at TP1, and finer blocks than the layout's at
    TP > 1. With --muonbp-block tp_shard only; R and C must divide every local matrix (checked
    when the plan is built)."""
    log_stats: bool = False
    """append the last step's kind (muon / full / block), bytes sent, orthogonalize time, the Muon
    parameters' global norm, the update's RMS per step kind and, per matrix class, scale·NS's RMS
    before lr, its matched RMS and a fixed sample's orthogonality residual to Megatron's iteration
    log line (--muon-log-stats; ``core.update_stats``)."""

    def __post_init__(self) -> None:
        checks = [
            (self.tp_mode in TP_MODES, "--muon-tp-mode", f"one of {TP_MODES}", self.tp_mode),
            (self.dp_mode in DP_MODES, "--muon-dp-mode", f"one of {DP_MODES}", self.dp_mode),
            (self.scale_mode in SCALE_MODES, "--muon-scale-mode", f"one of {SCALE_MODES}", self.scale_mode),
            (self.fp32_matmul_prec in NS_PRECISIONS, "--muon-fp32-matmul-prec", f"one of {sorted(NS_PRECISIONS)}",
             self.fp32_matmul_prec),
            (self.coefficient_type in COEFFICIENT_SETS, "--muon-coefficient-type",
             f"one of {sorted(COEFFICIENT_SETS)}", self.coefficient_type),
            (isinstance(self.num_ns_steps, int) and self.num_ns_steps >= 1, "--muon-num-ns-steps",
             "an integer >= 1", self.num_ns_steps),
            (self.ns_method in NS_METHODS, "--muon-ns-method", f"one of {NS_METHODS}", self.ns_method),
            (self.mamba_in_proj in MAMBA_IN_PROJ, "--muon-mamba-in-proj", f"one of {MAMBA_IN_PROJ}",
             self.mamba_in_proj),
            (isinstance(self.router_skip_muon, bool), "--moe-router-skip-muon", "True or False",
             self.router_skip_muon),
            (not self.split_qkv_per_head or self.split_qkv, "--muon-split-qkv-per-head",
             "the per-group QKV split it refines (drop --muon-no-split-qkv)", _Shown("--muon-no-split-qkv")),
            (not self.gram_fp16 or (self.ns_method == "gram" and self.fp32_matmul_prec == "medium"),
             "--muon-gram-fp16", "only with --muon-ns-method gram and --muon-fp32-matmul-prec medium "
             "(bf16 Newton-Schulz)", _Shown(f"--muon-ns-method {self.ns_method} --muon-fp32-matmul-prec "
                                            f"{self.fp32_matmul_prec}")),
            (0.0 <= self.momentum < 1.0, "--muon-momentum", "a value in [0, 1)", self.momentum),
            (self.dp_layout in DP_LAYOUTS, "--muon-dp-layout", f"one of {DP_LAYOUTS}", self.dp_layout),
            (isinstance(self.layout_alpha, (int, float)) and 0.0 <= self.layout_alpha <= 1.0,
             "--muon-layout-alpha", "a value in [0, 1]", self.layout_alpha),
            (finite(self.extra_scale_factor) and self.extra_scale_factor > 0, "--muon-extra-scale-factor",
             "a finite value > 0", self.extra_scale_factor),
            (self.owner_bucket_bytes > 0, "--muon-owner-bucket-size-mb", "a positive size in MiB",
             _Shown(f"{self.owner_bucket_bytes / 2**20:g}")),
        ]
        if self.muonbp_period is not None:
            checks += [
                (isinstance(self.muonbp_period, int) and self.muonbp_period >= 0, "--muonbp-period",
                 "an integer >= 0 (0: never a full step)", self.muonbp_period),
                (finite(self.muonbp_block_lr_mult) and self.muonbp_block_lr_mult > 0, "--muonbp-block-lr-mult",
                 "a finite value > 0", self.muonbp_block_lr_mult),
                (self.muonbp_block in MUONBP_BLOCKS, "--muonbp-block", f"one of {MUONBP_BLOCKS}", self.muonbp_block),
                (self.muonbp_block_grid is None or self.muonbp_block == "tp_shard", "--muonbp-block-grid",
                 "--muonbp-block tp_shard (a grid of the local matrix; local blocks are cut by the DP layout)",
                 _Shown(f"--muonbp-block {self.muonbp_block}")),
                (self.muonbp_period == 0 or self.tp_mode != "blockwise", "--muon-tp-mode",
                 f"an exact mode (owner, duplicated, distributed or auto) for the full steps of --muonbp-period "
                 f"{self.muonbp_period}", self.tp_mode),
            ]
        grid = self.muonbp_block_grid
        checks.append((grid is None or (isinstance(grid, tuple) and len(grid) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in grid)), "--muonbp-block-grid",
            "RxC with integers R, C >= 1", grid))
        checks.append((grid is None or self.muonbp_period not in (None, 1), "--muonbp-block-grid",
                       "--muonbp-period P other than 1 as well (without MuonBP, or with period 1, there are "
                       "no block steps)",
                       _Shown(f"{grid[0]}x{grid[1]} " + ("without it" if self.muonbp_period is None
                                                         else f"with --muonbp-period {self.muonbp_period}"))
                       if isinstance(grid, tuple) and len(grid) == 2 else grid))
        for ok, flag, expected, got in checks:
            if not ok:
                raise ValueError(f"{flag}: expected {expected}, got {got!r}")
        if self.auto_hardware != "detect":
            # A bad name or JSON file fails here in any mode, naming --muon-auto-hardware (a typo
            # should not wait until someone switches to auto). ``detect`` waits for the optimizer:
            # asking CUDA for the device name before Megatron sets the device would open a context
            # on GPU 0 from every rank.
            from .plan.hardware import hardware_profile

            hardware_profile(self.auto_hardware)

    def step_kind(self, t: int) -> str:
        """``"muon"`` (MuonBP off), ``"full"`` or ``"block"`` for applied step t (0-based)."""
        if self.muonbp_period is None:
            return "muon"
        if self.muonbp_period > 0 and t % self.muonbp_period == 0:
            return "full"
        return "block"

    def hardware(self) -> Hardware | None:
        """The cost model's constants for tp_mode auto (None for the other modes)."""
        if self.tp_mode != "auto":
            return None
        from .plan.hardware import hardware_profile

        return hardware_profile(self.auto_hardware)

    @property
    def ns_dtype(self) -> torch.dtype:
        return NS_PRECISIONS[self.fp32_matmul_prec]

    @property
    def ns(self) -> NSOptions:
        """The Newton–Schulz settings, as one value."""
        return NSOptions(self.num_ns_steps, self.coefficient_type, dtype=self.ns_dtype, method=self.ns_method,
                         fp32_precision=self.fp32_matmul_prec,
                         gram_dtype=torch.float16 if self.gram_fp16 else None)

    def block_plan_settings(self) -> PlanSettings:
        """The plan settings of a MuonBP block step: blockwise, on local blocks with ``local``."""
        return dataclasses.replace(self.plan_settings("blockwise"), local_blocks=self.muonbp_block == "local",
                                   block_grid=self.muonbp_block_grid or (1, 1))

    def plan_settings(self, tp_mode: str | None = None, hardware: Hardware | None = None,
                      topology: Topology | None = None) -> PlanSettings:
        """What a step plan needs from this config; ``tp_mode`` overrides the field (MuonBP's block
        steps plan ``blockwise``). ``auto``'s hardware constants: ``hardware`` when the caller has
        resolved them (the Megatron factory: global rank 0's, broadcast), else resolved here.
        ``topology``: the stage's rank map (``PlanSettings.topology``; None: the contiguous default)."""
        mode = self.tp_mode if tp_mode is None else tp_mode
        if mode == "auto" and hardware is None:
            hardware = self.hardware()
        return PlanSettings(mode, self.ns, self.dp_mode, self.scale_mode, self.extra_scale_factor,
                            self.owner_bucket_bytes, hardware if mode == "auto" else None, topology=topology)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
