"""Tenants (GPUFEED_TENANTS): each submits to streams of its own, under the Redis user
docs/security.md documents, and what it does to its own stream reaches only its own jobs."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import example, given
from hypothesis import strategies as st

from producer import Producer, tenants
from producer.shards import hash_tag, layout, slot_of
from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import running_worker, wait_results
from tests.system.test_security import WORKER_ACL
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
LAST_ID = "18446744073709551615-18446744073709551615"


def documented_tenant_acl(name: str) -> list[str]:
    """Tenant `name`'s ACL rules exactly as docs/security.md documents them for `acme`."""
    page = (ROOT / "docs" / "security.md").read_text()
    line = next(ln.strip() for ln in page.splitlines() if "ACL SETUSER tenant-acme " in ln)
    rules = line.split("ACL SETUSER tenant-acme ", 1)[1].split()
    return [">t3nant-pw" if r.startswith(">") else r.replace("acme", name) for r in rules]


def test_tenant_names_and_weights_are_checked() -> None:
    assert tenants.parse("acme=3, globex") == [("acme", 3), ("globex", 1)]
    assert tenants.parse("") == []
    for bad in ("a:b", "a*", "x{y}", "acme,acme", "acme=0", "acme=x", "a" * 65):
        with pytest.raises(tenants.TenantError):
            tenants.parse(bad)


def test_a_tenants_keys_share_their_shards_slot_and_never_an_operators_key() -> None:
    own = layout(4)
    acme = tenants.tenant_layout("acme", 4)
    for o, t in zip(own, acme, strict=True):
        assert t.tenant == "acme" and t.tag == o.tag
        # One publish script touches the job stream, the reply stream, the hashes and the
        # dead letters: on a cluster they must share one slot.
        slots = {slot_of(k) for k in (t.stream, t.results_stream, t.result_key("x"))}
        assert slots == {slot_of(o.dead_stream)} and t.dead_stream == o.dead_stream
        assert hash_tag(t.stream) == o.tag
        assert t.stream != o.stream and not t.result_key("x").startswith(o.result_prefix + "x")
    one = tenants.tenant_layout("acme", 1)[0]
    assert (one.stream, one.results_stream, one.result_prefix) == (
        "gpufeed:jobs:t:acme",
        "gpufeed:results:t:acme",
        "gpufeed:result:t:acme:",
    )


@pytest.mark.parametrize("shards", [1, 4])
def test_a_tenant_is_answered_only_on_its_own_streams(shards: int) -> None:
    keys = tenants.tenant_layout("acme", shards)[-1]
    own_batch = keys.reply_stream("gpufeed:results:t:acme:batch:abc")
    assert tenants.reply_problem(keys.results_stream, keys) is None
    assert tenants.reply_problem(own_batch, keys) is None
    for other in (
        "gpufeed:results",
        "gpufeed:results:t:acmex",
        "gpufeed:results:t:globex",
        "gpufeed:jobs:hot",
        "gpufeed:dead",
    ):
        problem = tenants.reply_problem(other, keys)
        assert problem is not None and "acme" in problem


@pytest.fixture
def tenant_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "tenants").start()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "gpufeed", *WORKER_ACL.split())
    for name in ("acme", "globex"):
        admin.execute_command("ACL", "SETUSER", f"tenant-{name}", *documented_tenant_acl(name))
    admin.close()
    yield server
    server.stop()


def _tenant(server: RedisServer, name: str) -> redis.Redis:
    return redis.Redis.from_url(f"redis://tenant-{name}:t3nant-pw@127.0.0.1:{server.port}/0")


# Each command the documented tenant user may run, as it would run on `key`; a right added
# to the documented line without a row here fails the test below, so every right is tried.
COMMANDS = {
    "ping": lambda r, key: r.ping(),
    "info": lambda r, key: r.info("memory"),
    "exists": lambda r, key: r.exists(key),
    "xlen": lambda r, key: r.xlen(key),
    "type": lambda r, key: r.type(key),
    "xinfo|groups": lambda r, key: r.xinfo_groups(key),
    "xinfo|consumers": lambda r, key: r.xinfo_consumers(key, "gpufeed"),
    "xadd": lambda r, key: r.xadd(key, {"f": "v"}, maxlen=0),
    "xread": lambda r, key: r.xread({key: "0"}, count=1),
    "xrange": lambda r, key: r.xrange(key, count=1),
    "xrevrange": lambda r, key: r.xrevrange(key, count=1),
    "hgetall": lambda r, key: r.hgetall(key),
    "del": lambda r, key: r.delete(key),
}
KEYLESS = {"ping", "info"}


def test_every_right_of_a_tenant_stops_at_the_workers_and_other_tenants_keys(
    tenant_server: RedisServer,
) -> None:
    admin = redis.Redis(port=tenant_server.port)
    acme = _tenant(tenant_server, "acme")
    rights = {r[1:] for r in documented_tenant_acl("acme") if r.startswith("+")}
    assert rights == set(COMMANDS), "a documented right without a row in COMMANDS"
    theirs = [
        "gpufeed:jobs",
        "gpufeed:jobs:high",
        "gpufeed:results",
        "gpufeed:result:x",
        "gpufeed:dead",
        "gpufeed:jobs:hot",
        "gpufeed:worker:w1",
        "gpufeed:jobs:t:globex",
        "gpufeed:jobs:t:globex:high",
        "gpufeed:results:t:globex",
        "gpufeed:results:t:globex:batch:1",
        "gpufeed:result:t:globex:x",
        "gpufeed:jobs:t:acmex",
        "gpufeed:result:t:acmex:x",
    ]
    for key in theirs:
        admin.xadd(key, {"keep": "me"}) if "result:" not in key else admin.hset(key, "k", "v")
    for right in sorted(rights - KEYLESS):
        for key in theirs:
            with pytest.raises(redis.exceptions.NoPermissionError):
                COMMANDS[right](acme, key)
    for key in theirs:
        assert admin.exists(key), f"{key} was touched by another tenant"
    # Its own keys: every right works there (an empty answer is fine, a refusal is not).
    mine = {
        "gpufeed:jobs:t:acme",
        "gpufeed:jobs:t:acme:high",
        "gpufeed:results:t:acme",
        "gpufeed:results:t:acme:batch:1",
    }
    for right in sorted(rights):
        for key in mine:
            if right == "hgetall":
                continue
            try:
                COMMANDS[right](acme, key)
            except redis.exceptions.NoPermissionError:
                raise
            except redis.exceptions.ResponseError as exc:
                assert "NOGROUP" in str(exc)  # no worker made the group: not a refusal
    acme.hgetall("gpufeed:result:t:acme:x")
    # No script: a tenant cannot hold Redis for everyone (BUSY).
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme.eval("return 1", 0)
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme.fcall("anything", 0)
    admin.close()
    acme.close()


async def test_what_a_tenant_does_to_its_own_stream_reaches_only_its_own_jobs(
    tenant_server: RedisServer, tiny_weights: Path
) -> None:
    port = tenant_server.port
    admin = redis.Redis(port=port)
    acme_redis = _tenant(tenant_server, "acme")
    url = f"redis://gpufeed:w0rker-pw@127.0.0.1:{port}/0"
    image = jpeg_bytes()
    globex = Producer(f"redis://tenant-globex:t3nant-pw@127.0.0.1:{port}/0", tenant="globex")
    acme = Producer(f"redis://tenant-acme:t3nant-pw@127.0.0.1:{port}/0", tenant="acme")
    # Both queue jobs; acme then trims its stream to nothing: only its own are lost.
    for i in range(8):
        globex.submit(image, id=f"g{i}")
        acme.submit(image, id=f"a{i}")
    acme_redis.xadd("gpufeed:jobs:t:acme", {"image": image, "id": "trim"}, maxlen=0)
    # ... and closes it for good with the last possible ID.
    acme_redis.xadd("gpufeed:jobs:t:acme", {"image": image, "id": "last"}, id=LAST_ID)
    with pytest.raises(redis.exceptions.ResponseError, match="last possible ID"):
        acme_redis.xadd("gpufeed:jobs:t:acme", {"image": image})
    # It may not touch the others' streams, whatever the XADD says.
    for key in ("gpufeed:jobs:t:globex", "gpufeed:jobs"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            acme_redis.xadd(key, {"image": image}, maxlen=0)
    async with running_worker(url, tiny_weights, tenants="acme=1,globex=1") as worker:
        got = await asyncio.to_thread(globex.wait, [f"g{i}" for i in range(8)], 60.0)
        assert sorted(got) == [f"g{i}" for i in range(8)]
        assert all(r.ok for r in got.values())
        # acme's closed stream is still read: what it holds is answered, once.
        answered = await wait_results(admin, "gpufeed:results:t:acme", 1)
        assert [f[b"id"] for _, f in answered] == [b"last"]
        # While the worker reads, acme deletes its stream and starts afresh (its own
        # jobs only); the same id from two tenants is two jobs, neither the other's
        # duplicate.
        acme_redis.delete("gpufeed:jobs:t:acme")
        globex.submit(image, id="late")
        await asyncio.to_thread(acme.submit, image, id="g0")
        got = await asyncio.to_thread(acme.wait, ["g0"], 60.0)
        assert got["g0"].ok and not got["g0"].duplicate_of
        assert (await asyncio.to_thread(globex.wait, ["late"], 60.0))["late"].ok
        # A reply_to outside its own streams is refused, on its own stream.
        sneak = {"image": image, "id": "sneak", "reply_to": "gpufeed:results:t:globex"}
        acme_redis.xadd("gpufeed:jobs:t:acme", sneak)
        got = await asyncio.to_thread(acme.wait, ["sneak"], 60.0)
        assert got["sneak"].error_code == "invalid_job"
        assert "gpufeed:results:t:acme" in (got["sneak"].error or "")
        assert worker.ready
    assert not admin.exists("gpufeed:results")
    for stream in ("gpufeed:jobs:t:globex", "gpufeed:jobs:t:acme"):
        assert admin.xpending(stream, "gpufeed")["pending"] == 0
    results = [JobResult.from_fields(f) for _, f in admin.xrange("gpufeed:results:t:globex")]
    assert sorted(r.id for r in results) == sorted([f"g{i}" for i in range(8)] + ["late"])
    globex.close()
    acme.close()
    admin.close()
    acme_redis.close()


def test_a_tenant_producer_refuses_a_name_that_cannot_be_a_key() -> None:
    with pytest.raises(tenants.TenantError, match=re.escape("'a:b'")):
        Producer("redis://127.0.0.1:1/0", tenant="a:b", cluster="off")


@pytest.mark.slow
async def test_a_tenants_backlog_does_not_hold_back_another_tenants_jobs(
    redis_url: str, tiny_weights: Path
) -> None:
    """A backlog of 300 in one tenant's stream; another tenant's 5 jobs, sent once the
    worker is busy with it, are answered after about the jobs already read, not after the
    backlog (on one shared stream they would come last)."""
    admin = redis.Redis.from_url(redis_url)
    image = jpeg_bytes()
    bulk, live = tenants.names("bulk")[0], tenants.names("live")[0]
    async with running_worker(redis_url, tiny_weights, tenants="bulk,live") as worker:
        with admin.pipeline(transaction=False) as pipe:
            for i in range(300):
                pipe.xadd(bulk, {"image": image, "id": f"b{i}"})
            pipe.execute()
        await wait_results(admin, tenants.names("bulk")[1], 20)
        for i in range(5):
            admin.xadd(live, {"image": image, "id": f"l{i}"})
        live_results = await wait_results(admin, tenants.names("live")[1], 5)
        last_live = max(entry for entry, _ in live_results)
        bulk_results = await wait_results(admin, tenants.names("bulk")[1], 300)
        assert len(bulk_results) == 300 and len(live_results) == 5
        before = sum(1 for entry, _ in bulk_results if _entry_key(entry) < _entry_key(last_live))
        # Answered ahead of the live tenant's last job: what was read before it came (the
        # in-flight places) and a few reads' worth, far from the 300 of the backlog.
        assert before < 20 + 3 * worker.stages.in_flight.limit < 300, before
    admin.close()


def _entry_key(entry: bytes) -> tuple[int, int]:
    ms, seq = entry.decode().split("-")
    return int(ms), int(seq)


@pytest.mark.slow
async def test_a_tenants_user_runs_submit_batch_and_stats_with_the_documented_rights(
    tenant_server: RedisServer, tiny_weights: Path, tmp_path: Path
) -> None:
    port = tenant_server.port
    admin = redis.Redis(port=port)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.jpg").write_bytes(jpeg_bytes(24, 16, seed=i))
    env = {
        "REDIS_URL": f"redis://tenant-acme:t3nant-pw@127.0.0.1:{port}/0",
        "GPUFEED_TENANT": "acme",
    }
    url = f"redis://gpufeed:w0rker-pw@127.0.0.1:{port}/0"
    async with running_worker(url, tiny_weights, tenants="acme"):
        submit = await asyncio.to_thread(
            run_module, "producer", "submit", str(folder / "0.jpg"), "--wait", "--json", env=env
        )
        assert submit.returncode == 0, submit.stderr
        assert json.loads(submit.stdout.splitlines()[-1])["status"] == "ok"
        out = tmp_path / "out.jsonl"
        batch = await asyncio.to_thread(
            run_module, "producer", "batch", str(folder), "--out", str(out), env=env
        )
        assert batch.returncode == 0, batch.stderr
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(r["id"] for r in rows) == [f"{i}.jpg" for i in range(6)]
        assert all(r["status"] == "ok" for r in rows)
        stats = await asyncio.to_thread(run_module, "producer", "stats", "--json", env=env)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["stream"]["name"] == "gpufeed:jobs:t:acme"
    # Everything it did stayed under its own keys; its batch's reply stream is gone.
    assert admin.xlen("gpufeed:jobs") == 0 and not admin.exists("gpufeed:results")
    assert admin.keys("gpufeed:results:t:acme:*") == []
    admin.close()


def test_an_operator_sees_each_tenants_backlog(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    for i in range(3):
        admin.xadd("gpufeed:jobs:t:acme", {"image": b"x", "id": f"a{i}"})
    admin.xadd("gpufeed:jobs:t:globex", {"image": b"x"})
    env = {"REDIS_URL": redis_url, "GPUFEED_TENANTS": "acme=3,globex"}
    shown = run_module("producer", "stats", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows = {r["tenant"]: r for r in json.loads(shown.stdout)["tenants"]}
    assert (rows["acme"]["stream"], rows["acme"]["length"]) == ("gpufeed:jobs:t:acme", 3)
    assert rows["globex"]["length"] == 1 and rows["globex"]["lag"] is None  # no group yet
    table = run_module("producer", "stats", env=env)
    assert table.returncode == 0 and "gpufeed:jobs:t:globex" in table.stdout
    bad = run_module("producer", "stats", env={**env, "GPUFEED_TENANTS": "a:b"})
    assert bad.returncode == 2 and "GPUFEED_TENANTS" in bad.stderr
    admin.close()


async def test_a_tenants_dead_letter_is_replayed_to_its_own_stream(
    redis_url: str, tiny_weights: Path
) -> None:
    admin = redis.Redis.from_url(redis_url)
    stream = "gpufeed:jobs:t:acme"
    admin.xgroup_create(stream, "gpufeed", id="0", mkstream=True)
    admin.xadd(stream, {"id": "poison", "image": jpeg_bytes()})
    # A consumer that read it and vanished: delivered once, never answered.
    assert admin.xreadgroup("gpufeed", "ghost", {stream: ">"}, count=1)
    async with running_worker(
        redis_url,
        tiny_weights,
        tenants="acme",
        visibility_timeout_s=1.0,
        claim_interval_s=0.3,
        max_deliveries=1,
    ):
        first = await wait_results(admin, "gpufeed:results:t:acme", 1, timeout_s=30)
        assert JobResult.from_fields(first[0][1]).error_code == "dead_letter"
        (dead,) = admin.xrange("gpufeed:dead")
        assert dead[1][b"dead_tenant"] == b"acme"
        operator = Producer(redis_url)
        replayed = await asyncio.to_thread(operator.replay_dead, all=True)
        assert len(replayed) == 1
        answers = await wait_results(admin, "gpufeed:results:t:acme", 2, timeout_s=30)
        second = JobResult.from_fields(answers[-1][1])
        assert second.ok and second.id == "poison" and not second.duplicate_of
        assert admin.xlen("gpufeed:jobs") == 0
        operator.close()
    admin.close()


@given(st.text(max_size=200))
@example("acme=" + "9" * 5000)
@example("acme=１２")
@example("acme=1_0")
def test_any_tenants_text_is_a_list_or_one_config_line(raw: str) -> None:
    try:
        WorkerConfig.load(env={"GPUFEED_TENANTS": raw})
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("GPUFEED_TENANTS: ")
