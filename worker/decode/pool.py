"""The decode thread pool: reads a job's bytes and decodes them into a staging row.

PIL releases the GIL while it decodes and resizes, so threads give real parallelism here
without the cost of shipping pixels between processes.

Every image has a decode budget (GPUFEED_DECODE_BUDGET_MS), counted from the moment a thread
starts on it. A batch waits for a row at most that long; a row still decoding then is given
up, answered `decode_timeout`, and the batch goes on without it, so one slow image never
holds the jobs behind it. A thread cannot be stopped inside a Pillow call, hence:

- a decode works on its own array and copies it into the slot row under the row's lock, and
  only if the batch has not given the row up: by the time a slow decode ends, its slot may
  hold a later batch;
- the thread it keeps busy is replaced at once by a spare, so N threads keep decoding. At
  most N spares exist at a time (2N threads in all); the replaced thread retires when its
  decode ends. Past that bound a decode over budget still gives up its row, but its thread
  stays busy until the decode ends, and the pool decodes with one thread fewer meanwhile.

With GPU decode on, a JPEG the router picks for the GPU is only probed here (header,
limits, orientation): its row is marked deferred and the runner decodes it on the GPU
straight into the device copy of the slot. Anything else, and any JPEG the GPU fails on,
is decoded here as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import structlog

from producer.wire import ErrorCode
from worker.decode.cache import DecodeCache, cache_key
from worker.decode.cpu import (
    DecodeError,
    DecodeInfo,
    DecodeSpec,
    check_row,
    decode_pixels,
    write_row,
)
from worker.decode.gpu import GpuDecodeRouter, GpuRow
from worker.job_path import read_job_path
from worker.jobs import Job

log = structlog.get_logger("gpufeed.decode")


@dataclass(frozen=True)
class DecodeResult:
    info: DecodeInfo | None
    error: DecodeError | None
    decode_ms: float
    # Set when the row was left for the GPU: the row in the pinned slot is not written.
    gpu: GpuRow | None = None
    # The row came from the decode cache (the same bytes were decoded before).
    cached: bool = False


class _Row(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    GIVEN_UP = "given_up"


class RowTicket:
    """Who may still write one staging row: its decode thread, until the batch gives it up.

    The thread's final copy into the row and the batch's give-up take the same lock, so
    either the copy happened before the batch went on, or it never happens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = _Row.QUEUED
        self.started_s: float | None = None
        # A spare thread took the place of the thread running this decode.
        self.replaced = False

    def start(self) -> bool:
        """Called by the thread taking the row; False if the row was given up meanwhile."""
        with self._lock:
            if self.state is not _Row.QUEUED:
                return False
            self.state = _Row.RUNNING
            self.started_s = time.monotonic()
            return True

    def write(self, out: npt.NDArray[np.uint8], pixels: npt.NDArray[np.uint8]) -> bool:
        """Copy `pixels` into the row and mark it done, unless it was given up."""
        with self._lock:
            if self.state is not _Row.RUNNING:
                return False
            write_row(out, pixels)
            self.state = _Row.DONE
            return True

    def finish(self) -> tuple[bool, bool]:
        """The thread is done with the row: (given up, thread replaced)."""
        with self._lock:
            if self.state is _Row.RUNNING:
                self.state = _Row.DONE
            return self.state is _Row.GIVEN_UP, self.replaced

    def give_up(self, reserve_spare: Callable[[], bool]) -> bool:
        """Called by the batch; False if the decode finished first (its result is on its
        way). `reserve_spare` runs under the lock, so the thread sees `replaced` settled."""
        with self._lock:
            if self.state is _Row.DONE:
                return False
            if self.state is _Row.RUNNING:
                self.replaced = reserve_spare()
            self.state = _Row.GIVEN_UP
            return True


class RowFuture(asyncio.Future[DecodeResult]):
    """A row's decode as the event loop sees it, with the ticket that guards the row."""

    def __init__(self, loop: asyncio.AbstractEventLoop, job: Job) -> None:
        super().__init__(loop=loop)
        self.ticket = RowTicket()
        self.job = job


@dataclass(frozen=True)
class _Work:
    job: Job
    out: npt.NDArray[np.uint8]
    may_defer: bool
    future: RowFuture


class DecodePool:
    def __init__(
        self,
        spec: DecodeSpec,
        threads: int,
        path_root: Path | None,
        *,
        delay_hook: Callable[[Job], None] | None = None,
        gpu_router: GpuDecodeRouter | None = None,
        cache: DecodeCache | None = None,
        budget_s: float = 10.0,
    ) -> None:
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive (got {budget_s})")
        self.spec = spec
        self.threads = threads
        self.path_root = path_root
        self.budget_s = budget_s
        # Lets the doctor and tests simulate a slow decoder without touching the real one.
        self._delay_hook = delay_hook
        self.gpu_router = gpu_router
        self.cache = cache if cache is not None and cache.enabled else None
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._spares = 0  # spare threads standing in for threads held by given-up decodes
        self._closed = False
        self._started = 0
        self._spawned: list[threading.Thread] = []
        self.given_up = 0  # rows given up so far
        for _ in range(threads):
            self._start_thread()

    @property
    def spare_threads(self) -> int:
        """Threads currently standing in for ones held by decodes that were given up."""
        return self._spares

    def submit(self, job: Job, out: npt.NDArray[np.uint8]) -> asyncio.Future[DecodeResult]:
        """Queue `job` for decoding into the staging row `out`; `settle` waits for it."""
        future = RowFuture(asyncio.get_running_loop(), job)
        self._work.put(_Work(job, out, True, future))
        return future

    async def decode_on_cpu(self, job: Job, out: npt.NDArray[np.uint8]) -> DecodeResult:
        """Decode on a CPU thread whatever the router says (the GPU fallback)."""
        future = RowFuture(asyncio.get_running_loop(), job)
        self._work.put(_Work(job, out, False, future))
        return (await self.settle([future]))[0]

    async def settle(self, futures: Sequence[asyncio.Future[DecodeResult]]) -> list[DecodeResult]:
        """The results of a batch's rows, giving up each row still decoding `budget_s` after
        its thread started on it. Rows not yet started are waited for: with spare threads
        standing in for stuck ones, they start as soon as the decodes ahead of them end."""
        pending = {f for f in futures if not f.done()}
        while pending:
            now = time.monotonic()
            deadlines = [self._deadline(f, now) for f in pending if isinstance(f, RowFuture)]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            _, pending = await asyncio.wait(pending, timeout=timeout)
            now = time.monotonic()
            for f in list(pending):
                if not isinstance(f, RowFuture):
                    continue
                started = f.ticket.started_s
                if started is not None and now - started >= self.budget_s and self._give_up(f):
                    pending.discard(f)
        return [f.result() for f in futures]

    def _deadline(self, future: RowFuture, now: float) -> float:
        started = future.ticket.started_s
        # Not started yet: look again a budget from now (it cannot be over budget before).
        return (now if started is None else started) + self.budget_s

    def _give_up(self, future: RowFuture) -> bool:
        """Answer a row over budget with decode_timeout, and replace its thread."""
        ticket = future.ticket
        if not ticket.give_up(self._reserve_spare):
            return False
        started = ticket.started_s if ticket.started_s is not None else time.monotonic()
        elapsed_ms = (time.monotonic() - started) * 1000
        budget_ms = round(self.budget_s * 1000)
        error = DecodeError(
            ErrorCode.DECODE_TIMEOUT,
            f"decoding took longer than the budget of {budget_ms} ms; "
            "the batch went on without this image",
        )
        if not future.done():
            future.set_result(DecodeResult(None, error, elapsed_ms))
        self.given_up += 1
        if ticket.replaced:
            self._start_thread()
        log.warning(
            "decode_over_budget",
            job_id=future.job.job_id,
            entry=future.job.entry_id,
            budget_ms=budget_ms,
            spare_thread=ticket.replaced,
            spare_threads=self._spares,
        )
        return True

    def _reserve_spare(self) -> bool:
        with self._lock:
            if self._closed or self._spares >= self.threads:
                return False
            self._spares += 1
            return True

    def _start_thread(self) -> None:
        self._started += 1
        thread = threading.Thread(
            target=self._serve, name=f"gpufeed-decode-{self._started}", daemon=True
        )
        # Daemon: a decode given up may still run at exit; it must not hold the process.
        thread.start()
        self._spawned = [t for t in self._spawned if t.is_alive()]
        self._spawned.append(thread)

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            ticket = work.future.ticket
            if not ticket.start():
                continue
            result = self._decode(work.job, work.out, work.may_defer, ticket)
            given_up, replaced = ticket.finish()
            if not given_up:
                _deliver(work.future, result)
            if replaced:
                # A spare took this thread's place while it was stuck: retire.
                with self._lock:
                    self._spares -= 1
                return

    def _decode(
        self, job: Job, out: npt.NDArray[np.uint8], may_defer: bool, ticket: RowTicket
    ) -> DecodeResult:
        start = time.perf_counter()
        try:
            if self._delay_hook is not None:
                self._delay_hook(job)
            if job.cached_row is not None:
                # A `url` job the server said had not changed: its row from the cache.
                row, row_info = job.cached_row
                ticket.write(out, row)
                return DecodeResult(
                    row_info, None, (time.perf_counter() - start) * 1000, cached=True
                )
            if job.image is not None:
                data = job.image
            elif job.path is not None:
                data = read_job_path(job.path, self.path_root, self.spec.max_bytes)
            else:
                raise DecodeError(ErrorCode.INVALID_JOB, "nothing to decode")
            key = None
            if self.cache is not None and data:
                key = job.cache_key or cache_key(data, job.reply_to)
            if key is not None and self.cache is not None:
                entry = self.cache.get(key)
                if entry is not None:
                    row, info = entry
                    ticket.write(out, row)
                    ms = (time.perf_counter() - start) * 1000
                    return DecodeResult(info, None, ms, cached=True)
            if may_defer and self.gpu_router is not None:
                gpu = self.gpu_router.route(data, self.spec)
                if gpu is not None:
                    ms = (time.perf_counter() - start) * 1000
                    return DecodeResult(gpu.info, None, ms, gpu=gpu)
            check_row(out, self.spec)
            pixels, info = decode_pixels(data, self.spec)
            if ticket.write(out, pixels) and key is not None and self.cache is not None:
                # The row is ours until this result is delivered: the batch waits for it.
                self.cache.put(key, out, info)
            return DecodeResult(info, None, (time.perf_counter() - start) * 1000)
        except DecodeError as exc:
            return DecodeResult(None, exc, (time.perf_counter() - start) * 1000)
        except Exception as exc:  # noqa: BLE001 - one bad job must never take down its batch
            err = DecodeError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            return DecodeResult(None, err, (time.perf_counter() - start) * 1000)

    def shutdown(self) -> None:
        """Drop queued rows, let running decodes end (up to a budget), stop the threads.
        Threads held by decodes given up are not waited for."""
        with self._lock:
            self._closed = True
        while True:
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work.future.ticket.give_up(lambda: False)
                _cancel(work.future)
        for _ in range(self.threads):
            self._work.put(None)
        deadline = time.monotonic() + self.budget_s
        for thread in self._spawned:
            thread.join(max(0.0, deadline - time.monotonic()))


def _deliver(future: RowFuture, result: DecodeResult) -> None:
    def resolve() -> None:
        if not future.done():
            future.set_result(result)

    # The loop may be gone when a decode ends after shutdown: nobody waits for it then.
    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(resolve)


def _cancel(future: RowFuture) -> None:
    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(future.cancel)
