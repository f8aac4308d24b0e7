"""One inner optimizer for a whole model: Muon on hidden matrices, AdamW on everything else.

Param groups carry ``algorithm`` (``"muon"`` or ``"adamw"``) next to Megatron's own keys, so
Megatron's LR scheduler (which rewrites ``lr`` and ``weight_decay`` per group), grad clipping
and found-inf skipping work unchanged: this class only implements ``step``.

The parameters it updates are whatever Megatron hands an inner optimizer: full fp32 main params
(no distributed optimizer), flat fp32 shard main params (distributed optimizer), or Megatron-FSDP's
DTensor main params (``--use-megatron-fsdp``: each rank's rows of a matrix, possibly none). A
DTensor is stepped through its local shard (``to_local``): the arithmetic is elementwise or runs
on the plan's exchanged pieces, so it never needs DTensor's sharding propagation, and the
state it creates (``zeros_like`` the param) is a DTensor sharded like it, which is what
Megatron-FSDP's ``fsdp_dtensor`` checkpoint saves. Muon needs
to know, for every matrix of the model — including those this rank holds nothing of — where
its pieces live; that is a ``MatrixCatalogue`` (a ``MatrixLayout`` per matrix and the DP/TP
groups), given at construction: the Megatron adapter builds this optimizer once, on the main
params Megatron's wrapper has made, with the catalogue of them. The optimizer builds its step
plans from it there, once (``plan.step_plan``; ``optimizer.plans``), and every step executes
them. Without a catalogue every Muon param is one whole local matrix, which makes this a plain
single-process Muon + AdamW.

Construction also prepares the steps (``parallel.step_setup``: DP team groups, the one-plan
check, the warm-up), a collective: every rank builds its optimizers in the same order.

Per step, for the Muon matrices (upstream emerging-optimizers semantics):
    G ← G + wd·θ                           (only with decoupled_weight_decay False: L2)
    B ← B.lerp(G, 1 − μ);  U ← G.lerp(B, μ) if nesterov else B      (foreach, all params)
    θ ← θ·(1 − lr·wd)                      (decoupled weight decay, the default)
    O ← orthogonalize_updates(U, plan)     (exact per tp_mode; one call for all, pipelined)
    θ ← θ − lr·scale·O                     (as each micro-group's results arrive)
and ``torch.optim.AdamW``'s own functional (foreach) step for the rest (``torch.optim.Adam``'s,
L2 in the gradient, with decoupled_weight_decay False). The updates are applied
micro-group by micro-group through ``orthogonalize_updates``' ``apply``, so no full set of O (nor
of scaled copies) is ever held: the step's extra memory is a few micro-groups' worth.

MuonBP (Khaled et al., arXiv 2510.16981, Algorithm 1; ``MuonConfig.muonbp_period``): the
momentum is updated every step as above; on a *full* step (t % P == 0, t the 0-based count of
applied steps) O is the exact orthogonalization of the whole matrix (``tp_mode``) scaled by the
full shape, with lr η_full = the scheduled lr; on a *block* step O is NS of this rank's TP block
(``blockwise``: no TP traffic; DP fragments are still reassembled on their owner) scaled by the
block's shape, with lr η_block = ``muonbp_block_lr_mult`` × η_full. Weight decay uses the
scheduled lr on every step, so it is the same as Muon's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as functional_adam

from .config import MuonConfig, finite
from .core.matrix_layout import MatrixLayout
from .parallel import comm
from .parallel.comm import comm_stats
from .parallel.devices import resolve_device
from .parallel.orthogonalize import StepGroups, orthogonalize_updates
from .parallel.step_setup import SetupReport, prepare_optimizers, stage_topology
from .parallel.step_stats import ClassStats
from .plan.hardware import Hardware
from .plan.step_plan import StepPlan, build_step_plan
from .plan.topology import Topology

__all__ = ["ALGORITHMS", "MatrixCatalogue", "MuonWithAdamW", "prepare_optimizers", "step_plans", "to_local"]

ALGORITHMS = ("muon", "adamw")


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (Megatron-FSDP's params, grads and the state made like
    them): the tensor that holds its storage, so in-place updates reach the DTensor. Any other
    tensor is returned as it is."""
    return getattr(tensor, "_local_tensor", tensor)


def _is_view_of_leaf(tensor: torch.Tensor) -> bool:
    return tensor._base is not None and tensor._base.is_leaf


def _holds(group, members) -> bool:
    """Whether ``group`` (None: the default group) holds every rank of ``members`` (None: one rank)."""
    import torch.distributed as dist

    if members is None or group is None or not dist.is_initialized():
        return True
    return set(dist.get_process_group_ranks(members)) <= set(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class MatrixCatalogue:
    """Every Muon matrix of one optimizer, described identically on every rank of its groups.

    The Megatron adapter builds it (``megatron.catalogue``: one ``describe`` per backend); a
    plain single-process optimizer needs none (each Muon param is one whole matrix).
    """

    layouts: tuple[MatrixLayout, ...]
    """per matrix, where its pieces live across TP and DP (same list, same order, on every rank)."""
    params: tuple[torch.Tensor | None, ...]
    """per matrix, the tensor this rank updates (its DP range of the TP-local shard), or None if
    it holds none."""
    dp_group: object = None
    """the process group the pieces are cut over (None: one DP rank)."""
    tp_group: object = None
    """the process group the matrices are TP-sharded over (None: one TP rank)."""

    def __post_init__(self) -> None:
        if len(self.layouts) != len(self.params):
            raise ValueError(f"MatrixCatalogue: {len(self.layouts)} layouts for {len(self.params)} params")


def step_plans(config: MuonConfig, layouts, dp_size: int, tp_size: int, hardware: Hardware | None = None,
               topology: Topology | None = None) -> dict[str, StepPlan]:
    """Per step kind, its plan: ``muon`` (MuonBP off), or MuonBP's ``full`` (the exact
    ``tp_mode``) and ``block`` (``blockwise``: each TP shard on its own, no TP traffic; with
    ``muonbp_block`` local, each rank's own blocks, no traffic at all). ``hardware``: ``auto``'s
    constants, already resolved (None: ``config.auto_hardware``'s, resolved here); ``topology``:
    the stage's rank map (``step_setup.stage_topology``; None: the contiguous default)."""
    if config.muonbp_period is None:
        settings = {"muon": config.plan_settings(hardware=hardware, topology=topology)}
    else:
        settings = {"full": config.plan_settings(hardware=hardware, topology=topology),
                    "block": dataclasses.replace(config.block_plan_settings(), topology=topology)}
    return {kind: build_step_plan(layouts, dp_size=dp_size, tp_size=tp_size, settings=plan_settings)
            for kind, plan_settings in settings.items()}


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon + AdamW in one ``torch.optim.Optimizer``.

    Args:
        params: param groups, each with ``algorithm`` in ``ALGORITHMS`` (default ``"adamw"``).
        lr, weight_decay: defaults for groups that do not set them.
        betas, eps: AdamW's (Megatron's ``--adam-beta1/2``, ``--adam-eps``).
        config: the Muon settings.
        hardware: ``auto``'s cost-model constants, resolved by the caller (the Megatron factory:
            global rank 0's, broadcast); None: this process resolves ``config.auto_hardware``.
        prepare: prepare the steps now (``prepare_optimizers([self])``, a collective over the
            default group); False: the caller prepares this optimizer together with others.
        decoupled_weight_decay: Megatron's ``OptimizerConfig.decoupled_weight_decay`` (no CLI
            flag in megatron-core 0.19.2). True (default): θ ← θ·(1 − lr·wd), AdamW-style, for
            both algorithms. False: L2, wd·θ added to the gradient before the momentum (Muon,
            as emerging-optimizers' ``weight_decay_method="l2"``) and before Adam's moments
            (``torch.optim.Adam``).

    Muon groups take 2-D matrices only (a zero dim is allowed: its update is empty); anything
    else is refused here, naming the group, the parameter and its shape.
    """

    def __init__(
        self,
        params,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        config: MuonConfig | None = None,
        decoupled_weight_decay: bool = True,
        catalogue: MatrixCatalogue | None = None,
        hardware: Hardware | None = None,
        prepare: bool = True,
    ) -> None:
        if config is not None and not isinstance(config, MuonConfig):
            raise ValueError(f"MuonWithAdamW: config: expected a MuonConfig or None, got {type(config).__name__}")
        if catalogue is not None and not isinstance(catalogue, MatrixCatalogue):
            raise ValueError(f"MuonWithAdamW: catalogue: expected a MatrixCatalogue or None, "
                             f"got {type(catalogue).__name__}")
        if not isinstance(decoupled_weight_decay, bool):
            raise ValueError(f"MuonWithAdamW: decoupled_weight_decay: expected True or False, "
                             f"got {decoupled_weight_decay!r}")
        checks = [
            (finite(lr) and lr >= 0, "lr", "a finite value >= 0", lr),
            (finite(weight_decay) and weight_decay >= 0, "weight_decay", "a finite value >= 0", weight_decay),
            (finite(eps) and eps >= 0, "eps", "a finite value >= 0", eps),
            (isinstance(betas, (tuple, list)) and len(betas) == 2
             and all(finite(b) and 0 <= b < 1 for b in betas), "betas", "two values in [0, 1)", betas),
        ]
        for ok, name, expected, got in checks:
            if not ok:
                raise ValueError(f"MuonWithAdamW: {name}: expected {expected}, got {got!r}")
        self.config = config or MuonConfig()
        self.decoupled_weight_decay = decoupled_weight_decay
        """False: L2 weight decay in the gradient (Muon and AdamW alike) instead of θ·(1 − lr·wd)."""
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, algorithm="adamw")
        super().__init__(params, defaults)
        for g, group in enumerate(self.param_groups):
            if group["algorithm"] not in ALGORITHMS:
                raise ValueError(f"MuonWithAdamW: param group {g}: algorithm: expected one of {ALGORITHMS}, "
                                 f"got {group['algorithm']!r}")
            if group["algorithm"] != "muon":
                continue
            for i, p in enumerate(group["params"]):
                # 1-D is allowed: a flat DP range of a matrix (the distributed optimizer's main
                # shards, scripts/gpu_check.py), whose matrix the catalogue describes; a 1-D param
                # that is no matrix's range is refused there.
                if p.dim() not in (1, 2):
                    raise ValueError(
                        f"MuonWithAdamW: param group {g} (algorithm 'muon') parameter {i} has shape "
                        f"{tuple(p.shape)}; Muon takes 2-D matrices (or a flat range of one) only (give "
                        f"biases, norms and embeddings to an 'adamw' group)")
        self._catalogue = self._whole_matrices() if catalogue is None else catalogue
        self._check_catalogue()
        self._plans = self._build_plans(hardware)
        """per step kind, its plan: built here, once; see ``plans``."""
        self._step_groups: StepGroups | None = None
        self.setup_report: SetupReport | None = None
        """what preparing the steps did (``prepare_optimizers``); None until then."""
        self.muon_steps = 0
        """optimizer steps applied (skipped steps never reach ``step``); MuonBP's phase."""
        self.last_step_kind: str | None = None
        """``"muon"``, ``"full"`` or ``"block"``: what the last applied step did (for logs)."""
        self._last_stats: dict = {}
        self._norms: dict[str, torch.Tensor] = {}
        self._counted: tuple[list[bool], torch.Tensor] | None = None
        self._classes: ClassStats | None = None
        self.class_stats: torch.Tensor | None = None
        """the last recording step's per-class table (``parallel.step_stats``: the update's RMS before
        lr, its matched RMS, the sampled orthogonality residuals), on the device; a log reads it."""
        self._timer: StepTimer | None = None
        self._device: torch.device | None = None
        # muon_steps is MuonBP's phase: it travels in state_dict() so a resume keeps the schedule.
        self.register_state_dict_post_hook(_save_muon_steps)
        self.register_load_state_dict_pre_hook(_pop_muon_steps)
        self.register_load_state_dict_post_hook(_restore_muon_steps)
        if prepare:
            prepare_optimizers([self])

    # ---- the matrices and the plan ----------------------------------------------------------
    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]

    def _whole_matrices(self) -> MatrixCatalogue:
        """One process: each Muon param is one whole matrix (a 1-D param cannot be one)."""
        params = self._muon_params()
        for i, p in enumerate(params):
            if p.dim() != 2:
                raise ValueError(f"MuonWithAdamW: muon parameter {i} has shape {tuple(p.shape)}: a flat range of a "
                                 "matrix needs a catalogue saying which matrix (catalogue=MatrixCatalogue(...))")
        return MatrixCatalogue(tuple(MatrixLayout(f"param {i}", tuple(p.shape), None, 1) for i, p in enumerate(params)),
                               tuple(params))

    @property
    def catalogue(self) -> MatrixCatalogue:
        """every Muon matrix and the groups it is cut over (given at construction; without one,
        each Muon param of this process is one whole matrix)."""
        return self._catalogue

    @property
    def plans(self) -> dict[str, StepPlan]:
        """per step kind (``muon``, or MuonBP's ``full`` and ``block``), the plan of that step:
        built once, at construction; the step executes it, the startup report and the dry run
        read it."""
        return self._plans

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with one exception to its leaf rule: a view of a leaf is accepted.

        torch refuses a non-leaf tensor because an optimizer's in-place update of it would not
        reach the tensor the model uses. A view of a leaf is that leaf's own storage, so its
        update does reach it; Megatron's ZeRO-1 main shard of an fp32 param is exactly such a
        view (``param.view(-1)[start:end]``, so that the update lands in the model param), and
        under ``--use-distributed-optimizer`` this optimizer is built on those shards."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params
        g = len(self.param_groups)
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and not (p.is_leaf or p.retains_grad or _is_view_of_leaf(p)):
                raise ValueError(f"MuonWithAdamW: param group {g} parameter {i}: expected a leaf tensor or a view "
                                 "of one (an in-place update of any other tensor never reaches the model)")
        had_key = "differentiable" in param_group
        # torch skips its leaf check for differentiable optimizers; the check was made above.
        self.defaults["differentiable"] = True
        try:
            super().add_param_group(param_group)
        finally:
            del self.defaults["differentiable"]
            if not had_key:
                param_group.pop("differentiable", None)

    def _check_catalogue(self) -> None:
        mine = {id(p) for p in self._muon_params()}
        listed = [id(p) for p in self._catalogue.params if p is not None]
        if mine != set(listed) or len(listed) != len(set(listed)):
            raise ValueError(
                f"MuonWithAdamW: catalogue: its matrices name {len(set(listed))} local params, the muon groups "
                f"hold {len(mine)}; every muon param must appear exactly once"
            )

    def _build_plans(self, hardware: Hardware | None) -> dict[str, StepPlan]:
        """The plans, on the stage's rank map read from the catalogue's groups (the expert
        optimizer's DP group is Megatron's expert-DP group, strided by EP): which DP ranks share
        a node decides ``auto``'s teams. No collective here; the digest check compares the maps."""
        cat = self._catalogue
        dp = comm.group_size(cat.dp_group) if cat.dp_group is not None else 1
        tp = comm.group_size(cat.tp_group) if cat.tp_group is not None else 1
        if hardware is None:
            hardware = self.config.hardware()  # auto's, resolved once for the plans and the map; None otherwise
        return step_plans(self.config, cat.layouts, dp, tp, hardware,
                          stage_topology(cat.dp_group, cat.tp_group, hardware))

    @property
    def step_groups(self) -> StepGroups:
        """The groups and device every step runs on (the catalogue's, the optimizer's device): the
        key its plans are bound under at construction, so the step finds them bound."""
        if self._step_groups is None:
            self._step_groups = StepGroups(self.catalogue.dp_group, self.catalogue.tp_group, self.device)
        return self._step_groups

    @property
    def plan(self) -> StepPlan:
        """The plan of a Muon step (MuonBP: of a full step)."""
        return self.plans["muon" if "muon" in self.plans else "full"]

    @property
    def device(self) -> torch.device:
        """Where the Muon step allocates: the device of the params Megatron gave this optimizer
        (its main-param shards), or the DP group's when this rank holds none
        (``devices.resolve_device``). Never "the first matrix": on a DP rank that holds no piece
        of it, that matrix has no param here."""
        if self._device is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._device = resolve_device(params, self.catalogue.dp_group, what="MuonWithAdamW: params")
        return self._device

    @property
    def last_step_stats(self) -> dict:
        """The last applied step: ``kind`` (muon / full / block), ``bytes_sent`` by this rank (the
        package's collectives), ``ns_flops``, ``orthogonalize_ms`` and ``timing`` (``cuda
        events`` or ``host clock``). Reading ``orthogonalize_ms`` on CUDA waits for the step's end
        event: do it when logging, not on the step's path. Empty before the first step."""
        if not self._last_stats:
            return {}
        return dict(self._last_stats, orthogonalize_ms=self._timer.elapsed_ms(), timing=self._timer.clock)

    record_norms: bool = True
    """Whether the next step computes ``step_norms``: two passes over this rank's Muon shards (the
    update's and the params' sums of squares) that only a log reads. A training loop that knows
    which steps it logs sets it before each step (``megatron.log_stats.plan_next_step``); a step
    without it leaves ``step_norms`` as the last step that recorded them left it."""

    @property
    def norms_group(self):
        """The process group ``step_norms`` are summed over (None, the default: every rank of the
        job). The Megatron adapter sets Megatron's grad-stats group, the one its grad norm is
        reduced over; ``norm_groups`` adds the DP or TP group where that one does not hold them."""
        return getattr(self, "_norms_group", None)

    @norms_group.setter
    def norms_group(self, group) -> None:
        self._norms_group = group
        self._counted = None  # which pieces this rank counts depends on the groups

    @property
    def norm_groups(self) -> tuple:
        """The groups to all-reduce ``step_norms`` over, in order, so that each rank gets the sums
        over every element of every Muon matrix: ``norms_group``, preceded by the DP (TP) group
        when pieces are cut over DP (TP) and ``norms_group`` does not hold that group's ranks
        (torch FSDP2's rows under Megatron's TP x PP grad-stats group)."""
        cat, group = self._catalogue, self.norms_group
        out = []
        if any(lay.dp_ranges is not None for lay in cat.layouts) and not _holds(group, cat.dp_group):
            out.append(cat.dp_group)
        if any(lay.partition_dim is not None for lay in cat.layouts) and not _holds(group, cat.tp_group):
            out.append(cat.tp_group)
        return (*out, group)

    @property
    def step_norms(self) -> dict[str, torch.Tensor]:
        """Per step kind (``muon``, or MuonBP's ``full`` / ``block``), the last such step's sums on
        this rank, ``[Σθ², Σu², n]`` (fp32, on the optimizer's device): the Muon parameters after
        the step, the update applied to them (``lr·scale·O``; weight decay is not in it) and their
        element count, over the pieces this rank counts (``_counted_pieces``: every element of a
        Muon matrix on exactly one rank of ``norm_groups``). All-reduced over ``norm_groups`` they
        give the global parameter norm and the update's RMS. Device tensors, never read on the
        step's path: a log reads them (``megatron.log_stats``). Only steps with ``record_norms``
        update them."""
        return dict(self._norms)

    def _counted_pieces(self) -> tuple[list[bool], torch.Tensor]:
        """Per matrix: whether this rank counts its piece in ``step_norms``, and the counted
        elements (a device scalar, made once). A piece cut over DP is counted by the rank holding
        it; a matrix every DP rank holds whole by DP rank 0 when ``norm_groups`` reduce over DP,
        else by every DP rank (each DP replica then sums its own copy: Megatron's grad-stats
        group without the distributed optimizer is TP x PP); likewise over TP. PP stages and expert
        ranks hold different matrices."""
        if self._counted is None:
            cat = self._catalogue
            groups = self.norm_groups
            dp_rank = comm.group_rank(cat.dp_group) if cat.dp_group is not None else 0
            tp_rank = comm.group_rank(cat.tp_group) if cat.tp_group is not None else 0
            dp_once = any(_holds(g, cat.dp_group) for g in groups)  # one copy per reduction, not per replica
            tp_once = any(_holds(g, cat.tp_group) for g in groups)
            counted = [p is not None and (lay.dp_ranges is not None or dp_rank == 0 or not dp_once)
                       and (lay.partition_dim is not None or tp_rank == 0 or not tp_once)
                       for lay, p in zip(cat.layouts, cat.params)]
            numel = sum(to_local(p).numel() for p, c in zip(cat.params, counted) if c)
            self._counted = counted, torch.tensor(float(numel), device=self.device)
        return self._counted

    def init_state(self) -> None:
        """Create every param's state now (Megatron's checkpointing reads state before step 1).

        Muon params: ``momentum_buffer``; AdamW params: ``exp_avg``, ``exp_avg_sq``; both keep
        a ``step`` tensor, which Megatron's distributed optimizer reads per param.
        """
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                state["step"] = torch.tensor(0.0)  # device-rule: host scalar, as torch's AdamW keeps it
                if group["algorithm"] == "muon":
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ---- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step: closures are not supported (Megatron never passes one)")
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        self._muon_step()
        self.muon_steps += 1
        return None

    def _group_of(self) -> dict[int, dict]:
        return {id(p): g for g in self.param_groups for p in g["params"]}

    def _muon_step(self) -> None:
        params = self.catalogue.params
        if not params:
            return
        cfg = self.config
        kind = cfg.step_kind(self.muon_steps)
        lr_mult = cfg.muonbp_block_lr_mult if kind == "block" else 1.0
        self.last_step_kind = kind
        group_of = self._group_of()
        device = self.device
        live = [p for p in params if p is not None and p.grad is not None]
        update_of = self._momentum_and_decay(live, group_of)
        # Every rank joins every collective: a missing grad contributes zeros (as KellerJordan/Muon
        # does), so the exchange sizes stay the plan's. A rank holding no piece of this matrix
        # (param None) still allocates on the optimizer's device.
        pieces = [update_of.pop(id(p)) if p is not None and id(p) in update_of
                  else torch.zeros(0 if p is None else to_local(p).numel(), device=device)
                  for p in params]
        step_lr = [-group_of[id(p)]["lr"] * lr_mult if p is not None else 0.0 for p in params]

        # The norms only a log reads: on the steps it reads them (record_norms), nothing otherwise
        record = self.record_norms
        counted, numel = self._counted_pieces() if record else ([False] * len(params), None)
        update_sq = torch.zeros((), dtype=torch.float32, device=device) if record else None
        classes = self._class_stats(counted).start() if record else None

        def apply(i: int, update: torch.Tensor, scale: float) -> None:
            p = params[i]
            if p is None or p.grad is None:
                return
            # θ ← θ − lr·(scale·O): the scalar scale rides in add_'s alpha instead of a scaled copy.
            p = to_local(p)
            alpha = step_lr[i] * scale
            p.add_(update.reshape_as(p), alpha=alpha)
            if counted[i]:  # Σ(alpha·O)² and, per class, Σ(scale·O)², on the device
                norm_sq = torch.linalg.vector_norm(update, dtype=torch.float32).square()
                update_sq.add_(norm_sq, alpha=alpha * alpha)
                classes.add_update(i, norm_sq, scale)

        if self._timer is None:  # built once: its CUDA events are recorded again every step
            self._timer = StepTimer(device)
        if self._step_groups is None:
            self._step_groups = StepGroups(self.catalogue.dp_group, self.catalogue.tp_group, device)
        self._timer.start()
        with comm_stats() as stats:
            orthogonalize_updates(pieces, self.plans[kind], self._step_groups, apply,
                                  classes.probe if record else None)
        self._timer.stop()
        self._last_stats = dict(kind=kind, bytes_sent=stats.bytes_sent, ns_flops=stats.ns_flops)
        if not record:
            return
        mine = [to_local(p) for p, c in zip(params, counted) if c]
        param_sq = (torch.stack(torch._foreach_norm(mine)).float().square().sum() if mine
                    else torch.zeros((), dtype=torch.float32, device=device))
        self._norms[kind] = torch.stack([param_sq, update_sq, numel])
        self.class_stats = classes.table

    def _class_stats(self, counted: list[bool]) -> ClassStats:
        """The per-class tables' fixed part for these counted pieces (built once per norm groups)."""
        if self._classes is None or self._classes.counted is not counted:
            cat, cfg = self._catalogue, self.config
            dp_rank = comm.group_rank(cat.dp_group) if cat.dp_group is not None else 0
            self._classes = ClassStats(cat.layouts, counted, dp_rank, cfg.scale_mode, cfg.extra_scale_factor,
                                       self.device)
        return self._classes

    def _momentum_and_decay(self, live: list[torch.Tensor], group_of: dict[int, dict]) -> dict[int, torch.Tensor]:
        """B ← B.lerp(G, 1 − μ); U ← G.lerp(B, μ) or B; θ ← θ·(1 − lr·wd); id(θ) → flat U.

        With ``decoupled_weight_decay`` False, G ← G + wd·θ first (a new tensor: Megatron's
        grads are left as they are) and θ is not multiplied.

        One foreach op per stage over every Muon param with a grad: on CPU torch loops over the
        same per-tensor kernels, so the arithmetic is that of the loop it replaces. Weight decay
        runs here, before the update exists, because the update depends on the gradients only;
        each θ then changes once more, when its micro-group's result arrives. Without Nesterov U
        is the momentum itself (no copy); with it, one copy of every update, alive for the step.
        """
        cfg = self.config
        for p in live:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["step"] = torch.tensor(0.0)  # device-rule: host scalar, as torch's AdamW keeps it
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not live:
            return {}
        params = [to_local(p) for p in live]
        grads = [to_local(p.grad) for p in live]
        if not self.decoupled_weight_decay:
            grads = _with_l2(params, grads, [group_of[id(p)]["weight_decay"] for p in live])
        bufs = [to_local(self.state[p]["momentum_buffer"]) for p in live]
        torch._foreach_add_([self.state[p]["step"] for p in live], 1.0)
        torch._foreach_lerp_(bufs, grads, 1 - cfg.momentum)
        updates = torch._foreach_lerp(grads, bufs, cfg.momentum) if cfg.nesterov else bufs
        if self.decoupled_weight_decay:
            torch._foreach_mul_(params, [1 - group_of[id(p)]["lr"] * group_of[id(p)]["weight_decay"] for p in live])
        return {id(p): u.reshape(-1) for p, u in zip(live, updates)}

    def _adamw_step(self, group) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)  # device-rule: host scalar, as torch's AdamW keeps it
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(to_local(p))
            grads.append(to_local(p.grad))
            exp_avgs.append(to_local(state["exp_avg"]))
            exp_avg_sqs.append(to_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        # torch.optim.AdamW's own foreach path. On CPU fp32 it is bitwise the single-tensor path
        # the tests' torch.optim.AdamW reference takes (checked: tests/unit/test_optimizer.py); on
        # CUDA it is what torch.optim.AdamW itself defaults to.
        functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=True, capturable=False, differentiable=False, fused=None,
            grad_scale=None, found_inf=None, has_complex=False,
            decoupled_weight_decay=self.decoupled_weight_decay,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )


def _with_l2(params: list[torch.Tensor], grads: list[torch.Tensor], decays: list[float]) -> list[torch.Tensor]:
    """G + wd·θ per param (G itself where wd is 0), one foreach add per distinct wd: the op
    ``torch.optim.Adam`` applies for its L2 decay (``_foreach_add(grads, params, alpha=wd)``)."""
    out = list(grads)
    by_decay: dict[float, list[int]] = {}
    for k, wd in enumerate(decays):
        if wd:
            by_decay.setdefault(wd, []).append(k)
    for wd, ks in by_decay.items():
        for k, g in zip(ks, torch._foreach_add([grads[k] for k in ks], [params[k] for k in ks], alpha=wd)):
            out[k] = g
    return out


# ---- timing -----------------------------------------------------------------------------------


class StepTimer:
    """Wall time of one region of the step, without a host sync on the step's path.

    On CUDA two events are recorded on the current stream and the elapsed time is read only when
    asked (the log line, once per log interval, long after the kernels ran); a host clock there
    would measure kernel launches, not kernels. Elsewhere the host clock: CPU kernels are
    synchronous, so it measures the work.
    """

    def __init__(self, device: torch.device) -> None:
        self.clock = "cuda events" if device.type == "cuda" else "host clock"
        if self.clock == "cuda events":
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self.clock == "cuda events":
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.clock == "cuda events":
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.clock == "cuda events":
            self._end.synchronize()  # off the step's path: the reader (a log line) waits
            return self._start.elapsed_time(self._end)
        return 1e3 * (self._t1 - self._t0)

    def measure(self, fn) -> float:
        """Seconds of ``fn()`` alone, for benchmarks (never on the step's path): on CUDA after a
        synchronize, so that work queued before it does not count, then its events read."""
        if self.clock == "cuda events":
            torch.cuda.synchronize()
        self.start()
        fn()
        self.stop()
        return self.elapsed_ms() / 1e3


# ---- state dict: the step counter ---------------------------------------------------------------


def _save_muon_steps(optimizer: MuonWithAdamW, state_dict: dict) -> dict:
    state_dict["muon_steps"] = int(optimizer.muon_steps)
    return state_dict


def _pop_muon_steps(optimizer: MuonWithAdamW, state_dict: dict) -> dict:
    # torch hands pre-hooks its own shallow copy of the caller's dict: popping is local.
    optimizer._loaded_muon_steps = state_dict.pop("muon_steps", None)
    return state_dict


def _restore_muon_steps(optimizer: MuonWithAdamW) -> None:
    loaded = getattr(optimizer, "_loaded_muon_steps", None)
    optimizer._loaded_muon_steps = None
    if loaded is None:  # a state dict without the counter: every param steps once per step
        steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
        if not steps:
            return
        loaded = max(steps)
    optimizer.muon_steps = int(loaded)
