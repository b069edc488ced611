"""Metrics move under load, health endpoints answer, the heartbeat shows the worker."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import redis

from tests.support.images import jpeg_bytes
from tests.support.redis_server import free_port
from tests.support.worker_harness import running_worker, wait_results


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


@pytest.mark.slow
async def test_metrics_health_and_heartbeat_under_load(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with running_worker(
        redis_url, tiny_weights, metrics_port=port, worker_name="obs-1", batch_size=4
    ):
        assert await asyncio.to_thread(get, f"{base}/live") == (200, "live\n")
        assert (await asyncio.to_thread(get, f"{base}/ready"))[0] == 200
        status, before = await asyncio.to_thread(get, f"{base}/metrics")
        assert status == 200 and metric(before, "gpufeed_ready") == 1.0

        for i in range(30):
            redis_client.xadd("gpufeed:jobs", {"id": f"o{i}", "image": jpeg_bytes(seed=i)})
        redis_client.xadd("gpufeed:jobs", {"id": "bad", "image": b"not an image"})
        await wait_results(redis_client, "gpufeed:results", 31)
        await asyncio.sleep(2.5)  # one heartbeat
        _, after = await asyncio.to_thread(get, f"{base}/metrics")
        hb = redis_client.hgetall("gpufeed:worker:obs-1")
        assert redis_client.ttl("gpufeed:worker:obs-1") > 0

    assert metric(after, "gpufeed_results_total", code="", status="ok") == 30
    assert metric(after, "gpufeed_results_total", code="unsupported_format", status="error") == 1
    # 30 images at up to 4 per batch, each batch run on shape 1, 2 or 4 (auto for B = 4):
    # the rows run are the shapes', padding included.
    by_size = {s: metric(after, "gpufeed_batches_total", size=str(s)) for s in (1, 2, 4)}
    assert sum(by_size.values()) >= 8
    real = metric(after, "gpufeed_batch_rows_total", kind="real")
    padding = metric(after, "gpufeed_batch_rows_total", kind="padding")
    assert real == 30 and real + padding == sum(s * n for s, n in by_size.items())
    for stage in ("decode", "queue", "batch_wait", "compute", "redis_wait"):
        assert metric(after, "gpufeed_stage_seconds_count", stage=stage) >= 30, stage
    assert metric(after, "gpufeed_job_seconds_count") == 31
    assert metric(after, "gpufeed_queue_depth", queue="jobs") == 0
    assert metric(after, "gpufeed_stream_lag") == 0
    assert metric(after, "gpufeed_stream_pending") == 0
    # What the worker serves, so two deployments' series cannot be confused.
    info = [line for line in after.splitlines() if line.startswith("gpufeed_worker_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0")
    for label in ('model="mobilenet_v3_small"', 'worker="obs-1"', 'device="cpu"', "weights="):
        assert label in info[0], label

    # The heartbeat: plain fields for redis-cli, and the full snapshot.
    assert hb[b"name"] == b"obs-1" and hb[b"model"] == b"mobilenet_v3_small"
    assert int(hb[b"results_ok"]) == 30 and int(hb[b"results_error"]) == 1
    snap = msgpack.unpackb(hb[b"snapshot"])
    assert snap["errors_by_code"] == {"unsupported_format": 1}
    assert snap["p50_ms"] > 0 and snap["p99_ms"] >= snap["p50_ms"]
    assert 0 < snap["batch_fill"] <= 1
    assert set(snap["stage_ms"]) >= {"decode", "compute"}
    # A clean stop removes the heartbeat at once.
    assert not redis_client.exists("gpufeed:worker:obs-1")


async def test_ready_is_503_until_the_worker_reads(redis_url: str, tiny_weights: Path) -> None:
    from tests.support.worker_harness import tiny_config
    from worker.lifecycle.service import Worker

    port = free_port()
    worker = Worker(tiny_config(redis_url, tiny_weights, metrics_port=port))
    worker.observer.serve_http(port, worker.health)
    try:
        assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/live"))[0] == 200
        code, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/ready")
        assert (code, body) == (503, "warming up\n")
    finally:
        worker.observer.close()
