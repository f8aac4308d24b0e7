"""Pretrain a GPT with megatron-core 0.19.2's own training loop and megatron-muon's optimizer.

The equivalent of upstream Megatron-LM's ``pretrain_gpt.py`` for this plugin (written for
megatron-core 0.19.2, whose ``megatron.training`` it drives unchanged):

    parse_and_validate_args -> pretrain_cfg_container_from_args -> pretrain(...)
    (pretrain -> setup_model_and_optimizer -> train -> train_step / training_log / save_checkpoint)

* ``megatron_muon.megatron.hooks.install()`` runs before anything parses the command line, so
  ``--optimizer muon`` and every ``--muon-*`` flag are known to every Megatron parser;
* the model is a ``ModelConfig`` (``model_config_from_args``), as in upstream's entries:
  ``GPTModel``, or ``HybridModel`` with ``--hybrid-layer-pattern``; Megatron's builder picks the
  local layer spec with ``--transformer-impl local`` and Transformer Engine's with
  ``--transformer-impl transformer_engine``;
* data: megatron-core's ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``, from
  ``--data-path`` or ``--train-data-path/--valid-data-path`` (an indexed dataset prefix, e.g. the
  byte-level one read with ``--tokenizer-type NullTokenizer --vocab-size 257``), or
  ``MockGPTDataset`` with ``--mock-data``;
* without CUDA, ``megatron_muon.megatron.cpu_patches.apply_cpu_patches()`` retargets Megatron's
  hard-coded CUDA calls to the CPU; run with ``--distributed-backend gloo``.

CPU example (2 gloo ranks, TP=2; Megatron asks for CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1)::

    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 2 scripts/pretrain_gpt.py \
        --distributed-backend gloo --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --max-position-embeddings 64 \
        --micro-batch-size 2 --global-batch-size 4 --train-iters 20 \
        --lr 0.02 --min-lr 0.002 --lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 40 \
        --optimizer muon --muon-tp-mode owner --use-distributed-optimizer --muon-log-stats \
        --transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion \
        --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion \
        --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm \
        --position-embedding-type rope --normalization RMSNorm --swiglu \
        --untie-embeddings-and-output-weights --disable-bias-linear \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 257 \
        --log-interval 5 --eval-iters 0 --eval-interval 1000 \
        --save CKPT --save-interval 10 --ckpt-format torch_dist

Real data: replace ``--mock-data`` by ``--train-data-path PREFIX --valid-data-path PREFIX``
(indexed ``.bin``/``.idx`` prefixes; no ``--split`` with per-split paths) and set
``--eval-iters``. Resume: the same command with ``--load CKPT`` and a larger ``--train-iters``;
as ``--train-iters`` sets the scheduler's total steps, a longer run also needs
``--override-opt-param-scheduler`` (else Megatron refuses the checkpoint's scheduler state).
"""

from __future__ import annotations

import os
import sys
import time

_PROGRAM_START_TIME = time.time()

import warnings

if int(os.environ.get("RANK", 0)) != 0:  # one copy of the import-time warnings
    for _category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=_category)

from functools import partial

import torch

# Runnable as `torchrun scripts/pretrain_gpt.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_muon.megatron.hooks  # noqa: E402

# Before anything parses sys.argv (megatron.training parses it more than once).
megatron_muon.megatron.hooks.install()

if not torch.cuda.is_available():
    from megatron_muon.megatron.cpu_patches import apply_cpu_patches

    CPU_PATCHES = apply_cpu_patches()
else:
    CPU_PATCHES = []

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import (  # noqa: E402
    get_args,
    get_timers,
    pretrain,
    print_rank_0,
    set_startup_timestamps,
)
from megatron.training.argument_utils import (  # noqa: E402
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)


def _use_prebuilt_dataset_helpers() -> None:
    """``initialize_megatron`` -> ``_compile_dependencies`` runs ``make`` in
    megatron/core/datasets (``datasets.utils.compile_helpers``, looked up at call time). A
    megatron-core wheel ships no Makefile there but the built ``helpers_cpp`` extension: when
    that imports and there is nothing to make, the compile step is skipped (GPU or CPU alike)."""
    from megatron.core.datasets import utils as dataset_utils

    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # let Megatron report it
    dataset_utils.compile_helpers = lambda: None


_use_prebuilt_dataset_helpers()

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def model_config_from_args(args):
    """The model as Megatron's ``ModelConfig``, made as upstream's ``pretrain_gpt.py`` and
    ``pretrain_hybrid.py`` make it: ``gpt_config_from_args`` (``GPTModel``; its builder picks the
    local or Transformer Engine layer spec from ``--transformer-impl``, the MoE block spec with
    ``--num-experts``), or with ``--hybrid-layer-pattern`` ``hybrid.hybrid_model_config``
    (``HybridModel``). ``setup_model_and_optimizer`` builds it with the config's builder and wraps
    it in DDP through ``megatron.training.models.dist_utils``, where the hooks lay out the
    balanced buffers."""
    if args.hybrid_layer_pattern is not None:
        from megatron_muon.megatron.hybrid import hybrid_model_config

        return hybrid_model_config(args)
    return gpt_config_from_args(args)


def get_batch(data_iterator, vp_stage=None):
    """This micro-batch on this rank: TP rank 0 reads it, the others receive it (broadcast)."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return {key: None for key in BATCH_KEYS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: (batch[key].to(_device(), non_blocking=True) if batch.get(key) is not None else None)
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # With virtual stages (--num-virtual-stages-per-pipeline-rank) a rank holds several
        # chunks; only the first chunk of the first rank reads tokens, only the last chunk of
        # the last rank reads labels.
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
    )
    return {key: batch.get(key) for key in BATCH_KEYS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked token loss, the token count, and ``lm loss`` for the log (Megatron's
    ``train_step`` divides by the tokens summed over the data-parallel ranks)."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if args.check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject,
                                  message=f"found {what} in local forward loss calculation",
                                  tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model: GPTModel):
    """One micro-batch forward: the per-token losses and the loss function to reduce them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    # The chunk's virtual stage sits on the innermost module (DDP and Float16Module wrap it).
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """Only TP rank 0 of the stages that read data builds (and reads) the dataset."""
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset (``--data-path`` / ``--train-data-path`` ...) or MockGPTDataset (``--mock-data``)."""
    args = get_args()
    config = gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# The datasets are built on TP rank 0 only; the other ranks get their batches by broadcast.
train_valid_test_datasets_provider.is_distributed = True


def main() -> None:
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    if CPU_PATCHES:
        print_rank_0(f"> no CUDA: megatron_muon.megatron.cpu_patches applied {len(CPU_PATCHES)} patches")
    cfg = pretrain_cfg_container_from_args(args, model_config_from_args(args))
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    # Leave together: a rank that exits while a peer's gloo worker threads still run can abort
    # in the C++ runtime ("terminate called without an active exception", seen on a loaded CPU
    # host after training had finished), which fails the job although its work is done.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
