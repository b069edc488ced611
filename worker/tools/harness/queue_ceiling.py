"""The queue ceiling: how many jobs/s Redis and the client allow for gpufeed's own Redis work,
with nothing else in the way (no decode, no model, no batcher).

A minimal consumer on its own streams: XREADGROUP COUNT = batch, each entry parsed into a
Job as the reader does (worker/jobs.py), then the writer's own publish (worker/delivery/writer.py
ResultWriter.publish: one PUBLISH_RESULTS script call per batch, worker/delivery/redis_scripts.py,
carrying the fields the writer sends, a classify answer): for each job XACK, XADD to the
reply stream, HSET and EXPIRE of the result hash, all with the worker's key layout. The
jobs are queued before the timed window, as in the benchmark's runs.

It is the third isolated stage beside the model (direct-feed) and decode ceilings: a worker
can go no faster than this on the same Redis and the same host, and the ratio of a worker's
rate to it says how much the worker itself costs per job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer import wire
from worker.delivery.redis_scripts import PUBLISH_RESULTS
from worker.delivery.writer import PublishState, ResultWriter, WriterSettings
from worker.jobs import Outcome, parse_job
from worker.model.answers import Classification

_GROUP = "gpufeed-queue-ceiling"
_PUSH_CHUNK = 512
_TIMINGS = dict.fromkeys(
    ("redis_wait", "queue", "decode", "batch_wait", "compute", "total", "write"), 0.0
)


@dataclass(frozen=True)
class QueueKeys:
    """A private set of keys under `base` (one hash tag with it in Redis Cluster)."""

    base: str

    @property
    def jobs(self) -> str:
        return f"{self.base}:jobs"

    @property
    def results(self) -> str:
        return f"{self.base}:results"

    @property
    def result_prefix(self) -> str:
        return f"{self.base}:result:"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"


def _answer(top_k: int) -> Classification:
    k = max(1, top_k)
    return Classification(
        indices=list(range(k)),
        scores=[round(1.0 / (i + 2), 6) for i in range(k)],
        names=[f"null_{i}" for i in range(k)],
    )


async def push_queue_jobs(
    client: aioredis.Redis, stream: str, payload: bytes, jobs: int, id_prefix: str
) -> None:
    """`jobs` jobs carrying `payload`, pipelined; each with its own id, as producers send."""
    for start in range(0, jobs, _PUSH_CHUNK):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(jobs, start + _PUSH_CHUNK)):
            pipe.xadd(stream, {wire.JOB_ID: f"{id_prefix}-{i}", wire.JOB_IMAGE: payload})
        await pipe.execute()


async def delete_queue_keys(client: aioredis.Redis, keys: QueueKeys) -> None:
    await client.delete(keys.jobs, keys.results, keys.dead)
    batch: list[Any] = []
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in keys.result_prefix)
    async for key in client.scan_iter(match=escaped + "*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            await client.unlink(*batch)
            batch = []
    if batch:
        await client.unlink(*batch)


async def queue_ceiling(
    client: aioredis.Redis,
    base: str,
    *,
    payload: bytes,
    jobs: int,
    batch: int,
    top_k: int = 5,
    model: str = "null",
    weights: str = "none",
    keep: bool = False,
) -> dict[str, Any]:
    """Queue `jobs` jobs of `payload` under `base`, then read, publish and acknowledge them
    all as described above; the figures of the timed part. Deletes its keys afterwards.

    `loop_cpu_us_per_job` is this thread's CPU (time.thread_time) over the window per job:
    the client-side cost of the Redis work alone, what a worker's event loop cannot go
    below. `keep` leaves the keys in place (to inspect what it wrote)."""
    if jobs < 1 or batch < 1:
        raise ValueError("jobs and batch must be at least 1")
    keys = QueueKeys(base)
    settings = WriterSettings(
        stream=keys.jobs,
        group=_GROUP,
        result_prefix=keys.result_prefix,
        result_ttl_s=600,
        results_maxlen=max(jobs, 1000),
        worker_name="queue-ceiling",
        model_name=model,
        weights=weights,
        dead_stream=keys.dead,
        default_reply_to=keys.results,
    )
    writer = ResultWriter(client, settings, max_queued=1)
    answer = _answer(top_k)
    await delete_queue_keys(client, keys)
    try:
        await push_queue_jobs(client, keys.jobs, payload, jobs, base.rsplit(":", 1)[-1])
        try:
            await client.xgroup_create(keys.jobs, _GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # Load the script outside the window (the writer's first flush does it once too).
        await client.script_load(PUBLISH_RESULTS)
        done = 0
        batches = 0
        published = 0
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        while done < jobs:
            reply: Any = await client.xreadgroup(
                _GROUP, "queue-ceiling", {keys.jobs: ">"}, count=batch
            )
            if not reply:
                break
            entries = reply[0][1]
            outcomes = []
            for raw_id, fields in entries:
                job = parse_job(raw_id.decode(), fields, keys.results)
                # The stages a worker's result reports, so the result is as large.
                job.timings_ms.update(_TIMINGS)
                outcomes.append(Outcome(job=job, ok=True, answer=answer))
            states = await writer.publish(outcomes)
            published += states.count(PublishState.PUBLISHED)
            done += len(entries)
            batches += 1
        wall_s = time.perf_counter() - t0
        cpu_s = time.thread_time() - cpu0
    finally:
        if not keep:
            await delete_queue_keys(client, keys)
    wall = max(wall_s, 1e-9)
    return {
        "jobs": done,
        "published": published,
        "batch": batch,
        "batches": batches,
        "payload_bytes": len(payload),
        "seconds": round(wall_s, 4),
        "jobs_per_s": round(done / wall, 1),
        "loop_cpu_us_per_job": round(1e6 * cpu_s / max(done, 1), 1),
        "method": "XREADGROUP COUNT batch; the writer's publish: one PUBLISH_RESULTS call per "
        "batch (per job XACK, XADD, HSET, EXPIRE) with the writer's result fields",
    }
