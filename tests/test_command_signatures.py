"""Issue 28: no command's signature is longer than 40 lines; a command with more options takes
them as option records (cli/records.py), each declared once. Checked over every function in
cli/, commands and helpers alike: from its `def` to its body's first statement."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "cli"
MOST_LINES = 40


def test_no_signature_in_cli_is_longer_than_40_lines() -> None:
    long = []
    for path in sorted(CLI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.body[0].lineno - node.lineno
                if lines > MOST_LINES:
                    long.append(
                        f"{path.relative_to(CLI.parent)}:{node.lineno} {node.name}: {lines}"
                    )
    assert not long, f"signatures over {MOST_LINES} lines: {long}"
