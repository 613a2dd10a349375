"""Exit calls that would run when pytest imports a file under tests/ (see test_suite_hygiene.py).

conftest.py runs `exits_at_import()` at session start, before any test module is imported: a
module-level ``os._exit(0)`` would otherwise end the session with exit code 0 and nothing run.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXITS = {("os", "_exit"), ("sys", "exit"), ("os", "abort")}


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def _module_level_exits(tree: ast.Module):
    """Exit calls that run when the module is imported (outside functions, classes and the main guard)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_main_guard(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in EXITS:
            yield node.lineno
        pending.extend(ast.iter_child_nodes(node))


def exits_at_import(root: Path = TESTS) -> list[str]:
    """``file:line`` of every exit call that runs at import, in the Python files under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line in sorted(_module_level_exits(ast.parse(path.read_text(), filename=str(path)))):
            found.append(f"{path.relative_to(root)}:{line}")
    return found
