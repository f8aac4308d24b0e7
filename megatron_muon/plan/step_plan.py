"""The step plan: every decision of one Muon step, for every rank of a pipeline stage, made once.

A Muon step over a TP × DP grid is a pure function of the matrices' layouts and a few settings.
``build_step_plan`` makes each decision once, in this order, and records it:

    0. units          the pieces placed independently (``units.split_units``): a weight, or each
                      contiguous fused block of it (fc1's gate and up)
    1. DP owners      one DP rank per unit (``owners.plan_unit_owners``: LPT on NS FLOPs, a weight
                      whole on one rank pinned there); none without a DP exchange (DP 1, or
                      ``dp_mode`` redundant: every DP rank computes everything)
    2. micro-groups   consecutive weights of at most ``bucket_bytes`` of full matrices, about
                      ``MIN_MICRO_GROUPS`` of them, as their units: the pipeline's stage
                      (``exchange.split_micro_groups``); a weight's units share one micro-group
    3. per DP owner   the sub-matrices its TP group orthogonalizes (fused rows split: QKV per query
                      group), the TP mode of each and, in owner mode, the TP owner of each (LPT over
                      everything that DP owner holds, so the balance is that of one call)
    (auto)            steps 1 and 3 at once, for the whole TP × DP grid (``auto_schedule``: which DP
                      group, and on one rank or the whole TP group, minimizing the busiest rank's
                      predicted seconds); at TP 1, on one DP rank or a team of them
                      (``teams``: a node's consecutive DP ranks, each running a block of the unit
                      in the distributed mode over the team)
    4. scales         each unit's update scale, per sub-matrix (global shape; local in blockwise)
    5. costs          per rank, the Newton–Schulz FLOPs and the bytes the step's collectives send

The step (``parallel.orthogonalize``) executes a rank's slice of it; the startup report, the dry
run and the cost figures read it. Nothing here imports ``torch.distributed``: a plan for 512 ranks
is built on one process, and every rank builds the same one from the same inputs.

Ranks are indexed ``dp_rank * tp_size + tp_rank``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.block_grid import block_shape, check_grid
from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import NSOptions
from ..core.scaling import SCALE_MODES, muon_scale
from . import exchange
from .grid_schedule import GridSchedule, schedule_grid
from .hardware import Hardware
from .local_blocks import Block, fragment_blocks
from .owners import dp_pins, plan_owners, plan_unit_owners, unit_pinnable
from .pricing import plan_cost, rank_prices
from .teams import team_layout, team_size
from .topology import Topology
from .units import Unit, split_units

__all__ = ["DEFAULT_BUCKET_BYTES", "DP_MODES", "SUB_MODES", "TP_MODES", "LocalRound", "OwnerWork", "PlanSettings",
           "StepPlan", "auto_schedule", "build_step_plan", "call_settings"]

# Append new modes last: the cross-rank check sends TP_MODES.index(mode).
SUB_MODES = ("duplicated", "distributed", "blockwise", "owner")
"""the modes one sub-matrix runs in (``auto`` resolves to these, per sub-matrix)."""
TP_MODES = (*SUB_MODES, "auto")
DP_MODES = ("owner", "redundant")
DEFAULT_BUCKET_BYTES = 256 * 2**20
"""cap on the full-matrix bytes of one micro-group (``--muon-owner-bucket-size-mb``)."""


@dataclass(frozen=True)
class PlanSettings:
    """What a plan depends on besides the matrices and the group sizes."""

    tp_mode: str
    """one of ``TP_MODES``: how each DP owner's TP group runs NS (``auto``: per sub-matrix)."""
    ns: NSOptions = NSOptions()
    dp_mode: str = "owner"
    """``owner`` (NS once per matrix on its DP owner) or ``redundant`` (every DP rank computes
    every matrix; only without DP ranges)."""
    scale_mode: str | None = "spectral"
    """``scaling.muon_scale`` of each sub-matrix; None: no scale (``orthogonalize_sharded``)."""
    extra_scale_factor: float = 1.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    hardware: Hardware | None = None
    """the cost model's constants for ``auto`` (required with it, unused otherwise)."""
    min_micro_groups: int | None = None
    """micro-groups below the cap (None: ``exchange.MIN_MICRO_GROUPS``, read at build time)."""
    pipelined: bool = True
    """False: the whole step is one micro-group (a call with no asynchronous stage to overlap,
    ``orthogonalize_sharded``'s blocking modes, batches everything at once)."""
    local_blocks: bool = False
    """MuonBP's local block steps (``--muonbp-block local``, with ``tp_mode`` blockwise): every DP
    rank orthogonalizes the blocks of its own pieces (``local_blocks.fragment_blocks``), nothing
    moves between ranks."""
    block_grid: tuple[int, int] = (1, 1)
    """MuonBP's block grid (``--muonbp-block-grid RxC``, with ``tp_mode`` blockwise): each local
    matrix orthogonalized as R x C blocks, scaled by the block's shape (``core.block_grid``)."""
    topology: Topology | None = None
    """where the stage's ranks live (``topology.Topology``: each position's global rank and the
    ranks per node), for the link class of each group and the size of DP teams; None: the
    contiguous order, TP fastest, with the hardware profile's ranks per node."""

    def topology_for(self, dp_size: int, tp_size: int) -> Topology:
        """The topology the plan prices with: the given one, or the contiguous default."""
        if self.topology is not None:
            return self.topology
        per_node = self.hardware.ranks_per_node if self.hardware is not None else dp_size * tp_size
        return Topology.contiguous(dp_size, tp_size, per_node)


def call_settings(mode: str, ns: NSOptions, hardware: Hardware | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                  ) -> PlanSettings:
    """The settings of one ``orthogonalize_sharded`` call (no scale; the owner exchange and
    ``auto`` pipelined over micro-groups, a blocking mode batching everything at once), which its
    cost model (``mode_cost.tp_mode_cost``) plans alike."""
    return PlanSettings(mode, ns, scale_mode=None, bucket_bytes=bucket_bytes,
                        hardware=hardware if mode == "auto" else None, pipelined=mode in ("owner", "auto"))


@dataclass(frozen=True)
class OwnerWork:
    """What one DP owner's TP group orthogonalizes in a step, in execution order."""

    matrices: tuple[int, ...]
    """indices of the units it owns, micro-group by micro-group."""
    subs: tuple[MatrixLayout, ...]
    """their sub-matrices (TP-sharded, no DP ranges), in the same order."""
    sub_positions: dict[int, tuple[int, ...]]
    """unit index → positions of its sub-matrices in ``subs``."""
    modes: tuple[str, ...]
    """per sub-matrix, the TP mode it runs in (never ``auto``), or ``team``: this DP rank's block
    of a unit its DP team runs in the distributed mode (the sub-matrix is then the block, laid
    out as a shard over the team)."""
    tp_owners: tuple[int | None, ...]
    """per sub-matrix in owner mode, the TP rank that runs its NS, and so per replicated one in
    duplicated or distributed mode at TP > 1 (the rank that runs it and broadcasts the result, so
    that every TP rank holds the same bits); None elsewhere."""


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step of one optimizer (one pipeline stage's dense or expert matrices), for all ranks.

    Immutable and compared by identity: the step caches what it builds from a plan (exchanges
    bound to process groups) on the plan object, and a plan never changes.
    """

    matrices: tuple[MatrixLayout, ...]
    """every Muon weight of the stage, same order on every rank."""
    units: tuple[Unit, ...]
    """the weights' units (``units.split_units``), weight by weight: what the rest is indexed by."""
    dp_size: int
    tp_size: int
    settings: PlanSettings
    dp_owners: tuple[int, ...] | None
    """per unit, its DP owner; None when the step has no DP exchange."""
    micro_groups: tuple[tuple[int, ...], ...]
    """consecutive unit indices, whole weights (empty weights, with a zero dim, belong to none)."""
    work: tuple[OwnerWork, ...]
    """per DP rank, what its TP group orthogonalizes (without a DP exchange, everything)."""
    scales: tuple[tuple[float, ...], ...]
    """per unit, per sub-matrix, the scale of its update."""
    ns_flops: tuple[int, ...]
    """per rank, the Newton–Schulz FLOPs it runs."""
    dp_bytes: tuple[int, ...]
    """per rank, bytes it sends in the DP owner exchange, there and back."""
    tp_bytes: tuple[int, ...]
    """per rank, bytes it sends in its TP group's mode (owner exchange, all-gather, all-reduces)."""
    teams: tuple[int | None, ...] | None = None
    """per unit, the DP team (of ``team_size`` consecutive DP ranks, numbered) that runs it as
    blocks, or None where one DP owner does (``dp_owners`` then names the team's first rank);
    None without teams."""
    team_size: int = 1
    local_blocks: tuple[tuple[LocalRound, ...], ...] | None = None
    """with ``settings.local_blocks``: per DP rank, its rounds of weights (consecutive, at most the
    owner bucket cap of piece bytes each), every block of a round batched by shape with its scale;
    then there are no units to exchange (``dp_owners`` None, no micro-groups, no TP work)."""

    @property
    def bytes_sent(self) -> tuple[int, ...]:
        """per rank, everything it sends in the step."""
        return tuple(d + t for d, t in zip(self.dp_bytes, self.tp_bytes))

    @property
    def exchanges_dp(self) -> bool:
        return self.dp_owners is not None

    @property
    def owner_of(self) -> tuple[int, ...]:
        """per unit, the DP rank whose TP group computes it (0 for all without a DP exchange)."""
        return self.dp_owners if self.dp_owners is not None else (0,) * len(self.units)

    def units_of(self, i: int) -> tuple[int, ...]:
        """The indices of weight ``i``'s units, in row order."""
        return tuple(u for u, unit in enumerate(self.units) if unit.weight == i)

    def tp_modes_of(self, i: int) -> tuple[str, ...]:
        """The TP mode of each sub-matrix of weight ``i`` (empty for an empty weight)."""
        modes: list[str] = []
        for u in self.units_of(i):
            work = self.work[self.owner_of[u]]
            modes += [work.modes[p] for p in work.sub_positions.get(u, ())]
        return tuple(modes)

    def team_of(self, u: int) -> int | None:
        """The DP team running unit ``u`` as blocks, or None."""
        return None if self.teams is None else self.teams[u]

    def idle_dp_ranks(self) -> list[int]:
        """DP ranks whose TP group orthogonalizes nothing."""
        return [d for d, w in enumerate(self.work) if not w.matrices]


def auto_schedule(matrices: Sequence[MatrixLayout], units: Sequence[Unit], dp_groups: int, tp_size: int,
                  settings: PlanSettings, team: int = 1) -> GridSchedule:
    """``auto``'s joint plan of the stage (``grid_schedule.schedule_grid``): per unit its DP group
    (of ``dp_groups``: 1 without a DP exchange) or with ``team`` > 1 its team, per sub-matrix its
    TP mode and TP owner (or member). A unit whose weight lies whole on one DP rank stays there; a
    cut one prefers its largest piece's holder."""
    layouts = [unit.layout for unit in units]
    pinned, prefer = dp_pins(layouts, dp_groups, unit_pinnable(matrices, units, dp_groups)) if dp_groups > 1 \
        else ({}, None)
    return schedule_grid(layouts, dp_groups, tp_size, settings.hardware, settings.ns, pinned=pinned, prefer=prefer,
                         team=team, topology=settings.topology)


def build_step_plan(matrices: Sequence[MatrixLayout], *, dp_size: int, tp_size: int,
                    settings: PlanSettings) -> StepPlan:
    """The plan of one step (see the module docstring); raises ``ValueError`` naming the flag
    for a setting the matrices cannot honour.

    ``auto`` is never priced above ``owner``: the grid schedule minimizes its own makespan model
    (NS, TP calls and each unit's DP exchange as one sum per rank), which can rank two plans
    otherwise than the step's price (``pricing.plan_cost``: batched calls, micro-group overlap,
    the exchange as all-to-alls). Where owner's plan prices lower, auto runs owner's plan
    (settings still ``auto``, every sub-matrix in ``owner`` mode); every rank prices both alike."""
    _check(matrices, dp_size, tp_size, settings)
    matrices = tuple(matrices)
    if settings.local_blocks:
        return _local_block_plan(matrices, dp_size, tp_size, settings)
    plan = _build(matrices, dp_size, tp_size, settings)
    if settings.tp_mode == "auto":
        rival = _build(matrices, dp_size, tp_size, dataclasses.replace(settings, tp_mode="owner"))
        # relative margin: two float sums over the same terms; a tie keeps auto's own plan
        if plan_cost(rival, settings.hardware).total_s < plan_cost(plan, settings.hardware).total_s * (1 - 1e-9):
            plan = dataclasses.replace(rival, settings=settings)
    return plan


def _build(matrices: tuple[MatrixLayout, ...], dp_size: int, tp_size: int, settings: PlanSettings) -> StepPlan:
    units = split_units(matrices)
    layouts = tuple(unit.layout for unit in units)
    ns = settings.ns
    live = [i for i, lay in enumerate(matrices) if lay.numel]
    exchanges_dp = settings.dp_mode == "owner" and dp_size > 1
    schedule = None
    team, teams, blocks = 1, None, {}
    if settings.tp_mode == "auto":
        if exchanges_dp:
            team = team_size(settings.topology_for(dp_size, tp_size))
        schedule = auto_schedule(matrices, units, dp_size if exchanges_dp else 1, tp_size, settings, team)
        if team > 1:
            schedule, teams = _from_teams(schedule, layouts, team)
            blocks = {u: team_layout(layouts[u], team) for u, t in enumerate(teams) if t is not None}
            if not blocks:
                team, teams = 1, None
    dp_owners = None
    if exchanges_dp:
        dp_owners = (schedule.dp_owners if schedule
                     else tuple(plan_unit_owners(matrices, units, dp_size, ns)))
    # Micro-groups are cut on full-matrix bytes: the TP owner holds whole matrices, and a full
    # matrix is at least the TP-local shard the DP exchange moves, so one cap bounds both (a
    # per-rank weight's matrices are whole in its TP-local shard already).
    element = ns.dtype_bytes
    full_bytes = [matrices[i].numel * element * (matrices[i].tp_size if matrices[i].is_sharded
                                                 and not matrices[i].per_rank else 1) for i in live]
    min_groups = exchange.MIN_MICRO_GROUPS if settings.min_micro_groups is None else settings.min_micro_groups
    if not settings.pipelined:
        weight_groups = [tuple(live)] if live else []
    else:
        weight_groups = [[live[k] for k in chunk]
                         for chunk in exchange.split_micro_groups(full_bytes, settings.bucket_bytes, min_groups)]
    units_of = {}
    for u, unit in enumerate(units):
        units_of.setdefault(unit.weight, []).append(u)
    micro_groups = tuple(tuple(u for i in g for u in units_of[i]) for g in weight_groups)
    if dp_owners is None:
        shared = _owner_work(layouts, [u for g in micro_groups for u in g], tp_size, settings, schedule)
        work = (shared,) * dp_size
    else:
        def runs_on(u: int, d: int) -> bool:
            return dp_owners[u] == d if u not in blocks else teams[u] == d // team

        work = tuple(_owner_work(layouts, [u for g in micro_groups for u in g if runs_on(u, d)], tp_size,
                                 settings, schedule, blocks) for d in range(dp_size))
    blockwise = settings.tp_mode == "blockwise"
    scales = tuple(_scales(lay, blockwise, settings) for lay in layouts)
    plan = StepPlan(matrices, units, dp_size, tp_size, settings, dp_owners, micro_groups, work, scales, (), (), (),
                    teams=teams, team_size=team)
    prices, dp_sent, _ = rank_prices(plan)
    return dataclasses.replace(plan, ns_flops=tuple(int(p.flops) for p in prices),
                               dp_bytes=tuple(round(b) for b in dp_sent), tp_bytes=tuple(round(p.sent) for p in prices))


def _from_teams(schedule: GridSchedule, layouts, team: int) -> tuple[GridSchedule, tuple[int | None, ...]]:
    """A schedule over teams as one over DP ranks: a narrow unit's DP owner is its member (each of
    its sub-matrices in owner mode on its one TP rank), a wide one is its team's (the team
    returned apart; its DP owner names the team's first rank) with one ``team`` sub-matrix."""
    teams = tuple(g if modes[0] == "team" else None for g, modes in zip(schedule.dp_owners, schedule.modes))
    dp_owners = tuple(g * team + (0 if t is not None else members[0])
                      for g, t, members in zip(schedule.dp_owners, teams, schedule.tp_owners))
    modes = tuple(("team",) if t is not None else ("owner",) * len(lay.sub_matrices())
                  for t, lay in zip(teams, layouts))
    owners = tuple((None,) if t is not None else (0,) * len(lay.sub_matrices()) for t, lay in zip(teams, layouts))
    return GridSchedule(dp_owners, modes, owners, schedule.makespan_s, schedule.ns_makespan_s), teams


@dataclass(frozen=True)
class LocalRound:
    """Consecutive weights of one DP rank's local block step, applied together."""

    weights: tuple[int, ...]
    batches: tuple[tuple[tuple[int, int], tuple[tuple[int, Block, float], ...]], ...]
    """(block shape, its (weight, block, scale)s): one batched NS call each."""


def _local_block_plan(matrices: tuple[MatrixLayout, ...], dp: int, tp: int, settings: PlanSettings) -> StepPlan:
    """Every DP rank its own blocks, scaled by their shapes, in rounds of at most the owner bucket
    cap of piece bytes (so the step holds about one round of updates); no collective at all."""
    scale = (lambda r, c: 1.0) if settings.scale_mode is None else \
        (lambda r, c: muon_scale(r, c, settings.scale_mode, settings.extra_scale_factor))
    rounds, flops = [], []
    for d in range(dp):
        blocks = [fragment_blocks(lay, d) for lay in matrices]
        sizes = [(lambda r: (r[1] - r[0]) * settings.ns.dtype_bytes)(lay.local_range(d)) for lay in matrices]
        mine = []
        for chunk in exchange.split_rounds(sizes, settings.bucket_bytes) if matrices else []:
            by_shape: dict[tuple[int, int], list] = {}
            for i in chunk:
                for b in blocks[i]:
                    by_shape.setdefault((b.rows, b.cols), []).append((i, b, scale(b.rows, b.cols)))
            mine.append(LocalRound(tuple(chunk), tuple((k, tuple(v)) for k, v in by_shape.items())))
        rounds.append(tuple(mine))
        flops += [sum(settings.ns.flops(b.rows, b.cols) for per in blocks for b in per)] * tp
    idle = OwnerWork((), (), {}, (), ())
    zeros = (0,) * (dp * tp)
    return StepPlan(matrices, split_units(matrices), dp, tp, settings, None, (), (idle,) * dp, (), tuple(flops),
                    zeros, zeros, local_blocks=tuple(rounds))


def _check(matrices, dp_size: int, tp_size: int, settings: PlanSettings) -> None:
    if settings.tp_mode not in TP_MODES:
        raise ValueError(f"--muon-tp-mode: expected one of {TP_MODES}, got {settings.tp_mode!r}")
    if settings.dp_mode not in DP_MODES:
        raise ValueError(f"--muon-dp-mode: expected one of {DP_MODES}, got {settings.dp_mode!r}")
    if settings.scale_mode is not None and settings.scale_mode not in SCALE_MODES:
        raise ValueError(f"--muon-scale-mode: expected one of {SCALE_MODES}, got {settings.scale_mode!r}")
    if settings.bucket_bytes <= 0:
        raise ValueError(f"--muon-owner-bucket-size-mb: expected a positive size, got {settings.bucket_bytes} bytes")
    grid = settings.block_grid
    if grid != (1, 1) and (settings.tp_mode != "blockwise" or settings.local_blocks):
        raise ValueError(f"--muonbp-block-grid {grid[0]}x{grid[1]}: MuonBP's block steps of TP shards only "
                         f"(--muonbp-block tp_shard), got tp mode {settings.tp_mode!r}"
                         f"{' with local blocks' if settings.local_blocks else ''}")
    if grid != (1, 1):
        for lay in matrices:
            for k, shape in enumerate(lay.sub_local_shapes()):
                check_grid(lay.name if len(lay.sub_local_shapes()) == 1 else f"{lay.name} (sub-matrix {k})", shape,
                           grid)
    cut = [lay.name for lay in matrices if lay.tp_blocks is not None]
    if settings.local_blocks and cut:
        raise ValueError(f"--muonbp-block local: {cut[0]}: --muon-split-qkv-per-head at TP {tp_size} above the "
                         "query groups cuts heads between TP ranks, and a local block step of a cut head is not "
                         "supported; use --muonbp-block tp_shard")
    if settings.local_blocks and settings.tp_mode != "blockwise":
        raise ValueError(f"--muonbp-block local: block steps only (tp mode blockwise), got tp mode "
                         f"{settings.tp_mode!r}")
    topo = settings.topology
    if topo is not None and (topo.dp_size, topo.tp_size) != (dp_size, tp_size):
        raise ValueError(f"PlanSettings.topology: a rank map of DP {topo.dp_size} x TP {topo.tp_size}, planned for "
                         f"DP {dp_size} x TP {tp_size}")
    if settings.tp_mode == "auto" and settings.hardware is None:
        raise ValueError("--muon-tp-mode auto: the plan needs the cost model's hardware constants "
                         "(--muon-auto-hardware)")
    for lay in matrices:
        if lay.tp_size != tp_size:
            raise ValueError(f"{lay.name}: laid out for a TP group of {lay.tp_size}, planned for {tp_size}")
        if lay.dp_ranges is not None and len(lay.dp_ranges) != dp_size:
            raise ValueError(f"{lay.name}: {len(lay.dp_ranges)} DP ranges for a DP group of {dp_size}")
    if settings.dp_mode == "redundant" and dp_size > 1:
        cut = [lay.name for lay in matrices if lay.dp_ranges is not None]
        if cut:
            raise ValueError(
                f"--muon-dp-mode redundant needs every DP rank to hold whole matrices (no "
                f"--use-distributed-optimizer); {cut[0]} is split across DP ranks"
            )


def _owner_work(matrices, owned: list[int], tp_size: int, settings: PlanSettings,
                schedule: GridSchedule | None, blocks: dict[int, MatrixLayout] | None = None) -> OwnerWork:
    """What one DP owner's TP group runs: its units' sub-matrices, the requested TP mode (the only
    place a TP mode is decided) and its owners by LPT, or ``auto``'s, both from its schedule
    (a team unit: its block, ``blocks[i]``)."""
    subs: list[MatrixLayout] = []
    positions: dict[int, tuple[int, ...]] = {}
    for i in owned:
        parts = (blocks[i],) if blocks and i in blocks else matrices[i].sub_matrices()
        positions[i] = tuple(range(len(subs), len(subs) + len(parts)))
        subs += parts
    if schedule is not None:
        modes = tuple(m for i in owned for m in schedule.modes[i])
        owners = tuple(None if m == "blockwise" else r
                       for m, r in zip(modes, (r for i in owned for r in schedule.tp_owners[i])))
        return OwnerWork(tuple(owned), tuple(subs), positions, *_held_heads(subs, modes, owners))
    # A per-rank sub-matrix (a head whole on each TP rank, ``MatrixLayout.per_rank``) runs in
    # blockwise's kernel in every mode: NS of what each TP rank holds, which is that whole matrix,
    # so the update is exact and TP sends nothing (``pricing.widths`` tells ``auto`` the same).
    # A head of TP's row cut (``tp_rows``) runs in the owner exchange in every mode (``_held_heads``).
    modes = tuple("blockwise" if sub.per_rank else "owner" if sub.tp_rows is not None else settings.tp_mode
                  for sub in subs)
    # One TP rank runs each owner-mode sub-matrix, and each replicated one in duplicated and
    # distributed mode (broadcast from there): LPT over everything this DP owner holds.
    on_one = [p for p, m in enumerate(modes) if subs[p].tp_rows is None and (
        m == "owner" or (m in ("duplicated", "distributed") and tp_size > 1 and not subs[p].is_sharded))]
    chosen = plan_owners([settings.ns.flops(*subs[p].full_shape) for p in on_one], tp_size)
    tp_owners: list[int | None] = [None] * len(subs)
    for p, r in zip(on_one, chosen):
        tp_owners[p] = r
    return OwnerWork(tuple(owned), tuple(subs), positions, *_held_heads(subs, modes, tp_owners))


def _held_heads(subs, modes, owners) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    """``modes`` and ``owners`` with every head of TP's row cut (``MatrixLayout.tp_rows``: per-head
    QKV at TP above the query groups) in owner mode on the TP rank holding most of its rows (the
    lowest of a tie): a head whole on one rank runs there and moves nothing, a cut one gathers
    only its other holders' rows. In every TP mode, ``auto``'s too: no other mode runs a matrix
    held in uneven row pieces, and the owner exchange is exact."""
    modes, owners = list(modes), list(owners)
    for p, sub in enumerate(subs):
        if sub.tp_rows is not None:
            held = [hi - lo for lo, hi in sub.tp_rows]
            modes[p], owners[p] = "owner", held.index(max(held))
    return tuple(modes), tuple(owners)


def _scales(layout: MatrixLayout, blockwise: bool, settings: PlanSettings) -> tuple[float, ...]:
    """Per sub-matrix scale: its global shape's (its local, TP shard, shape in blockwise mode, as
    Megatron scales BlockMuon); 1.0 everywhere without a scale mode."""
    # a head of TP's row cut (``tp_blocks``) runs whole in the owner exchange in every mode
    shapes = ([block_shape(s, settings.block_grid) for s in layout.sub_local_shapes()]
              if blockwise and layout.tp_blocks is None else layout.sub_global_shapes())
    if settings.scale_mode is None:
        return (1.0,) * len(shapes)
    return tuple(muon_scale(r, c, settings.scale_mode, settings.extra_scale_factor) for r, c in shapes)
