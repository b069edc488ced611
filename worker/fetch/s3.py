"""s3://bucket/key, gs://bucket/key and az://container/key, with obstore.

obstore wraps the Rust `object_store` crate (Apache Arrow's): one client per bucket, with its
own connection pool, request signing, retries of 5xx answers, dropped connections and
timeouts (exponential backoff), and the standard credential chain of each store read from
the worker's environment, never from the job: for S3 the AWS_* variables (AWS_ENDPOINT_URL
for an S3-compatible server such as MinIO, AWS_ALLOW_HTTP=true for one without TLS), web
identity tokens, container and instance credentials; for GCS GOOGLE_APPLICATION_CREDENTIALS;
for Azure the AZURE_STORAGE_* variables. Where boto3 is installed and an AWS profile is in
use (AWS_PROFILE, or ~/.aws/credentials without AWS_ACCESS_KEY_ID), boto3's chain supplies
the S3 credentials, so profiles and SSO work as in the AWS CLI.

The endpoint of a store comes from the operator's environment, not from the job, so the
address policy of http(s) URLs does not apply here. Which buckets and keys a job may name is
GPUFEED_OBJECT_ALLOW's (worker/fetch/objects.py), checked by the stage before this runs.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import obstore
import structlog
from obstore.exceptions import (
    BaseError,
    NotModifiedError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from obstore.store import ObjectStore

from producer.object_stores import open_store
from producer.wire import ErrorCode
from worker.fetch.objects import SCHEMES, split_store_url
from worker.fetch.result import Fetched, FetchError, Validator, too_large

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

STORE_SCHEMES = SCHEMES
_CHUNK = 256 * 1024


class StoreFetcher:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        total_timeout_s: float,
        retries: int,
        max_stores: int = 64,
    ) -> None:
        self.client_options: ClientConfig = {
            "connect_timeout": timedelta(seconds=connect_timeout_s),
            "read_timeout": timedelta(seconds=read_timeout_s),
            "timeout": timedelta(seconds=total_timeout_s),
        }
        self.retry_config: RetryConfig = {
            "max_retries": retries,
            "retry_timeout": timedelta(seconds=total_timeout_s),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "base": 2},
        }
        self.max_stores = max_stores
        # Jobs choose buckets, so the clients kept are bounded (least recently used go).
        self._stores: OrderedDict[tuple[str, str], ObjectStore] = OrderedDict()

    def _store(self, scheme: str, bucket: str) -> ObjectStore:
        key = (scheme, bucket)
        store = self._stores.get(key)
        if store is not None:
            self._stores.move_to_end(key)
            return store
        store = open_store(scheme, bucket, self.client_options, self.retry_config)
        self._stores[key] = store
        while len(self._stores) > self.max_stores:
            self._stores.popitem(last=False)
        return store

    async def close(self) -> None:
        # The clients own no task of ours; their pools close when they are dropped.
        self._stores.clear()

    async def fetch(self, url: str, max_bytes: int, known: Validator | None) -> Fetched:
        scheme, bucket, key = split_store_url(url)
        where = f"{scheme}://{bucket}/{key}"
        options: dict[str, Any] = {}
        if known is not None and known.etag:
            options["if_none_match"] = known.etag
        elif known is not None and known.last_modified:
            options["if_modified_since"] = datetime.fromisoformat(known.last_modified)
        try:
            store = self._store(scheme, bucket)
            result = await obstore.get_async(store, key, options=options or None)  # type: ignore[arg-type]
            meta = result.meta
            if meta["size"] > max_bytes:
                raise too_large(max_bytes, where, "store")
            buf = bytearray()
            async for chunk in result.stream(min_chunk_size=_CHUNK):
                buf += chunk
                if len(buf) > max_bytes:
                    raise too_large(max_bytes, where, "store")
        except FetchError:
            raise
        except NotModifiedError:
            assert known is not None
            return Fetched(None, known, "store")
        except (FileNotFoundError, PermissionDeniedError, UnauthenticatedError):
            # One answer for both: which keys exist is not the job's to learn.
            raise FetchError(
                ErrorCode.FETCH_FAILED,
                f"{where}: not found, or not readable with the worker's credentials",
                status="4xx",
                host_class="store",
            ) from None
        except (BaseError, OSError, ValueError) as exc:
            text = str(exc)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            # The store's own text goes to the operator's log only: it can describe the
            # object (its size, its bucket's settings), which the job is not to learn.
            log.warning("store_error", url=where, error=_first_line(text))
            raise FetchError(
                ErrorCode.FETCH_TIMEOUT if timed_out else ErrorCode.FETCH_FAILED,
                f"{where}: the store did not answer in time"
                if timed_out
                else f"{where}: the store failed ({type(exc).__name__})",
                status="timeout" if timed_out else "network",
                host_class="store",
            ) from None
        etag = meta.get("e_tag")
        modified = meta.get("last_modified")
        validator = Validator(etag, modified.isoformat() if modified is not None else None)
        return Fetched(bytes(buf), validator, "store")


log = structlog.get_logger("gpufeed.fetch")


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]
