"""The decode thread pool: reads a job's bytes and decodes them into a staging row.

libjpeg-turbo and PIL release the GIL while they decode and resize, so threads give real
parallelism here without the cost of shipping pixels between processes. With `row_side`
set (the device placement) a row receives the decoded pixels and their geometry
(worker/decode/rows.py) instead of a resized square.

Every image has a decode budget (the tuning constant DECODE_BUDGET_MS), counted from when a thread
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import structlog

from worker.decode import gil_account
from worker.decode.cache import DecodeCache
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, check_row, write_row
from worker.decode.executor import DecodeExecutor, DecodeGroup, DecodeResult, over_budget
from worker.decode.gpu import GpuDecodeRouter
from worker.decode.row_policy import RowPolicy
from worker.decode.rows import DecodedRow, write_decoded_row

if TYPE_CHECKING:
    # For annotations only: importing it at run time would tie this folder to a layer above it.
    from worker.jobs import Job

log = structlog.get_logger("gpufeed.decode")


class _Row(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    GIVEN_UP = "given_up"


class RowTicket:
    """Who may still write one staging row: its decode thread, until the batch gives it up.

    The thread's final copy into the row and the batch's give-up take the same lock (its
    group's), so either the copy happened before the batch went on, or it never happens.
    """

    __slots__ = ("_lock", "out", "replaced", "started_s", "state")

    # The staging row it guards: set by the thread that decodes it, before its decode
    # starts (not here, on the event loop: a view of the row is an allocation per row).
    out: npt.NDArray[np.uint8]

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.state = _Row.QUEUED
        self.started_s: float | None = None
        # A spare thread took the place of the thread running this decode.
        self.replaced = False

    def write(
        self,
        out: npt.NDArray[np.uint8],
        pixels: Any,
        writer: Callable[[npt.NDArray[np.uint8], Any], None] = write_row,
    ) -> bool:
        """Copy `pixels` into the row with `writer` and mark it done, unless it was given
        up."""
        with self._lock:
            if self.state is not _Row.RUNNING:
                return False
            if gil_account.switch.on:
                # The copy releases the GIL: the bench and doctor count it apart.
                gil_account.timed(writer, out, pixels)
            else:
                writer(out, pixels)
            self.state = _Row.DONE
            return True


class RowGroup:
    """Rows of one batch that went to the pool together (what one read gave the batch).

    The group is queued once per thread that may work on it; each thread claims the next
    row not yet started, so the rows still decode in parallel, and a thread stuck on one
    row holds up only that row. The thread that ends the last row wakes the event loop,
    once per group, not once per row.
    """

    def __init__(
        self,
        future: asyncio.Future[Any],
        jobs: Sequence[Job],
        outs: Sequence[npt.NDArray[np.uint8]] | npt.NDArray[np.uint8],
        *,
        may_defer: bool,
        until: float | None = None,
    ) -> None:
        self.future = future  # resolved by `resolve()` once every row has its result
        # A time.monotonic() past which every row not decoded is given up (None: each
        # row's budget alone).
        self.until = until
        self.jobs = jobs
        self.outs = outs  # outs[i]: row i's staging row
        self.may_defer = may_defer
        self.lock = threading.Lock()
        self.tickets = [RowTicket(self.lock) for _ in jobs]
        self.results: list[DecodeResult | None] = [None] * len(jobs)
        self.left = len(jobs)  # rows without a result yet
        self._next = 0

    def done(self) -> bool:
        return self.left == 0 or self.future.done()

    def claim(self) -> int | None:
        """The next row still queued, now running on the calling thread; None when none."""
        with self.lock:
            while self._next < len(self.tickets):
                row = self._next
                self._next += 1
                ticket = self.tickets[row]
                if ticket.state is _Row.QUEUED:
                    ticket.state = _Row.RUNNING
                    ticket.started_s = time.monotonic()
                    return row
            return None

    def finish(self, row: int, result: DecodeResult) -> tuple[bool, bool]:
        """The thread is done with `row`: keep its result unless the row was given up.
        Returns (the thread was replaced by a spare, this was the group's last row)."""
        with self.lock:
            ticket = self.tickets[row]
            if ticket.state is _Row.RUNNING:
                ticket.state = _Row.DONE
            if ticket.state is _Row.GIVEN_UP:
                return ticket.replaced, False
            self.results[row] = result
            self.left -= 1
            return ticket.replaced, self.left == 0

    def give_up(self, row: int, reserve_spare: Callable[[], bool], result: DecodeResult) -> bool:
        """Called by the batch; False if the decode finished first (its result is kept).
        `reserve_spare` runs under the lock, so the thread sees `replaced` settled."""
        with self.lock:
            ticket = self.tickets[row]
            if ticket.state is _Row.DONE or ticket.state is _Row.GIVEN_UP:
                return False
            if ticket.state is _Row.RUNNING:
                ticket.replaced = reserve_spare()
            ticket.state = _Row.GIVEN_UP
            self.results[row] = result
            self.left -= 1
            return True

    def drop_queued(self) -> None:
        """Shutdown: rows not started are never decoded."""
        with self.lock:
            for ticket in self.tickets:
                if ticket.state is _Row.QUEUED:
                    ticket.state = _Row.GIVEN_UP

    def deadline(self, now: float, budget_s: float) -> float:
        """When the next running row goes over budget (rows not started: a budget from now;
        they cannot be over budget before), or the group's `until`."""
        soonest = now + budget_s if self.until is None else min(now + budget_s, self.until)
        for ticket in self.tickets:
            started = ticket.started_s
            if ticket.state is _Row.RUNNING and started is not None:
                soonest = min(soonest, started + budget_s)
        return soonest

    def overdue(self, now: float, budget_s: float) -> list[int]:
        if self.until is not None and now >= self.until:
            return [
                row
                for row, ticket in enumerate(self.tickets)
                if ticket.state is _Row.RUNNING or ticket.state is _Row.QUEUED
            ]
        return [
            row
            for row, ticket in enumerate(self.tickets)
            if ticket.state is _Row.RUNNING
            and ticket.started_s is not None
            and now - ticket.started_s >= budget_s
        ]

    def resolve(self) -> None:
        """On the event loop: every row has its result."""
        if self.future.done():
            return
        if isinstance(self.future, RowFuture):
            result = self.results[0]
            assert result is not None
            self.future.set_result(result)
        else:
            self.future.set_result(None)


class ThreadRows(RowPolicy[RowTicket, DecodeResult]):
    """The row policy (worker/decode/row_policy.py) on decode threads: a row is a staging
    row under its ticket, which the batch may give up, answered by a DecodeResult. The GPU
    is offered a row, through the router, after the decode cache missed."""

    def __init__(
        self,
        spec: DecodeSpec,
        *,
        row_side: int,
        path_root: Path | None,
        cache: DecodeCache | None,
        delay: Callable[[Job], None] | None,
        router: GpuDecodeRouter | None,
    ) -> None:
        super().__init__(spec, row_side=row_side, path_root=path_root, cache=cache, delay=delay)
        self.router = router
        self.writer = write_decoded_row if row_side else write_row
        self._lock = threading.Lock()
        self.reduced = 0
        self.reduced_ms = 0.0

    def offer(
        self,
        row: RowTicket,
        data: bytes | memoryview,
        namespace: str | None,
        start: float,
        *,
        staged: bool,
    ) -> DecodeResult | None:
        router = self.router
        if router is None:
            return None
        gpu = router.route(data if isinstance(data, bytes) else bytes(data), self.spec)
        if gpu is None:
            return None
        return DecodeResult(gpu.info, None, (time.perf_counter() - start) * 1000, gpu=gpu)

    def check(self, row: RowTicket) -> None:
        out, side = row.out, self.row_side
        if not side:
            check_row(out, self.spec)
        elif out.shape != (side, side, 3) or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 of shape {(side, side, 3)}, got {out.shape}")

    def copy_kept(self, row: RowTicket, kept: npt.NDArray[np.uint8]) -> None:
        row.write(row.out, kept, self.writer)

    def write(self, row: RowTicket, decoded: DecodedRow | npt.NDArray[np.uint8]) -> bool:
        return row.write(row.out, decoded, self.writer)

    def entry(self, row: RowTicket) -> npt.NDArray[np.uint8]:
        return row.out

    def answer(
        self, row: RowTicket, info: DecodeInfo, start: float, *, cached: bool, reduced: bool
    ) -> DecodeResult:
        ms = (time.perf_counter() - start) * 1000
        if reduced:
            with self._lock:
                self.reduced += 1
                self.reduced_ms += ms
        return DecodeResult(info, None, ms, cached=cached)

    def fail(self, row: RowTicket, error: DecodeError, start: float) -> DecodeResult:
        return DecodeResult(None, error, (time.perf_counter() - start) * 1000)


class RowFuture(asyncio.Future[DecodeResult]):
    """One row submitted alone (`submit`), as the event loop sees it; `group` holds it."""

    group: RowGroup


class DecodePool:
    kind = "threads"

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
        row_side: int = 0,
    ) -> None:
        """`row_side`: rows for the device placement (worker/decode/rows.py) of that side;
        0: S x S rows resized here (the host placement)."""
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive (got {budget_s})")
        self.spec = spec
        self.row_side = row_side
        self.threads = threads
        self.path_root = path_root
        self.budget_s = budget_s
        self.gpu_router = gpu_router
        self._rows = ThreadRows(
            spec,
            row_side=row_side,
            path_root=path_root,
            cache=cache if cache is not None and cache.enabled else None,
            # Lets the doctor and tests simulate a slow decoder without touching the real one.
            delay=delay_hook,
            router=gpu_router,
        )
        self._work: queue.SimpleQueue[RowGroup | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._spares = 0  # spare threads standing in for threads held by given-up decodes
        self._closed = False
        self._started = 0
        self._spawned: list[threading.Thread] = []
        self.given_up = 0  # rows given up so far
        for _ in range(threads):
            self._start_thread()

    @property
    def reduced(self) -> int:
        """Device placement: images too large for a row, fitted to S x S here instead."""
        return self._rows.reduced

    @property
    def reduced_ms(self) -> float:
        return self._rows.reduced_ms

    @property
    def spare_threads(self) -> int:
        """Threads currently standing in for ones held by decodes that were given up."""
        return self._spares

    def submit(self, job: Job, out: npt.NDArray[np.uint8]) -> asyncio.Future[DecodeResult]:
        """Queue `job` alone for decoding into the staging row `out`; `settle` waits for it."""
        future = RowFuture(loop=asyncio.get_running_loop())
        future.group = RowGroup(future, [job], [out], may_defer=True)
        self._queue(future.group)
        return future

    def submit_rows(
        self,
        jobs: Sequence[Job],
        rows: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
        *,
        gpu: bool = True,
        until: float | None = None,
    ) -> RowGroup:
        """Queue `jobs` for decoding into `rows` (rows[i] for jobs[i]) as one group; `settle`
        waits for it. `gpu`: rows may be left for the GPU decoder (False: decoded here).
        `until`: a time.monotonic() past which every row not decoded is given up
        (`decode_timeout`), started or not."""
        group = RowGroup(
            asyncio.get_running_loop().create_future(), jobs, rows, may_defer=gpu, until=until
        )
        self._queue(group)
        return group

    def _queue(self, group: RowGroup) -> None:
        # Once per thread that may take part: each copy lets one more thread claim rows.
        for _ in range(min(len(group.jobs), self.threads)):
            self._work.put(group)

    async def redecode(
        self, jobs: Sequence[Job], rows: Sequence[npt.NDArray[np.uint8]]
    ) -> list[DecodeResult]:
        """Decode `jobs` into `rows` on the CPU threads whatever the router says (the rows
        the GPU decoder failed)."""
        return await self.settle([self.submit_rows(jobs, rows, gpu=False)])

    async def decode_on_cpu(self, job: Job, out: npt.NDArray[np.uint8]) -> DecodeResult:
        """`redecode` of one row (the threads' GPU decoder's fallback, row by row)."""
        return (await self.redecode([job], [out]))[0]

    async def settle(self, groups: Sequence[DecodeGroup]) -> list[DecodeResult]:
        """The results of a batch's rows in order, giving up each row still decoding
        `budget_s` after its thread started on it. Rows not yet started are waited for: with
        spare threads standing in for stuck ones, they start as soon as the decodes ahead of
        them end. `groups`: what `submit_rows` and `submit` returned (or any futures)."""
        parts = [_part(g) for g in groups]
        row_groups = [p for p in parts if isinstance(p, RowGroup)]
        while True:
            waiting = [p.future if isinstance(p, RowGroup) else p for p in parts if not p.done()]
            if not waiting:
                break
            now = time.monotonic()
            open_groups = [g for g in row_groups if not g.done()]
            deadline = min((g.deadline(now, self.budget_s) for g in open_groups), default=None)
            timeout = None if deadline is None else max(0.0, deadline - now)
            await asyncio.wait(waiting, timeout=timeout)
            now = time.monotonic()
            for group in open_groups:
                for row in group.overdue(now, self.budget_s):
                    self._give_up(group, row)
        results: list[DecodeResult] = []
        for part in parts:
            if isinstance(part, RowGroup):
                if part.future.cancelled():
                    raise asyncio.CancelledError
                results.extend(r for r in part.results if r is not None)
            else:
                results.append(part.result())
        return results

    def _give_up(self, group: RowGroup, row: int) -> bool:
        """Answer a row over budget with decode_timeout, and replace its thread."""
        ticket = group.tickets[row]
        started = ticket.started_s if ticket.started_s is not None else time.monotonic()
        elapsed_ms = (time.monotonic() - started) * 1000
        budget_ms = round(self.budget_s * 1000)
        error = over_budget(budget_ms)
        if not group.give_up(row, self._reserve_spare, DecodeResult(None, error, elapsed_ms)):
            return False
        self.given_up += 1
        if ticket.replaced:
            self._start_thread()
            # The stuck thread may have held the group's only place in the work queue.
            self._work.put(group)
        if group.left == 0:
            group.resolve()
        job = group.jobs[row]
        log.warning(
            "decode_over_budget",
            job_id=job.job_id,
            entry=job.entry_id,
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
            group = self._work.get()
            if group is None:
                return
            while not self._closed and (row := group.claim()) is not None:
                result = self._decode(
                    group.jobs[row], group.outs[row], group.may_defer, group.tickets[row]
                )
                replaced, last = group.finish(row, result)
                if last:
                    _wake(group)
                if replaced:
                    # A spare took this thread's place while it was stuck: retire.
                    with self._lock:
                        self._spares -= 1
                    return

    def _decode(
        self, job: Job, out: npt.NDArray[np.uint8], may_defer: bool, ticket: RowTicket
    ) -> DecodeResult:
        ticket.out = out
        gpu = may_defer and self.gpu_router is not None
        return self._rows.run(
            ticket,
            job.image,
            job.path,
            namespace=job.reply_to,
            key=job.cache_key,
            kept=job.cached_row,
            gpu=gpu,
            subject=job,
        )

    def shutdown(self) -> None:
        """Drop queued rows, let running decodes end (up to a budget), stop the threads.
        Threads held by decodes given up are not waited for."""
        with self._lock:
            self._closed = True
        while True:
            try:
                group = self._work.get_nowait()
            except queue.Empty:
                break
            if group is not None:
                group.drop_queued()
                _cancel(group)
        for _ in range(self.threads):
            self._work.put(None)
        deadline = time.monotonic() + self.budget_s
        for thread in self._spawned:
            thread.join(max(0.0, deadline - time.monotonic()))


def _part(group: DecodeGroup) -> RowGroup | asyncio.Future[DecodeResult]:
    if isinstance(group, RowFuture):
        return group.group
    if isinstance(group, (RowGroup, asyncio.Future)):
        return group
    raise TypeError(f"decode threads settle only the rows they were given, not {group!r}")


def _wake(group: RowGroup) -> None:
    # The loop may be gone when a decode ends after shutdown: nobody waits for it then.
    with contextlib.suppress(RuntimeError):
        group.future.get_loop().call_soon_threadsafe(group.resolve)


def _cancel(group: RowGroup) -> None:
    with contextlib.suppress(RuntimeError):
        group.future.get_loop().call_soon_threadsafe(group.future.cancel)


if TYPE_CHECKING:

    def _keeps_the_contract(pool: DecodePool) -> DecodeExecutor:
        return pool
