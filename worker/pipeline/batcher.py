"""The batcher: slots of the largest batch shape, filled row by row, sealed when full or after
max wait.

Jobs arrive in lists (what one read returned); the rows a list takes in a batch go to the
decode executor (worker/decode/executor.py) as one group. Each job gets a row of a staging
slot *before* it is decoded, so the decoder writes its pixels straight into the buffer that
will be copied to the device. A batch is sealed when all B rows are taken or when
`max_wait_s` has passed since its first row; rows never taken (and rows whose decode failed
or ran past the decode budget) are padding, masked out of the results. The step runs on the
smallest compiled batch shape that holds the sealed rows (worker/model/sizes.py), always one
compiled at start-up, so it never recompiles and cuDNN never re-tunes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.decode.executor import DecodeExecutor, DecodeGroup, DecodeResult
from worker.jobs import Job
from worker.pipeline.device_room import DeviceRoom
from worker.pipeline.job_queue import JobQueue
from worker.pipeline.staging import InputRing, InputSlot

# The decode executor's wait for the groups it handed out.
SettleFn = Callable[[Sequence[DecodeGroup]], Awaitable[list[DecodeResult]]]


@dataclass(eq=False)
class Batch:
    """A sealed batch; its decodes may still be running until `decoded()` returns."""

    seq: int
    slot: InputSlot
    jobs: list[Job]  # row i holds jobs[i]; rows past len(jobs) are padding
    # In row order: the groups of rows the decode executor handed out (or, a batch made
    # without its `settle`, one future per row).
    futures: list[DecodeGroup]
    opened_s: float
    sealed_s: float = 0.0
    results: list[DecodeResult] = field(default_factory=list)
    # The decode executor's wait, which gives up rows over the decode budget; None: wait for
    # all.
    settle: SettleFn | None = None
    # The GPU decode of the rows left for it, started once the batch was decoded (while the
    # batch before it launched: worker/pipeline/launch.py); the launch awaits it.
    device_rows: asyncio.Task[Any] | None = None
    # When the dispatcher took it, and when its decode was done (the decode split's wait).
    taken_s: float = 0.0
    decoded_s: float = 0.0

    async def decoded(self) -> list[DecodeResult]:
        if not self.results:
            if self.settle is not None:
                self.results = await self.settle(self.futures)
            else:
                futures = [f for f in self.futures if isinstance(f, asyncio.Future)]
                if len(futures) != len(self.futures):
                    raise TypeError("a batch of row groups needs the decode executor's settle")
                self.results = list(await asyncio.gather(*futures))
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
        decoder: DecodeExecutor,
        *,
        batch_size: int,
        max_wait_s: float,
        jobs: JobQueue,
        sealed: asyncio.Queue[Batch | None],
        room: DeviceRoom | None = None,
    ) -> None:
        self.ring = ring
        # A batch past its max wait is sealed only when the device has room for it
        # (worker/pipeline/device_room.py); None: at its max wait, whatever the device does.
        self.room = room
        self.decoder = decoder
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self._jobs = jobs
        self._sealed = sealed
        self._open: Batch | None = None
        self._deadline_s = 0.0
        # The open batch's one timer: it wakes the queue's `get` when max wait has passed.
        self._timer: asyncio.TimerHandle | None = None
        self._seq = 0
        # Called with each batch as it is sealed (the benchmark counts batch fill with it).
        self.on_sealed: Callable[[Batch], None] | None = None

    async def run(self) -> None:
        """Consume lists of jobs until a None sentinel arrives; then seal the open batch and
        pass the sentinel on, so the stages downstream drain in order."""
        try:
            while True:
                item = await self._jobs.get()
                if item is None:
                    await self._seal()
                    await self._sealed.put(None)
                    return
                if isinstance(item, list):
                    await self._add(item)
                elif self._open is not None:
                    remaining = self._deadline_s - time.monotonic()
                    if remaining <= 0:
                        # Max wait passed and nothing is queued: the stream has nothing
                        # more to give right now. Sealed if the device can take it; else it
                        # keeps filling, and the room's wake-up comes back here.
                        if self.room is None or self.room.has_room():
                            await self._seal()
                    else:
                        # A wake-up left over from a batch sealed full, or a timer that
                        # fired a hair early: wait out the rest of this batch's max wait.
                        self._arm_timer(remaining)
        finally:
            self._cancel_timer()

    async def _add(self, jobs: list[Job]) -> None:
        """Give each job the next row, opening and sealing batches as they fill."""
        taken = 0
        while taken < len(jobs):
            batch = self._open or await self._open_batch()
            first = len(batch.jobs)
            group = jobs[taken : taken + self.batch_size - first]
            taken += len(group)
            now = time.monotonic()
            for job in group:
                # From the moment its bytes were here (a `url` job's fetch is a stage of
                # its own).
                job.timings_ms["queue"] = (now - job.ready_s) * 1000
            batch.jobs.extend(group)
            # One submit per group of rows: the executor wakes the loop once when all are
            # done.
            batch.futures.append(
                self.decoder.submit_rows(group, batch.slot.array[first : first + len(group)])
            )
            if len(batch.jobs) == self.batch_size:
                await self._seal()

    async def _open_batch(self) -> Batch:
        slot = await self.ring.acquire()
        self._seq += 1
        batch = Batch(
            seq=self._seq,
            slot=slot,
            jobs=[],
            futures=[],
            opened_s=time.monotonic(),
            settle=self.decoder.settle,
        )
        self._open = batch
        self._deadline_s = batch.opened_s + self.max_wait_s
        self._arm_timer(self.max_wait_s)
        return batch

    def _arm_timer(self, delay_s: float) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._jobs.wake)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _seal(self) -> None:
        self._cancel_timer()
        batch, self._open = self._open, None
        if batch is None:
            return
        batch.sealed_s = time.monotonic()
        if self.on_sealed is not None:
            self.on_sealed(batch)
        if self.room is not None:
            self.room.sealed()
        await self._sealed.put(batch)
