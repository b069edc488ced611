"""Decode in processes: the worker only hands out rows; K processes decode them.

Threads that retake the GIL for every image starve behind a busy event loop (the GIL's
switch interval is paid at each retake), so past a few cores an in-process decode pool
cannot feed a GPU. Here each decode process (worker/decode/process_main.py) runs
libjpeg-turbo and Pillow with a GIL of its own and writes pixels straight into the staging
ring, which lives in memory shared with the worker (worker/decode/arena.py) and is the
very memory the host-to-device copy reads: no copy between decode and the device.

What the worker does per group of rows (what one read gave a batch) is one message per
process: the rows are cut into at most K contiguous runs, each sent with its payload bytes
by that process's sender thread (a blocking send, without the GIL), and each process
answers once per run. Each row's outcome is a record in the shared result table.

Rows go to the processes by load: each process's share of a group is what brings the
longest queue of rows sent and not yet answered down as far as it goes. With the decode
cache on, an image goes back to the process it was last sent to (where it is cached) only
within that process's share, so affinity never lengthens a queue: images that share a
fingerprint (a length and a tail, which a sender controls) spread like any others. Each
process decodes its run cheapest first (worker/decode/process_main.py), so a small image
never waits behind a large one sent with it.

The decode budget (the constant DECODE_BUDGET_MS) bounds each run, counted from the start of its
first row, not each image alone: images that each decode within the budget cannot together
hold a batch for many budgets. Each process notes in shared memory which run and row it
works on and since when the run started; a run past the budget has its process killed and
replaced, the row it was on answered `decode_timeout`, and so is each row of that run not
started yet (they waited behind the others for the whole budget); the runs of other groups
it held are sent to its replacement. A process that dies on its own (a crash in a codec) is
handled the same way: its row is answered `internal_error`, the others are decoded by the
replacement, no job is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import structlog

from producer.wire import ErrorCode
from worker.base.errors import GpufeedError
from worker.decode import gil_account
from worker.decode.arena import DEFERRED, DONE, ERROR_CODES, PENDING, SharedArena
from worker.decode.cache import DecodeCache
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec
from worker.decode.executor import DecodeExecutor, DecodeGroup, DecodeResult, over_budget
from worker.decode.gpu_packed import DeferredRow
from worker.decode.packed import SlotFull
from worker.decode.payloads import PayloadMemory
from worker.decode.process_main import DECODE, DecodeInit, Run, RunDone, copy_kept
from worker.ipc.child import READY_TIMEOUT_S, Child, ChildNotReady, Restarts
from worker.ipc.messages import Ready

if TYPE_CHECKING:
    # For annotations only: importing it at run time would tie this folder to a layer above it.
    from worker.jobs import Job

log = structlog.get_logger("gpufeed.decode")

# What each decode process runs (`python -m`).
CHILD_MODULE = "worker.decode.process_main"
# Processes that die before they are ready, in a row, before the pool gives up on them.
_MAX_FAILED_STARTS = 3
# Processes ending on the same rows with none of them started, before those rows fail.
_MAX_ATTEMPTS = 3
# Images whose process is remembered (a hundred bytes or so each, a few MB in all) before
# the memory starts over: a forgotten image costs one more decode, no more.
_PLACES_KEPT = 1 << 16


class DecodeProcessesFailed(GpufeedError, RuntimeError):
    """The decode processes cannot start (a broken install, no memory)."""


class ProcessGroup:
    """Rows of one batch sent to the processes together; `settle` waits for it."""

    def __init__(
        self,
        future: asyncio.Future[None],
        jobs: Sequence[Job],
        rows: list[int],
        *,
        sent_ns: int,
        until_ns: int | None = None,
    ) -> None:
        self.future = future
        self.jobs = jobs
        self.rows = rows  # rows[i]: the ring row of jobs[i]
        # time.monotonic_ns() when the rows were handed over, and past which those not
        # decoded are answered without it, started or not (None: the budget alone).
        self.sent_ns = sent_ns
        self.until_ns = until_ns
        self.results: list[DecodeResult | None] = [None] * len(jobs)
        self.left = len(jobs)
        # gpu[i]: the process may leave jobs[i] for the GPU decoder (empty: none may).
        self.gpu: list[bool] = []

    def done(self) -> bool:
        return self.left == 0 or self.future.done()

    def set(self, position: int, result: DecodeResult) -> None:
        if self.results[position] is not None:
            return
        self.results[position] = result
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(None)


@dataclass(eq=False)
class _Item:
    """A run of one group's rows sent to one process, answered by one message."""

    token: int
    group: ProcessGroup
    positions: list[int]  # indices into group.jobs
    # How many processes ended while holding these rows, none of them blamed on a row: a
    # process that dies before it starts a row (a fault outside any decode) would otherwise
    # have the rows sent on for ever.
    attempts: int = 0


@dataclass(eq=False)
class _Process:
    slot: int  # its progress record in the arena
    child: Child
    items: dict[int, _Item] = field(default_factory=dict)
    # Rows sent and not yet answered: what routing balances.
    load: int = 0


class ProcessDecodePool:
    """K decode processes writing into the shared ring; the worker's side of them."""

    kind = "processes"

    def __init__(
        self,
        spec: DecodeSpec,
        processes: int,
        path_root: Path | None,
        *,
        arena: SharedArena,
        budget_s: float = 10.0,
        row_side: int = 0,
        cache_bytes: int = 0,
        cache_counts: DecodeCache | None = None,
        delay_s: float = 0.0,
        max_image_pixels: int = 0,
        payloads: PayloadMemory | None = None,
    ) -> None:
        """`cache_bytes`: the decode cache, split among the processes (each image goes to
        the process its bytes' fingerprint names, so a repeated image meets its cached
        row); `cache_counts`: the worker's own cache, where hits and misses are counted and
        `url` jobs' rows are kept under their URL's key (the fetch stage serves a 304 from
        it); `payloads`: the payload memory the intake's process fills, which the processes
        read a job's bytes from where its `payload_at` says."""
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive (got {budget_s})")
        if not 1 <= processes <= arena.layout.processes:
            raise ValueError(f"processes must be between 1 and {arena.layout.processes}")
        self.spec = spec
        self.processes = processes
        self.arena = arena
        self.path_root = path_root
        self.budget_s = budget_s
        self.row_side = row_side
        # Each process keeps its own decode cache: an equal share of the setting.
        self.cache_bytes = cache_bytes // processes
        self.cache_counts = cache_counts
        self.url_cache = cache_counts if cache_counts is not None and cache_counts.enabled else None
        self.delay_s = delay_s
        self.payloads = payloads
        self.max_image_pixels = max_image_pixels or spec.max_pixels
        # The share of the rows offered to the GPU decoder (worker/decode/gpu_packed.py; 0:
        # none): the processes decode the rest, and what the GPU's hardware cannot take.
        self.gpu_share = 0.0
        # Of the thumbnails offered, the fraction the processes leave for the GPU (they
        # decode the rest): thumbnails get a share of their own (gpu_packed.DecodeRates).
        self.gpu_thumbnail_accept = 1.0
        self._gpu_credit = 0.0
        self.deferred = 0
        self.given_up = 0
        self.crashed = 0
        self.replaced = 0
        self.reduced = 0
        self.reduced_ms = 0.0
        self.broken: str | None = None
        # Processes that died before they were ready, in a row.
        self._starts = Restarts(_MAX_FAILED_STARTS)
        self._tokens = itertools.count(1)
        self._next = 0  # the process that gets the next group's first run
        # With the cache on: the process each image (by its fingerprint) was last sent to.
        self._placed: dict[int, int] = {}
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._procs = [self._spawn(slot) for slot in range(processes)]
        self._wait_ready()

    # The doctor, bench and GPU check count decoders as threads.
    @property
    def threads(self) -> int:
        return self.processes

    @property
    def spare_threads(self) -> int:
        return 0

    @property
    def pids(self) -> list[int]:
        return [p.child.pid for p in self._procs]

    # ---------------------------------------------------------------- processes
    def _spawn(self, slot: int) -> _Process:
        self.arena.progress[slot] = (0, -1, 0)
        memory = self.payloads
        child = Child(
            CHILD_MODULE,
            wire=DECODE,
            sender=f"gpufeed-decode-send-{slot}",
            fds=(self.arena.fd,) if memory is None else (self.arena.fd, memory.fd),
            send_buffer=4 << 20,
            sendmsg=_sendmsg,
        )
        child.send(
            DecodeInit(
                slot=slot,
                layout=self.arena.layout.__dict__,
                spec=self.spec.__dict__,
                row_side=self.row_side,
                path_root=str(self.path_root or ""),
                cache_bytes=self.cache_bytes,
                delay_s=self.delay_s,
                max_image_pixels=self.max_image_pixels,
                payloads_size=memory.size if memory is not None else 0,
            )
        )
        proc = _Process(slot, child)
        child.watch(self._loop, self._on_answer, proc)
        return proc

    def _wait_ready(self) -> None:
        """Start-up only: every process imported its decoders and answered."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.child.wait_ready(deadline, partial(self._take, proc))
            except ChildNotReady as exc:
                self.shutdown()
                raise DecodeProcessesFailed(
                    exc.said(f"decode process {proc.slot}", "decode processes")
                ) from None

    def _on_answer(self, proc: _Process) -> None:
        messages = proc.child.receive()
        if messages is None:
            if proc in self._procs:
                self._retire(proc, cause="crash")
            return
        for message in messages:
            self._take(proc, message)

    def _take(self, proc: _Process, message: Any) -> None:
        if isinstance(message, RunDone):
            item = proc.items.pop(message.token, None)
            if item is not None:
                proc.load -= len(item.positions)
                self._collect(item)
        elif isinstance(message, Ready):
            self._starts.proved()

    def _collect(self, item: _Item) -> None:
        group = item.group
        positions = [p for p in item.positions if group.results[p] is None]
        rows = [group.rows[p] for p in positions]
        jobs = [group.jobs[p] for p in positions]
        for position, row, result in zip(positions, rows, self._results(rows, jobs), strict=True):
            key = group.jobs[position].cache_key
            if (
                key is not None
                and result.info is not None
                and result.gpu is None  # a row left for the GPU has no pixels on the host
                and self.url_cache is not None
            ):
                # The fetch stage serves this URL's next 304 from here.
                packed = self.arena.packed
                kept = packed.entry(row) if packed is not None else self.arena.rows[row]
                self.url_cache.put(key, kept, result.info)
            group.set(position, result)

    def _result(self, row: int, job: Job) -> DecodeResult:
        return self._results([row], [job])[0]

    def _results(self, rows: list[int], jobs: Sequence[Job]) -> list[DecodeResult]:
        """The records of `rows` (of `jobs`), read as one copy of the table's rows (a field
        read per record costs microseconds in numpy; `tolist` gives plain values at once)."""
        out: list[DecodeResult] = []
        records = self.arena.table[rows].tolist()
        for row, job, record in zip(rows, jobs, records, strict=True):
            state, width, height, draft, us, cached, reduced, error, fmt, staged, message = record
            ms = us / 1000
            left = self._deferred(row, job, staged, height, width) if state == DEFERRED else None
            if left is not None:
                self.deferred += 1
                info = DecodeInfo("JPEG", width, height, 1)
                out.append(DecodeResult(info, None, ms, gpu=left))
            elif state == DONE:
                if reduced:
                    self.reduced += 1
                    self.reduced_ms += ms
                if self.cache_counts is not None and self.cache_bytes:
                    if cached:
                        self.cache_counts.hits += 1
                    else:
                        self.cache_counts.misses += 1
                info = DecodeInfo(fmt.decode("ascii", "replace"), width, height, draft)
                out.append(DecodeResult(info, None, ms, cached=bool(cached)))
            elif error >= 0:
                failure = DecodeError(ERROR_CODES[error], message.decode("utf-8", "replace"))
                out.append(DecodeResult(None, failure, ms))
            else:  # left for the GPU with nothing it could decode from: never a guess
                why = f"the decode process left row {row} in state {state} with no answer"
                out.append(DecodeResult(None, DecodeError(ErrorCode.INTERNAL_ERROR, why), ms))
        return out

    def _deferred(
        self, row: int, job: Job, staged: int, height: int, width: int
    ) -> DeferredRow | None:
        """What the GPU decoder takes for a row a process left it: the job's bytes, or
        those the process staged in the slot (a `path` job's) with the place they are at;
        None where it has neither (the row is then answered as an internal error)."""
        packed = self.arena.packed
        if staged <= 0 or packed is None:
            return DeferredRow(row, job.image, height, width) if job.image is not None else None
        offset, _ = packed.place(row)
        data = memoryview(packed.memory[row // packed.batch])[offset : offset + staged]
        return DeferredRow(row, data, height, width, offset=offset)

    def _retire(self, proc: _Process, *, cause: str) -> None:
        """End `proc` (`timeout`: its run is past the budget, or it holds rows of a group
        past its `until`; `crash`: it died), answer the row it was on and the rows of the
        groups out of time, and send the other rows it had not finished to a new process in
        its place."""
        code = proc.child.end(0)
        # Read once the process is gone: nothing moves under the reads any more.
        progress = self.arena.progress
        token = int(progress["token"][proc.slot])
        on = int(progress["row"][proc.slot]) if token in proc.items else None
        now = time.monotonic_ns()
        # The process's run: when it started, and whether it is past the budget.
        on_ms = (now - int(progress["started_ns"][proc.slot])) / 1e6
        run_over = on is not None and on_ms >= self.budget_s * 1000
        index = self._procs.index(proc)
        log.warning(
            "decode_process_replaced",
            cause=cause,
            pid=proc.child.pid,
            exit_code=code,
            rows_held=sum(len(item.positions) for item in proc.items.values()),
        )
        # Ended by us, a process that had not started yet says nothing about the install.
        if not proc.child.ready and cause == "crash":
            self._starts.charge()
        if self._closed:
            return
        if self._starts.given_up:
            self.broken = f"decode processes exit before they are ready (last exit code {code})"
            log.error("decode_processes_broken", reason=self.broken)
        replacement = None if self.broken else self._spawn(proc.slot)
        if replacement is not None:
            self._procs[index] = replacement
            self.replaced += 1
        else:
            self._procs.pop(index)
        state = self.arena.table["state"]
        # A crash on a row of its own: that row is answered, the others are not at fault.
        # Otherwise it ended between rows, and every row it held counts an attempt; a
        # process we ended counts none (the rows it held had done nothing wrong).
        blamed = on is not None and int(state[on]) == PENDING
        counted = cause == "crash" and not blamed
        for item in proc.items.values():
            group = item.group
            expired = cause == "timeout" and (
                (item.token == token and run_over)
                or (group.until_ns is not None and group.until_ns <= now)
            )
            left: list[int] = []
            waited: list[int] = []
            for position in item.positions:
                ring_row = group.rows[position]
                if group.results[position] is not None:
                    continue
                job = group.jobs[position]
                if int(state[ring_row]) != PENDING:
                    group.set(position, self._result(ring_row, job))
                elif ring_row == on and item.token == token and (cause == "crash" or expired):
                    group.set(position, DecodeResult(None, self._blame(job, cause, code), on_ms))
                elif expired:
                    waited.append(position)
                else:
                    left.append(position)
            if waited:
                self._waited(group, waited, now)
            if left:
                attempts = item.attempts + 1 if counted else item.attempts
                if replacement is None:
                    self._fail(group, left, self.broken or "decode processes are gone")
                elif attempts >= _MAX_ATTEMPTS:
                    self._fail(
                        group,
                        left,
                        f"decode processes ended {attempts} times before decoding this image "
                        f"(last exit code {code})",
                    )
                else:
                    self._send(replacement, group, left, attempts=attempts)
        proc.items.clear()

    def _waited(self, group: ProcessGroup, positions: list[int], now_ns: int) -> None:
        """Answer the rows of `group` that its whole budget went by without a start: they
        waited behind other images (one line for the lot, each job named)."""
        budget_ms = round(self.budget_s * 1000)
        waited_ms = (now_ns - group.sent_ns) / 1e6
        error = waited_over_budget(budget_ms)
        for position in positions:
            group.set(position, DecodeResult(None, error, waited_ms))
        self.given_up += len(positions)
        log.warning(
            "decode_waited_over_budget",
            job_ids=[group.jobs[p].job_id for p in positions],
            budget_ms=budget_ms,
        )

    def _blame(self, job: Job, cause: str, code: int | None) -> DecodeError:
        """The error of the row a process was on when it ended: over budget, or dead."""
        if cause == "timeout":
            self.given_up += 1
            budget_ms = round(self.budget_s * 1000)
            log.warning(
                "decode_over_budget",
                job_id=job.job_id,
                entry=job.entry_id,
                budget_ms=budget_ms,
                process_replaced=True,
            )
            return over_budget(budget_ms)
        self.crashed += 1
        log.error("decode_process_died", job_id=job.job_id, entry=job.entry_id, exit_code=code)
        return DecodeError(
            ErrorCode.INTERNAL_ERROR,
            f"the decode process ended (exit code {code}) while decoding this image; it was "
            "replaced",
        )

    # ---------------------------------------------------------------- rows
    def submit_rows(
        self,
        jobs: Sequence[Job],
        rows: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
        *,
        gpu: bool = True,
        until: float | None = None,
    ) -> ProcessGroup:
        """Send `jobs` to be decoded into `rows` (ring rows, rows[i] for jobs[i]); `settle`
        waits for them. `gpu`: offer `gpu_share` of them to the GPU decoder (False: the
        rows the GPU failed, sent back here). `until`: a time.monotonic() past which the
        rows not decoded are answered `decode_timeout`, started or not (their processes
        replaced), whatever the budget."""
        if isinstance(rows, np.ndarray):
            first = self.arena.row_index(rows)
            ring_rows = list(range(first, first + len(jobs)))
        else:
            ring_rows = [self.arena.row_index(r) for r in rows]
        group = ProcessGroup(
            self._loop.create_future(),
            jobs,
            ring_rows,
            sent_ns=time.monotonic_ns(),
            until_ns=None if until is None else int(until * 1e9),
        )
        self.arena.table["state"][ring_rows] = PENDING
        todo: list[int] = []
        for position, job in enumerate(jobs):
            if job.cached_row is not None:
                # A `url` job the server said had not changed: its row from the fetch cache,
                # copied here (the processes never see the worker's cache).
                row, info = job.cached_row
                try:
                    copy_kept(self.arena, ring_rows[position], row)
                except SlotFull as exc:
                    error = DecodeError(ErrorCode.INTERNAL_ERROR, str(exc))
                    group.set(position, DecodeResult(None, error, 0.0))
                    continue
                group.set(position, DecodeResult(info, None, 0.0, cached=True))
            else:
                todo.append(position)
        if self.broken is not None:
            self._fail(group, todo, self.broken)
            return group
        if gpu and self.gpu_share > 0:
            self._offer_to_gpu(group, todo)
        if todo:
            self._route(group, todo)
        return group

    def _offer_to_gpu(self, group: ProcessGroup, todo: list[int]) -> None:
        """Flag `gpu_share` of the rows with bytes at hand, spread evenly over the batch (and
        over batches: the fraction left carries to the next group), so that each process
        gets its part of both."""
        flags = [False] * len(group.jobs)
        share, credit = self.gpu_share, self._gpu_credit
        for position in todo:
            job = group.jobs[position]
            if job.url is not None or (job.image is None and job.path is None):
                # A url job's row is kept by the fetch cache (a 304 is answered from it),
                # which only a host row can fill. A path job's bytes, read in the process,
                # are staged in the slot for the GPU.
                continue
            credit += share
            if credit >= 1.0:
                credit -= 1.0
                flags[position] = True
        self._gpu_credit = credit
        group.gpu = flags

    def _route(self, group: ProcessGroup, todo: list[int]) -> None:
        """Send `todo` (positions in `group`) to the processes by load: each takes its
        share (`shares`). With the cache on, an image the processes met before goes back
        to the process it went to (where its row is cached) while that process is within
        its share; the rest fill the shares left, and are remembered where they went.
        Images are known by a fingerprint: their length and last 64 bytes (a JPEG's
        entropy-coded tail, where images differ, unlike their headers), which a sender
        controls, hence the shares. Work per row: one hash, a look-up and an append."""
        procs = self._procs
        count = len(procs)
        plan = shares([p.load for p in procs], len(todo), self._next)
        base, extra = plan.base, plan.extra
        parts: list[list[int]] = [[] for _ in range(count)]
        # Took one of the `extra` rows (at most one each, so no queue ends over another's).
        bonus = [False] * count
        rest = todo
        marks: dict[int, int] = {}
        if self.cache_bytes:
            rest = []
            jobs = group.jobs
            placed = self._placed
            for position in todo:
                job = jobs[position]
                data = job.image if job.image is not None else job.path
                if data is None:
                    rest.append(position)
                    continue
                mark = hash((len(data), data[-64:]))
                k = placed.get(mark, -1)
                if k >= 0:
                    part = parts[k]
                    room = base[k] - len(part)
                    if room > 0:
                        part.append(position)
                        continue
                    if room == 0 and extra and not bonus[k]:
                        bonus[k] = True
                        extra -= 1
                        part.append(position)
                        continue
                marks[position] = mark
                rest.append(position)
            if len(placed) + len(marks) > _PLACES_KEPT:
                placed.clear()
        taken = 0
        for k in plan.order:
            room = base[k] - len(parts[k])
            if room > 0:
                self._place(parts[k], rest[taken : taken + room], k, marks)
                taken += room
        for k in plan.order:
            if taken == len(rest):
                break
            if not bonus[k]:
                self._place(parts[k], rest[taken : taken + 1], k, marks)
                taken += 1
        used = 0
        for proc, part in zip(procs, parts, strict=True):
            if part:
                used += 1
                self._send(proc, group, part)
        # Equal loads: the next group's rows start where this one's ended.
        self._next = (self._next + used) % count

    def _place(self, part: list[int], positions: list[int], k: int, marks: dict[int, int]) -> None:
        """Add `positions` to process `k`'s part, and remember it as the place of their
        images (`marks`: their fingerprints, where the cache is on)."""
        part.extend(positions)
        if marks:
            placed = self._placed
            for position in positions:
                mark = marks.get(position)
                if mark is not None:
                    placed[mark] = k

    def _send(
        self, proc: _Process, group: ProcessGroup, positions: list[int], *, attempts: int = 0
    ) -> None:
        token = next(self._tokens)
        item = _Item(token, group, positions, attempts)
        proc.items[token] = item
        proc.load += len(positions)
        rows: list[int] = []
        lengths: list[int] = []
        paths: list[bytes | None] = []
        namespaces: list[str | None] = []
        payloads: list[bytes | memoryview] = []
        # Where a payload lies in the payload memory (-1: among this message's bytes).
        places: list[int] = []
        gpu = [group.gpu[p] for p in positions] if group.gpu else [False] * len(positions)
        for position in positions:
            job = group.jobs[position]
            rows.append(group.rows[position])
            # A `url` job with a validator is cached here under its URL's key (the fetch
            # stage looks it up on a 304), not in the process under its bytes'.
            namespaces.append(None if job.cache_key is not None else job.reply_to)
            places.append(job.payload_at)
            if job.image is not None:
                if job.payload_at < 0:
                    payloads.append(job.image)
                lengths.append(len(job.image))
                paths.append(None)
            else:
                lengths.append(-1 if job.path is not None else -2)
                paths.append(job.path)
        run = Run(token, rows, lengths, paths, namespaces, places, gpu, self.gpu_thumbnail_accept)
        proc.child.send_parts(DECODE.parts(run, payloads))

    async def redecode(
        self, jobs: Sequence[Job], rows: Sequence[npt.NDArray[np.uint8]]
    ) -> list[DecodeResult]:
        """Decode `jobs` into their ring rows here, none left for the GPU (the rows the GPU
        decoder failed)."""
        return await self.settle([self.submit_rows(jobs, rows, gpu=False)])

    def _fail(self, group: ProcessGroup, positions: list[int], why: str) -> None:
        for position in positions:
            error = DecodeError(ErrorCode.INTERNAL_ERROR, why)
            group.set(position, DecodeResult(None, error, 0.0))

    async def settle(self, groups: Sequence[DecodeGroup]) -> list[DecodeResult]:
        """The results of a batch's rows in order (`groups`: what `submit_rows` returned). A
        process's run still decoding `budget_s` after it started ends that process (see the
        module's docstring)."""
        parts = [g for g in groups if isinstance(g, ProcessGroup)]
        if len(parts) != len(groups):
            raise TypeError("decode processes settle only the groups they were given")
        check_s = max(0.02, min(self.budget_s / 4, 0.5))
        while True:
            waiting = [g.future for g in parts if not g.done()]
            if not waiting:
                break
            deadline = self._enforce_budget()
            timeout = check_s if deadline is None else max(0.0, min(deadline, check_s))
            await asyncio.wait(waiting, timeout=timeout)
            self._enforce_budget()
        results: list[DecodeResult] = []
        for group in parts:
            if group.future.cancelled():
                raise asyncio.CancelledError
            results.extend(r for r in group.results if r is not None)
        return results

    def _enforce_budget(self) -> float | None:
        """Retire every process whose run is past the budget, or that holds rows of a group
        past its `until`; seconds until the next one could be."""
        budget_ns = int(self.budget_s * 1e9)
        now = time.monotonic_ns()
        soonest: int | None = None
        progress = self.arena.progress
        for proc in list(self._procs):
            if not proc.items:
                continue
            due: int | None = None
            # Token before the time: the process writes the time first (process_main.py).
            if int(progress["token"][proc.slot]) in proc.items:
                due = int(progress["started_ns"][proc.slot]) + budget_ns
            for item in proc.items.values():
                until = item.group.until_ns
                if until is not None and (due is None or until < due):
                    due = until
            if due is None:
                continue
            if due <= now:
                self._retire(proc, cause="timeout")
            elif soonest is None or due < soonest:
                soonest = due
        return None if soonest is None else (soonest - now) / 1e9

    def shutdown(self) -> None:
        """Close the processes' sockets (they exit once their current run is done); kill
        those still running after the budget. Rows not answered are cancelled."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.budget_s
        for proc in self._procs:
            proc.child.unwatch()
            proc.child.close()
        for proc in self._procs:
            proc.child.end(max(0.0, deadline - time.monotonic()))
            for item in proc.items.values():
                if not item.group.future.done():
                    item.group.future.cancel()
        self._procs = []


class Shares(NamedTuple):
    """How a group's rows are shared among the processes (`shares`)."""

    # The rows each process takes (-1: none, its queue is already over the others').
    base: list[int]
    # Rows left over: one more each for as many processes of `order`.
    extra: int
    # The processes that take rows, the shortest queue first (equal ones in turn).
    order: list[int]


def shares(loads: list[int], rows: int, start: int = 0) -> Shares:
    """How many of `rows` each process takes, its queue at `loads[k]`, so that the longest
    queue after is as short as it can be: the shortest queues are filled up to a level,
    and what is left over goes one each to some of them. Equal queues are taken in turn
    from `start`. Work per group, not per row."""
    count = len(loads)
    # A stable sort of the processes taken in turn from `start`: equal loads keep that turn.
    order = sorted([*range(start, count), *range(start)], key=loads.__getitem__)
    filled = 0  # the processes under the level
    total = 0  # their rows queued
    while filled < count and loads[order[filled]] * filled - total <= rows:
        total += loads[order[filled]]
        filled += 1
    level, extra = divmod(rows + total, filled)
    base = [-1] * count
    for k in order[:filled]:
        base[k] = level - loads[k]
    return Shares(base, extra, order[:filled])


def waited_over_budget(budget_ms: int) -> DecodeError:
    """The error of a row whose run's budget went by before its decode started."""
    return DecodeError(
        ErrorCode.DECODE_TIMEOUT,
        f"the decode budget of {budget_ms} ms ran out while this image waited behind "
        "other images of its batch; the batch went on without it",
    )


def _sendmsg(sock: socket.socket, buffers: list[memoryview]) -> int:
    # The kernel's copy runs without the GIL: the bench and doctor count it apart.
    if gil_account.switch.on:
        return gil_account.timed(sock.sendmsg, buffers)
    return sock.sendmsg(buffers)


if TYPE_CHECKING:

    def _keeps_the_contract(pool: ProcessDecodePool) -> DecodeExecutor:
        return pool
