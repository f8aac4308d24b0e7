#!/usr/bin/env python
"""MuonBP's four claims (Khaled et al., arXiv 2510.16981) in miniature, through Megatron's own loop.

    .venv/bin/python -m scripts.bench.muonbp_study --out-dir docs/perf-results/muonbp-study
    .venv/bin/python -m scripts.bench.muonbp_study --smoke --out-dir /tmp/muonbp-smoke   # ~1.5 min

Every run is ``scripts/pretrain_gpt.py`` in one process (TP1, DP1, gloo, CPU, fp32) on the
byte-level dataset of ``scripts/prepare_data.py`` (built first if missing), with
``compare_optimizers``'s shared flags: a Llama-style GPT (RoPE, RMSNorm, SwiGLU, GQA, untied, no
bias), weight decay 0.1, Adam betas (0.9, 0.95), clip-grad 1.0, warmup over 10% of the iterations,
cosine to 0.1 × lr. ``--workers`` runs go at once, one core each (OMP_NUM_THREADS=1).

At TP1 the layout makes no blocks, so the block grid (``--muonbp-block-grid RxC``) makes them:
a block count n is the grid ``GRIDS[n]`` (2 = 2x1, 4 = 2x2, 8 = 4x2, 16 = 4x4) applied to every
hidden matrix (q, k, v, attention out, gate, up, fc2 apart). The paper's blocks are TP shards,
1 × t or t × 1 depending on the layer; ours are grids of both dims, so "n blocks" here is a
block count, not a TP degree.

Phases (each cell = one (variant, lr) at every seed; a cell already run is never run twice):

1. **lr sweep**: AdamW, Muon, BlockMuon (``--muonbp-period 0``, the comparison's grid) and MuonBP
   (``--muonbp-period P``, the same grid) at every lr of ``lrs``. Best lr = the lowest mean final
   validation loss over seeds. This phase is also claim 3's comparison (each at its best lr).
2. **ablation** (claim 1): MuonBP at every period × block count at Muon's best lr; period 1 is
   Muon, period ∞ (0) is BlockMuon.
3. **large lr** (claim 2): Muon, BlockMuon and MuonBP at Muon's best lr × each of ``lr_factors``
   (one lr for all three, so stability is compared at equal step sizes), with the parameter norm
   of the Muon matrices (``--muon-log-stats``) logged every ``log_interval`` iterations. A run that
   stops on a NaN here is a result (diverged), not a failure of the study.
4. **dual lr** (claim 4): MuonBP at its own best lr with ``--muonbp-block-lr-mult`` = (rc)^e for
   each e of ``mult_exponents`` (rc = the grid's block count): 1, (1/√(rc))^½ and 1/√(rc) are
   e = 0, −¼, −½; the others make the small sweep around them.

The flattening criterion for the token budget (fixed before the full study ran): at Muon's best
lr, the last quarter of the run brings less than ``FLAT_SHARE`` (5%) of the run's whole
validation-loss improvement from the initial loss ln(vocab 257) (mean over seeds): the curve has
given 95% of what this budget gives. The report states the share and the relative drop.

Outputs in ``--out-dir``: one log per run (``<variant>_lr<lr>_seed<seed>.log``), ``results.json``
(every run's curves, flags and status; rewritten after each run, so ``--reuse`` resumes an
interrupted study), ``results.md`` (the tables and the claims; also printed) and the PNGs of
``muonbp_study_report``. Exit 1 if a run outside the large-lr phase failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts.bench import compare_optimizers as compare

REPO = compare.REPO
GRIDS = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (4, 2), 16: (4, 4)}
FLAT_SHARE = 0.05
INITIAL_LOSS = 5.549076  # ln(257): the byte-level vocabulary's uniform loss


@dataclass(frozen=True)
class Variant:
    """One optimizer setting. ``kind``: adamw, muon or muonbp; MuonBP with ``period`` 0 is
    BlockMuon (never a full step); ``blocks`` is a key of GRIDS; ``mult`` the block lr multiplier."""

    kind: str
    period: int = 0
    blocks: int = 1
    mult: float = 1.0

    @property
    def slug(self) -> str:
        if self.kind != "muonbp":
            return self.kind
        base = f"blockmuon_b{self.blocks}" if self.period == 0 else f"muonbp_p{self.period}_b{self.blocks}"
        return base + ("" if self.mult == 1.0 else f"_mult{self.mult:.4g}")

    @property
    def label(self) -> str:
        if self.kind != "muonbp":
            return {"adamw": "AdamW", "muon": "Muon"}[self.kind]
        base = (f"BlockMuon, {self.blocks} blocks" if self.period == 0
                else f"MuonBP P={self.period}, {self.blocks} blocks")
        return base + ("" if self.mult == 1.0 else f", block lr × {self.mult:.3g}")

    def flags(self) -> list[str]:
        if self.kind == "adamw":
            return ["--optimizer", "adam"]
        flags = ["--optimizer", "muon", "--muon-tp-mode", "owner", "--muon-log-stats"]
        if self.kind == "muonbp":
            r, c = GRIDS[self.blocks]
            flags += ["--muonbp-period", str(self.period), "--muonbp-block-grid", f"{r}x{c}"]
            if self.mult != 1.0:
                flags += ["--muonbp-block-lr-mult", f"{self.mult:.6g}"]
        return flags


@dataclass(frozen=True)
class StudySize:
    """How big a study is. ``model_argv``: compare_optimizers flags for the model, batch, schedule
    and evaluation; ``periods`` use 0 for ∞; ``period`` and ``blocks`` are MuonBP's and BlockMuon's
    in phases 1, 3 and 4."""

    model_argv: tuple[str, ...]
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]
    periods: tuple[int, ...]
    block_counts: tuple[int, ...]
    period: int
    blocks: int
    lr_factors: tuple[float, ...]
    mult_exponents: tuple[float, ...]


FULL = StudySize(
    # 4 layers, hidden 128, 4 heads / 2 groups, ffn 320 (Megatron's SwiGLU default), seq 128; batch 16:
    # 2,048 tokens a step, 200 steps = 409,600 tokens; 4 evaluations of 8 batches (16,384 tokens) each.
    model_argv=("--hidden-size", "128", "--num-layers", "4", "--seq-length", "128", "--train-iters", "200",
                "--micro-batch-size", "16", "--global-batch-size", "16", "--evals", "4", "--eval-iters", "8",
                "--log-interval", "10"),
    seeds=(1, 2, 3), lrs=(1e-3, 2e-3, 4e-3), periods=(1, 2, 4, 8, 16, 0), block_counts=(2, 4, 8, 16),
    period=4, blocks=4, lr_factors=(3.0, 10.0), mult_exponents=(-1.0, -0.5, -0.25, 0.0, 0.25),
)
SMOKE = StudySize(
    model_argv=("--model", "tiny", "--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "4",
                "--evals", "2", "--eval-iters", "2", "--log-interval", "2"),
    seeds=(1, 2), lrs=(3e-3,), periods=(1, 2, 0), block_counts=(2, 4), period=2, blocks=4,
    lr_factors=(10.0,), mult_exponents=(-0.5, 0.0),
)


def comparison_variants(size: StudySize) -> list[Variant]:
    return [Variant("adamw"), Variant("muon"), Variant("muonbp", 0, size.blocks),
            Variant("muonbp", size.period, size.blocks)]


def ablation_variant(period: int, blocks: int) -> Variant:
    return Variant("muon") if period == 1 else Variant("muonbp", period, blocks)


def dual_lr_mults(size: StudySize) -> list[float]:
    """(rc)^e for each exponent, rc = the comparison grid's block count; 1 exactly at e = 0."""
    return [1.0 if e == 0 else round(size.blocks ** e, 6) for e in size.mult_exponents]


def sweep_jobs(size: StudySize) -> list[tuple[str, Variant, float]]:
    return [("sweep", v, lr) for v in comparison_variants(size) for lr in size.lrs]


def later_jobs(size: StudySize, lr_muon: float, lr_muonbp: float) -> list[tuple[str, Variant, float]]:
    """Phases 2-4, given Muon's and MuonBP's best lrs from the sweep."""
    jobs = [("ablation", ablation_variant(p, n), lr_muon) for p in size.periods for n in size.block_counts]
    stable = [Variant("muon"), Variant("muonbp", 0, size.blocks), Variant("muonbp", size.period, size.blocks)]
    jobs += [("large_lr", v, round(lr_muon * f, 9)) for f in size.lr_factors for v in stable]
    jobs += [("dual_lr", Variant("muonbp", size.period, size.blocks, m), lr_muonbp) for m in dual_lr_mults(size)]
    return jobs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the test suite's size: a 2-layer hidden-64 GPT, "
                   "6 iterations, 2 seeds, a reduced grid (about 1.5 minutes on 2 cores)")
    p.add_argument("--workers", type=int, default=2, help="runs at once, one core each (default 2)")
    p.add_argument("--data-dir", type=Path, default=REPO / "data",
                   help="where prepare_data.py wrote train/valid_text_document (built if missing)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "muonbp-study")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds before a run is killed")
    p.add_argument("--reuse", action="store_true",
                   help="keep --out-dir's successful runs whose Megatron flags are unchanged")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite results.md and the PNGs from --out-dir's results.json")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers: expected an integer >= 1, got {args.workers}")
    args.size = SMOKE if args.smoke else FULL
    return args


class Runner:
    """Runs (variant, lr, seed) once each, ``workers`` at a time, and records every run in
    ``results.json`` as it finishes."""

    def __init__(self, shared: list[str], out_dir: Path, timeout: float, meta: dict, previous: dict):
        self.shared, self.out_dir, self.timeout, self.meta = shared, out_dir, timeout, meta
        self.previous = previous
        self.runs: dict[tuple[Variant, float, int], dict] = {}
        self.lock = threading.Lock()

    def flags(self, variant: Variant, lr: float, seed: int) -> list[str]:
        return [*self.shared, *variant.flags(), "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--seed", str(seed)]

    def run(self, jobs: list[tuple[str, Variant, float]], seeds: tuple[int, ...], workers: int) -> None:
        todo, phases = [], {}
        for phase, variant, lr in jobs:
            for seed in seeds:
                key = (variant, lr, seed)
                phases.setdefault(key, []).append(phase)
                if key not in self.runs and key not in todo:
                    todo.append(key)
        for key, names in phases.items():
            if key in self.runs:
                self.runs[key]["phases"] = sorted(set(self.runs[key]["phases"]) | set(names))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for _ in pool.map(lambda key: self._one(key, phases[key]), todo):
                pass

    def _one(self, key: tuple[Variant, float, int], phases: list[str]) -> None:
        variant, lr, seed = key
        flags = self.flags(variant, lr, seed)
        old = self.previous.get(shlex.join(flags))
        result = old or compare.run_training(flags, self.out_dir / f"{variant.slug}_lr{lr:g}_seed{seed}.log",
                                             self.timeout, nproc=1)
        record = dict(result, variant=dataclasses.asdict(variant), slug=variant.slug, label=variant.label,
                      lr=lr, seed=seed, phases=sorted(set(phases)), flags=flags)
        with self.lock:
            self.runs[key] = record
            print(f"[{len(self.runs)}] {variant.label} lr {lr:g} seed {seed}: {record['status']}"
                  + (" (reused)" if old else f", final val {compare.fmt(_final(record))}, {record['wall_s']:.0f} s"),
                  flush=True)
            self.save()

    def save(self) -> None:
        (self.out_dir / "results.json").write_text(json.dumps(dict(meta=self.meta, runs=list(self.runs.values())),
                                                              indent=1))


def _final(record: dict) -> float | None:
    return record["val_loss"][-1][1] if record["status"] == "ok" else None


def previous_runs(path: Path) -> dict[str, dict]:
    """The successful runs of an earlier results.json, by their Megatron flags."""
    if not path.is_file():
        return {}
    keep = ("returncode", "wall_s", "log", "train_loss", "val_loss", "param_norm", "ms_per_iteration", "status",
            "best_val_loss")
    return {shlex.join(r["flags"]): {k: r[k] for k in keep} for r in json.loads(path.read_text())["runs"]
            if r["status"] == "ok"}


def main(argv=None) -> int:
    from scripts.bench import muonbp_study_report as report

    args = parse_args(argv)
    size = args.size
    out_dir = args.out_dir.resolve()
    if args.report_only:
        recorded = json.loads((out_dir / "results.json").read_text())
        size = StudySize(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded["meta"]["study"].items()})
        print(report.write(recorded["runs"], recorded["meta"], size, out_dir))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir.resolve()
    if not (data_dir / "train_text_document.bin").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(data_dir)],
                       check=True)
    model_args = compare.parse_args(list(size.model_argv))
    shared = compare.shared_flags(model_args, data_dir, out_dir / "data-cache")
    shared[shared.index("--tensor-model-parallel-size") + 1] = "1"  # TP1: the block grid makes the blocks
    dims = compare.model_dims(model_args)
    meta = dict(
        command=shlex.join(["python", "-m", "scripts.bench.muonbp_study", *(sys.argv[1:] if argv is None else argv)]),
        size="smoke" if args.smoke else "full", study=dataclasses.asdict(size), grids={str(n): f"{r}x{c}" for n, (r, c)
                                                                                        in GRIDS.items()},
        model=(f"{dims['num_layers']} layers, hidden {dims['hidden_size']}, {dims['num_attention_heads']} heads / "
               f"{dims['num_query_groups']} query groups, seq {dims['seq_length']}, TP1 DP1 (one process, CPU)"),
        train_iters=model_args.train_iters, tokens_per_run=model_args.train_iters * model_args.global_batch_size
        * dims["seq_length"], workers=args.workers, megatron_flags=shared,
    )
    runner = Runner(shared, out_dir, args.run_timeout, meta,
                    previous_runs(out_dir / "results.json") if args.reuse else {})
    runner.run(sweep_jobs(size), size.seeds, args.workers)
    records = list(runner.runs.values())
    lr_muon = report.best_lr(records, Variant("muon"), size.lrs)
    lr_muonbp = report.best_lr(records, Variant("muonbp", size.period, size.blocks), size.lrs)
    if lr_muon is None or lr_muonbp is None:
        print("Muon or MuonBP failed at every lr of the sweep; see the logs in " + str(out_dir), file=sys.stderr)
        return 1
    runner.run(later_jobs(size, lr_muon, lr_muonbp), size.seeds, args.workers)
    records = list(runner.runs.values())
    text = report.write(records, meta, size, out_dir)
    print("\n" + text)
    failed = [r for r in records if r["status"] != "ok" and r["phases"] != ["large_lr"]]
    if failed:
        print(f"{len(failed)} run(s) failed; see their logs in {out_dir}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    # Through the imported module, so that the report's Variant is this Variant (one class).
    from scripts.bench import muonbp_study

    sys.exit(muonbp_study.main())
