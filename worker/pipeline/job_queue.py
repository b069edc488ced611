"""The jobs queue: lists of jobs from the reader (and the fetch stage) to the batcher.

What one XREADGROUP returned travels as one item, so the hand-over costs the event loop one
queue operation per read, not one per job. The bound counts jobs, not items: a put waits
while the queue holds jobs and the new list would take it past `max_jobs` (a list longer
than the bound still goes in once the queue is empty, so one large read cannot wedge it).

The batcher is the only consumer. Instead of a timer per `get`, the batcher arms one timer
per batch that calls `wake()`: a waiting `get` then returns `WOKEN`, and queued jobs always
come out before a wake-up does, so a batch is sealed short only when nothing is queued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

from worker.jobs import Job

WOKEN: Final = "woken"
"""What `get` returns when `wake()` was called and nothing is queued."""


class JobQueue:
    def __init__(self, max_jobs: int) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1 (got {max_jobs})")
        self.max_jobs = max_jobs
        self._items: deque[list[Job] | None] = deque()
        self._jobs = 0
        self._woken = False
        self._not_empty = asyncio.Event()
        self._room = asyncio.Event()

    def qsize(self) -> int:
        """Jobs queued (not lists)."""
        return self._jobs

    async def put(self, jobs: list[Job] | None) -> None:
        """Queue `jobs` as one item (None: the end-of-input sentinel, always taken)."""
        if jobs is not None:
            if not jobs:
                return
            while self._jobs and self._jobs + len(jobs) > self.max_jobs:
                self._room.clear()
                await self._room.wait()
            self._jobs += len(jobs)
        self._items.append(jobs)
        self._not_empty.set()

    async def get(self) -> list[Job] | str | None:
        """The oldest list (or the sentinel); `WOKEN` if `wake()` was called meanwhile and
        nothing is queued."""
        while not self._items:
            if self._woken:
                self._woken = False
                return WOKEN
            self._not_empty.clear()
            await self._not_empty.wait()
        item = self._items.popleft()
        if item is not None:
            self._jobs -= len(item)
            self._room.set()
        return item

    def wake(self) -> None:
        """Make the next `get` that finds the queue empty return `WOKEN` (callable from a
        loop callback, e.g. the batch's timer)."""
        self._woken = True
        self._not_empty.set()
