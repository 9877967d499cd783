"""The package's import rules (DESIGN.md): data flows capture -> judging -> training -> serving, and the light parts
never pull in the heavy ones. Each module's imports are read from its source (lazy imports inside functions
included), so a rule broken on a rarely-run path still fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mappa_graph"
CONTRACT = {"traces", "messages", "errors", "event_loop"}  # the top-level modules every part may read
HEAVY = {"torch", "transformers", "peft"}

# part -> (the other parts of mappa_graph it may import, third-party packages it must never import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    "traces": (set(), HEAVY | {"langgraph", "langchain_core"}),
    "errors": (set(), HEAVY | {"langgraph", "langchain_core", "pydantic"}),
    "event_loop": (set(), HEAVY | {"langgraph", "langchain_core", "pydantic"}),
    "messages": ({"traces"}, HEAVY | {"langgraph"}),
    "capture": (CONTRACT, HEAVY),
    "judging": (CONTRACT | {"capture"}, HEAVY | {"langgraph"}),
    "models": (CONTRACT, {"langgraph"}),
    "training": (CONTRACT | {"capture", "judging", "models", "serving"}, set()),
    "serving": (CONTRACT | {"models"}, {"langgraph"}),
    "testing": (CONTRACT | {"models"}, {"langgraph"}),
}
MODULE_LEVEL_ONLY = {"training": {"langgraph"}}  # training may reach langgraph only lazily (through capture)


def _imports(source: str, module: str) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every import in `source`, relative ones resolved
    against `module` (a dotted name under mappa_graph)."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks never run: treat them as lazy
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            top_level.discard(id(node))
    parent = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def at_module_level(node: ast.AST) -> bool:
        while id(node) in parent:
            node = parent[id(node)]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return False
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return False
        return True

    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, at_module_level(node)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                targets = [name] if node.module else [f"{name}.{alias.name}" for alias in node.names]
            else:
                targets = [node.module or ""]
            found += [(target, node.lineno, at_module_level(node)) for target in targets]
    return found


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else module


def violations(source: str, module: str) -> list[str]:
    """Every import in `source` (the text of mappa_graph module `module`) that breaks its part's rule."""
    part = _part(module)
    allowed, forbidden = RULES[part]
    lazy_ok = MODULE_LEVEL_ONLY.get(part, set())
    broken = []
    for target, line, module_level in _imports(source, module):
        root = target.split(".")[0]
        if root == "mappa_graph" and target.count("."):
            other = target.split(".")[1]
            if other != part and other not in allowed:
                broken.append(f"{module}:{line} imports mappa_graph.{other} ({part} may import {sorted(allowed)})")
        elif root in forbidden:
            broken.append(f"{module}:{line} imports {target} ({part} never imports {sorted(forbidden)})")
        elif root in lazy_ok and module_level:
            broken.append(f"{module}:{line} imports {target} at module level ({part} reaches it only lazily)")
    return broken


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts == ("mappa_graph", "__init__"):
            continue  # the top-level __init__ re-exports the public names of every part, lazily
        found.append((".".join(parts), path))
    return found


MODULES = [(name, path) for name, path in _modules() if _part(name) in RULES]


def test_every_module_falls_under_a_rule() -> None:
    unruled = sorted({_part(name) for name, _ in _modules()} - set(RULES) - {"cli"})
    assert not unruled, f"parts of mappa_graph with no import rule: {unruled}; add them to RULES"


@pytest.mark.parametrize("module,path", MODULES, ids=[name for name, _ in MODULES])
def test_module_keeps_its_parts_import_rule(module: str, path: Path) -> None:
    assert violations(path.read_text(), module) == []


@pytest.mark.parametrize(
    "module,source",
    [
        ("mappa_graph.judging.protocol", "import torch\n"),
        ("mappa_graph.judging.protocol", "def f():\n    from langgraph.graph import StateGraph\n"),
        ("mappa_graph.capture.store", "def f():\n    from ..models.policies import AgentPolicies\n"),
        ("mappa_graph.training.trainer", "from langgraph.types import Send\n"),
        ("mappa_graph.serving.export", "from ..training import trainer\n"),
    ],
)
def test_the_checker_catches_a_forbidden_import(module: str, source: str) -> None:
    assert violations(source, module), f"{source!r} in {module} should break its rule"


def test_lazy_langgraph_in_training_and_type_checking_imports_are_allowed() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import langgraph\ndef f():\n    import langgraph\n"
    assert violations(source, "mappa_graph.training.trainer") == []


def test_importing_the_light_parts_loads_no_heavy_library() -> None:
    """What actually lands in sys.modules, transitive imports included (the AST rule only sees direct ones)."""
    code = ("import sys, mappa_graph, mappa_graph.capture, mappa_graph.judging, mappa_graph.training.config, "
            "mappa_graph.training.credit; print(sorted(m for m in ('torch', 'transformers', 'peft', 'langgraph') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing the light parts loaded {out}"
