"""``--muon-tp-mode auto``: the per-matrix choice, its exactness, its hardware profiles, its flags.

The choice is pure (``choose_tp_modes`` on shapes and ``Hardware``), so most checks run here on
the real profiles and the cost model. Exactness runs gloo worlds of 2 and 4 ranks on a mixed list
whose choice uses all three exact modes in one call, and compares with ``newton_schulz`` of each
full matrix; one optimizer-level check compares ``MuonWithAdamW`` under auto and owner at TP 2.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from rounding_bounds import muon_params_bound, ns_bound

from megatron_muon import comm_stats, newton_schulz, orthogonalize_sharded
from megatron_muon.config import MuonConfig
from megatron_muon.core.matrix_layout import MatrixLayout, RowSplit
from megatron_muon.core.models import LLAMA3
from megatron_muon.core.newton_schulz import NSOptions
from megatron_muon.core.scaling import muon_scale
from megatron_muon.megatron.cli import add_muon_args, muon_config_from_args
from megatron_muon.optimizer import MatrixCatalogue, MuonWithAdamW
from megatron_muon.plan.auto_mode import choose_tp_modes, predicted_time
from megatron_muon.plan.hardware import CPU_GLOO, GPU_PROFILES, hardware_profile
from megatron_muon.plan.mode_cost import tp_mode_cost
from megatron_muon.plan.pricing import AUTO_CANDIDATES
from megatron_muon.plan.step_plan import TP_MODES as MODES

FP32_NS = NSOptions(dtype=torch.float32)  # shards in fp32: 4-byte elements

H100 = GPU_PROFILES["h100-sxm"]
# A machine with no per-call latency (collectives and kernels cost only their bytes and FLOPs).
# At test sizes every real profile is latency-bound, and the shared owner all-to-alls then win
# nearly everything; without latency the choice follows FLOPs and bytes, as it does for large
# matrices, so one small call mixes all three exact modes.
NO_LATENCY = dataclasses.replace(H100, name="no-latency", source="tests: h100-sxm without latencies",
                                 collective_latency_s=0.0, kernel_overhead_s=0.0)
# The exact modes differ from NS of the full matrix only in summation order (Gram sums over
# ranks, batched GEMMs, the other orientation's Gram), so the tolerance is two fp32 NS roundings
# of that matrix (rounding_bounds.ns_bound; test_tp_modes.fp32_bound): 1.8e-4 … 1.4e-3 here,
# measured ~1e-6, against 1e-2 … 1 for any non-exact answer (blockwise, a wrong shard).
def fp32_bound(matrix: torch.Tensor) -> float:
    return ns_bound(torch.float32, matrix)


def sub(rows: int, cols: int, pdim: int | None, tp: int) -> MatrixLayout:
    """A whole ``rows x cols`` matrix split along ``pdim`` over ``tp`` ranks, as a plan holds it."""
    return MatrixLayout.from_full_shape(f"{rows}x{cols}", (rows, cols), pdim, tp)


def _llama_submatrices(model: str, tp: int = 8) -> list[MatrixLayout]:
    """Every matrix NS runs on with split QKV (q, k, v summed over query groups) and split fc1."""
    shape = LLAMA3[model]
    out = []
    for name, rows, cols, pdim in shape.matrices():
        if name.endswith("linear_qkv"):
            subs = shape.qkv_sub_rows
        elif name.endswith("linear_fc1"):
            subs = (shape.ffn_hidden, shape.ffn_hidden)
        else:
            subs = (rows,)
        out += [sub(r, cols, pdim, tp) for r in subs]
    return out


def _argmin_mode(matrices, tp, hw, candidates=AUTO_CANDIDATES, **kw) -> str:
    costs = [tp_mode_cost(matrices, m, tp, hw, **kw).total_s for m in candidates]
    return candidates[costs.index(min(costs))]  # index() of the first minimum: the tie order


# ---- the choice (pure) ---------------------------------------------------------------------


def test_auto_is_a_mode_appended_last():
    # _validate_across_ranks sends MODES.index(mode): existing indices must not move.
    assert MODES == ("duplicated", "distributed", "blockwise", "owner", "auto")
    assert "blockwise" not in AUTO_CANDIDATES


def test_tall_thin_split_along_its_long_side_is_distributed():
    # 28672 x 512 row-split 8 ways: the Gram is only 512 x 512, so distributed does a sliver of
    # the FLOPs and sends 2·s·k² < what duplicated or owner move.
    m = [sub(28672, 512, 0, 8)]
    assert choose_tp_modes(m, 8, H100) == ["distributed"]
    assert _argmin_mode(m, 8, H100) == "distributed"


def test_many_same_shape_squares_are_owner():
    ms = [sub(4096, 4096, 1, 8)] * 32
    assert choose_tp_modes(ms, 8, H100) == ["owner"] * 32
    owner = tp_mode_cost(ms, "owner", 8, H100).total_s
    for other in ("duplicated", "distributed"):
        assert owner < tp_mode_cost(ms, other, 8, H100).total_s


@pytest.mark.parametrize("pdim", [0, 1])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_lone_large_square_is_the_argmin_of_the_exact_modes(tp, pdim):
    m = [sub(8192, 8192, pdim, tp)]
    chosen = choose_tp_modes(m, tp, H100)
    assert chosen[0] != "blockwise"
    assert chosen == [_argmin_mode(m, tp, H100)]


def test_deterministic_and_cached():
    ms = _llama_submatrices("8B")[:28] + [sub(512, 28672, 1, 8), sub(100, 60, None, 8)]
    first = choose_tp_modes(ms, 8, H100)
    assert choose_tp_modes(tuple(ms), 8, H100) == first
    assert choose_tp_modes(list(ms), 8, dataclasses.replace(H100)) == first  # equal, not identical
    again = choose_tp_modes(ms, 8, H100)
    again[0] = "changed"  # callers get a fresh list; the cache is not aliased
    assert choose_tp_modes(ms, 8, H100) == first


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_one_and_two_give_exact_modes(tp):
    ms = [sub(64, 32, 0, tp), sub(64, 64, 1, tp), sub(30, 20, None, tp), sub(2048, 16, 0, tp)]
    chosen = choose_tp_modes(ms, tp, H100)
    assert len(chosen) == len(ms) and set(chosen) <= set(AUTO_CANDIDATES)
    if tp == 1:
        assert "distributed" not in chosen  # nothing is split: no distributed form


def test_replicated_matrices_are_never_distributed():
    ms = [sub(4096, 512, None, 8)] * 3 + [sub(28672, 512, 0, 8)]
    for hw in (H100, NO_LATENCY, CPU_GLOO):
        chosen = choose_tp_modes(ms, 8, hw)
        assert all(c in ("owner", "duplicated") for c in chosen[:3]), (hw.name, chosen)


def test_same_shape_and_split_share_a_mode():
    ms = _llama_submatrices("8B")
    chosen = choose_tp_modes(ms, 8, NO_LATENCY)
    by_class: dict = {}
    for m, c in zip(ms, chosen):
        by_class.setdefault(m, set()).add(c)
    assert all(len(v) == 1 for v in by_class.values())


@pytest.mark.parametrize("model", ["8B", "70B"])
@pytest.mark.parametrize("hw", [H100, NO_LATENCY, CPU_GLOO], ids=lambda h: h.name)
def test_never_predicted_slower_than_a_uniform_mode(model, hw):
    """Coordinate descent starts from all-owner and never takes a move that raises the
    prediction, so auto <= all-owner by construction; on these shapes it also reaches (or
    beats) the other uniform assignments."""
    for tp in (2, 8):
        ms = _llama_submatrices(model, tp)
        chosen = choose_tp_modes(ms, tp, hw)
        auto = predicted_time(ms, chosen, tp, hw)
        for mode in AUTO_CANDIDATES:
            # 1e-12: the two sides sum the same positive float terms in another order, each off
            # by at most n·u of the total (Higham's γ_n; u = 1.1e-16, n < 1,000 sub-matrices here)
            assert auto <= tp_mode_cost(ms, mode, tp, hw).total_s * (1 + 1e-12), (tp, mode)


# ---- hardware profiles ---------------------------------------------------------------------


def test_profiles_by_name():
    assert hardware_profile("h100-sxm") is GPU_PROFILES["h100-sxm"]
    assert hardware_profile("h200") is GPU_PROFILES["h200"]
    assert hardware_profile("cpu-gloo") is CPU_GLOO


def test_detect(monkeypatch):
    from megatron_muon.plan import hardware

    if not torch.cuda.is_available():
        assert hardware_profile("detect") is CPU_GLOO
    detect = hardware._detected.__wrapped__  # uncached
    for name, want in [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                       ("NVIDIA A100-SXM4-80GB", "h100-sxm")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert detect() is GPU_PROFILES[want], name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect() is CPU_GLOO


def test_json_round_trip(tmp_path):
    for hw in (NO_LATENCY, CPU_GLOO, dataclasses.replace(H100, all_to_all_efficiency=0.6)):
        path = tmp_path / f"{hw.name}.json"
        path.write_text(json.dumps(dataclasses.asdict(hw)))  # what calibrate_hardware.py writes
        assert hardware_profile(str(path)) == hw
    # Integers where floats are expected are fine (JSON writes 2e9 as 2000000000.0, but by hand...)
    data = {**dataclasses.asdict(CPU_GLOO), "matmul_flops": 50_000_000_000}
    (tmp_path / "ints.json").write_text(json.dumps(data))
    assert hardware_profile(str(tmp_path / "ints.json")) == CPU_GLOO


@pytest.mark.parametrize(
    "content,match",
    [
        (None, r"--muon-auto-hardware: expected detect, one of \['cpu-gloo', 'h100-sxm', 'h200'\], or the path"),
        ("{not json", r"--muon-auto-hardware .*bad\.json: not a readable JSON file"),
        ("[1, 2]", r"--muon-auto-hardware .*: expected a JSON object of Hardware fields"),
        (json.dumps({"name": "x"}), r"--muon-auto-hardware .*: missing Hardware fields \['source', 'matmul_flops'"),
        (json.dumps({**dataclasses.asdict(CPU_GLOO), "speed": 1}), r"unknown Hardware fields \['speed'\]"),
        (json.dumps({**dataclasses.asdict(CPU_GLOO), "matmul_flops": -1}), r"field matmul_flops must be a number > 0"),
        (json.dumps({**dataclasses.asdict(CPU_GLOO), "ranks_per_node": 1.5}), r"ranks_per_node must be an integer"),
        (json.dumps({**dataclasses.asdict(CPU_GLOO), "fused_adam": 1}), r"field fused_adam must be true or false"),
        (json.dumps({**dataclasses.asdict(CPU_GLOO), "solo_gather_bandwidth": 0}),
         r"field solo_gather_bandwidth must be a number > 0 or null"),
    ],
    ids=["unknown_name", "bad_syntax", "not_object", "missing", "unknown_field", "negative", "float_ranks",
         "fused_adam_not_bool", "solo_gather_zero"],
)
def test_bad_profiles_name_the_flag(tmp_path, content, match):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    name = str(path) if content is not None else "a100-pcie"
    with pytest.raises(ValueError, match=match):
        hardware_profile(name)


# ---- config and CLI ------------------------------------------------------------------------


def test_cli_parses_auto_into_the_config():
    parser = add_muon_args(__import__("argparse").ArgumentParser())
    cfg = muon_config_from_args(parser.parse_args("--muon-tp-mode auto --muon-auto-hardware h100-sxm".split()))
    assert (cfg.tp_mode, cfg.auto_hardware, cfg.hardware()) == ("auto", "h100-sxm", H100)
    assert muon_config_from_args(parser.parse_args([])).auto_hardware == "detect"
    assert MuonConfig(tp_mode="owner").hardware() is None


def test_config_rejects_a_bad_hardware_in_every_mode():
    """A typo fails when it is made, not when someone later switches to auto."""
    for mode in ("auto", "owner"):
        with pytest.raises(ValueError, match=r"^--muon-auto-hardware: expected detect"):
            MuonConfig(tp_mode=mode, auto_hardware="tpu-v5")
    assert MuonConfig(tp_mode="owner", auto_hardware="h200").hardware() is None  # valid, and unused there


def test_muonbp_accepts_auto_for_its_full_steps():
    cfg = MuonConfig(tp_mode="auto", muonbp_period=5)
    assert [cfg.step_kind(t) for t in range(3)] == ["full", "block", "block"]


# ---- exactness across ranks ----------------------------------------------------------------


def _mixed_cases(t: int) -> list[tuple[tuple[int, int], int | None]]:
    """Tall-thin split along the long side (both dims), several same-shape squares, small wide
    ones, one replicated matrix: NO_LATENCY picks distributed, owner and duplicated for them.
    The squares are 320 wide: below ~256 at TP2, on NO_LATENCY's constants, a square costs less
    to compute on every rank than to send there and back, and duplicated takes them too. The
    tall-thin ones are 128·t long: at 64·t and TP2 the distributed mode's own passes (each rank
    normalizes, stacks and files its shard, ``core.ns_traffic``) cost more than sending the
    shard to one owner."""
    cases = [((128 * t, 8), 0), ((8, 128 * t), 1)]
    cases += [((320, 320), 0)] * (2 * t) + [((4 * t, 12 * t), 1)] * (2 * t)
    cases += [((24, 40), None), ((32 * t, 8), 0)]
    return cases


def _full(i: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(300 + i))


def _shard(full, pdim, t, rank):
    return full if pdim is None else full.chunk(t, dim=pdim)[rank].contiguous()


def _exact_worker(rank: int, t: int) -> dict:
    cases = _mixed_cases(t)
    shards = [_shard(_full(i, s), p, t, rank) for i, (s, p) in enumerate(cases)]
    pdims = [p for _, p in cases]
    with comm_stats() as stats:
        out = orthogonalize_sharded(shards, pdims, mode="auto", hardware=NO_LATENCY,
                                    full_shapes=[s for s, _ in cases])
    chosen = choose_tp_modes([sub(*s, p, t) for s, p in cases], t, NO_LATENCY, FP32_NS)
    return {"out": out, "chosen": chosen, "calls": dict(stats.calls)}


@pytest.mark.parametrize("t", [2, 4])
def test_auto_mixes_modes_and_matches_full_newton_schulz(t):
    cases = _mixed_cases(t)
    chosen = choose_tp_modes([sub(*s, p, t) for s, p in cases], t, NO_LATENCY, FP32_NS)
    assert set(chosen) == set(AUTO_CANDIDATES), chosen  # the call really mixes all three sub-modes
    assert chosen[0] == chosen[1] == "distributed" and chosen[-2] in ("owner", "duplicated")
    ranks = run_world(t, _exact_worker)
    for r in ranks:
        assert r["chosen"] == chosen  # every rank chose the same without communicating
    for i, (shape, pdim) in enumerate(cases):
        pieces = [r["out"][i] for r in ranks]
        if pdim is None:
            assert all(torch.equal(p, pieces[0]) for p in pieces)
            got = pieces[0]
        else:
            assert all(p.shape == pieces[0].shape for p in pieces)
            got = torch.cat(pieces, dim=pdim)
        want = newton_schulz(_full(i, shape))
        err = (got - want).abs().max().item()
        assert got.shape == shape and err <= fp32_bound(_full(i, shape)), (f"t={t} {shape} pdim={pdim} "
                                                                             f"({chosen[i]}): {err:.2e}")


def test_world_of_one_without_torch_distributed():
    assert not dist.is_initialized()
    mats = [_full(i, s) for i, s in enumerate([(96, 40), (40, 96), (64, 64)])]
    got = orthogonalize_sharded(mats, [0, 1, None], mode="auto", hardware=H100)
    for m, g in zip(mats, got):
        assert (g - newton_schulz(m)).abs().max().item() <= fp32_bound(m)


# ---- optimizer level -----------------------------------------------------------------------

TP = 2
# TP-local shards: QKV-like (split per group), column-split, tall-thin row-split, replicated.
OPT_SHAPES = [((24, 16), 0, RowSplit(2, (8, 2, 2))), ((16, 12), 1, None), ((128, 4), 0, None), ((6, 10), None, None)]
OPT_BASE = dict(momentum=0.9, nesterov=True, fp32_matmul_prec="highest", coefficient_type="jordan",
                scale_mode="spectral", extra_scale_factor=0.2)
OPT_STEPS = 3


def _opt_global(i: int, seed: int) -> torch.Tensor:
    (r, c), pdim, _ = OPT_SHAPES[i]
    shape = (r * TP, c) if pdim == 0 else (r, c * TP) if pdim == 1 else (r, c)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _opt_run(rank: int, cfg: MuonConfig, solo) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(_shard(_opt_global(i, 10 + i), pdim, TP, rank))
              for i, (_, pdim, _) in enumerate(OPT_SHAPES)]
    layouts = tuple(MatrixLayout(f"m{i}", shape, pdim, TP, split) for i, (shape, pdim, split) in enumerate(OPT_SHAPES))
    opt = MuonWithAdamW([dict(params=params, algorithm="muon", weight_decay=0.1)], lr=0.05, config=cfg,
                        catalogue=MatrixCatalogue(layouts, tuple(params), dp_group=solo, tp_group=dist.group.WORLD))
    for step in range(OPT_STEPS):
        for i, (p, (_, pdim, _)) in enumerate(zip(params, OPT_SHAPES)):
            p.grad = _shard(_opt_global(i, 1000 * step + i), pdim, TP, rank)
        opt.step()
    return [p.detach().clone() for p in params]


def _opt_bound() -> float:
    """How far two exact runs of ``_opt_run`` may end apart: their NS inputs (the momentum's
    U = (1 − μ)·G + μ·B, computed here in float64 from the same gradients) are the same, and each
    step's NS of every global sub-matrix (and, at MuonBP's block steps, of every TP shard's) may
    round differently: two fp32 NS roundings of it (rounding_bounds.ns_bound) times its scale,
    through three steps of lr 0.05 (rounding_bounds.muon_params_bound)."""
    worst = 0.0
    for i, (shape, pdim, split) in enumerate(OPT_SHAPES):
        lay = MatrixLayout(f"m{i}", shape, pdim, TP, split)
        buf = 0.0
        for step in range(OPT_STEPS):
            grad = _opt_global(i, 1000 * step + i).double()
            buf = OPT_BASE["momentum"] * buf + (1 - OPT_BASE["momentum"]) * grad
            update = (1 - OPT_BASE["momentum"]) * grad + OPT_BASE["momentum"] * buf
            shards = [lay.split_rows(_shard(update, pdim, TP, r)) for r in range(TP)]
            whole = [parts for parts in zip(*shards)] if pdim is not None else [(part,) for part in shards[0]]
            for parts in whole:
                matrices = [torch.cat(parts, dim=pdim) if pdim is not None else parts[0], *parts]
                for m in matrices:
                    scale = muon_scale(*m.shape, OPT_BASE["scale_mode"], OPT_BASE["extra_scale_factor"])
                    worst = max(worst, ns_bound(torch.float32, m, "jordan") * scale)
    return muon_params_bound(worst, 0.05, 1.0, 4.5, steps=OPT_STEPS)  # |θ| < 4.5: seeded Gaussians


def _opt_worker(rank: int, world: int, hardware_json: str) -> dict:
    solo = [dist.new_group([r]) for r in range(world)][rank]  # pure TP: a DP group of one
    out = {}
    for name, mode, period in [("owner", "owner", None), ("auto", "auto", None),
                               ("bp-owner", "owner", 2), ("bp-auto", "auto", 2)]:
        cfg = MuonConfig(tp_mode=mode, auto_hardware=hardware_json, muonbp_period=period, **OPT_BASE)
        out[name] = _opt_run(rank, cfg, solo)
    return out


def test_optimizer_auto_equals_owner_at_tp2(tmp_path):
    path = tmp_path / "no-latency.json"
    path.write_text(json.dumps(dataclasses.asdict(NO_LATENCY)))
    # The sub-matrices NS sees: q, k, v (global rows 32, 8, 8), the column split, the tall-thin
    # row split and the replicated one; the optimizer runs them in one call.
    layouts = [MatrixLayout(f"m{i}", s, p, TP, split) for i, (s, p, split) in enumerate(OPT_SHAPES)]
    subs = [s for lay in layouts for s in lay.sub_matrices()]
    assert len(set(choose_tp_modes(subs, TP, NO_LATENCY, FP32_NS))) >= 2
    ranks = run_world(TP, _opt_worker, str(path))
    bound = _opt_bound()  # 2.2e-4 (measured ≤ 1e-7); blockwise in place of an exact mode: ~1e-2
    for r in ranks:
        for a, b in (("auto", "owner"), ("bp-auto", "bp-owner")):
            for i, (x, y) in enumerate(zip(r[a], r[b])):
                err = (x - y).abs().max().item()
                assert err <= bound, f"{a} vs {b} param {i}: {err:.2e}"


def _mismatched_hardware_worker(rank: int, t: int) -> str:
    hw = NO_LATENCY if rank == 0 else GPU_PROFILES["h100-sxm"]
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    try:
        orthogonalize_sharded([x], [0], mode="auto", hardware=hw)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ranks_with_different_hardware_are_rejected_before_any_payload_moves():
    # Different constants could choose different modes per rank and hang the collectives; the
    # cross-rank check compares a checksum of the constants and names the flag instead.
    for message in run_world(2, _mismatched_hardware_worker):
        assert "ranks disagree on the call" in message and "--muon-auto-hardware" in message, message
