"""The map of worker/'s folders on the development page, from the folders themselves.

Each folder's `__init__` docstring says what it holds (its first paragraph) and what it may
import (its `May import:` line); the map is those, and tests/test_layout.py checks that
every folder imports no more than it says, counting imports made inside functions.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from worker.tools.markdown import table

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "worker"
BEGIN, END = "<!-- generated:layout -->", "<!-- /generated:layout -->"
_MAY_IMPORT = re.compile(r"^May import:(.*)$", re.M | re.S)


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


def part_of(module: str) -> str | None:
    """The part of the project `module` (dotted) belongs to: a folder or a flat module of
    worker/, or `producer`; None for anything else."""
    parts = module.split(".")
    if parts[0] == "producer":
        return "producer"
    if parts[0] != "worker" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(folder: str) -> set[str]:
    """The parts of the project that the modules of worker/<folder> import, anywhere in a
    file (inside functions too), other than the folder itself."""
    seen: set[str] = set()
    for path in (WORKER / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from worker import x` names the module x.
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                part = part_of(name)
                if part is not None and part != folder:
                    seen.add(part)
    return seen


def render_block() -> str:
    rows = [
        [f"`worker/{f.name}/`", f.holds, ", ".join(f"`{n}`" for n in sorted(f.may_import))]
        for f in folders()
    ]
    flat = ", ".join(f"`{m}.py`" for m in flat_modules())
    return (
        f"{BEGIN}\n"
        "<!-- Written by `make docs-gen` from each folder's __init__ docstring. -->\n\n"
        + table(["folder", "what it holds", "may import"], rows)
        + f"\n\nAt `worker/`'s top, flat: {flat} (what every concern uses, and the command line)."
        + f"\n{END}"
    )


def render(page: Path) -> str:
    """`page` (docs/development.md) with its layout block written anew."""
    text = page.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render_block() + text[end:]
