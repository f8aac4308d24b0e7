"""The CLI layer and the Megatron hooks, against megatron-core 0.19.2's real argparse.

``add_muon_args`` on Megatron's parser (``add_megatron_arguments``): owner accepted, upstream
choices kept, defaults and every flag translated by ``muon_config_from_args``; the plain-argparse
fallback defines the same flags as Megatron. ``hooks.install()``: Megatron's own
``parse_args`` / ``validate_args`` keep ``--use-distributed-optimizer`` for ``--optimizer muon``,
reject unsupported combinations naming the flag, and ``get_megatron_optimizer`` dispatches. The
same dispatch on a real one-rank GPT, with the config Megatron builds from the parsed args, is
``tests/megatron/test_cli_real_optimizer.py`` (a Megatron world).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import pytest

from megatron_muon.config import MuonConfig
from megatron_muon.megatron.cli import FIELD_OF_DEST, add_muon_args, flag_default, muon_config_from_args

# The smallest command line that passes validate_args on one CPU process.
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 --lr 1e-3").split()

# The CLI's documented defaults, which are MuonConfig's (test_parser_default_is_the_fields): upstream
# 0.19.2's flags (nesterov off), momentum 0.95, tp mode auto.
CLI_DEFAULTS = MuonConfig(
    momentum=0.95, nesterov=False, split_qkv=True, split_fc1=True, scale_mode="spectral",
    extra_scale_factor=1.0, fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5, ns_method="standard",
    tp_mode="auto", dp_mode="owner", owner_bucket_bytes=256 * 2**20,
)

# (flags, MuonConfig field, value): every field is reached by some flag.
FLAG_TO_FIELD = [
    ("--muon-momentum 0.8", "momentum", 0.8),
    ("--muon-nesterov", "nesterov", True),
    ("--muon-no-split-qkv", "split_qkv", False),
    ("--muon-split-qkv-per-head", "split_qkv_per_head", True),
    ("--muon-split-qkv-per-head --muon-no-split-qkv-per-head", "split_qkv_per_head", False),
    ("--muon-no-split-fc1", "split_fc1", False),
    ("--muon-no-split-fc1 --muon-split-fc1", "split_fc1", True),
    ("--muon-mamba-in-proj whole", "mamba_in_proj", "whole"),
    ("--muon-mamba-in-proj adamw", "mamba_in_proj", "adamw"),
    ("--muon-no-split-mamba-in-proj", "mamba_in_proj", "whole"),  # the flags before the choice, onto it
    ("--muon-no-split-mamba-in-proj --muon-split-mamba-in-proj", "mamba_in_proj", "split"),
    ("--muon-mamba-in-proj adamw --muon-no-split-mamba-in-proj", "mamba_in_proj", "whole"),  # the last one wins
    ("--moe-router-skip-muon", "router_skip_muon", True),
    ("--muon-scale-mode unit_rms_norm", "scale_mode", "unit_rms_norm"),
    ("--muon-scale-mode shape_scaling", "scale_mode", "shape_scaling"),
    ("--muon-extra-scale-factor 0.2", "extra_scale_factor", 0.2),
    ("--muon-fp32-matmul-prec high", "fp32_matmul_prec", "high"),
    ("--muon-fp32-matmul-prec highest", "fp32_matmul_prec", "highest"),
    ("--muon-coefficient-type polar_express", "coefficient_type", "polar_express"),
    ("--muon-num-ns-steps 7", "num_ns_steps", 7),
    ("--muon-ns-method gram", "ns_method", "gram"),
    ("--muon-ns-method gram --muon-gram-fp16", "gram_fp16", True),
    ("--muon-tp-mode owner", "tp_mode", "owner"),
    ("--muon-tp-mode duplicated", "tp_mode", "duplicated"),
    ("--muon-tp-mode auto", "tp_mode", "auto"),
    ("--muon-auto-hardware h100-sxm", "auto_hardware", "h100-sxm"),
    ("--muon-dp-mode redundant", "dp_mode", "redundant"),
    ("--muon-dp-layout megatron", "dp_layout", "megatron"),
    ("--muon-layout-alpha 0.75", "layout_alpha", 0.75),
    ("--muon-owner-bucket-size-mb 0.5", "owner_bucket_bytes", 2**19),
    ("--muonbp-period 0", "muonbp_period", 0),  # 0 (BlockMuon) is valid with any mode
    ("--muonbp-block-lr-mult 0.5", "muonbp_block_lr_mult", 0.5),
    ("--muonbp-block local", "muonbp_block", "local"),
    ("--muonbp-period 2 --muonbp-block-grid 2x4", "muonbp_block_grid", (2, 4)),
    ("--muon-log-stats", "log_stats", True),
]

# (flags, the flag the ValueError must name)
BAD_VALUES = [
    ("--muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec"),
    ("--muon-gram-fp16", "--muon-gram-fp16"),  # the standard method: it would be ignored
    ("--muon-split-qkv-per-head --muon-no-split-qkv", "--muon-split-qkv-per-head"),  # it refines the split
    ("--muon-ns-method gram --muon-gram-fp16 --muon-fp32-matmul-prec high", "--muon-gram-fp16"),
    ("--muon-scalar-optimizer lion", "--muon-scalar-optimizer"),
    ("--muon-coefficient-type nope", "--muon-coefficient-type"),
    ("--muon-num-ns-steps 0", "--muon-num-ns-steps"),
    ("--muon-momentum 1.0", "--muon-momentum"),
    ("--muon-owner-bucket-size-mb 0", "--muon-owner-bucket-size-mb"),
    ("--muon-layout-alpha 1.5", "--muon-layout-alpha"),
    ("--muon-layout-alpha nan", "--muon-layout-alpha"),
    ("--muon-extra-scale-factor nan", "--muon-extra-scale-factor"),
    ("--muon-extra-scale-factor 0", "--muon-extra-scale-factor"),
    ("--muon-extra-scale-factor -1", "--muon-extra-scale-factor"),
    ("--muon-momentum nan", "--muon-momentum"),
    ("--muonbp-period 5 --muon-tp-mode owner --muonbp-block-lr-mult inf", "--muonbp-block-lr-mult"),
    ("--muon-layout-alpha -0.1", "--muon-layout-alpha"),
    ("--muonbp-period -1 --muon-tp-mode owner", "--muonbp-period"),
    ("--muonbp-period 5 --muon-tp-mode blockwise", "--muon-tp-mode"),  # full steps need an exact mode
    ("--muonbp-period 5 --muon-tp-mode owner --muonbp-block-lr-mult 0", "--muonbp-block-lr-mult"),
    ("--muon-tp-mode auto --muon-auto-hardware tpu-v5", "--muon-auto-hardware"),
]


@pytest.fixture(scope="module")
def megatron():
    from megatron.training import arguments, training

    return arguments, training


@pytest.fixture(scope="module")
def parser(megatron):
    """Megatron's full parser (as ``parse_args`` builds it) plus ours."""
    arguments, _ = megatron
    return add_muon_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _parse(parser, flags: str = "") -> argparse.Namespace:
    return parser.parse_args(flags.split())


# --- add_muon_args on Megatron's parser --------------------------------------------------------


def test_owner_is_a_tp_mode(parser):
    assert _parse(parser, "--muon-tp-mode owner").muon_tp_mode == "owner"


@pytest.mark.parametrize("mode", ["blockwise", "duplicated", "distributed"])
def test_upstream_tp_modes_still_accepted(parser, mode):
    assert _parse(parser, f"--muon-tp-mode {mode}").muon_tp_mode == mode


def test_unknown_tp_mode_is_rejected_naming_the_flag(parser, capsys):
    with pytest.raises(SystemExit):
        _parse(parser, "--muon-tp-mode bogus")
    assert "--muon-tp-mode" in capsys.readouterr().err


def test_unknown_mamba_in_proj_is_rejected_naming_the_flag(parser, capsys):
    with pytest.raises(SystemExit):
        _parse(parser, "--muon-mamba-in-proj muon")
    err = capsys.readouterr().err
    assert "--muon-mamba-in-proj" in err and "'split', 'whole', 'adamw'" in err


@pytest.mark.parametrize("value", ["muon", None, True])
def test_a_bad_mamba_in_proj_off_the_command_line_names_the_flag(value):
    """An object with the attributes (an upstream config, a hand-built namespace) gets the one-line
    ``ValueError`` naming the flag, as the parser's choices would."""
    args = argparse.Namespace(muon_mamba_in_proj=value, moe_router_skip_muon=False)
    if value is None:  # not given: the default
        assert muon_config_from_args(args).mamba_in_proj == "split"
        return
    expected = r"^--muon-mamba-in-proj: expected one of \('split', 'whole', 'adamw'\)"
    with pytest.raises(ValueError, match=expected) as info:
        muon_config_from_args(args)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="^--moe-router-skip-muon: expected True or False, got 'yes'"):
        MuonConfig(router_skip_muon="yes")


def test_upstream_main_flag_is_not_defined_twice(megatron):
    """megatron-core's main branch defines --moe-router-skip-muon itself (PR #6504): a parser that
    has it keeps its own action, whose dest the translation reads all the same."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-router-skip-muon", action="store_true")
    own = parser._option_string_actions["--moe-router-skip-muon"]
    add_muon_args(parser)
    assert parser._option_string_actions["--moe-router-skip-muon"] is own
    assert muon_config_from_args(parser.parse_args(["--moe-router-skip-muon"])).router_skip_muon is True
    assert muon_config_from_args(parser.parse_args([])).router_skip_muon is False


def test_help_names_the_exact_modes_and_the_default(parser):
    help_text = parser._option_string_actions["--muon-tp-mode"].help
    assert "auto (megatron-muon; exact)" in help_text and "owner (megatron-muon; exact)" in help_text
    assert "Default: auto" in help_text and "BlockMuon, not Muon" in help_text
    assert any(g.title == "megatron-muon" for g in parser._action_groups)


def test_defaults_translate_to_the_documented_config(parser):
    assert muon_config_from_args(_parse(parser)) == CLI_DEFAULTS


@pytest.mark.parametrize("flags,field,value", FLAG_TO_FIELD, ids=[f[0] for f in FLAG_TO_FIELD])
def test_flag_maps_to_its_field(parser, flags, field, value):
    config = muon_config_from_args(_parse(parser, flags))
    assert getattr(config, field) == value
    others = {f: getattr(config, f) for f in MuonConfig.field_names() if f != field}
    needs = {"gram_fp16": {"ns_method": "gram"},  # flags valid only beside another
             "muonbp_block_grid": {"muonbp_period": 2}}.get(field, {})
    assert others == {f: needs.get(f, getattr(CLI_DEFAULTS, f)) for f in others}


def test_every_field_has_a_flag():
    assert {field for _, field, _ in FLAG_TO_FIELD} == set(MuonConfig.field_names())


# --- one default per knob: MuonConfig's -------------------------------------------------------

DEST_OF_FIELD = {field: dest for dest, field in FIELD_OF_DEST.items()}


def test_every_field_is_one_flags():
    assert len(DEST_OF_FIELD) == len(FIELD_OF_DEST)
    assert sorted(DEST_OF_FIELD) == sorted(MuonConfig.field_names())


@pytest.mark.parametrize("which", ["megatron", "plain"])
@pytest.mark.parametrize("field", MuonConfig.field_names())
def test_parser_default_is_the_fields(parser, which, field):
    """Each flag's default, on Megatron's parser and on plain argparse, and a flag missing from
    ``args`` altogether, translate to exactly ``MuonConfig()``'s value of its field: a default
    written in cli.py that differs from the field's fails here."""
    if which == "plain":
        parser = add_muon_args(argparse.ArgumentParser())
    dest, want = DEST_OF_FIELD[field], getattr(MuonConfig(), field)
    args = _parse(parser)
    assert getattr(args, dest) in (None, flag_default(dest)), dest  # None: "not given"
    for translated in (muon_config_from_args(args), muon_config_from_args(argparse.Namespace())):
        got = getattr(translated, field)
        assert (got, type(got)) == (want, type(want)), dest


def test_no_flag_given_is_muonconfigs_defaults(parser):
    for args in (_parse(parser), add_muon_args(argparse.ArgumentParser()).parse_args([]), argparse.Namespace()):
        assert muon_config_from_args(args) == MuonConfig() == CLI_DEFAULTS


def test_upstream_defaults_differ_where_the_docstrings_say(megatron):
    """Megatron's own parser (without add_muon_args) defaults --muon-momentum to 0.9 and
    --muon-tp-mode to blockwise, and its OptimizerConfig tp mode to blockwise: the defaults above
    are set by add_muon_args, not inherited."""
    from megatron.core.optimizer import OptimizerConfig

    arguments, _ = megatron
    upstream = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args([])
    assert (upstream.muon_momentum, upstream.muon_tp_mode) == (0.9, "blockwise")
    assert (MuonConfig().momentum, MuonConfig().tp_mode) == (0.95, "auto")
    assert (OptimizerConfig().muon_momentum, OptimizerConfig().muon_tp_mode) == (0.95, "blockwise")


def test_an_upstream_optimizer_config_keeps_its_own_values():
    """``get_megatron_muon_optimizer`` without a ``MuonConfig`` translates the ``OptimizerConfig``'s
    own ``muon_*`` values, its blockwise default included; the fields it lacks take MuonConfig's."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.megatron.optimizer import _muon_config

    assert _muon_config(OptimizerConfig(), None) == MuonConfig(tp_mode="blockwise")
    upstream = OptimizerConfig(muon_tp_mode="duplicated", muon_momentum=0.9, muon_num_ns_steps=7)
    assert _muon_config(upstream, None) == MuonConfig(tp_mode="duplicated", momentum=0.9, num_ns_steps=7)


@pytest.mark.parametrize("flags,flag", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_names_its_flag(parser, flags, flag):
    with pytest.raises(ValueError, match=flag):
        muon_config_from_args(_parse(parser, flags))


def test_plain_argparse_defines_the_upstream_flags_as_megatron_does(parser):
    plain = add_muon_args(argparse.ArgumentParser())
    muon = {a.dest: a for a in parser._actions if a.dest.startswith("muon_")}
    mine = {a.dest: a for a in plain._actions if a.dest.startswith("muon_")}
    assert mine.keys() == muon.keys()
    for dest, action in muon.items():
        assert (mine[dest].default, mine[dest].choices, mine[dest].type, mine[dest].nargs) == (
            action.default, action.choices, action.type, action.nargs), dest
    assert muon_config_from_args(plain.parse_args([])) == CLI_DEFAULTS
    assert muon_config_from_args(argparse.Namespace()) == CLI_DEFAULTS


def test_add_muon_args_is_idempotent(parser):
    assert add_muon_args(parser) is parser
    assert _parse(parser, "--muon-tp-mode owner").muon_tp_mode == "owner"


# --- hooks.install() with Megatron's parse_args / validate_args --------------------------


@pytest.fixture
def installed(megatron, monkeypatch):
    """install() for one test; monkeypatch puts Megatron's functions back afterwards."""
    from megatron_muon.megatron import hooks

    arguments, training = megatron
    for module_name, name in hooks.HOOKED:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    hooks.install()
    return arguments, training


def _parse_and_validate(arguments, monkeypatch, flags: str) -> argparse.Namespace:
    """What ``parse_and_validate_args`` does, minus global state (tokenizer, timers)."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags.split()])
    args = arguments.parse_args()
    arguments.validate_args(args)
    return args


def test_upstream_rewrites_muon_distributed_optimizer_to_layer_wise(megatron, monkeypatch):
    """Why the validate_args hook exists (megatron-core 0.19.2 without install())."""
    arguments, _ = megatron
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = _parse_and_validate(arguments, monkeypatch, "--optimizer muon --use-distributed-optimizer")
    assert (args.use_distributed_optimizer, args.use_layer_wise_distributed_optimizer) == (False, True)


def test_install_keeps_megatrons_distributed_optimizer_for_muon(installed, monkeypatch):
    arguments, _ = installed
    args = _parse_and_validate(arguments, monkeypatch,
                               "--optimizer muon --use-distributed-optimizer --muon-tp-mode owner")
    assert args.optimizer == "muon" and args.megatron_muon is True
    assert (args.use_distributed_optimizer, args.use_layer_wise_distributed_optimizer) == (True, False)
    assert muon_config_from_args(args).tp_mode == "owner"


def test_install_leaves_other_optimizers_alone(installed, monkeypatch):
    arguments, _ = installed
    args = _parse_and_validate(arguments, monkeypatch, "--optimizer adam --use-distributed-optimizer")
    assert (args.optimizer, args.megatron_muon, args.use_distributed_optimizer) == ("adam", False, True)


def test_every_megatron_parser_knows_our_flags_after_install(installed, monkeypatch):
    """inprocess_restart / ft_integration re-parse sys.argv with no extra_args_provider."""
    arguments, _ = installed
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, "--muon-tp-mode", "owner",
                                      "--muon-no-split-fc1", "--muon-dp-mode", "redundant"])
    args = arguments.parse_args(ignore_unknown_args=True)
    assert (args.muon_tp_mode, args.muon_split_fc1, args.muon_dp_mode) == ("owner", False, "redundant")


def test_install_is_idempotent(installed):
    from megatron_muon.megatron import hooks

    def hooked():
        return [getattr(sys.modules[module], name) for module, name in hooks.HOOKED]

    before = hooked()
    assert all(hasattr(f, "__megatron_muon_original__") for f in before)
    hooks.install()
    assert hooked() == before


REJECTED = [
    ("--optimizer muon --fp16", "--fp16"),
    # Megatron-FSDP runs with Muon (tests/megatron/test_megatron_fsdp.py); what it cannot run yet is refused
    ("--optimizer muon --use-megatron-fsdp --ckpt-format torch_dist", "--use-megatron-fsdp: --ckpt-format"),
    ("--optimizer muon --use-megatron-fsdp --ckpt-format fsdp_dtensor --distributed-backend gloo",
     "--use-megatron-fsdp with --distributed-backend gloo: add --no-gradient-reduce-div-fusion"),
    # torch FSDP2 trains with Muon (tests/megatron/test_torch_fsdp2.py) and resumes from torch_dist
    # (tests/megatron/test_fsdp2_checkpoint.py), experts at any EP and expert-TP size too
    # (tests/megatron/test_fsdp2_moe.py, test_fsdp2_expert_parallel.py); the legacy torch format is refused
    ("--optimizer muon --use-torch-fsdp2 --ckpt-format torch --save x", "--use-torch-fsdp2 with --ckpt-format torch"),
    ("--optimizer muon --ckpt-format torch_dcp", "--ckpt-format"),
    ("--optimizer muon --dump-param-to-param-group-map x.json", "--dump-param-to-param-group-map"),
    ("--optimizer muon --use-distributed-optimizer --muon-dp-mode redundant", "--muon-dp-mode"),
    ("--optimizer muon --muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec"),
    ("--optimizer muon --muon-scalar-optimizer lion", "--muon-scalar-optimizer"),
    ("--optimizer adaptive_muon --muon-tp-mode owner", "--muon-tp-mode"),
    ("--optimizer muon --muon-split-qkv-per-head --num-layers 1 --hybrid-layer-pattern -",
     "--muon-split-qkv-per-head: only"),
    ("--optimizer muon --muon-split-qkv-per-head --muon-no-split-qkv", "--muon-split-qkv-per-head: expected"),
]


@pytest.mark.parametrize("flags,flag", REJECTED, ids=[r[1] for r in REJECTED])
def test_unsupported_combination_rejected_naming_the_flag(installed, monkeypatch, flags, flag):
    arguments, _ = installed
    with pytest.raises(ValueError, match=f"^{flag}") as info:
        _parse_and_validate(arguments, monkeypatch, flags)
    assert "\n" not in str(info.value)


def test_per_head_is_accepted_with_multi_latent_attention(installed, monkeypatch):
    """MLA's up-projections are split per head (docs/per_head.md): the flag stands with MLA."""
    arguments, _ = installed
    args = _parse_and_validate(arguments, monkeypatch,
                               "--optimizer muon --muon-split-qkv-per-head --multi-latent-attention")
    assert muon_config_from_args(args).split_qkv_per_head


def test_fsdp2_with_experts_at_ep1_is_accepted(installed, monkeypatch):
    """Experts under torch FSDP2 at EP1, the expert-TP size at the TP size (docs/fsdp.md): exact, so
    neither our checks nor Megatron's validate_args stop them."""
    arguments, _ = installed
    args = _parse_and_validate(arguments, monkeypatch, "--optimizer muon --use-torch-fsdp2 --num-experts 4 "
                               "--no-gradient-accumulation-fusion --untie-embeddings-and-output-weights")
    assert args.use_torch_fsdp2 and args.num_experts == 4 and args.expert_model_parallel_size == 1


def test_dispatcher(megatron, monkeypatch):
    """muon + plugin active → get_megatron_muon_optimizer(muon_config_from_args(args)); else the original."""
    from types import SimpleNamespace

    from megatron.training import global_vars

    from megatron_muon.megatron import hooks
    from megatron_muon.megatron import optimizer as megatron_optimizer

    arguments, training = megatron
    calls = []
    monkeypatch.setattr(arguments, "add_megatron_arguments", arguments.add_megatron_arguments)
    monkeypatch.setattr(arguments, "validate_args", arguments.validate_args)
    monkeypatch.setattr(training, "get_megatron_optimizer", lambda *a, **k: calls.append(("upstream", a, k)))
    monkeypatch.setattr(megatron_optimizer, "get_megatron_muon_optimizer",
                        lambda *a, **k: calls.append(("muon", a, k)))
    hooks.install()
    model, overrides = object(), {"o": 1}

    def call(optimizer: str, **args):
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(**args))
        calls.clear()
        training.get_megatron_optimizer(SimpleNamespace(optimizer=optimizer), [model], config_overrides=overrides,
                                        use_gloo_process_groups=False, dump_param_to_param_group_map=None)
        return calls[0]

    kind, a, k = call("muon", megatron_muon=True, muon_tp_mode="owner")
    assert kind == "muon" and a[1] == [model] and a[2] == MuonConfig(**{**vars(CLI_DEFAULTS), "tp_mode": "owner"})
    assert k == dict(config_overrides=overrides, pg_collection=None, use_gloo_process_groups=False)
    assert call("adam", megatron_muon=False)[0] == "upstream"
    assert call("muon", megatron_muon=False)[0] == "upstream"  # --optimizer dist_muon: upstream's
    with pytest.raises(RuntimeError, match="install"):
        call("muon")  # validate_args hook never ran


def test_messages_quote_the_value_the_user_gave(parser):
    """The rejected value is the one on the command line: MiB for the bucket size, and the TP
    mode (not the period) when MuonBP's full steps would be blockwise."""
    with pytest.raises(ValueError, match=r"--muon-owner-bucket-size-mb: expected a positive size in MiB, got -5$"):
        muon_config_from_args(_parse(parser, "--muon-owner-bucket-size-mb -5"))
    blockwise = r"^--muon-tp-mode: expected an exact mode .* --muonbp-period 5, got 'blockwise'$"
    with pytest.raises(ValueError, match=blockwise):
        muon_config_from_args(_parse(parser, "--muonbp-period 5 --muon-tp-mode blockwise"))
