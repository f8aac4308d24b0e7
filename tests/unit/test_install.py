"""The install: pyproject.toml declares ranges (what a user's environment may hold), and
scripts/requirements.lock pins the one environment CI and scripts/run.sh build. Every pinned
version must satisfy every declared range, or the lock would install something the package
says it does not support."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "scripts" / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"requirements.lock: {line!r} is not an exact pin (name==version)"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _declared(extras: tuple[str, ...] = ()) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_the_lock_satisfies_every_declared_range():
    pins = _lock()
    for req in _declared(("test", "bench")):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is declared but not in scripts/requirements.lock"
        assert pins[name] in req.specifier, f"requirements.lock pins {name}=={pins[name]}, outside {req}"


def test_the_core_stack_is_a_range_not_a_pin():
    """torch and megatron-core are ranges, so that installing the plugin into an environment
    that already has them (an NGC container) does not replace them; the lock pins them."""
    by_name = {canonicalize_name(r.name): r for r in _declared()}
    for name in ("torch", "megatron-core"):
        spec = by_name[name].specifier
        assert not any(s.operator == "==" for s in spec), f"{by_name[name]}: a pin, not a range"
        assert any(s.operator == "<" for s in spec), f"{by_name[name]}: no upper end (a release not tried would pass)"
        assert _lock()[name] in spec
