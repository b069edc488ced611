"""What the docs and the code's own prose name is there: a page, a README or a comment that
points at a file, a module or a document that moved or never was sends a newcomer looking
for nothing.

The prose read: docs/*.md, docs/reference/*.md (written from the code: a name there is fixed
where the code says it), README.md, and every comment and docstring of worker/,
producer/ and measure/.
In it:

- a path under the repository's own folders (`worker/...`, `producer/...`, `scripts/...`,
  `tests/...`, `docs/...`) names a file or folder of this repository, and a page's
  `#anchor` one of its headings;
- a `.py` path relative to a folder of the code (`pipeline/launch.py`, measure/'s
  `gpu_check/peer.py`) names a file under one of the folders above the text that names
  it, or under worker/, producer/ or measure/;
- a bare `name.py` in a comment or docstring names a module beside it (further away, the
  path says where); in a page, a module somewhere in the repository;
- a bare `name.md` names a page of docs/ (or docs/reference/) or a file at the
  repository's top;
- a dotted `worker.x.y` / `producer.x` whose first part below the package is a part of it
  names a module, or a name a module defines (`worker.delivery.reader.Reader`);
- a package's docstring that lists its modules (`- `name`: ...`) names its modules;
- a `../` path is one of the repository's (from the page that names it, or in the code
  from the repository's top); none leads outside it: the project speaks of itself only,
  so what lives beside the checkout is said in words, not pointed at.

ALLOWED holds the few names that are meant to be no file of this repository, each with its
reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
# The packages whose comments and docstrings are read, and the folders a path may start with.
CODE = ("worker", "producer", "measure")
TOP_FOLDERS = (*CODE, "scripts", "tests", "docs")

# Files another change is rewriting right now: their comments and docstrings are checked
# once it lands and takes them out of this set.
BEING_REWRITTEN: frozenset[str] = frozenset()

# Names that are meant to be no file of this repository.
ALLOWED = {
    # The module tests/measure/test_gpu_host_rehearsal.py writes into its copy of the checkout to
    # show the failure docs/gpu-hosts.md quotes.
    "tests/test_needs_pyarrow.py": "written by a test, quoted in docs/gpu-hosts.md",
    # Files the tools write or the user writes, named as such.
    "report.md": "the benchmark's report, written into its output folder",
    "nets.py": "a user's module, in docs/own-model.md's example",
}


@dataclass(frozen=True)
class Prose:
    """A page, or one comment or docstring of the code, and where it is."""

    path: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def in_code(self) -> bool:
        return self.path.suffix == ".py"


def rewritten(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(
        rel == name or (name.endswith("/") and rel.startswith(name)) for name in BEING_REWRITTEN
    )


def code_prose(path: Path) -> Iterator[Prose]:
    """The comments and docstrings of one module."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield Prose(path, token.start[0], token.string)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield Prose(path, first.lineno, first.value.value)


@cache
def all_prose() -> tuple[Prose, ...]:
    pages = [*sorted((ROOT / "docs").glob("*.md")), *sorted(REFERENCE.glob("*.md"))]
    found = [Prose(p, 1, p.read_text()) for p in pages]
    found.append(Prose(ROOT / "README.md", 1, (ROOT / "README.md").read_text()))
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not rewritten(path):
                found.extend(code_prose(path))
    return tuple(found)


# --------------------------------------------------------------------------- the rules
_NOT_AFTER = r"(?<![\w./-])"
TOP_PATH = re.compile(
    _NOT_AFTER + r"((?:" + "|".join(TOP_FOLDERS) + r")/[\w./-]*[\w/])(?:#([\w-]+))?"
)
RELATIVE_PY = re.compile(_NOT_AFTER + r"([a-z_][\w-]*(?:/[\w-]+)*/\w+\.py)\b")
BARE_PY = re.compile(_NOT_AFTER + r"(\w+\.py)\b")
BARE_MD = re.compile(_NOT_AFTER + r"([\w-]+\.md)\b")
OUTSIDE = re.compile(r"(?<![\w.])(\.\./[\w./-]*)")
DOTTED = re.compile(_NOT_AFTER + r"((?:worker|producer|measure)(?:\.[A-Za-z_]\w*)+)")
MODULE_ITEM = re.compile(r"^\s*- `(\w+)`:", re.M)


@cache
def code_folders() -> frozenset[str]:
    """The names of the folders of worker/ and producer/ (at any depth)."""
    return frozenset(
        p.name
        for top in CODE
        for p in (ROOT / top).rglob("*")
        if p.is_dir() and p.name != "__pycache__"
    )


@cache
def modules_named(name: str) -> bool:
    return any(
        p.name == name
        for top in TOP_FOLDERS
        for p in (ROOT / top).rglob(name)
        if "__pycache__" not in p.parts
    )


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a page's headings, as the site's table of contents makes them."""
    if page.suffix != ".md":
        return frozenset()
    headings = re.findall(r"^#+ (.+?)\s*$", page.read_text(), re.M)
    slugs = (re.sub(r"[^\w\s-]", "", h).strip().lower() for h in headings)
    return frozenset(re.sub(r"[-\s]+", "-", slug) for slug in slugs)


def top_level_names(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def dotted_problem(dotted: str) -> str | None:
    """Why `dotted` names nothing, or None; a name whose first part below the package is no
    part of it is taken for an attribute (`worker.runner.step`: a Worker's runner)."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    if not ((here / parts[1]).is_dir() or (here / f"{parts[1]}.py").is_file()):
        return None
    for i, part in enumerate(parts[1:], start=1):
        if (here / part / "__init__.py").is_file():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            module = here / f"{part}.py"
            rest = parts[i + 1 :]
            if rest and rest[0] not in top_level_names(module):
                return f"{'.'.join(parts[: i + 1])} defines no {rest[0]}"
            return None
        if part in top_level_names(here / "__init__.py"):
            return None
        return f"{'.'.join(parts[:i])} has no module or name {part}"
    return None


def problems_of(prose: Prose) -> list[str]:
    """What `prose` names that is not there, each with its line."""
    found = []
    for at, what in _found(prose):
        line = prose.line + prose.text.count("\n", 0, at)
        found.append(f"{line}: {what}")
    return found


def _found(prose: Prose) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    text = prose.text
    for match in TOP_PATH.finditer(text):
        ref = match.group(1).rstrip(".")
        if "*" in ref or ref in ALLOWED:
            continue
        if not (ROOT / ref).exists():
            out.append((match.start(), ref))
        elif match.group(2) and match.group(2) not in anchors(ROOT / ref):
            out.append((match.start(), f"{ref}#{match.group(2)} (no such heading)"))
    ancestors = [prose.path.parent, *prose.path.parent.parents]
    bases = [a for a in ancestors if ROOT in (a, *a.parents)] + [ROOT / top for top in CODE]
    for match in RELATIVE_PY.finditer(text):
        ref = match.group(1)
        first = ref.split("/")[0]
        if first in TOP_FOLDERS or first not in code_folders() or ref in ALLOWED:
            continue
        if not any((base / ref).is_file() for base in bases):
            out.append((match.start(), ref))
    for match in BARE_PY.finditer(text):
        name = match.group(1)
        if name in ALLOWED:
            continue
        there = (prose.path.parent / name).is_file() if prose.in_code else modules_named(name)
        if not there:
            what = f"{name} (not beside it: give its path)" if prose.in_code else name
            out.append((match.start(), what))
    for match in BARE_MD.finditer(text):
        name = match.group(1)
        if name not in ALLOWED and not any(
            (folder / name).is_file()
            for folder in (ROOT, ROOT / "docs", ROOT / "docs" / "reference")
        ):
            out.append((match.start(), name))
    for match in OUTSIDE.finditer(text):
        ref = match.group(1).rstrip(".")
        # A page's link goes from its folder; the code writes paths from the repository's top.
        target = ((ROOT if prose.in_code else prose.path.parent) / ref).resolve()
        if ROOT not in target.parents:
            out.append((match.start(), f"{ref} (outside the repository)"))
        elif not target.exists():
            out.append((match.start(), ref))
    for match in DOTTED.finditer(text):
        problem = dotted_problem(match.group(1).rstrip("."))
        if problem is not None:
            out.append((match.start(), problem))
    return out


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("kind", ["pages", "code"])
def test_every_file_module_and_page_named_exists(kind: str) -> None:
    found = [
        f"{prose.where}:{problem}"
        for prose in all_prose()
        if prose.in_code == (kind == "code")
        for problem in problems_of(prose)
    ]
    assert not found, "named, and not there (fix the name, or say it in words):\n" + "\n".join(
        found
    )


def test_each_package_s_list_of_modules_names_its_modules() -> None:
    found = []
    for top in CODE:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            for name in MODULE_ITEM.findall(doc):
                if not ((init.parent / f"{name}.py").is_file() or (init.parent / name).is_dir()):
                    found.append(f"{init.relative_to(ROOT).as_posix()}: `{name}`")
    assert not found, f"listed as modules, and no module: {found}"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("The payload memory (worker/delivery/payload_arena.py) is a ring.", "payload_arena"),
        ("the names in DESIGN.md are part of the contract", "DESIGN.md"),
        ("see `../shared/DESIGN.md`", "outside the repository"),
        ("the launch thread (`pipeline/device.py`)", "pipeline/device.py"),
        ("as worker.pipeline.device does", "worker.pipeline has no module or name device"),
        ("`python -m worker.tools.docs_gen`", "worker.tools has no module or name docs_gen"),
        ("(docs/concepts.md#the-intake-process)", "no such heading"),
        ("from `worker.delivery.reader.Nothing`", "defines no Nothing"),
    ],
)
def test_the_check_sees_a_name_that_is_not_there(text: str, problem: str) -> None:
    prose = Prose(ROOT / "worker" / "delivery" / "payload_ring.py", 1, text)
    assert any(problem in p for p in problems_of(prose)), problems_of(prose)


@pytest.mark.parametrize(
    "text",
    [
        "the reader (worker/delivery/reader.py) and `payload_ring.py`",
        "docs/figures.md, scripts/gpu-check.sh and tests/project/test_layout.py",
        "docs/concepts.md#the-intakes-process, docs/gpu-hosts.md#make-gpu-check",
        "`python -m measure.gpu_check.carry`, worker.delivery.reader.Reader",
        "the runner's step (worker.runner.step): an attribute, not a module",
        "an entry `.../get?id=1` and `tools/doctor/verdict.py`",
    ],
)
def test_the_check_passes_names_that_are_there(text: str) -> None:
    prose = Prose(ROOT / "worker" / "delivery" / "payload_ring.py", 1, text)
    assert problems_of(prose) == []


# --------------------------------------------------------------------------- figures
# A comment or docstring of worker/ or producer/ carries no measured figure. A figure that
# justifies a choice goes stale as the code and the hosts change, so it lives in the docs
# (docs/figures.md, written from a benchmark report, or the page about the choice, which
# says where and when it was measured) and the comment keeps the reason and points there.
#
# A measured figure, for this check: in one sentence (or clause, or list item), a number
# with a unit of time (ns, µs, us, ms, s, seconds, minutes, hours) or of rate (jobs/s,
# images/s, GB/s, ..., "N a second"), and a sign that it was measured rather than chosen:
# a measuring word (measured, measures, took, takes, cost, costs), an approximation
# (about, ~, some, near, roughly), or a host (on this / a 2-core / a loaded ... host or
# machine, N cores, N-core, an H100 or H200). A setting (a timeout, an interval, a
# backoff, a limit, a target) is an exact number said as one ("within 2 s", "every
# 20 ms") and passes; a setting whose sentence reads like a measurement is in
# SETTING_FIGURES, with why.
_UNIT = (
    r"(?:ns|µs|us|ms|s|sec|seconds?|minutes?|min|hours?|h"
    r"|(?:jobs|images|img|calls|reads|rows|entries|commands|requests)/s|[KMG]i?B/s)"
)
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?-\s?\d[\d,]*(?:\.\d+)?)?"
    r"(?:\s" + _UNIT + r"(?![\w/])|(?:µs|us|ms|ns)\b|\s(?:\w+\s)?a second\b)"
)
MEASURED = re.compile(
    # (`measure/...` and `measure.x` are the measurements' package, no measuring word.)
    r"\b(?:measur\w*(?![/.]\w)|took|takes|costs?|about|some|near(?:ly)?|roughly)\b|~\s?\d"
    r"|\bon (?:this|that|the|a|an|one)(?: \w+)?(?: \d+-core)? (?:host|machine|box)\b"
    r"|\b\d+(?:-core| (?:idle |busy )?cores)\b|\b[AH]\d00\b",
    re.I,
)
# Where one sentence (or clause, or list item) ends and the next begins.
_SENTENCE_END = re.compile(
    r"(?<=[.!?])\s+(?=[A-Z(`\"'0-9])|;\s+|\n\s*\n|\n\s*(?=- |\(\w\) |\d+\w?\. )"
)

# Settings whose sentence reads like a measurement: (file, words of the sentence) -> why.
SETTING_FIGURES: dict[tuple[str, str], str] = {
    ("worker/pipeline/degrade.py", "How often the backlog is measured"): (
        "the interval between looks at the backlog, a setting's bounds"
    ),
}


def comment_blocks(path: Path) -> Iterator[Prose]:
    """A module's comments, each run of comment lines as one text, and its docstrings."""
    source = path.read_text()
    lines: list[str] = []
    start = last = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        if lines and token.start[0] != last + 1:
            yield Prose(path, start, "\n".join(lines))
            lines = []
        if not lines:
            start = token.start[0]
        lines.append(token.string.lstrip("#").strip())
        last = token.start[0]
    if lines:
        yield Prose(path, start, "\n".join(lines))
    yield from (p for p in code_prose(path) if not p.text.lstrip().startswith("#"))


def measured_figures(prose: Prose) -> list[str]:
    """The sentences of `prose` that carry a measured figure, each with its line."""
    found = []
    at = 0
    for sentence in [*_SENTENCE_END.split(prose.text)]:
        at = prose.text.find(sentence, at)
        figure = FIGURE.search(sentence)
        if figure and MEASURED.search(sentence):
            line = prose.line + prose.text.count("\n", 0, at)
            found.append(f"{line}: {' '.join(sentence.split())}")
        at += len(sentence)
    return found


def test_no_comment_or_docstring_carries_a_measured_figure() -> None:
    found = []
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if rewritten(path):
                continue
            rel = path.relative_to(ROOT).as_posix()
            for prose in comment_blocks(path):
                for sentence in measured_figures(prose):
                    if not any(f == rel and w in sentence for f, w in SETTING_FIGURES):
                        found.append(f"{rel}:{sentence}")
    assert not found, (
        "measured figures in the code's prose: move each to the docs page about the choice "
        "(or docs/figures.md), keep the reason here and point there:\n" + "\n".join(found)
    )
