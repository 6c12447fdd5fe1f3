"""The package's shape, checked: layers, no import cycle, small classes.

These are the rules a maintainer relies on when changing one part: the
policy never reaches up into stores or vLLM, no two modules need each other
(a lazy import inside a function counts as an import), and a class small
enough to hold in one's head (at most :data:`MAX_METHODS` methods).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "vllm_output_rate"
#: More methods than this and a class is two classes.
MAX_METHODS = 12


def test_layer_contract_is_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is not installed (it is in the [dev] extra)"
    done = subprocess.run([lint], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.find_modules_directly_imported_by(module):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_lazy_imports_included():
    graph = grimp.build_graph("vllm_output_rate")
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    class Graph:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert _cycles(Graph()) == [["a", "b"]]


def _large_classes() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [
                    item
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > MAX_METHODS:
                    found.append(f"{path.relative_to(REPO)}::{node.name} ({len(methods)} methods)")
    return found


def test_no_class_has_more_than_twelve_methods():
    assert _large_classes() == []


def test_policy_and_stores_type_check_strictly():
    """mypy --strict on the two plain-Python layers (pyproject's [tool.mypy]):
    a protocol whose implementations drift apart fails here, not in an engine."""
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    assert mypy, "mypy is not installed (it is in the [dev] extra)"
    done = subprocess.run([mypy], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
