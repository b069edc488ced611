"""The fetch stage: between the reader and the batcher, for jobs that name a `url`.

    reader -> _deliver -> fetch stage (a task per job, bounded) -> jobs queue -> batcher
                                     \\-> result writer (fetch errors)

A `url` job takes a row of a staging slot only once its bytes have arrived, so one slow
URL never holds a batch back: it is simply not in one yet. Each job's fetch is a task owned
here; at most GPUFEED_FETCH_CONCURRENCY run at once, at most GPUFEED_FETCH_PER_HOST on one
host, and each has FETCH_TIMEOUT_S (a tuning constant, worker/config/tuning.py) in all,
retries included.

A host that stalls fills its own allowance, not everyone's: a job being fetched holds its
in-flight place (its bytes are in memory), but a job waiting for a fetch slot gives its
place back until it has one, for up to FETCH_HOST_QUEUE jobs per host (and
WAITING_HOSTS times that in all; a job's URL is at most wire.MAX_URL_BYTES long), so a
queue behind a slow host never keeps the reader from other jobs. Past that queue a job
waits holding its place, which slows the reader to the host's pace (a large batch of one
host's URLs is served, not refused), unless the host has answered nothing for
FETCH_READ_TIMEOUT_S: then it is answered `fetch_failed` (host busy) at once, and
so are the jobs of that host that were holding places.

Object-store keys are checked against GPUFEED_OBJECT_ALLOW (worker/fetch/objects.py) for
the job's reply stream before anything else, so a refused key is never asked for.

Repeated URLs: the validator (ETag, Last-Modified) of each URL fetched is kept in a bounded
map. A URL seen before is asked for with If-None-Match / If-Modified-Since; a 304 answer
(no body) takes the decoded row from the decode cache, so neither the download nor the
decode is repeated, and the result says `cached`. A URL whose server gives no validator is
downloaded again (its bytes may still hit the decode cache, which is keyed by their hash).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import structlog

from producer.wire import ErrorCode
from worker.base.errors import GpufeedError
from worker.decode.cache import DecodeCache
from worker.fetch.objects import ObjectAllow, parse_object_allow, split_store_url
from worker.fetch.policy import AddressPolicy, loggable_url
from worker.fetch.result import Fetched, FetchError, Validator
from worker.jobs import Job, Outcome

if TYPE_CHECKING:
    # For annotations only: importing it at run time would tie this folder to a layer above it.
    from worker.observe.metrics import WorkerMetrics

log = structlog.get_logger("gpufeed.fetch")

HTTP_SCHEMES = ("http", "https")
STORE_SOURCES = ("s3", "gs", "az")
# How many URLs' validators are remembered (about 100 bytes each).
VALIDATORS_KEPT = 65_536
# Jobs waiting for a fetch slot without an in-flight place, all hosts together, in
# FETCH_HOST_QUEUE units: with the default, 16 x 64 jobs of at most 8 KiB of URL.
WAITING_HOSTS = 16


class Fetcher(Protocol):
    async def fetch(self, url: str, max_bytes: int, known: Validator | None) -> Fetched: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class FetchSettings:
    concurrency: int = 64
    per_host: int = 16
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0
    timeout_s: float = 60.0
    retries: int = 2
    max_redirects: int = 5
    max_bytes: int = 50 * 1024 * 1024
    url_allow: str = ""
    url_deny: str = ""
    host_queue: int = 64
    object_allow: str = ""

    @classmethod
    def from_config(cls, cfg: Any) -> FetchSettings:
        return cls(
            concurrency=cfg.fetch_concurrency,
            per_host=min(cfg.fetch_per_host, cfg.fetch_concurrency),
            connect_timeout_s=cfg.fetch_connect_timeout_s,
            read_timeout_s=cfg.fetch_read_timeout_s,
            timeout_s=cfg.fetch_timeout_s,
            retries=cfg.fetch_retries,
            max_redirects=cfg.fetch_max_redirects,
            max_bytes=cfg.max_image_bytes,
            url_allow=cfg.url_allow,
            url_deny=cfg.url_deny,
            host_queue=cfg.fetch_host_queue,
            object_allow=cfg.object_allow,
        )


class _Unavailable:
    """Stands in for a fetcher whose library is not installed: every URL of it fails."""

    def __init__(self, what: str) -> None:
        self.what = what

    async def fetch(self, url: str, max_bytes: int, known: Validator | None) -> Fetched:
        raise FetchError(ErrorCode.FETCH_FAILED, self.what, status="invalid")

    async def close(self) -> None:
        return None


class HostBusy(GpufeedError):
    """A job of a stalled host past its queue: answered at once, never queued."""


class _Host:
    __slots__ = ("answered_at", "lent", "sem", "users")

    def __init__(self, per_host: int) -> None:
        self.sem = asyncio.Semaphore(per_host)
        self.users = 0  # its jobs in the stage: fetching or waiting
        self.lent = 0  # its jobs waiting without an in-flight place
        # When one of its fetches last ended other than by a timeout; a new host starts
        # with the benefit of the doubt.
        self.answered_at = time.monotonic()


class HostLimits:
    """Each host's fetch slots and the jobs waiting for them. A host's entry exists only
    while it has jobs, so the table holds only the hosts being fetched from.

    A job that must wait for a slot waits without its in-flight place while its host has
    fewer than `queue` such jobs (and the stage fewer than WAITING_HOSTS x `queue`). Past
    that, it waits holding its place, which slows the reader down to the host's pace, as
    long as the host answers: once none of the host's fetches has ended for `stall_s`,
    such a job is refused (HostBusy), and so is every new one past the queue."""

    def __init__(self, per_host: int, queue: int, stall_s: float) -> None:
        self.per_host = per_host
        self.queue = queue
        self.stall_s = stall_s
        self.waiting = 0
        self._hosts: dict[str, _Host] = {}

    def users(self, host: str) -> int:
        entry = self._hosts.get(host)
        return entry.users if entry is not None else 0

    def answered(self, host: str) -> None:
        entry = self._hosts.get(host)
        if entry is not None:
            entry.answered_at = time.monotonic()

    def _stalled(self, entry: _Host) -> bool:
        return time.monotonic() - entry.answered_at > self.stall_s

    @asynccontextmanager
    async def hold(
        self, host: str, global_slots: asyncio.Semaphore, places: _Places
    ) -> AsyncIterator[None]:
        """A fetch slot of `host` and one of `global_slots` (see the class docstring)."""
        entry = self._hosts.get(host) or _Host(self.per_host)
        lend = False
        if entry.sem.locked() or global_slots.locked():
            if entry.lent < self.queue and self.waiting < self.queue * WAITING_HOSTS:
                lend = True
            elif self._stalled(entry):
                raise HostBusy
        entry.users += 1
        self._hosts[host] = entry
        if lend:
            entry.lent += 1
            self.waiting += 1
            places.give_back()
        try:
            await self._acquire(entry, global_slots, lend)
            try:
                if lend:
                    lend = False
                    entry.lent -= 1
                    self.waiting -= 1
                    places.take()
                yield
            finally:
                global_slots.release()
                entry.sem.release()
        finally:
            if lend:
                # Given up while waiting (the fetch timeout): its answer gives the place back.
                entry.lent -= 1
                self.waiting -= 1
                places.take()
            entry.users -= 1
            if entry.users == 0:
                del self._hosts[host]

    async def _acquire(self, entry: _Host, global_slots: asyncio.Semaphore, lent: bool) -> None:
        if lent or not (entry.sem.locked() or global_slots.locked()):
            # Free slots are taken before this returns (no task in between), so the next
            # job's check in `hold` sees them taken.
            await _both(entry.sem, global_slots)
            return
        while True:
            try:
                await asyncio.wait_for(_both(entry.sem, global_slots), self.stall_s)
                return
            except TimeoutError:
                # Holding a place while its host answers nothing: give the place up.
                if self._stalled(entry):
                    raise HostBusy from None


async def _both(first: asyncio.Semaphore, second: asyncio.Semaphore) -> None:
    await first.acquire()
    try:
        await second.acquire()
    except BaseException:
        first.release()
        raise


class _Places:
    """The reader's in-flight places, as the stage lends and takes them back."""

    def __init__(
        self, give_back: Callable[[int], None] | None, take: Callable[[int], None] | None
    ) -> None:
        self._give_back = give_back
        self._take = take

    def give_back(self) -> None:
        if self._give_back is not None:
            self._give_back(1)

    def take(self) -> None:
        if self._take is not None:
            self._take(1)


class FetchStage:
    def __init__(
        self,
        settings: FetchSettings,
        *,
        ready: Callable[[list[Job]], Awaitable[None]],
        fail: Callable[[list[Outcome]], Awaitable[None]],
        cache: DecodeCache | None = None,
        metrics: WorkerMetrics | None = None,
        http: Fetcher | None = None,
        store: Fetcher | None = None,
        give_back_place: Callable[[int], None] | None = None,
        take_place: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self._ready = ready
        self._fail = fail
        self.cache = cache if cache is not None and cache.enabled else None
        self.metrics = metrics
        self.policy = AddressPolicy.from_settings(settings.url_allow, settings.url_deny)
        self.http = http if http is not None else self._make_http()
        self.store = store if store is not None else self._make_store()
        self.objects: ObjectAllow = parse_object_allow(settings.object_allow)
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._hosts = HostLimits(settings.per_host, settings.host_queue, settings.read_timeout_s)
        self._places = _Places(give_back_place, take_place)
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        # URL (a hash of it) -> the validator its server gave; only with the decode cache on.
        self._validators: OrderedDict[bytes, Validator] = OrderedDict()

    def _make_http(self) -> Fetcher:
        s = self.settings
        try:
            # Each source's library (aiohttp, obstore) loads with its fetcher, where used.
            from worker.fetch.http import HttpFetcher  # noqa: PLC0415
        except ImportError:
            return _Unavailable("http(s) URLs need aiohttp: pip install 'gpufeed[worker]'")
        return HttpFetcher(
            self.policy,
            concurrency=s.concurrency,
            per_host=s.per_host,
            connect_timeout_s=s.connect_timeout_s,
            read_timeout_s=s.read_timeout_s,
            retries=s.retries,
            max_redirects=s.max_redirects,
        )

    def _make_store(self) -> Fetcher:
        s = self.settings
        try:
            from worker.fetch.s3 import StoreFetcher  # noqa: PLC0415
        except ImportError:
            return _Unavailable("s3://, gs:// and az:// URLs need obstore: pip install obstore")
        return StoreFetcher(
            connect_timeout_s=s.connect_timeout_s,
            read_timeout_s=s.read_timeout_s,
            total_timeout_s=s.timeout_s,
            retries=s.retries,
        )

    # ------------------------------------------------------------------ the stage
    @property
    def in_progress(self) -> int:
        return len(self._tasks)

    def submit(self, job: Job) -> None:
        """Start fetching `job.url`; the job goes on to `ready` or, failed, to `fail`."""
        task = asyncio.create_task(self._run(job), name=f"fetch-{job.entry_id}")
        # Keep a hard reference: the event loop holds tasks only weakly.
        self._tasks.add(task)
        self._idle.clear()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("fetch_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every fetch started has handed its job on; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Cancel what is still being fetched (those jobs stay pending in Redis for another
        worker) and close the clients."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.http.close()
        await self.store.close()

    async def _run(self, job: Job) -> None:
        outcome = await self.prepare(job)
        if outcome is not None:
            await self._fail([outcome])
            return
        await self._ready([job])

    async def prepare(self, job: Job) -> Outcome | None:
        """Fetch `job.url` and give the job its bytes (or, on a 304, its decoded row); the
        failure to answer it with, or None. Warm start fetches its images through it too,
        so their validators are remembered as any job's are."""
        assert job.url is not None
        url = job.url
        start = time.monotonic()
        source, host = _source_and_host(url)
        try:
            fetched, row = await asyncio.wait_for(
                self._fetch(source, host, url, job.reply_to), self.settings.timeout_s
            )
            outcome = self._take(job, url, fetched, row)
            status = "ok" if fetched.data is not None else "not_modified"
            self._count(source, fetched.host_class, status)
        except FetchError as exc:
            self._count(source, exc.host_class, exc.status)
            outcome = Outcome.failure(job, exc.code, exc.message)
        except TimeoutError:
            self._count(source, "unknown", "timeout")
            outcome = Outcome.failure(
                job,
                ErrorCode.FETCH_TIMEOUT,
                f"{loggable_url(url)} was not fetched within the fetch timeout "
                f"({self.settings.timeout_s:g} s, retries included)",
            )
        except Exception as exc:  # noqa: BLE001 - one job's fetch must never stop the stage
            log.error("fetch_error", job_id=job.job_id, url=loggable_url(url), error=repr(exc))
            outcome = Outcome.failure(job, ErrorCode.INTERNAL_ERROR, f"fetch: {exc!r}")
        job.timings_ms["fetch"] = (time.monotonic() - start) * 1000
        job.ready_s = time.monotonic()
        if outcome is not None:
            log.debug(
                "fetch_failed",
                job_id=job.job_id,
                url=loggable_url(url),
                error=outcome.error_text,
            )
        return outcome

    async def _fetch(
        self, source: str, host: str, url: str, namespace: str
    ) -> tuple[Fetched, tuple[Any, Any] | None]:
        """What was fetched, and on a 304 the decoded row from the decode cache."""
        if source == "http":
            fetcher = self.http
        elif source in STORE_SOURCES:
            fetcher = self.store
        else:
            scheme = url.split(":", 1)[0][:16] if ":" in url else "a URL without a scheme"
            raise FetchError(
                ErrorCode.FORBIDDEN_URL,
                f"{scheme}:// URLs are not fetched; use http, https, s3, gs or az",
                status="forbidden",
                host_class="refused",
            )
        if source in STORE_SOURCES:
            self._check_object(url, namespace)
        url_key = _url_key(url)
        max_bytes = self.settings.max_bytes
        known = self._validators.get(url_key) if self.cache is not None else None
        row = None
        try:
            async with self._hosts.hold(host, self._slots, self._places):
                fetched = await self._answered(host, fetcher.fetch(url, max_bytes, known))
                if fetched.data is None:
                    row = self._cached_row(url, fetched.validator, namespace)
                    if row is None:
                        # 304, but the decoded row has left the cache since: fetch it whole.
                        fetched = await self._answered(host, fetcher.fetch(url, max_bytes, None))
        except HostBusy:
            raise FetchError(
                ErrorCode.FETCH_FAILED,
                f"host busy: the host of {loggable_url(url)} has answered nothing for the read "
                f"timeout ({self.settings.read_timeout_s:g} s) and {self._hosts.users(host)} "
                "of its jobs are being fetched (GPUFEED_FETCH_PER_HOST at once) or wait; send "
                "it again later",
                status="busy",
            ) from None
        if self.cache is not None:
            if fetched.validator:
                self._validators[url_key] = fetched.validator
                self._validators.move_to_end(url_key)
                while len(self._validators) > VALIDATORS_KEPT:
                    self._validators.popitem(last=False)
            else:
                self._validators.pop(url_key, None)
        return fetched, row

    async def _answered(self, host: str, fetch: Awaitable[Fetched]) -> Fetched:
        """`fetch`, noting that the host answered unless it timed out."""
        try:
            fetched = await fetch
        except FetchError as exc:
            if exc.status != "timeout":
                self._hosts.answered(host)
            raise
        self._hosts.answered(host)
        return fetched

    def _check_object(self, url: str, reply_to: str) -> None:
        scheme, bucket, key = split_store_url(url)
        if not self.objects.allows(reply_to, scheme, bucket, key):
            raise FetchError(
                ErrorCode.OBJECT_NOT_ALLOWED,
                f"{scheme}://{bucket}/{key} is not in GPUFEED_OBJECT_ALLOW for jobs answered "
                f"on {reply_to}",
                status="forbidden",
                host_class="refused",
            )

    def _cached_row(self, url: str, validator: Validator, namespace: str) -> tuple[Any, Any] | None:
        if self.cache is None or not validator:
            return None
        return self.cache.get(validator.cache_key(url, namespace))

    def _take(
        self, job: Job, url: str, fetched: Fetched, row: tuple[Any, Any] | None
    ) -> Outcome | None:
        """Give the job what was fetched: its bytes, or on 304 its decoded row."""
        if fetched.data is None:
            job.cached_row = row
            return None
        if not fetched.data:
            return Outcome.failure(
                job, ErrorCode.EMPTY_IMAGE, f"{loggable_url(url)} answered with an empty body"
            )
        job.image = fetched.data
        if self.cache is not None and fetched.validator:
            job.cache_key = fetched.validator.cache_key(url, job.reply_to)
        return None

    def _count(self, source: str, host_class: str, status: str) -> None:
        if self.metrics is not None:
            self.metrics.fetches.labels(source, host_class, status).inc()


def _url_key(url: str) -> bytes:
    return hashlib.blake2b(url.encode(), digest_size=16).digest()


def _source_and_host(url: str) -> tuple[str, str]:
    """The metrics' source label and the per-host limit's key (never logged)."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    except ValueError:
        return "other", ""
    if scheme in HTTP_SCHEMES:
        return "http", f"{scheme}://{netloc}"
    if scheme in STORE_SOURCES:
        return scheme, f"{scheme}://{netloc}"
    return "other", ""
