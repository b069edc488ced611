"""The batcher: one fixed batch shape, filled row by row, sealed when full or after max wait.

Each job gets a row of a staging slot *before* it is decoded, so the decode thread writes its
pixels straight into the buffer that will be copied to the device. A batch is sealed when all
B rows are taken or when `max_wait_s` has passed since its first row; rows never taken (and
rows whose decode failed or ran past the decode budget) are padding, masked out of the
results. The compiled model always sees the same shape, so it never recompiles and cuDNN
never re-tunes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from worker.decode.pool import DecodePool, DecodeResult
from worker.jobs import Job
from worker.staging import InputRing, InputSlot

SettleFn = Callable[[Sequence[asyncio.Future[DecodeResult]]], Awaitable[list[DecodeResult]]]


@dataclass(eq=False)
class Batch:
    """A sealed batch; its decodes may still be running until `decoded()` returns."""

    seq: int
    slot: InputSlot
    jobs: list[Job]  # row i holds jobs[i]; rows past len(jobs) are padding
    futures: list[asyncio.Future[DecodeResult]]
    opened_s: float
    sealed_s: float = 0.0
    results: list[DecodeResult] = field(default_factory=list)
    # The decode pool's wait, which gives up rows over the decode budget; None: wait for all.
    settle: SettleFn | None = None

    async def decoded(self) -> list[DecodeResult]:
        if not self.results:
            if self.settle is not None:
                self.results = await self.settle(self.futures)
            else:
                self.results = list(await asyncio.gather(*self.futures))
        return self.results

    @property
    def valid_rows(self) -> list[int]:
        """Rows holding a successfully decoded image (call after `decoded()`): the step
        computes all B rows; only these are read. Padding and failed rows are not."""
        return [i for i, r in enumerate(self.results) if r.error is None]

    def fill_ratio(self, batch_size: int) -> float:
        return len(self.valid_rows) / batch_size


class Batcher:
    def __init__(
        self,
        ring: InputRing,
        decoder: DecodePool,
        *,
        batch_size: int,
        max_wait_s: float,
        jobs: asyncio.Queue[Job | None],
        sealed: asyncio.Queue[Batch | None],
    ) -> None:
        self.ring = ring
        self.decoder = decoder
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self._jobs = jobs
        self._sealed = sealed
        self._open: Batch | None = None
        self._seq = 0

    async def run(self) -> None:
        """Consume jobs until a None sentinel arrives; then seal the open batch and pass the
        sentinel on, so the stages downstream drain in order."""
        while True:
            job = await self._next_job()
            if job is _TIMEOUT:
                await self._seal()
                continue
            if job is None:
                await self._seal()
                await self._sealed.put(None)
                return
            assert isinstance(job, Job)
            await self._add(job)

    async def _next_job(self) -> Job | object | None:
        if self._open is None:
            return await self._jobs.get()
        remaining = self._open.opened_s + self.max_wait_s - time.monotonic()
        if remaining <= 0:
            # Take what is already queued before sealing a short batch.
            try:
                return self._jobs.get_nowait()
            except asyncio.QueueEmpty:
                return _TIMEOUT
        try:
            return await asyncio.wait_for(self._jobs.get(), remaining)
        except TimeoutError:
            return _TIMEOUT

    async def _add(self, job: Job) -> None:
        if self._open is None:
            slot = await self.ring.acquire()
            self._seq += 1
            self._open = Batch(
                seq=self._seq,
                slot=slot,
                jobs=[],
                futures=[],
                opened_s=time.monotonic(),
                settle=self.decoder.settle,
            )
        batch = self._open
        row = len(batch.jobs)
        batch.jobs.append(job)
        # From the moment its bytes were here (a `url` job's fetch is a stage of its own).
        job.timings_ms["queue"] = (time.monotonic() - job.ready_s) * 1000
        batch.futures.append(self.decoder.submit(job, batch.slot.array[row]))
        if len(batch.jobs) == self.batch_size:
            await self._seal()

    async def _seal(self) -> None:
        batch, self._open = self._open, None
        if batch is None:
            return
        batch.sealed_s = time.monotonic()
        await self._sealed.put(batch)


_TIMEOUT = object()
