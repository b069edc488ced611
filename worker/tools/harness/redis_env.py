"""The benchmark's Redis: a private redis-server, each run's own streams, pushing jobs,
reading results back, and deleting a run's keys afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from producer import wire
from worker.tools.demo import redis_for_demo


@dataclass(frozen=True)
class RunKeys:
    run_id: str

    @property
    def jobs(self) -> str:
        return f"bench:{self.run_id}:jobs"

    @property
    def results(self) -> str:
        return f"bench:{self.run_id}:results"

    @property
    def result_prefix(self) -> str:
        return f"bench:{self.run_id}:result:"

    @property
    def dead(self) -> str:
        return f"bench:{self.run_id}:dead"


@dataclass(frozen=True)
class ReadBack:
    """One result as the benchmark reads it back."""

    ms: int  # Redis time the result was added (its entry ID)
    job_ms: int  # Redis time the job was added
    ok: bool
    error: str
    timings: dict[str, float]
    cached: bool | None = None  # the worker's `cached` flag (decode cache hit); None: absent


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    # A result names an entry of a priority level's stream `<level>:<entry ID>`.
    return int(text.rsplit(":", 1)[-1].split("-", 1)[0])


def parse_answer(entry_id: bytes, fields_: Mapping[bytes, bytes]) -> ReadBack:
    details: dict[str, Any] = {}
    raw = fields_.get(wire.RES_RESULT)
    if raw:
        details = msgpack.unpackb(raw, raw=False)
    job_entry = fields_.get(wire.RES_ENTRY, b"0-0")
    status = fields_.get(wire.RES_STATUS, b"").decode()
    timings = {str(k): float(v) for k, v in (details.get("timings_ms") or {}).items()}
    cached = details.get("cached")
    return ReadBack(
        ms=_entry_ms(entry_id),
        job_ms=_entry_ms(job_entry),
        ok=status == wire.STATUS_OK,
        error=fields_.get(wire.RES_ERROR, b"").decode(errors="replace"),
        timings=timings,
        cached=bool(cached) if cached is not None else None,
    )


# After the JPEG's end-of-image marker: decoders stop at EOI and ignore what follows.
JPEG_EOI = b"\xff\xd9"
TRAILER_PREFIX = b"gpufeed-bench-"


def job_image(images: Sequence[bytes], i: int, job_id: str, *, unique: bool) -> bytes:
    """The bytes of job `i`, cycling through `images`.

    `unique` (the default of every comparable run) appends a short per-job trailer after the
    JPEG's end-of-image marker (`gpufeed-bench-<job id>`), so no two jobs of a worker carry
    the same bytes and its decode cache (worker/decode/cache.py, keyed by a hash of the
    bytes) never hits: the pixels decoded are the same, only the repeats are gone. Without
    it, the jobs repeat the distinct images as they are (the cache pair's workload)."""
    data = images[i % len(images)]
    if not unique:
        return data
    if not data.endswith(JPEG_EOI):
        raise ValueError("the benchmark's images are JPEGs ending with the EOI marker")
    return data + TRAILER_PREFIX + job_id.encode()


def _job_fields(
    images: Sequence[bytes], i: int, id_prefix: str, *, unique: bool
) -> dict[FieldT, EncodableT]:
    job_id = f"{id_prefix}-{i}"
    return {"id": job_id, "image": job_image(images, i, job_id, unique=unique)}


def push_jobs(
    client: redis.Redis,
    stream: str,
    images: Sequence[bytes],
    count: int,
    id_prefix: str,
    *,
    unique: bool = True,
) -> None:
    """`count` jobs cycling through `images`, pipelined (64 per round trip); each job's
    bytes unique unless `unique` is False (see `job_image`)."""
    for start in range(0, count, 64):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + 64)):
            pipe.xadd(stream, _job_fields(images, i, id_prefix, unique=unique))
        pipe.execute()


def paced_push(
    client: redis.Redis,
    stream: str,
    *,
    images: Sequence[bytes],
    count: int,
    rate_per_s: float,
    id_prefix: str,
    unique: bool = True,
) -> None:
    """`count` jobs at `rate_per_s` (open loop: the schedule ignores the results); each
    job's bytes unique unless `unique` is False (see `job_image`)."""
    t0 = time.perf_counter()
    sent = 0
    while sent < count:
        due = min(count, max(sent + 1, int((time.perf_counter() - t0) * rate_per_s) + 1))
        pipe = client.pipeline(transaction=False)
        for i in range(sent, due):
            pipe.xadd(stream, _job_fields(images, i, id_prefix, unique=unique))
        pipe.execute()
        sent = due
        pause = t0 + sent / rate_per_s - time.perf_counter()
        if pause > 0:
            time.sleep(pause)


async def read_answers(client: aioredis.Redis, stream: str) -> list[ReadBack]:
    out: list[ReadBack] = []
    start = "-"
    while True:
        chunk: Any = await client.xrange(stream, min=start, max="+", count=1000)
        if not chunk:
            return out
        out.extend(parse_answer(eid, f) for eid, f in chunk)
        start = "(" + chunk[-1][0].decode()


async def wait_for_results(
    client: aioredis.Redis,
    stream: str,
    expected: int,
    *,
    alive: Callable[[], None],
    timeout_s: float,
) -> None:
    """Wait until `expected` results are in `stream` (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await client.xlen(stream) >= expected:
            return
        alive()
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


async def collect(
    client: aioredis.Redis,
    stream: str,
    expected: int,
    *,
    alive: Callable[[], None],
    timeout_s: float,
) -> list[ReadBack]:
    """Wait until `expected` results are in `stream` (or the time is up); return them all."""
    await wait_for_results(client, stream, expected, alive=alive, timeout_s=timeout_s)
    return await read_answers(client, stream)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def bench_redis(external_url: str | None, workdir: Path) -> Iterator[str]:
    """The Redis to use: `external_url` if given, else a private redis-server on a free port
    (started and stopped by worker/tools/demo.py's helper)."""
    if external_url:
        yield external_url
        return
    workdir.mkdir(parents=True, exist_ok=True)
    # Nothing listens on a port just found free, so the helper starts a private server.
    with redis_for_demo(f"redis://127.0.0.1:{_free_port()}/0", workdir) as url:
        yield url


async def delete_run(aclient: aioredis.Redis, keys: RunKeys) -> None:
    """Delete a run's streams and its per-job result keys."""
    await aclient.delete(keys.jobs, keys.results, keys.dead)
    batch: list[bytes] = []
    async for key in aclient.scan_iter(match=f"{keys.result_prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            await aclient.unlink(*batch)
            batch = []
    if batch:
        await aclient.unlink(*batch)
