"""The habits CI keeps (issue 30): ruff's lint and format (configured in pyproject.toml, line
length 120), no module over 700 lines and no function body over 60 lines in dflashctl/ and
remote_payload/. A function's body is its statements after the docstring: a Typer command's
signature is its table of options, not logic a reader must follow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflashctl", "remote_payload")
MAX_MODULE_LINES = 700
MAX_BODY_LINES = 60


def sources() -> list[Path]:
    """The project's own Python modules (the CLI and the payload)."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = fn.body
    if (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_or_function_is_too_long():
    long_modules, long_functions = [], []
    for path in sources():
        text = path.read_text()
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_BODY_LINES:
                long_functions.append(f"{name}:{node.lineno} {node.name}: {body_lines(node)} lines")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_the_length_rule_counts_the_body_not_the_signature_or_docstring():
    fn = ast.parse('def f(\n    a,\n    b,\n):\n    """Doc\n    string."""\n    x = 1\n    return x\n').body[0]
    assert body_lines(fn) == 2
