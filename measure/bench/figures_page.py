"""The docs' figures, written from a benchmark report, each saying where it comes from.

`python -m measure bench --figures-page docs/figures.md` (`make docs-figures`) keeps the
report it measured as docs/figures/report.json (its throughput figure beside it), writes
docs/figures.md from it, and rewrites every marked block

    <!-- figures:NAME -->
    ...
    <!-- /figures:NAME -->

of README.md and the pages under docs/ with the report's section NAME (`summary`,
`overhead`, `stage-rates`, `targets`, `batch`, `throughput-figure`, ...: the slug of the
section's heading in report.md, or of its first words). Every section starts with its
provenance: when, which commit, on what host, and whether the host was quiet.

`python -m measure.bench.figures_page [--check]` does the same from the committed
report without running the benchmark (after a change to this renderer), or checks that the
committed page and blocks are what it would write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from measure.bench.report import render_markdown

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "figures.md"
FIX_COMMAND = "python -m measure.bench.figures_page"
FIGURE = "throughput-figure"

# The host counts as quiet when, at the start, its load average was under half its cores
# and, during every run, all other processes together took under this much of one core.
QUIET_OTHER_PCT = 25.0

_BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)",
    re.S,
)


def assets_dir(page: Path) -> Path:
    """docs/figures.md keeps its report and figure in docs/figures/."""
    return page.with_suffix("")


# --------------------------------------------------------------------------- provenance
def quiet_verdict(report: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the host was quiet while measured, and the figures that say so."""
    host = report["host"]
    cores = int(host["cpu_count"])
    load = float(host["load_avg_1m_at_start"])
    others = [
        float(r["cpu_other_processes_pct"])
        for r in report.get("runs", [])
        if isinstance(r.get("cpu_other_processes_pct"), int | float)
    ]
    worst = max(others, default=0.0)
    quiet = load < 0.5 * cores and worst < QUIET_OTHER_PCT
    detail = f"load average {load:g} on {cores} cores at the start"
    if others:
        detail += (
            f"; other processes took {statistics.median(others):.0f}% of one core during a run "
            f"(median), {worst:.0f}% at most"
        )
    if quiet:
        return True, f"quiet host ({detail})"
    return False, f"busy host ({detail}): the figures may be low and noisy"


def _commit(host: Mapping[str, Any]) -> str:
    if "commit" not in host:
        return "commit not recorded"
    if host["commit"] is None:
        return "commit unknown (not measured from a git checkout)"
    dirty = " + uncommitted changes" if host.get("commit_dirty") else ""
    return f"commit `{str(host['commit'])[:10]}`{dirty}"


def _date(created_at: str) -> str:
    try:
        return datetime.strptime(created_at, "%Y-%m-%dT%H:%M:%S%z").strftime("%Y-%m-%d %H:%M %z")
    except ValueError:
        return created_at


def provenance(report: Mapping[str, Any]) -> str:
    """One line: when, what code, on what host, and whether it was quiet."""
    host = report["host"]
    cpu = host.get("cpu_model") or "CPU model not recorded"
    gpu = host.get("gpu") or "no GPU"
    _, quiet = quiet_verdict(report)
    return (
        f"> Measured {_date(str(report['created_at']))}, {report['profile']} profile, "
        f"{_commit(host)}; {host['cpu_count']} cores ({cpu}), {gpu}, device {host['device']}, "
        f"torch {host['torch']}; {quiet}."
    )


# --------------------------------------------------------------------------- sections
def slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def _tidy(lines: list[str]) -> list[str]:
    # Markdown starts a list only after a blank line: report.md writes "Notes:" then "- ...".
    out: list[str] = []
    for line in lines:
        if line.startswith("- ") and out and out[-1] and not out[-1].startswith("- "):
            out.append("")
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    while out and not out[0].strip():
        out.pop(0)
    return out


def sections(report: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(slug, heading, body) of each section of report.md, then the throughput figure."""
    heading: str | None = None
    body: list[str] = []
    seen: set[str] = set()
    for line in render_markdown(report).splitlines():
        if line.startswith("## "):
            if heading is not None:
                seen.add(slug(heading))
                yield slug(heading), heading, "\n".join(_tidy(body))
            heading, body = line[3:].strip(), []
        elif heading is not None:
            body.append(line)
    if heading is not None:
        seen.add(slug(heading))
        yield slug(heading), heading, "\n".join(_tidy(body))
    if report.get("figure"):
        yield FIGURE, "Throughput over time, and where each image's time went", ""


def _figure(report: Mapping[str, Any], figures_dir: str) -> str:
    return (
        f"![Throughput over time per run, and the per-image stage breakdown]"
        f"({figures_dir}/{report['figure']})"
    )


def block(report: Mapping[str, Any], name: str, figures_dir: str) -> str:
    """Section `name` of the report, without its heading, under its provenance line."""
    for key, _, body in sections(report):
        if key == name or key.startswith(name + "-"):
            text = _figure(report, figures_dir) if key == FIGURE else body
            return f"{provenance(report)}\n\n{text}\n"
    if name == "batch":
        return ""  # the report has no batch figures (yet): an empty block
    known = ", ".join(sorted({key for key, _, _ in sections(report)}))
    raise ValueError(f"the report has no section {name!r}; it has: {known}")


def render_page(report: Mapping[str, Any]) -> str:
    """docs/figures.md: every section of the report, each under its provenance."""
    out = [
        f"<!-- Written by `{FIX_COMMAND}` (and `make docs-figures`) from "
        "docs/figures/report.json: do not edit. -->",
        "",
        "# Figures",
        "",
        f"What the benchmark (`make bench`) measured, as it reported it: the {report['profile']} "
        "profile, [its report](figures/report.json) ([schema](bench-schema.md)). Each section "
        "starts with where its figures come from; on a busy host they are low and noisy. "
        "`make docs-figures` measures them again.",
    ]
    for key, heading, body in sections(report):
        text = _figure(report, "figures") if key == FIGURE else body
        out += ["", f"## {heading}", "", provenance(report)]
        if text:
            out += ["", text]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- files
def regenerate_blocks(text: str, report: Mapping[str, Any], figures_dir: str) -> str:
    """`text` with every figures block rewritten from `report`."""
    return _BLOCK.sub(
        lambda m: m.group(1) + block(report, m.group("name"), figures_dir) + m.group(4), text
    )


def block_files(root: Path) -> list[Path]:
    """README.md and the docs pages that hold a figures block."""
    candidates = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in candidates if p.is_file() and "<!-- figures:" in p.read_text("utf-8")]


def expected_files(report: Mapping[str, Any], page: Path, root: Path) -> dict[Path, str]:
    """What the page and every file with figures blocks should hold."""
    files = {page: render_page(report)}
    figures = assets_dir(page)
    for path in block_files(root):
        if path == page:
            continue
        rel = Path(os.path.relpath(figures, path.parent)).as_posix()
        files[path] = regenerate_blocks(path.read_text("utf-8"), report, rel)
    return files


def publish(out_dir: Path, page: Path, root: Path | None = None) -> list[Path]:
    """Keep `out_dir`'s report (and figure) beside `page`, write `page` and the figures
    blocks from it; return the files written."""
    root = root or page.resolve().parent.parent
    figures = assets_dir(page)
    figures.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "report.json", figures / "report.json")
    report = json.loads((figures / "report.json").read_text())
    if report.get("figure"):
        shutil.copyfile(out_dir / report["figure"], figures / report["figure"])
    return write(report, page, root)


def write(report: Mapping[str, Any], page: Path, root: Path) -> list[Path]:
    written = []
    for path, text in expected_files(report, page, root).items():
        if not path.is_file() or path.read_text("utf-8") != text:
            path.write_text(text, "utf-8")
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(f"usage: {FIX_COMMAND} [--check]", file=sys.stderr)
        return 2
    report = json.loads((assets_dir(PAGE) / "report.json").read_text())
    if argv == ["--check"]:
        stale = [
            path
            for path, text in expected_files(report, PAGE, ROOT).items()
            if not path.is_file() or path.read_text("utf-8") != text
        ]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date; run: {FIX_COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in write(report, PAGE, ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
