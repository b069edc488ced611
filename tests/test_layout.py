"""worker/ is grouped by concern: each folder imports no more than its docstring says, no two
modules import each other however indirectly (imports inside functions count), and only a
handful of modules sit flat at worker/'s top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from worker.tools.docs_gen import layout_page

ROOT = layout_page.ROOT


@pytest.mark.parametrize("folder", [f.name for f in layout_page.folders()])
def test_each_folder_says_what_it_holds_and_imports_no_more_than_it_says(folder: str) -> None:
    (declared,) = [f for f in layout_page.folders() if f.name == folder]
    assert declared.holds, f"worker/{folder}/__init__.py: say what the folder holds"
    extra = layout_page.imports_of(folder) - declared.may_import
    assert not extra, (
        f"worker/{folder} imports {sorted(extra)}, which its __init__ docstring's "
        "'May import:' line does not name: import from a part it may, or say why it may"
    )


def test_at_most_six_modules_sit_flat_at_the_top() -> None:
    assert len(layout_page.flat_modules()) <= 6, layout_page.flat_modules()


def module_graph() -> dict[str, set[str]]:
    """Each module of worker/ and producer/ -> the project's modules it imports."""
    paths: dict[str, Path] = {}
    for top in ("worker", "producer"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            paths[".".join(parts)] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                target = known(name)
                # A package's own __init__ is imported with it: no edge to a parent.
                if target and target != module and not module.startswith(target + "."):
                    targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other() -> None:
    assert circles(module_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
