"""docs/reference/make-targets.md: the Makefile's targets, each with its `## ` line (what
`make help` prints) and the longer comment above it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from worker.docs_gen.markdown import notice

_TARGET = re.compile(r"^([a-zA-Z0-9_-]+):.*?## (.*)$")


@dataclass(frozen=True)
class Target:
    name: str
    summary: str
    details: str  # the comment lines right above the target, joined; "" without


def targets(makefile: Path) -> list[Target]:
    found = []
    comment: list[str] = []
    for line in makefile.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
            continue
        if m := _TARGET.match(line):
            # Make writes a literal $ as $$.
            details = " ".join(comment).replace("$$", "$")
            found.append(Target(m.group(1), m.group(2).strip().replace("$$", "$"), details))
        comment = []
    return found


def render(makefile: Path) -> str:
    out = [
        notice("the Makefile's comments").rstrip() + "\n",
        "# Make targets\n",
        "`make help` lists them, one line each. Every target that needs the environment "
        "builds it first (`make setup`: idempotent, quick when done).\n",
    ]
    for t in targets(makefile):
        out.append(f"## `make {t.name}`\n")
        out.append(f"{t.summary}.\n")
        if t.details:
            out.append(f"{t.details}\n")
    return "\n".join(out)
