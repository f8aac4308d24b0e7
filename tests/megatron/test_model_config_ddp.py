"""The balanced layout on both of Megatron's DDP paths: the ``ModelConfig`` builders and ``get_model``'s.

Upstream's ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` (and ours) hand ``pretrain`` a model
config; ``setup_model_and_optimizer`` then builds the model with its builder and wraps it in DDP
in ``megatron.training.models.dist_utils._ddp_wrap``, not in ``training.wrap_model_chunks_with_ddp``.
At TP1 x DP2, with the hooks installed and Megatron's args saying ``--optimizer muon``:

* ``--muon-dp-layout balanced``: the model the builder wraps in DDP carries ``layout.BALANCED_MARK``
  and every Muon matrix lies inside one DP rank's shard of its bucket; the same for the same model
  wrapped by ``training.wrap_model_chunks_with_ddp``, what ``get_model`` calls for an entry that
  passes a model provider (hook 5); with one bucket, and with the 4 buckets ``--overlap-grad-reduce``
  and a bucket size give a 9-layer model (the two paths forming the same buckets);
* ``--muon-dp-layout megatron``: the chunk is megatron-core's (no mark), and the same buffers laid
  out by megatron-core cut at least one matrix (so the first check can fail);
* the dispatcher's check refuses a chunk without the mark under ``balanced`` in the table's one line
  (``api-ddp-outside-hooks``), and accepts the builder's.
"""

from __future__ import annotations

import argparse

import pytest
import torch.nn.functional as F
from bad_inputs_table import expected_line
from dist_harness import run_world
from megatron_harness import destroy_megatron, init_megatron

# Three layers (an even count puts megatron-core's DP2 midpoint between two layers): its one
# bucket, halved over DP2, is cut inside layer 1's fc1 (checked in the megatron run below).
LAYERS, HIDDEN, FFN, HEADS, VOCAB, SEQ = 3, 64, 192, 4, 128, 16


def _matrices_cut(chunk) -> list[str]:
    """Names of the Muon matrices whose buffer range crosses a DP shard boundary of its bucket."""
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.catalogue import is_muon_matrix

    dp = ps.get_data_parallel_world_size()
    names = {p: n for n, p in chunk.module.named_parameters()}
    cut = []
    for buffer in chunk.buffers:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // dp
            if is_muon_matrix(param) and (start - bucket.offset) // shard != (end - 1 - bucket.offset) // shard:
                cut.append(names[param])
    return cut


def _builder_worker(rank: int, world: int, dp_layout: str, bucket_size: int | None, layers: int) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars, training
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_muon.megatron import hooks
    from megatron_muon.megatron.errors import UserInputError
    from megatron_muon.megatron.layout import BALANCED_MARK

    pg = init_megatron(1, 1)
    saved_args = global_vars._GLOBAL_ARGS
    modules = {module: __import__(module, fromlist=["_"]) for module, _ in hooks.HOOKED}
    saved = {(module, name): getattr(modules[module], name) for module, name in hooks.HOOKED}
    args = argparse.Namespace(megatron_muon=True, muon_dp_layout=dp_layout)
    try:
        hooks.install()
        global_vars._GLOBAL_ARGS = args
        config = TransformerConfig(
            num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
            gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
            use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False)
        model_config = GPTModelConfig(
            transformer=config, vocab_size=VOCAB, seq_length=SEQ, share_embeddings_and_output_weights=False,
            position_embedding_type="rope", transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"))
        # bucket_size: several buckets, as --overlap-grad-reduce gives them (DDP drops buckets without it)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=bucket_size is not None,
                                                   bucket_size=bucket_size)
        builder = GPTModelBuilder(model_config)
        chunks = builder.build_distributed_models(pg, ddp_config=ddp_config)
        # the model-provider path: get_model wraps its chunks with wrap_model_chunks_with_ddp (hook 5)
        provided = training.wrap_model_chunks_with_ddp([builder.build_model(pg)], config, ddp_config)
        out = dict(marked=[getattr(c.module, BALANCED_MARK, False) for c in chunks],  # fp32: DDP wraps the model
                   cut=[name for c in chunks for name in _matrices_cut(c)],
                   provider_marked=[getattr(c.module, BALANCED_MARK, False) for c in provided],
                   provider_cut=[name for c in provided for name in _matrices_cut(c)],
                   buckets=[len(b.buckets) for c in chunks for b in c.buffers],
                   provider_buckets=[len(b.buckets) for c in provided for b in c.buffers])
        try:
            hooks.check_balanced_layout_applied(
                argparse.Namespace(megatron_muon=True, muon_dp_layout="balanced"),
                argparse.Namespace(use_distributed_optimizer=True), chunks)
            out["check"] = None
        except UserInputError as e:
            out["check"] = str(e)
        return out
    finally:
        global_vars._GLOBAL_ARGS = saved_args
        for (module, name), value in saved.items():
            setattr(modules[module], name, value)
        destroy_megatron()


BUCKET, BUCKET_LAYERS = 40_000, 9
"""elements, and the layers that make several buckets of them: the balanced layout closes a bucket
at max(bucket size, BUCKET_SPAN (2) x DP x its largest matrix) = 98K elements here (fc1, 24.6K),
so the 9-layer model's 497K elements make 4 (3 layers would make one)."""


@pytest.fixture(scope="module")
def built() -> dict:
    return {(layout, bucket): run_world(2, _builder_worker, layout, bucket,
                                        LAYERS if bucket is None else BUCKET_LAYERS)
            for layout, bucket in (("balanced", None), ("balanced", BUCKET), ("megatron", None))}


@pytest.mark.parametrize("bucket", [None, BUCKET], ids=["one-bucket", "several-buckets"])
def test_builder_path_lays_out_balanced_buffers(built, bucket):
    for rank, out in enumerate(built[("balanced", bucket)]):
        assert out["marked"] == [True] and out["provider_marked"] == [True], (rank, out)
        assert out["cut"] == [] and out["provider_cut"] == [], (rank, out)
        assert out["check"] is None, out["check"]
        assert out["buckets"] == out["provider_buckets"] == ([1] if bucket is None else [4]), out


def test_megatron_layout_is_left_alone_and_the_check_refuses_it(built):
    for out in built[("megatron", None)]:
        assert out["marked"] == [False] and out["provider_marked"] == [False]
        assert out["cut"] and out["provider_cut"], "megatron-core's layout cut nothing: the balanced run proves nothing"
        assert expected_line("api-ddp-outside-hooks").fullmatch(out["check"]), out["check"]
