"""Tables, claims and PNGs of ``muonbp_study``'s runs (records as in its results.json).

A cell is one (variant, lr) over the study's seeds; its value is the mean ± sample standard
deviation of the runs' final validation loss. Comparisons between two cells are *paired*: the
same seed gives both runs the same initial weights and the same batches in the same order, so
the per-seed differences carry less noise than the two spreads. A difference counts as
resolved when |mean| > 2 × its standard error (std / √seeds) — about a 90% interval at 3 seeds
(t₂ = 2.9 would be 95%); anything smaller is reported as within seed noise.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from scripts.bench import compare_optimizers as compare
from scripts.bench.muonbp_study import (
    FLAT_SHARE,
    GRIDS,
    INITIAL_LOSS,
    StudySize,
    Variant,
    ablation_variant,
    comparison_variants,
    dual_lr_mults,
)

__all__ = ["best_lr", "write"]


def _variant(record: dict) -> Variant:
    return Variant(**record["variant"])


def _final(record: dict) -> float | None:
    return record["val_loss"][-1][1] if record["status"] == "ok" else None


def cell(records: list[dict], variant: Variant, lr: float) -> list[dict]:
    return sorted((r for r in records if _variant(r) == variant and r["lr"] == lr), key=lambda r: r["seed"])


def _complete(group: list[dict]) -> bool:
    return bool(group) and all(r["status"] == "ok" for r in group)


def mean_final(group: list[dict]) -> float | None:
    return statistics.fmean(_final(r) for r in group) if _complete(group) else None


def spread_text(group: list[dict]) -> str:
    """mean ± std of the final validation loss; the failed runs counted where any failed."""
    if not group:
        return "—"
    bad = sum(r["status"] != "ok" for r in group)
    if bad:
        return f"diverged {bad}/{len(group)}"
    return compare.spread([_final(r) for r in group])


def best_lr(records: list[dict], variant: Variant, lrs) -> float | None:
    """The lr of ``lrs`` with the lowest mean final validation loss, among complete cells."""
    scored = [(mean_final(cell(records, variant, lr)), lr) for lr in lrs]
    scored = [(m, lr) for m, lr in scored if m is not None]
    return min(scored)[1] if scored else None


def paired(a: list[dict], b: list[dict]) -> tuple[float, float, int] | None:
    """Mean and sample std of final(a) − final(b) over the seeds both finished; None if none."""
    fb = {r["seed"]: _final(r) for r in b if r["status"] == "ok"}
    diffs = [_final(r) - fb[r["seed"]] for r in a if r["status"] == "ok" and r["seed"] in fb]
    if not diffs:
        return None
    return statistics.fmean(diffs), (statistics.stdev(diffs) if len(diffs) > 1 else 0.0), len(diffs)


def resolved(diff: tuple[float, float, int]) -> bool:
    mean, std, n = diff
    return n > 1 and abs(mean) > 2 * std / math.sqrt(n)


def diff_text(diff: tuple[float, float, int] | None) -> str:
    if diff is None:
        return "—"
    mean, std, n = diff
    return f"{mean:+.4f} ± {std:.4f}" + ("" if resolved(diff) else " (noise)")


def _period_name(p: int) -> str:
    return "∞" if p == 0 else str(p)


def flattening(records: list[dict], lr_muon: float) -> tuple[float, float, int, int]:
    """Muon at its best lr, mean over seeds: (share of the improvement from INITIAL_LOSS made in the
    last quarter, relative drop of the validation loss over it, its first and last iteration)."""
    group = cell(records, Variant("muon"), lr_muon)
    its = [it for it, _ in group[0]["val_loss"]]
    last = its[-1]
    start = min(its, key=lambda it: abs(it - 0.75 * last))
    shares = [(dict(r["val_loss"])[start] - _final(r)) / (INITIAL_LOSS - _final(r)) for r in group]
    drops = [(dict(r["val_loss"])[start] - _final(r)) / _final(r) for r in group]
    return statistics.fmean(shares), statistics.fmean(drops), start, last


def ablation_lines(records, size: StudySize, lr: float) -> tuple[list[str], dict]:
    finite = sorted(p for p in size.periods if p > 1)
    p_lo, p_hi = finite[0], (finite[-1] if len(finite) > 1 else 0)
    lines = [f"Final validation loss at Muon's best lr {lr:g}, mean ± std over seeds; P=1 is Muon (no blocks), "
             "P=∞ is BlockMuon.", "",
             "| P \\ blocks | " + " | ".join(f"{n} ({'x'.join(map(str, GRIDS[n]))})" for n in size.block_counts) + " |",
             "|---|" + "---|" * len(size.block_counts)]
    for p in size.periods:
        lines.append(f"| {_period_name(p)} | " + " | ".join(
            spread_text(cell(records, ablation_variant(p, n), lr)) for n in size.block_counts) + " |")
    gaps = {n: paired(cell(records, ablation_variant(p_hi, n), lr), cell(records, ablation_variant(p_lo, n), lr))
            for n in size.block_counts}
    monotone = {}
    for n in size.block_counts:
        means = [mean_final(cell(records, ablation_variant(p, n), lr)) for p in sorted(size.periods, key=lambda p:
                                                                                    math.inf if p == 0 else p)]
        monotone[n] = all(a is not None and b is not None and a <= b for a, b in zip(means, means[1:]))
    lines += ["", f"Paired difference P={_period_name(p_hi)} − P={p_lo} per block count (positive: the smaller "
              "period is better): " + "; ".join(f"{n} blocks {diff_text(d)}" for n, d in gaps.items()) + ".",
              "Loss non-decreasing in P at: " + (", ".join(f"{n} blocks" for n, ok in monotone.items() if ok)
                                                 or "no block count") + ".", ""]
    return lines, dict(p_lo=p_lo, p_hi=p_hi, gaps=gaps, monotone=monotone)


def _norm_end(group: list[dict]) -> str:
    norms = [r["param_norm"][-1][1] for r in group if r["status"] == "ok" and r["param_norm"]]
    return compare.spread(norms) if norms else "—"


def large_lr_lines(records, size: StudySize, lr_muon: float) -> tuple[list[str], dict]:
    stable = [Variant("muon"), Variant("muonbp", 0, size.blocks), Variant("muonbp", size.period, size.blocks)]
    factors = (1.0, *size.lr_factors)
    lines = [f"Muon's best lr {lr_muon:g} × factor, one lr for all three. Final validation loss | parameter norm of "
             "the Muon matrices at the last logged iteration (mean ± std over seeds).", "",
             "| optimizer | " + " | ".join(f"{f:g}× val | {f:g}× norm" for f in factors) + " |",
             "|---|" + "---|---|" * len(factors)]
    for v in stable:
        lines.append(f"| {v.label} | " + " | ".join(
            f"{spread_text(g)} | {_norm_end(g)}" for g in (cell(records, v, round(lr_muon * f, 9)) for f in factors))
            + " |")
    per_factor = {}  # factor > 1 → (BlockMuon − Muon, BlockMuon − MuonBP, BlockMuon's failed seeds)
    lines.append("")
    for f in size.lr_factors:
        lr = round(lr_muon * f, 9)
        block = cell(records, stable[1], lr)
        per_factor[f] = (paired(block, cell(records, stable[0], lr)), paired(block, cell(records, stable[2], lr)),
                         sum(r["status"] != "ok" for r in block))
        lines.append(f"At {f:g}×, BlockMuon − Muon {diff_text(per_factor[f][0])}, BlockMuon − MuonBP "
                     f"{diff_text(per_factor[f][1])} (paired).")
    return lines + [""], per_factor


def write(records: list[dict], meta: dict, size: StudySize, out_dir: Path) -> str:
    """results.md and the PNGs into ``out_dir``; returns the markdown."""
    variants = comparison_variants(size)
    lrs = {v: best_lr(records, v, size.lrs) for v in variants}
    muon, bp = Variant("muon"), variants[3]
    lr_muon = lrs[muon]
    lines = ["# MuonBP study (megatron-muon, CPU)", "",
             f"Model: {meta['model']}. {meta['tokens_per_run']:,} training tokens per run ({meta['train_iters']} "
             f"iterations). Seeds: {', '.join(map(str, size.seeds))}. Block grids: "
             + ", ".join(f"{n} blocks = {g}" for n, g in meta["grids"].items() if n != "1") + ".", ""]
    share, drop, start, last = flattening(records, lr_muon)
    lines += [f"Token budget: from iteration {start} to {last} (the last quarter) Muon's validation loss at its best "
              f"lr fell {100 * drop:.2f}%, {100 * share:.1f}% of the run's whole improvement from ln(257); the "
              f"criterion is < {100 * FLAT_SHARE:g}% of it: "
              + ("met." if share < FLAT_SHARE else "**not met**: the curve has not flattened at this budget."), ""]

    lines += ["## 1. lr sweep (final validation loss)", "",
              "| optimizer | " + " | ".join(f"lr {lr:g}" for lr in size.lrs) + " | best lr |",
              "|---|" + "---|" * (len(size.lrs) + 1)]
    for v in variants:
        edge = " (grid edge)" if len(size.lrs) > 1 and lrs[v] in (min(size.lrs), max(size.lrs)) else ""
        lines.append(f"| {v.label} | " + " | ".join(spread_text(cell(records, v, lr)) for lr in size.lrs)
                     + f" | {compare.fmt(lrs[v], 'g')}{edge} |")
    lines += ["", "## 2. Each at its best lr (claim 3)", "",
              "| optimizer | lr | final val | best val | final train | − Muon (paired) | ms/iteration |",
              "|---|---|---|---|---|---|---|"]
    for v in variants:
        g = cell(records, v, lrs[v]) if lrs[v] is not None else []
        ok = _complete(g)
        lines.append(f"| {v.label} | {compare.fmt(lrs[v], 'g')} | {spread_text(g)} | "
                     + (compare.spread([r["best_val_loss"] for r in g]) if ok else "—") + " | "
                     + (compare.spread([r["train_loss"][-1][1] for r in g]) if ok else "—") + " | "
                     + ("" if v == muon else diff_text(paired(g, cell(records, muon, lr_muon)))) + " | "
                     + (f"{statistics.median(r['ms_per_iteration'] for r in g):.0f}" if ok else "—") + " |")
    lines += [""]
    ablation, abl = ablation_lines(records, size, lr_muon)
    lines += ["## 3. Ablation: period × block count (claim 1)", "", *ablation]
    large, big = large_lr_lines(records, size, lr_muon)
    lines += ["## 4. Large learning rates (claim 2)", "", *large]
    mults = dual_lr_mults(size)
    dual = {m: cell(records, Variant("muonbp", size.period, size.blocks, m), lrs[bp]) for m in mults}
    lines += ["## 5. Block learning rate (claim 4)", "",
              f"MuonBP P={size.period}, {size.blocks} blocks (rc = {size.blocks}, 1/√(rc) = "
              f"{size.blocks ** -0.5:.3g}) at its best lr {compare.fmt(lrs[bp], 'g')}; η_block = mult × η_full.", "",
              "| block lr mult | final val | − mult 1 (paired) |", "|---|---|---|"]
    for m, g in dual.items():
        lines.append(f"| {m:.4g} | {spread_text(g)} | {'' if m == 1.0 else diff_text(paired(g, dual[1.0]))} |")
    scored = [(mean_final(g), m) for m, g in dual.items() if mean_final(g) is not None]
    best_mult = min(scored)[1] if scored else None
    others = [(v, m) for v, m in scored if m != 1.0]
    best_other = min(others)[1] if others else None  # the best two-lr setting, against one shared lr
    lines += ["", f"Best multiplier: {compare.fmt(best_mult, '.4g')}.", ""]

    lines += ["## The paper's claims at this size", "", "| claim | paper | measured | held |", "|---|---|---|---|"]
    lines += _claim_rows(abl, big, paired(cell(records, bp, lrs[bp]), cell(records, muon, lr_muon)),
                         best_mult, paired(dual[best_other], dual[1.0]) if best_other is not None else None, size)
    lines += ["", f"Command: `{meta['command']}`", ""]
    text = "\n".join(lines)
    (out_dir / "results.md").write_text(text)
    _plots(records, size, lrs, lr_muon, dual, out_dir, meta)
    return text


def _claim_rows(abl, big, bp_vs_muon, best_mult, best_vs_one, size) -> list[str]:
    """One row per claim; "held" says where it held, resolved (|mean| > 2 standard errors) or not."""
    def verdict(ok: bool, diffs) -> str:
        noisy = any(d is None or not resolved(d) for d in diffs)
        return ("yes" if ok else "no") + (", within seed noise" if noisy else "")

    gaps = abl["gaps"]
    ns = list(gaps)
    held = [n for n, d in gaps.items() if d is not None and d[0] > 0 and resolved(d)]
    grows = all(gaps[a] is not None and gaps[b] is not None and gaps[a][0] <= gaps[b][0] for a, b in zip(ns, ns[1:]))
    where = ("at every block count" if held == ns else f"at {', '.join(map(str, held))} blocks" if held
             else "at no block count")
    row1 = (f"| 1. smaller P lowers the loss at every block count, more so with more blocks | P=2 vs 16 at "
            f"TP 2/4/8/16: +0.037 / +0.092 / +0.079 / +0.113 | P={_period_name(abl['p_hi'])} − P={abl['p_lo']}: "
            + "; ".join(f"{n}: {diff_text(d)}" for n, d in gaps.items())
            + f" | {'yes' if held == ns else 'partly' if held else 'no'}: lower {where} (resolved); the gap "
            + ("grows" if grows else "does not grow monotonically") + " with the block count |")
    parts, held2 = [], []
    for f, (vs_muon, vs_bp, failed) in big.items():
        ok = failed > 0 or (vs_muon is not None and vs_bp is not None and vs_muon[0] > 0 and vs_bp[0] > 0)
        held2.append(ok and (failed > 0 or (resolved(vs_muon) and resolved(vs_bp))))
        parts.append(f"{f:g}×: {verdict(ok, [] if failed else [vs_muon, vs_bp])}")
    row2 = ("| 2. BlockMuon is unstable at a large lr | 8B: BlockMuon ppl 24.68 vs Muon 13.40, MuonBP 12.97 | "
            "BlockMuon − Muon / − MuonBP at "
            + "; ".join(f"{f:g}×: {diff_text(a)} / {diff_text(b)}" + (f", diverged in {n} seeds" if n else "")
                        for f, (a, b, n) in big.items())
            + f" | {'yes' if all(held2) else 'partly' if any(held2) else 'no'} ({'; '.join(parts)}) |")
    ok3 = bp_vs_muon is not None and bp_vs_muon[0] <= 0
    row3 = (f"| 3. MuonBP ≤ Muon at the best lr | 960M: 15.12 vs 15.33 ppl; 8B: 12.77 vs 12.90 | MuonBP − Muon "
            f"{diff_text(bp_vs_muon)} | {verdict(ok3, [bp_vs_muon])} |")
    lo = size.blocks ** -0.5
    in_range = best_mult is not None and lo - 1e-9 <= best_mult <= 1.0 + 1e-9
    two_beat_one = best_vs_one is not None and best_vs_one[0] < 0
    row4 = (f"| 4. two lrs beat one; best η_block/η_full in [1/√(rc), 1] | theory | best multiplier "
            f"{compare.fmt(best_mult, '.4g')}; the best other than 1 − mult 1: {diff_text(best_vs_one)} | optimum in "
            f"[{lo:.3g}, 1]: {'yes' if in_range else 'no'}; two lrs beat one: "
            f"{verdict(two_beat_one, [best_vs_one])} |")
    return [row1, row2, row3, row4]


def _band(ax, group: list[dict], key: str, label: str, tokens_per_iteration: int) -> None:
    runs = [r for r in group if r["status"] == "ok" and r[key]]
    if not runs:
        return
    n = min(len(r[key]) for r in runs)
    x = [it * tokens_per_iteration for it, _ in runs[0][key][:n]]
    ys = [[v for _, v in r[key][:n]] for r in runs]
    line, = ax.plot(x, [statistics.fmean(v) for v in zip(*ys)], label=f"{label} ({len(runs)} seeds)")
    if len(runs) > 1:
        ax.fill_between(x, [min(v) for v in zip(*ys)], [max(v) for v in zip(*ys)], color=line.get_color(), alpha=0.2)


def _plots(records, size, lrs, lr_muon, dual, out_dir: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tpi = meta["tokens_per_run"] // meta["train_iters"]
    periods = size.periods
    grid = [[mean_final(cell(records, ablation_variant(p, n), lr_muon)) for n in size.block_counts] for p in periods]
    fig, ax = plt.subplots(figsize=(1.6 * len(size.block_counts) + 2, 0.7 * len(periods) + 1.5))
    values = [[math.nan if v is None else v for v in row] for row in grid]
    im = ax.imshow(values, cmap="viridis_r", aspect="auto")
    for i, p in enumerate(periods):
        for j, n in enumerate(size.block_counts):
            ax.text(j, i, spread_text(cell(records, ablation_variant(p, n), lr_muon)).replace(" ± ", "\n± "),
                    ha="center", va="center", fontsize=8, color="white")
    ax.set_xticks(range(len(size.block_counts)), [f"{n} ({'x'.join(map(str, GRIDS[n]))})" for n in size.block_counts])
    ax.set_yticks(range(len(periods)), [_period_name(p) for p in periods])
    ax.set_xlabel("blocks per matrix (grid)")
    ax.set_ylabel("period P")
    ax.set_title(f"final validation loss, lr {lr_muon:g}")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(out_dir / "ablation_heatmap.png", dpi=120)
    plt.close(fig)

    factors = (1.0, *size.lr_factors)
    stable = [Variant("muon"), Variant("muonbp", 0, size.blocks), Variant("muonbp", size.period, size.blocks)]
    fig, axes = plt.subplots(2, len(factors), figsize=(5 * len(factors), 8), squeeze=False)
    for j, f in enumerate(factors):
        for v in stable:
            g = cell(records, v, round(lr_muon * f, 9))
            _band(axes[0][j], g, "train_loss", v.label, tpi)
            _band(axes[1][j], g, "param_norm", v.label, tpi)
        axes[0][j].set_title(f"training loss, lr {lr_muon * f:g} ({f:g}× Muon's best)")
        axes[1][j].set_title("parameter norm of the Muon matrices")
        for ax in axes[:, j]:
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "large_lr.png", dpi=120)
    plt.close(fig)

    fig, (ax_val, ax_mult) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in comparison_variants(size):
        if lrs[v] is not None:
            _band(ax_val, cell(records, v, lrs[v]), "val_loss", f"{v.label}, lr {lrs[v]:g}", tpi)
    ax_val.set_title("validation loss, each at its best lr")
    ax_val.set_xlabel("tokens")
    ax_val.grid(alpha=0.3)
    ax_val.legend(fontsize=8)
    points = [(m, [_final(r) for r in g if r["status"] == "ok"]) for m, g in dual.items()]
    points = [(m, v) for m, v in points if v]
    ax_mult.errorbar([m for m, _ in points], [statistics.fmean(v) for _, v in points],
                     yerr=[statistics.stdev(v) if len(v) > 1 else 0 for _, v in points], marker="o", capsize=3)
    ax_mult.axvline(size.blocks ** -0.5, ls="--", color="grey", label="1/√(rc)")
    ax_mult.set_xscale("log")
    ax_mult.set_xlabel("η_block / η_full")
    ax_mult.set_ylabel("final validation loss")
    ax_mult.set_title(f"MuonBP P={size.period}, {size.blocks} blocks")
    ax_mult.grid(alpha=0.3)
    ax_mult.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "comparison.png", dpi=120)
    plt.close(fig)
