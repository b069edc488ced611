"""The wire contract between upstream services and gpufeed workers.

Everything any client (in any language) relies on lives here: key names, job fields, result
fields and error codes. The worker imports these names too, so the two sides cannot drift.
This module must stay free of torch and of anything heavy: producers import it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

# Default Redis keys. In Redis Cluster, pick names that share a hash tag (e.g.
# "{gpufeed}:jobs") so that the atomic publish-and-ack script touches one slot.
DEFAULT_STREAM = "gpufeed:jobs"
DEFAULT_GROUP = "gpufeed"
DEFAULT_RESULTS_STREAM = "gpufeed:results"
DEFAULT_RESULT_PREFIX = "gpufeed:result:"
DEFAULT_DEAD_STREAM = "gpufeed:dead"
DEFAULT_WORKER_PREFIX = "gpufeed:worker:"

MAX_ID_BYTES = 128

# Job fields (stream entry field names).
JOB_IMAGE = b"image"
JOB_PATH = b"path"
JOB_URL = b"url"
JOB_ID = b"id"
JOB_REPLY_TO = b"reply_to"
JOB_META = b"meta"

# Result fields (stream entry and hash field names).
RES_ID = b"id"
RES_ENTRY = b"entry"
RES_STATUS = b"status"
RES_TOP1 = b"top1"
RES_LABEL = b"label"
RES_SCORE = b"score"
RES_ERROR = b"error"
RES_RESULT = b"result"
RES_META = b"meta"
RES_MODEL = b"model"
RES_WEIGHTS = b"weights"
RES_DUPLICATE_OF = b"duplicate_of"

STATUS_OK = "ok"
STATUS_ERROR = "error"


class ErrorCode(str, enum.Enum):
    """Every code an `error` result can carry; the README documents each one."""

    INVALID_JOB = "invalid_job"  # not exactly one of image, path, url; wrong field types
    ID_TOO_LONG = "id_too_long"  # id over MAX_ID_BYTES
    EMPTY_IMAGE = "empty_image"  # image field present but empty
    PAYLOAD_TOO_LARGE = "payload_too_large"  # encoded bytes over the configured limit
    UNSUPPORTED_FORMAT = "unsupported_format"  # bytes are not an image format we decode
    IMAGE_TOO_LARGE = "image_too_large"  # header announces dimensions over the pixel limit
    DECODE_ERROR = "decode_error"  # truncated or corrupt image data
    PATH_DISABLED = "path_disabled"  # a path job, but the worker has no path root
    FORBIDDEN_PATH = "forbidden_path"  # path resolves outside the allowed root
    PATH_NOT_FOUND = "path_not_found"  # path under the root, but no readable file there
    FORBIDDEN_URL = "forbidden_url"  # url to an address or host the worker may not fetch from
    FETCH_FAILED = "fetch_failed"  # url answered with an HTTP error, or the network failed
    FETCH_TIMEOUT = "fetch_timeout"  # url did not answer in time, after the retries
    INFERENCE_ERROR = "inference_error"  # the model failed on the batch holding this job
    DEAD_LETTER = "dead_letter"  # delivered too many times without a result
    ENTRY_DELETED = "entry_deleted"  # the job entry was deleted while still pending
    INTERNAL_ERROR = "internal_error"  # a worker bug; the message says what happened


def result_key(job_id: str | bytes, prefix: str = DEFAULT_RESULT_PREFIX) -> str:
    """The hash that holds the result of `job_id`."""
    if isinstance(job_id, bytes):
        job_id = job_id.decode("utf-8", "backslashreplace")
    return f"{prefix}{job_id}"


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


@dataclass(frozen=True)
class JobResult:
    """A result as a client sees it, parsed from a result stream entry or result hash."""

    id: str
    entry: str
    status: str
    top1: int | None = None
    label: str | None = None
    score: float | None = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    meta: bytes | None = None
    # The model and weights that served it.
    model: str | None = None
    weights: str | None = None
    # Set on the answer to a job whose id already had a result (from another entry, the one
    # named here, served by the same model and weights): that result stands under the id,
    # and this answer is stored under this job's entry ID.
    duplicate_of: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def error_code(self) -> str | None:
        if self.error is None:
            return None
        return self.error.split(":", 1)[0]

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes | str]) -> JobResult:
        norm: dict[bytes, bytes] = {}
        for k, v in fields.items():
            kb = k.encode() if isinstance(k, str) else k
            vb = v.encode() if isinstance(v, str) else v
            norm[kb] = vb
        details: dict[str, Any] = {}
        raw = norm.get(RES_RESULT)
        if raw:
            unpacked = msgpack.unpackb(raw, raw=False)
            if isinstance(unpacked, dict):
                details = unpacked
        top1 = norm.get(RES_TOP1)
        score = norm.get(RES_SCORE)
        return cls(
            id=_text(norm.get(RES_ID)) or "",
            entry=_text(norm.get(RES_ENTRY)) or "",
            status=_text(norm.get(RES_STATUS)) or "",
            top1=int(top1) if top1 not in (None, b"") else None,
            label=_text(norm.get(RES_LABEL)) or None,
            score=float(score) if score not in (None, b"") else None,
            error=_text(norm.get(RES_ERROR)) or None,
            details=details,
            meta=norm.get(RES_META),
            model=_text(norm.get(RES_MODEL)),
            weights=_text(norm.get(RES_WEIGHTS)),
            duplicate_of=_text(norm.get(RES_DUPLICATE_OF)),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (meta as text where it is UTF-8, else hex)."""
        meta: str | None = None
        if self.meta is not None:
            try:
                meta = self.meta.decode("utf-8")
            except UnicodeDecodeError:
                meta = self.meta.hex()
        return {
            "id": self.id,
            "entry": self.entry,
            "status": self.status,
            "top1": self.top1,
            "label": self.label,
            "score": self.score,
            "error": self.error,
            "result": self.details,
            "meta": meta,
            "model": self.model,
            "weights": self.weights,
            "duplicate_of": self.duplicate_of,
        }
