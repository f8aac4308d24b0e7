"""The Python API's inputs: what a caller of the factory and of MuonWithAdamW gets for each.

``get_megatron_muon_optimizer`` without a ``MuonConfig`` reads Megatron's own ``OptimizerConfig``
``muon_*`` fields (and ``decoupled_weight_decay``); a given ``MuonConfig`` wins. Bad values fail at
construction in one line naming the argument (or the field's flag) and what was expected.
The numerics of these inputs are tested where the math lives: L2 weight decay, huge gradients
and empty matrices in test_optimizer.py / test_newton_schulz.py / test_tp_modes.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from bad_inputs_table import expected_line
from dist_harness import run_world
from megatron_harness import build_tiny_gpt, destroy_megatron, init_megatron

from megatron_muon.config import MuonConfig
from megatron_muon.core.newton_schulz import COEFFICIENT_SETS
from megatron_muon.optimizer import MuonWithAdamW

# ---- get_megatron_muon_optimizer -------------------------------------------------------------

# Every upstream muon_* field away from its default (and from MuonConfig's), so a field that is
# not carried over shows.
UPSTREAM_FIELDS = dict(muon_momentum=0.9, muon_nesterov=True, muon_split_qkv=False, muon_scale_mode="unit_rms_norm",
                       muon_fp32_matmul_prec="high", muon_coefficient_type="deepseekv4", muon_num_ns_steps=10,
                       muon_tp_mode="duplicated", muon_extra_scale_factor=0.2)
CARRIED = dict(momentum=0.9, nesterov=True, split_qkv=False, scale_mode="unit_rms_norm", fp32_matmul_prec="high",
               coefficient_type="deepseekv4", num_ns_steps=10, tp_mode="duplicated", extra_scale_factor=0.2)


def _config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**{**dict(optimizer="muon", lr=0.02, min_lr=0.02, weight_decay=0.1, clip_grad=0.0), **kw})


def _factory_worker(rank: int, world: int) -> dict:
    from megatron_muon.megatron.optimizer import get_megatron_muon_optimizer

    init_megatron(1, 1)
    model = build_tiny_gpt(1, 1)
    out = {}

    def inner(optimizer) -> MuonWithAdamW:
        return optimizer.chained_optimizers[0].optimizer

    def attempt(name, make):
        try:
            opt = inner(make())
            out[name] = dict(config=dataclasses.asdict(opt.config), decoupled=opt.decoupled_weight_decay)
        except ValueError as e:
            out[name] = str(e)

    attempt("defaults", lambda: get_megatron_muon_optimizer(_config(), model))
    attempt("upstream_fields", lambda: get_megatron_muon_optimizer(_config(**UPSTREAM_FIELDS), model))
    attempt("explicit_wins", lambda: get_megatron_muon_optimizer(
        _config(**UPSTREAM_FIELDS), model, MuonConfig(tp_mode="owner", coefficient_type="jordan")))
    attempt("l2", lambda: get_megatron_muon_optimizer(_config(decoupled_weight_decay=False), model))
    attempt("muon_config_dict", lambda: get_megatron_muon_optimizer(_config(), model, {"tp_mode": "owner"}))
    attempt("prec_low", lambda: get_megatron_muon_optimizer(_config(muon_fp32_matmul_prec="low"), model))
    attempt("lion", lambda: get_megatron_muon_optimizer(_config(muon_scalar_optimizer="lion"), model))
    attempt("bad_tp_mode", lambda: get_megatron_muon_optimizer(_config(muon_tp_mode="sharded"), model))
    attempt("custom_coefficients", lambda: get_megatron_muon_optimizer(_config(muon_coefficient_type="custom"),
                                                                       model))
    mla = build_tiny_gpt(1, 1, mla=dict(cache_mla_latents=True))  # inference-only latents: no kv up-projection
    mla[0].config.qk_clip = True
    attempt("qk_clip_mla_cache", lambda: get_megatron_muon_optimizer(_config(), mla))
    destroy_megatron()
    return out


@pytest.fixture(scope="module")
def factory():
    return run_world(1, _factory_worker)[0]


def test_without_muon_config_the_optimizer_config_fields_are_used(factory):
    got = factory["upstream_fields"]["config"]
    assert {k: got[k] for k in CARRIED} == CARRIED
    # Fields OptimizerConfig does not have take MuonConfig's defaults.
    defaults = dataclasses.asdict(MuonConfig())
    assert {k: v for k, v in got.items() if k not in CARRIED} == {k: v for k, v in defaults.items() if k not in CARRIED}
    # OptimizerConfig's own defaults are MuonConfig's, but its tp mode: upstream's blockwise is kept
    # (MuonConfig.tp_mode).
    assert factory["defaults"]["config"] == {**defaults, "tp_mode": "blockwise"}


def test_an_explicit_muon_config_wins_over_the_fields(factory):
    got = factory["explicit_wins"]["config"]
    assert got == dataclasses.asdict(MuonConfig(tp_mode="owner", coefficient_type="jordan"))


def test_decoupled_weight_decay_reaches_the_optimizer(factory):
    assert factory["defaults"]["decoupled"] is True
    assert factory["l2"]["decoupled"] is False


FACTORY_ERRORS = {
    "muon_config_dict": r"^get_megatron_muon_optimizer: muon_config: expected a MuonConfig or None, got dict$",
    "prec_low": r"^get_megatron_muon_optimizer: no muon_config given, so the OptimizerConfig muon_\* fields are "
                r"used: --muon-fp32-matmul-prec: 'low' is not supported",
    "lion": r"used: --muon-scalar-optimizer: .*AdamW only; expected adam, got 'lion'$",
    "bad_tp_mode": r"used: --muon-tp-mode: expected one of \(.*'owner'.*\), got 'sharded'$",
    "custom_coefficients": r"used: --muon-coefficient-type: expected one of \[.*'deepseekv4'.*\], got 'custom'$",
}


@pytest.mark.parametrize("name", sorted(FACTORY_ERRORS))
def test_factory_errors_are_one_line_naming_the_field(factory, name):
    assert isinstance(factory[name], str), f"{name}: no error"
    assert re.search(FACTORY_ERRORS[name], factory[name]), factory[name]
    assert "\n" not in factory[name]


# The Python API rows of docs/bad_inputs.md, each produced here and compared with the table's line.
API_ROWS = {
    "api-muon-config-type": lambda factory: factory["muon_config_dict"],
    "api-tp-mode": lambda factory: factory["bad_tp_mode"],
    "api-3d-muon": lambda _: _error(lambda: MuonWithAdamW([dict(params=[_param(2, 3, 4)], algorithm="muon")])),
    "api-algorithm": lambda _: _error(lambda: MuonWithAdamW([dict(params=[_param(4, 4)], algorithm="lion")])),
    "api-negative-lr": lambda _: _error(lambda: MuonWithAdamW([_param(4, 4)], lr=-1.0)),
    "api-qk-clip-mla-cache": lambda factory: factory["qk_clip_mla_cache"],
}


def _error(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


@pytest.mark.parametrize("row_id", sorted(API_ROWS))
def test_api_rows_of_the_bad_input_table(factory, row_id):
    line = API_ROWS[row_id](factory)
    assert expected_line(row_id).fullmatch(line), f"\n{line}"


# ---- MuonConfig: coefficient sets ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_every_coefficient_set_is_a_valid_coefficient_type(name):
    """One source of truth: MuonConfig accepts exactly newton_schulz's table (which holds every
    name emerging-optimizers knows, test_newton_schulz.test_every_emerging_set_is_ours)."""
    assert MuonConfig(coefficient_type=name).coefficient_type == name


# ---- MuonWithAdamW -------------------------------------------------------------------------------


def _param(*shape):
    return torch.nn.Parameter(torch.zeros(shape))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MuonWithAdamW([dict(params=[_param(4, 4), _param()], algorithm="muon")]),
         r"^MuonWithAdamW: param group 0 \(algorithm 'muon'\) parameter 1 has shape \(\); Muon takes 2-D "
         r"matrices \(or a flat range of one\) only \(give biases, norms and embeddings to an 'adamw' group\)$"),
        (lambda: MuonWithAdamW([dict(params=[_param(7)]), dict(params=[_param(2, 3, 4)], algorithm="muon")]),
         r"^MuonWithAdamW: param group 1 \(algorithm 'muon'\) parameter 0 has shape \(2, 3, 4\)"),
        (lambda: MuonWithAdamW([_param(4, 4)], lr=-1.0),
         r"^MuonWithAdamW: lr: expected a finite value >= 0, got -1.0$"),
        (lambda: MuonWithAdamW([_param(4, 4)], lr=float("nan")), r"^MuonWithAdamW: lr: .* got nan$"),
        (lambda: MuonWithAdamW([_param(4, 4)], weight_decay=-0.1),
         r"^MuonWithAdamW: weight_decay: expected a finite value >= 0, got -0.1$"),
        (lambda: MuonWithAdamW([_param(4, 4)], betas=(0.9, 1.0)),
         r"^MuonWithAdamW: betas: expected two values in \[0, 1\), got \(0.9, 1.0\)$"),
        (lambda: MuonWithAdamW([_param(4, 4)], eps=-1e-8), r"^MuonWithAdamW: eps: expected a finite value >= 0"),
        (lambda: MuonWithAdamW([_param(4, 4)], config={"tp_mode": "owner"}),
         r"^MuonWithAdamW: config: expected a MuonConfig or None, got dict$"),
        (lambda: MuonWithAdamW([_param(4, 4)], decoupled_weight_decay="no"),
         r"^MuonWithAdamW: decoupled_weight_decay: expected True or False, got 'no'$"),
    ],
    ids=["0d_in_muon", "3d_in_muon", "lr_negative", "lr_nan", "wd_negative", "beta_1", "eps_negative",
         "config_dict", "decoupled_str"],
)
def test_muon_with_adamw_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_empty_matrices_are_accepted_in_muon_groups():
    """A zero dim is a matrix with an empty update (test_optimizer.test_empty_matrices_are_a_no_op)."""
    MuonWithAdamW([dict(params=[_param(0, 5), _param(5, 0), _param(0, 0)], algorithm="muon")])
