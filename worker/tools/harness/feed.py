"""The GPU check's and `doctor`'s job producer, in a process of its own.

Building each job's bytes and redis-py's packing of a pipeline of XADDs are Python work:
run on a thread of the worker's process (or on its event loop, as the doctor's once was),
they took turns of the worker's GIL away from the pipeline the check measures. In its own
process (spawned: nothing of torch or CUDA is inherited) the producer costs the measured
worker nothing but Redis's time, as an upstream service would. Imports no torch.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType
from typing import Any

import redis

# XADDs per pipeline round trip.
CHUNK = 256


def unique_jpeg(data: bytes, n: int) -> bytes:
    """`data` (a JPEG) with a comment segment holding `n` after its SOI marker: bytes of
    their own for every job, so no cache can answer a job with another's decode."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG")
    payload = n.to_bytes(8, "big")
    return data[:2] + b"\xff\xfe" + (2 + len(payload)).to_bytes(2, "big") + payload + data[2:]


@dataclass(frozen=True)
class FeedOrder:
    redis_url: str
    stream: str
    images: Sequence[bytes]
    # Jobs kept ahead of the worker's answers.
    backlog: int
    # Paced instead (the latency phase): `count` jobs at this rate, open loop (the schedule
    # ignores the answers), numbered from `first` so that their bytes are new too.
    rate_per_s: float = 0.0
    count: int = 0
    first: int = 0
    # The check's pid: the feeder ends once it is no longer its parent. Taken by the check,
    # not by the feeder: a check cut while the feeder was still starting is already gone.
    parent: int = 0
    # Kept ahead: at most this many jobs in all (0: until stopped).
    total: int = 0
    # Job ids are the prefix and the job's number.
    prefix: str = "g"
    # Each job's image made bytes of its own (no cache can answer it), or the image as given.
    unique: bool = True
    # The field `images` fill: `image`, or `url` / `path` (then they are URLs or paths, as
    # bytes).
    field: str = "image"


def feed(
    plan: FeedOrder, stop: EventType, pushed: Synchronized[int], done: Synchronized[int]
) -> None:
    """Keep `plan.backlog` jobs ahead of the worker's answers (`done`, kept by the parent)
    until `stop` is set, or with a rate push the plan's paced jobs; `pushed` counts what was
    added."""
    if plan.rate_per_s > 0:
        paced(plan, stop, pushed)
        return
    client = redis.Redis.from_url(plan.redis_url)
    images = plan.images
    n = 0
    try:
        while not stop.is_set() and not _orphaned(plan.parent):
            if plan.total and n >= plan.total:
                return
            room = plan.backlog - (n - done.value)
            if room <= 0:
                time.sleep(0.002)
                continue
            chunk = min(CHUNK, room, plan.total - n) if plan.total else CHUNK
            pipe = client.pipeline(transaction=False)
            for _ in range(chunk):
                data = images[n % len(images)]
                if plan.unique:
                    data = unique_jpeg(data, n)
                pipe.xadd(plan.stream, {"id": f"{plan.prefix}{n}", plan.field: data})
                n += 1
            pipe.execute()
            pushed.value = n
    finally:
        client.close()


def _orphaned(parent: int) -> bool:
    """The check that started this process has ended: a check cut by its deadline or a
    signal leaves with os._exit, stopping nothing, and its feeder must not push for ever."""
    return os.getppid() != parent


def paced(plan: FeedOrder, stop: EventType, pushed: Synchronized[int]) -> None:
    """`plan.count` jobs at `plan.rate_per_s`, each pipeline holding the jobs due by then."""
    client = redis.Redis.from_url(plan.redis_url)
    images = plan.images
    t0 = time.perf_counter()
    sent = 0
    try:
        while sent < plan.count and not stop.is_set() and not _orphaned(plan.parent):
            due = int((time.perf_counter() - t0) * plan.rate_per_s) + 1
            due = min(plan.count, max(sent + 1, due))
            pipe = client.pipeline(transaction=False)
            for i in range(sent, due):
                n = plan.first + i
                data = images[n % len(images)]
                if plan.unique:
                    data = unique_jpeg(data, n)
                pipe.xadd(plan.stream, {"id": f"l{n}", plan.field: data})
            pipe.execute()
            sent = due
            pushed.value = sent
            pause = t0 + sent / plan.rate_per_s - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
    finally:
        client.close()


class Feeder:
    """`feed` in a spawned process, with the counters it shares with the check."""

    def __init__(
        self,
        redis_url: str,
        stream: str,
        images: Sequence[bytes],
        backlog: int,
        *,
        rate_per_s: float = 0.0,
        count: int = 0,
        first: int = 0,
        total: int = 0,
        prefix: str = "g",
        unique: bool = True,
        field: str = "image",
    ):
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._pushed: Synchronized[int] = ctx.Value("q", 0)
        self._done: Synchronized[int] = ctx.Value("q", 0)
        plan = FeedOrder(
            redis_url,
            stream,
            list(images),
            backlog,
            rate_per_s,
            count,
            first,
            os.getpid(),
            total=total,
            prefix=prefix,
            unique=unique,
            field=field,
        )
        args: tuple[Any, ...] = (plan, self._stop, self._pushed, self._done)
        self._process = ctx.Process(target=feed, args=args, name="gpu-check-feed", daemon=True)

    def start(self) -> None:
        self._process.start()

    def answered(self, count: int) -> None:
        """Tell the producer how many jobs the worker has answered."""
        self._done.value = count

    @property
    def pushed(self) -> int:
        return int(self._pushed.value)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
