"""`run_batch`: every item of a source through the workers, into one output file.

Flow control, not refusal: at most `in_flight` jobs are outstanding; more are submitted as
results come back. Jobs go at the lowest priority level unless told otherwise, so online
traffic passes them. Admission control (max_backlog, max_memory_share) still applies: a
refused submission waits and is tried again while results keep coming, never dropped.

Results are read from a reply stream of the run's own (named after the output path, so a
resumed run reads the same one), with the producer's results feed; ids whose answer did not
show up there (e.g. answered on the default results stream) are looked up in their result
hashes with the producer's `wait` after a quiet spell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from producer import wire
from producer.admission import AdmissionRefused, BacklogFull
from producer.batch_ids import IdStore, id_hashes
from producer.batch_output import Existing, Output
from producer.batch_rows import Row, error_row, result_row
from producer.batch_sources import Item, Source, open_source
from producer.client import Producer
from producer.jobs import Job
from producer.priorities import level_stream, pick_level
from producer.stats import collect_stats
from producer.waiting import ResultsFeed

# Without a worker heartbeat to read the batch size from: this many jobs per consumer.
DEFAULT_BATCH = 32
# With neither consumers nor workers yet: this many jobs outstanding.
DEFAULT_IN_FLIGHT = 256
SUBMIT_CHUNK = 256
READ_BLOCK_MS = 200
READ_COUNT = 1000
ROW_GROUP = 4096
# Look up result hashes of outstanding jobs after this long without a result.
RECHECK_S = 5.0
REFUSED_BACKOFF_S = (0.1, 2.0)
PROGRESS_EVERY_S = 0.25


@dataclass
class Progress:
    """Where a run stands; passed to `on_progress` a few times a second and at the end."""

    source: str
    output: str
    total: int | None  # entries of the source where known beforehand
    done_before: int  # rows the output held already (not submitted again)
    retried: int = 0  # error rows submitted again (--retry-failed)
    submitted: int = 0
    ok: int = 0
    errors: int = 0
    in_flight: int = 0
    in_flight_limit: int = 0
    skipped: int = 0  # items not submitted: their id is in the output, or came before
    listed: int = 0  # items read from the source so far
    refused: int = 0  # submissions admission control refused (tried again)
    error_codes: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    rows: int = 0  # rows of the finished output

    @property
    def answered(self) -> int:
        return self.ok + self.errors

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def rate(self) -> float:
        elapsed = self.elapsed_s
        return self.answered / elapsed if elapsed > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "output": self.output,
            "total": self.total,
            "done_before": self.done_before,
            "retried": self.retried,
            "submitted": self.submitted,
            "ok": self.ok,
            "errors": self.errors,
            "in_flight": self.in_flight,
            "in_flight_limit": self.in_flight_limit,
            "skipped": self.skipped,
            "refused": self.refused,
            "error_codes": dict(self.error_codes),
            "rate": round(self.rate, 1),
            "elapsed_s": round(self.elapsed_s, 2),
            "finished": self.finished,
            "rows": self.rows,
        }


@dataclass(frozen=True)
class BatchOptions:
    in_flight: int | None = None  # None: from the consumer group (default_in_flight)
    priority: str | None = None  # None: the lowest level
    retry_failed: bool = False
    deadline_s: float | None = None  # each job's deadline, from its submission
    path_root: str | None = None  # send local files as path jobs relative to this
    meta: bytes | None = None
    checkpoint_s: float = 10.0
    row_group: int = ROW_GROUP


def default_in_flight(producer: Producer, stream: str) -> int:
    """Enough to keep every worker's batches full while results come back: twice the sum
    of the live workers' batch sizes, else twice the group's consumers times
    DEFAULT_BATCH, else DEFAULT_IN_FLIGHT."""
    snapshot = collect_stats(producer.client, stream, producer.group)
    sizes = []
    for w in snapshot["workers"]:
        value = w["fields"].get("batch_size")
        if isinstance(value, str) and value.isdigit():
            sizes.append(int(value))
    if sizes:
        return max(2 * sum(sizes), 1)
    group = snapshot["group"]
    consumers = int(group["consumers"] or 0) if group else 0
    return 2 * consumers * DEFAULT_BATCH if consumers else DEFAULT_IN_FLIGHT


def reply_stream_for(producer: Producer, out: Path) -> str:
    """The run's reply stream: one per output file, so a resumed run reads the same."""
    digest = hashlib.sha1(str(out.absolute()).encode()).hexdigest()[:16]
    name = f"{producer.results_stream}:batch:{digest}"
    if producer.cluster:
        return producer.shards[0].reply_stream(name)
    return name


class _Items:
    """The source's items not already done, in order, read a page at a time."""

    def __init__(self, pages: Iterator[list[Item]], store: IdStore, progress: Progress) -> None:
        self._pages = pages
        self._store = store
        self._progress = progress
        self._ready: deque[Item] = deque()
        self.exhausted = False

    def take(self, n: int) -> list[Item]:
        while len(self._ready) < n and not self.exhausted:
            page = next(self._pages, None)
            if page is None:
                self.exhausted = True
                if self._progress.total is None:
                    self._progress.total = self._progress.listed  # known now
                break
            self._progress.listed += len(page)
            new = self._store.add_new(id_hashes(i.id for i in page))
            self._progress.skipped += len(page) - int(new.sum())
            self._ready.extend(item for item, fresh in zip(page, new, strict=True) if fresh)
        return [self._ready.popleft() for _ in range(min(n, len(self._ready)))]

    @property
    def empty(self) -> bool:
        return self.exhausted and not self._ready


class BatchRun:
    """One run of `run_batch`, as state: what is outstanding, what is written."""

    def __init__(
        self,
        source: Source,
        output: Output,
        producer: Producer,
        options: BatchOptions,
        on_progress: Callable[[Progress], None] | None,
    ) -> None:
        self.source = source
        self.output = output
        self.producer = producer
        self.options = options
        self.on_progress = on_progress
        if producer.sharded:
            # Each shard answers on its own reply stream, in its own slot.
            raise ValueError(
                "batch reads one shard's reply stream: run one batch per shard "
                "(GPUFEED_SHARDS=1 and that shard's GPUFEED_STREAM)"
            )
        self.level = pick_level(producer.levels, options.priority)
        existing = output.start(retry_failed=options.retry_failed)
        try:
            self._prepare(existing)
        except BaseException:
            output.release()
            raise

    def _prepare(self, existing: Existing) -> None:
        source, output, producer, options = self.source, self.output, self.producer, self.options
        self.contested = existing.contested
        self.progress = Progress(
            source=source.spec,
            output=str(output.path),
            total=source.total,
            done_before=existing.rows,
            retried=existing.retried,
        )
        self.items = _Items(source.pages(), IdStore(existing.done), self.progress)
        self.reply_to = reply_stream_for(producer, output.path)
        self.in_flight: dict[str, str] = {}  # id -> source
        self.rows: list[Row] = []
        limit = options.in_flight
        if limit is None:
            stream = level_stream(producer.shards[0].stream, self.level)
            limit = default_in_flight(producer, stream)
        self.limit = max(1, limit)
        self.progress.in_flight_limit = self.limit
        self._ready: list[tuple[Job, str]] = []
        # Jobs per submission: a chunk over the backlog limit would never be admitted.
        self._chunk = min(SUBMIT_CHUNK, producer.max_backlog or SUBMIT_CHUNK)
        self._fit = self._chunk
        self._refused_until = 0.0
        self._refused_backoff = REFUSED_BACKOFF_S[0]
        self._last_result = time.monotonic()
        self._last_report = 0.0
        self._checkpoint_at = time.monotonic() + options.checkpoint_s

    # ------------------------------------------------------------------ the loop
    def run(self) -> Progress:
        feed = ResultsFeed(self.reply_to, "$", READ_BLOCK_MS, READ_COUNT)
        try:
            self._read(feed)  # resolves "$" before the first job goes out
            self._loop(feed)
        finally:
            self.output.release()
        self.progress.finished = True
        self._report(force=True)
        return self.progress

    def _loop(self, feed: ResultsFeed) -> None:
        try:
            while not (self.items.empty and not self.in_flight and not self._ready):
                self._fill()
                self._read(feed)
                self._recheck()
                if len(self.rows) >= self.options.row_group:
                    self._flush()
                if time.monotonic() >= self._checkpoint_at:
                    # What is committed survives a crash; the rest is submitted again.
                    self._flush()
                    self.output.commit()
                    self._checkpoint_at = time.monotonic() + self.options.checkpoint_s
                self._report()
        finally:
            self._flush()
            self.output.commit()
        self.progress.rows = self.output.finish(self.contested)
        self.producer.client.delete(self.reply_to)

    def _fill(self) -> None:
        while len(self.in_flight) < self.limit and time.monotonic() >= self._refused_until:
            if not self._ready:
                room = min(self._chunk, self.limit - len(self.in_flight))
                items = self.items.take(room)
                if not items:
                    return
                self._ready = self._jobs(items)
                if not self._ready:
                    continue
            if not self._submit():
                return

    def _jobs(self, items: list[Item]) -> list[tuple[Job, str]]:
        """The jobs of `items`; an item whose job cannot be made (its file is gone or
        empty) gets its error row here, as a worker would have answered it."""
        # A placeholder deadline for the check; the real one is set as the job goes out.
        deadline_ms = None if self.options.deadline_s is None else int(time.time() * 1000)
        jobs: list[tuple[Job, str]] = []
        for item in items:
            try:
                job = item.job(
                    reply_to=self.reply_to, deadline_ms=deadline_ms, meta=self.options.meta
                )
                job.fields()  # checked here: submit_many would refuse the whole chunk
            except OSError as exc:
                reason = f"cannot read {item.source}: {exc.strerror or exc}"
                self._answer(error_row(item.id, item.source, wire.ErrorCode.PATH_NOT_FOUND, reason))
                continue
            except ValueError as exc:
                empty = "empty" in str(exc)
                code = wire.ErrorCode.EMPTY_IMAGE if empty else wire.ErrorCode.INVALID_JOB
                self._answer(error_row(item.id, item.source, code, str(exc)))
                continue
            jobs.append((job, item.source))
        return jobs

    def _submit(self) -> bool:
        """Submit ready jobs; False when admission control refused them (they stay ready,
        first in line, and the next try waits a little longer)."""
        chunk = self._ready[: self._fit]
        if self.options.deadline_s is not None:
            # From the submission: a wait for admission does not eat into it.
            due = int((time.time() + self.options.deadline_s) * 1000)
            chunk = [(dataclasses.replace(job, deadline_ms=due), source) for job, source in chunk]
        try:
            self.producer.submit_many((job for job, _ in chunk), priority=self.options.priority)
        except AdmissionRefused as exc:
            self.progress.refused += 1
            room = exc.max_backlog - exc.backlog if isinstance(exc, BacklogFull) else 0
            if 0 < room < len(chunk):
                self._fit = room  # a smaller chunk fits now: try it at once
                return True
            self._fit = max(1, room)
            self._refused_until = time.monotonic() + self._refused_backoff
            self._refused_backoff = min(self._refused_backoff * 2, REFUSED_BACKOFF_S[1])
            return False
        self._refused_backoff = REFUSED_BACKOFF_S[0]
        self._fit = self._chunk
        for job, source in chunk:
            assert job.id is not None
            self.in_flight[job.id] = source
        self.progress.submitted += len(chunk)
        self.progress.in_flight = len(self.in_flight)
        del self._ready[: len(chunk)]
        return True

    def _read(self, feed: ResultsFeed) -> None:
        request = feed.next_read()
        assert request is not None
        # Block only when there is nothing to submit meanwhile.
        can_submit = (
            len(self.in_flight) < self.limit
            and (bool(self._ready) or not self.items.empty)
            and time.monotonic() >= self._refused_until
        )
        if can_submit and feed.cursor is not None:
            request = ResultsFeed(feed.stream, feed.cursor, None, READ_COUNT).next_read()
            assert request is not None
        for _, result in feed.take(request.on(self.producer.client)):
            self._take(result)

    def _take(self, result: wire.JobResult) -> None:
        source = self.in_flight.pop(result.id, None)
        if source is None:
            return  # not ours, or answered already (an earlier run's copy of the job)
        self._answer(result_row(result.id, source, result))

    def _answer(self, row: Row) -> None:
        self.rows.append(row)
        self._last_result = time.monotonic()
        if row["status"] == wire.STATUS_OK:
            self.progress.ok += 1
        else:
            self.progress.errors += 1
            self.progress.error_codes[row["error_code"] or "unknown"] += 1
        self.progress.in_flight = len(self.in_flight)

    def _recheck(self) -> None:
        if not self.in_flight or time.monotonic() - self._last_result < RECHECK_S:
            return
        self._last_result = time.monotonic()
        found = self.producer.wait(list(self.in_flight), 0, streams=[])
        for result in found.values():
            self._take(result)

    def _flush(self) -> None:
        if self.rows:
            self.output.write(self.rows)
            self.rows = []

    def _report(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_progress is not None and (force or now - self._last_report >= PROGRESS_EVERY_S):
            self._last_report = now
            self.on_progress(self.progress)


def run_batch(
    source: str | Source,
    out: str | os.PathLike[str],
    producer: Producer,
    options: BatchOptions | None = None,
    *,
    on_progress: Callable[[Progress], None] | None = None,
) -> Progress:
    """Run every item of `source` (a folder, a manifest or an s3://, gs://, az:// prefix)
    and write one row per id into `out` (.parquet or .jsonl). Resumes where an earlier run
    over the same output stopped; returns the final counts."""
    options = options or BatchOptions()
    src = source if isinstance(source, Source) else open_source(source, path_root=options.path_root)
    output = Output(out)
    return BatchRun(src, output, producer, options, on_progress).run()
