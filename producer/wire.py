"""The wire contract between upstream services and gpufeed workers.

Everything any client (in any language) relies on lives here: key names, job fields, result
fields and error codes. The worker imports these names too, so the two sides cannot drift.
This module must stay free of torch and of anything heavy: producers import it.
"""

from __future__ import annotations

import array
import base64
import enum
import json
import struct
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
# The longest `url` a job may carry (real URLs, presigned ones included, stay well under
# 2 KiB); longer is `invalid_job`, refused before the field is decoded or parsed.
MAX_URL_BYTES = 8192
# The longest `reply_to` stream name: a key name, quoted in errors and passed to every publish
# call; longer is `invalid_job`, answered on the default results stream.
MAX_REPLY_TO_BYTES = 1024
# Defaults of the worker's GPUFEED_MAX_META_BYTES and GPUFEED_MAX_RESULT_BYTES: `meta` is
# echoed in the result (stream entry and hash), so it is bounded like the result as a whole.
DEFAULT_MAX_META_BYTES = 64 * 1024
DEFAULT_MAX_RESULT_BYTES = 4 * 1024 * 1024
# The workers' default GPUFEED_MAX_IMAGE_BYTES: a larger image is `payload_too_large`.
# `producer batch` reads no file past the limit (the same variable sets both sides).
DEFAULT_MAX_IMAGE_BYTES = 50 * 1024 * 1024

# Job fields (stream entry field names).
JOB_IMAGE = b"image"
JOB_PATH = b"path"
JOB_URL = b"url"
JOB_DEADLINE_MS = b"deadline_ms"
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
# "1" on a result served by the worker's degraded step (under backlog; docs/priorities.md,
# "Degrade under backlog"); absent otherwise. `model` then names the degraded model or input size.
RES_DEGRADED = b"degraded"
# By output kind: classify with sigmoid (multi-label), embed, raw.
RES_LABELS = b"labels"  # JSON array of the class names at or above the threshold
RES_EMBEDDING = b"embedding"  # the vector, raw little-endian bytes of `dtype`
RES_DIM = b"dim"
RES_DTYPE = b"dtype"  # float16 or float32
RES_OUTPUT = b"output"  # raw: the whole output tensor, little-endian bytes of `dtype`
RES_SHAPE = b"shape"  # raw: JSON array of the output's dimensions (per image)

STATUS_OK = "ok"
STATUS_ERROR = "error"


class ErrorCode(str, enum.Enum):
    """Every code an `error` result can carry; producer/wire_help.py says when each is given."""

    INVALID_JOB = "invalid_job"  # not exactly one of image, path, url; wrong field types
    ID_TOO_LONG = "id_too_long"  # id over MAX_ID_BYTES
    EMPTY_IMAGE = "empty_image"  # image field present but empty
    PAYLOAD_TOO_LARGE = "payload_too_large"  # encoded bytes over the configured limit
    UNSUPPORTED_FORMAT = "unsupported_format"  # bytes are not an image format we decode
    IMAGE_TOO_LARGE = "image_too_large"  # header announces dimensions over the pixel limit
    DECODE_ERROR = "decode_error"  # truncated or corrupt image data
    DECODE_TIMEOUT = "decode_timeout"  # decoding ran past the per-image decode budget
    PATH_DISABLED = "path_disabled"  # a path job, but the worker has no path root
    FORBIDDEN_PATH = "forbidden_path"  # path resolves outside the allowed root
    PATH_NOT_FOUND = "path_not_found"  # path under the root, but no readable file there
    FORBIDDEN_URL = "forbidden_url"  # url to an address or host the worker may not fetch from
    FETCH_FAILED = "fetch_failed"  # url answered with an HTTP error, or the network failed
    FETCH_TIMEOUT = "fetch_timeout"  # url did not answer in time, after the retries
    # s3://, gs://, az:// key outside GPUFEED_OBJECT_ALLOW for the job's reply stream;
    # refused before any request, so it says nothing of whether the object exists
    OBJECT_NOT_ALLOWED = "object_not_allowed"
    INFERENCE_ERROR = "inference_error"  # the model failed on the batch holding this job
    DEAD_LETTER = "dead_letter"  # delivered too many times without a result
    ENTRY_DELETED = "entry_deleted"  # the job entry was deleted while still pending
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline_ms passed before it ran
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
    """A result as a client sees it, parsed from a result stream entry or result hash.

    What an `ok` result holds depends on the model's output kind: `top1`, `label`, `score`
    and `labels` for a classifier; `embedding`, `dim` and `dtype` for an embedder; `output`,
    `shape` and `dtype` for a raw output.
    """

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
    # Served by the worker's cheaper degraded step, while a backlog waited (`model` says
    # which); False for results without the field.
    degraded: bool = False
    # classify: the top-k class names; multi-label (sigmoid): the names at or above the
    # model's threshold, best first
    labels: list[str] | None = None
    # embed: the vector, as float32 values whatever the wire dtype (float16 widens exactly)
    embedding: array.array[float] | None = None
    dim: int | None = None
    dtype: str | None = None  # embed, raw: float16 or float32
    # raw: the model's whole output for the image, little-endian bytes of `dtype`
    output: bytes | None = None
    shape: tuple[int, ...] | None = None

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
        """Parse a result; ValueError (or TypeError) for one that breaks the contract."""
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
        dtype = _text(norm.get(RES_DTYPE)) or _str_or_none(details.get("dtype"))
        vector = norm.get(RES_EMBEDDING) or _bytes_or_none(details.get("embedding"))
        dim = norm.get(RES_DIM)
        shape = norm.get(RES_SHAPE)
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
            degraded=norm.get(RES_DEGRADED) == b"1",
            labels=_labels(norm.get(RES_LABELS), details.get("labels")),
            embedding=decode_vector(vector, dtype) if vector is not None else None,
            dim=int(dim) if dim not in (None, b"") else _int_or_none(details.get("dim")),
            dtype=dtype,
            output=norm.get(RES_OUTPUT) or _bytes_or_none(details.get("output")),
            shape=_shape(shape, details.get("shape")),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (meta as text where it is UTF-8, else hex; bytes in the
        result map and a raw output as base64)."""
        meta: str | None = None
        if self.meta is not None:
            try:
                meta = self.meta.decode("utf-8")
            except UnicodeDecodeError:
                meta = self.meta.hex()
        out: dict[str, Any] = {
            "id": self.id,
            "entry": self.entry,
            "status": self.status,
            "top1": self.top1,
            "label": self.label,
            "score": self.score,
            "error": self.error,
            "result": {
                k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                for k, v in self.details.items()
            },
            "meta": meta,
            "model": self.model,
            "weights": self.weights,
            "duplicate_of": self.duplicate_of,
        }
        if self.degraded:
            out["degraded"] = True
        if self.labels is not None:
            out["labels"] = self.labels
        if self.embedding is not None:
            out.update(embedding=list(self.embedding), dim=self.dim, dtype=self.dtype)
        if self.output is not None:
            out.update(
                output=base64.b64encode(self.output).decode(),
                shape=list(self.shape) if self.shape is not None else None,
                dtype=self.dtype,
            )
        return out


_VECTOR_FORMATS = {"float16": ("e", 2), "float32": ("f", 4)}


def decode_vector(data: bytes, dtype: str | None) -> array.array[float]:
    """Little-endian float16/float32 bytes -> float32 values (an array('f'); numpy users:
    `np.frombuffer(data, "<f2" or "<f4")` gives the same values without a copy)."""
    if dtype not in _VECTOR_FORMATS:
        raise ValueError(f"unknown vector dtype {dtype!r} (float16 or float32)")
    code, size = _VECTOR_FORMATS[dtype]
    if len(data) % size:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} values")
    return array.array("f", struct.unpack(f"<{len(data) // size}{code}", data))


def _labels(field_value: bytes | None, detail: Any) -> list[str] | None:
    if isinstance(detail, list) and all(isinstance(x, str) for x in detail):
        return list(detail)
    if field_value:
        parsed = json.loads(field_value)
        if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed):
            return list(parsed)
        raise ValueError("labels is not a JSON array of strings")
    return None


def _shape(field_value: bytes | None, detail: Any) -> tuple[int, ...] | None:
    value = json.loads(field_value) if field_value else detail
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    ):
        raise ValueError("shape is not a list of integers")
    return tuple(value)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _bytes_or_none(value: Any) -> bytes | None:
    return value if isinstance(value, bytes) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
