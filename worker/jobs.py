"""A job as the pipeline carries it, parsed from one stream entry, and its outcome."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import structlog

from producer import wire
from producer.priorities import entry_ref
from producer.wire import ErrorCode
from worker.model.answers import Answer

log = structlog.get_logger("gpufeed.jobs")

# A Unix time in milliseconds: ASCII digits only (str.isdigit() and int() also take
# superscripts, other scripts' digits and underscores), at most 20 of them so that int()
# never meets a number it refuses; ASCII white space around it.
_DEADLINE = re.compile(rb"\s*([0-9]{1,20})\s*")


@dataclass(eq=False)
class Job:
    entry_id: str
    job_id: str
    reply_to: str
    meta: bytes | None
    # bytes, or with the intake's process a read-only view of the shared payload memory.
    image: bytes | memoryview | None
    path: bytes | None
    # A `url` job: where its bytes are (the fetch stage sets `image` once they arrived).
    url: str | None = None
    # Unix milliseconds after which the job is answered `deadline_exceeded` instead of run.
    deadline_ms: int | None = None
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
    # Set when the job was read and rejected before decoding.
    rejected: tuple[ErrorCode, str] | None = None
    # The producer gave its own id: a second job with that id is answered by the first's
    # result instead of running again.
    has_own_id: bool = False
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


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def parse_job(
    entry_id: str,
    fields: dict[bytes, bytes],
    default_reply_to: str,
    max_meta_bytes: int = wire.DEFAULT_MAX_META_BYTES,
) -> Job:
    """Turn a stream entry into a Job; contract violations become `rejected`, never raise.

    Unknown fields are ignored, as the contract says, so producers can add their own. The
    fields a result echoes (`meta`, and `reply_to` as a key) are bounded here, before the
    job costs anything: an oversized one would make its result too large for one publish
    call, and the answer that says so carries neither.
    """
    raw_id = fields.get(wire.JOB_ID)
    raw_reply = fields.get(wire.JOB_REPLY_TO)
    meta = fields.get(wire.JOB_META)
    image = fields.get(wire.JOB_IMAGE)
    path = fields.get(wire.JOB_PATH)
    raw_url = fields.get(wire.JOB_URL)
    raw_deadline = fields.get(wire.JOB_DEADLINE_MS)

    reply_to = default_reply_to
    rejected: tuple[ErrorCode, str] | None = None
    if raw_reply is not None:
        text = _text(raw_reply)
        if len(raw_reply) > wire.MAX_REPLY_TO_BYTES:
            rejected = (
                ErrorCode.INVALID_JOB,
                f"reply_to is {len(raw_reply):,} bytes; at most {wire.MAX_REPLY_TO_BYTES:,} "
                "are allowed",
            )
        elif text is None or not text.strip():
            rejected = (ErrorCode.INVALID_JOB, "reply_to is empty or not a UTF-8 stream name")
        else:
            reply_to = text

    # The result must be findable, so a bad id falls back to the entry ID for the answer.
    job_id = entry_id
    has_own_id = False
    if raw_id is not None:
        text = _text(raw_id)
        if len(raw_id) > wire.MAX_ID_BYTES:
            rejected = (
                ErrorCode.ID_TOO_LONG,
                f"id is {len(raw_id)} bytes, at most {wire.MAX_ID_BYTES} are allowed",
            )
        elif text is None:
            rejected = (ErrorCode.INVALID_JOB, "id is not valid UTF-8")
        elif text == "":
            rejected = (ErrorCode.INVALID_JOB, "id is empty")
        else:
            job_id = text
            has_own_id = True

    if meta is not None and len(meta) > max_meta_bytes:
        # Never echoed, whatever else is wrong with the job.
        rejected = rejected or (
            ErrorCode.INVALID_JOB,
            f"meta is {len(meta):,} bytes; at most {max_meta_bytes:,} are allowed "
            "(GPUFEED_MAX_META_BYTES); it is not echoed",
        )
        meta = None

    deadline_ms: int | None = None
    if raw_deadline is not None and rejected is None:
        deadline_ms = _deadline(raw_deadline)
        if deadline_ms is None:
            rejected = (
                ErrorCode.INVALID_JOB,
                "deadline_ms is not a Unix time in milliseconds (a positive integer)",
            )

    url: str | None = None
    if rejected is None:
        sources = [
            n for n, v in (("image", image), ("path", path), ("url", raw_url)) if v is not None
        ]
        if len(sources) > 1:
            rejected = (
                ErrorCode.INVALID_JOB,
                f"give exactly one of image, path or url, not {' and '.join(sources)}",
            )
        elif not sources:
            rejected = (ErrorCode.INVALID_JOB, "the job has none of the image, path or url fields")
        elif image is not None and len(image) == 0:
            rejected = (ErrorCode.EMPTY_IMAGE, "the image field is empty")
        elif path is not None and len(path) == 0:
            rejected = (ErrorCode.INVALID_JOB, "the path field is empty")
        elif raw_url is not None and len(raw_url) > wire.MAX_URL_BYTES:
            rejected = (
                ErrorCode.INVALID_JOB,
                f"the url is {len(raw_url):,} bytes long; at most {wire.MAX_URL_BYTES:,}",
            )
        elif raw_url is not None:
            url = _text(raw_url)
            if url is None or not url.strip():
                rejected = (ErrorCode.INVALID_JOB, "the url field is empty or not UTF-8")
                url = None

    return Job(
        entry_id=entry_id,
        job_id=job_id,
        reply_to=reply_to,
        meta=meta,
        image=image,
        path=path,
        url=url,
        deadline_ms=deadline_ms,
        rejected=rejected,
        has_own_id=has_own_id,
    )


def _deadline(raw: bytes) -> int | None:
    match = _DEADLINE.fullmatch(raw)
    if match is None:
        return None
    value = int(match.group(1))
    # Milliseconds since 1970 have 13 digits until 2286; seconds (10 digits) are a mistake
    # that would pass every job's deadline at once.
    return value if 10**12 <= value < 10**14 else None


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
