"""No message, page or comment names a former setting as if it could still be set.

The 25 variables that became tuning constants (worker/config/tuning.py) are refused at
start-up with the line `table.REMOVED_SETTINGS` gives. A log line, error, doctor verdict or
page that still names one sends an operator to a refusal: so every string literal and
comment of the code, and every page an operator reads, is scanned for them. The refusal
itself, the tuning constants' own comments and the few places in `ALLOWED` (each with its
reason) may name them.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.config import table

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()
NAMED = re.compile(
    r"\b(" + "|".join(sorted(table.REMOVED_SETTINGS, key=len, reverse=True)) + r")\b"
)

# Whole trees: Python files by their string literals and comments, any other text whole.
CODE_TREES = ("worker", "producer", "measure", "scripts", "tests")
PAGES = ("README.md", "docs/*.md", "docs/reference/*.md", "deploy/**/*")

# (path, where): a Markdown page's section (its heading's words, "" for the whole page),
# and why a former variable may be named there.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/reference/configuration.md", "Tuning constants"): (
        "the tuning constants' table gives each one's former variable, so that an operator "
        "who had it set finds what replaced it"
    ),
    ("docs/figures.md", ""): (
        "written from docs/figures/report.json, a past bench run's record: it quotes the "
        "worker's feed plan as the worker said it then; the next `make docs-figures` writes "
        "it from the code as it is"
    ),
}

# The refusal's test sets each former variable to see it refused.
REFUSAL_TEST = "tests/config/test_settings_table.py"


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _files() -> Iterator[Path]:
    for tree in CODE_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in parts):
                yield path
    for pattern in PAGES:
        yield from sorted(p for p in ROOT.glob(pattern) if p.is_file())


def _python_pieces(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each string literal and comment."""
    kinds = {tokenize.STRING, tokenize.COMMENT}
    # Python 3.12 splits f-strings into tokens of their own.
    if (middle := getattr(tokenize, "FSTRING_MIDDLE", None)) is not None:
        kinds.add(middle)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in kinds:
            for offset, line in enumerate(token.string.splitlines() or [""]):
                yield token.start[0] + offset, line


def _refusal_lines(source: str) -> set[int]:
    """table.py's lines that are the refusal: REMOVED_SETTINGS and each `instead=` line."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        spans: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "REMOVED_SETTINGS" for t in targets):
                spans.append(node)
        if isinstance(node, ast.keyword) and node.arg == "instead":
            spans.append(node.value)
        for span in spans:
            lines.update(range(span.lineno, (span.end_lineno or span.lineno) + 1))
    return lines


def _heading(lines: list[str], index: int) -> str:
    for line in reversed(lines[: index + 1]):
        if m := re.match(r"#{1,6} (.+)", line):
            return m.group(1).strip()
    return ""


def naming() -> Iterator[tuple[str, int, str, str]]:
    """(path, line, where, variable) of each former variable named."""
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in (HERE, REFUSAL_TEST):
            continue
        text = _text(path)
        if text is None:
            continue
        if path.suffix == ".py":
            refusal = _refusal_lines(text) if rel == "worker/config/table.py" else set()
            for number, line in _python_pieces(text):
                # tuning.py's comments say which variable each constant replaced.
                own_comment = rel == "worker/config/tuning.py" and line.lstrip().startswith("#")
                if number in refusal or own_comment:
                    continue
                for m in NAMED.finditer(line):
                    yield rel, number, "", m.group(1)
            continue
        lines = text.splitlines()
        for index, line in enumerate(lines):
            for m in NAMED.finditer(line):
                where = _heading(lines, index) if path.suffix == ".md" else ""
                yield rel, index + 1, where, m.group(1)


def _allowed(path: str, where: str) -> bool:
    return (path, where) in ALLOWED or (path, "") in ALLOWED


def test_the_scan_sees_the_pages_and_the_code() -> None:
    scanned = {p.relative_to(ROOT).as_posix() for p in _files()}
    for expected in (
        "README.md",
        "docs/reference/configuration.md",
        "worker/lifecycle/feed_plan.py",
        "worker/tools/doctor/verdict.py",
        "measure/bench/suite.py",
        "deploy/systemd/worker.env.example",
    ):
        assert expected in scanned
    assert len(table.REMOVED_SETTINGS) == 25


def test_no_message_or_page_names_a_removed_setting() -> None:
    found = [
        f"{path}:{line}: {variable}" + (f" (under {where!r})" if where else "")
        for path, line, where, variable in naming()
        if not _allowed(path, where)
    ]
    assert found == [], (
        "these name a variable the worker now refuses; name the tuning constant as such "
        "(`the ring's depth (tuning constant RING_SLOTS)`) or the setting that replaced it "
        "(table.REMOVED_SETTINGS):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(("path", "where"), sorted(ALLOWED))
def test_each_allowed_place_still_needs_it(path: str, where: str) -> None:
    named = [(p, w) for p, _, w, _ in naming() if p == path and (not where or w == where)]
    assert named, f"{path} {where!r} names no former variable any more: drop it from ALLOWED"


def test_the_scan_finds_a_former_variable_in_a_string_and_a_comment() -> None:
    name = next(iter(table.REMOVED_SETTINGS))
    source = f'x = "set {name}=1"  # {name}\ny = "{name}_MORE"\n'
    assert [line for line, piece in _python_pieces(source) if NAMED.search(piece)] == [1, 1]
