"""The completion watcher: notices finished batches through their events, off the launch path.

Batches finish in launch order (one compute stream), so the watcher only ever looks at the
oldest one. It polls `event.query()` from the event loop, which never blocks, and only after
the event fired does it read the pinned output slot: the few bytes per image that left the
GPU. Reading host memory here, through the model kind's reader (model/readers.py), is the
one place where results become Python values.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from worker.jobs import Outcome
from worker.model.readers import ClassifyReader, OutputReader
from worker.pipeline.device_room import DeviceRoom
from worker.pipeline.launch import Launched
from worker.pipeline.staging import OutputRing

PublishFn = Callable[[list[Outcome]], Awaitable[None]]
BatchDoneFn = Callable[[Launched, float], None]


class CompletionWatcher:
    def __init__(
        self,
        out_ring: OutputRing,
        publish: PublishFn,
        *,
        reader: OutputReader | None = None,
        poll_interval_s: float = 0.0005,
        on_batch_done: BatchDoneFn | None = None,
        room: DeviceRoom | None = None,
    ) -> None:
        # Told when a batch finished on the device, so that the open batch may be sealed.
        self._room = room
        self.out_ring = out_ring
        self._publish = publish
        self._reader = reader or ClassifyReader()
        self._poll_s = poll_interval_s
        self._on_batch_done = on_batch_done
        self._pending: deque[Launched | None] = deque()
        self._arrived = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return sum(1 for p in self._pending if p is not None)

    def track(self, launched: Launched | None) -> None:
        """Queue a launched batch; None marks the end (after it, `run` returns)."""
        self._pending.append(launched)
        self._arrived.set()

    async def run(self) -> None:
        while True:
            if not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            head = self._pending[0]
            if head is None:
                self._pending.popleft()
                return
            if not head.done.query():
                await asyncio.sleep(self._poll_s)
                continue
            self._pending.popleft()
            if self._room is not None:
                self._room.finished()
            await self._finish(head)

    async def _finish(self, launched: Launched) -> None:
        batch = launched.batch
        gpu_ms = launched.start.elapsed_time(launched.done)
        now = time.monotonic()
        out = launched.out
        outcomes: list[Outcome] = []
        # A batch run on the degraded step has that step's outputs, in its output ring.
        serving = launched.serving
        reader = serving.reader if serving is not None else self._reader
        out_ring = serving.out_ring if serving is not None else self.out_ring
        degraded = serving is not None and serving.degraded
        # Only rows holding a decoded image are read; padding and failed rows are not. The
        # reader works on whole columns: only those of the rows the step wrote (the batch
        # shape it ran on), never a row it left as an earlier batch wrote it.
        valid = batch.valid_rows
        arrays = out.arrays
        if launched.size and launched.size < len(arrays[0]):
            arrays = tuple(a[: launched.size] for a in arrays)
        answers = dict(zip(valid, reader.read(arrays, valid), strict=True))
        batch_wait_ms = (launched.launched_s - batch.sealed_s) * 1000
        # `degraded`: the writer names the degraded step's model in the result.
        marks: dict[str, Any] = {"degraded": True} if degraded else {}
        results = batch.results
        for row, job in enumerate(batch.jobs):
            result = results[row]
            timings = job.timings_ms
            timings["decode"] = result.decode_ms
            timings["batch_wait"] = batch_wait_ms
            timings["compute"] = gpu_ms
            timings["total"] = (now - job.received_s) * 1000
            if result.error is not None:
                outcomes.append(Outcome.failure(job, result.error.code, result.error.message))
                continue
            info = result.info
            extra: dict[str, Any] = (
                {**marks}
                if info is None
                else {
                    **marks,
                    "format": info.format,
                    "width": info.width,
                    "height": info.height,
                    "draft_scale": info.draft_scale,
                    "cached": result.cached,
                }
            )
            outcomes.append(Outcome(job=job, ok=True, answer=answers[row], extra=extra))
        out_ring.release(out)
        if self._on_batch_done is not None:
            self._on_batch_done(launched, gpu_ms)
        await self._publish(outcomes)
