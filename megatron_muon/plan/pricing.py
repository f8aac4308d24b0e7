"""The one price of a Muon step: what a sub-matrix costs a rank in a TP mode, and what a plan costs.

Every figure about a step's cost is read from here: the step plan's per-rank FLOPs and bytes
(``step_plan.build_step_plan``), ``auto``'s objective (``grid_schedule``: each sub-matrix's
seconds narrow and wide, each unit's DP exchange) and the cost model's step time
(``plan_cost``, and ``mode_cost.tp_mode_cost`` on a plan of one TP group). A new TP mode gets its
price in ``sub_price`` and nowhere else.

A ``Price`` is one rank's share: NS FLOPs, the bytes it sends (``comm.py``'s convention: what
leaves the rank, what the plan reports), per collective primitive the bytes over the rank's
busier link direction, the calls that pay a latency, the bytes its copies touch, and the bytes
NS's own elementwise work touches (``core.ns_traffic``: the normalization, the batch, the
products' accumulator copies). Links are
full duplex, so an exchange in which a rank sends and receives as much costs it one direction's
bytes: an owner receives t − 1 shards and sends t − 1 results back, max(sent, received) = (t − 1)
shards; prices of different sub-matrices add, and the sum of per-sub maxima equals the max of the
sums because every mode's price is symmetric per rank (a broadcast's receivers are charged what
the source sends). ``seconds`` turns a price into time on a ``Hardware`` profile over a ``Link``.

Pure: no torch.distributed, no Megatron. Every rank prices the same plan alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.block_grid import block_shape
from ..core.matrix_layout import MatrixLayout
from ..core.newton_schulz import (
    NSOptions,
    gram_block_rows,
    gram_blocks,
    gram_chunks,
    sharded_gram_flops,
    sharded_ns_flops,
    sharded_runs_gram,
    splits_gram,
)
from ..core.ns_traffic import pass_bytes, sharded_pass_bytes
from .cost_model import Cost, call_latency, collective_time, link_time, memory_time, ns_time
from .hardware import Hardware
from .teams import team_blocks, team_layout

__all__ = ["AUTO_CANDIDATES", "DISTRIBUTED_SUM_BYTES", "PRIMITIVES", "Link", "Price", "Widths", "dp_exchange",
           "hidden_s", "moved_s", "plan_cost", "rank_prices", "seconds", "sub_price", "team_exchange", "team_widths",
           "widths"]

PRIMITIVES = ("all_to_all", "all_gather", "all_reduce", "broadcast")
_A2A, _GATHER, _REDUCE, _CAST = range(4)

DISTRIBUTED_SUM_BYTES = 4
"""bytes per element of the distributed mode's all-reduces (its Grams, scale and norm): they run
in fp32 whatever the NS dtype (``parallel.tp_modes.REDUCE_DTYPE``); B's row gathers stay in it."""

AUTO_CANDIDATES = ("owner", "duplicated", "distributed")
"""the exact modes ``auto`` chooses among: narrow (``owner``; a replicated matrix ``duplicated``
on one rank, its result broadcast) or wide (``distributed`` or ``duplicated``), ``widths``."""

_ZERO4 = (0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Price:
    """One rank's share of some Newton–Schulz work and its collectives."""

    flops: float = 0.0
    """Newton–Schulz FLOPs it runs."""
    sent: float = 0.0
    """bytes leaving it (``comm.py``'s convention)."""
    link: tuple[float, float, float, float] = _ZERO4
    """per ``PRIMITIVES``, bytes over its busier link direction (max of sent and received)."""
    calls: tuple[int, int, int, int] = (0, 0, 0, 0)
    """per ``PRIMITIVES``, collective calls carrying a payload (each pays a latency)."""
    scalar_calls: int = 0
    """all-reduces of a few numbers (the distributed mode's scale and norm)."""
    memory: float = 0.0
    """bytes touched by the copies around the collectives (packing, joining, cutting)."""
    ns_bytes: float = 0.0
    """bytes its Newton–Schulz touches outside the GEMMs (``core.ns_traffic``)."""
    overlap: tuple[float, float] = (0.0, 0.0)
    """(GEMM FLOPs, all-reduce link bytes) that run side by side: a chunked Gram's rows formed
    while the previous chunk is summed (``gram_chunks``); ``hidden_s`` prices what that hides."""

    def __add__(self, other: Price) -> Price:
        return Price(self.flops + other.flops, self.sent + other.sent,
                     tuple(a + b for a, b in zip(self.link, other.link)),
                     tuple(a + b for a, b in zip(self.calls, other.calls)),
                     self.scalar_calls + other.scalar_calls, self.memory + other.memory,
                     self.ns_bytes + other.ns_bytes, tuple(a + b for a, b in zip(self.overlap, other.overlap)))


ZERO = Price()


@dataclass(frozen=True)
class Link:
    """The group a price's collectives run on: its size and whether it leaves a node."""

    size: int
    spans_nodes: bool


def _one(primitive: int, sent: float, link: float, calls: int = 1) -> tuple[float, tuple, tuple]:
    lk, cl = list(_ZERO4), [0, 0, 0, 0]
    lk[primitive], cl[primitive] = link, calls
    return sent, tuple(lk), tuple(cl)


def sub_price(sub: MatrixLayout, mode: str, ns: NSOptions, *, tp: int, rank: int, owner: int | None = None,
              grid: tuple[int, int] = (1, 1), megatron_core: bool = False) -> Price:
    """TP rank ``rank``'s price of one sub-matrix in ``mode`` on a TP group of ``tp``.

    ``owner``: the TP rank running it in owner mode, or a replicated one in duplicated and
    distributed mode at TP > 1 (the others receive its result). ``team``: the sub-matrix is a
    DP team's block, run in the distributed mode over ``sub.tp_size`` members. The owner mode's
    all-to-all calls are the micro-group's, shared by its matrices: not in a sub-matrix's price.
    ``megatron_core``: the distributed mode as megatron-core 0.19.2's ``TensorParallelMuon`` runs
    it (``_megatron_core_distributed``), not ours.
    """
    local, full, elem = sub.local_shape, sub.full_shape, ns.dtype_bytes
    local_n, full_n = sub.numel, full[0] * full[1]

    def run(shape: tuple[int, int], times: int = 1) -> dict:
        """NS of ``times`` matrices of ``shape`` on this rank: its FLOPs and its own passes."""
        return dict(flops=times * ns.flops(*shape), ns_bytes=times * pass_bytes(ns, *shape))

    if mode == "team":
        return sub_price(sub, "distributed", ns, tp=sub.tp_size, rank=0)
    if sub.tp_rows is not None and tp > 1:
        # a head of TP's row cut (per-head QKV at TP above the query groups), in the owner exchange
        # whatever the mode (``step_plan._held_heads``): each other holder's rows there and back
        held = [(hi - lo) * local[1] * elem for lo, hi in sub.tp_rows]
        moved = held[rank] if rank != owner else sum(held) - held[owner]
        sent, link, _ = _one(_A2A, moved, moved, 0)
        return Price(sent=sent, link=link, memory=2 * 2 * moved, **(run(full) if rank == owner else {}))
    if mode == "blockwise":  # NS of what the rank holds, block by block
        return Price(**run(block_shape(local, grid), grid[0] * grid[1]))
    sharded = sub.is_sharded and tp > 1
    if not sharded and mode in ("duplicated", "distributed") and tp > 1:
        # computed on its owner, the result broadcast: every rank's link carries it
        sent, link, calls = _one(_CAST, full_n * elem if rank == owner else 0, full_n * elem)
        return Price(sent=sent, link=link, calls=calls, **(run(full) if rank == owner else {}))
    if not sharded and mode != "owner" or tp == 1:  # NS of what the rank holds (a TP group of one)
        return Price(**run(local))
    if mode == "duplicated":  # gathered, NS everywhere; join the shards and cut the result back
        sent, link, calls = _one(_GATHER, (tp - 1) * local_n * elem, (tp - 1) * local_n * elem)
        return Price(sent=sent, link=link, calls=calls, memory=2 * 2 * full_n * elem, **run(full))
    if mode == "distributed":
        return _megatron_core_distributed(sub, tp, ns) if megatron_core else _distributed_price(sub, tp, ns)
    if mode != "owner":
        raise ValueError(f"sub_price: unknown TP mode {mode!r}; expected duplicated, distributed, blockwise, "
                         f"owner or team")
    # owner mode: the shards to the owner and the results back (a replicated matrix: its result only)
    if rank != owner:
        shard = local_n * elem if sharded and sub.is_sharded else 0
        received = local_n * elem if sub.is_sharded else full_n * elem
        sent, link, _ = _one(_A2A, shard, max(shard, received), 0)
        return Price(0, sent, link, memory=2 * (shard + received))
    out = (tp - 1) * (local_n if sub.is_sharded else full_n) * elem
    received = (tp - 1) * local_n * elem if sub.is_sharded else 0
    sent, link, _ = _one(_A2A, out, max(out, received), 0)
    return Price(sent=sent, link=link, memory=2 * (out + received), **run(full))


def _distributed_price(sub: MatrixLayout, tp: int, ns: NSOptions) -> Price:
    """Each rank's share of NS, the fp32 all-reduces of the Grams (k × k, k the unsharded dim),
    the scale and the norm, and where B's rows are split their all-gathers (Gram NS: one Gram per
    restart block and one scalar, the k × k iteration whole). A large Gram is summed in
    ``gram_chunks`` calls, all but the last beside the next chunk's rows of X·Xᵀ (``overlap``)."""
    local = sub.local_shape
    k, cols = (local[1], local[0]) if sub.partition_dim == 0 else local
    ring = 2 * (tp - 1) / tp * DISTRIBUTED_SUM_BYTES
    chunks = gram_chunks(k, tp)

    def side_by_side(grams: int) -> tuple[float, float]:
        share = (chunks - 1) / chunks  # the first chunk's rows and the last chunk's sum run alone
        return grams * 2 * k * k * cols * share, grams * ring * k * k * share

    if sharded_runs_gram(ns.method, k, cols, tp):
        grams = len(gram_blocks([None] * ns.steps, ns.restarts))
        reduced = ring * (grams * k * k + 1)
        return Price(sharded_gram_flops(k, cols, ns.steps, ns.restarts), reduced, (0.0, 0.0, reduced, 0.0),
                     (0, 0, grams * chunks, 0), scalar_calls=1, ns_bytes=sharded_pass_bytes(ns, k, cols, tp),
                     overlap=side_by_side(grams))
    reduced = ring * (ns.steps * k * k + 2)
    gathered = ns.steps * (tp - 1) * gram_block_rows(k, tp) * k * ns.dtype_bytes if splits_gram(k, cols, tp) else 0
    return Price(sharded_ns_flops(k, cols, ns.steps, tp), reduced + gathered, (0.0, gathered, reduced, 0.0),
                 (0, ns.steps if gathered else 0, ns.steps * chunks, 0), scalar_calls=2,
                 ns_bytes=sharded_pass_bytes(ns, k, cols, tp), overlap=side_by_side(ns.steps))


def _megatron_core_distributed(sub: MatrixLayout, tp: int, ns: NSOptions) -> Price:
    """megatron-core 0.19.2's distributed mode (emerging-optimizers' ``newton_schulz`` with a TP
    group): the squared norm all-reduced in fp32, then per step the k × k Gram all-reduced in the
    NS dtype and the quintic formed whole on every rank, A·A (2k³) and B·X (2k²·cols) beside the
    Gram's 2k²·cols: no split products, no all-gather, one scalar call."""
    local = sub.local_shape
    k, cols = (local[1], local[0]) if sub.partition_dim == 0 else local
    ring = 2 * (tp - 1) / tp
    reduced = ring * (ns.steps * k * k * ns.dtype_bytes + DISTRIBUTED_SUM_BYTES)
    return Price(ns.steps * (4 * k * k * cols + 2 * k ** 3), reduced, (0.0, 0.0, reduced, 0.0), (0, 0, ns.steps, 0),
                 scalar_calls=1, ns_bytes=sharded_pass_bytes(ns, k, cols, tp))


def seconds(price: Price, hw: Hardware, link: Link, *, batches: int, steps: int) -> float:
    """Seconds of ``price`` on ``hw`` with its collectives on ``link`` and its NS in ``batches``
    batched calls of ``steps`` iterations."""
    return (_compute_s(price, hw, batches, steps) + _comm_s(price, hw, link) - hidden_s(price, hw, link)
            + memory_time(price.memory, 0, hw))


def hidden_s(price: Price, hw: Hardware, link: Link) -> float:
    """Seconds of ``price``'s all-reduces that run under its GEMMs (``Price.overlap``): the shorter
    of the two side by side, of which ``hw.comm_overlap`` is hidden (a collective beside a GEMM
    slows both on a GPU)."""
    flops, nbytes = price.overlap
    if link.size <= 1 or not flops or not hw.comm_overlap:
        return 0.0
    return hw.comm_overlap * min(flops / hw.matmul_flops,
                                 link_time("all_reduce", nbytes, link.size, hw, link.spans_nodes))


def _compute_s(price: Price, hw: Hardware, batches: int, steps: int) -> float:
    return ns_time(price.flops, batches, hw, steps) + memory_time(price.ns_bytes, 0, hw) if price.flops else 0.0


def _comm_s(price: Price, hw: Hardware, link: Link) -> float:
    if link.size <= 1:
        return 0.0
    # a price may carry bytes whose calls are counted elsewhere (the owner exchange's, per micro-group)
    total = sum(link_time(p, b, link.size, hw, link.spans_nodes) + call_latency(p, c, link.size, hw)
                for p, b, c in zip(PRIMITIVES, price.link, price.calls))
    return total + call_latency("all_reduce", price.scalar_calls, link.size, hw, scalars=True)


# ---- auto's choice: a sub-matrix narrow or wide ---------------------------------------------


@dataclass(frozen=True)
class Widths:
    """One sub-matrix's (or, with teams, one unit's) predicted seconds in each width: what
    ``auto`` chooses between (``grid_schedule``)."""

    narrow_s: float
    """on its owner rank."""
    narrow_other_s: float
    """on each other rank of the group (sending its shard, receiving the result)."""
    wide_mode: str | None
    """the faster wide mode; None when it has none (a TP group of one, an empty matrix, a
    replicated one)."""
    wide_s: float
    """on every rank of the group, in ``wide_mode``."""
    narrow_move_s: float = 0.0
    """the part of ``narrow_s`` a unit placed on the member that holds it whole does not pay
    (with teams: the rest of the unit gathered from the other members)."""
    narrow_mode: str = "owner"
    """the mode it runs in narrow: ``owner`` (the owner exchange), or ``duplicated`` for a
    replicated matrix (computed on its TP rank, the result broadcast)."""

    def free_to_widen(self, tp: int) -> bool:
        """Wide costs the group no more rank-seconds than narrow (a tall-thin shard's tiny Gram):
        always wide."""
        return self.wide_mode is not None and tp * self.wide_s <= self.narrow_s + (tp - 1) * self.narrow_other_s


def widths(sub: MatrixLayout, hw: Hardware, ns: NSOptions, link: Link) -> Widths:
    """A sub-matrix's seconds narrow and wide on a TP group (``pricing.sub_price``, the plan's
    own price, on ``link``)."""
    tp = link.size

    def on(mode: str, rank: int, owner: int | None = None) -> float:
        price = sub_price(sub, mode, ns, tp=tp, rank=rank, owner=owner)
        return seconds(price, hw, link, batches=1 if price.flops else 0, steps=ns.steps)

    if tp == 1 or not sub.numel:
        return Widths(on("owner", 0, 0), 0.0, None, 0.0)
    if sub.tp_rows is not None:
        # A head of TP's row cut runs on the holder of most of its rows (``step_plan._held_heads``,
        # which overrides the schedule's owner): narrow only.
        held = [hi - lo for lo, hi in sub.tp_rows]
        owner = held.index(max(held))
        others = [on("owner", r, owner) for r in range(tp) if r != owner]
        return Widths(on("owner", owner, owner), max(others, default=0.0), None, 0.0)
    if sub.per_rank:
        # Each TP rank holds its own whole matrix (a head, ``MatrixLayout.per_rank``): NS on every
        # rank at once, nothing sent; blockwise's kernel is that, exactly. Narrow only, every rank alike.
        local = on("blockwise", 0)
        return Widths(local, local, None, 0.0, narrow_mode="blockwise")
    if not sub.is_sharded:
        # Every rank holds it, yet one computes it and broadcasts the result (the others' copies
        # could differ in their last bits, their GEMMs picking other kernels): narrow only.
        return Widths(on("duplicated", 0, 0), on("duplicated", 1, 0), None, 0.0, narrow_mode="duplicated")
    # owner: shards there and back (the all-to-alls' latency is the micro-group's, shared)
    narrow, other = on("owner", 0, 0), on("owner", 1, 0)
    duplicated, distributed = on("duplicated", 0), on("distributed", 0)
    if distributed < duplicated:
        return Widths(narrow, other, "distributed", distributed)
    return Widths(narrow, other, "duplicated", duplicated)


def team_widths(unit: MatrixLayout, team: int, hw: Hardware, ns: NSOptions) -> Widths:
    """A TP-1 unit on a team: narrow on one member (the rest of the unit gathered there over the
    node and returned), or wide as the team's blocks (each member receives its block and runs its
    share of the distributed mode); one task per unit, since a unit goes whole to one rank."""
    link = Link(team, False)  # a team is one node's DP ranks (teams.team_size)
    subs = unit.sub_matrices()
    compute = seconds(Price(flops=sum(ns.flops(*sub.full_shape) for sub in subs),
                            ns_bytes=sum(pass_bytes(ns, *sub.full_shape) for sub in subs)), hw, link,
                      batches=1, steps=ns.steps)
    gather = moved_s(unit.numel * ns.dtype_bytes * (team - 1) / team, hw, link)
    block = moved_s(unit.numel * ns.dtype_bytes / team, hw, link)
    layout = team_layout(unit, team)
    if layout is None:
        return Widths(compute + gather, block, None, 0.0, gather)
    wide = seconds(sub_price(layout, "team", ns, tp=team, rank=0), hw, link, batches=1, steps=ns.steps)
    return Widths(compute + gather, block, "team", wide + block, gather)


def moved_s(nbytes: float, hw: Hardware, link: Link) -> float:
    """Seconds a rank's link spends on ``nbytes`` of an all-to-all, without its call latency (the
    owner exchanges' calls are per micro-group, shared by the matrices in it)."""
    return seconds(Price(link=(nbytes, 0.0, 0.0, 0.0)), hw, link, batches=0, steps=0)


# ---- the DP exchange ----------------------------------------------------------------------


def dp_exchange(layout: MatrixLayout, owner: int, dp: int, elem: int) -> dict[int, tuple[int, int]]:
    """DP rank → (bytes sent, bytes received) for ``layout`` owned by DP rank ``owner``: each
    holder's piece to the owner and its result back; with every rank holding it whole (no
    distributed optimizer), the result broadcast from the owner."""
    out: dict[int, tuple[int, int]] = {}
    if not layout.numel or dp == 1:
        return out
    if layout.dp_ranges is None:
        n = layout.numel * elem
        return {r: ((n, 0) if r == owner else (0, n)) for r in range(dp)}
    moved = 0
    for r, n in layout.holders(dp).items():
        if r != owner:
            out[r] = (n * elem, n * elem)
            moved += n * elem
    if moved:
        out[owner] = (moved, moved)
    return out


def team_exchange(layout: MatrixLayout, t: int, team: int, elem: int) -> dict[int, tuple[int, int]]:
    """DP rank → (bytes sent, bytes received) for a unit that team ``t`` runs as blocks: each
    holder its piece of every block to that block's member, each member the pieces back."""
    out: dict[int, list[int]] = {}
    for block in team_blocks(layout, team, t * team):
        owner = block.owned.owner
        for p in block.owned.gather:
            if p.rank != owner:
                for r in (p.rank, owner):
                    out.setdefault(r, [0, 0])
                    out[r][0] += p.numel * elem
                    out[r][1] += p.numel * elem
    return {r: (s, v) for r, (s, v) in out.items()}


# ---- a plan's price -----------------------------------------------------------------------


def rank_prices(plan) -> tuple[tuple[Price, ...], tuple[float, ...], tuple[float, ...]]:
    """Per rank of ``plan`` (a ``step_plan.StepPlan``; this module is below it, so the type is not
    imported), indexed ``dp_rank * tp_size + tp_rank``: the price of its TP work, the bytes it sends in
    the DP exchange and the bytes over its busier DP link direction."""
    dp, tp, ns = plan.dp_size, plan.tp_size, plan.settings.ns
    grid = plan.settings.block_grid
    dp_sent, dp_link = [0.0] * dp, [0.0] * dp
    if plan.dp_owners is not None:
        for u, unit in enumerate(plan.units):
            lay = unit.layout
            t = plan.team_of(u)
            moves = (team_exchange(lay, t, plan.team_size, ns.dtype_bytes) if t is not None
                     else dp_exchange(lay, plan.dp_owners[u], dp, ns.dtype_bytes))
            for d, (s, r) in moves.items():
                dp_sent[d] += s
                dp_link[d] += max(s, r)
    prices: list[Price] = []
    for w in plan.work:
        for j in range(tp):
            total = ZERO
            for sub, mode, owner in zip(w.subs, w.modes, w.tp_owners):
                total = total + sub_price(sub, mode, ns, tp=tp, rank=j, owner=owner, grid=grid)
            prices.append(total)
    # every TP peer moves its own TP-local shard alike in the DP exchange (teams only at TP 1)
    return (tuple(prices), tuple(dp_sent[i // tp] for i in range(dp * tp)),
            tuple(dp_link[i // tp] for i in range(dp * tp)))


def plan_cost(plan, hw: Hardware, *, megatron_core: bool = False) -> Cost:
    """The busiest rank's seconds of ``plan``'s (a ``step_plan.StepPlan``) orthogonalization on
    ``hw``: its Newton–Schulz in batched calls (one per mode, shape and micro-group;
    ``megatron_core``: one per matrix, and the distributed mode as megatron-core's
    ``TensorParallelMuon`` runs it, ``_megatron_core_distributed``), its
    TP collectives (the owner exchange's two all-to-alls per micro-group, the blocking modes'
    calls per mode, shape and micro-group), a DP team's all-reduces on the team (inside a node),
    its copies and its DP exchange, with ``hw.comm_overlap`` of the owner pipeline's communication
    hidden under NS. Its ``ns_flops_max`` and ``bytes_sent_max`` are the plan's own
    (``plan.ns_flops``, ``plan.bytes_sent``): the cost model and the plan cannot disagree on them."""
    ns = plan.settings.ns
    if plan.local_blocks is not None:
        flops = max(plan.ns_flops, default=0)
        batches = max((sum(len(r.batches) for r in rounds) for rounds in plan.local_blocks), default=0)
        passes = max((sum(len(items) * pass_bytes(ns, *shape) for r in rounds for shape, items in r.batches)
                      for rounds in plan.local_blocks), default=0)
        compute = ns_time(flops, batches, hw, ns.steps) + memory_time(passes, 0, hw) if flops else 0.0
        return Cost(compute_s=compute, ns_flops_max=flops, parts=Counter({"ns": compute}))
    _, _, dp_link = rank_prices(plan)
    topo = plan.settings.topology_for(plan.dp_size, plan.tp_size)
    tp_link = Link(plan.tp_size, topo.tp_spans_nodes)
    team_link = Link(plan.team_size, False)  # a team is consecutive DP ranks of one node (teams.team_size)
    dp_group = Link(plan.dp_size, topo.dp_spans_nodes)
    group_of = {u: g for g, members in enumerate(plan.micro_groups) for u in members}
    exchanges = plan.dp_owners is not None and plan.dp_size > 1
    busiest, worst = Cost(), -1.0
    for d, work in enumerate(plan.work):
        calls = _group_calls(plan, work, group_of, megatron_core)
        for j in range(plan.tp_size):
            i = d * plan.tp_size + j
            tp_price, team_price, keys, runs = ZERO, ZERO, set(), 0
            for u in work.matrices:
                for p in work.sub_positions.get(u, ()):
                    sub, mode, owner = work.subs[p], work.modes[p], work.tp_owners[p]
                    price = sub_price(sub, mode, ns, tp=plan.tp_size, rank=j, owner=owner,
                                      grid=plan.settings.block_grid, megatron_core=megatron_core)
                    if mode == "team":
                        team_price = team_price + price
                    else:
                        tp_price = tp_price + price
                    if price.flops:
                        keys.add((group_of.get(u, 0), mode, sub.full_shape, sub.partition_dim))
                        runs += 1
            flops = tp_price.flops + team_price.flops
            compute = ns_time(flops, runs if megatron_core else len(keys), hw, ns.steps) if flops else 0.0
            compute += memory_time(tp_price.ns_bytes + team_price.ns_bytes, 0, hw)
            comm = _comm_s(_with_calls(tp_price, calls["tp"]), hw, tp_link) - hidden_s(tp_price, hw, tp_link)
            comm += _comm_s(_with_calls(team_price, calls["team"]), hw, team_link) - hidden_s(team_price, hw, team_link)
            if exchanges:
                comm += collective_time("all_to_all", dp_link[i], 2 * len(plan.micro_groups), dp_group.size, hw,
                                        dp_group.spans_nodes)
            copies = memory_time(tp_price.memory + team_price.memory + 2 * 2 * dp_link[i], 0, hw)
            groups = calls["owner groups"]
            if hw.comm_overlap > 0 and groups > 1:
                # the micro-group pipeline runs some groups' exchanges during the NS of others;
                # the first group's gather and the last one's return have nothing to hide under
                comm -= hw.comm_overlap * min(compute, comm * (groups - 1) / groups)
            if compute + comm + copies > worst:
                worst = compute + comm + copies
                busiest = Cost(compute, comm, copies, parts=Counter({"ns": compute, "collectives": comm,
                                                                     "copies": copies}))
    busiest.ns_flops_max = max(plan.ns_flops, default=0)
    busiest.bytes_sent_max = max(plan.bytes_sent, default=0)
    return busiest


def _with_calls(price: Price, calls: tuple[tuple[int, ...], int]) -> Price:
    return Price(price.flops, price.sent, price.link, calls[0], calls[1], price.memory, price.ns_bytes, price.overlap)


def _group_calls(plan, work, group_of: dict[int, int], megatron_core: bool) -> dict:
    """One DP owner's collective calls, which every rank of its TP group (or team) joins: per
    primitive the payload calls and the scalar all-reduces, for its TP modes (``tp``) and for its
    team blocks (``team``), and the micro-groups with owner-mode work (``owner groups``).
    Same-shape sub-matrices of one mode (and one TP owner) batch into one call within a
    micro-group (not ``megatron_core``'s, one call per matrix); the owner exchange posts two
    all-to-alls per micro-group with owner-mode work."""
    seen: set = set()
    out = {"tp": [[0, 0, 0, 0], 0], "team": [[0, 0, 0, 0], 0]}
    owner_groups: set[int] = set()
    ns = plan.settings.ns
    for u in work.matrices:
        g = group_of.get(u, 0)
        for p in work.sub_positions.get(u, ()):
            sub, mode, owner = work.subs[p], work.modes[p], work.tp_owners[p]
            if mode == "owner":
                owner_groups.add(g)
                continue
            key = (g, mode, sub.full_shape, sub.partition_dim, owner)
            if not megatron_core and key in seen:
                continue
            seen.add(key)
            one = sub_price(sub, mode, ns, tp=plan.tp_size, rank=owner or 0, owner=owner, megatron_core=megatron_core)
            acc = out["team" if mode == "team" else "tp"]
            acc[0] = [a + b for a, b in zip(acc[0], one.calls)]
            acc[1] += one.scalar_calls
    if plan.tp_size > 1:
        out["tp"][0][_A2A] += 2 * len(owner_groups)
    return {"tp": (tuple(out["tp"][0]), out["tp"][1]), "team": (tuple(out["team"][0]), out["team"][1]),
            "owner groups": len(owner_groups)}
