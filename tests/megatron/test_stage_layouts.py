"""The road from a model's shape to its layouts (``plan.stage_params`` → ``plan.stage_layouts``)
equals what megatron-core and our optimizer build, parameter by parameter (issue 42, item 2).

The real side is ``scripts/dry_run.py``'s ``build_rank``: megatron-core's ``GPTModel`` /
``HybridModel`` on the meta device under torch's fake process group, its DDP on the buffer layout
``--muon-dp-layout`` gives it (ours: ``megatron.layout``; megatron-core's own packing), and our
optimizer on it, whose catalogue (``describe_zero1``) and step plan are read back. It runs in one
child process (the fake group and Megatron's parallel state are process-wide), once per module.
Compared exactly, since both sides are integer arithmetic on the same sizes:

* every parameter's name, TP-local shape and ``(start, end, bucket)`` in the buffer, and the buckets;
* every Muon matrix's ``MatrixLayout`` (TP shard, split dim, fused rows, every DP rank's range), in
  the catalogue's order;
* the step plan built on the road's layouts with the optimizer's own settings: DP owners and
  every rank's NS FLOPs and bytes; and the cost model's NS max and Muon bytes, the plan's.

Layouts: TP 1 and 2, DP 2 and 4, PP 1, PP 3's first and middle stage, a hybrid model (Mamba,
attention and MLP layers) at PP 1 and PP 2's last stage; both buffer layouts; several DDP buckets
where the stage holds more than DDP's default bucket (40M elements). Mixture-of-experts GPTs, with
multi-latent attention and a shared expert after a dense first layer, or with grouped-query
attention: EP 2 and 4 with expert TP 1 and 2 (the experts' own DDP buffer over expert DP, compared
like the dense one, and the expert optimizer's catalogue and plan), and EP 1 with expert TP = TP
(megatron-core keeps the experts in the dense buffer). ``--muon-split-qkv-per-head`` on a dense and
an MoE GPT and on MLA's up-projections (every head its own matrix, whole on its TP rank).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os

import pytest
import torch.multiprocessing as mp

from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.models import MambaShape, MLAShape, ModelShape
from megatron_muon.plan.hardware import GPU_PROFILES
from megatron_muon.plan.layout_choice import job_price
from megatron_muon.plan.param_marks import RowSplits
from megatron_muon.plan.stage_layouts import BufferSettings, stage_layouts
from megatron_muon.plan.stage_params import StageGrid
from megatron_muon.plan.step_cost import optimizer_step_cost
from megatron_muon.plan.step_plan import build_step_plan

# 8 layers of about 15M elements at TP1 and a 33M-element embedding and output each: several
# buckets of DDP's default 40M at TP 1 and 2.
GPT = ModelShape("gpt-mid", 8, 1024, 8, 2, 128, 4096, 32000)
HYBRID = ModelShape("hybrid-mid", 10, 1024, 8, 2, 128, 4096, 32000, hybrid_pattern="M-M*-M-M*-", gated_mlp=False,
                    mamba=MambaShape(num_heads=32, head_dim=64, state_dim=64, num_groups=4))
# 4 layers, the first dense: MLA's five projections, a router, 4 experts and a shared expert
MOE_MLA = ModelShape("moe-mla", 4, 512, 8, 8, 64, 1024, 1000, num_experts=4, moe_topk=2, moe_ffn_hidden=256,
                     shared_expert_ffn=256, first_dense_layers=1,
                     mla=MLAShape(q_lora_rank=128, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                  v_head_dim=32))
MOE_GQA = ModelShape("moe-gqa", 4, 512, 8, 2, 64, 1024, 1000, num_experts=4, moe_topk=2, moe_ffn_hidden=512)
CASES = [  # (model, tp, pp, dp, stage, dp_layout, tp_mode[, ep, etp])
    *[(GPT, tp, pp, dp, stage, layout, "owner") for layout in ("balanced", "megatron")
      for tp, pp, dp, stage in ((1, 1, 4, 0), (2, 1, 2, 0), (2, 3, 2, 0), (2, 3, 2, 1))],
    *[(HYBRID, tp, pp, dp, stage, layout, "owner") for layout in ("balanced", "megatron")
      for tp, pp, dp, stage in ((2, 1, 2, 0), (2, 2, 2, 1))],
    (GPT, 2, 1, 4, 0, "balanced", "auto"),
    # --muon-dp-layout priced: the layout chosen on the dry run's price, whole or megatron-core's buckets cut at rows
    *[(GPT, tp, pp, dp, stage, "priced", "owner") for tp, pp, dp, stage in ((1, 1, 4, 0), (2, 3, 2, 0))],
    (HYBRID, 2, 1, 2, 0, "megatron", "auto"),
    (MOE_MLA, 2, 1, 2, 0, "balanced", "owner", 2, 1),
    (MOE_MLA, 2, 2, 2, 1, "megatron", "owner", 4, 1),
    (MOE_GQA, 2, 1, 4, 0, "priced", "auto", 2, 2),
    (MOE_GQA, 1, 1, 4, 0, "megatron", "owner", 1, None),
    # --muon-split-qkv-per-head: every head its own matrix, whole on its TP rank (per_rank)
    (GPT, 2, 1, 2, 0, "balanced", "owner", 1, None, True),
    (MOE_GQA, 2, 1, 2, 0, "priced", "auto", 2, 1, True),
    (MOE_MLA, 2, 1, 2, 0, "balanced", "owner", 2, 1, True),  # MLA's up-projections per head
]
PREFIX = "chunk0.module.module."  # the catalogue's names: chunk, DDP, Float16Module
BUCKET = 40_000_000  # the dry run's DDP bucket at DP <= 40: max(40M, 1M x DP)


def _unpack(case) -> tuple:
    """(model, tp, pp, dp, stage, dp_layout, tp_mode, ep, etp, per_head): EP 1, expert TP = TP and
    QKV per query group by default."""
    return (*case, 1, None, False)[:10] if len(case) == 7 else (*case, False)[:10]


def _ids(case) -> str:
    model, tp, pp, dp, stage, layout, mode, ep, etp, per_head = _unpack(case)
    experts = f"ep{ep}etp{etp or tp}" if model.num_experts else ""
    return f"{model.name}-tp{tp}pp{pp}dp{dp}{experts}s{stage}-{layout}-{mode}{'-per-head' if per_head else ''}"


def _read(buffer, names) -> dict:
    return dict(params=[(names[id(p)], tuple(p.shape), buffer.param_index_map[p]) for p in buffer.params],
                buckets=[(b.offset, b.offset + b.grad_data.numel()) for b in buffer.buckets])


def _plan(inner) -> dict:
    plan = inner.plan
    return dict(matrices=plan.matrices, settings=plan.settings, dp_owners=plan.dp_owners, ns_flops=plan.ns_flops,
                dp_bytes=plan.dp_bytes, tp_bytes=plan.tp_bytes)


def built(cases) -> list[dict]:
    """In a fresh process: each case's first rank of its stage as the dry run builds it, read back."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as the dry run: Megatron's CUDA-isms take the meta path
    import megatron.core.distributed as ddp_module
    import torch

    from megatron_muon.megatron.cpu_patches import apply_cpu_patches, view_device
    from scripts import dry_run

    apply_cpu_patches()
    wrapped = []

    class Recorded(ddp_module.DistributedDataParallel):  # build_rank imports the class when called
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            wrapped.append(self)

    ddp_module.DistributedDataParallel = Recorded
    out = []
    for case in cases:
        model, tp, pp, dp, stage, layout, mode, ep, etp, per_head = _unpack(case)
        wrapped.clear()
        with view_device(torch.device("meta")), contextlib.redirect_stdout(io.StringIO()):
            parts, slot = dry_run.build_rank(model, tp, pp, dp, stage * tp * dp, mode, layout, ep=ep, etp=etp,
                                             per_head=per_head)
            (chunk,) = wrapped
            (buffer,) = chunk.buffers
            names = {id(p): n.removeprefix("module.") for n, p in chunk.module.named_parameters()}
            got = dict(stage=slot["pp"], **_read(buffer, names), **_plan(parts[0]["inner"]), experts=None)
            if chunk.expert_parallel_buffers:
                (expert_buffer,) = chunk.expert_parallel_buffers
                (expert_part,) = parts[1:]
                got["experts"] = dict(**_read(expert_buffer, names), **_plan(expert_part["inner"]))
            out.append(got)
            dry_run.teardown()
    return out


@pytest.fixture(scope="module")
def real():
    """Every case built once, in one child forked from the test session's fork server."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
        results = pool.submit(built, CASES).result(timeout=900)
    return dict(zip(map(_ids, CASES), results))


def _price(model, tp, dp, mode):
    """the price the dry run's DDP chooses its balanced layout on (``dry_run.layout_price``: each
    candidate's step planned in the run's TP mode)"""
    return job_price(model, tp, dp, GPU_PROFILES["h100-sxm"], tp_mode=mode)


def _grid(case) -> StageGrid:
    model, tp, pp, dp, stage, _, _, ep, etp, _ = _unpack(case)
    return StageGrid(tp, dp, pp, stage, ep, etp)


def _splits(case) -> RowSplits:
    return RowSplits(qkv_per_head=_unpack(case)[9])


def _road(case):
    model, tp, pp, dp, stage, layout, mode, *_ = _unpack(case)
    settings = BufferSettings(layout, BUCKET, splits=_splits(case), price=_price(model, tp, dp, mode))
    return stage_layouts(model, _grid(case), settings)


def _pairs(real: dict, case):
    """(what megatron-core built, the road's, the grid it is planned on) per buffer: the dense one,
    then the experts' where megatron-core gave them one (the road must agree that it did)."""
    got, road = real[_ids(case)], _road(case)
    assert (got["experts"] is None) == (road.experts is None), "the experts' own buffer: megatron-core and the road"
    out = [(got, road, _grid(case))]
    if road.experts is not None:
        out.append((got["experts"], road.experts, _grid(case).expert_grid))
    return out


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_buffer_is_ddps(real, case):
    assert real[_ids(case)]["stage"] == case[4]
    for got, road, _ in _pairs(real, case):
        assert [(p.name, p.shape, r) for p, r in zip(road.params, road.buffer.ranges)] == got["params"]
        assert list(road.buffer.buckets) == got["buckets"]


def test_experts_have_their_own_buffer_where_megatron_gives_them_one(real):
    """EP > 1 or expert TP != TP: a second buffer over expert DP; EP 1 at expert TP = TP: none."""
    own = {_ids(case): real[_ids(case)]["experts"] is not None for case in CASES if case[0].num_experts}
    assert sorted(own.values()) == [False, True, True, True, True, True], own


def test_some_stages_hold_several_buckets(real):
    """The comparison covers bucket boundaries, not one bucket per stage only."""
    assert max(len(got["buckets"]) for got in real.values()) >= 3


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matrices_are_the_catalogues(real, case):
    for got, road, _ in _pairs(real, case):
        theirs = tuple(MatrixLayout(m.name.removeprefix(PREFIX), m.local_shape, m.partition_dim, m.tp_size, m.split,
                                    m.dp_ranges, m.per_rank, m.per_head) for m in got["matrices"])
        assert road.matrices == theirs


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_plan_and_cost_are_the_optimizers(real, case):
    """The plan of the road's layouts, with the optimizer's settings, is the optimizer's: the same
    owners and per-rank figures; the cost model (its own settings: h100-sxm, bf16 NS) prices that
    plan, so its NS max and Muon bytes are the optimizer's plan's."""
    model, tp, pp, dp, stage, layout, mode, ep, etp, _ = _unpack(case)
    for got, road, grid in _pairs(real, case):
        plan = build_step_plan(road.matrices, dp_size=grid.dp, tp_size=grid.tp, settings=got["settings"])
        assert (plan.dp_owners, plan.ns_flops, plan.dp_bytes, plan.tp_bytes) == (
            got["dp_owners"], got["ns_flops"], got["dp_bytes"], got["tp_bytes"])
    cost = optimizer_step_cost(model, optimizer="ours", tp=tp, dp=dp, pp=pp, hw=GPU_PROFILES["h100-sxm"], tp_mode=mode,
                               dp_layout=layout, bucket_numel=BUCKET, stage=stage,
                               layout_price=_price(model, tp, dp, mode), ep=ep, etp=etp, splits=_splits(case))
    figures = [(max(got["ns_flops"]), max(d + t for d, t in zip(got["dp_bytes"], got["tp_bytes"])))
               for got, _, _ in _pairs(real, case)]
    assert (cost.ns_flops_max, cost.bytes_sent_max) == figures[0]
    assert (cost.expert_ns_flops_max, cost.expert_bytes_sent_max) == (figures[1] if len(figures) > 1 else (0.0, 0.0))
