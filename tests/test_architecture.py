"""The package's shape: every module imports alone, the import graph among ttrank's modules has
no cycle, and no function imports a ttrank module (the way a cycle is hidden)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ttrank"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _imported(node: ast.AST) -> list[str]:
    """The ttrank modules an import statement names ("__init__" for the package itself)."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 1:  # from .x import y / from . import x, y
            return [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
        if node.level == 0 and node.module and node.module.split(".")[0] == "ttrank":
            parts = node.module.split(".")
            if len(parts) > 1:
                return [parts[1]]
            return [a.name for a in node.names if a.name in MODULES] or ["__init__"]
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "ttrank":
                out.append(parts[1] if len(parts) > 1 else "__init__")
        return out
    return []


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the ttrank modules it imports, function-local ttrank imports found)."""
    graph, local = {}, []
    for m in MODULES:
        tree = ast.parse((PACKAGE / f"{m}.py").read_text())
        graph[m] = set()
        for node in ast.walk(tree):
            for target in _imported(node):
                if target in MODULES and target != m:
                    graph[m].add(target)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if _imported(node):
                        local.append(f"{m}.py:{node.lineno} in {fn.name}()")
    return graph, local


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_among_ttrank_modules():
    graph, _ = _graph()
    # importing any ttrank.x runs ttrank/__init__.py first, so the package's own imports count
    # as every module's: a module that imports __init__ would close a cycle through it
    assert "__init__" not in set().union(*(graph[m] for m in graph if m != "__init__"))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_function_imports_a_ttrank_module():
    _, local = _graph()
    assert local == []


def test_the_checker_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _import(*names: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]))
    code = "; ".join(f"import {n}" for n in names)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _name(module: str) -> str:
    return "ttrank" if module == "__init__" else f"ttrank.{module}"


def test_every_module_imports_in_a_fresh_interpreter():
    r = _import(*map(_name, MODULES))
    assert r.returncode == 0, r.stderr[-2000:]


# each alone: ~6 s apiece (TVM's import), so with the long tests. Any ttrank.x runs the
# package's __init__ first, which the test above does too; the graph walk covers the rest.
@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module):
    r = _import(_name(module))
    assert r.returncode == 0, r.stderr[-2000:]
