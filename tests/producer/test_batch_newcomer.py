"""`producer batch` as a newcomer meets it: files it does not read are counted and named,
a source with nothing to run is an error, rows answered as repeats are counted and
explained, a lost Redis says how to go on, a log without a terminal gets progress lines,
and getting-started followed word for word gives no surprise row."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rich.console import Console

from producer import Producer
from producer.batch_runner import BatchOptions, Progress, run_batch
from producer.batch_view import BatchView
from tests.project.test_readme_commands import GETTING_STARTED, readme_blocks
from tests.support.cli_runner import ROOT, clean_env, run_module
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import running_worker

pq = pytest.importorskip("pyarrow.parquet")

NULL = {"model": "null", "input_size": 64, "batch_size": 8, "max_wait_ms": 5.0}


def tiff_bytes(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 12), (seed, 40, 90)).save(buf, "TIFF")
    return buf.getvalue()


def batch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("producer", "batch", *args)


def test_a_folder_of_only_tiffs_exits_2_naming_them_and_writes_nothing(tmp_path: Path) -> None:
    scans = tmp_path / "scans"
    scans.mkdir()
    for n in range(3):
        (scans / f"page{n}.tif").write_bytes(tiff_bytes(n))
    out = tmp_path / "scans.parquet"
    # No Redis behind this URL: the source is judged before anything is reached.
    done = batch(str(scans), "--out", str(out), "--redis-url", "redis://127.0.0.1:1/0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: nothing to run: {scans} has no image batch reads")
    assert ".tif 3; e.g. page0.tif, page1.tif, page2.tif" in lines[0]
    assert not out.exists()


async def test_passed_over_files_and_duplicate_rows_are_counted_and_explained(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    for n in range(4):
        (photos / f"{n}.jpg").write_bytes(jpeg_bytes(24, 16, seed=n, quality=70))
    (photos / "scan.tif").write_bytes(tiff_bytes(1))
    (photos / "sub" / "scan2.TIFF").write_bytes(tiff_bytes(2))
    (photos / "notes.txt").write_text("not an image")
    first, second, third = (tmp_path / f"{n}.parquet" for n in ("first", "second", "third"))
    async with running_worker(redis_url, tiny_weights, **NULL):
        once = await asyncio.to_thread(run_library, redis_url, photos, first)
        # The same folder into a new output: the ids (file names) were answered above.
        again = await asyncio.to_thread(
            batch, str(photos), "--out", str(second), "--redis-url", redis_url
        )
        fresh = await asyncio.to_thread(
            batch, str(photos), "--out", str(third), "--redis-url", redis_url,
            "--id-prefix", "run2/", "--json",
        )  # fmt: skip

    assert (once.ok, once.duplicates, once.not_images.count) == (4, 0, 3)

    assert again.returncode == 0, again.stderr
    assert "passed over (not an image name)" in again.stdout
    assert "duplicate_of (id answered before)" in again.stdout
    rows = pq.read_table(second).to_pylist()
    assert len(rows) == 4 and all(r["duplicate_of"] for r in rows)
    (note,) = [line for line in again.stderr.splitlines() if "duplicate_of" in line]
    assert note.startswith("note: 4 row(s) of this run are marked duplicate_of")
    assert "GPUFEED_RESULT_TTL_S" in note and note.endswith("(--id-prefix run2/)")

    assert fresh.returncode == 0, fresh.stderr
    done = json.loads(fresh.stdout.splitlines()[-1])["summary"]
    assert (done["ok"], done["duplicates"], done["not_images"]) == (4, 0, 3)
    assert done["not_images_by_extension"] == {".tif": 1, ".tiff": 1, ".txt": 1}
    assert set(done["not_image_files"]) == {"scan.tif", "notes.txt", "sub/scan2.TIFF"}
    assert "note: 3 file(s) passed over, not an image name batch reads" in fresh.stderr
    rows = pq.read_table(third).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"run2/{n}.jpg" for n in range(4)]
    assert not any(r["duplicate_of"] for r in rows)


def run_library(redis_url: str, folder: Path, out: Path) -> Progress:
    with Producer(redis_url) as producer:
        return run_batch(str(folder), out, producer, BatchOptions())


def test_redis_lost_mid_run_ends_with_how_to_go_on(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for n in range(12):
        (folder / f"{n:02d}.jpg").write_bytes(jpeg_bytes(16, 12, seed=n, quality=60))
    server = RedisServer(tmp_path / "redis").start()
    command = [
        sys.executable, "-m", "producer", "batch", str(folder), "--out",
        str(tmp_path / "o.jsonl"), "--redis-url", server.url, "--in-flight", "4",
    ]  # fmt: skip
    try:
        # No worker: four jobs wait in the stream when Redis goes away.
        proc = subprocess.Popen(
            command, cwd=ROOT, env=clean_env(), stderr=subprocess.PIPE, text=True
        )
        client = redis.Redis.from_url(server.url)
        deadline = time.monotonic() + 30
        try:
            while client.xlen("gpufeed:jobs") < 4:
                assert time.monotonic() < deadline and proc.poll() is None, "no jobs came"
                time.sleep(0.02)
        finally:
            client.close()
        server.kill()
        _, stderr = proc.communicate(timeout=60)
    finally:
        server.stop()
    assert proc.returncode == 3, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: cannot reach Redis at ")
    assert line.endswith(
        "the output keeps the rows written so far: run the same command again once Redis is back"
    )


def test_without_a_terminal_progress_is_a_plain_line_on_stderr() -> None:
    log = io.StringIO()
    view = BatchView(Console(file=log, force_terminal=False), json_lines=False, plain_every_s=0)
    p = Progress(source="photos", output="o.parquet", total=10, done_before=0)
    p.ok, p.errors, p.in_flight = 6, 1, 3
    with view as on_progress:
        on_progress(p)
    assert log.getvalue().startswith("batch: 7/10 answered, ok 6, errors 1, skipped 0, ")
    # On a terminal the bar says it; with --json the JSON lines do.
    for terminal, json_lines in ((True, False), (False, True)):
        other = io.StringIO()
        console = Console(file=other, force_terminal=terminal)
        with BatchView(console, json_lines=json_lines, plain_every_s=0) as on_progress:
            on_progress(p)
        assert "answered" not in other.getvalue()


async def test_getting_started_followed_word_for_word_gives_no_duplicate_row(
    redis_url: str, tiny_weights: Path, tmp_path: Path
) -> None:
    """The page's photos, its `submit`, then its batch through a worker: no row of the
    batch answers as a repeat of the submitted job. A null-model worker stands in for the
    page's (the model is not what this is about); the --local runs have Redis of their own."""
    wanted = [
        b.body
        for b in readme_blocks(GETTING_STARTED)
        if b.lang == "sh"
        and not b.marker
        and "--local" not in b.body
        and any(s in b.body for s in ("Image.new", "producer submit", "producer batch"))
    ]
    assert len(wanted) == 3 and "producer submit" in wanted[1], wanted
    venv_bin = Path(sys.executable).parent
    env = clean_env(
        REDIS_URL=redis_url,
        PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
    )
    work = tmp_path / "work"
    work.mkdir()
    async with running_worker(redis_url, tiny_weights, **NULL):
        for body in wanted:
            done = await asyncio.to_thread(
                subprocess.run, ["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env,
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode == 0, f"{body}\n{done.stderr}"
    rows = pq.read_table(work / "served.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == ["navy.jpg", "orange.jpg", "teal.jpg"]
    assert [r["id"] for r in rows if r["duplicate_of"]] == []
    assert "duplicate_of" not in done.stderr
