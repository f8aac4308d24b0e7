"""docs/bad_inputs.md as data: its rows, and the line a row promises as a regular expression.

Every test that produces a row's line (``test_bad_inputs`` for the flags, YAML and data rows;
the checkpoint and API rows in the test that produces them) compares it with ``expected_line``.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DOC", "PLACEHOLDERS", "expected_line", "rows"]

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad_inputs.md"
ROW = re.compile(r"^\| `(?P<id>[a-z0-9-]+)` \| (?P<kind>\w+) \| (?P<input>.*?) \| `(?P<line>.*)` \|$")
PLACEHOLDERS = {  # the table's placeholders (besides TMP and CONFIG), as regular expressions
    "HALF": r"\d+", "FULL": r"\d+", "THIRD": r"\d+", "SIZE": r"\d+", "FILE": r"\S+\.distcp",
    "TENSOR": r"\S+ \(\w+\)", "PARAM": r"\S+ \(\d+ elements\)", "MORE": r"( \(and \d+ more\))?",
    "REASON": r"(Operation not permitted|Permission denied|Read-only file system)",
}


def rows() -> dict[str, dict]:
    """Every row by id; a ``\\|`` in a cell (how a Markdown table cell holds ``|``) is read as ``|``."""
    found = {}
    for text in DOC.read_text().splitlines():
        if match := ROW.match(text):
            assert match["id"] not in found, f"row {match['id']} twice"
            found[match["id"]] = {key: value.replace("\\|", "|") for key, value in match.groupdict().items()}
    return found


def expected_line(row_id: str, **paths: str) -> re.Pattern:
    """The table's line for ``row_id`` as a regex: ``paths`` (TMP=..., CONFIG=...) substituted
    literally, the other placeholders by their patterns."""
    pattern = re.escape(rows()[row_id]["line"])
    for name, value in paths.items():
        pattern = pattern.replace(name, re.escape(value))
    for name, value in PLACEHOLDERS.items():
        pattern = pattern.replace(name, value)
    return re.compile(pattern)
