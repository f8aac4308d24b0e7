"""A pipeline stage's parameters as megatron-core 0.19.2 registers them, from a ``ModelShape``.

The planning tools (the cost model, the planner and deep-pipeline tables) describe a stage
without building it: ``stage_params`` lists, in ``named_parameters()`` order, every trainable
parameter one TP rank of the stage holds — its name, TP-local shape and the marks
(``param_marks.ParamMarks``) megatron-core and the catalogue's tags put on it — so that
``plan.stage_layouts`` lays them out in DDP's buffer exactly as the real model's are laid out.
``tests/megatron/test_stage_layouts.py`` checks it parameter by parameter against the models
``scripts/dry_run.py`` builds on the meta device.

Which model, which modules (what the dry run builds):

* a GPT: ``GPTModel`` with the local layer spec (RMSNorm, no biases, RoPE, untied output):
  ``embedding.word_embeddings.weight`` on the first stage; per layer ``input_layernorm``,
  ``self_attention.linear_proj``, ``self_attention.linear_qkv`` (megatron-core registers the
  projection first), ``pre_mlp_layernorm``, ``mlp.linear_fc1``, ``mlp.linear_fc2``; on the last
  stage ``decoder.final_layernorm`` and ``output_layer``;
* a GPT with multi-latent attention (``MLASelfAttention``, no q/kv layernorms: the dry run's
  local spec): ``linear_proj`` (RowParallel), then ``linear_q_down_proj``, ``linear_q_up_proj``,
  ``linear_kv_down_proj``, ``linear_kv_up_proj``, every one ColumnParallel (megatron-core 0.19.2
  marks the down-projections ``partition_dim`` 0 too, their TP-local rows ``lora / TP``; the
  up-projections take the whole lora rank, and carry the catalogue's ``mla_heads``: this TP
  rank's heads and one head's row blocks, what ``--muon-split-qkv-per-head`` splits them by);
* a GPT with a mixture of experts (``MoELayer`` with the local spec's ``SequentialMLP``, from
  layer ``first_dense_layers`` on): ``mlp.router`` (experts × hidden, every TP rank whole), per
  local expert ``mlp.experts.local_experts.{j}.linear_fc1`` (gate and up) and ``linear_fc2``,
  sharded over expert TP, then the shared expert's ``mlp.shared_experts.linear_fc1`` /
  ``linear_fc2`` (TP-sharded, a dense MLP). Expert weights are ``expert_parallel`` (megatron-core's
  ``allreduce = False``) where EP > 1 or expert TP differs from TP (its ``use_expert_pgs``; else
  they are dense params): DDP puts them in their own buffer over the expert-DP group; this EP rank
  holds experts ``[ep_rank · E / EP, (ep_rank + 1) · E / EP)``, named from 0;
* a hybrid model: ``HybridModel`` with the entry's local hybrid stack spec
  (``megatron.hybrid.local_hybrid_stack_spec``), per symbol of its pattern: a Mamba layer's
  mixer (``conv1d_weight``, ``conv1d_bias``, ``dt_bias``, ``A_log``, ``D`` — its own parameters
  first — then ``in_proj``, its gated ``norm``, ``out_proj``) and the layer's ``norm``; an
  attention layer's ``input_layernorm`` and projections; an MLP layer's ``pre_mlp_layernorm``,
  fc1 and fc2; the final norm is ``decoder.final_norm``.

Layer numbers in names are the stage's own (megatron-core numbers a stage's ``layers`` from 0).
The vocabulary is padded to a multiple of 128 × TP (``--make-vocab-size-divisible-by``). Layers
split over stages evenly, else as the dry run splits them (``core.models.staged_pattern``'s rule:
middle stages of ceil(layers / PP), the rest on the first and last).

Not described (``NotImplementedError``): MoE layers in a hybrid pattern (``E``), and MLA without a
query lora rank. Pure: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.models import ModelShape, staged_pattern
from .param_marks import ParamMarks
from .topology import Topology

__all__ = ["VOCAB_DIVISOR", "StageGrid", "StageParam", "group_topology", "model_numel", "stage_layer_counts",
           "stage_params"]

VOCAB_DIVISOR = 128
"""Megatron's default ``--make-vocab-size-divisible-by``: the vocabulary is padded to this × TP."""
MAMBA_CONV = 4
"""megatron-core's ``MambaMixer`` ``d_conv``: the depthwise filter's length."""


@dataclass(frozen=True)
class StageGrid:
    """Where a stage sits: the parallel sizes and its pipeline rank."""

    tp: int
    """tensor-parallel size."""
    dp: int = 1
    """data-parallel size (the distributed optimizer's shards)."""
    pp: int = 1
    """pipeline stages."""
    stage: int = 0
    """this stage's pipeline rank, in [0, pp)."""
    ep: int = 1
    """expert-parallel size (``--expert-model-parallel-size``)."""
    etp: int | None = None
    """expert tensor-parallel size (``--expert-tensor-parallel-size``); None: ``tp``, Megatron's default."""

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StageGrid: {name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.stage < self.pp:
            raise ValueError(f"StageGrid: stage must be in [0, {self.pp}) for pp {self.pp}, got {self.stage!r}")
        etp = self.expert_tp
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 or (self.tp * self.dp) % (self.ep * etp):
            raise ValueError(f"StageGrid: EP {self.ep} x expert TP {etp!r} must divide TP x DP = {self.tp * self.dp}")

    @property
    def expert_tp(self) -> int:
        """the expert tensor-parallel size (``etp``, else ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """the expert data-parallel size: a stage's TP × DP ranks over EP × expert TP (megatron-core's
        expert grid), the DP size of the experts' DDP buffer."""
        return self.tp * self.dp // (self.ep * self.expert_tp)

    @property
    def expert_grid(self) -> StageGrid:
        """The grid of the stage's expert-parallel buffer: expert TP × expert DP."""
        return StageGrid(self.expert_tp, self.expert_dp, self.pp, self.stage)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


@dataclass(frozen=True)
class StageParam:
    """One trainable parameter of a stage, on one TP rank."""

    name: str
    """its name in the model (``named_parameters()``), e.g. ``decoder.layers.0.mlp.linear_fc1.weight``."""
    shape: tuple[int, ...]
    """TP-local shape."""
    marks: ParamMarks = ParamMarks()
    """what megatron-core (and the catalogue's tags) mark on it."""
    expert_parallel: bool = False
    """an expert's weight (megatron-core's ``allreduce = False``): in DDP's expert-parallel buffer,
    over the expert-DP group, TP-cut over the expert TP group."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_muon(self) -> bool:
        """A hidden 2-D weight: Muon's (``megatron.catalogue.is_muon_matrix``'s rule); else AdamW."""
        return len(self.shape) == 2 and not self.marks.embedding_or_output


def stage_layer_counts(model: ModelShape, pp: int) -> list[int]:
    """Layers per pipeline stage (see the module docstring); raises ``ValueError`` when the layers
    cannot fill ``pp`` stages."""
    pattern = model.hybrid_pattern if model.hybrid_pattern is not None else "-" * model.num_layers
    return [len(segment) for segment in staged_pattern(pattern, pp).split("|")]


def stage_params(model: ModelShape, grid: StageGrid) -> tuple[StageParam, ...]:
    """The trainable parameters of stage ``grid.stage`` on one TP rank, in registration order."""
    if model.hybrid_pattern and "E" in model.hybrid_pattern:
        raise NotImplementedError(f"stage_params: {model.name}: MoE layers (E) in a hybrid pattern are not "
                                  "described; scripts/dry_run.py builds and measures them")
    if model.mla is not None and not model.mla.q_lora_rank:
        raise NotImplementedError(f"stage_params: {model.name}: MLA without a query lora rank is not described")
    if model.num_experts and model.num_experts % grid.ep:
        raise ValueError(f"stage_params: {model.name}: EP {grid.ep} must divide its {model.num_experts} experts")
    tp = grid.tp
    counts = stage_layer_counts(model, grid.pp)
    first_layer = sum(counts[:grid.stage])
    kinds = (model.hybrid_pattern or "G" * model.num_layers)[first_layer:first_layer + counts[grid.stage]]
    out: list[StageParam] = []
    vocab = -(-model.vocab // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp
    embedding_marks = ParamMarks(tensor_parallel=True, partition_dim=0, embedding_or_output=True)
    if grid.first:
        out.append(StageParam("embedding.word_embeddings.weight", (vocab // tp, model.hidden), embedding_marks))
    for i, kind in enumerate(kinds):
        prefix = f"decoder.layers.{i}."
        if kind == "G":
            mlp = (_moe(model, grid) if model.is_moe_layer(first_layer + i)
                   else [(*part, False) for part in _mlp(model, tp)])
            out += [StageParam(prefix + name, shape, marks) for name, shape, marks in _attention(model, tp)]
            out += [StageParam(prefix + name, shape, marks, expert) for name, shape, marks, expert in mlp]
            continue
        parts = _mamba(model, tp) if kind == "M" else _attention(model, tp) if kind == "*" else _mlp(model, tp)
        out += [StageParam(prefix + name, shape, marks) for name, shape, marks in parts]
    if grid.last:
        final = "decoder.final_norm.weight" if model.hybrid_pattern is not None else "decoder.final_layernorm.weight"
        out.append(StageParam(final, (model.hidden,)))
        out.append(StageParam("output_layer.weight", (vocab // tp, model.hidden), embedding_marks))
    return tuple(out)


def model_numel(model: ModelShape) -> int:
    """Every parameter of ``model`` (one TP rank of one stage holding all: what 6·params·tokens uses)."""
    return sum(p.numel for p in stage_params(model, StageGrid(tp=1)))


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"stage_params: {what} {n} does not split over TP {tp}")
    return n // tp


def _column(**marks) -> ParamMarks:
    """A ColumnParallel parameter's marks (TP cut its rows)."""
    return ParamMarks(tensor_parallel=True, partition_dim=0, **marks)


def _attention(model: ModelShape, tp: int) -> list[tuple[str, tuple[int, ...], ParamMarks]]:
    """Grouped-query attention: the input norm, the projection (RowParallel), the fused QKV
    (ColumnParallel, ``[q; k; v]`` per query group, as ``catalogue.tag_qkv`` marks it); MLA: the
    input norm, the projection and its four down / up projections (module docstring)."""
    if model.mla is not None:
        m, heads = model.mla, model.num_heads
        return [("input_layernorm.weight", (model.hidden,), ParamMarks()),
                ("self_attention.linear_proj.weight", (model.hidden, _split(heads * m.v_head_dim, tp, "MLA values")),
                 ParamMarks(tensor_parallel=True, partition_dim=1)),
                ("self_attention.linear_q_down_proj.weight", (_split(m.q_lora_rank, tp, "q lora rank"), model.hidden),
                 _column()),
                ("self_attention.linear_q_up_proj.weight",
                 (_split(heads * (m.qk_head_dim + m.qk_pos_emb_head_dim), tp, "MLA query rows"), m.q_lora_rank),
                 _column(mla_heads=(heads // tp, (m.qk_head_dim + m.qk_pos_emb_head_dim,)))),
                ("self_attention.linear_kv_down_proj.weight",
                 (_split(m.kv_lora_rank + m.qk_pos_emb_head_dim, tp, "kv lora rank + RoPE"), model.hidden), _column()),
                ("self_attention.linear_kv_up_proj.weight",
                 (_split(heads * (m.qk_head_dim + m.v_head_dim), tp, "MLA key/value rows"), m.kv_lora_rank),
                 _column(mla_heads=(heads // tp, (m.qk_head_dim, m.v_head_dim))))]
    q, k, v = model.qkv_sub_rows
    per_group = (model.num_heads // model.num_query_groups * model.head_dim, model.head_dim, model.head_dim)
    return [("input_layernorm.weight", (model.hidden,), ParamMarks()),
            ("self_attention.linear_proj.weight", (model.hidden, _split(q, tp, "attention channels")),
             ParamMarks(tensor_parallel=True, partition_dim=1)),
            ("self_attention.linear_qkv.weight", (_split(q + k + v, tp, "QKV rows"), model.hidden),
             # megatron-core's per-partition counts: one query group per rank below TP query groups
             _column(qkv_split=per_group, qkv_heads=(max(model.num_query_groups // tp, 1),
                                                     model.num_heads // model.num_query_groups, model.head_dim),
                     qkv_groups=model.num_query_groups))]


def _mlp(model: ModelShape, tp: int) -> list[tuple[str, tuple[int, ...], ParamMarks]]:
    """The pre-MLP norm, fc1 (``[gate; up]`` on every TP rank when gated: partition_stride 2), fc2."""
    ffn = _split(model.ffn_hidden, tp, "ffn hidden size")
    rows = 2 * ffn if model.gated_mlp else ffn
    return [("pre_mlp_layernorm.weight", (model.hidden,), ParamMarks()),
            ("mlp.linear_fc1.weight", (rows, model.hidden), _column(gated=model.gated_mlp)),
            ("mlp.linear_fc2.weight", (model.hidden, ffn), ParamMarks(tensor_parallel=True, partition_dim=1))]


def _moe(model: ModelShape, grid: StageGrid) -> list[tuple[str, tuple[int, ...], ParamMarks, bool]]:
    """An MoE layer's pre-MLP norm, router, this EP rank's experts (expert parallel, TP-cut over
    expert TP) and the shared expert (module docstring); each with whether it is an expert's."""
    etp, gated = grid.expert_tp, model.gated_mlp
    own_buffer = grid.ep > 1 or etp != grid.tp  # megatron-core's use_expert_pgs: else experts are dense params
    ffn = _split(model.moe_ffn_hidden, etp, "expert ffn hidden size")
    out = [("pre_mlp_layernorm.weight", (model.hidden,), ParamMarks(), False),
           ("mlp.router.weight", (model.num_experts, model.hidden), ParamMarks(), False)]
    for j in range(model.num_experts // grid.ep):
        expert = f"mlp.experts.local_experts.{j}."
        out += [(expert + "linear_fc1.weight", ((1 + gated) * ffn, model.hidden), _column(gated=gated), own_buffer),
                (expert + "linear_fc2.weight", (model.hidden, ffn), ParamMarks(tensor_parallel=True, partition_dim=1),
                 own_buffer)]
    if model.shared_expert_ffn:
        shared = _split(model.shared_expert_ffn, grid.tp, "shared expert ffn hidden size")
        out += [("mlp.shared_experts.linear_fc1.weight", ((1 + gated) * shared, model.hidden), _column(gated=gated),
                 False),
                ("mlp.shared_experts.linear_fc2.weight", (model.hidden, shared),
                 ParamMarks(tensor_parallel=True, partition_dim=1), False)]
    return out


def _mamba(model: ModelShape, tp: int) -> list[tuple[str, tuple[int, ...], ParamMarks]]:
    """megatron-core's ``MambaMixer`` (every role sharded over TP on its own) and the layer's norm."""
    m = model.mamba
    if m is None:
        raise ValueError(f"ModelShape {model.name}: hybrid_pattern has Mamba layers (M); expected mamba sizes")
    z, x, b, c, dt = (_split(n, tp, "Mamba in_proj rows") for n in m.in_proj_sub_rows)
    conv = x + b + c  # the depthwise filter runs over x, B and C
    heads = _split(m.num_heads, tp, "Mamba heads")
    return [("mixer.conv1d_weight", (conv, 1, MAMBA_CONV), _column(partition_sizes=(x, b, c))),
            ("mixer.conv1d_bias", (conv,), _column(partition_sizes=(x, b, c))),
            ("mixer.dt_bias", (heads,), _column()),
            ("mixer.A_log", (heads,), _column()),
            ("mixer.D", (heads,), _column()),
            ("mixer.in_proj.weight", (z + x + b + c + dt, model.hidden), _column(partition_sizes=(z, x, b, c, dt))),
            ("mixer.norm.weight", (z,), _column()),
            ("mixer.out_proj.weight", (model.hidden, z), ParamMarks(tensor_parallel=True, partition_dim=1)),
            ("norm.weight", (model.hidden,), ParamMarks())]


def group_topology(grid: StageGrid, *, experts: bool, ranks_per_node: int) -> Topology:
    """Where a stage's DP × TP positions of one optimizer live on Megatron's default rank order,
    the stage's first rank at 0: the dense optimizer's TP fastest, then DP
    (``Topology.contiguous``); the expert optimizer's (EP rank 0's) expert TP fastest, then EP,
    then expert DP (megatron-core's expert grid), so expert-DP peers stand EP × expert TP apart."""
    if not experts:
        return Topology.contiguous(grid.dp, grid.tp, ranks_per_node)
    etp, stride = grid.expert_tp, grid.ep * grid.expert_tp
    return Topology(tuple(d * stride + j for d in range(grid.expert_dp) for j in range(etp)), etp, ranks_per_node)
