"""`python -m producer submit --urls FILE --wait` at 80 columns against a real worker: the ids
fit (the tail of each URL, never cut), duplicates and cached answers are marked."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.cli import shown_ids
from tests.support.cli_runner import run_module
from tests.support.http_images import ImageServer
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

NAMES = ("holiday-beach.jpg", "holiday-hills.jpg")


@pytest.fixture
def image_server() -> Iterator[ImageServer]:
    server = ImageServer().start()
    for i, name in enumerate(NAMES):
        server.images[name] = jpeg_bytes(96, 72, seed=i)
    yield server
    server.stop()


def submit(redis_url: str, url_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_module(
        "producer",
        "submit",
        "--urls",
        str(url_file),
        "--wait",
        "--timeout",
        "60",
        "--redis-url",
        redis_url,
        *extra,
        env={"COLUMNS": "80"},
        timeout=90,
    )


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by shown id (the first cell), cells split on the box's bars."""
    found = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0].startswith("…/") and not cells[0].endswith(":"):  # not a note
            found[cells[0]] = cells
    return found


async def test_url_ids_fit_and_duplicates_and_cached_answers_are_marked(
    redis_url: str, tmp_path: Path, tiny_weights: Path, image_server: ImageServer
) -> None:
    url_file = tmp_path / "urls.txt"
    urls = [image_server.url(f"/img/{name}") for name in NAMES]
    url_file.write_text("\n".join(urls) + "\n")
    async with running_worker(redis_url, tiny_weights, model="null", url_allow="127.0.0.1"):
        first = await asyncio.to_thread(submit, redis_url, url_file)
        again = await asyncio.to_thread(submit, redis_url, url_file)
        other_ids = await asyncio.to_thread(submit, redis_url, url_file, "--id-prefix", "x-")
    assert first.returncode == 0, first.stderr
    shown = rows(first.stdout)
    assert set(shown) == {f"…/{name}" for name in NAMES}, first.stdout
    assert all(cells[1] == "ok" for cells in shown.values())
    assert "http://127.0.0.1" not in first.stdout
    assert "mark" not in first.stdout  # nothing to mark: no column
    assert "…/name: the tail of the job's URL (--json gives whole ids)" in first.stdout
    # The same ids again: each answered by its earlier result, and marked so.
    assert again.returncode == 0, again.stderr
    assert all(cells[-1].startswith("dup") for cells in rows(again.stdout).values()), again.stdout
    assert "dup: the id had a result already" in again.stdout
    # New ids, the same images: fetched conditionally, taken from the decode cache.
    assert other_ids.returncode == 0, other_ids.stderr
    assert all(cells[-1] == "cached" for cells in rows(other_ids.stdout).values()), other_ids.stdout
    for out in (first.stdout, again.stdout, other_ids.stdout):
        assert "…" not in out.replace("…/", "")  # no cell cut


def test_shown_ids_take_as_many_folders_as_tell_them_apart() -> None:
    ids = [
        "https://cdn.example.com/a/2024/img.jpg",
        "https://cdn.example.com/b/2024/img.jpg",
        "https://cdn.example.com/c/other.jpg",
        "photo.jpg",
        "https://cdn.example.com/",
    ]
    assert shown_ids(ids) == [
        "…/a/2024/img.jpg",
        "…/b/2024/img.jpg",
        "…/other.jpg",
        "photo.jpg",
        "https://cdn.example.com/",
    ]
