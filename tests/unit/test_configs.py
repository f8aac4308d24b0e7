"""The shipped YAML configs, the YAML → argv loader, and docs/flags.md.

Each ``configs/*.yaml`` goes through ``load_yaml_args`` and then Megatron's own ``parse_args``
(with ``hooks.install()``) and ``validate_args`` on this one CPU process. validate_args
never initializes torch.distributed; it only reads WORLD_SIZE / RANK, so WORLD_SIZE is set to
TP x PP x CP (data-parallel size 1) and the divisibility checks run for real. Two checks need
the machine a config is meant for, and are given its answers (see ``_as_on_a_gpu_node``).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.megatron.cli import muon_config_from_args
from megatron_muon.megatron.yaml_config import build_parser, load_yaml_args, main, read_yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXPECTED_CONFIGS = {"tiny-cpu", "gpt-125m-muon", "llama3-8b-tp8-owner", "llama3-8b-tp8-muonbp",
                    "llama3-70b-tp8-pp4-owner", "moe-tiny-cpu", "moonlight-16b-a3b-ep8", "tiny-cpu-fsdp",
                    "tiny-cpu-fsdp2", "hybrid-tiny-cpu", "tiny-cpu-per-head", "moe-tiny-cpu-fsdp",
                    "moe-tiny-cpu-fsdp2"}


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# --- the loader ------------------------------------------------------------------------------


def test_scalars_and_lists_map_one_to_one(tmp_path):
    path = _write(tmp_path, "num_layers: 2\nnum-attention-heads: 4\nlr: 3.0e-3\n"
                            "train_data_path: [a, b]\nvalid_data_path:\n  - c\nmuon_tp_mode: owner\n")
    assert load_yaml_args(path) == ["--num-layers", "2", "--num-attention-heads", "4", "--lr", "0.003",
                                    "--train-data-path", "a", "b", "--valid-data-path", "c",
                                    "--muon-tp-mode", "owner"]


@pytest.mark.parametrize("text,argv", [
    ("bf16: true", ["--bf16"]),                                  # store_true
    ("bf16: false", []),                                         # its default: left out
    ("muon_split_fc1: false", ["--muon-no-split-fc1"]),          # a dest: the flag that gives false
    ("muon_split_fc1: true", ["--muon-split-fc1"]),
    ("muon_split_qkv: false", ["--muon-no-split-qkv"]),          # dest of a store_false flag
    ("muon_split_qkv: true", []),
    ("muon_no_split_qkv: true", ["--muon-no-split-qkv"]),        # the flag itself: true = pass it
    ("muon_no_split_qkv: false", []),
    ("disable_bias_linear: true", ["--disable-bias-linear"]),
    ("add_bias_linear: false", ["--disable-bias-linear"]),
    ("gradient_accumulation_fusion: false", ["--no-gradient-accumulation-fusion"]),
    ("layernorm_epsilon: 1.0e-6", ["--norm-epsilon", "1e-06"]),  # a dest, not an option string
])
def test_bool_and_dest_handling(tmp_path, parser, text, argv):
    assert load_yaml_args(_write(tmp_path, text + "\n")) == argv
    if argv:
        parser.parse_args(argv)  # and the parser accepts what came out


def test_unknown_key_names_key_and_file(tmp_path):
    path = _write(tmp_path, "num_layers: 2\nnum_layerz: 3\n")
    with pytest.raises(ValueError, match="num_layerz") as info:
        load_yaml_args(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text,key", [
    ("num_layers: two", "num_layers"),          # int flag, a word
    ("num_layers: 2.5", "num_layers"),          # int flag, a float
    ("lr: fast", "lr"),                         # float flag
    ("num_layers: true", "num_layers"),         # a bool for a value flag
    ("swiglu: 1", "swiglu"),                    # a number for an on/off flag
    ("muon_tp_mode: exact", "muon_tp_mode"),    # outside the choices
    ("seq_length: [1, 2]", "seq_length"),       # a list for a one-value flag
    ("muon_nesterov: [true]", "muon_nesterov"),
    ("swiglu: false\nno_persist_layer_norm: 3", "no_persist_layer_norm"),
    ("tokenizer_model: null", "tokenizer_model"),  # null: leave the key out for the default
    ("lr: null", "lr"),                         # (Megatron has none for --lr: a traceback at the optimizer build)
    ("swiglu: null", "swiglu"),
])
def test_wrong_type_names_the_key(tmp_path, text, key):
    path = _write(tmp_path, text + "\n")
    with pytest.raises(ValueError, match=f"'{key}'") as info:
        load_yaml_args(path)
    assert str(path) in str(info.value)


def test_two_keys_for_one_setting_rejected(tmp_path):
    with pytest.raises(ValueError, match="muon_no_split_fc1"):
        load_yaml_args(_write(tmp_path, "muon_split_fc1: true\nmuon_no_split_fc1: true\n"))
    with pytest.raises(ValueError, match="appears twice"):
        load_yaml_args(_write(tmp_path, "lr: 1.0e-3\nlr: 2.0e-3\n"))


def test_config_must_be_a_mapping(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        load_yaml_args(_write(tmp_path, "- --num-layers\n- 2\n"))


def test_cli_prints_shell_quoted_args_then_extras(tmp_path, capsys):
    path = _write(tmp_path, "num_layers: 2\nsave: dir with space\n")
    assert main([str(path), "--lr", "1e-3"]) == 0
    assert capsys.readouterr().out == "--num-layers 2 --save 'dir with space' --lr 1e-3\n"
    assert main(["--lines", str(path), "--lr", "1e-3"]) == 0  # the format scripts/run.sh and slurm/ read
    assert capsys.readouterr().out == "--num-layers\n2\n--save\ndir with space\n--lr\n1e-3\n"


# --- errors: one line naming the file (and the line, where there is one) ------------------------

# Each bad file → the message after "PATH" (PyYAML's 0-based marks are printed 1-based).
BAD_FILES = [
    pytest.param(b"", ": empty config; expected a mapping of flag names to values", id="empty"),
    pytest.param(b"# only a comment\n\n", ": empty config; expected a mapping of flag names to values",
                 id="comments-only"),
    pytest.param(b"{}\n", ": empty config; expected a mapping of flag names to values", id="empty-mapping"),
    pytest.param(b"- --num-layers\n- 2\n", ": a config must be a mapping of flag names to values, got list",
                 id="a-list"),
    pytest.param(b"num_layers: 2\n  lr: 3.0e-3\n", ":2:5: mapping values are not allowed here", id="indent"),
    pytest.param(b"lr:\t3.0e-3\n", ":1:4: found character '\\t' that cannot start any token "
                 "(while scanning for the next token)", id="tab"),
    pytest.param(b"num_layers: 2\nlr: [1, 2\n", ":3:1: expected ',' or ']', but got '<stream end>' "
                 "(while parsing a flow sequence at line 2)", id="unclosed-list"),
    pytest.param(b"num_layers: 2\nlr\nsave: x\n", ":3:1: could not find expected ':' "
                 "(while scanning a simple key at line 2)", id="no-colon"),
    pytest.param(b"save: 'dir\n", ":2:1: found unexpected end of stream (while scanning a quoted scalar at line 1)",
                 id="unclosed-quote"),
    pytest.param(b"num_layers: 2\n- 3\n", ":2:1: expected <block end>, but found '-' "
                 "(while parsing a block mapping at line 1)", id="mapping-then-list"),
    pytest.param(b"--- {lr: 1}\n--- {lr: 2}\n", ":2:1: but found another document "
                 "(expected a single document in the stream at line 1)", id="two-documents"),
    pytest.param(b"lr: !!python/name:os.system\n", ":1:5: could not determine a constructor for the tag "
                 "'tag:yaml.org,2002:python/name:os.system'", id="unsafe-tag"),
    pytest.param(b"num_layers: 2\nlr: \x07\n", ":2:5: unacceptable character #x0007: special characters are not "
                 "allowed", id="control-character"),
    pytest.param(b"num_layers: 2\nsave: \xff\n", ":2: not UTF-8 text (byte 0xff: invalid start byte)",
                 id="not-utf8"),
    pytest.param(b"num_layers: 2\nsave: x\n\n# again\nnum_layers: 3\n",
                 ":5:1: key 'num_layers' appears twice (first at line 1)", id="repeated-key"),
    # Errors about a key's meaning (checked against the parser) name its line: SOURCE:LINE.
    pytest.param(b"num_layers: 2\n\n# typo below\nnum_layerz: 3\n",
                 ":4: unknown key 'num_layerz': no Megatron or megatron-muon flag --num-layerz "
                 "(nor an option whose dest is 'num_layerz')", id="unknown-key"),
    pytest.param(b"lr: 3.0e-3\nnum_layers: two\n", ":2: key 'num_layers' (--num-layers) expects an int, got 'two'",
                 id="wrong-type"),
    pytest.param(b"lr: 3.0e-3\nswiglu: 1\n", ":2: key 'swiglu' is an on/off flag; expected true or false, got 1",
                 id="not-a-bool"),
    pytest.param(b"lr: 3.0e-3\nlr_decay_style: fancy\n",  # Megatron's choices: pinned with megatron-core
                 ":2: key 'lr_decay_style' (--lr-decay-style) must be one of constant, linear, cosine, "
                 "inverse-square-root, WSD; got 'fancy'", id="not-a-choice"),
    pytest.param(b"muon_split_fc1: true\nlr: 3.0e-3\nmuon_no_split_fc1: true\n",
                 ":3: keys 'muon_split_fc1' and 'muon_no_split_fc1' both set 'muon_split_fc1'", id="same-setting"),
    pytest.param(b"lr: 3.0e-3\n1: 2\n", ":2: key 1 is not a flag name", id="number-key"),
]


@pytest.mark.parametrize("content,message", BAD_FILES)
def test_bad_config_is_one_line_naming_file_and_line(tmp_path, capsys, content, message):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_yaml_args(path)
    assert str(info.value) == f"{path}{message}"
    assert main(["--lines", str(path)]) == 2  # 2: a usage/config error, as argparse exits
    assert capsys.readouterr() == ("", f"error: {path}{message}\n")


def test_missing_or_unreadable_file_named(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main([str(missing)]) == 2
    assert capsys.readouterr() == ("", f"error: {missing}: no such config file\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr() == ("", f"error: {tmp_path}: is a directory; expected a YAML config file\n")


def test_cli_error_is_exactly_one_stderr_line_in_a_fresh_process(tmp_path):
    """In a fresh interpreter the parser's first import of megatron-core warns (Transformer Engine,
    Apex, CUDA) on stderr; the CLI holds that back, so the error is the only line."""
    path = _write(tmp_path, "lr: 3.0e-3\nnum_layers: two\n")
    done = subprocess.run([sys.executable, "-m", "megatron_muon.megatron.yaml_config", "--lines", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error: {path}:2: key 'num_layers' (--num-layers) expects an int, got 'two'\n"


# --- the shipped configs ---------------------------------------------------------------------


def test_the_configs_are_all_here():
    assert {p.stem for p in CONFIGS} == EXPECTED_CONFIGS


@pytest.fixture(scope="module")
def megatron():
    from megatron.training import arguments

    return arguments


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, demo_data) -> Path:
    """A job's working directory with the demo dataset at data/, as scripts/run.sh main builds it.

    tiny-cpu.yaml names data/train_text_document relative to where the job starts, and the
    validate_args hook checks that the files exist (data_check); a clean clone has no data/.
    """
    job = tmp_path_factory.mktemp("job")
    (job / "data").symlink_to(demo_data)
    return job


@pytest.fixture
def installed(megatron, monkeypatch, job_dir):
    from megatron.training import training

    monkeypatch.chdir(job_dir)

    from megatron_muon.megatron import hooks

    for module, name in [(megatron, "add_megatron_arguments"), (megatron, "validate_args"),
                         (training, "training_log"), (training, "get_megatron_optimizer")]:
        monkeypatch.setattr(module, name, getattr(module, name))
    hooks.install()
    return megatron


def _as_on_a_gpu_node(arguments, monkeypatch):
    """What validate_args reads from the machine, for the GPU node a TP>1 config is meant for.

    With TP (or CP) > 1, megatron-core 0.19.2's validate_args (1) queries the GPU's architecture,
    ``get_device_arch_version()`` = ``torch.cuda.get_device_properties('cuda:0').major``, which
    raises on a machine without a GPU, and (2) before Blackwell asserts
    CUDA_DEVICE_MAX_CONNECTIONS=1, which the launcher must export (configs/README.md). Here the
    first answers 9 (Hopper, the H100/H200 the Llama configs target) and the second is set, as
    the launch line sets it; with --moe-grouped-gemm it (3) asks the compute capability, answered
    (9, 0); every other check runs unchanged. For tiny-cpu (gloo, TP=2) the
    same architecture query happens in a real CPU run: the training entry has to answer it too.
    """
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # --moe-grouped-gemm asks the GPU's compute capability (>= 8 for the grouped GEMM kernels)
    monkeypatch.setattr(arguments.torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


def _parse_and_validate(arguments, monkeypatch, argv: list[str]):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    probe = arguments.parse_args()
    model_parallel = probe.tensor_model_parallel_size * probe.context_parallel_size
    # the fewest data-parallel replicas the layout allows: one, or as many as expert parallelism needs
    expert_parallel = probe.expert_model_parallel_size * (probe.expert_tensor_parallel_size or 1)
    world = math.lcm(model_parallel, expert_parallel) * probe.pipeline_model_parallel_size
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = arguments.parse_args()
    arguments.validate_args(args)
    return args


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_passes_megatrons_parse_and_validate(installed, monkeypatch, path):
    _as_on_a_gpu_node(installed, monkeypatch)
    data = read_yaml(path)
    if data.get("use_megatron_fsdp") or data.get("use_torch_fsdp2"):  # FSDPs refuse CUDA_DEVICE_MAX_CONNECTIONS=1
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(path))
    assert args.optimizer == "muon" and args.megatron_muon is True
    # every config keeps Megatron's distributed optimizer, but FSDP2, which forbids it
    assert args.use_distributed_optimizer != bool(data.get("use_torch_fsdp2"))
    assert not args.use_layer_wise_distributed_optimizer
    assert args.data_parallel_size == max(1, args.expert_model_parallel_size // args.tensor_model_parallel_size)
    assert args.global_batch_size % args.micro_batch_size == 0
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "lr",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "muon_tp_mode"):
        if key == "num_layers" and "hybrid_layer_pattern" in data:  # the pattern sets the layer count
            assert args.num_layers == len(data["hybrid_layer_pattern"]) and key not in data
            continue
        assert getattr(args, key) == data[key], key
    assert args.num_layers % args.pipeline_model_parallel_size == 0
    config = muon_config_from_args(args)
    assert config.tp_mode == "owner"
    assert config.log_stats == bool(data.get("muon_log_stats", False))


LLAMA3 = {  # Llama-3 shapes: layers, hidden, heads, KV groups, FFN
    "llama3-8b": (32, 4096, 32, 8, 14336),
    "llama3-70b": (80, 8192, 64, 8, 28672),
}


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem.startswith("llama3")],
                         ids=lambda p: p.stem)
def test_llama3_configs_have_llama3_shapes(installed, monkeypatch, path):
    _as_on_a_gpu_node(installed, monkeypatch)
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(path))
    shape = LLAMA3["-".join(path.stem.split("-")[:2])]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
            args.ffn_hidden_size) == shape
    assert args.group_query_attention and args.swiglu and args.untie_embeddings_and_output_weights
    assert (args.normalization, args.position_embedding_type, args.rotary_base) == ("RMSNorm", "rope", 500000)
    assert (args.seq_length, args.tensor_model_parallel_size, args.bf16) == (8192, 8, True)
    assert not args.add_bias_linear
    config = muon_config_from_args(args)
    assert (config.scale_mode, config.extra_scale_factor) == ("spectral", 0.2)
    assert config.muonbp_period == (5 if "muonbp" in path.stem else None)
    if "70b" in path.stem:
        assert args.pipeline_model_parallel_size == 4


def test_tiny_cpu_is_the_cpu_demo(installed, monkeypatch):
    _as_on_a_gpu_node(installed, monkeypatch)
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "tiny-cpu.yaml"))
    assert (args.tensor_model_parallel_size, args.distributed_backend, args.transformer_impl) == (2, "gloo", "local")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (2, 64, 4, 64)
    assert (args.micro_batch_size, args.global_batch_size, args.train_iters) == (2, 4, 200)
    assert not args.bf16 and not args.gradient_accumulation_fusion
    assert (args.tokenizer_type, args.vocab_size, args.ckpt_format) == ("NullTokenizer", 257, "torch_dist")
    assert args.train_data_path == ["data/train_text_document"]
    assert args.valid_data_path == ["data/valid_text_document"]
    assert (args.lr, args.lr_decay_style, args.log_interval, args.save_interval) == (3e-3, "cosine", 10, 100)
    assert args.lr_warmup_iters > 0


def test_moe_configs_are_what_they_say(installed, monkeypatch):
    """The CPU MoE demo (EP2 over its 2 ranks, QK-clip on GQA attention) and the cluster MoE
    config (Moonlight-16B-A3B's shapes at EP8, MLA, QK-clip off as Moonlight trained), through Megatron's
    parser."""
    _as_on_a_gpu_node(installed, monkeypatch)
    demo = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "moe-tiny-cpu.yaml"))
    assert (demo.num_experts, demo.moe_router_topk, demo.expert_model_parallel_size) == (4, 2, 2)
    assert (demo.tensor_model_parallel_size, demo.data_parallel_size, demo.distributed_backend) == (1, 2, "gloo")
    assert demo.qk_clip and demo.qk_clip_threshold == 1.0 and demo.transformer_impl == "local"
    assert demo.train_data_path == ["data/train_text_document"]
    big = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "moonlight-16b-a3b-ep8.yaml"))
    assert (big.num_layers, big.hidden_size, big.num_experts, big.moe_router_topk) == (27, 2048, 64, 6)
    assert (big.moe_ffn_hidden_size, big.moe_shared_expert_intermediate_size) == (1408, 2816)
    assert big.moe_layer_freq == [0] + [1] * 26
    assert big.multi_latent_attention and not big.qk_clip
    assert big.overlap_grad_reduce and big.overlap_param_gather


def test_hybrid_config_is_what_it_says(installed, monkeypatch):
    """The CPU HybridModel demo: attention, MLP, attention, MoE (the pattern sets 4 layers), EP2 over
    its 2 ranks, QK-clip on, through Megatron's parser."""
    _as_on_a_gpu_node(installed, monkeypatch)
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "hybrid-tiny-cpu.yaml"))
    assert args.hybrid_layer_pattern == "*-*E" and args.num_layers == 4
    assert (args.num_experts, args.expert_model_parallel_size, args.tensor_model_parallel_size) == (4, 2, 1)
    assert args.qk_clip and args.transformer_impl == "local" and args.save == "checkpoints/hybrid-tiny-cpu"


def test_fsdp_config_is_what_it_says(installed, monkeypatch):
    """The CPU Megatron-FSDP demo: TP1 (DP over both ranks), fully sharded, its own checkpoint
    format, bf16 (its save of a SwiGLU model needs the bf16 wrapper), no fused division (gloo)."""
    _as_on_a_gpu_node(installed, monkeypatch)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "tiny-cpu-fsdp.yaml"))
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    assert (args.tensor_model_parallel_size, args.ckpt_format, args.bf16) == (1, "fsdp_dtensor", True)
    assert not args.gradient_reduce_div_fusion and args.distributed_backend == "gloo"
    assert args.save == "checkpoints/tiny-cpu-fsdp" and args.load == args.save



def test_fsdp_moe_config_is_what_it_says(installed, monkeypatch):
    """The CPU MoE Megatron-FSDP demo: 4 experts at EP1 and TP1, so the dense DP group and the
    expert-DP group are both ranks (experts sharded over them); Megatron's validate_args accepts
    experts under Megatron-FSDP, and so do ours (docs/fsdp.md#experts-moe)."""
    _as_on_a_gpu_node(installed, monkeypatch)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "moe-tiny-cpu-fsdp.yaml"))
    assert args.use_megatron_fsdp and args.num_experts == 4 and args.expert_model_parallel_size == 1
    assert (args.tensor_model_parallel_size, args.ckpt_format, args.bf16) == (1, "fsdp_dtensor", True)
    assert args.save == "checkpoints/moe-tiny-cpu-fsdp" and args.load == args.save


def test_per_head_config_is_what_it_says(installed, monkeypatch):
    """The per-head demo: tiny-cpu.yaml with GQA (4 heads in 2 query groups, one group per TP rank at
    TP2, so every rank holds whole heads) and --muon-split-qkv-per-head, its own checkpoint directory."""
    _as_on_a_gpu_node(installed, monkeypatch)
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "tiny-cpu-per-head.yaml"))
    assert args.muon_split_qkv_per_head and args.muon_split_qkv
    assert (args.tensor_model_parallel_size, args.num_attention_heads, args.num_query_groups) == (2, 4, 2)
    assert args.group_query_attention and args.tensor_model_parallel_size <= args.num_query_groups
    assert args.save == "checkpoints/tiny-cpu-per-head" and args.load == args.save


def test_fsdp2_config_is_what_it_says(installed, monkeypatch):
    """The CPU torch FSDP2 demo: TP1 (DP over both ranks), Megatron's non-distributed optimizer
    (FSDP2 forbids the distributed one), bf16, and no checkpoints (tests/e2e/test_fsdp2_resume.py adds them)."""
    _as_on_a_gpu_node(installed, monkeypatch)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "tiny-cpu-fsdp2.yaml"))
    assert args.use_torch_fsdp2 and not args.use_distributed_optimizer and not args.use_megatron_fsdp
    assert (args.tensor_model_parallel_size, args.bf16, args.distributed_backend) == (1, True, "gloo")
    assert args.save is None and args.load is None


def test_fsdp2_moe_config_is_what_it_says(installed, monkeypatch):
    """The CPU torch FSDP2 MoE demo: EP2 over its 2 ranks, which megatron-core's validate_args refuses
    under FSDP2 and the validate_args hook lets through (Megatron sees EP1; the EP size is back after
    it, with what Megatron would have done with it: the expert-DP group among the high-priority
    stream groups of an FSDP run)."""
    _as_on_a_gpu_node(installed, monkeypatch)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse_and_validate(installed, monkeypatch, load_yaml_args(ROOT / "configs" / "moe-tiny-cpu-fsdp2.yaml"))
    assert args.use_torch_fsdp2 and not args.use_distributed_optimizer
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size) == (4, 2, 2)
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size, args.data_parallel_size) == (1, 1, 2)
    assert {"dp_cp", "ep_dp"} <= set(args.high_priority_stream_groups)


# --- docs/flags.md ---------------------------------------------------------------------------


def _gen_flags_doc():
    spec = importlib.util.spec_from_file_location("gen_flags_doc", ROOT / "scripts" / "gen_flags_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_doc_is_current(parser):
    gen = _gen_flags_doc()
    expected = gen.render(parser)
    assert expected == gen.render(parser), "render() is not deterministic"
    doc = ROOT / "docs" / "flags.md"
    assert doc.exists() and doc.read_text() == expected, (
        f"docs/flags.md is stale (the --muon-* argparse definitions changed); regenerate it with: "
        f"{gen.COMMAND}")


def test_flags_doc_lists_every_muon_flag(parser):
    text = (ROOT / "docs" / "flags.md").read_text()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--muon")}
    assert flags and all(f"`{flag}`" in text for flag in flags)
