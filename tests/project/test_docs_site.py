"""The documentation site builds with `mkdocs build --strict` (as `make docs` does): a broken
link or anchor, a page missing from the nav or a docstring the API page cannot render fails
the suite, not only the next person to build the site."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed (make setup installs it)")
pytest.importorskip("material", reason="the docs extra is not installed (make setup installs it)")

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "producer-api" / "index.html").read_text()
    # mkdocstrings rendered the producer's docstrings, not only the page's headings.
    assert "submit_url" in api
    assert "wait_one" in api


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    # A copy of the site's sources, one page given a link to a page that does not exist.
    for name in ("docs", "producer"):
        shutil.copytree(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    reference = tmp_path / "docs" / "reference" / "producer-api.md"
    reference.write_text(reference.read_text() + "\nSee [the old page](no-such-page.md).\n")
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr
