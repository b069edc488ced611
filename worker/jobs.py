"""A job as the pipeline carries it, parsed from one stream entry, and its outcome."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import structlog

from producer import wire
from producer.job_fields import (
    DEADLINE_PROBLEM,
    deadline_of,
    field_problem,
    sources_problem,
    text_field,
)
from producer.priorities import entry_ref
from producer.wire import ErrorCode
from worker.model.answers import Answer

log = structlog.get_logger("gpufeed.jobs")


class JobEntry(NamedTuple):
    """What a job's stream entry says, parsed by the rules both sides read
    (producer/job_fields.py): the wire contract as the producer sent it. Frozen (a tuple:
    one is made per job, on the event loop): no stage changes what a job asked for; what
    the stages find and decide is the Job's."""

    entry_id: str
    # Its own id and reply_to, where it gave valid ones; None: the defaults apply.
    id: str | None
    reply_to: str | None
    meta: bytes | None
    # bytes, or with the intake's process a read-only view of the shared payload memory.
    image: bytes | memoryview | None
    path: bytes | None
    # A `url` job: where its bytes are.
    url: str | None = None
    # Unix milliseconds after which the job is answered `deadline_exceeded` instead of run.
    deadline_ms: int | None = None
    # What breaks the contract, the first problem told; None: nothing.
    problem: tuple[ErrorCode, str] | None = None


@dataclass(eq=False)
class Job:
    """A job on its way through the stages: its entry (frozen) and the stages' bookkeeping.
    The entry's fields read through (`job.path`, `job.url`, ...); `job_id`, `reply_to`,
    `meta`, `image` and `has_own_id` are the values the stages use, which start as the
    entry's and which a stage may settle otherwise (the entry reference as id, a tenant's
    results stream, the bytes a fetch brought, a result stored by its entry)."""

    entry: JobEntry
    # The id its result carries: its own, else the entry's reference.
    job_id: str
    # The stream its result goes to: its own reply_to, else the worker's (or tenant's).
    reply_to: str
    # What its result echoes (None: nothing, e.g. an answer that must stay small).
    meta: bytes | None
    # The bytes to decode: the entry's, or for a `url` job what the fetch stage brought.
    image: bytes | memoryview | None
    # Its result is stored under its own id (a second job with that id is answered by the
    # first's result instead of running again); False: under its entry.
    has_own_id: bool = False
    # Why it is answered without running: the entry's problem, or a stage's verdict.
    rejected: tuple[ErrorCode, str] | None = None
    received_s: float = field(default_factory=time.monotonic)
    # When the job became ready for a batch row: its arrival, or the end of its fetch.
    ready_s: float = field(default_factory=time.monotonic)
    # Decode-cache key the fetch stage derived from the URL and its validator (ETag or
    # Last-Modified); None: the decode pool keys the cache by a hash of the bytes.
    cache_key: bytes | None = None
    # A decoded row the fetch stage took from the decode cache (the server answered 304
    # Not Modified): (row, DecodeInfo), copied into the staging row instead of decoding.
    cached_row: tuple[Any, Any] | None = None
    # Per-stage durations in milliseconds, filled as the job moves along.
    timings_ms: dict[str, float] = field(default_factory=dict)
    # How many times Redis delivered this entry (1 on a first read).
    deliveries: int = 1
    # The job stream the entry was read from; empty: the worker's configured stream. A
    # worker that reads several streams (priority levels, shards) acknowledges each entry
    # on its own stream.
    stream: str = ""
    # The priority level of that stream; "" without priorities.
    level: str = ""
    # With the intake's process (worker/delivery/intake_process.py): where `image` lies in
    # the shared payload memory (its offset there, -1: `image` is bytes of its own) and the
    # read whose payloads hold that memory until the job's result is published.
    payload_at: int = -1
    payload_span: int = -1

    @classmethod
    def new(
        cls,
        entry_id: str,
        job_id: str,
        reply_to: str,
        *,
        meta: bytes | None = None,
        image: bytes | memoryview | None = None,
        path: bytes | None = None,
        url: str | None = None,
        deadline_ms: int | None = None,
        has_own_id: bool = False,
        **work: Any,
    ) -> Job:
        """A job from its parts (the writer's process rebuilding one, warm start, tests):
        the entry they make, and `work`, the stages' fields."""
        entry = JobEntry(
            entry_id,
            job_id if has_own_id else None,
            reply_to,
            meta,
            image,
            path,
            url,
            deadline_ms,
            work.get("rejected"),
        )
        return cls(
            entry=entry,
            job_id=job_id,
            reply_to=reply_to,
            meta=meta,
            image=image,
            has_own_id=has_own_id,
            **work,
        )

    @property
    def entry_id(self) -> str:
        return self.entry.entry_id

    @property
    def path(self) -> bytes | None:
        return self.entry.path

    @property
    def url(self) -> str | None:
        return self.entry.url

    @property
    def deadline_ms(self) -> int | None:
        return self.entry.deadline_ms

    @property
    def entry_ref(self) -> str:
        """The entry as results name it: its ID, qualified by its level where there are
        levels, since two level streams may hand out the same entry ID."""
        return entry_ref(self.level, self.entry_id)

    def read_from(self, stream: str, level: str) -> Job:
        """Note the stream (and level) the entry was read from; a job without its own id is
        known by its entry reference."""
        self.stream, self.level = stream, level
        if not self.has_own_id:
            self.job_id = self.entry_ref
        return self

    @cached_property
    def enqueued_ms(self) -> int:
        """The stream entry's own timestamp (ms since the epoch), when Redis assigned it.
        Parsed once: the reader, the deadline check and the metrics all ask for it."""
        try:
            return int(self.entry_id.split("-", 1)[0])
        except ValueError:
            return 0


@dataclass(eq=False)
class Outcome:
    """The result of one job, ready to be published."""

    job: Job
    ok: bool
    # What the model answered (ok outcomes): classes, an embedding or a raw output.
    answer: Answer | None = None
    error_code: ErrorCode | None = None
    error_message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Redis refused to publish it once already (logged then; retries are not logged again).
    refused_logged: bool = False
    # For a dead letter: the job entry's original fields, copied to the dead-letter stream.
    dead_fields: list[bytes | str] | None = None

    @classmethod
    def failure(cls, job: Job, code: ErrorCode, message: str) -> Outcome:
        return cls(job=job, ok=False, error_code=code, error_message=message)

    @property
    def error_text(self) -> str:
        code = self.error_code.value if self.error_code else ErrorCode.INTERNAL_ERROR.value
        return f"{code}: {self.error_message}"


def parse_job(
    entry_id: str,
    fields: dict[bytes, bytes],
    default_reply_to: str,
    max_meta_bytes: int = wire.DEFAULT_MAX_META_BYTES,
) -> Job:
    """Turn a stream entry into a Job; contract violations become `rejected`, never raise.

    The rules are producer/job_fields.py's, which the producer checks before sending.
    Unknown fields are ignored, as the contract says, so producers can add their own. The
    fields a result echoes (`meta`, and `reply_to` as a key) are bounded here, before the
    job costs anything: an oversized one would make its result too large for one publish
    call, and the answer that says so carries neither. A bad id is the first problem told:
    the answer then goes under the entry ID, so that it can be found.
    """
    raw_id = fields.get(wire.JOB_ID)
    raw_reply = fields.get(wire.JOB_REPLY_TO)
    reply_to, reply_problem = _text_field("reply_to", raw_reply, default_reply_to)
    job_id, id_problem = _text_field("id", raw_id, entry_id)
    rejected = id_problem or reply_problem

    meta = fields.get(wire.JOB_META)
    if meta is not None:
        too_large = field_problem("meta", meta, limit=max_meta_bytes)
        if too_large is not None:
            # Never echoed, whatever else is wrong with the job.
            rejected = rejected or too_large
            meta = None

    deadline_ms: int | None = None
    raw_deadline = fields.get(wire.JOB_DEADLINE_MS)
    if raw_deadline is not None and rejected is None:
        deadline_ms = deadline_of(raw_deadline)
        if deadline_ms is None:
            rejected = DEADLINE_PROBLEM

    image = fields.get(wire.JOB_IMAGE)
    path = fields.get(wire.JOB_PATH)
    raw_url = fields.get(wire.JOB_URL)
    url: str | None = None
    if rejected is None:
        given = [
            (n, v) for n, v in (("image", image), ("path", path), ("url", raw_url)) if v is not None
        ]
        if len(given) != 1:
            rejected = sources_problem([n for n, _ in given])
        else:
            name, value = given[0]
            if name == "url":
                url, rejected = text_field("url", value)
                url = url if rejected is None else None
            else:
                rejected = field_problem(name, value)

    entry = JobEntry(  # positional: one per job, on the event loop
        entry_id,
        job_id if raw_id is not None and id_problem is None else None,
        reply_to if raw_reply is not None and reply_problem is None else None,
        meta,
        image,
        path,
        url,
        deadline_ms,
        rejected,
    )
    return Job(
        entry=entry,
        job_id=job_id,
        reply_to=reply_to,
        meta=meta,
        image=image,
        has_own_id=entry.id is not None,
        rejected=rejected,
    )


def _text_field(
    name: str, raw: bytes | None, default: str
) -> tuple[str, tuple[ErrorCode, str] | None]:
    """A text field's value (`default` when absent or broken) and its problem, if any."""
    if raw is None:
        return default, None
    text, problem = text_field(name, raw)
    return (default, problem) if problem is not None else (text, None)


def job_of_entry(
    entry_id: str,
    fields: Any,
    default_reply_to: str,
    max_meta_bytes: int = wire.DEFAULT_MAX_META_BYTES,
) -> Job:
    """`parse_job`, for the stages that read entries (the reader, the reclaimer): should
    parsing ever fail, the entry is answered `invalid_job` instead of ending the stage,
    which would leave it pending for the next worker to die on in turn."""
    try:
        return parse_job(entry_id, fields, default_reply_to, max_meta_bytes)
    except Exception as exc:  # noqa: BLE001 - nothing a job carries may end a stage task
        log.error("job_unparsable", entry=entry_id, error=repr(exc))
        job = parse_job(entry_id, {}, default_reply_to, max_meta_bytes)
        job.rejected = (ErrorCode.INVALID_JOB, "the job's fields could not be read")
        return job


def past_deadline(job: Job, now_ms: float) -> Outcome | None:
    """The `deadline_exceeded` answer of a job whose deadline has passed, else None."""
    if job.deadline_ms is None or now_ms <= job.deadline_ms:
        return None
    late = now_ms - job.deadline_ms
    return Outcome.failure(
        job,
        ErrorCode.DEADLINE_EXCEEDED,
        f"its deadline_ms passed {late:.0f} ms before it could run; not decoded or computed",
    )


def deleted_entry_job(entry_id: str, default_reply_to: str) -> Job:
    """A pending entry whose data was deleted (XDEL or a trim): it cannot run, yet it must
    end with a result. Its own id and reply_to went with its fields, so the entry ID and
    the default results stream stand in."""
    job = parse_job(entry_id, {}, default_reply_to)
    job.rejected = (
        ErrorCode.ENTRY_DELETED,
        "the job entry was deleted from the stream while it was pending",
    )
    return job
