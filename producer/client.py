"""Submit image jobs to gpufeed and collect their results, from sync or asyncio code.

`Producer` wraps a `redis.Redis`, `AsyncProducer` a `redis.asyncio.Redis`; both speak only
the wire contract in `producer.wire`, so any worker version that honours it will do.
Clients passed in must return bytes (`decode_responses=False`): images, `meta` and the
msgpack `result` field are binary.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from producer import wire

DEFAULT_REDIS_URL = "redis://localhost:6379/0"

# redis-py's default socket timeout is 5 s: a longer XREAD BLOCK would look like a dead
# server, so long waits are made of short blocking reads.
_MAX_BLOCK_MS = 1000
_READ_COUNT = 1000
# Results whose stream entry we cannot see (another reply_to stream, a trimmed stream)
# still land in their hash; look there again this often while waiting.
_RECHECK_S = 2.0
_HASH_CHUNK = 5000
# Dead letters replayed by `replay_dead(all=True)` per transaction: each holds its image.
_REPLAY_CHUNK = 100
# A replay reads the dead-letter stream under WATCH; a worker adding a dead letter in
# between aborts the transaction, which is then simply run again.
_REPLAY_ATTEMPTS = 10

# The fields a worker adds to a job's own fields when it copies it to the dead-letter stream.
DEAD_ENTRY = b"dead_entry"  # the job's entry ID in the job stream
DEAD_DELIVERIES = b"dead_deliveries"  # how many times it was delivered
DEAD_CONSUMER = b"dead_consumer"  # the consumer that had it last
DEAD_AT_MS = b"dead_at_ms"  # when it was dead-lettered, epoch milliseconds
DEAD_FIELDS = (DEAD_ENTRY, DEAD_DELIVERIES, DEAD_CONSUMER, DEAD_AT_MS)

_ENTRY_ID = re.compile(r"[0-9]+-[0-9]+")

OnResult = Callable[[wire.JobResult], None]


class DeadLetterNotFound(LookupError):
    """`replay_dead` was given entry IDs that are not (or no longer) in the dead-letter stream;
    nothing was replayed. `missing` lists them."""

    def __init__(self, stream: str, missing: list[str]) -> None:
        super().__init__(f"no dead letter {', '.join(missing)} in {stream}")
        self.stream = stream
        self.missing = missing


class ResultsTimeout(TimeoutError):
    """`wait` ran out of time; `results` holds what arrived, `missing` the ids that did not."""

    def __init__(self, results: dict[str, wire.JobResult], missing: list[str]) -> None:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        super().__init__(f"{len(missing)} result(s) missing: {shown}")
        self.results = results
        self.missing = missing


@dataclass(frozen=True)
class Job:
    """One job for `submit_many`: exactly one of `image` (encoded bytes) or `path`."""

    image: bytes | None = None
    path: str | None = None
    id: str | None = None
    meta: bytes | None = None
    reply_to: str | None = None

    @classmethod
    def from_file(
        cls,
        file: str | os.PathLike[str],
        *,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
    ) -> Job:
        """Read `file` into an image job; the id defaults to the file's name."""
        p = Path(file)
        return cls(
            image=p.read_bytes(), id=p.name if id is None else id, meta=meta, reply_to=reply_to
        )

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry fields, only those that are set; ValueError if the job is invalid."""
        if (self.image is None) == (self.path is None):
            raise ValueError("a job needs exactly one of image (bytes) or path")
        out: dict[FieldT, EncodableT] = {}
        if self.image is not None:
            if not isinstance(self.image, (bytes, bytearray, memoryview)):
                raise ValueError(f"image must be bytes, not {type(self.image).__name__}")
            if len(self.image) == 0:
                raise ValueError("image is empty")
            out[wire.JOB_IMAGE] = self.image
        if self.path is not None:
            if not self.path:
                raise ValueError("path is empty")
            out[wire.JOB_PATH] = self.path.encode()
        if self.id is not None:
            _check_id(self.id)
            out[wire.JOB_ID] = self.id.encode()
        if self.reply_to is not None:
            if not self.reply_to:
                raise ValueError("reply_to is empty")
            out[wire.JOB_REPLY_TO] = self.reply_to.encode()
        if self.meta is not None:
            if not isinstance(self.meta, (bytes, bytearray, memoryview)):
                raise ValueError(f"meta must be bytes, not {type(self.meta).__name__}")
            out[wire.JOB_META] = self.meta
        return out


def _check_id(job_id: str) -> None:
    if not job_id:
        raise ValueError("id is empty; leave it out to use the stream entry ID")
    size = len(job_id.encode())
    if size > wire.MAX_ID_BYTES:
        raise ValueError(
            f"id is {size} bytes, over the limit of {wire.MAX_ID_BYTES}: {job_id[:40]}..."
        )


def file_job_ids(files: Sequence[str | os.PathLike[str]], *, id_prefix: str = "") -> list[str]:
    """Ids for jobs made from `files`: the file name, or the path relative to the files'
    common folder where names repeat, so that every id is unique and fits the limit."""
    paths = [Path(f).absolute() for f in files]
    names = [p.name for p in paths]
    counts = Counter(names)
    root = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path()
    seen: dict[str, int] = {}
    ids: list[str] = []
    for p, name in zip(paths, names, strict=True):
        base = p.relative_to(root).as_posix() if counts[name] > 1 else name
        nth = seen[base] = seen.get(base, 0) + 1
        # The same file given twice is two jobs; each needs its own id.
        ids.append(_fit_id(id_prefix + (base if nth == 1 else f"{base}#{nth}")))
    return ids


def _fit_id(job_id: str) -> str:
    if len(job_id.encode()) <= wire.MAX_ID_BYTES:
        return job_id
    # Keep the informative tail (file name) and a digest of the whole, so ids stay unique.
    digest = hashlib.sha1(job_id.encode()).hexdigest()[:16]
    tail = job_id.encode()[-(wire.MAX_ID_BYTES - len(digest) - 1) :].decode("utf-8", "ignore")
    return f"{digest}~{tail}"


def jobs_from_files(
    files: Sequence[str | os.PathLike[str]],
    *,
    id_prefix: str = "",
    meta: bytes | None = None,
    reply_to: str | None = None,
) -> Iterator[Job]:
    """Image jobs for `files`, read lazily one by one, with ids from `file_job_ids`."""
    for file, job_id in zip(files, file_job_ids(files, id_prefix=id_prefix), strict=True):
        yield Job.from_file(file, id=job_id, meta=meta, reply_to=reply_to)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(fields: dict[Any, Any]) -> wire.JobResult | None:
    """A result, or None for an entry that does not follow the contract (never fatal)."""
    try:
        return wire.JobResult.from_fields(fields)
    except (ValueError, TypeError):
        return None


def _stream_entries(items: Iterable[Any]) -> Iterator[tuple[str, dict[Any, Any]]]:
    # RESP2 gives [(id, fields), ...]; RESP3 wraps that list once more.
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (bytes, str)):
            if isinstance(item[1], dict):
                yield _text(item[0]), item[1]
        elif isinstance(item, (list, tuple)):
            yield from _stream_entries(item)


def _xread_entries(resp: Any) -> list[tuple[str, str, dict[Any, Any]]]:
    """(stream, entry id, fields) from an XREAD reply in RESP2 or RESP3 shape."""
    pairs = resp.items() if isinstance(resp, dict) else (resp or [])
    return [(_text(s), eid, f) for s, entries in pairs for eid, f in _stream_entries(entries)]


def _last_id(xrevrange_reply: Any) -> str:
    # XREAD returns entries after this id; "0-0" for an empty or missing stream is right too.
    entries = list(_stream_entries(xrevrange_reply or []))
    return entries[0][0] if entries else "0-0"


def _check_client(client: redis.Redis | aioredis.Redis) -> None:
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError(
            "the Redis client must use decode_responses=False: images and results are bytes"
        )


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream: a job that kept killing or stalling its workers.

    `dead_id` is the entry's ID in the dead-letter stream (what `replay_dead` takes), `entry`
    the job's original entry ID in the job stream, and `id` the job id its results are stored
    under (its `id` field, or `entry` where it has none). Exactly one of `image_bytes` (the
    size of the encoded image) and `path` is set for a well-formed job. `fields` names the
    job's own fields, in order, as `replay_dead` would enqueue them again.
    """

    dead_id: str
    id: str
    entry: str
    deliveries: int | None
    consumer: str | None
    dead_at_ms: int | None
    image_bytes: int | None
    path: str | None
    reply_to: str | None
    has_meta: bool
    fields: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def dead_at(self) -> datetime | None:
        """When the job was dead-lettered (UTC), if the entry says."""
        if self.dead_at_ms is None:
            return None
        return datetime.fromtimestamp(self.dead_at_ms / 1000, tz=timezone.utc)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view; `dead_at` in ISO 8601, UTC."""
        at = self.dead_at
        return {
            "dead_id": self.dead_id,
            "id": self.id,
            "entry": self.entry,
            "deliveries": self.deliveries,
            "consumer": self.consumer,
            "dead_at_ms": self.dead_at_ms,
            "dead_at": None if at is None else iso_utc(at),
            "image_bytes": self.image_bytes,
            "path": self.path,
            "reply_to": self.reply_to,
            "has_meta": self.has_meta,
            "fields": [f.decode("utf-8", "backslashreplace") for f in self.fields],
        }


def iso_utc(at: datetime) -> str:
    """`at` as ISO 8601 in UTC with milliseconds and a `Z`."""
    return at.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _norm(fields: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """Stream entry fields with bytes keys and values, in the entry's order."""
    return {_raw(k): _raw(v) for k, v in fields.items()}


def _job_fields(fields: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """A dead letter's fields less those the worker added: the job exactly as enqueued."""
    return {k: v for k, v in fields.items() if k not in DEAD_FIELDS}


def _own_id(fields: Mapping[bytes, bytes]) -> str | None:
    """The job's `id` where a worker would honour it (the worker's rule), else None."""
    raw = fields.get(wire.JOB_ID)
    if not raw or len(raw) > wire.MAX_ID_BYTES:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _opt_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "backslashreplace")


def _opt_int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _dead_letter(dead_id: str, raw_fields: Mapping[Any, Any]) -> DeadLetter:
    fields = _norm(raw_fields)
    entry = _opt_text(fields.get(DEAD_ENTRY)) or ""
    image = fields.get(wire.JOB_IMAGE)
    return DeadLetter(
        dead_id=dead_id,
        id=_own_id(fields) or entry,
        entry=entry,
        deliveries=_opt_int(fields.get(DEAD_DELIVERIES)),
        consumer=_opt_text(fields.get(DEAD_CONSUMER)),
        dead_at_ms=_opt_int(fields.get(DEAD_AT_MS)),
        image_bytes=None if image is None else len(image),
        path=_opt_text(fields.get(wire.JOB_PATH)),
        reply_to=_opt_text(fields.get(wire.JOB_REPLY_TO)),
        has_meta=wire.JOB_META in fields,
        fields=tuple(_job_fields(fields)),
    )


def _replay_selection(entry_ids: Sequence[str] | None, all: bool) -> list[str] | None:
    """The entry IDs to replay (deduplicated, in order), or None for all of them."""
    if all:
        if entry_ids:
            raise ValueError("give either entry IDs or all=True, not both")
        return None
    if entry_ids is None:
        raise ValueError("give the dead letters' entry IDs, or all=True")
    if isinstance(entry_ids, str):
        raise TypeError("entry_ids is a list of entry IDs, not one string")
    ids = list(dict.fromkeys(entry_ids))
    bad = [i for i in ids if not _ENTRY_ID.fullmatch(i)]
    if bad:
        raise ValueError(f"not a stream entry ID (ms-seq): {', '.join(map(repr, bad))}")
    return ids


def _single_entries(replies: list[Any]) -> list[tuple[str, dict[Any, Any]]]:
    """The entries of one-entry XRANGE replies, left out where the entry is gone."""
    return [e for reply in replies for e in _stream_entries(reply or [])]


@dataclass
class _Replay:
    """What replaying some dead letters writes, worked out before the transaction."""

    dead_ids: list[str] = field(default_factory=list)
    jobs: list[dict[bytes, bytes]] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    reply_to: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls, entries: Iterable[tuple[str, Mapping[Any, Any]]], result_prefix: str
    ) -> tuple[_Replay, list[str]]:
        """The plan for `entries`, and the IDs of those with no job fields to replay."""
        plan, empty = cls(), []
        for dead_id, raw_fields in entries:
            job = _job_fields(_norm(raw_fields))
            if not job:
                empty.append(dead_id)
                continue
            plan.dead_ids.append(dead_id)
            plan.jobs.append(job)
            own_id = _own_id(job)
            if own_id is not None:
                # The dead_letter error result under this id would make workers answer the
                # replayed job as a duplicate of an id that already has a result.
                plan.stale.append(wire.result_key(own_id, result_prefix))
            reply_to = _opt_text(job.get(wire.JOB_REPLY_TO))
            if reply_to:
                plan.reply_to.append(reply_to)
        return plan, empty

    def queue(self, pipe: Any, stream: str, dead_stream: str, keep: bool) -> None:
        """Queue the writes on `pipe`, a sync or asyncio pipeline in MULTI mode."""
        if self.stale:
            pipe.delete(*dict.fromkeys(self.stale))
        for job in self.jobs:
            pipe.xadd(stream, job)
        if not keep and self.dead_ids:
            pipe.xdel(dead_stream, *self.dead_ids)

    def added(self, replies: list[Any]) -> list[str]:
        """The new job entry IDs, from the transaction's replies."""
        first = 1 if self.stale else 0
        return [_text(r) for r in replies[first : first + len(self.jobs)]]


class _Waiter:
    """The client-independent half of `wait`: what is still missing and where to read next."""

    def __init__(
        self, ids: Iterable[str], timeout_s: float | None, on_result: OnResult | None
    ) -> None:
        self.wanted = list(dict.fromkeys(ids))
        self.pending = set(self.wanted)
        self.found: dict[str, wire.JobResult] = {}
        self.cursors: dict[KeyT, StreamIdT] = {}
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.recheck_at = time.monotonic() + _RECHECK_S
        self.on_result = on_result

    def take(self, result: wire.JobResult | None) -> None:
        if result is not None and result.id in self.pending:
            self.pending.discard(result.id)
            self.found[result.id] = result
            if self.on_result is not None:
                self.on_result(result)

    def take_entries(self, resp: Any) -> None:
        for stream, entry_id, fields in _xread_entries(resp):
            self.cursors[stream] = entry_id
            self.take(_parse(fields))

    def hash_chunks(self) -> list[list[str]]:
        self.recheck_at = time.monotonic() + _RECHECK_S
        ids = [i for i in self.wanted if i in self.pending]
        return [ids[i : i + _HASH_CHUNK] for i in range(0, len(ids), _HASH_CHUNK)]

    def take_hashes(self, replies: list[Any]) -> None:
        for reply in replies:
            if reply:
                self.take(_parse(reply))

    def block_ms(self) -> int | None:
        """How long the next XREAD may block; None when done or out of time."""
        if not self.pending:
            return None
        if self.deadline is None:
            return _MAX_BLOCK_MS
        left_ms = int((self.deadline - time.monotonic()) * 1000)
        # XREAD BLOCK 0 would block forever.
        return min(left_ms, _MAX_BLOCK_MS) if left_ms >= 1 else None

    def recheck_due(self) -> bool:
        return bool(self.pending) and time.monotonic() >= self.recheck_at

    def finish(self, raise_on_timeout: bool) -> dict[str, wire.JobResult]:
        results = {i: self.found[i] for i in self.wanted if i in self.found}
        if self.pending and raise_on_timeout:
            raise ResultsTimeout(results, [i for i in self.wanted if i in self.pending])
        return results


class _Base:
    def __init__(
        self, stream: str, results_stream: str, result_prefix: str, dead_stream: str
    ) -> None:
        self.stream = stream
        self.results_stream = results_stream
        self.result_prefix = result_prefix
        self.dead_stream = dead_stream
        # Every reply_to used here is watched by wait(); a handful of names, not one per job.
        self._reply_streams: dict[str, None] = {results_stream: None}

    def _fields(self, job: Job) -> dict[FieldT, EncodableT]:
        fields = job.fields()
        if job.reply_to is not None:
            self._reply_streams[job.reply_to] = None
        return fields

    def _watched(self, streams: Iterable[str] | None) -> list[str]:
        return list(self._reply_streams if streams is None else dict.fromkeys(streams))

    def _plan(self, entries: Iterable[tuple[str, Mapping[Any, Any]]]) -> tuple[_Replay, list[str]]:
        return _Replay.of(entries, self.result_prefix)

    def _replayed(self, plan: _Replay, replies: list[Any]) -> list[str]:
        for reply_to in plan.reply_to:
            self._reply_streams[reply_to] = None
        return plan.added(replies)

    def _dead_letters(self, reply: Any) -> list[DeadLetter]:
        return [_dead_letter(eid, f) for eid, f in _stream_entries(reply or [])]


class Producer(_Base):
    """A synchronous gpufeed client. Closes the Redis client only if it created it."""

    def __init__(
        self,
        url_or_client: str | redis.Redis = DEFAULT_REDIS_URL,
        *,
        stream: str = wire.DEFAULT_STREAM,
        results_stream: str = wire.DEFAULT_RESULTS_STREAM,
        result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
        dead_stream: str = wire.DEFAULT_DEAD_STREAM,
    ) -> None:
        super().__init__(stream, results_stream, result_prefix, dead_stream)
        self._owns_client = isinstance(url_or_client, str)
        self.client = (
            redis.Redis.from_url(url_or_client) if isinstance(url_or_client, str) else url_or_client
        )
        _check_client(self.client)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def submit(
        self,
        image: bytes | None = None,
        *,
        path: str | None = None,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
    ) -> str:
        """Enqueue one job; returns its id (`id`, or the stream entry ID the worker will use)."""
        job = Job(image=image, path=path, id=id, meta=meta, reply_to=reply_to)
        entry_id = _text(self.client.xadd(self.stream, self._fields(job)))
        return entry_id if id is None else id

    def submit_many(self, jobs: Iterable[Job]) -> list[str]:
        """Enqueue all `jobs` in one pipelined round trip, or none if any is invalid."""
        prepared = [(job, self._fields(job)) for job in jobs]
        if not prepared:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for _, fields in prepared:
                pipe.xadd(self.stream, fields)
            entry_ids = pipe.execute()
        return [
            _text(e) if job.id is None else job.id
            for (job, _), e in zip(prepared, entry_ids, strict=True)
        ]

    def get_result(self, id: str) -> wire.JobResult | None:
        reply = self.client.hgetall(wire.result_key(id, self.result_prefix))
        return _parse(reply) if reply else None

    def wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None = 30.0,
        *,
        raise_on_timeout: bool = False,
        on_result: OnResult | None = None,
        streams: Iterable[str] | None = None,
    ) -> dict[str, wire.JobResult]:
        """Results for `ids` (in that order) that arrive within `timeout_s` (None: no limit).

        Watches the results stream and every reply_to this producer used (or `streams`).
        Missing results raise ResultsTimeout if `raise_on_timeout`, else are left out.
        `on_result` is called as each result arrives, e.g. to drive a progress bar.
        """
        w = _Waiter(ids, timeout_s, on_result)
        if not w.pending:
            return {}
        watched = self._watched(streams)
        # The cursors are taken before the hashes are read: a result published in between
        # is in both, one published later is in the stream after the cursor.
        with self.client.pipeline(transaction=False) as pipe:
            for s in watched:
                pipe.xrevrange(s, count=1)
            w.cursors = {s: _last_id(r) for s, r in zip(watched, pipe.execute(), strict=True)}
        self._check_hashes(w)
        while (block := w.block_ms()) is not None:
            w.take_entries(self.client.xread(w.cursors, count=_READ_COUNT, block=block))
            if w.recheck_due():
                self._check_hashes(w)
        if w.pending:
            self._check_hashes(w)
        return w.finish(raise_on_timeout)

    def wait_one(self, id: str, timeout_s: float | None = 30.0) -> wire.JobResult:
        """The result of `id`; ResultsTimeout (a TimeoutError) if none arrives in time."""
        return self.wait([id], timeout_s, raise_on_timeout=True)[id]

    def _check_hashes(self, w: _Waiter) -> None:
        for chunk in w.hash_chunks():
            with self.client.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hgetall(wire.result_key(job_id, self.result_prefix))
                w.take_hashes(pipe.execute())

    def recent_results(
        self, count: int = 10, *, stream: str | None = None
    ) -> list[tuple[str, wire.JobResult]]:
        """The last `count` results on the results stream, oldest first, with entry ids."""
        reply = self.client.xrevrange(stream or self.results_stream, count=count)
        return [
            (eid, r)
            for eid, f in reversed(list(_stream_entries(reply or [])))
            if (r := _parse(f)) is not None
        ]

    def iter_results(
        self,
        start: str = "$",
        *,
        block_ms: int | None = _MAX_BLOCK_MS,
        count: int = 100,
        stream: str | None = None,
    ) -> Iterator[tuple[str, wire.JobResult]]:
        """(entry id, result) from the results stream after `start` ("$": only new ones,
        "0": all). block_ms=None reads what is there and stops; otherwise this follows the
        stream for ever, each read blocking up to block_ms."""
        name = stream or self.results_stream
        # "$" is resolved once: re-sent on every read it would skip entries between reads.
        cursor = _last_id(self.client.xrevrange(name, count=1)) if start == "$" else start
        block = None if block_ms is None else max(1, min(block_ms, _MAX_BLOCK_MS))
        while True:
            entries = _xread_entries(self.client.xread({name: cursor}, count=count, block=block))
            if not entries and block is None:
                return
            for _, entry_id, fields in entries:
                cursor = entry_id
                if (result := _parse(fields)) is not None:
                    yield entry_id, result

    # ------------------------------------------------------------------ dead letters
    def dead_letters(self, count: int = 100, start: str = "-") -> list[DeadLetter]:
        """Up to `count` dead letters, oldest first, from `start` (an entry ID, inclusive;
        "(ID" for the ones after ID, to page on)."""
        return self._dead_letters(self.client.xrange(self.dead_stream, start, count=count))

    def replay_dead(
        self, entry_ids: Sequence[str] | None = None, *, all: bool = False, keep: bool = False
    ) -> list[str]:
        """Enqueue dead letters again, to be run again; returns the new job entry IDs.

        Give the dead letters' `entry_ids` (their IDs in the dead-letter stream, e.g. from
        `dead_letters`) or `all=True`. Each job is added to the job stream with exactly its
        original fields (image or path, id, reply_to, meta and any field of the producer's
        own), without the `dead_*` fields the worker added. Replay means "run it again": the
        result stored for the job's `id` (its `dead_letter` error) is deleted, or workers
        would answer the replayed job as a duplicate of an id that already has a result.
        A job without an `id` is identified by its new entry ID, so its old result stays.

        The dead letters are removed from the dead-letter stream unless `keep`. Their jobs,
        the removal and the deletion of the stale results are one MULTI/EXEC transaction,
        under WATCH of the dead-letter stream, so a replay is never half done nor done twice
        by two concurrent replays. With entry IDs, all of them are one transaction and
        DeadLetterNotFound is raised, with nothing replayed, if any is not in the stream;
        with all=True, the dead letters present when the call starts are replayed in
        transactions of up to 100 each, and entries with no job fields are left in place.
        In Redis Cluster the job stream, the dead-letter stream and the result prefix must
        share a hash tag.
        """
        ids = _replay_selection(entry_ids, all)
        if ids is None:
            return self._replay_all(keep)
        if not ids:
            return []
        for _ in range(_REPLAY_ATTEMPTS - 1):
            with contextlib.suppress(redis.WatchError):
                return self._replay_ids(ids, keep)
        return self._replay_ids(ids, keep)

    def _replay_ids(self, ids: list[str], keep: bool) -> list[str]:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.watch(self.dead_stream)  # type: ignore[no-untyped-call]
            # Read on another connection: on the watching one each command is a round trip.
            with self.client.pipeline(transaction=False) as read:
                for i in ids:
                    read.xrange(self.dead_stream, i, i, count=1)
                found = dict(_single_entries(read.execute()))
            missing = [i for i in ids if i not in found]
            plan, empty = self._plan((i, found[i]) for i in ids if i in found)
            if missing or empty:
                pipe.unwatch()
                if missing:
                    raise DeadLetterNotFound(self.dead_stream, missing)
                raise ValueError(f"dead letter(s) with no job fields: {', '.join(empty)}")
            pipe.multi()
            plan.queue(pipe, self.stream, self.dead_stream, keep)
            return self._replayed(plan, pipe.execute())

    def _replay_all(self, keep: bool) -> list[str]:
        end = _last_id(self.client.xrevrange(self.dead_stream, count=1))
        added: list[str] = []
        cursor = "-"
        while end != "0-0":
            for attempt in range(_REPLAY_ATTEMPTS):
                try:
                    new, last = self._replay_range(cursor, end, keep)
                    break
                except redis.WatchError:
                    if attempt == _REPLAY_ATTEMPTS - 1:
                        raise
            added += new
            if last is None or last == end:
                break
            cursor = f"({last}"
        return added

    def _replay_range(self, start: str, end: str, keep: bool) -> tuple[list[str], str | None]:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.watch(self.dead_stream)  # type: ignore[no-untyped-call]
            entries = list(
                _stream_entries(
                    self.client.xrange(self.dead_stream, start, end, _REPLAY_CHUNK) or []
                )
            )
            if not entries:
                pipe.unwatch()
                return [], None
            plan, _ = self._plan(entries)
            pipe.multi()
            plan.queue(pipe, self.stream, self.dead_stream, keep)
            return self._replayed(plan, pipe.execute() if plan.jobs else []), entries[-1][0]


class AsyncProducer(_Base):
    """The asyncio twin of `Producer`: the same methods, awaited."""

    def __init__(
        self,
        url_or_client: str | aioredis.Redis = DEFAULT_REDIS_URL,
        *,
        stream: str = wire.DEFAULT_STREAM,
        results_stream: str = wire.DEFAULT_RESULTS_STREAM,
        result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
        dead_stream: str = wire.DEFAULT_DEAD_STREAM,
    ) -> None:
        super().__init__(stream, results_stream, result_prefix, dead_stream)
        self._owns_client = isinstance(url_or_client, str)
        self.client = (
            aioredis.Redis.from_url(url_or_client)
            if isinstance(url_or_client, str)
            else url_or_client
        )
        _check_client(self.client)

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def submit(
        self,
        image: bytes | None = None,
        *,
        path: str | None = None,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
    ) -> str:
        job = Job(image=image, path=path, id=id, meta=meta, reply_to=reply_to)
        entry_id = _text(await self.client.xadd(self.stream, self._fields(job)))
        return entry_id if id is None else id

    async def submit_many(self, jobs: Iterable[Job]) -> list[str]:
        prepared = [(job, self._fields(job)) for job in jobs]
        if not prepared:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for _, fields in prepared:
                pipe.xadd(self.stream, fields)
            entry_ids = await pipe.execute()
        return [
            _text(e) if job.id is None else job.id
            for (job, _), e in zip(prepared, entry_ids, strict=True)
        ]

    async def get_result(self, id: str) -> wire.JobResult | None:
        reply = await self.client.hgetall(wire.result_key(id, self.result_prefix))
        return _parse(reply) if reply else None

    async def wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None = 30.0,
        *,
        raise_on_timeout: bool = False,
        on_result: OnResult | None = None,
        streams: Iterable[str] | None = None,
    ) -> dict[str, wire.JobResult]:
        w = _Waiter(ids, timeout_s, on_result)
        if not w.pending:
            return {}
        watched = self._watched(streams)
        async with self.client.pipeline(transaction=False) as pipe:
            for s in watched:
                pipe.xrevrange(s, count=1)
            w.cursors = {s: _last_id(r) for s, r in zip(watched, await pipe.execute(), strict=True)}
        await self._check_hashes(w)
        while (block := w.block_ms()) is not None:
            w.take_entries(await self.client.xread(w.cursors, count=_READ_COUNT, block=block))
            if w.recheck_due():
                await self._check_hashes(w)
        if w.pending:
            await self._check_hashes(w)
        return w.finish(raise_on_timeout)

    async def wait_one(self, id: str, timeout_s: float | None = 30.0) -> wire.JobResult:
        return (await self.wait([id], timeout_s, raise_on_timeout=True))[id]

    async def _check_hashes(self, w: _Waiter) -> None:
        for chunk in w.hash_chunks():
            async with self.client.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hgetall(wire.result_key(job_id, self.result_prefix))
                w.take_hashes(await pipe.execute())

    async def recent_results(
        self, count: int = 10, *, stream: str | None = None
    ) -> list[tuple[str, wire.JobResult]]:
        reply = await self.client.xrevrange(stream or self.results_stream, count=count)
        return [
            (eid, r)
            for eid, f in reversed(list(_stream_entries(reply or [])))
            if (r := _parse(f)) is not None
        ]

    async def iter_results(
        self,
        start: str = "$",
        *,
        block_ms: int | None = _MAX_BLOCK_MS,
        count: int = 100,
        stream: str | None = None,
    ) -> AsyncIterator[tuple[str, wire.JobResult]]:
        name = stream or self.results_stream
        cursor = _last_id(await self.client.xrevrange(name, count=1)) if start == "$" else start
        block = None if block_ms is None else max(1, min(block_ms, _MAX_BLOCK_MS))
        while True:
            entries = _xread_entries(
                await self.client.xread({name: cursor}, count=count, block=block)
            )
            if not entries and block is None:
                return
            for _, entry_id, fields in entries:
                cursor = entry_id
                if (result := _parse(fields)) is not None:
                    yield entry_id, result

    # ------------------------------------------------------------------ dead letters
    async def dead_letters(self, count: int = 100, start: str = "-") -> list[DeadLetter]:
        return self._dead_letters(await self.client.xrange(self.dead_stream, start, count=count))

    async def replay_dead(
        self, entry_ids: Sequence[str] | None = None, *, all: bool = False, keep: bool = False
    ) -> list[str]:
        """See `Producer.replay_dead`: replay means "run it again" (the stale result of the
        job's id is deleted in the same transaction)."""
        ids = _replay_selection(entry_ids, all)
        if ids is None:
            return await self._replay_all(keep)
        if not ids:
            return []
        for _ in range(_REPLAY_ATTEMPTS - 1):
            with contextlib.suppress(redis.WatchError):
                return await self._replay_ids(ids, keep)
        return await self._replay_ids(ids, keep)

    async def _replay_ids(self, ids: list[str], keep: bool) -> list[str]:
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(self.dead_stream)
            async with self.client.pipeline(transaction=False) as read:
                for i in ids:
                    read.xrange(self.dead_stream, i, i, count=1)
                found = dict(_single_entries(await read.execute()))
            missing = [i for i in ids if i not in found]
            plan, empty = self._plan((i, found[i]) for i in ids if i in found)
            if missing or empty:
                await pipe.unwatch()  # type: ignore[no-untyped-call]
                if missing:
                    raise DeadLetterNotFound(self.dead_stream, missing)
                raise ValueError(f"dead letter(s) with no job fields: {', '.join(empty)}")
            pipe.multi()  # type: ignore[no-untyped-call]
            plan.queue(pipe, self.stream, self.dead_stream, keep)
            return self._replayed(plan, await pipe.execute())

    async def _replay_all(self, keep: bool) -> list[str]:
        end = _last_id(await self.client.xrevrange(self.dead_stream, count=1))
        added: list[str] = []
        cursor = "-"
        while end != "0-0":
            for attempt in range(_REPLAY_ATTEMPTS):
                try:
                    new, last = await self._replay_range(cursor, end, keep)
                    break
                except redis.WatchError:
                    if attempt == _REPLAY_ATTEMPTS - 1:
                        raise
            added += new
            if last is None or last == end:
                break
            cursor = f"({last}"
        return added

    async def _replay_range(self, start: str, end: str, keep: bool) -> tuple[list[str], str | None]:
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(self.dead_stream)
            reply = await self.client.xrange(self.dead_stream, start, end, _REPLAY_CHUNK)
            entries = list(_stream_entries(reply or []))
            if not entries:
                await pipe.unwatch()  # type: ignore[no-untyped-call]
                return [], None
            plan, _ = self._plan(entries)
            pipe.multi()  # type: ignore[no-untyped-call]
            plan.queue(pipe, self.stream, self.dead_stream, keep)
            replies = await pipe.execute() if plan.jobs else []
            return self._replayed(plan, replies), entries[-1][0]
