"""The two hand-overs between the stages that are the worker's own decisions: what a read
returned (answered at once, fetched, or batched: `ReadRouter`), and which step a sealed batch
runs on and what its failure answers (`Dispatcher`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass

import structlog

from producer import tenants
from producer.shards import Shard
from producer.wire import ErrorCode
from worker.base.device import FencedError
from worker.config.lanes import Lanes
from worker.decode.cpu import DecodeError
from worker.delivery.sharding import reply_to_problem, wrong_shard_problem
from worker.fetch.stage import FetchStage
from worker.jobs import Job, Outcome, past_deadline
from worker.pipeline.batcher import Batch
from worker.pipeline.completion import CompletionWatcher
from worker.pipeline.degrade import DegradeSwitch, Serving
from worker.pipeline.device_room import DeviceRoom
from worker.pipeline.gpu_decode import GpuDecodeStage
from worker.pipeline.job_queue import JobQueue
from worker.pipeline.launch import Launched, ModelRunner
from worker.pipeline.staging import InputRing

log = structlog.get_logger("gpufeed.worker")

Reply = Callable[[list[Outcome]], Awaitable[None]]
Deliver = Callable[[list[Job]], Awaitable[None]]


class ReadRouter:
    """Where what one read (or one reclaim) returned goes: answered at once (rejected,
    late), to the fetch stage (`url` jobs), or to the batcher as one queue item."""

    def __init__(
        self,
        *,
        held: MutableMapping[tuple[str, str], Job],
        fetcher: FetchStage,
        jobs: JobQueue,
        answer: Reply,
        shards: list[Shard],
        cluster: bool,
    ) -> None:
        self._held = held
        self._fetcher = fetcher
        self._jobs = jobs
        self._answer = answer
        self._shards = shards
        self._cluster = cluster

    async def __call__(self, jobs: list[Job]) -> None:
        now_ms = time.time() * 1000
        answered: list[Outcome] = []
        ready: list[Job] = []
        for job in jobs:
            self._held[(job.stream, job.entry_id)] = job
            if job.enqueued_ms > now_ms:
                # An entry ID from the future (chosen by whoever added it, or numbered after
                # such an entry) says nothing of when the job came: its time counts from
                # this read, so the latency metrics are not all zero behind it.
                job.enqueued_ms = int(now_ms)
            if job.enqueued_ms:
                # Time in Redis before this worker read it (server and worker clocks may
                # differ a little; never negative).
                job.timings_ms["redis_wait"] = max(0.0, now_ms - job.enqueued_ms)
            if job.rejected is not None:
                code, message = job.rejected
                answered.append(Outcome.failure(job, code, message))
            elif (late := past_deadline(job, now_ms)) is not None:
                answered.append(late)
            elif job.url is not None:
                # Fetched in the background: the reader goes on, and the job joins a batch
                # only once its bytes are here.
                self._fetcher.submit(job)
            else:
                ready.append(job)
        if answered:
            await self._answer(answered)
        if ready:
            await self._jobs.put(ready)

    def of_shard(self, shard: Shard, lanes: Lanes) -> Deliver:
        """The hand-over of one shard's reader and reclaimer. A job whose own id belongs to
        another shard is answered `invalid_job` naming that shard's stream, computed
        nowhere. On a cluster, a reply_to in another slot than the shard's cannot be written
        by its publish script: such a job is answered `invalid_job` on the shard's results
        stream. A tenant's job (read from one of its `lanes`) may be answered only on its
        own streams (producer/tenants.py): another reply_to is answered `invalid_job` on
        the tenant's results stream."""
        layout = self._shards
        cluster = self._cluster
        tenant_keys = {
            lane.stream: lane.keys for lane in lanes if lane.keys is not None and lane.keys.tenant
        }
        sharded = cluster or len(layout) > 1

        async def deliver(jobs: list[Job]) -> None:
            if not (sharded or tenant_keys):
                await self(jobs)
                return
            for job in jobs:
                if job.rejected is not None:
                    continue
                keys = tenant_keys.get(job.stream, shard)
                problem = tenants.reply_problem(job.reply_to, keys) if keys.tenant else None
                if problem is None and sharded:
                    problem = wrong_shard_problem(job, shard, layout)
                if problem is None and cluster:
                    problem = reply_to_problem(job, keys)
                if problem is not None:
                    job.reply_to = keys.results_stream
                    job.rejected = (ErrorCode.INVALID_JOB, problem)
            await self(jobs)

        return deliver


@dataclass
class Steps:
    """The steps a batch can run on: the main one, and the degraded one while the switch
    (GPUFEED_DEGRADE_AFTER_S) is on."""

    main: Serving
    degraded: Serving | None = None
    switch: DegradeSwitch | None = None

    def now(self) -> Serving:
        switch = self.switch
        if switch is not None and switch.on and self.degraded is not None:
            return self.degraded
        return self.main


class Dispatcher:
    """Takes sealed batches in order, launches each on the step of the moment, and hands
    the launch to the completion watcher; a batch that fails is answered here."""

    def __init__(
        self,
        *,
        sealed: asyncio.Queue[Batch | None],
        ring: InputRing,
        runner: ModelRunner,
        watcher: CompletionWatcher,
        steps: Steps,
        answer: Reply,
        on_launched: Callable[[Launched], None],
        gpu_decode: GpuDecodeStage,
        room: DeviceRoom | None = None,
    ) -> None:
        self._room = room
        self._gpu_decode = gpu_decode
        self._upcoming: asyncio.Task[Batch | None] | None = None
        self._sealed = sealed
        self._ring = ring
        self._runner = runner
        self._watcher = watcher
        self._steps = steps
        self._answer = answer
        self._on_launched = on_launched

    async def _take(self) -> Batch | None:
        """The next sealed batch, decoded, its expired rows answered as such, and the GPU
        decode of its rows left for the GPU started; None at the end."""
        batch = await self._sealed.get()
        if batch is None:
            return None
        batch.taken_s = time.monotonic()
        await batch.decoded()
        batch.decoded_s = time.monotonic()
        expire_rows(batch)
        self._gpu_decode.start(batch)
        return batch

    async def run(self) -> None:
        # One batch ahead: while a batch launches, the next is taken and its GPU decode runs
        # (on the GPU decoder's other lane), off the launches' path.
        upcoming = asyncio.create_task(self._take(), name="dispatch_take")
        try:
            await self._run(upcoming)
        finally:
            for task in (upcoming, self._upcoming):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _run(self, upcoming: asyncio.Task[Batch | None]) -> None:
        while True:
            ready_s = time.monotonic()
            batch = await upcoming
            if batch is None:
                self._watcher.track(None)
                return
            upcoming = self._upcoming = asyncio.create_task(self._take(), name="dispatch_take")
            await self._gpu_decode.observe_split(batch, ready_s)
            results = batch.results
            if not batch.valid_rows:
                self._dropped()
                self._ring.release_now(batch.slot)
                await self._answer(
                    [
                        Outcome.failure(job, r.error.code, r.error.message)
                        for job, r in zip(batch.jobs, results, strict=True)
                        if r.error is not None
                    ]
                )
                continue
            # Chosen once per batch: a batch runs whole on one step.
            serving = self._steps.now()
            out = await serving.out_ring.acquire()
            try:
                rows = await self._gpu_decode.rows(batch)
                launched = await self._runner.launch(batch, out, serving, rows=rows)
            except Exception as exc:  # noqa: BLE001 - the batch fails, the worker goes on
                log.error(
                    "batch_failed",
                    batch=batch.seq,
                    error=repr(exc),
                    job_ids=[j.job_id for j in batch.jobs],
                )
                serving.out_ring.release(out)
                self._dropped()
                if isinstance(exc, FencedError):
                    # Device work queued before the failure may still read the slot.
                    batch.slot.copy_done = exc.fence
                    self._ring.release_after_copy(batch.slot)
                else:
                    self._ring.release_now(batch.slot)
                await self._answer(
                    [
                        Outcome.failure(job, r.error.code, r.error.message)
                        if r.error is not None
                        else _failed_on(
                            serving, Outcome.failure(job, ErrorCode.INFERENCE_ERROR, f"{exc}")
                        )
                        for job, r in zip(batch.jobs, results, strict=True)
                    ]
                )
                continue
            self._on_launched(launched)
            batch.slot.copy_done = launched.copied
            self._ring.release_after_copy(batch.slot)
            self._watcher.track(launched)

    def _dropped(self) -> None:
        """A sealed batch that will not reach the completion watcher leaves the device's
        room (the watcher frees it for the batches that ran)."""
        if self._room is not None:
            self._room.finished()


def _failed_on(serving: Serving, outcome: Outcome) -> Outcome:
    """An inference_error of the degraded step names that step, as its results would."""
    if serving.degraded:
        outcome.extra["degraded"] = True
    return outcome


def expire_rows(batch: Batch) -> None:
    """Rows whose job's deadline passed while it was decoded are not computed: they become
    failed rows, answered `deadline_exceeded` with the batch's other failures."""
    now_ms = time.time() * 1000
    for row, job in enumerate(batch.jobs):
        if job.deadline_ms is None or batch.results[row].error is not None:
            continue
        late = past_deadline(job, now_ms)
        if late is not None and late.error_code is not None:
            batch.results[row] = batch.results[row]._replace(
                info=None,
                gpu=None,
                error=DecodeError(late.error_code, late.error_message),
            )
