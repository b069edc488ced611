"""`python -m worker top`: one frame from heartbeats written the way workers write them,
against a real stream and group, and one against a live in-process worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.cli import cli
from worker.observe.observer import heartbeat_key, write_heartbeat
from worker.tools.top.screen import footer, legend_lines


def snapshot(name: str, **changes: Any) -> dict[str, Any]:
    """A heartbeat snapshot with the keys Observer.snapshot() writes."""
    snap: dict[str, Any] = {
        "model": "resnet50",
        "device": "cuda:0 (NVIDIA H200)",
        "batch_size": 64,
        "stream": "gpufeed:jobs",
        "group": "gpufeed",
        "name": name,
        "host": "gpu-1",
        "pid": 42,
        "uptime_s": 120.0,
        "results_ok": 1000,
        "results_error": 0,
        "duplicates": 0,
        "jobs_per_s": 12.5,
        "p50_ms": 41.2,
        "p99_ms": 97.5,
        "batches": 20,
        "batch_fill": 0.75,
        "gpu_ms_per_batch": 18.0,
        "in_flight": 7,
        "stage_ms": {
            "redis_wait": 1.5,
            "queue": 0.4,
            "decode": 5.1,
            "batch_wait": 2.0,
            "compute": 18.0,
            "write": 0.9,
        },
        "errors_by_code": {},
        "gpu_util_pct": 87.0,
        "mem_bw_util_pct": 30.0,
        "mem_used_mib": 2048.0,
        "process_cpu_pct": 150.0,
        "system_cpu_pct": 40.0,
        "stream_lag": 7,
    }
    snap.update(changes)
    return snap


def top_once(redis_url: str, *extra: str) -> str:
    where = ["--redis-url", redis_url, "--stream", "gpufeed:jobs", "--group", "gpufeed"]
    result = CliRunner().invoke(cli, ["top", "--once", *where, *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def test_top_shows_every_worker_of_the_group(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A real stream and group: 10 entries, 3 delivered and not yet answered.
    for i in range(10):
        redis_client.xadd("gpufeed:jobs", {"id": f"j{i}", "image": b"x"})
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0")
    redis_client.xreadgroup("gpufeed", "gpu-1-42", {"gpufeed:jobs": ">"}, count=3)

    client = aioredis.from_url(redis_url)
    try:
        await write_heartbeat(client, heartbeat_key("gpu-1-42"), snapshot("gpu-1-42"), ttl_s=30)
        second = snapshot(
            "gpu-2-43",
            jobs_per_s=25.0,
            p50_ms=12.0,
            p99_ms=30.25,
            results_ok=2000,
            results_error=2,
            errors_by_code={"decode_error": 2},
            gpu_util_pct=None,
            process_cpu_pct=95.0,
            batch_fill=1.0,
        )
        await write_heartbeat(client, heartbeat_key("gpu-2-43"), second, ttl_s=30)
        elsewhere = snapshot("other-9", stream="other:jobs", group="other")
        await write_heartbeat(client, heartbeat_key("other-9"), elsewhere, ttl_s=30)
    finally:
        await client.aclose()

    out = await asyncio.to_thread(top_once, redis_url)
    head = out.splitlines()[0]
    assert "stream gpufeed:jobs: length 10" in head
    assert "group gpufeed: lag 7, pending 3" in head
    assert "consumers 1" in head and "workers 2" in head
    assert "37.5 jobs/s" in head  # 12.5 + 25.0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "gpu-" in line}
    # worker, device (3 words), jobs/s, ok, errors, p50, p99, a column per stage (no fetch:
    # nothing was fetched), GPU, CPU, fill, in flight
    heads = next(line for line in out.splitlines() if line.split()[:1] == ["worker"]).split()
    stage_heads = ["redis_wait", "queue", "decode", "model_wait", "compute", "write"]
    assert heads[heads.index("p99") + 2 : heads.index("GPU")] == stage_heads
    stages = ["1.5", "0.4", "5.1", "2.0", "18.0", "0.9"]
    first = ["12.5", "1,000", "0", "41.2", "97.5", *stages, "87%", "150%", "75%", "7"]
    assert rows["gpu-1-42"] == ["gpu-1-42", "cuda:0", "(NVIDIA", "H200)", *first]
    second = ["25.0", "2,000", "2", "12.0", "30.2", *stages, "-", "95%", "100%", "7"]
    assert rows["gpu-2-43"][4:] == second
    # The legend says what the stages measure, from the text /metrics' HELP gives.
    assert "model_wait sealed batch waiting to run | faster step, not GPUFEED_MAX_WAIT_MS" in out
    assert "errors by code: decode_error 2" in out
    assert "other-9" not in out  # another group's worker


def test_top_says_unknown_lag_and_no_group(redis_url: str, redis_client: redis.Redis) -> None:
    out = top_once(redis_url)
    assert "length no such stream" in out and "group gpufeed: none yet" in out
    assert "no live worker on this stream and group" in out
    # After a deletion Redis cannot compute the lag: "unknown", never 0.
    ids = [redis_client.xadd("gpufeed:jobs", {"image": b"x"}) for _ in range(3)]
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0")
    redis_client.xdel("gpufeed:jobs", ids[1])
    assert "lag unknown" in top_once(redis_url)


def test_top_says_how_to_quit(redis_url: str) -> None:
    once = top_once(redis_url)
    assert "one frame; without --once it refreshes until q or Ctrl+C quits" in once
    live = footer({"workers": []}, interval_s=2.0).plain
    assert "refreshes every 2 s; l hides the legend; q or Ctrl+C quits" in live
    assert "--once" not in live


def test_top_exits_3_without_redis() -> None:
    result = CliRunner().invoke(cli, ["top", "--once", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 3
    assert "cannot reach Redis" in result.output


async def test_top_against_a_live_worker(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, worker_name="top-live"):
        for i in range(12):
            redis_client.xadd("gpufeed:jobs", {"id": f"t{i}", "image": jpeg_bytes(seed=i)})
        redis_client.xadd("gpufeed:jobs", {"id": "bad", "image": b"not an image"})
        await wait_results(redis_client, "gpufeed:results", 13)
        await asyncio.sleep(2.5)  # one heartbeat
        out = await asyncio.to_thread(top_once, redis_url)
    row = next(line for line in out.splitlines() if "top-live" in line).split()
    assert row[:2] == ["top-live", "cpu"]
    assert row[3:5] == ["12", "1"]  # ok, errors
    assert "errors by code: unsupported_format 1" in out
    assert "lag 0, pending 0" in out.splitlines()[0]


def test_the_docs_show_the_legend_top_prints() -> None:
    # docs/operations.md shows the legend's own text, not a paraphrase that may drift.
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for line in legend_lines():
        assert line in page, line
