"""A Mamba mixer's parameters in megatron-muon (issue 28), on megatron-core's real ``MambaMixer``.

The mixer is built inside a ``HybridModel`` of pattern ``M*-`` (Mamba, attention, MLP) with the
entry's local hybrid stack spec, at TP1 and at TP2. Megatron-core refuses to build the mixer
without mamba_ssm and allocates on ``torch.cuda.current_device()``;
``hybrid.mamba_mixer_without_kernels`` lets it build on CPU, for the construction only: the
mamba_ssm flag, the device, and the gated RMSNorm (mamba_ssm's ``RMSNormGated``: one ``weight``
of d_inner / TP entries, which is all the optimizer sees of it). Every parameter, its shape and
its TP attributes are megatron-core's own. No forward runs (the selective scan is a mamba_ssm
CUDA kernel): the step takes a seeded gradient.

Checked: the parameter names and shapes; the routing (``in_proj`` and ``out_proj`` to Muon, the
3-D ``conv1d_weight``, ``conv1d_bias``, ``A_log``, ``D``, ``dt_bias`` and the norms to AdamW);
``in_proj`` split by role from megatron-core's ``partition_sizes`` into z, x, B, C and dt, whose
global shapes are the same at TP1 and TP2 (each role is TP-sharded on its own, so role k's whole
matrix is the TP ranks' k-th blocks in rank order); the startup report's notes; QK-clip's
layers (the attention only, the mixer left alone); and one step of the real optimizer (owner
mode) at TP2 against single-process Muon on the whole roles.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from megatron_harness import HIDDEN, MAMBA, destroy_megatron
from training_harness import ATOL, LR, MUON, WD, Run, build, start

from megatron_muon.megatron.hybrid import mamba_mixer_without_kernels

D_INNER = 2 * HIDDEN
HEADS = D_INNER // MAMBA["mamba_head_dim"]
BC = MAMBA["mamba_num_groups"] * MAMBA["mamba_state_dim"]
ROLES = (D_INNER, D_INNER, BC, BC, HEADS)  # z, x, B, C, dt rows of the whole in_proj
PATTERN = "M*-"


def _grad(name: str, shape) -> torch.Tensor:
    """A seeded whole-matrix gradient (the logical [z; x; B; C; dt] for in_proj)."""
    import zlib

    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _role_shard(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's in_proj rows: its slice of each role, in role order (megatron-core's layout)."""
    return torch.cat([role.chunk(tp)[rank] for role in full.split(ROLES)])


def inspect(rank: int, world: int, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_muon.config import MuonConfig
    from megatron_muon.megatron.catalogue import is_muon_matrix, layout_of
    from megatron_muon.megatron.report import name_pattern, routing_note

    run = Run(tp=tp, hybrid=PATTERN, layers=len(PATTERN), dist_opt=False)
    start(run)
    with mamba_mixer_without_kernels(torch.device("cpu")):  # the CPU tests' device
        model, optimizer, scheduler = build(run)
    chunk = model[0].module
    out = dict(params={}, notes={})
    for name, p in chunk.named_parameters():
        out["params"][name] = dict(shape=tuple(p.shape), muon=is_muon_matrix(p),
                                   partition_dim=getattr(p, "partition_dim", None),
                                   partition_sizes=getattr(p, "partition_sizes", None))
        out["notes"][name_pattern(name)] = routing_note(name_pattern(name))
    in_proj = chunk.decoder.layers[0].mixer.in_proj.weight
    for choice in ("split", "whole"):
        lay = layout_of("in_proj", in_proj, tp, MuonConfig(mamba_in_proj=choice))
        out[f"layout_{choice}"] = (lay.partition_dim, lay.sub_global_shapes(), lay.full_shape)
    out_proj = chunk.decoder.layers[0].mixer.out_proj.weight
    out["out_proj_layout"] = (layout_of("out_proj", out_proj, tp, MuonConfig()).partition_dim,
                              layout_of("out_proj", out_proj, tp, MuonConfig()).full_shape)

    # QK-clip on this model: the clipper's attention layers (only layer 1's; the mixer has no core attention).
    from megatron_muon.megatron.qk_clip import build_qk_clip

    config = model[0].config
    config.qk_clip, config.qk_clip_threshold, config.qk_clip_alpha = True, 0.09, 0.5
    dense = optimizer.chained_optimizers[0]
    clipper = build_qk_clip(model, dense.matrix_of_param, ps.get_data_parallel_group(), 0)
    out["qk_clip_attentions"] = [a.name for a in clipper.attentions]
    out["qk_clip_weights"] = [w.name for a in clipper.attentions for w in a.weights]
    config.qk_clip = False

    # One step: every grad zero but in_proj's, which gets this rank's rows of one seeded whole gradient.
    tp_rank = ps.get_tensor_model_parallel_rank()
    whole = _grad("in_proj", (sum(ROLES), HIDDEN))
    initial = [torch.empty_like(in_proj) for _ in range(tp)]
    torch.distributed.all_gather(initial, in_proj.detach().clone(), group=ps.get_tensor_model_parallel_group())
    for p in model[0].parameters():
        p.main_grad.zero_()
    in_proj.main_grad.copy_(_role_shard(whole, tp_rank, tp))
    ok, *_ = optimizer.step()
    after = [torch.empty_like(in_proj) for _ in range(tp)]
    torch.distributed.all_gather(after, in_proj.detach().clone(), group=ps.get_tensor_model_parallel_group())
    out.update(ok=ok, whole_grad=whole, initial=initial, after=after)
    del model, optimizer, scheduler
    destroy_megatron()
    return out


def _whole(pieces: list[torch.Tensor], tp: int) -> torch.Tensor:
    """The logical [z; x; B; C; dt] from the TP ranks' in_proj rows."""
    local = [r // tp for r in ROLES]
    per_rank = [p.split(local) for p in pieces]
    return torch.cat([torch.cat([per_rank[r][k] for r in range(tp)]) for k in range(len(ROLES))])


@pytest.fixture(scope="module")
def inspected():
    return {tp: run_world(tp, inspect, tp)[0] for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_mixer_parameters_and_routing(inspected, tp):
    params = inspected[tp]["params"]
    mixer = {n.split("mixer.")[1]: v for n, v in params.items() if ".mixer." in n}
    want_shapes = {"in_proj.weight": (sum(ROLES) // tp, HIDDEN), "out_proj.weight": (HIDDEN, D_INNER // tp),
                   "conv1d_weight": ((D_INNER + 2 * BC) // tp, 1, 4), "conv1d_bias": ((D_INNER + 2 * BC) // tp,),
                   "dt_bias": (HEADS // tp,), "A_log": (HEADS // tp,), "D": (HEADS // tp,),
                   "norm.weight": (D_INNER // tp,)}
    assert {k: v["shape"] for k, v in mixer.items()} == want_shapes
    assert {k for k, v in mixer.items() if v["muon"]} == {"in_proj.weight", "out_proj.weight"}
    assert mixer["in_proj.weight"]["partition_sizes"] == [r // tp for r in ROLES]
    assert params["decoder.layers.0.norm.weight"]["muon"] is False  # the layer's pre-norm
    # the other layers route as in the GPT
    assert params["decoder.layers.1.self_attention.linear_qkv.weight"]["muon"]
    assert params["decoder.layers.2.mlp.linear_fc1.weight"]["muon"]


@pytest.mark.parametrize("tp", [1, 2])
def test_in_proj_splits_by_role_into_the_same_global_matrices(inspected, tp):
    pdim, subs, full = inspected[tp]["layout_split"]
    assert pdim == (0 if tp > 1 else None)
    assert subs == [(r, HIDDEN) for r in ROLES] and full == (sum(ROLES), HIDDEN)
    assert inspected[tp]["layout_whole"][1] == [(sum(ROLES), HIDDEN)]  # --muon-mamba-in-proj whole
    assert inspected[tp]["out_proj_layout"] == ((1 if tp > 1 else None), (HIDDEN, D_INNER))


@pytest.mark.parametrize("tp", [1, 2])
def test_qk_clip_takes_the_attention_layer_and_leaves_the_mixer(inspected, tp):
    assert inspected[tp]["qk_clip_attentions"] == ["chunk0.module.decoder.layers.1.self_attention"]
    assert inspected[tp]["qk_clip_weights"] == ["chunk0.module.decoder.layers.1.self_attention.linear_qkv.weight"]


def test_report_says_why(inspected):
    notes = inspected[2]["notes"]
    assert notes["decoder.layers.*.mixer.in_proj.weight"].startswith("Mamba in_proj: split by role, z, x, B, C, dt")
    for key in ("conv1d_weight", "A_log", "D", "dt_bias"):
        assert notes[f"decoder.layers.*.mixer.{key}"].endswith("AdamW"), key
    assert notes["decoder.layers.*.self_attention.linear_qkv.weight"] == ""


@pytest.mark.parametrize("tp", [1, 2])
def test_one_step_equals_single_process_muon_on_the_roles(inspected, tp):
    """The owner step on the real in_proj (TP2: each rank holds a slice of every role) equals
    ``megatron_muon.Muon`` on the whole [z; x; B; C; dt] split by role, on one process."""
    from megatron_muon import Muon
    from megatron_muon.core.matrix_layout import RowSplit

    got = inspected[tp]
    assert got["ok"]
    weight = torch.nn.Parameter(_whole(got["initial"], tp).clone())
    weight.grad = got["whole_grad"].clone()
    muon = Muon([dict(params=[weight], row_split=RowSplit(1, ROLES))], lr=LR, weight_decay=WD,
                momentum=MUON["momentum"], nesterov=MUON["nesterov"], ns_dtype=torch.float32,
                coefficients=MUON["coefficient_type"], scale_mode=MUON["scale_mode"],
                extra_scale_factor=MUON["extra_scale_factor"])
    muon.step()
    result = _whole(got["after"], tp)
    diff = (result - weight.detach()).abs().max().item()
    assert diff <= ATOL, f"TP{tp}: in_proj off by {diff:.2e}"
    # Orthogonalized whole, the update is another one: the role split is what the test sees.
    whole = torch.nn.Parameter(_whole(got["initial"], tp).clone())
    whole.grad = got["whole_grad"].clone()
    Muon([dict(params=[whole])], lr=LR, weight_decay=WD, momentum=MUON["momentum"], nesterov=MUON["nesterov"],
         ns_dtype=torch.float32, coefficients=MUON["coefficient_type"], scale_mode=MUON["scale_mode"],
         extra_scale_factor=MUON["extra_scale_factor"]).step()
    assert (result - whole.detach()).abs().max().item() > 100 * ATOL
