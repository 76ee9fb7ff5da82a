"""Every module of the installed package (the top-level `processors/` and `entrypoints/` included)
stays readable in one sitting: no file over 500 lines, no function over 60 (issue 22)."""

from __future__ import annotations

import ast
import os

from test_import_graph import package_files

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def _functions(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_file_over_500_lines():
    sizes = {module: _lines(path) for module, path in package_files().items()}
    over = {module: n for module, n in sizes.items() if n > MAX_FILE_LINES}
    assert over == {}, f"split these by what they do (at most {MAX_FILE_LINES} lines): {over}"


def test_no_function_over_60_lines():
    long = [f"{os.path.relpath(path)}:{line} {name} ({n} lines)"
            for path in package_files().values() for name, line, n in _functions(path) if n > MAX_FUNCTION_LINES]
    assert long == [], f"split these (at most {MAX_FUNCTION_LINES} lines each): {long}"
