"""`url` jobs: images fetched over HTTP from a real server on loopback and from an
S3-compatible server (moto in server mode), through a real worker and redis-server.

Loopback is refused by default, so the HTTP tests allow it explicitly (GPUFEED_URL_ALLOW),
and one test shows it refused without that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog

from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.http_images import ImageServer
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.fetch.policy import AddressPolicy, loggable_url, parse_host_list
from worker.jobs import parse_job

pytest.importorskip("aiohttp")

# Short limits: every hostile case ends in about a second.
FAST_FETCH: dict[str, Any] = {
    "fetch_connect_timeout_s": 0.5,
    "fetch_read_timeout_s": 0.5,
    "fetch_timeout_s": 5.0,
    "fetch_retries": 1,
    "max_image_bytes": 256 * 1024,
}


@pytest.fixture
def image_server() -> Iterator[ImageServer]:
    server = ImageServer().start()
    for i, name in enumerate(("a", "b", "c", "d", "e", "slow")):
        server.images[name] = jpeg_bytes(96, 72, seed=i, quality=80)
    yield server
    server.stop()


def results_by_id(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> dict[str, JobResult]:
    return {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}


def assert_exactly_once(client: redis.Redis, entries: list[Any], ids: set[str]) -> None:
    counts = Counter(JobResult.from_fields(f).id for _, f in entries)
    assert set(counts) == ids and set(counts.values()) == {1}
    assert client.xinfo_groups("gpufeed:jobs")[0]["pending"] == 0


# ---------------------------------------------------------------------- the policy
@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.10", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "reserved"),
        ("::ffff:127.0.0.1", "loopback"),
        ("64:ff9b::a9fe:a9fe", "link-local"),
    ],
)
def test_non_public_addresses_are_refused_by_default(address: str, kind: str) -> None:
    policy = AddressPolicy.from_settings("", "")
    reason = policy.refuse_address("images.example", ipaddress.ip_address(address))
    assert reason is not None and kind in reason and "GPUFEED_URL_ALLOW" in reason
    assert policy.refuse_address("images.example", ipaddress.ip_address("93.184.216.34")) is None


def test_allow_names_hosts_and_networks_and_deny_wins() -> None:
    policy = AddressPolicy.from_settings(
        "minio.internal, 10.0.0.0/8, *.lan", "10.9.0.0/16, bad.example"
    )
    ip = ipaddress.ip_address
    assert policy.refuse_address("minio.internal", ip("172.16.0.5")) is None
    assert policy.refuse_address("x", ip("10.1.0.1")) is None
    assert policy.refuse_address("cam.lan", ip("192.168.1.9")) is None
    assert "GPUFEED_URL_DENY" in (policy.refuse_address("x", ip("10.9.1.1")) or "")
    assert policy.refuse_address("other.internal", ip("172.16.0.5")) is not None
    assert "GPUFEED_URL_DENY" in (policy.refuse_host("BAD.example.") or "")


def test_a_bad_allow_list_stops_the_worker_with_the_variable_named() -> None:
    with pytest.raises(ConfigError, match="GPUFEED_URL_ALLOW: 'not a host!'"):
        WorkerConfig.load(env={"GPUFEED_URL_ALLOW": "10.0.0.0/8, not a host!"})
    with pytest.raises(ValueError, match="neither a host name"):
        parse_host_list("ok.example, /bad")


def test_logged_urls_carry_no_query_and_no_password() -> None:
    url = "https://user:pw@bucket.s3.amazonaws.com:443/a/b.jpg?X-Amz-Signature=SECRET#frag"
    shown = loggable_url(url)
    assert shown == "https://bucket.s3.amazonaws.com:443/a/b.jpg?..."
    assert "SECRET" not in shown and "pw" not in shown


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({b"url": b"https://x.example/a.jpg"}, None),
        ({b"url": b"https://x.example/a.jpg", b"image": b"\xff\xd8"}, "invalid_job"),
        ({b"url": b"s3://b/k", b"path": b"a.jpg"}, "invalid_job"),
        ({b"url": b""}, "invalid_job"),
        ({b"url": b"\xff\xfe"}, "invalid_job"),
    ],
)
def test_a_job_names_exactly_one_source(fields: dict[bytes, bytes], code: str | None) -> None:
    job = parse_job("1-0", fields, "gpufeed:results")
    assert (job.rejected[0].value if job.rejected else None) == code
    if code is None:
        assert job.url == "https://x.example/a.jpg"


# ---------------------------------------------------------------------- through a worker
@pytest.mark.slow
async def test_hostile_urls_get_their_codes_and_the_worker_goes_on(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, image_server: ImageServer
) -> None:
    # Only the name `localhost` is allowed: the same server by its address is not.
    local = image_server.url("", host="localhost")
    by_address = image_server.url("/img/a")
    jobs = {
        "ok-a": {"url": f"{local}/img/a"},
        "ok-b": {"url": f"{local}/img/b?X-Amz-Signature=SECRET123"},
        "missing": {"url": f"{local}/status/404?sig=SECRET123"},
        "flaky": {"url": f"{local}/flaky/c"},
        "hangs": {"url": f"{local}/hang"},
        "endless": {"url": f"{local}/endless"},
        "to-metadata": {"url": f"{local}/redirect?to=http://169.254.169.254/latest/meta-data/"},
        "to-loopback": {"url": f"{local}/redirect?to={by_address}"},
        "unresolvable": {"url": "http://gpufeed-no-such-host.invalid/a.jpg"},
        "two-sources": {"url": f"{local}/img/a", "image": image_server.images["a"]},
        "local-file": {"url": "file:///etc/passwd"},
        "ftp": {"url": "ftp://example.com/a.jpg"},
    }
    expected = {
        "ok-a": None,
        "ok-b": None,
        "missing": "fetch_failed",
        "flaky": None,
        "hangs": "fetch_timeout",
        "endless": "payload_too_large",
        "to-metadata": "forbidden_url",
        "to-loopback": "forbidden_url",
        "unresolvable": "fetch_failed",
        "two-sources": "invalid_job",
        "local-file": "forbidden_url",
        "ftp": "forbidden_url",
    }
    async with running_worker(
        redis_url, tiny_weights, url_allow="localhost", **FAST_FETCH
    ) as worker:
        with structlog.testing.capture_logs() as logs:
            for job_id, fields in jobs.items():
                redis_client.xadd("gpufeed:jobs", {"id": job_id, **fields})
            entries = await wait_results(redis_client, "gpufeed:results", len(jobs))
        # The worker is alive and serving after all of it.
        redis_client.xadd("gpufeed:jobs", {"id": "after", "url": f"{local}/img/d"})
        entries = await wait_results(redis_client, "gpufeed:results", len(jobs) + 1)
        metrics = worker.observer.metrics.render().decode()

    results = results_by_id(entries)
    assert_exactly_once(redis_client, entries, {*jobs, "after"})
    assert {k: results[k].error_code for k in jobs} == expected
    assert results["after"].ok
    assert image_server.hits["/flaky/c"] == 2  # the 500 was retried, once
    assert image_server.hits["/status/404"] == 1  # a 404 is not
    assert image_server.hits["/img/a"] == 1  # ok-a only: not the refused redirect, nor two-sources
    assert "404" in (results["missing"].error or "")
    assert "redirected to" in (results["to-metadata"].error or "")
    assert "169.254.169.254" in (results["to-metadata"].error or "")
    assert "does not resolve" in (results["unresolvable"].error or "")
    # A signature in the query reaches neither the results nor the log.
    assert all("SECRET123" not in (r.error or "") for r in results.values())
    assert "SECRET123" not in repr(logs)
    # Fetch stage time, and the fetches counted by host class and status.
    assert results["ok-a"].details["timings_ms"]["fetch"] > 0
    assert 'gpufeed_fetch_total{host_class="allowed",source="http",status="ok"}' in metrics
    assert 'gpufeed_fetch_total{host_class="refused",source="http",status="forbidden"}' in metrics
    assert 'status="timeout"' in metrics and 'status="too_large"' in metrics


async def test_loopback_is_refused_unless_allowed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, image_server: ImageServer
) -> None:
    async with running_worker(redis_url, tiny_weights, **FAST_FETCH):
        redis_client.xadd("gpufeed:jobs", {"id": "by-ip", "url": image_server.url("/img/a")})
        redis_client.xadd(
            "gpufeed:jobs", {"id": "by-name", "url": image_server.url("/img/a", host="localhost")}
        )
        entries = await wait_results(redis_client, "gpufeed:results", 2)
    results = results_by_id(entries)
    assert {r.error_code for r in results.values()} == {"forbidden_url"}
    assert "loopback" in (results["by-name"].error or "")
    assert image_server.hits["/img/a"] == 0  # refused before any request was sent


async def test_a_slow_url_does_not_hold_back_its_batch_mates_and_repeats_are_cached(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, image_server: ImageServer
) -> None:
    image_server.hold("slow")
    async with running_worker(
        redis_url, tiny_weights, url_allow="127.0.0.1", batch_size=4, max_wait_ms=50, **FAST_FETCH
    ) as worker:
        redis_client.xadd("gpufeed:jobs", {"id": "slow", "url": image_server.url("/held/slow")})
        for name in ("a", "b", "c"):
            redis_client.xadd("gpufeed:jobs", {"id": name, "url": image_server.url(f"/img/{name}")})
        # The slow image is held by the server until the fast ones are answered: were they
        # waiting for it, this would never return.
        fast = await wait_results(redis_client, "gpufeed:results", 3, timeout_s=20)
        assert {JobResult.from_fields(f).id for _, f in fast} == {"a", "b", "c"}
        image_server.release("slow")
        entries = await wait_results(redis_client, "gpufeed:results", 4)

        # The same URL again: the server answers 304, and neither download nor decode repeat.
        redis_client.xadd("gpufeed:jobs", {"id": "a-again", "url": image_server.url("/img/a")})
        entries = await wait_results(redis_client, "gpufeed:results", 5)
        hits = worker.counters.cache_hits
        metrics = worker.observer.metrics.render().decode()

    results = results_by_id(entries)
    assert_exactly_once(redis_client, entries, {"slow", "a", "b", "c", "a-again"})
    assert all(r.ok for r in results.values())
    assert results["a"].details["cached"] is False
    assert results["a-again"].details["cached"] is True
    assert results["a-again"].top1 == results["a"].top1
    assert results["a-again"].details["scores"] == results["a"].details["scores"]
    assert image_server.conditional == 1 and image_server.hits["/img/a"] == 2
    assert hits >= 1
    assert 'status="not_modified"' in metrics


# ---------------------------------------------------------------------- s3:// (moto)
@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("obstore")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def put_objects(endpoint: str, bucket: str, objects: dict[str, bytes]) -> None:
    import urllib.request

    import obstore
    from obstore.store import S3Store

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")).close()
    store = S3Store(bucket)
    for key, data in objects.items():
        obstore.put(store, key, data)


async def test_s3_keys_are_fetched_with_credentials_from_the_environment(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, s3_endpoint: str
) -> None:
    image = jpeg_bytes(96, 72, seed=7, quality=80)
    await asyncio.to_thread(put_objects, s3_endpoint, "images", {"cats/1.jpg": image})
    async with running_worker(redis_url, tiny_weights, object_allow="images", **FAST_FETCH):
        redis_client.xadd("gpufeed:jobs", {"id": "s3-ok", "url": "s3://images/cats/1.jpg"})
        redis_client.xadd("gpufeed:jobs", {"id": "s3-missing", "url": "s3://images/cats/2.jpg"})
        redis_client.xadd("gpufeed:jobs", {"id": "s3-bad", "url": "s3://Not_A_Bucket!/x"})
        await wait_results(redis_client, "gpufeed:results", 3)
        redis_client.xadd("gpufeed:jobs", {"id": "s3-again", "url": "s3://images/cats/1.jpg"})
        entries = await wait_results(redis_client, "gpufeed:results", 4)

    results = results_by_id(entries)
    assert_exactly_once(redis_client, entries, {"s3-ok", "s3-missing", "s3-bad", "s3-again"})
    assert results["s3-ok"].ok and results["s3-ok"].details["cached"] is False
    assert results["s3-again"].ok and results["s3-again"].details["cached"] is True
    assert results["s3-missing"].error_code == "fetch_failed"
    assert "not found, or not readable" in (results["s3-missing"].error or "")
    assert results["s3-bad"].error_code == "invalid_job"


# ---------------------------------------------------------------------- the producer
def test_producer_cli_submits_urls_from_a_file_and_from_stdin(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    listing = tmp_path / "urls.txt"
    listing.write_text(
        "# images\nhttps://cdn.example/a.jpg?sig=1\n\ns3://bucket/b.jpg\nhttps://cdn.example/a.jpg?sig=2\n"
    )
    done = run_module("producer", "submit", "--urls", str(listing), "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    fields = [f for _, f in redis_client.xrange("gpufeed:jobs")]
    assert [f[b"url"] for f in fields] == [
        b"https://cdn.example/a.jpg?sig=1",
        b"s3://bucket/b.jpg",
        b"https://cdn.example/a.jpg?sig=2",
    ]
    # Ids leave the query out (a signature must not become a result key), and stay unique.
    assert [f[b"id"] for f in fields] == [
        b"https://cdn.example/a.jpg",
        b"s3://bucket/b.jpg",
        b"https://cdn.example/a.jpg#2",
    ]
    assert all(b"image" not in f for f in fields)

    import subprocess
    import sys

    from tests.support.cli_runner import ROOT, clean_env

    piped = subprocess.run(
        [sys.executable, "-m", "producer", "submit", "--urls", "-", "--redis-url", redis_url],
        input="https://cdn.example/c.jpg\n",
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert piped.returncode == 0, piped.stderr
    assert redis_client.xlen("gpufeed:jobs") == 4

    both = run_module(
        "producer", "submit", "a.jpg", "--urls", str(listing), "--redis-url", redis_url
    )
    assert both.returncode == 2 and "not both" in both.stderr


def test_producer_submit_url_and_job_url(redis_url: str, redis_client: redis.Redis) -> None:
    from producer import Job, Producer

    with Producer(redis_url) as p:
        assert p.submit_url("https://cdn.example/x.jpg", id="x") == "x"
        p.submit_many([Job(url="s3://bucket/y.jpg", id="y")])
        with pytest.raises(ValueError, match="exactly one of image"):
            p.submit_many([Job(url="s3://bucket/z.jpg", image=b"\xff")])
        with pytest.raises(ValueError, match="needs a scheme"):
            p.submit_url("cdn.example/x.jpg")
    fields = [f for _, f in redis_client.xrange("gpufeed:jobs")]
    assert fields == [
        {b"url": b"https://cdn.example/x.jpg", b"id": b"x"},
        {b"url": b"s3://bucket/y.jpg", b"id": b"y"},
    ]


# ---------------------------------------------------------------------- the stage alone
class FakeFetcher:
    """Answers from a script; `gate` (per URL) holds a fetch until the test opens it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.active: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.gates: dict[str, asyncio.Event] = {}
        self.answers: dict[str, list[Any]] = {}

    async def fetch(self, url: str, max_bytes: int, known: Any) -> Any:
        from worker.fetch.result import Fetched, Validator

        host = url.split("/")[2]
        self.calls.append((url, known))
        self.active[host] += 1
        self.most[host] = max(self.most[host], self.active[host])
        try:
            if url in self.gates:
                await self.gates[url].wait()
            script = self.answers.get(url)
            if script:
                return script.pop(0)
            return Fetched(b"bytes of " + url.encode(), Validator('"v1"'), "public")
        finally:
            self.active[host] -= 1

    async def close(self) -> None:
        return None


def stage_with(fake: FakeFetcher, cache: Any = None, **settings: Any) -> tuple[Any, list[Any]]:
    from worker.fetch.stage import FetchSettings, FetchStage

    ready: list[Any] = []

    async def on_ready(jobs: list[Any]) -> None:
        ready.extend(jobs)

    async def on_fail(outcomes: list[Any]) -> None:
        ready.extend(outcomes)

    stage = FetchStage(
        FetchSettings(**settings), ready=on_ready, fail=on_fail, cache=cache, http=fake, store=fake
    )
    return stage, ready


def url_job(n: int, url: str) -> Any:
    return parse_job(f"{n}-0", {b"url": url.encode()}, "gpufeed:results")


async def test_the_per_host_limit_holds_one_host_back_not_the_others() -> None:
    fake = FakeFetcher()
    first = "http://busy.example/1.jpg"
    fake.gates[first] = asyncio.Event()
    stage, ready = stage_with(fake, concurrency=8, per_host=1)
    stage.submit(url_job(1, first))
    stage.submit(url_job(2, "http://busy.example/2.jpg"))
    stage.submit(url_job(3, "http://other.example/3.jpg"))
    for _ in range(100):
        if ready:
            break
        await asyncio.sleep(0.01)
    # The other host's image arrived while the busy host's first fetch was held.
    assert [j.url for j in ready] == ["http://other.example/3.jpg"]
    fake.gates[first].set()
    assert await stage.drain(5)
    assert len(ready) == 3 and fake.most["busy.example"] == 1
    assert all(j.image is not None and j.timings_ms["fetch"] >= 0 for j in ready)


async def test_a_304_uses_the_cached_row_and_a_304_without_one_fetches_whole() -> None:
    import numpy as np

    from worker.decode.cache import DecodeCache
    from worker.decode.cpu import DecodeInfo
    from worker.fetch.result import Fetched, Validator

    cache = DecodeCache(1 << 20)
    fake = FakeFetcher()
    url = "https://cdn.example/a.jpg"
    v1 = Validator('"v1"')
    stage, ready = stage_with(fake, cache=cache)

    stage.submit(url_job(1, url))
    assert await stage.drain(5)
    assert ready[0].image is not None and ready[0].cache_key == v1.cache_key(url, "gpufeed:results")
    assert fake.calls == [(url, None)]

    # Known, not modified, but never decoded (not in the cache): fetched whole again.
    fake.answers[url] = [Fetched(None, v1, "public")]
    stage.submit(url_job(2, url))
    assert await stage.drain(5)
    assert fake.calls[1:] == [(url, v1), (url, None)]
    assert ready[1].image is not None and ready[1].cached_row is None

    # Decoded meanwhile: a 304 gives the job its row, and nothing more is fetched.
    row = np.full((4, 4, 3), 7, dtype=np.uint8)
    cache.put(v1.cache_key(url, "gpufeed:results"), row, DecodeInfo("JPEG", 4, 4, 1))
    fake.answers[url] = [Fetched(None, v1, "public")]
    stage.submit(url_job(3, url))
    assert await stage.drain(5)
    assert fake.calls[3:] == [(url, v1)]
    assert ready[2].image is None and ready[2].cached_row is not None
    assert (ready[2].cached_row[0] == 7).all()
