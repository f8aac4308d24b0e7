"""The startup report's name patterns and the per-step scalars handed to TensorBoard / W&B.

The report itself is checked where it is printed: by Megatron's training loop (test_pretrain.py)
and by the dry run at Llama-3 sizes (test_dry_run.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_muon.megatron.log_stats import muon_scalars, write_scalars
from megatron_muon.megatron.report import name_pattern


@pytest.mark.parametrize("name, pattern", [
    ("chunk0.module.module.decoder.layers.11.mlp.linear_fc1.weight", "decoder.layers.*.mlp.linear_fc1.weight"),
    ("chunk1.module.decoder.layers.3.self_attention.linear_qkv.weight",
     "decoder.layers.*.self_attention.linear_qkv.weight"),
    ("module.embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight",
     "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight"),
])
def test_name_patterns_fold_layer_numbers(name, pattern):
    assert name_pattern(name) == pattern


class _Writer:
    """Megatron's writer interfaces (``add_scalar``; W&B's ``log``), recording what they get."""

    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def _inner(kind: str):
    stats = dict(kind=kind, bytes_sent=2_500_000, ns_flops=3e12, orthogonalize_ms=4.5, timing="host clock")
    return SimpleNamespace(last_step_stats=stats)


def test_scalars_of_the_last_step():
    assert muon_scalars([_inner("full")]) == {"muon/bytes_sent_mb": 2.5, "muon/orthogonalize_ms": 4.5,
                                             "muon/ns_tflop": 3.0, "muon/full_step": 1.0}
    assert muon_scalars([_inner("block")])["muon/full_step"] == 0.0
    assert muon_scalars([SimpleNamespace(last_step_stats={})]) == {}  # before the first step


def test_writers_get_the_scalars(monkeypatch):
    from megatron.training import global_vars

    tensorboard, wandb = _Writer(), _Writer()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", tensorboard)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
    write_scalars([_inner("muon")], 40)
    assert ("muon/orthogonalize_ms", 4.5, 40) in tensorboard.scalars and len(tensorboard.scalars) == 4
    assert wandb.logged == [(muon_scalars([_inner("muon")]), 40)]
    norms = {"muon/param_norm": 12.5, "muon/update_rms_muon": 1e-3}  # log_stats.norm_scalars' reduced figures
    write_scalars([_inner("muon")], 42, norms)
    assert ("muon/param_norm", 12.5, 42) in tensorboard.scalars and ("muon/update_rms_muon", 1e-3, 42) in \
        tensorboard.scalars
    assert wandb.logged[-1] == ({**muon_scalars([_inner("muon")]), **norms}, 42)
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    write_scalars([_inner("muon")], 41)  # no writer configured: nothing to do, nothing raised


def _report(tp_mode: str, tp: int, **config) -> str:
    """The startup report of one 64x32 TP-row-sharded matrix plus a norm (one process)."""
    import torch

    from megatron_muon.config import MuonConfig
    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.megatron.report import startup_report
    from megatron_muon.optimizer import step_plans

    chunk = torch.nn.Module()
    chunk.linear_fc2 = torch.nn.Linear(32, 64 // tp, bias=False)
    chunk.norm = torch.nn.LayerNorm(32, bias=False)
    muon_config = MuonConfig(tp_mode=tp_mode, **config)
    layout = MatrixLayout("chunk0.decoder.layers.0.mlp.linear_fc2.weight", (64 // tp, 32), 0, tp)
    # The plans an optimizer of this rank would build (one process cannot hold a TP group of tp).
    return startup_report(step_plans(muon_config, [layout], 1, tp), [chunk], muon_config)


def test_blockwise_at_tp_above_one_is_announced_as_blockmuon():
    """Item 7 of issue 13: a run that is BlockMuon says so at startup and names the exact flag."""
    line = ("  BlockMuon: tp mode blockwise orthogonalizes each TP shard on its own, an update that changes "
            "with the TP size (not Muon); --muon-tp-mode owner (muon_tp_mode='owner') is exact")
    assert line in _report("blockwise", 2).splitlines()
    assert "BlockMuon" not in _report("owner", 2)
    assert "BlockMuon" not in _report("blockwise", 1)  # one TP rank: blockwise is Muon
    assert "  BlockMuon:" not in _report("blockwise", 2, muonbp_period=0)  # MuonBP says what it does


def test_the_muonbp_line_says_what_each_period_does():
    """t % P == 0 is undefined at P = 0: that period and P = 1 get lines of their own."""
    def line(**config):
        return [row for row in _report("owner", 2, **config).splitlines() if "MuonBP" in row]

    assert line() == ["  MuonBP: off"]
    assert line(muonbp_period=0, muonbp_block_lr_mult=0.5) == [
        "  MuonBP: period 0: never a full step, every step a block step (BlockMuon: each TP shard orthogonalized on "
        "its own, not Muon), lr x 0.5 (eta_block / eta_full)"]
    assert line(muonbp_period=1) == ["  MuonBP: period 1: every step a full step (exactly Muon)"]
    assert line(muonbp_period=5, muonbp_block_lr_mult=0.5) == [
        "  MuonBP: period 5 (a full step when t % P == 0), block-step lr x 0.5 (eta_block / eta_full)"]
    assert line(muonbp_period=4, muonbp_block_grid=(2, 4))[1] == (
        "  MuonBP block grid 2x4: a block step orthogonalizes each local matrix as 8 blocks (2 row bands x 4 column "
        "bands), each scaled by its own shape")


def test_an_imbalanced_owner_plan_says_what_auto_would_plan():
    """405B TP8 x PP16 x DP64 stage 0 under owner: max/mean 19.2; the report names auto and its
    figures (on the CPU's default constants here, cpu-gloo), and says nothing at PP1."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.core.models import LLAMA3
    from megatron_muon.megatron.report import _plan_lines
    from megatron_muon.optimizer import step_plans
    from megatron_muon.plan.stage_layouts import whole_layouts
    from megatron_muon.plan.stage_params import StageGrid, stage_params

    config = MuonConfig(tp_mode="owner")
    stage = whole_layouts(stage_params(LLAMA3["405B"], StageGrid(tp=8, pp=16)), 8)  # its first stage, whole
    deep = _plan_lines(step_plans(config, stage, 64, 8), config, "this stage")
    note = [line for line in deep if "NOTE" in line]
    assert len(note) == 1 and "--muon-tp-mode auto (on cpu-gloo's constants" in note[0]
    assert "plans this stage at max 41.23 TFLOP (max/mean 2.40)" in note[0], note[0]
    shallow = _plan_lines(step_plans(config, whole_layouts(stage_params(LLAMA3["8B"], StageGrid(tp=8)), 8), 8, 8),
                          config, "this stage")
    assert not [line for line in shallow if "NOTE" in line]


def test_each_class_states_its_ns_method_dtype_and_precision():
    """Issue 25, item 2: per matrix class the method that runs (gram only where the aspect takes it),
    the NS dtype and, in fp32, the matmul precision inside the call."""
    import torch

    from megatron_muon.core.matrix_layout import MatrixLayout
    from megatron_muon.core.newton_schulz import NSOptions
    from megatron_muon.megatron.report import _ns_text

    long, square = MatrixLayout("fc2", (64, 224), None, 1), MatrixLayout("proj", (64, 64), None, 1)
    gram32 = NSOptions(dtype=torch.float32, method="gram", fp32_precision="high")
    assert _ns_text(gram32, long) == "gram, float32 at high"
    assert _ns_text(gram32, square) == "standard, float32 at high"
    assert _ns_text(NSOptions(method="gram"), long) == "gram, bfloat16"
    fp16 = NSOptions(method="gram", gram_dtype=torch.float16)  # --muon-gram-fp16
    assert _ns_text(fp16, long) == "gram in float16, bfloat16" and _ns_text(fp16, square) == "standard, bfloat16"
    assert _ns_text(NSOptions(), long) == "standard, bfloat16"


def test_a_priced_buffer_prints_its_buckets_beside_megatron_cores():
    import torch
    from megatron.core.optimizer.param_layout import BufferKey

    from megatron_muon.core.models import LLAMA3
    from megatron_muon.megatron.report import CHOICE_MARK, layout_choice_lines
    from megatron_muon.plan.hardware import GPU_PROFILES
    from megatron_muon.plan.layout_choice import choose_layout, forward_flops, job_price
    from megatron_muon.plan.stage_layouts import BufferSettings, buffer_items, shard_divisor
    from megatron_muon.plan.stage_params import StageGrid, stage_params

    shape = LLAMA3["8B"]
    params = stage_params(shape, StageGrid(8, 8))
    price = job_price(shape, 8, 8, GPU_PROFILES["h100-sxm"])
    choice = choose_layout(buffer_items(params, 8, BufferSettings()),
                           [forward_flops(p.name, p.numel, len(p.shape), price) for p in params], 8, 40_000_000,
                           price, shard_divisor=shard_divisor(8))
    key = BufferKey(param_dtype=torch.bfloat16, grad_dtype=torch.float32, is_expert_parallel=False)
    chunk = SimpleNamespace(module=SimpleNamespace(**{CHOICE_MARK: {key: choice}}))
    (line,) = layout_choice_lines([chunk])
    assert line.startswith("  DDP buckets (bfloat16 params, float32 grads): row-aligned, 18 buckets: exposed DDP ")
    assert "(whole matrices: 4 buckets, " in line and "megatron-core's layout: 18 buckets, " in line
    assert line.endswith("h100-sxm, M 64")
    assert layout_choice_lines([SimpleNamespace(module=SimpleNamespace())]) == []  # no price: no line
