"""The package's layers, enforced: import-linter's contracts and ruff, run as tests.

The contracts live in pyproject.toml ([tool.importlinter]): ``core`` imports nothing of ours above
it, ``plan`` only ``core``, ``parallel`` only those two, then ``config``, ``optimizer`` and the
Megatron adapter; the adapter's own modules are ordered too; and nothing outside
``megatron_muon.megatron`` imports Megatron. Each contract is also shown to fail on a copy of the
package with one planted import, so a misconfigured contract cannot pass silently. Beyond the
contracts: the graph of every import (those inside functions included) has no cycle, and the
planning layer never imports ``torch.distributed``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _lint_imports(root: Path, *, pythonpath: Path) -> subprocess.CompletedProcess:
    # The package is installed editable; PYTHONPATH's copy is found first (path finders run before
    # the editable finder), so a planted copy is what gets analysed.
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([str(BIN / "lint-imports"), "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    proc = _lint_imports(REPO, pythonpath=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


LAYERS = "megatron adapter > optimizer > config > parallel > plan > core"
ADAPTER = "the adapter's own modules: entry points > factory > report > catalogue > \nbackends > flags > errors"


@pytest.mark.parametrize("module, planted, contract", [
    ("core/shapes.py", "from ..parallel import comm", LAYERS),
    ("plan/owners.py", "from .. import config", LAYERS),
    ("plan/step_plan.py", "from ..parallel import comm", LAYERS),
    ("config.py", "from .megatron import hooks", LAYERS),
    ("parallel/comm.py", "import megatron.core", "only megatron_muon.megatron imports Megatron"),
    ("megatron/catalogue.py", "from . import report", ADAPTER),
    ("megatron/report.py", "from . import optimizer", ADAPTER),
])
def test_a_planted_import_breaks_its_contract(tmp_path, module, planted, contract):
    shutil.copytree(REPO / "megatron_muon", tmp_path / "megatron_muon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "megatron_muon" / module
    target.write_text(target.read_text() + f"\n{planted}  # planted by test_layers\n")
    proc = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert f"{contract} BROKEN" in proc.stdout, proc.stdout[-4000:]


_FIND_CYCLE = """
import grimp
graph = grimp.build_graph("megatron_muon", cache_dir=None)
ours = sorted(m for m in graph.modules if m.startswith("megatron_muon"))
edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i.startswith("megatron_muon"))
         for m in ours}
state = {}
def visit(m, path):
    state[m] = 1
    for n in edges[m]:
        if state.get(n) == 1:
            raise SystemExit("import cycle: " + " -> ".join(path[path.index(n):] + [m, n] if n in path else [m, n]))
        if n not in state:
            visit(n, path + [m])
    state[m] = 2
for m in ours:
    if m not in state:
        visit(m, [])
print("hooks imports the factory:", "megatron_muon.megatron.optimizer" in edges["megatron_muon.megatron.hooks"])
"""


def _find_cycle(pythonpath: Path) -> subprocess.CompletedProcess:
    """grimp's graph of every import statement of the package at ``pythonpath`` (at module level
    or inside a function), searched depth-first for a cycle."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, "-c", _FIND_CYCLE], cwd=pythonpath, env=env, capture_output=True,
                          text=True, timeout=300)


def test_no_import_cycle_counting_imports_inside_functions():
    """A cycle dodged by a function-level import is still a cycle. The graph really holds
    function-level imports: ``hooks`` imports the factory inside a function."""
    proc = _find_cycle(REPO)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert "hooks imports the factory: True" in proc.stdout


def test_a_planted_function_level_import_makes_a_cycle(tmp_path):
    shutil.copytree(REPO / "megatron_muon", tmp_path / "megatron_muon", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "megatron_muon" / "megatron" / "errors.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from . import hooks  # planted by test_layers\n")
    proc = _find_cycle(tmp_path)
    assert proc.returncode != 0 and "import cycle:" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_planning_layer_never_imports_torch_distributed():
    """``plan/`` decides for every rank on one process: no process group, no collective."""
    import ast

    for path in sorted((REPO / "megatron_muon" / "plan").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad = [n for n in names if n == "torch.distributed" or n.startswith("torch.distributed.")]
            assert not bad, f"{path.name}:{node.lineno} imports {bad[0]}"


def test_the_step_entry_is_narrow_and_outsiders_read_no_private_optimizer_state():
    """``orthogonalize_updates`` takes the pieces, the plan, the groups and the apply callback
    (at most 6 parameters); and nothing outside the package (scripts/, tests/) reads a private
    attribute of ``MuonWithAdamW``: the report and the dry run read ``optimizer.plans``."""
    import inspect
    import re

    import torch

    from megatron_muon.optimizer import MuonWithAdamW
    from megatron_muon.parallel.orthogonalize import orthogonalize_updates

    assert len(inspect.signature(orthogonalize_updates).parameters) <= 6
    opt = MuonWithAdamW([dict(params=[torch.nn.Parameter(torch.zeros(4, 4))], algorithm="muon")])
    opt.plans  # noqa: B018  (every lazily made private attribute exists now)
    private = sorted(n for n in vars(opt) if n.startswith("_") and not n.startswith("__")
                     and n not in vars(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})))
    assert "_plans" in private and "_catalogue" in private, private
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, private)) + r")\b")
    for path in sorted([*(REPO / "scripts").rglob("*.py"), *(REPO / "tests").rglob("*.py")]):
        if path.resolve() == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            hit = pattern.search(line)
            assert not hit, f"{path.relative_to(REPO)}:{number} reads MuonWithAdamW's private {hit.group(1)}"


def test_the_top_level_imports_no_megatron():
    """``import megatron_muon`` (and its CLI flags) must work where megatron-core is not imported."""
    code = ("import sys, megatron_muon, megatron_muon.megatron; "
            "megatron_muon.add_muon_args; "
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_public_surface():
    import megatron_muon
    import megatron_muon.megatron as adapter

    assert set(megatron_muon.__all__) == {
        "Muon", "MuonConfig", "MuonWithAdamW", "orthogonalize_sharded", "newton_schulz", "ns_flops",
        "comm_stats", "plan_owners", "add_muon_args", "muon_config_from_args",
    }
    for internal in ("Piece", "OwnedMatrix", "OwnerExchange", "rank_loads"):
        assert not hasattr(megatron_muon, internal), internal
    assert set(adapter.__all__) == {"get_megatron_muon_optimizer", "MuonDistributedOptimizer", "install"}
    assert callable(adapter.get_megatron_muon_optimizer) and callable(adapter.install)


def test_ruff_passes():
    proc = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_every_test_module_has_its_own_name():
    """The tiers are folders without ``__init__.py``, so pytest imports each test module by its
    file name: two tiers' modules of one name stop the whole collection ("import file mismatch")."""
    names: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {n: paths for n, paths in names.items() if len(paths) > 1}
