"""What a fetcher returns or raises: the bytes and their validator, or a coded error."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from producer.wire import ErrorCode
from worker.base.errors import GpufeedError

# Labels of gpufeed_fetch_total{status}: a small, fixed set (never a host name or URL).
FETCH_STATUSES = (
    "ok", "not_modified", "4xx", "5xx", "timeout", "forbidden", "too_large", "network",
    "unresolved", "invalid", "busy",
)  # fmt: skip


@dataclass(frozen=True)
class Validator:
    """What the server said identifies this version of the object: its ETag and/or its
    Last-Modified date. The same URL with the same validator is the same image."""

    etag: str | None = None
    last_modified: str | None = None

    def __bool__(self) -> bool:
        return bool(self.etag or self.last_modified)

    def cache_key(self, url: str, namespace: str) -> bytes:
        """The decode-cache key of this URL at this version, for jobs answered on
        `namespace` (their reply stream, as for inline bytes). A hash: the cache never holds
        a URL, so a presigned URL's signature does not sit in memory as text."""
        text = f"url\0{namespace}\0{url}\0{self.etag or ''}\0{self.last_modified or ''}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Fetched:
    """The object's bytes (None when the server said it did not change since `validator`)."""

    data: bytes | None
    validator: Validator
    host_class: str  # "public", "allowed" (a non-public address let through) or "store"
    attempts: int = 1


class FetchError(GpufeedError):
    """A fetch that failed for good; `code` and `message` become the job's error result.

    `message` never holds the URL's query string (worker/fetch/policy.py `loggable_url`).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        status: str,
        host_class: str = "unknown",
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.host_class = host_class
        self.retryable = retryable


def too_large(limit: int, where: str, host_class: str) -> FetchError:
    """The same words whether the server announced a length over the limit (nothing read)
    or the body passed it while read: the job learns the limit, never the object's size."""
    return FetchError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"{where} is larger than GPUFEED_MAX_IMAGE_BYTES ({limit:,} bytes)",
        status="too_large",
        host_class=host_class,
    )
