"""A resume, or a migration from megatron-core's Muon, across the routing choices
(``--muon-mamba-in-proj``, ``--moe-router-skip-muon``), on ``Saved`` records built as
``saved_checkpoint.read_saved`` builds them.

A change that moves a Mamba in_proj or an MoE router between Muon and AdamW with the optimizer
state loaded is refused (``resume_config._routing_refusal``: a Muon matrix's state is momentum
under ``exp_avg`` and zeros under ``exp_avg_sq``); without the state it is reported, and split <->
whole (Muon both ways) is reported. The migration line (``reset_state.routing_differences``) names
each routing against megatron-core 0.19.2's and its main branch's. The real checkpoints and jobs of
the other resume checks are ``tests/e2e/test_resume_config.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_muon.megatron.reset_state import routing_differences, settings_differences
from megatron_muon.megatron.resume_config import _changes, _routing_refusal
from megatron_muon.megatron.saved_checkpoint import Saved

CKPT = Path("/ckpt/iter_0000003")
HYBRID = dict(hybrid_layer_pattern="M*-")
MOE = dict(num_experts=4)


def _saved(**saved_args) -> Saved:
    return Saved(CKPT, SimpleNamespace(**saved_args), {"distrib_optim_sharding_type": "fully_reshardable"})


def _run(**args) -> SimpleNamespace:
    return SimpleNamespace(**args)


@pytest.mark.parametrize("old, new", [("split", "adamw"), ("whole", "adamw"), ("adamw", "split")])
def test_in_proj_to_or_from_adamw_is_refused_with_the_state(old, new):
    line = _routing_refusal(_saved(muon_mamba_in_proj=old, **HYBRID), _run(muon_mamba_in_proj=new, **HYBRID))
    was, now = ("AdamW", "Muon") if old == "adamw" else ("Muon", "AdamW")
    assert line.startswith(f"--muon-mamba-in-proj {new}: {CKPT} was saved with --muon-mamba-in-proj {old}, so its "
                           f"Mamba in_proj state is {was}'s (")
    assert line.endswith(f"which {now} would read as its own; resume with --muon-mamba-in-proj {old}, or add "
                         "--muon-reset-optimizer-state to load the weights, iteration and LR schedule with fresh "
                         "optimizer state")
    assert "\n" not in line


def test_router_skip_change_is_refused_with_the_state():
    line = _routing_refusal(_saved(**MOE), _run(moe_router_skip_muon=True, **MOE))  # saved before the flag: Muon
    assert line == (f"--moe-router-skip-muon: {CKPT} was saved without --moe-router-skip-muon, so its MoE router "
                    "state is Muon's (Muon momentum under exp_avg, zeros under exp_avg_sq), which AdamW would read "
                    "as its own; resume without --moe-router-skip-muon, or add --muon-reset-optimizer-state to load "
                    "the weights, iteration and LR schedule with fresh optimizer state")
    line = _routing_refusal(_saved(moe_router_skip_muon=True, **MOE), _run(**MOE))
    assert line.startswith(f"--moe-router-skip-muon not given: {CKPT} was saved with --moe-router-skip-muon, so its "
                           "MoE router state is AdamW's (Adam's moments exp_avg and exp_avg_sq), which Muon would read")
    assert "; resume with --moe-router-skip-muon, or add --muon-reset-optimizer-state" in line


@pytest.mark.parametrize("saved, run", [
    (_saved(muon_mamba_in_proj="split", **HYBRID), _run(muon_mamba_in_proj="whole", **HYBRID)),  # Muon both ways
    (_saved(muon_split_mamba_in_proj=True, **HYBRID), _run(muon_mamba_in_proj="split", **HYBRID)),  # the old flag
    (_saved(muon_mamba_in_proj="split", **HYBRID),
     _run(muon_mamba_in_proj="adamw", muon_reset_optimizer_state=True, **HYBRID)),  # the state is not loaded
    (_saved(muon_mamba_in_proj="split", **HYBRID), _run(muon_mamba_in_proj="adamw", no_load_optim=True, **HYBRID)),
    (_saved(muon_mamba_in_proj="split"), _run(muon_mamba_in_proj="adamw")),  # no Mamba layer: nothing moves
    (_saved(), _run(moe_router_skip_muon=True)),  # no MoE layer: no router
    (_saved(moe_router_skip_muon=True, **MOE), _run(moe_router_skip_muon=True, **MOE)),
])
def test_allowed(saved, run):
    assert _routing_refusal(saved, run) is None


def _changed(saved: Saved, run: SimpleNamespace) -> list[str]:
    return [line for line in _changes(saved, run, None) if "in-proj" in line or "router" in line]


def test_the_report_lists_what_changed():
    assert _changed(_saved(muon_split_mamba_in_proj=True, **HYBRID), _run(muon_mamba_in_proj="whole", **HYBRID)) == [
        "--muon-mamba-in-proj split -> whole: Mamba in_proj on Muon either way, whole from the next step on"]
    assert _changed(_saved(muon_mamba_in_proj="split", **HYBRID),
                    _run(muon_mamba_in_proj="adamw", muon_reset_optimizer_state=True, **HYBRID)) == [
        "--muon-mamba-in-proj split -> adamw: Mamba in_proj on AdamW from the next step on, its optimizer state fresh"]
    assert _changed(_saved(**MOE), _run(moe_router_skip_muon=True, no_load_optim=True, **MOE)) == [
        "--moe-router-skip-muon off -> on: MoE router on AdamW from the next step on, its optimizer state fresh"]
    assert _changed(_saved(muon_mamba_in_proj="split", **HYBRID), _run(muon_mamba_in_proj=None, **HYBRID)) == []


@pytest.mark.parametrize("choice, line", [
    ("split", "Mamba in_proj split by role, z, x, B, C, dt orthogonalized apart (--muon-mamba-in-proj split; "
              "megatron-core 0.19.2: Muon whole, --muon-mamba-in-proj whole; upstream main: AdamW, "
              "--muon-mamba-in-proj adamw)"),
    ("whole", "Mamba in_proj: Muon whole, as megatron-core 0.19.2 (upstream main: AdamW, --muon-mamba-in-proj adamw)"),
    ("adamw", "Mamba in_proj: AdamW, as upstream main (megatron-core 0.19.2: Muon whole, --muon-mamba-in-proj whole)"),
])
def test_the_migration_line_names_the_in_proj_against_both_upstreams(choice, line):
    margs = _run(muon_mamba_in_proj=choice, **HYBRID)
    assert routing_differences(margs, _run()) == [line]
    assert line in settings_differences(margs, _run())


def test_the_migration_line_names_the_router_where_it_differs():
    assert routing_differences(_run(**MOE), _run()) == []  # Muon, as 0.19.2 and main's default
    assert routing_differences(_run(moe_router_skip_muon=True, **MOE), _run()) == [
        "MoE router: AdamW (--moe-router-skip-muon, as upstream main with it; megatron-core 0.19.2: Muon)"]
    assert routing_differences(_run(**MOE), _run(moe_router_skip_muon=True)) == [
        "MoE router: Muon, as megatron-core 0.19.2 (the checkpoint's run had --moe-router-skip-muon: AdamW)"]
    assert routing_differences(_run(moe_router_skip_muon=True), _run()) == []  # a dense model has no router
