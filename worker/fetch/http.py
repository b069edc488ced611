"""http:// and https:// URLs (presigned S3, GCS and Azure URLs included), with aiohttp.

One ClientSession per worker: its connector pools connections (at most the stage's
concurrency in use, GPUFEED_FETCH_PER_HOST to one host, and as many idle ones kept open for
reuse, all hosts together), and every new connection's address
goes through `GuardedResolver`, so the address policy (worker/fetch/policy.py) is checked on
the address actually connected to, after DNS, with no window for a second lookup to answer
differently. aiohttp skips the resolver for IP literals, so each hop's host is also checked
here before its request; redirects are followed here, hop by hop, for the same reason.

The body is read in chunks and abandoned as soon as it passes GPUFEED_MAX_IMAGE_BYTES (a
Content-Length above it is refused before reading). Timeouts and 5xx answers are retried
with exponential backoff and jitter; 4xx answers, refused addresses and names that do not
resolve are not.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from producer.wire import ErrorCode
from worker.base.errors import GpufeedError
from worker.fetch.policy import AddressPolicy, loggable_url
from worker.fetch.result import Fetched, FetchError, Validator, too_large

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 256 * 1024
USER_AGENT = "gpufeed"


class ForbiddenAddress(GpufeedError):
    """Raised by the resolver: not an OSError, so aiohttp does not take it for a DNS failure
    and try the next address."""


class GuardedResolver(AbstractResolver):
    """The system resolver, then the address policy on every address it returned: one
    forbidden address refuses the host (a name that answers with a public and a private
    address is a rebinding attempt, not a choice)."""

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy
        self._inner = ThreadedResolver()
        # Host name -> "public" or "allowed" (for the metrics), of the hosts resolved lately.
        self.classes: dict[str, str] = {}

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kinds = set()
        for result in results:
            ip = ipaddress.ip_address(result["host"])
            reason = self.policy.refuse_address(host, ip)
            if reason is not None:
                raise ForbiddenAddress(reason)
            kinds.add(self.policy.host_class(ip))
        if len(self.classes) >= 4096:
            self.classes.clear()
        self.classes[host.lower()] = "allowed" if "allowed" in kinds else "public"
        return results

    async def close(self) -> None:
        await self._inner.close()


class BoundedPoolConnector(aiohttp.TCPConnector):
    """aiohttp's connector with a bound on idle keep-alive connections, all hosts together.

    aiohttp's `limit` counts connections in use only: an idle one stays open for
    `keepalive_timeout` per host, so jobs naming many host names (one wildcard DNS record
    gives unlimited names) would pile up one open socket per name until file descriptors ran
    out. Here, a connection handed back beyond `max_idle` idle ones closes the oldest idle
    connection instead. aiohttp has no public hook for this; `_release` and `_conns` are
    its pool (tests/fetch/test_fetch_limits.py checks the bound against a real server)."""

    def __init__(self, *, max_idle: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_idle = max_idle

    def _release(self, key: Any, protocol: Any, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        self._trim_idle()

    def idle_count(self) -> int:
        return sum(len(conns) for conns in self._conns.values())

    def _trim_idle(self) -> None:
        pool = self._conns
        idle = self.idle_count()
        while idle > self.max_idle:
            # The oldest idle connection of all: each host's deque is oldest first.
            key = min((k for k in pool if pool[k]), key=lambda k: pool[k][0][1])
            proto, _ = pool[key].popleft()
            if not pool[key]:
                del pool[key]
            proto.close()
            idle -= 1


class HttpFetcher:
    def __init__(
        self,
        policy: AddressPolicy,
        *,
        concurrency: int,
        per_host: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        retries: int,
        max_redirects: int,
        backoff_s: float = 0.1,
    ) -> None:
        self.policy = policy
        self.concurrency = concurrency
        self.per_host = per_host
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.max_redirects = max_redirects
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._resolver = GuardedResolver(policy)

    def _get_session(self) -> aiohttp.ClientSession:
        # Created on first use: a ClientSession belongs to the running event loop.
        if self._session is None:
            connector = BoundedPoolConnector(
                resolver=self._resolver,
                limit=self.concurrency,
                limit_per_host=self.per_host,
                # Idle connections kept for reuse: as many as may be in use at once.
                max_idle=self.concurrency,
                keepalive_timeout=15.0,
                ttl_dns_cache=10,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.connect_timeout_s,
                    sock_read=self.read_timeout_s,
                ),
                # Proxies from the environment would move the address check onto the proxy;
                # cookies would carry one job's session into another's request.
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                # Images are compressed already; asking for identity also keeps a small
                # gzip body from inflating past the size limit before a chunk is counted.
                headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, max_bytes: int, known: Validator | None) -> Fetched:
        """The bytes at `url`, or `data=None` when `known` still holds (304 Not Modified)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                fetched = await self._get(url, max_bytes, known)
            except FetchError as exc:
                if not exc.retryable or attempt > self.retries:
                    if attempt > 1:
                        exc.message += f" ({attempt} attempts)"
                    raise
                # Full jitter: many jobs failing at once on one host do not retry in step.
                delay = self.backoff_s * (2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                continue
            return Fetched(fetched.data, fetched.validator, fetched.host_class, attempt)

    async def _get(self, url: str, max_bytes: int, known: Validator | None) -> Fetched:
        session = self._get_session()
        headers = {}
        if known is not None and known.etag:
            headers["If-None-Match"] = known.etag
        if known is not None and known.last_modified:
            headers["If-Modified-Since"] = known.last_modified
        target = _parse(url)
        for hop in range(self.max_redirects + 1):
            where = loggable_url(str(target))
            # A refusal after a redirect says so: the job's own URL looked harmless.
            via = f"redirected to {where}: " if hop else ""
            self._check_hop(target, via)
            try:
                async with session.get(target, headers=headers, allow_redirects=False) as resp:
                    host_class = self._host_class(target)
                    if resp.status in _REDIRECTS:
                        target = _redirect_target(resp, where, host_class)
                        continue
                    if resp.status == 304 and known is not None:
                        return Fetched(None, known, host_class)
                    if resp.status != 200:
                        raise _status_error(resp.status, where, host_class)
                    data = await _read_limited(resp, max_bytes, where, host_class)
                    validator = Validator(
                        resp.headers.get("ETag"), resp.headers.get("Last-Modified")
                    )
                    return Fetched(data, validator, host_class)
            except FetchError:
                raise
            except ForbiddenAddress as exc:
                raise _forbidden(via + str(exc)) from None
            except aiohttp.ClientConnectorDNSError as exc:
                raise FetchError(
                    ErrorCode.FETCH_FAILED,
                    f"the host of {where} does not resolve: {exc.os_error.strerror or exc}",
                    status="unresolved",
                ) from None
            except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
                raise FetchError(
                    ErrorCode.FETCH_FAILED,
                    f"TLS failed for {where}: {type(exc).__name__}",
                    status="network",
                ) from None
            except TimeoutError:
                raise FetchError(
                    ErrorCode.FETCH_TIMEOUT,
                    f"{where} did not answer within the connect timeout "
                    f"({self.connect_timeout_s:g} s) / read timeout ({self.read_timeout_s:g} s)",
                    status="timeout",
                    retryable=True,
                ) from None
            except aiohttp.ClientConnectorError as exc:
                raise FetchError(
                    ErrorCode.FETCH_FAILED,
                    f"cannot connect to {where}: {exc.os_error.strerror or type(exc).__name__}",
                    status="network",
                    retryable=True,
                ) from None
            except (aiohttp.InvalidURL, ValueError) as exc:
                raise FetchError(
                    ErrorCode.INVALID_JOB,
                    f"not a valid URL: {where} ({type(exc).__name__})",
                    status="invalid",
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                # Dropped connections, truncated bodies: worth another try.
                raise FetchError(
                    ErrorCode.FETCH_FAILED,
                    f"{where}: {type(exc).__name__}",
                    status="network",
                    retryable=True,
                ) from None
        raise FetchError(
            ErrorCode.FETCH_FAILED,
            f"{loggable_url(url)} redirected more than {self.max_redirects} times (the "
            "redirect limit)",
            status="4xx",
        )

    def _check_hop(self, target: URL, via: str) -> None:
        """Scheme and host of one hop; an IP literal's address (the resolver never sees it)."""
        if target.scheme not in ("http", "https"):
            raise _forbidden(f"{via}{target.scheme}:// is not fetched; only http and https")
        host = target.raw_host
        if not host:
            raise FetchError(ErrorCode.INVALID_JOB, "the URL has no host", status="invalid")
        reason = self.policy.refuse_host(host)
        if reason is None:
            try:
                ip = ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                ip = None
            if ip is not None:
                reason = self.policy.refuse_address(host, ip)
        if reason is not None:
            raise _forbidden(via + reason)

    def _host_class(self, target: URL) -> str:
        """`public` or `allowed` (a non-public address let through GPUFEED_URL_ALLOW)."""
        host = (target.raw_host or "").strip("[]")
        try:
            return self.policy.host_class(ipaddress.ip_address(host))
        except ValueError:
            return self._resolver.classes.get(host.lower(), "public")


def _parse(url: str) -> URL:
    try:
        # encoded=True: a presigned URL's signature covers its exact query string, which
        # must not be re-quoted.
        return URL(url, encoded=True)
    except (ValueError, TypeError):
        raise FetchError(ErrorCode.INVALID_JOB, "not a valid URL", status="invalid") from None


def _forbidden(reason: str) -> FetchError:
    return FetchError(ErrorCode.FORBIDDEN_URL, reason, status="forbidden", host_class="refused")


def _redirect_target(resp: aiohttp.ClientResponse, where: str, host_class: str) -> URL:
    location = resp.headers.get("Location")
    if not location:
        raise FetchError(
            ErrorCode.FETCH_FAILED,
            f"HTTP {resp.status} from {where} without a Location",
            status="4xx",
            host_class=host_class,
        )
    try:
        return resp.url.join(URL(location, encoded=True))
    except (ValueError, TypeError):
        raise FetchError(
            ErrorCode.FETCH_FAILED,
            f"{where} redirected to an invalid URL",
            status="4xx",
            host_class=host_class,
        ) from None


def _status_error(status: int, where: str, host_class: str) -> FetchError:
    server = status >= 500
    return FetchError(
        ErrorCode.FETCH_FAILED,
        f"HTTP {status} from {where}",
        status="5xx" if server else "4xx",
        host_class=host_class,
        retryable=server,
    )


async def _read_limited(
    resp: aiohttp.ClientResponse, max_bytes: int, where: str, host_class: str
) -> bytes:
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise too_large(max_bytes, where, host_class)
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):
        buf += chunk
        if len(buf) > max_bytes:
            # Close, not release: the rest of the body is never read, and an endless one
            # would hold the connection open for good.
            resp.close()
            raise too_large(max_bytes, where, host_class)
    return bytes(buf)
