"""`run_batch`: every item of a source through the workers, into one output file.

Flow control, not refusal: at most `in_flight` jobs are outstanding; more are submitted as
results come back. Jobs go at the lowest priority level unless told otherwise, so online
traffic passes them. Admission control (max_backlog, max_memory_share) still applies: a
refused submission waits and is tried again while results keep coming, never dropped.

Results are read from a reply stream of the run's own, thousands of entries a read; ids
whose answer did not show up there (e.g. answered on the default results stream) are
looked up in their result hashes after a quiet spell.

Only answers to what this run submitted are written: each must name the stream entry the
run's own XADD added for that id (results carry it as `entry`), wherever it is read. The
reply stream's name holds 128 random bits, so a tenant who may only XADD cannot find it;
one who could, and who guessed entry IDs (they are times and counters), would still have
to name an entry this run is waiting on, for the id that entry holds. Anything else on the
stream (a killed run's late answers, a repeat, a forgery) is counted and left out.

The client is meant to keep many workers busy from one core, so each job costs it as
little Python as can be: jobs go out as packed XADDs on one connection (batch_redis.py),
results stay the raw fields Redis sent until a row group is made of them column-wise
(batch_rows.py), and the done ids are 64-bit hashes in numpy arrays (batch_ids.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError
from redis.typing import EncodableT, FieldT

from producer import wire
from producer.admission import ADMIT, AdmissionRefused, BacklogFull, admit_args, admitted
from producer.backoff import Backoff
from producer.batch_ids import IdStore, id_hashes
from producer.batch_lanes import (
    FAILOVER_BACKOFF_S,
    FAILOVER_ERRORS,
    FAILOVER_LIMIT_S,
    InFlight,
    Lane,
    lane_limits,
)
from producer.batch_output import Existing, Output
from producer.batch_parts import Part
from producer.batch_redis import Fields, RawLink, field_map
from producer.batch_rows import Rows, error_fields
from producer.batch_sources import Item, ItemError, NotImages, Source, open_source, printable
from producer.client import Producer
from producer.jobs import _fit_id
from producer.priorities import level_stream, pick_level
from producer.replies import last_id, xread_entries
from producer.shards import shard_of_id
from producer.stats import collect_stats

JobFields = dict[FieldT, EncodableT]

log = logging.getLogger("producer.batch")

# Allocations between two collections of the young generation while a run goes (Python's
# default is 700 to 2,000).
GC_YOUNG_THRESHOLD = 100_000
# Without a worker heartbeat to read the batch size from: this many jobs per consumer.
DEFAULT_BATCH = 32
# With neither consumers nor workers yet: this many jobs outstanding.
DEFAULT_IN_FLIGHT = 256
SUBMIT_CHUNK = 256
READ_BLOCK_MS = 200
# With several shards: each reply stream is looked at without waiting at most this often,
# and the wait on one of them when none has an answer is as long.
SWEEP_S = 0.01
SHARD_BLOCK_MS = 10
READ_COUNT = 4096
HASH_CHUNK = 2048
READ_BUFFER = 1 << 20
ROW_GROUP = 4096
# Look up result hashes of outstanding jobs after this long without a result.
RECHECK_S = 5.0
# After a shard's failover, its lane looks for lost jobs this soon.
LOST_CHECK_AFTER_FAILOVER_S = 1.0
PROGRESS_EVERY_S = 0.25
# Ignored answers logged one by one, per run; the rest are counted.
LOGGED_IGNORED = 10
# Folder entries passed over that the summary names (all are counted).
NAMED_NOT_REGULAR = 100


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
    # The client's own CPU (every thread of its process) since the run started: what one
    # client can feed is about 1 / (cpu_s / answered) jobs a second.
    cpu_started: float = field(default_factory=time.process_time)
    finished: bool = False
    rows: int = 0  # rows of the finished output
    # Ids the output held at the start that are not submitted again: rows the source's
    # listing will skip, not this run's work.
    done_ids: int = 0
    # Answers on the run's reply stream (or in a result hash) to no job this run is waiting
    # on: a killed run's late answers, repeats, forgeries. Never written.
    ignored: int = 0
    # A folder's image-named entries that are not regular files, with why ("path: a FIFO"):
    # all counted, the first NAMED_NOT_REGULAR named.
    not_regular: int = 0
    not_regular_files: list[str] = field(default_factory=list)
    # Files a folder or prefix holds whose names are not images: never read (the workers
    # would only answer `unsupported_format`), but counted and a few named.
    not_images: NotImages = field(default_factory=NotImages)
    # This run's rows the workers marked `duplicate_of`: the id had a result already (ids
    # default to file names; a result is kept per id for GPUFEED_RESULT_TTL_S).
    duplicates: int = 0
    # `I/N` when this client runs part I of N of the source (--part), else None.
    part: str | None = None
    # The source's items of the other parts (not this client's to run).
    other_parts: int = 0
    # Shards that could not be reached for a while (a failover ridden out), and the jobs
    # found lost there (gone from their stream without a result) and submitted again.
    failovers: int = 0
    resubmitted: int = 0
    # The whole output once finished: its rows by status and error code.
    output_ok: int = 0
    output_error_codes: Counter[str] = field(default_factory=Counter)

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

    @property
    def cpu_s(self) -> float:
        return time.process_time() - self.cpu_started

    @property
    def todo(self) -> int | None:
        """This run's work: the source's items less the ids the output holds (exact once
        the listing ends, when every skipped item is known)."""
        if self.total is None:
            return None
        return max(self.total - max(self.skipped, self.done_ids), self.answered)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's own rate."""
        todo, rate = self.todo, self.rate
        if todo is None or rate <= 0:
            return None
        return (todo - self.answered) / rate

    @property
    def output_errors(self) -> int:
        return sum(self.output_error_codes.values())

    def count_other_part(self, n: int) -> None:
        self.other_parts += n

    def skip_entry(self, path: str, reason: str) -> None:
        self.not_regular += 1
        if len(self.not_regular_files) < NAMED_NOT_REGULAR:
            self.not_regular_files.append(f"{path}: {reason}")

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
            "todo": self.todo,
            "rate": round(self.rate, 1),
            "eta_s": None if (eta := self.eta_s) is None else round(eta, 1),
            "elapsed_s": round(self.elapsed_s, 2),
            "cpu_s": round(self.cpu_s, 3),
            "ignored_answers": self.ignored,
            "not_regular": self.not_regular,
            "not_regular_files": self.not_regular_files,
            "not_images": self.not_images.count,
            "not_images_by_extension": self.not_images.by_extension,
            "not_image_files": self.not_images.examples,
            "duplicates": self.duplicates,
            "part": self.part,
            "other_parts": self.other_parts,
            "failovers": self.failovers,
            "resubmitted": self.resubmitted,
            "finished": self.finished,
            "rows": self.rows,
            "in_output": {
                "ok": self.output_ok,
                "errors": self.output_errors,
                "error_codes": dict(self.output_error_codes),
                "from_this_run": self.answered,
            },
        }


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, systemd and Kubernetes send to stop a process), raised where
    ^C raises KeyboardInterrupt, so that a run ends the same way either way: the rows
    answered so far committed, a --local service stopped and its folder removed."""


def interruption(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What ended a run interrupted by `exc`, in words, and the exit status that says so:
    128 and the signal's number, as a shell reports a process the signal ended."""
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While in it, the first SIGTERM raises `Terminated` in the main thread; any later one is
    ignored, so that the end it asked for (rows committed, workers drained, Redis stopped) is
    not cut short: whoever cannot wait sends SIGKILL. Outside the main thread (no handler can
    be set there), or where SIGTERM is ignored already, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        yield
        return
    ended = False

    def terminate(signum: int, frame: FrameType | None) -> None:
        nonlocal ended
        if not ended:
            ended = True
            raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be set back from here.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
    # No local file is read past this (the workers' GPUFEED_MAX_IMAGE_BYTES): a larger one
    # is an error row, as a worker would have answered it.
    max_image_bytes: int = wire.DEFAULT_MAX_IMAGE_BYTES
    # Prepended to every item's id: the same files as new jobs, not `duplicate_of` the
    # results their ids got before (a result is kept per id for GPUFEED_RESULT_TTL_S).
    id_prefix: str = ""
    # This client's part of the source (--part I/N): the ids whose hash is I modulo N.
    part: Part = field(default_factory=Part)


T = TypeVar("T")


def through_failover(producer: Producer, call: Callable[[], T]) -> T:
    """`call`, made again through a master's failover on a cluster (for up to
    FAILOVER_LIMIT_S, the layout reread between tries): the calls a run makes once, outside
    any lane (its start and its end), as a lane's calls are. On a single Redis, `call`."""
    if not producer.cluster:
        return call()
    backoff = Backoff(*FAILOVER_BACKOFF_S)
    since: float | None = None
    while True:
        try:
            return call()
        except FAILOVER_ERRORS as exc:
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("the cluster cannot be reached (%s): waiting for its failover", exc)
            elif now - since > FAILOVER_LIMIT_S:
                raise
        time.sleep(backoff.next())
        with contextlib.suppress(*FAILOVER_ERRORS):
            cast(RedisCluster, producer.client).nodes_manager.initialize()


def default_in_flight(producer: Producer, stream: str) -> int:
    """Enough to keep every worker's batches full while results come back: twice the sum
    of the live workers' batch sizes, else twice the group's consumers times
    DEFAULT_BATCH, else DEFAULT_IN_FLIGHT."""
    snapshot = collect_stats(
        producer.client,
        stream,
        producer.group,
        producer.results_stream,
        dead_stream=producer.dead_stream,
    )
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
    """A new reply stream's name for a run over `out`: named after the output (which run it
    is, for whoever lists keys) and 128 random bits (so no one else can find it). On a
    cluster each lane places it in its shard's slot (`Shard.reply_stream`)."""
    # The path's own bytes: a name that is not UTF-8 has no other encoding.
    digest = hashlib.sha1(os.fsencode(out.absolute())).hexdigest()[:16]
    return f"{producer.results_stream}:batch:{digest}:{secrets.token_hex(16)}"


def _prefixed(pages: Iterator[list[Item]], prefix: str) -> Iterator[list[Item]]:
    for page in pages:
        yield [item._replace(id=_fit_id(prefix + item.id)) for item in page]


class _Items:
    """The source's items not already done, in order, read a page at a time."""

    def __init__(self, pages: Iterator[list[Item]], store: IdStore, progress: Progress) -> None:
        self._pages = pages
        self._store = store
        self._progress = progress
        self._ready: list[Item] = []
        self._at = 0
        self.exhausted = False

    def take(self, n: int) -> list[Item]:
        while len(self._ready) - self._at < n and not self.exhausted:
            page = next(self._pages, None)
            if page is None:
                self.exhausted = True
                self._progress.total = self._progress.listed  # known now, exactly
                break
            self._progress.listed += len(page)
            new = self._store.add_new(id_hashes([i[0] for i in page]))  # Item.id
            fresh = [item for item, keep in zip(page, new.tolist(), strict=True) if keep]
            self._progress.skipped += len(page) - len(fresh)
            self._ready = self._ready[self._at :] + fresh
            self._at = 0
        taken = self._ready[self._at : self._at + n]
        self._at += len(taken)
        return taken

    @property
    def empty(self) -> bool:
        return self.exhausted and self._at >= len(self._ready)


class BatchRun:
    """One run of `run_batch`, as state: its lanes (one a shard), what is written."""

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
        part = options.part
        self.progress = Progress(
            source=printable(source.spec),
            output=printable(output.display),
            # A part's share of the source is known once its listing ends.
            total=source.total if part.whole else None,
            done_before=existing.rows,
            retried=existing.retried,
            done_ids=len(existing.done),
            part=None if part.whole else str(part),
        )
        progress = self.progress
        pages = source.pages(
            on_skip=progress.skip_entry,
            on_other=progress.not_images.add,
            part=part,
            on_other_part=progress.count_other_part,
        )
        if options.id_prefix:
            pages = _prefixed(pages, options.id_prefix)
        self.items = _Items(pages, IdStore(existing.done), self.progress)
        # Earlier runs' reply streams (a killed run's gets its late answers still): gone
        # now, and again once the output is finished.
        self._old_replies = output.reply_streams()
        reply_to = reply_stream_for(producer, output.path)
        on_cluster = producer.sharded or producer.cluster
        # Jobs per submission: a chunk over the backlog limit would never be admitted.
        self._chunk = min(SUBMIT_CHUNK, producer.max_backlog or SUBMIT_CHUNK)
        if options.in_flight is not None:
            each = lane_limits(options.in_flight, len(producer.shards))
        else:
            # Each shard its own: answers come back a few at a time on each, and a lane
            # whose limit were a share of the workers' batches would go out in small
            # submissions, a round trip each.
            stream = level_stream(producer.shards[0].stream, self.level)
            each = through_failover(producer, lambda: default_in_flight(producer, stream))
        self.lanes = [
            Lane(
                shard,
                level_stream(shard.stream, self.level),
                shard.reply_stream(reply_to) if on_cluster else reply_to,
                each,
                self._chunk,
            )
            for shard in producer.shards
        ]
        for lane in self.lanes:
            output.note_reply_stream(lane.reply_to)
        self.progress.in_flight_limit = sum(lane.limit for lane in self.lanes)
        # How results name this run's entries: `<level>:<entry ID>` on a level's stream.
        self._entry_prefix = f"{self.level}:".encode() if self.level else b""
        self.rows = Rows(source.keep)
        # Fields every job carries after its own, but its reply stream (its lane's).
        self._tail: list[bytes] = []
        if options.meta is not None:
            self._tail += [wire.JOB_META, options.meta]
        self._buffer = bytearray(READ_BUFFER)  # local files are read into this
        self._last_report = 0.0
        self._checkpoint_at = time.monotonic() + options.checkpoint_s
        # XADDs go straight out on one connection a lane, unless admission control (a
        # script of its own) has a say in them.
        self._raw = not (producer.max_backlog or producer.max_memory_share)

    # ------------------------------------------------------------------ the loop
    def run(self) -> Progress:
        # The rows waiting for their row group are many small objects, none in a cycle, and
        # each pass of the collector over them (and over every module's objects) would cost
        # more than the rest of a job. What exists at the start is frozen out of its passes
        # and the young generation is collected far less often; it still runs, so garbage in
        # a cycle (an exception's traceback, a caller's threads) stays bounded in a run of
        # hours, and the caller's settings come back after.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(max(thresholds[0], GC_YOUNG_THRESHOLD), *thresholds[1:])
        try:
            producer = self.producer
            through_failover(producer, self._drop_old_replies)
            for lane in self.lanes:  # before the first job goes out
                lane.cursor = through_failover(producer, functools.partial(self._last_id, lane))
            self._loop()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
            for lane in self.lanes:
                if lane.link is not None:
                    lane.link.close()
            self.output.release()
        self.progress.finished = True
        self._report(force=True)
        return self.progress

    def _loop(self) -> None:
        try:
            while not (self.items.empty and not any(lane.busy() for lane in self.lanes)):
                self._fill()
                self._read()
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
        through_failover(self.producer, self._drop_old_replies)
        through_failover(self.producer, self._drop_replies)
        tally = self.output.tally()
        self.progress.output_ok = tally.pop(wire.STATUS_OK, 0)
        self.progress.output_error_codes = tally

    def _drop_replies(self) -> None:
        self.producer.client.delete(*(lane.reply_to for lane in self.lanes))

    def _drop_old_replies(self) -> None:
        if self._old_replies:
            self.producer.client.delete(*self._old_replies)

    # ------------------------------------------------------------------ a shard's failover
    def _client(self, lane: Lane) -> redis.Redis:
        """The client for `lane`'s keys: on a cluster, the master of its shard's slot."""
        client = self.producer.client
        if not self.producer.cluster:
            return client
        cluster = cast(RedisCluster, client)
        node = cluster.get_node_from_key(lane.stream)  # type: ignore[no-untyped-call]
        return cluster.get_redis_connection(node)

    def _link(self, lane: Lane) -> RawLink | None:
        if self._raw and lane.link is None:
            lane.link = RawLink(self._client(lane), scripts=not self.producer.tenant)
        return lane.link

    def _ride_out(self, lane: Lane, exc: BaseException) -> bool:
        """`lane`'s call failed with `exc`: whether to wait for a failover (on a cluster,
        for up to FAILOVER_LIMIT_S) rather than end the run."""
        if not self.producer.cluster:
            return False
        now = time.monotonic()
        if lane.down_since is None:
            lane.down_since = now
            self.progress.failovers += 1
            log.warning(
                "shard %d (%s) cannot be reached (%s): waiting for its failover, "
                "the other shards go on", lane.index, lane.stream, exc,
            )  # fmt: skip
        elif now - lane.down_since > FAILOVER_LIMIT_S:
            return False
        lane.down_until = now + lane.down_backoff.next()
        if lane.link is not None:
            lane.link.close()
            lane.link = None
        with contextlib.suppress(*FAILOVER_ERRORS):
            # The new master's address: the layout as the cluster now tells it.
            cast(RedisCluster, self.producer.client).nodes_manager.initialize()
        return True

    def _reached(self, lane: Lane) -> None:
        """A call of `lane` went through: a failover it waited on is over."""
        if lane.down_since is None:
            return
        log.warning(
            "shard %d (%s) reached again after %.1f s", lane.index, lane.stream,
            time.monotonic() - lane.down_since,
        )  # fmt: skip
        lane.down_since = None
        lane.down_backoff.reset()
        # Writes the old master had not passed on are gone: look for lost jobs soon.
        lane.last_result = time.monotonic() - RECHECK_S + LOST_CHECK_AFTER_FAILOVER_S

    # ------------------------------------------------------------------ submitting
    def _fill(self) -> None:
        lanes = self.lanes
        while True:
            now = time.monotonic()
            for lane in lanes:
                while lane.ready and lane.due() and lane.open(now):
                    if not self._submit(lane):
                        break
            hungry = [lane for lane in lanes if not lane.ready and lane.room() > 0]
            held = sum(len(lane.ready) for lane in lanes)
            if not hungry or self.items.empty or held >= self._hold_limit():
                return
            if len(lanes) == 1:
                want = min(self._chunk, hungry[0].room())
            else:
                # Enough for the emptiest lane's room: each lane's share goes out whole.
                want = min(self._hold_limit() - held, len(lanes) * max(w.room() for w in hungry))
            items = self.items.take(max(1, want))
            if not items:
                continue  # the listing ended: the loop sees it
            self._distribute(self._jobs(items))

    def _hold_limit(self) -> int:
        # Jobs made but not submitted (a lane's share waiting for its room, a lane refused
        # or failing over) stay within a chunk a lane (a local file's bytes are in them),
        # so a shard that is down stops the listing rather than fill memory.
        return min(self._chunk * len(self.lanes), max(self._chunk, self.progress.in_flight_limit))

    def _distribute(self, jobs: list[tuple[Item, list[bytes]]]) -> None:
        lanes = self.lanes
        if len(lanes) == 1:
            lane = lanes[0]
            reply = [wire.JOB_REPLY_TO, lane.reply_b]
            lane.ready += [(item, fields + reply) for item, fields in jobs]
            return
        count = len(lanes)
        replies = [[wire.JOB_REPLY_TO, lane.reply_b] for lane in lanes]
        for item, fields in jobs:
            index = shard_of_id(item.id, count)
            lanes[index].ready.append((item, fields + replies[index]))

    def _jobs(self, items: list[Item]) -> list[tuple[Item, list[bytes]]]:
        """The jobs of `items`, as their stream fields but their reply stream; an item
        whose job cannot be made (its file is gone or empty) gets its error row here, as a
        worker would have answered it."""
        jobs: list[tuple[Item, list[bytes]]] = []
        tail, buffer, limit = self._tail, self._buffer, self.options.max_image_bytes
        for item in items:
            try:
                fields = item.fields(buffer, limit)
            except OSError as exc:
                reason = f"cannot read {item.source}: {exc.strerror or exc}"
                self._error(item, wire.ErrorCode.PATH_NOT_FOUND, reason)
                continue
            except ItemError as exc:
                self._error(item, exc.code, str(exc))
                continue
            fields += tail
            jobs.append((item, fields))
        return jobs

    def _submit(self, lane: Lane) -> bool:
        """Submit `lane`'s ready jobs; False when admission control refused them or the
        shard is failing over (they stay ready, first in line, and the next try waits)."""
        chunk = lane.ready[: min(lane.fit, lane.room())]
        fields = [f for _, f in chunk]
        if self.options.deadline_s is not None:
            # From the submission: a wait for admission does not eat into it.
            due = str(int((time.time() + self.options.deadline_s) * 1000)).encode()
            fields = [[*f, wire.JOB_DEADLINE_MS, due] for f in fields]
        try:
            entries = self._add(lane, fields)
        except AdmissionRefused as exc:
            self.progress.refused += 1
            room = exc.max_backlog - exc.backlog if isinstance(exc, BacklogFull) else 0
            if 0 < room < len(chunk):
                lane.fit = room  # a smaller chunk fits now: try it at once
                return True
            lane.fit = max(1, room)
            lane.refused_until = time.monotonic() + lane.refused_backoff.next()
            return False
        except FAILOVER_ERRORS as exc:
            # Whether the jobs were added is not known: they go again once the shard is
            # back, and an answer to a first copy names no entry the lane waits on.
            if not self._ride_out(lane, exc):
                raise
            return False
        self._reached(lane)
        lane.refused_backoff.reset()
        lane.fit = lane.chunk
        in_flight, prefix = lane.in_flight, self._entry_prefix
        for (item, _), entry in zip(chunk, entries, strict=True):
            in_flight[prefix + entry] = InFlight(item.id.encode(), item)
        self.progress.submitted += len(chunk)
        self.progress.in_flight += len(chunk)
        del lane.ready[: len(chunk)]
        return True

    def _add(self, lane: Lane, jobs: list[list[bytes]]) -> list[bytes]:
        """XADD `jobs` to `lane`'s stream; their entry ids. AdmissionRefused (none added)
        when admission control says no."""
        link = self._link(lane)
        if link is not None:
            return link.xadds(lane.stream_b, jobs)
        producer = self.producer
        if producer.tenant:
            maps = [cast(JobFields, dict(zip(f[::2], f[1::2], strict=True))) for f in jobs]
            found = producer._run(producer._admit_by_reads(lane.stream, list(maps)))
        else:
            maps = [cast(JobFields, dict(zip(f[::2], f[1::2], strict=True))) for f in jobs]
            args = admit_args(producer.group, producer.max_backlog, producer.max_memory_share, maps)
            reply = producer.client.eval(ADMIT, 1, lane.stream, *args)
            found = admitted(
                reply,
                max_backlog=producer.max_backlog,
                max_memory_share=producer.max_memory_share,
                jobs=len(jobs),
            )
        return [e.encode() if isinstance(e, str) else bytes(e) for e in found]

    def _last_id(self, lane: Lane) -> bytes:
        # Once a run: the producer's own client, whichever link carries the jobs.
        reply = self.producer.client.xrevrange(lane.reply_to, count=1)
        return last_id(reply).encode()

    # ------------------------------------------------------------------ answers
    def _read(self) -> None:
        now = time.monotonic()
        # Block only when there is nothing to submit meanwhile.
        can_submit = self._can_submit(now)
        if len(self.lanes) == 1:
            lane = self.lanes[0]
            if now >= lane.down_until:
                self._read_lane(lane, None if can_submit else READ_BLOCK_MS)
            else:
                time.sleep(min(lane.down_until - now, READ_BLOCK_MS / 1000))
            return
        # Several shards: each lane's reply stream is looked at without waiting, at most
        # every SWEEP_S (a look that finds nothing costs a round trip, and answers come a
        # worker's batch at a time); with nothing found and nothing to submit, a short wait
        # on the lane with the most jobs outstanding for its next answer.
        got = False
        for lane in self.lanes:
            if lane.in_flight and now >= lane.down_until and now - lane.read_at >= SWEEP_S:
                lane.read_at = now
                got |= self._read_lane(lane, None)
        if got or can_submit:
            return
        waiting = [lane for lane in self.lanes if lane.in_flight and now >= lane.down_until]
        if not waiting:
            later = [lane.down_until for lane in self.lanes if lane.busy()]
            if later:
                time.sleep(max(0.0, min(min(later) - now, READ_BLOCK_MS / 1000)))
            return
        lane = max(waiting, key=lambda w: len(w.in_flight))
        self._read_lane(lane, SHARD_BLOCK_MS)
        lane.read_at = time.monotonic()

    def _can_submit(self, now: float) -> bool:
        """Whether `_fill` has work now: ready jobs for a lane with room, or a lane with
        room and nothing ready while the source has more and the jobs held are below the
        limit. (A lane failing over holds its jobs: the others are not to spin meanwhile.)"""
        held = sum(len(lane.ready) for lane in self.lanes)
        more = not self.items.empty and held < self._hold_limit()
        return any(
            lane.open(now) and (lane.due() if lane.ready else more and lane.room() > 0)
            for lane in self.lanes
        )

    def _read_lane(self, lane: Lane, block: int | None) -> bool:
        """Read `lane`'s reply stream; whether any answer came."""
        entries: list[tuple[bytes | str, Any]]
        try:
            link = self._link(lane)
            if link is not None:
                entries = list(link.xread(lane.reply_b, lane.cursor, READ_COUNT, block))
            else:
                reply = self.producer.client.xread({lane.reply_b: lane.cursor}, READ_COUNT, block)
                entries = [(e, f) for _, e, f in xread_entries(reply)]
        except FAILOVER_ERRORS as exc:
            if not self._ride_out(lane, exc):
                raise
            return False
        self._reached(lane)
        if not entries:
            return False
        last = entries[-1][0]
        lane.cursor = last.encode() if isinstance(last, str) else bytes(last)
        before = len(self.rows)
        pop = lane.in_flight.pop
        taken = self.rows.fields
        sources = self.rows.sources
        extras = self.rows.extras if self.rows.keep else None
        for _, raw in entries:
            fields = field_map(raw)
            job = pop(fields.get(wire.RES_ENTRY, b""), None)
            if job is not None and job[0] == fields.get(wire.RES_ID):
                taken.append(fields)
                item = job[1]
                sources.append(item[1])  # Item.source
                if extras is not None:
                    extras.append(item[5])  # Item.extra
            else:
                self._ignore(lane, fields, job)
        if len(self.rows) > before:
            lane.last_result = time.monotonic()
            self.rows.changed()
            self._answered(before)
            return True
        return False

    def _answered(self, since: int) -> None:
        """Count the rows added since row `since`."""
        progress = self.progress
        ok = wire.STATUS_OK.encode()
        for fields in self.rows.fields[since:]:
            if fields.get(wire.RES_DUPLICATE_OF):
                progress.duplicates += 1
            if fields.get(wire.RES_STATUS) == ok:
                progress.ok += 1
            else:
                progress.errors += 1
                error = fields.get(wire.RES_ERROR)
                code = error.split(b":", 1)[0].decode("utf-8", "replace") if error else "unknown"
                progress.error_codes[code] += 1
        progress.in_flight = sum(len(lane.in_flight) for lane in self.lanes)

    def _ignore(self, lane: Lane, fields: Fields, job: InFlight | None) -> None:
        """An answer to no job this run waits on: counted and logged, never written."""
        entry = fields.get(wire.RES_ENTRY, b"")
        if job is not None:  # the entry is ours, the id is not its id: it still waits
            lane.in_flight[entry] = job
        self.progress.ignored += 1
        if self.progress.ignored <= LOGGED_IGNORED:
            job_id = fields.get(wire.RES_ID, b"").decode("utf-8", "backslashreplace")
            ref = entry.decode("utf-8", "backslashreplace")
            why = "names another id" if job is not None else "names no entry this run waits on"
            log.warning(
                "ignored an answer on %s for id %r, entry %r: it %s (an earlier run's, "
                "a repeat, or written by someone else)",
                lane.reply_to, job_id, ref, why,
            )  # fmt: skip

    def _error(self, item: Item, code: wire.ErrorCode, message: str) -> None:
        before = len(self.rows)
        self.rows.add(error_fields(item.id, code, message), item.source, item.extra)
        self._answered(before)

    def _recheck(self) -> None:
        """After a quiet spell on a lane, look for its outstanding jobs' results in their
        hashes: an answer can miss the reply stream (a worker that answered on the default
        results stream, a trimmed stream, a failover). A duplicate id's answer is stored
        under its entry id. A job whose entry is gone from the stream without a result was
        lost (a write the old master of a failed-over shard had not passed on, a Redis
        restarted without its data): it is submitted again."""
        now = time.monotonic()
        for lane in self.lanes:
            if not lane.in_flight or now - lane.last_result < RECHECK_S or not lane.open(now):
                continue
            lane.last_result = now
            try:
                self._recheck_lane(lane)
            except FAILOVER_ERRORS as exc:
                if not self._ride_out(lane, exc):
                    raise

    def _recheck_lane(self, lane: Lane) -> None:
        prefix = lane.shard.result_prefix.encode()
        client = self._client(lane)
        outstanding = list(lane.in_flight.items())
        before = len(self.rows)
        cut = len(self._entry_prefix)
        lost: list[Item] = []
        for start in range(0, len(outstanding), HASH_CHUNK):
            chunk = outstanding[start : start + HASH_CHUNK]
            with client.pipeline(transaction=False) as pipe:
                for ref, job in chunk:
                    # The entry first: gone from the stream means answered (the worker
                    # writes the result hash in the step that ends the entry) or lost.
                    if lane.lost_check:
                        pipe.xrange(lane.stream, ref[cut:], ref[cut:])
                    pipe.hgetall(prefix + job.id)
                    pipe.hgetall(prefix + ref)
                replies = pipe.execute(raise_on_error=False)
            width = 3 if lane.lost_check else 2
            for n, (ref, job) in enumerate(chunk):
                found_replies = replies[width * n + width - 2 : width * n + width]
                for found in found_replies:
                    if isinstance(found, Exception):
                        raise found
                # Either hash counts only where it holds this entry's answer for this id:
                # an id's hash may hold an earlier job's answer, and a hash named like an
                # entry reference may be another job's (whose id was chosen so).
                answer = next(
                    (
                        f
                        for f in found_replies
                        if f and f.get(wire.RES_ENTRY) == ref and f.get(wire.RES_ID) == job.id
                    ),
                    None,
                )
                if answer is not None:
                    if lane.in_flight.pop(ref, None) is not None:
                        self.rows.add(answer, job.item.source, job.item.extra)
                    continue
                if not lane.lost_check:
                    continue
                entry = replies[width * n]
                if isinstance(entry, NoPermissionError):
                    lane.lost_check = False  # a tenant's user without XRANGE on the stream
                elif isinstance(entry, Exception):
                    raise entry
                elif not entry and lane.in_flight.pop(ref, None) is not None:
                    lost.append(job.item)
        if len(self.rows) > before:
            self._answered(before)
        if lost:
            self.progress.resubmitted += len(lost)
            self.progress.in_flight = sum(len(lane.in_flight) for lane in self.lanes)
            log.warning(
                "shard %d: %d jobs were lost from %s (gone without a result): submitted again",
                lane.index, len(lost), lane.stream,
            )  # fmt: skip
            reply = [wire.JOB_REPLY_TO, lane.reply_b]
            lane.ready[:0] = [(item, fields + reply) for item, fields in self._jobs(lost)]

    def _flush(self) -> None:
        if len(self.rows):
            self.output.write(self.rows)
            self.rows = Rows(self.source.keep)

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
    and write one row per id into `out`: a .parquet or .jsonl file, or a Parquet dataset
    where `out` ends in `/` (a folder or an object-store prefix; with `options.part`, this
    client's part of it). Resumes where an earlier run over the same output stopped;
    returns the final counts."""
    options = options or BatchOptions()
    src = source if isinstance(source, Source) else open_source(source, path_root=options.path_root)
    from producer.batch_dataset import open_output

    output = open_output(
        os.fspath(out), part=options.part.index, parts=options.part.count, source=src.spec
    )
    return BatchRun(src, output, producer, options, on_progress).run()
