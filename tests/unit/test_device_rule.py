"""The device rule, checked on the package's source (``megatron_muon/parallel/devices.py`` states it).

Gloo accepts a CPU tensor wherever NCCL needs a GPU one, so no CPU run can catch a tensor
allocated on the wrong device; this walks every module's syntax tree instead and fails on:

* ``torch.device(...)`` built anywhere but ``parallel/devices.py`` (and Megatron's CPU patches);
* a device literal: a string constant inside a ``device=`` argument (``"cpu"``, ``"cuda"``, also
  in a conditional), or as the argument of ``.to(...)``; ``.cuda()`` and ``.cpu()`` calls;
* a tensor factory (``torch.empty``, ``zeros``, ``tensor``, ...) without ``device=``: it would
  land on the default device, the CPU. A host scalar by design (torch's AdamW keeps ``step`` on
  the host) says so with ``# device-rule: host scalar`` on its line.

The checker itself is shown to catch each kind on planted source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_muon"
EXEMPT = {"parallel/devices.py", "megatron/cpu_patches/"}  # a file, or every file of a package
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint", "eye",
             "empty_strided", "linspace"}
HOST_MARK = "# device-rule: host scalar"


def _is_torch_attr(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def _has_str_constant(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


def violations(source: str, where: str = "<planted>") -> list[str]:
    """Every breach of the device rule in ``source``, as ``where:line: what``."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        line = lines[node.lineno - 1] if node.lineno <= len(lines) else ""
        say = lambda what, node=node: found.append(f"{where}:{node.lineno}: {what}")
        if _is_torch_attr(node.func, "device"):
            say("torch.device(...) outside parallel/devices.py")
        for kw in node.keywords:
            if kw.arg == "device" and _has_str_constant(kw.value):
                say(f"device literal in device={ast.unparse(kw.value)}")
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("cuda", "cpu"):
            say(f".{node.func.attr}() moves a tensor to a fixed device")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "to":
            if any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
                say(f"device literal in {ast.unparse(node)}")
        if (isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(kw.arg == "device" for kw in node.keywords) and HOST_MARK not in line):
            say(f"torch.{node.func.attr}(...) without device= lands on the default device")
    return found


def test_the_package_obeys_the_device_rule():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in EXEMPT):
            found += violations(path.read_text(), f"megatron_muon/{rel}")
    assert not found, "device rule broken:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'x = torch.zeros(n, device=p.device if p is not None else "cpu")',  # the bug this rule was written for
    'x = torch.empty(3, device="cuda")',
    "d = torch.device('cpu')",
    'y = x.to("cuda")',
    "y = x.cuda()",
    "y = x.cpu()",
    "x = torch.empty(0, dtype=torch.float32)",
    "header = torch.tensor([1, 2], dtype=torch.int64)",
])
def test_the_checker_catches_a_planted_literal(planted):
    assert violations(f"import torch\n{planted}\n"), planted


@pytest.mark.parametrize("fine", [
    "x = torch.zeros(n, device=device)",
    "x = torch.empty_like(y)",
    "x = y.to(device)",
    "x = y.to(torch.float32)",
    f"step = torch.tensor(0.0)  {HOST_MARK}, as torch's AdamW keeps it",
])
def test_the_checker_passes_device_helper_code(fine):
    assert violations(f"import torch\n{fine}\n") == []
