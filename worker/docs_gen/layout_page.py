"""The map of worker/'s folders on the development page, from the folders themselves.

Each folder's `__init__` docstring says what it holds (its first paragraph) and what it may
import (its `May import:` line); worker/__init__.py's `Layers:` line puts every folder and
flat module in a layer. The map is those, and tests/project/test_layout.py checks that every part
imports no more than it says and only from layers below its own, counting imports made
inside functions (not those under `if TYPE_CHECKING:`, which are for annotations only).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from worker.tools.markdown import table

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
BEGIN, END = "<!-- generated:layout -->", "<!-- /generated:layout -->"
_MAY_IMPORT = re.compile(r"^May import:(.*)$", re.M | re.S)
_LAYERS = re.compile(r"^Layers:(.*)$", re.M | re.S)


@dataclass(frozen=True)
class Folder:
    name: str
    holds: str  # the docstring's first paragraph, on one line
    may_import: frozenset[str]


def folders() -> list[Folder]:
    """worker/'s folders, by name."""
    found = []
    for init in sorted(WORKER.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        match = _MAY_IMPORT.search(doc)
        allowed = match.group(1).replace("\n", " ").strip(" .") if match else ""
        found.append(
            Folder(
                name=init.parent.name,
                holds=" ".join(doc.split("\n\n", 1)[0].split()),
                may_import=frozenset(n.strip() for n in allowed.split(",") if n.strip()),
            )
        )
    return found


def flat_modules() -> list[str]:
    """The modules at worker/'s top (what every concern uses, and the command line)."""
    return sorted(p.stem for p in WORKER.glob("*.py") if p.stem not in ("__init__", "__main__"))


def layers() -> list[list[str]]:
    """worker/__init__.py's `Layers:` line, bottom first: each layer's parts (folders and
    flat modules of worker/)."""
    doc = ast.get_docstring(ast.parse((WORKER / "__init__.py").read_text(encoding="utf-8")))
    match = _LAYERS.search(doc or "")
    if not match:
        return []
    text = " ".join(match.group(1).split())
    return [[n.strip() for n in layer.split(",") if n.strip()] for layer in text.split("|")]


def layer_of() -> dict[str, int]:
    """Each part named in `layers()` -> its layer, 1 at the bottom."""
    return {part: i for i, layer in enumerate(layers(), start=1) for part in layer}


def parts() -> list[str]:
    """worker/'s folders and flat modules (`__main__` aside: it only starts the CLI)."""
    return sorted([f.name for f in folders()] + flat_modules())


def part_of(module: str) -> str | None:
    """The part of the project `module` (dotted) belongs to: a folder or a flat module of
    worker/, or `producer`; None for anything else."""
    parts = module.split(".")
    if parts[0] == "producer":
        return "producer"
    if parts[0] != "worker" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(part: str) -> set[str]:
    """The parts of the project that worker/<part> (a folder or a flat module) imports at
    run time, anywhere in a file (inside functions too), other than the part itself. An
    import under `if TYPE_CHECKING:` is for annotations only and does not count."""
    seen: set[str] = set()
    folder = WORKER / part
    paths = folder.rglob("*.py") if folder.is_dir() else [WORKER / f"{part}.py"]
    for path in paths:
        for name in _runtime_imports(path, _package_of(path)):
            found = part_of(name)
            if found is not None and found != part:
                seen.add(found)
    return seen


def _package_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts if parts[-1] == "__init__" else parts[:-1])


def _runtime_imports(path: Path, package: str) -> list[str]:
    """The dotted names `path` imports, relative imports resolved, those under `if
    TYPE_CHECKING:` left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from worker import x` names the module x.
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def render_block() -> str:
    level = layer_of()
    rows = [
        [
            str(level.get(f.name, "?")),
            f"`worker/{f.name}/`",
            f.holds,
            ", ".join(f"`{n}`" for n in sorted(f.may_import)),
        ]
        for f in sorted(folders(), key=lambda f: (level.get(f.name, len(level)), f.name))
    ]
    flat = ", ".join(f"`{m}.py` (layer {level.get(m, '?')})" for m in flat_modules())
    return (
        f"{BEGIN}\n"
        "<!-- Written by `make docs-gen` from each folder's __init__ docstring and the\n"
        "`Layers:` line of worker/__init__.py. -->\n\n"
        + table(["layer", "folder", "what it holds", "may import"], rows)
        + f"\n\nAt `worker/`'s top, flat: {flat} (what every concern uses, and the command line)."
        + f"\n{END}"
    )


def render(page: Path) -> str:
    """`page` (docs/development.md) with its layout block written anew."""
    text = page.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render_block() + text[end:]
