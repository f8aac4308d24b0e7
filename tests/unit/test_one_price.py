"""One price, one road, checked on the source (issue 42): the modes' costs are written once.

A TP mode's name as a string in ``megatron_muon/plan/`` marks code that decides or prices by
mode; only the step plan (which decides) and the pricing module (which prices) may hold one, so a
second accountant cannot grow back unseen. And no module imports another's private name: what
crosses a module boundary is public, named in its ``__all__`` or at least without a leading
underscore.
"""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_muon.plan.step_plan import TP_MODES

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_muon"
MODE_NAMES = {*TP_MODES, "team"}
ALLOWED = {"pricing.py", "step_plan.py"}


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants outside docstrings, with their lines."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            for i, stmt in enumerate(body):
                # a docstring, and the attribute docstrings after each assignment
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(
                        stmt.value.value, str) and (i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))):
                    docstrings.add(id(stmt.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_tp_mode_literals_only_in_the_step_plan_and_the_pricing():
    found = []
    for path in sorted((PACKAGE / "plan").glob("*.py")):
        if path.name in ALLOWED:
            continue
        found += [f"{path.name}:{line}: {value!r}" for line, value in _strings(ast.parse(path.read_text()))
                  if value in MODE_NAMES]
    assert not found, "TP modes named outside plan/step_plan.py and plan/pricing.py:\n" + "\n".join(found)


def test_the_check_sees_a_planted_literal():
    planted = ast.parse('"""doc"""\nX = 1\n"""about X: owner"""\ndef f(mode):\n    return mode == "owner"\n')
    assert [v for _, v in _strings(planted) if v in MODE_NAMES] == ["owner"]


def _private_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0] == "megatron_muon"
        if ours:
            out += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_crosses_a_module_boundary():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _private_imports(path)]
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def test_the_private_check_sees_a_planted_import(tmp_path):
    planted = tmp_path / "megatron_muon" / "x.py"
    planted.parent.mkdir()
    planted.write_text("from .config import _finite\nfrom megatron.core import _private_upstream\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, planted.parent
    try:
        assert [h.rsplit(": ", 1)[1] for h in _private_imports(planted)] == ["_finite"]
    finally:
        PACKAGE = saved
