"""What one tenant's URLs may cost everyone else: a host that stalls holds only its own
fetch slots, not the worker's in-flight places; what waits for a host is bounded; idle
pooled connections are bounded whatever the number of host names; a URL's length is bounded;
and IPv6 forms that carry an IPv4 address are judged by it."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from producer import wire
from producer.wire import JobResult
from tests.fetch.test_fetch import FakeFetcher, url_job
from tests.support.http_images import ImageServer
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.fetch.policy import AddressPolicy, address_class, parse_host_list
from worker.fetch.stage import FetchSettings, FetchStage

pytest.importorskip("aiohttp")


@pytest.fixture
def server() -> Iterator[ImageServer]:
    srv = ImageServer(keep_alive=True).start()
    srv.images["a"] = jpeg_bytes(96, 72, seed=1, quality=80)
    yield srv
    srv.stop()


# ------------------------------------------------------------------ a host that stalls
@pytest.mark.slow
async def test_a_host_that_trickles_does_not_keep_other_jobs_waiting(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, server: ImageServer
) -> None:
    # 4 x (2 + 2) = 16 in-flight places, and 16 jobs to a host that sends a byte every half
    # second: before, they held every place until the fetch timeout, and nothing else was read.
    settings: dict[str, Any] = {
        "batch_size": 4,
        "ring_slots": 2,
        "fetch_per_host": 2,
        "fetch_read_timeout_s": 3.0,
        "fetch_timeout_s": 4.0,
        "fetch_retries": 0,
        "url_allow": "127.0.0.1",
    }
    slow = [f"slow-{i}" for i in range(16)]
    async with running_worker(redis_url, tiny_weights, **settings) as worker:
        assert worker.stages.in_flight.limit == len(slow)
        for job_id in slow:
            redis_client.xadd("gpufeed:jobs", {"id": job_id, "url": server.url("/trickle")})
        redis_client.xadd("gpufeed:jobs", {"id": "inline", "image": server.images["a"]})
        redis_client.xadd("gpufeed:jobs", {"id": "long-url", "url": "http://x.example/" * 70_000})
        entries = await wait_results(redis_client, "gpufeed:results", len(slow) + 2)
        left = worker.stages.in_flight.count

    order = [JobResult.from_fields(f).id for _, f in entries]
    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    # Answered before any of the slow ones, which all ran to their fetch timeout.
    assert set(order[:2]) == {"inline", "long-url"}
    assert results["inline"].ok
    assert results["long-url"].error_code == "invalid_job"
    assert f"at most {wire.MAX_URL_BYTES:,}" in (results["long-url"].error or "")
    assert {results[j].error_code for j in slow} == {"fetch_timeout"}
    assert sorted(order) == sorted([*slow, "inline", "long-url"])  # each exactly once
    assert left == 0  # every place lent while waiting came back


@pytest.mark.slow
async def test_a_large_batch_of_one_hosts_urls_is_served_not_refused(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, server: ImageServer
) -> None:
    # Far more jobs of one host than its fetch slots, its queue and the in-flight places
    # together: the reader slows to the host's pace, and every job is answered ok.
    jobs = [f"bulk-{i}" for i in range(80)]
    async with running_worker(
        redis_url,
        tiny_weights,
        batch_size=4,
        ring_slots=2,
        fetch_per_host=1,
        fetch_host_queue=2,
        url_allow="127.0.0.1",
    ):
        for job_id in jobs:
            redis_client.xadd("gpufeed:jobs", {"id": job_id, "url": server.url("/img/a")})
        entries = await wait_results(redis_client, "gpufeed:results", len(jobs))
    results = [JobResult.from_fields(f) for _, f in entries]
    assert sorted(r.id for r in results) == sorted(jobs)
    assert all(r.ok for r in results), {r.error for r in results if not r.ok}


class Places:
    """The in-flight places a stage lends back while its jobs wait, and takes again."""

    def __init__(self) -> None:
        self.lent = 0
        self.most_lent = 0

    def give_back(self, n: int) -> None:
        self.lent += n
        self.most_lent = max(self.most_lent, self.lent)

    def take(self, n: int) -> None:
        self.lent -= n


def gated_stage(fake: FakeFetcher, places: Places, **settings: Any) -> tuple[FetchStage, list]:
    answered: list[Any] = []

    async def collect(items: list[Any]) -> None:
        answered.extend(items)

    stage = FetchStage(
        FetchSettings(concurrency=8, per_host=1, host_queue=2, **settings),
        ready=collect,
        fail=collect,
        http=fake,
        store=fake,
        give_back_place=places.give_back,
        take_place=places.take,
    )
    return stage, answered


async def until(check: Any, tries: int = 500) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.01)


async def test_a_busy_host_that_answers_slows_the_reader_and_nothing_is_refused() -> None:
    fake = FakeFetcher()
    gated = "http://busy.example/held.jpg"
    fake.gates[gated] = asyncio.Event()
    places = Places()
    stage, answered = gated_stage(fake, places, read_timeout_s=60.0)
    for n in range(6):
        stage.submit(url_job(n, gated))
    stage.submit(url_job(9, "http://other.example/a.jpg"))
    await until(lambda: len(answered) == 1)
    # The other host's job was not held back; of the busy host's six, one is fetched, two
    # wait with their places lent back (the queue), three wait holding theirs.
    assert [j.url for j in answered] == ["http://other.example/a.jpg"]
    assert places.lent == 2
    fake.gates[gated].set()
    assert await stage.drain(5)
    assert len(answered) == 7 and all(getattr(j, "image", None) for j in answered)
    assert places.lent == 0 and places.most_lent == 2


async def test_a_host_that_answers_nothing_gets_its_jobs_past_the_queue_refused() -> None:
    fake = FakeFetcher()
    gated = "http://stalled.example/held.jpg"
    fake.gates[gated] = asyncio.Event()
    places = Places()
    # A host that answers nothing for 0.2 s counts as stalled.
    stage, answered = gated_stage(fake, places, read_timeout_s=0.2)
    for n in range(6):
        stage.submit(url_job(n, gated))
    await until(lambda: len(answered) == 3)
    # The three holding places gave them up, answered at once as busy; a new one is too.
    stage.submit(url_job(7, gated))
    await until(lambda: len(answered) == 4)
    busy = [o for o in answered if getattr(o, "error_code", None) is not None]
    assert len(busy) == 4 and {o.error_code.value for o in busy} == {"fetch_failed"}
    assert all("host busy" in o.error_message for o in busy)
    assert places.lent == 2  # the queue still waits, without places
    fake.gates[gated].set()
    assert await stage.drain(5)
    assert len(answered) == 7 and places.lent == 0


# ------------------------------------------------------------------ idle connections
class LoopbackResolver:
    """Every name resolves to 127.0.0.1, as a wildcard DNS record would send them all to
    one address."""

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> Any:
        return [
            {
                "hostname": host,
                "host": "127.0.0.1",
                "port": port,
                "family": socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
        ]

    async def close(self) -> None:
        return None


def established_to(port: int) -> int:
    """Open TCP connections from this host to 127.0.0.1:`port` (the client ends)."""
    count = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


async def test_idle_connections_stay_bounded_however_many_host_names() -> None:
    from worker.fetch.http import HttpFetcher

    srv = ImageServer(keep_alive=True).start()
    srv.images["a"] = jpeg_bytes(32, 32, seed=2, quality=80)
    policy = AddressPolicy(parse_host_list("127.0.0.1"), parse_host_list(""))
    fetcher = HttpFetcher(
        policy,
        concurrency=8,
        per_host=2,
        connect_timeout_s=2,
        read_timeout_s=2,
        retries=0,
        max_redirects=0,
    )
    fetcher._resolver._inner = LoopbackResolver()  # type: ignore[assignment]
    try:
        names = [f"h{i}.wildcard.test" for i in range(120)]
        for start in range(0, len(names), 8):
            got = await asyncio.gather(
                *(
                    fetcher.fetch(f"http://{name}:{srv.port}/img/a", 1 << 20, None)
                    for name in names[start : start + 8]
                )
            )
            assert all(f.data == srv.images["a"] for f in got)
        open_now = await asyncio.to_thread(established_to, srv.port)
    finally:
        await fetcher.close()
        srv.stop()
    # 120 names, each left an idle keep-alive connection; at most 8 (the concurrency) stay.
    assert srv.hits["/img/a"] == 120
    assert open_now <= 8


# ------------------------------------------------------------------ the address policy
_NON_PUBLIC_V4 = [
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
    )
]  # fmt: skip


def _forms(v4: ipaddress.IPv4Address, suffix: int) -> list[ipaddress.IPv6Address]:
    """Every IPv6 form that carries `v4`."""
    n = int(v4)
    return [
        ipaddress.IPv6Address(0xFFFF << 32 | n),  # IPv4-mapped ::ffff:a.b.c.d
        ipaddress.IPv6Address(n),  # IPv4-compatible ::a.b.c.d
        ipaddress.IPv6Address(0xFFFF << 48 | n),  # IPv4-translated ::ffff:0:a.b.c.d
        ipaddress.IPv6Address(0x2002 << 112 | n << 80 | suffix),  # 6to4 2002:aabb:ccdd::/48
        ipaddress.IPv6Address(0x64FF9B << 96 | n),  # NAT64 64:ff9b::a.b.c.d
    ]


non_public_v4 = st.sampled_from(_NON_PUBLIC_V4).flatmap(
    lambda net: st.integers(int(net.network_address), int(net.broadcast_address)).map(
        ipaddress.IPv4Address
    )
)


@given(non_public_v4, st.integers(0, 2**80 - 1))
def test_a_non_public_ipv4_address_in_any_ipv6_form_is_refused(
    v4: ipaddress.IPv4Address, suffix: int
) -> None:
    policy = AddressPolicy(parse_host_list(""), parse_host_list(""))
    for ip in _forms(v4, suffix):
        assert address_class(ip) != "public", ip
        assert policy.refuse_address(str(ip), ip) is not None, ip


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**80 - 1))
def test_an_ipv6_form_is_public_exactly_when_its_ipv4_address_is(n: int, suffix: int) -> None:
    v4 = ipaddress.IPv4Address(n)
    for ip in _forms(v4, suffix):
        assert (address_class(ip) == "public") == (address_class(v4) == "public"), ip


@given(st.integers(0, 2**80 - 1))
def test_local_use_nat64_and_site_local_are_never_public(low: int) -> None:
    for prefix in (0x0064FF9B0001 << 80, 0xFEC0 << 112):
        ip = ipaddress.IPv6Address(prefix | low)
        assert address_class(ip) != "public", ip
