"""docs/fsdp.md's table of experts under Megatron-FSDP beside ZeRO-1 (issue 44, item 5) is the one
``scripts/bench/fsdp_moe_table`` prints from the recorded dry runs, to the letter."""

from __future__ import annotations

from pathlib import Path

from scripts.bench import fsdp_moe_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "fsdp.md"


def test_docs_quote_the_recorded_table():
    table = fsdp_moe_table.table()
    assert table.count("\n") == 9  # the header, its rule, and dense + experts for 2 models x 2 wrappers
    assert f"\n{table}\n" in DOC.read_text(), "docs/fsdp.md: run python -m scripts.bench.fsdp_moe_table"


def test_every_run_is_recorded_and_clean():
    for _, name in fsdp_moe_table.PAIRS:
        for suffix, fsdp in (("", None), ("_fsdp", "optim_grads_params")):
            run = fsdp_moe_table.json.loads(fsdp_moe_table.path_of(name + suffix).read_text())
            assert run["errors"] == [] and run["fsdp"] == fsdp and (run["tp"], run["ep"], run["dp"]) == (1, 8, 64)
            for res in run["ranks"].values():  # the expert optimizer, last in the chain, installs the weights
                expected = (False, True) if fsdp else (None, None)
                assert (res["installs_model_weights"], res["experts"]["installs_model_weights"]) == expected
