"""`python -m producer batch s3://bucket/prefix/`: a prefix listed page by page from
moto's S3 server, a real null-model worker and redis-server; the client SIGKILLed at about
40% and run again: every id once, all ok but the broken ones."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Producer, collect_stats
from producer.batch_runner import BatchOptions, Progress, default_in_flight, run_batch
from tests.fetch.test_fetch import put_objects, s3_endpoint
from tests.support.cli_runner import ROOT, clean_env
from tests.support.images import jpeg_bytes
from tests.support.process_harness import (
    FAST_RECLAIM_ENV,
    merged,
    pending_of,
    start_workers,
    stop_all,
)
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import running_worker
from worker.config.settings import WorkerConfig

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

__all__ = ["s3_endpoint"]  # the fixture, shared with the fetch tests

# Over S3's 1,000 keys a listing page: the prefix is listed in two pages.
IMAGES = 1050
BROKEN = {f"shots/broken-{i}.jpg" for i in range(4)}
BUCKET = "catalogue"
NULL = {"model": "null", "input_size": 64, "batch_size": 32, "max_wait_ms": 5.0}


def allow_bucket() -> dict[str, Any]:
    """GPUFEED_OBJECT_ALLOW where this worker knows it (the buckets it may read)."""
    if "object_allow" in {f.name for f in fields(WorkerConfig)}:
        return {"object_allow": BUCKET}
    return {}


def fill_bucket(endpoint: str) -> set[str]:
    image = jpeg_bytes(16, 12, seed=3, quality=60)
    objects = {f"shots/{n // 100:02d}/{n:05d}.jpg": image for n in range(IMAGES)}
    objects.update(dict.fromkeys(BROKEN, b"\xff\xd8 broken " * 8))
    objects["shots/manifest.json"] = b"{}"  # not an image: not a job
    objects["elsewhere/x.jpg"] = image  # outside the prefix
    put_objects(endpoint, BUCKET, objects)
    return {k.removeprefix("shots/") for k in objects if k.startswith("shots/")} - {"manifest.json"}


def committed_rows(out: Path) -> int:
    """Rows in the committed segments: each is a complete Parquet file at any moment."""
    parts = out.with_name(out.name + ".parts")
    files = [p for p in parts.glob("*.parquet")] if parts.is_dir() else []
    return sum(pq.ParquetFile(p).metadata.num_rows for p in files)


def batch_command(redis_url: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "producer", "batch", f"s3://{BUCKET}/shots/",
        "--out", str(out), "--redis-url", redis_url,
        "--in-flight", "64", "--checkpoint", "0.2", "--json",
    ]  # fmt: skip


def kill_at(redis_url: str, out: Path, share: float, total: int) -> int:
    proc = subprocess.Popen(
        batch_command(redis_url, out),
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    try:
        while committed_rows(out) < share * total:
            if proc.poll() is not None:
                raise AssertionError(
                    f"batch ended early: {proc.stderr.read() if proc.stderr else ''}"
                )
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr is not None:
            proc.stderr.close()
    return committed_rows(out)


def run_to_end(redis_url: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        batch_command(redis_url, out),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


async def test_a_killed_batch_over_a_prefix_resumes_and_every_id_is_there_once(
    redis_url: str, tiny_weights: Path, tmp_path: Path, s3_endpoint: str
) -> None:
    ids = await asyncio.to_thread(fill_bucket, s3_endpoint)
    out = tmp_path / "catalogue.parquet"
    async with running_worker(redis_url, tiny_weights, **NULL, **allow_bucket()):
        kept = await asyncio.to_thread(kill_at, redis_url, out, 0.4, len(ids))
        assert 0 < kept < len(ids)
        assert not out.exists()  # no final file until every id is done
        second = await asyncio.to_thread(run_to_end, redis_url, out)

    assert second.returncode == 1, second.stderr  # the broken images are error rows
    assert f"4 row(s) of {out} are errors (4 from this run)" in second.stderr
    summary = json.loads(second.stdout.splitlines()[-1])["summary"]
    assert summary["in_output"]["ok"] == len(ids) - 4 and summary["in_output"]["errors"] == 4
    assert summary["done_before"] == kept
    assert summary["submitted"] <= len(ids) - kept  # only what the output lacked
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert Counter(r["id"] for r in rows) == Counter(ids)  # every id exactly once
    errors = {r["id"] for r in rows if r["status"] != "ok"}
    assert errors == {b.removeprefix("shots/") for b in BROKEN}
    sample = next(r for r in rows if r["id"] == "03/00300.jpg")
    assert sample["source"] == f"s3://{BUCKET}/shots/03/00300.jpg" and sample["model"] == "null"


def test_a_worker_killed_mid_run_costs_nothing_and_the_in_flight_default_follows_the_workers(
    redis_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for n in range(300):
        (folder / f"{n:04d}.jpg").write_bytes(jpeg_bytes(16, 12, seed=n, quality=60))
    client = redis.Redis.from_url(redis_url)
    workers = start_workers(
        ["w1", "w2"],
        redis_url,
        "none",
        tmp_path / "logs",
        GPUFEED_MODEL="null",
        GPUFEED_BATCH_SIZE="8",
        **merged(FAST_RECLAIM_ENV, {"GPUFEED_TUNING": "stats_interval_s=0.5"}),
    )
    try:
        with Producer(redis_url) as producer:
            # Each live worker's heartbeat says its batch size: twice their sum.
            until(lambda: len(collect_stats(client)["workers"]) == 2)
            assert default_in_flight(producer, "gpufeed:jobs") == 2 * (8 + 8)
        done: list[Progress] = []
        thread = threading.Thread(
            target=lambda: done.append(run_library(redis_url, folder, tmp_path / "o.parquet"))
        )
        thread.start()
        until(lambda: pending_of(client, "w1") > 0, timeout_s=60)
        workers[0].kill()  # holding jobs it read and did not answer
        thread.join(120)
        assert not thread.is_alive()
    finally:
        stop_all(workers, timeout_s=10)
        client.close()
    (progress,) = done
    assert (progress.ok, progress.errors) == (300, 0)
    rows = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert Counter(r["id"] for r in rows) == Counter(f"{n:04d}.jpg" for n in range(300))


def run_library(redis_url: str, folder: Path, out: Path) -> Progress:
    with Producer(redis_url) as producer:
        return run_batch(str(folder), out, producer, BatchOptions(in_flight=32))


def until(check: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


async def test_redis_lost_mid_run_exits_3_and_the_same_command_finishes_the_job(
    tmp_path: Path, tiny_weights: Path
) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for n in range(20):
        (folder / f"{n:02d}.jpg").write_bytes(jpeg_bytes(16, 12, seed=n, quality=60))
    server = RedisServer(tmp_path / "redis").start()
    out = tmp_path / "o.jsonl"
    command = [
        sys.executable, "-m", "producer", "batch", str(folder), "--out", str(out),
        "--redis-url", server.url, "--in-flight", "8",
    ]  # fmt: skip
    try:
        # No worker: eight jobs wait in the stream when Redis goes away.
        proc = await asyncio.to_thread(
            subprocess.Popen, command, cwd=ROOT, env=clean_env(), stderr=subprocess.PIPE, text=True
        )
        client = redis.Redis.from_url(server.url)
        await asyncio.to_thread(until, lambda: client.xlen("gpufeed:jobs") == 8)
        client.close()
        server.kill()
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 3, stderr
        assert "cannot reach Redis" in stderr and "Traceback" not in stderr
        server.start()  # empty: what was queued is gone, the output is the record
        async with running_worker(server.url, tiny_weights, **NULL):
            again = await asyncio.to_thread(
                subprocess.run, command, cwd=ROOT, env=clean_env(), capture_output=True,
                text=True, timeout=120,
            )  # fmt: skip
    finally:
        server.stop()
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert Counter(ids) == Counter(f"{n:02d}.jpg" for n in range(20))
