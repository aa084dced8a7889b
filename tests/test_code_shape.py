"""Shape rules the team keeps (DEVELOPERS: "No class grows past ~300 lines"),
computed from the code outside tests/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("gearshift", "bus", "bus_schema", "services", "agent", "perfmodel", "policies", "sim", "loadtest", "examples")
MAX_CLASS_LINES = 300


def test_no_class_over_300_lines():
    seen, big = 0, []
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    seen += 1
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_CLASS_LINES:
                        big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {size} lines")
    assert seen > 100  # the scan sees the code
    assert not big, "classes over 300 lines:\n" + "\n".join(big)
