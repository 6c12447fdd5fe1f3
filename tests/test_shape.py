"""The package's shape, checked: layers, no import cycle, one writer of the ledger.

These are the rules a maintainer relies on when changing one part: the
policy never reaches up into stores or vLLM, no two modules need each other
(a lazy import inside a function counts as an import), the plain-Python
layers type-check strictly, and only the ledger writes its records.  How
big a class may be is judged by what it owns, in review, not by a count
here (a method cap was met by splitting classes, issue 43).
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


def test_policy_and_stores_type_check_strictly():
    """mypy --strict on the two plain-Python layers (pyproject's [tool.mypy]):
    a protocol whose implementations drift apart fails here, not in an engine."""
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    assert mypy, "mypy is not installed (it is in the [dev] extra)"
    done = subprocess.run([mypy], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


#: The ledger's records (issue 31: the ledger alone records what a step paid,
#: kept and refused; the other parts report through its methods).
LEDGER_RECORDS = frozenset({
    "charged_tokens", "throttled_ns", "ran", "blocked", "refused", "short",
    "unadmitted", "prepaid", "offers", "charged",
})
_MUTATORS = frozenset({"add", "discard", "update", "append", "clear", "pop", "remove", "setdefault"})


def _record_writes(tree: ast.AST) -> list[int]:
    """Lines that write a ledger record held by another object: assigned to,
    item-assigned, mutated in place, directly or through a local alias
    (``x = ledger.prepaid; x.add(k)``, or a loop variable over a tuple of
    records: ``for x in (ledger.ran, other): x.pop(u)``).  ``self.<name>``
    is the object's own."""

    def foreign_record(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr in LEDGER_RECORDS
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        )

    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        aliases: set[str] = set()
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and foreign_record(node.value):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif (
                isinstance(node, (ast.For, ast.AsyncFor))
                and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set))
                and any(foreign_record(item) for item in node.iter.elts)
            ):
                # ``for totals in (ledger.ran, ...)``: the loop variable is
                # each record in turn.
                aliases.add(node.target.id)

        def held(node: ast.AST) -> bool:
            return foreign_record(node) or (isinstance(node, ast.Name) and node.id in aliases)

        for node in ast.walk(func):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if foreign_record(target) or (isinstance(target, ast.Subscript) and held(target.value)):
                    found.append(node.lineno)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and held(node.func.value)
            ):
                found.append(node.lineno)
    return found


def test_only_the_ledger_writes_its_records():
    """In the layers that hold a ledger (the policy and the adapter)."""
    writes = {}
    for path in sorted([*(SRC / "policy").rglob("*.py"), *(SRC / "adapter").rglob("*.py")]):
        if path.name == "ledger.py":
            continue
        lines = _record_writes(ast.parse(path.read_text(), str(path)))
        if lines:
            writes[str(path.relative_to(REPO))] = lines
    assert writes == {}


def test_record_write_finder_finds_direct_and_aliased_writes():
    source = (
        "def settle(ledger, user):\n"
        "    ledger.ran[user] = 1\n"
        "    charged = ledger.charged_tokens\n"
        "    charged[user] = 2\n"
        "    ledger.prepaid.add(user)\n"
        "    self.ran = {}\n"
        "    return ledger.charged_tokens.get(user)\n"
    )
    assert _record_writes(ast.parse(source)) == [2, 4, 5]


def test_record_write_finder_finds_a_write_through_a_loop_alias():
    source = (
        "def forget(ledger, other, users):\n"
        "    for totals in (other, ledger.charged_tokens):\n"
        "        for user in users:\n"
        "            totals.pop(user, None)\n"
        "    for key in ledger.prepaid:\n"
        "        key.pop()\n"
        "    for others in (other,):\n"
        "        others.pop(1)\n"
    )
    # The record's elements (line 6) are not the record; a tuple without a
    # record (line 8) holds none.  (Aliases are found by name, per function.)
    assert _record_writes(ast.parse(source)) == [4]
