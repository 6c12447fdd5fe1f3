"""What the wheel ships: the plugin and the CLI, nothing only tests use.

The ``vllm-output-rate`` distribution is the packages under ``src/``
(pyproject's ``[tool.setuptools.packages.find]``).  Its ``tools`` package
holds the CLI's commands and what they import; the harnesses that only the
tests and benchmarks use (the scheduler simulator, the churn counters, the
gateway comparison, the benchmark kit) are the unpublished
``vllm-output-rate-harness`` distribution in ``harness/`` (issue 31).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
from setuptools import find_namespace_packages, find_packages

REPO = Path(__file__).resolve().parents[1]
HARNESS = "vllm_output_rate_harness"
#: Modules that left the wheel for the harness; none may come back.
HARNESS_MODULES = {"scheduler_sim", "churn", "gateway", "benchkit"}
TOOLS = "vllm_output_rate.tools"
CLI = f"{TOOLS}.cli"


def shipped_modules() -> set[str]:
    """Every package and module the main distribution's wheel holds."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    modules: set[str] = set()
    for where in find.get("where", ["."]):
        root = REPO / where
        packages = finder(str(root), include=find.get("include", ["*"]), exclude=find.get("exclude", []))
        for package in packages:
            if "__pycache__" in package.split("."):
                continue
            modules.add(package)
            folder = root.joinpath(*package.split("."))
            modules.update(f"{package}.{path.stem}" for path in folder.glob("*.py") if path.stem != "__init__")
    return modules


def cli_roots() -> set[str]:
    """The CLI module and the tools it runs by name (``_run_tool("bench", ...)``)."""
    tree = ast.parse((REPO / "src" / "vllm_output_rate" / "tools" / "cli.py").read_text())
    named = {
        f"{TOOLS}.{node.args[0].value}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_run_tool"
        and node.args and isinstance(node.args[0], ast.Constant)
    }
    assert named, "cli.py runs no tool by name any more: update this test"
    return {CLI, *named}


def test_the_wheel_ships_no_harness_module():
    shipped = shipped_modules()
    assert CLI in shipped and "vllm_output_rate.adapter.scheduler" in shipped
    harness = sorted(
        m for m in shipped
        if m.rpartition(".")[2] in HARNESS_MODULES or m.partition(".")[0] == HARNESS
    )
    assert harness == []


def test_every_shipped_tool_serves_a_cli_command():
    """A ``tools`` module that no CLI command reaches (lazy imports included)
    belongs to the harness, not the wheel."""
    graph = grimp.build_graph("vllm_output_rate")
    reached: set[str] = set()
    todo = list(cli_roots())
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(m for m in graph.find_modules_directly_imported_by(module) if m.startswith(TOOLS + "."))
    tools = {m for m in shipped_modules() if m.startswith(TOOLS + ".")}
    assert sorted(tools - reached) == []


NO_HARNESS = """
import importlib, importlib.abc, sys

class NoHarness(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == %r:
            raise ModuleNotFoundError(f"{name} is not in the wheel", name=name)
        return None

sys.meta_path.insert(0, NoHarness())
for module in sys.argv[1:]:
    importlib.import_module(module)
"""


def test_every_cli_command_imports_without_the_harness():
    modules = sorted(m for m in shipped_modules() if m.startswith(TOOLS + "."))
    done = subprocess.run(
        [sys.executable, "-c", NO_HARNESS % HARNESS, *modules],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
