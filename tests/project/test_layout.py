"""worker/ is grouped by concern and its parts stand in layers: each folder imports no more
than its docstring says, every folder and flat module imports only from the layers below its
own (worker/__init__.py's `Layers:` line), no two modules import each other however
indirectly (imports inside functions count), and only a handful of modules sit flat at
worker/'s top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from worker.docs_gen import layout_page

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


def test_every_folder_and_flat_module_stands_in_exactly_one_layer() -> None:
    named = [part for layer in layout_page.layers() for part in layer]
    assert sorted(named) == sorted(set(named)), f"named twice in a layer: {named}"
    missing = set(layout_page.parts()) - set(named)
    assert not missing, (
        f"worker/{sorted(missing)} stand in no layer: add each to the `Layers:` line of "
        "worker/__init__.py, above every part it imports and below every part importing it"
    )
    gone = set(named) - set(layout_page.parts())
    assert not gone, f"worker/__init__.py's `Layers:` line names parts that are gone: {gone}"


@pytest.mark.parametrize("part", layout_page.parts())
def test_each_part_imports_only_from_the_layers_below_its_own(part: str) -> None:
    level = layout_page.layer_of()
    if part not in level:
        pytest.skip("in no layer: the test above says so")
    upward = {
        name: level[name]
        for name in layout_page.imports_of(part)
        if name in level and level[name] >= level[part]
    }
    assert not upward, (
        f"worker/{part} (layer {level[part]}) imports {upward} (part: layer), at or above its "
        "own: move what it needs down a layer, hand it in from above, or import it for "
        "annotations only under `if TYPE_CHECKING:`"
    )


@pytest.mark.parametrize("folder", [f.name for f in layout_page.folders()])
def test_each_folder_says_it_may_import_only_the_layers_below_its_own(folder: str) -> None:
    level = layout_page.layer_of()
    (declared,) = [f for f in layout_page.folders() if f.name == folder]
    above = sorted(n for n in declared.may_import if n in level and level[n] >= level[folder])
    assert not above, f"worker/{folder}/__init__.py may import {above}, not below its layer"


def test_the_layer_check_sees_an_upward_import_and_passes_over_a_type_only_one(
    tmp_path: Path,
) -> None:
    module = tmp_path / "worker" / "decode" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from worker.base.errors import ConfigError\n"
        "def f() -> None:\n"
        "    from worker.pipeline import launch\n"
        "if TYPE_CHECKING:\n"
        "    from worker.jobs import Job\n"
    )
    names = layout_page._runtime_imports(module, "worker.decode")
    assert {layout_page.part_of(n) for n in names} - {None} == {"base", "pipeline"}


def test_the_model_runner_only_copies_and_runs_the_step() -> None:
    # Decoding is the decode stages' (worker/pipeline/gpu_decode.py for the GPU's rows): the
    # runner that launches the step knows no decoder, so data flows one way.
    imports = {
        target
        for target in module_graph()["worker.pipeline.launch"]
        if target.startswith("worker.decode")
    }
    assert not imports, imports


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
