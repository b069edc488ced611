"""The docs' figures come from a benchmark report and say where they come from: the committed
docs/figures.md and every `<!-- figures:NAME -->` block are exactly what the renderer makes of
the committed docs/figures/report.json, and each section names its date, commit, host and
whether the host was quiet."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from measure.bench import figures_page
from measure.bench.figures_page import FIX_COMMAND, PAGE
from worker.tools.harness import provenance

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_REPORT = ROOT / "docs" / "figures" / "report.json"


@pytest.fixture
def report() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(COMMITTED_REPORT.read_text())
    return loaded


def test_the_figures_page_is_what_the_renderer_makes_of_the_committed_report(
    report: dict[str, Any],
) -> None:
    assert PAGE.read_text() == figures_page.render_page(report), (
        f"docs/figures.md differs from docs/figures/report.json; run: {FIX_COMMAND}"
    )
    assert (COMMITTED_REPORT.parent / report["figure"]).is_file()


def test_every_committed_figures_block_matches_the_report(report: dict[str, Any]) -> None:
    for path, text in figures_page.expected_files(report, PAGE, ROOT).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale; run: {FIX_COMMAND}"


def test_every_section_is_headed_by_its_provenance(report: dict[str, Any]) -> None:
    page = figures_page.render_page(report)
    sections = page.split("\n## ")[1:]
    assert len(sections) >= 5
    host = report["host"]
    for section in sections:
        line = section.splitlines()[2]
        assert line.startswith("> Measured "), section[:200]
        assert host["commit"][:10] in line
        assert f"{host['cpu_count']} cores ({host['cpu_model']})" in line
        assert f"torch {host['torch']}" in line
        assert ("quiet host" in line) != ("busy host" in line)


def test_uncommitted_changes_and_unknown_commits_are_said(report: dict[str, Any]) -> None:
    dirty = copy.deepcopy(report)
    dirty["host"].update(commit="0123456789abcdef", commit_dirty=True)
    assert "commit `0123456789` + uncommitted changes;" in figures_page.provenance(dirty)
    clean = copy.deepcopy(report)
    clean["host"].update(commit="0123456789abcdef", commit_dirty=False)
    assert "commit `0123456789`;" in figures_page.provenance(clean)
    outside = copy.deepcopy(report)
    outside["host"].update(commit=None, commit_dirty=None)
    assert "commit unknown" in figures_page.provenance(outside)
    old = copy.deepcopy(report)
    del old["host"]["commit"]
    assert "commit not recorded" in figures_page.provenance(old)


def test_a_busy_host_is_called_busy_and_a_quiet_one_quiet(report: dict[str, Any]) -> None:
    quiet = copy.deepcopy(report)
    quiet["host"].update(cpu_count=16, load_avg_1m_at_start=0.2)
    for run in quiet["runs"]:
        run["cpu_other_processes_pct"] = 3.0
    assert figures_page.quiet_verdict(quiet)[0] is True
    assert "quiet host" in figures_page.provenance(quiet)

    loaded = copy.deepcopy(quiet)
    loaded["host"]["load_avg_1m_at_start"] = 9.0
    assert figures_page.quiet_verdict(loaded)[0] is False

    shared = copy.deepcopy(quiet)
    shared["runs"][0]["cpu_other_processes_pct"] = 80.0
    verdict = figures_page.quiet_verdict(shared)
    assert verdict[0] is False
    assert "80% at most" in verdict[1]
    assert "busy host" in figures_page.provenance(shared)


def test_blocks_are_rewritten_from_the_report(report: dict[str, Any]) -> None:
    text = (
        "intro\n<!-- figures:summary -->\nstale figures\n<!-- /figures:summary -->\n"
        "middle\n<!-- figures:batch -->\n<!-- /figures:batch -->\nend\n"
    )
    out = figures_page.regenerate_blocks(text, report, "docs/figures")
    summary = out.split("<!-- figures:summary -->\n")[1].split("<!-- /figures:summary -->")[0]
    assert "stale figures" not in summary
    assert summary.startswith("> Measured ")
    assert "| image set | model |" in summary
    assert out.startswith("intro\n") and "\nmiddle\n" in out and out.endswith("\nend\n")
    batch = out.split("<!-- figures:batch -->\n")[1].split("<!-- /figures:batch -->")[0]
    assert batch.startswith("> Measured ")
    assert f"{report['batch']['client_cpu_us_per_job']:,}" in batch
    # Rewriting is idempotent.
    assert figures_page.regenerate_blocks(out, report, "docs/figures") == out

    # A report without the batch section (an older one): the batch block stays empty.
    without = copy.deepcopy(report)
    del without["batch"]
    out = figures_page.regenerate_blocks(text, without, "docs/figures")
    assert "<!-- figures:batch -->\n<!-- /figures:batch -->" in out


def test_an_unknown_block_names_the_sections_there_are(report: dict[str, Any]) -> None:
    text = "<!-- figures:sumary -->\n<!-- /figures:sumary -->\n"
    with pytest.raises(ValueError, match=r"no section 'sumary'.*summary"):
        figures_page.regenerate_blocks(text, report, "docs/figures")


def test_the_figure_block_links_the_figure_from_where_it_is(report: dict[str, Any]) -> None:
    text = "<!-- figures:throughput-figure -->\n<!-- /figures:throughput-figure -->\n"
    out = figures_page.regenerate_blocks(text, report, "docs/figures")
    assert f"](docs/figures/{report['figure']})" in out


def test_bench_figures_page_publishes_the_report_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: dict[str, Any]
) -> None:
    # The benchmark itself is tests/measure/test_bench.py's; here a finished run's files stand in
    # for it, so that only what --figures-page does with them is measured.
    from measure.bench import suite as runner

    def finished_run(*_: Any, out_dir: Path, **__: Any) -> dict[str, Any]:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(COMMITTED_REPORT, out_dir / "report.json")
        shutil.copy(COMMITTED_REPORT.parent / report["figure"], out_dir / report["figure"])
        return copy.deepcopy(report)

    monkeypatch.setattr(runner, "run_bench", finished_run)
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("# x\n\n<!-- figures:summary -->\n<!-- /figures:summary -->\n")
    page = root / "docs" / "figures.md"
    from measure.cli import cli

    result = CliRunner().invoke(
        cli,
        ["bench", "--profile", "tiny", "--out", str(tmp_path / "out"), "--figures-page", str(page)],
    )
    assert result.exit_code == 0, result.output
    assert page.read_text() == figures_page.render_page(report)
    assert json.loads((root / "docs" / "figures" / "report.json").read_text()) == report
    assert (root / "docs" / "figures" / report["figure"]).is_file()
    readme = (root / "README.md").read_text()
    assert "> Measured " in readme and "| image set | model |" in readme


def test_the_host_block_names_the_cpu_model_and_the_commit(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Some  CPU @ 2.0GHz\n")
    assert provenance.cpu_model(cpuinfo) == "Some CPU @ 2.0GHz"
    assert provenance.cpu_model(tmp_path / "missing") is None

    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert provenance.source_commit() == {"commit": head, "commit_dirty": bool(status)}
