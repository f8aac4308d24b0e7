"""Per-class figures of one Muon step on this rank (``--muon-log-stats``; the math in
``core.update_stats``).

A recording step (``MuonWithAdamW.record_norms``, set only for steps a log reads) fills one
``CLASSES`` × ``FIELDS`` table on the optimizer's device, never read on the step's path:

* ``update_sq``: Σ(scale·O)² of the pieces this rank counts (``add_update``, from the step's
  ``apply``: every element of a Muon matrix on exactly one rank of the optimizer's norm groups);
* ``matched_sq``, ``elements``: the same pieces' matched mean square and count, fixed at
  construction (``ClassStats``);
* ``residual_sum``, ``residual_count``: the orthogonality residual of each sub-matrix of the
  sampled weights (``sample_weights``), measured where the whole NS output is
  (``measure_residuals``, called by the step's micro-group task), once per DP group: by its DP
  owner, or by every DP rank where the step has no DP exchange, whose mean is the same.

The table is summed over ranks by the log (``megatron.log_stats``); its columns are sums and
counts, so any replication that multiplies a class's sums and counts alike leaves the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.matrix_layout import MatrixLayout
from ..core.update_stats import (
    CLASSES,
    FIELDS,
    matched_mean_square,
    matrix_class,
    orthogonality_residual,
    residual_from_gram,
    sample_weights,
    unsplit_gram,
)
from . import comm

__all__ = ["ClassStats", "ResidualProbe", "StepStats", "measure_residuals"]

SAMPLES_PER_CLASS = 2
"""weights per class whose residual a recording step measures (the first and last of the stage)."""


@dataclass(frozen=True)
class ResidualProbe:
    """What the step measures the residual of, and where it goes."""

    weights: frozenset[int]
    """the sampled weights (indices into the plan's ``matrices``), the same on every rank."""
    record: Callable[[int, torch.Tensor], None]
    """``record(weight, residual)``: one sub-matrix's residual (a device 0-d tensor)."""


class ClassStats:
    """What a recording step's table needs from the catalogue, computed once: each weight's
    class, the sampled weights, and the counted pieces' matched mean square and element count."""

    def __init__(self, layouts: Sequence[MatrixLayout], counted: Sequence[bool], dp_rank: int, scale_mode: str,
                 extra_scale_factor: float, device: torch.device) -> None:
        self.counted = counted
        """the ``counted`` list it was built for (the optimizer rebuilds when its norm groups change)."""
        self.class_of = [CLASSES.index(matrix_class(lay.name, per_head=lay.per_head)) for lay in layouts]
        self.sample = frozenset(sample_weights([CLASSES[c] for c in self.class_of], SAMPLES_PER_CLASS))
        fixed = [[0.0] * len(FIELDS) for _ in CLASSES]
        for i, (lay, mine) in enumerate(zip(layouts, counted)):
            if not mine or not lay.numel:
                continue
            start, end = lay.local_range(dp_rank)
            per_sub = [matched_mean_square(r, c, scale_mode, extra_scale_factor) for r, c in lay.sub_global_shapes()]
            fixed[self.class_of[i]][1] += _range_sum(lay, per_sub, start, end)
            fixed[self.class_of[i]][2] += end - start
        self._fixed = torch.tensor(fixed, dtype=torch.float32, device=device)

    def start(self) -> StepStats:
        """A fresh table for one recording step."""
        return StepStats(self)


class StepStats:
    """One recording step's table (see the module docstring) and the callbacks that fill it."""

    def __init__(self, classes: ClassStats) -> None:
        self._class_of = classes.class_of
        self.table = classes._fixed.clone()
        """``CLASSES`` × ``FIELDS``, fp32, on the optimizer's device."""
        self.probe = ResidualProbe(classes.sample, self._record)

    def add_update(self, i: int, norm_sq: torch.Tensor, scale: float) -> None:
        """Weight ``i``'s counted piece: ``norm_sq`` = ‖O_piece‖² (a device scalar), ``scale`` its
        scale (1.0 where the piece is scaled row by row already)."""
        self.table[self._class_of[i], 0].add_(norm_sq, alpha=scale * scale)

    def _record(self, weight: int, residual: torch.Tensor) -> None:
        row = self.table[self._class_of[weight]]
        row[3].add_(residual)
        row[4].add_(1.0)


def _range_sum(layout: MatrixLayout, per_sub: list[float], start: int, end: int) -> float:
    """Σ over the TP-local shard's flat elements [start, end) of their sub-matrix's value
    (``per_sub``): the rows of a fused weight repeat ``split.sizes`` rows per group, one size per
    sub-matrix (``MatrixLayout.split_rows``), so the sum is a prefix difference, in closed form."""
    cols = layout.local_shape[1]
    # a ``tp_blocks`` layout (heads that TP's row cut may split) has no split: its heads are all
    # head_dim x hidden (GQA), so one value holds for every row
    if layout.tp_blocks is not None and len(set(per_sub)) > 1:
        raise ValueError(f"{layout.name}: heads of different shapes under TP's row cut: {sorted(set(per_sub))}")
    sizes = (layout.local_shape[0],) if layout.split is None else layout.split.sizes
    period, per_period = sum(sizes), cols * sum(n * v for n, v in zip(sizes, per_sub))

    def prefix(x: int) -> float:
        row, col = divmod(x, cols)
        groups, rest = divmod(row, period)
        total = groups * per_period
        for n, v in zip(sizes, per_sub):
            if rest >= n:
                total, rest = total + n * cols * v, rest - n
            else:
                return total + (rest * cols + col) * v
        return total

    return prefix(end) - prefix(start)


def measure_residuals(probe: ResidualProbe, work, owned: Sequence[int], unit_weight: Sequence[int], teams,
                      done: dict[int, torch.Tensor], owner_positions: Sequence[int],
                      owner_results: dict[int, torch.Tensor], tp_group, tp_rank: int,
                      block_grid: tuple[int, int] = (1, 1)) -> None:
    """The residual of every sub-matrix of the sampled weights among ``owned`` (the units whose
    NS this rank's TP group has just run: ``done``, position → this TP rank's result), each
    measured once per TP group:

    * in the owner exchange (pipelined, or blocking for the heads of TP's row cut outside owner
      and auto mode), on the TP owner, from its whole result (``owner_results``, keyed by index
      in ``owner_positions``): no collective;
    * a ``per_rank`` sub-matrix (a head whole on its TP rank, each rank's its own matrix): on
      every TP rank, from its own result, unless the blockwise kernel cuts it into a
      ``block_grid`` of blocks (MuonBP's block steps): no collective;
    * whole on every TP rank (TP 1, or not TP-split): on the plan's TP owner (rank 0 when none);
    * TP-split in duplicated or distributed mode, when TP splits the long side: each rank's Gram
      over the unsplit short side, k × k, summed by one all-reduce over the TP group for the whole
      micro-group, then the residual on TP rank 0;
    * TP-split along the short side: the shards all-gathered (k·L elements, fewer than the long
      side's L² Gram) and the residual computed on TP rank 0.

    Every TP peer owns the same units and reads the same plan, so each issues the same
    collectives in the same order, sizes from the plan. Skipped: the blockwise mode's TP shards
    and a DP team's blocks (no rank runs NS of the whole matrix). The collectives are uncounted
    (``comm.uncounted``): they are the log's traffic, not the plan's."""
    at = {p: j for j, p in enumerate(owner_positions)}
    grams: list[tuple[int, torch.Tensor]] = []
    for u in owned:
        w = unit_weight[u]
        if w not in probe.weights or (teams is not None and teams[u] is not None):
            continue
        for p in work.sub_positions[u]:
            sub, mode = work.subs[p], work.modes[p]
            if sub.per_rank and block_grid == (1, 1):  # blockwise's kernel on this TP rank's whole matrix
                probe.record(w, orthogonality_residual(done[p].reshape(sub.local_shape)))
                continue
            if mode in ("blockwise", "team"):
                continue
            if p in at:
                if at[p] in owner_results:
                    probe.record(w, orthogonality_residual(owner_results[at[p]].reshape(sub.full_shape)))
                continue
            mine = done[p].reshape(sub.local_shape)
            if not sub.is_sharded:
                if tp_rank == (work.tp_owners[p] or 0):
                    probe.record(w, orthogonality_residual(mine))
                continue
            rows, cols = sub.full_shape
            if (cols <= rows) if sub.partition_dim == 0 else (rows <= cols):  # the unsplit side is the short one
                grams.append((w, unsplit_gram(mine, sub.partition_dim)))
                continue
            parts = [torch.empty_like(mine) for _ in range(sub.tp_size)]
            with comm.uncounted():
                comm.all_gather(parts, mine.contiguous(), tp_group)
            if tp_rank == 0:
                probe.record(w, orthogonality_residual(torch.cat(parts, dim=sub.partition_dim)))
    if not grams:
        return
    flat = torch.cat([g.reshape(-1) for _, g in grams])
    with comm.uncounted():
        comm.all_reduce(flat, tp_group)
    offset = 0
    for w, g in grams:
        side = g.shape[0]
        if tp_rank == 0:
            probe.record(w, residual_from_gram(flat[offset:offset + side * side].view(side, side)))
        offset += side * side
