"""gpufeed on a real Redis Cluster (3 masters, 1 replica each): sharded job streams, two
workers, and a master killed mid-run.

The cluster starts once for the module; each test uses its own key names. The workers run
the null model, so the time goes to Redis and to gpufeed itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster as SyncCluster

from producer.client import Job, Producer
from producer.shards import SLOTS, layout, shard_of_id, slot_of
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.redis_cluster import RedisCluster, ResultWatcher, results_by_id
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import serving
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.lifecycle.service import Worker

# A private Redis Cluster of six is started for this module: `make test-fast` leaves it out.
pytestmark = pytest.mark.slow

NULL = {
    "model": "null",
    "weights": "none",
    "batch_size": 8,
    "max_wait_ms": 5.0,
    "decode_threads": 2,
    "ring_slots": 3,
    "log_format": "json",
    "log_level": "warning",
    "shutdown_grace_s": 20.0,
    "claim_interval_s": 1.0,
    "visibility_timeout_s": 3.0,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def names(prefix: str) -> dict[str, str]:
    return {
        "stream": f"{prefix}:jobs",
        "results_stream": f"{prefix}:results",
        "result_prefix": f"{prefix}:result:",
        "dead_stream": f"{prefix}:dead",
    }


def null_config(url: str, prefix: str, name: str, **overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = {
        **NULL,
        **names(prefix),
        "redis_url": url,
        "worker_name": name,
        "shards": 3,
        **overrides,
    }
    return WorkerConfig.load(env={}, overrides=values)


def running(config: WorkerConfig) -> AbstractAsyncContextManager[Worker]:
    return serving(Worker(config))


def node_url(cluster: RedisCluster) -> str:
    """A running node (the first may be the one a test killed)."""
    return next(n for n in cluster.nodes if n.running).url


def wait_for_results(client: SyncCluster, stream: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while client.xlen(stream) < count and time.monotonic() < deadline:
        time.sleep(0.01)


# ------------------------------------------------------------------ the layout, no cluster
def test_each_shard_tag_lands_in_its_own_share_of_the_slots() -> None:
    shards = layout(3)
    for i, shard in enumerate(shards):
        slot = slot_of(shard.stream)
        assert i * SLOTS // 3 <= slot < (i + 1) * SLOTS // 3
        # Every key the publish script touches for the shard is in that slot.
        for key in (shard.results_stream, shard.dead_stream, shard.result_key("order-77")):
            assert slot_of(key) == slot
    assert [s.stream for s in layout(1)] == ["gpufeed:jobs"]


def test_the_producer_computes_the_shard_of_an_id_as_any_language_would() -> None:
    for job_id in ("order-77", "t1", "é-ü"):
        assert shard_of_id(job_id, 3) == zlib.crc32(job_id.encode()) % 3
    producer = Producer(redis.Redis(port=1), shard_count=3, cluster="off")
    assert producer.shard_of("order-77") == zlib.crc32(b"order-77") % 3
    assert producer.shards[producer.shard_of("order-77")].result_key("order-77") == (
        f"gpufeed:result:{{{producer.shards[producer.shard_of('order-77')].tag}}}:order-77"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUFEED_SHARDS": "3", "GPUFEED_STREAM": "{gpufeed}:jobs"}, "GPUFEED_STREAM"),
        ({"GPUFEED_SHARDS": "0"}, "GPUFEED_SHARDS"),
        ({"GPUFEED_REDIS_CLUSTER": "maybe"}, "GPUFEED_REDIS_CLUSTER"),
        ({"GPUFEED_WAIT_REPLICAS": "-1"}, "GPUFEED_WAIT_REPLICAS"),
        ({"GPUFEED_TUNING": "wait_replicas_timeout_ms=0"}, "GPUFEED_TUNING wait_replicas_"),
    ],
)
def test_cluster_settings_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig.load(env={"GPUFEED_MODEL": "null", **env})


# ------------------------------------------------------------------ on the cluster
@pytest.mark.slow
async def test_one_shard_on_a_cluster_needs_one_hash_tag(cluster: RedisCluster) -> None:
    config = null_config(cluster.url, "untagged", "w-untagged", shards=1)
    with pytest.raises(ConfigError, match="share one hash tag"):
        async with running(config):
            pass


@pytest.mark.slow
async def test_jobs_over_three_shards_are_answered_exactly_once_by_two_workers(
    cluster: RedisCluster,
) -> None:
    prefix = "spread"
    image = jpeg_bytes(64, 48)
    client = SyncCluster.from_url(cluster.url)
    producer = Producer(client, shard_count=3, **names(prefix))
    shards = producer.shards
    # The three shards live on three different masters.
    assert len({cluster.master_of(s.stream).port for s in shards}) == 3
    async with AsyncExitStack() as stack:
        # One worker reads and publishes on its event loop; the other reads through an
        # intake process per shard (each reading its shard's master, the payloads into
        # memory its decode process reads) and publishes from its writer's process, through
        # a shard master's client of its own.
        apart = {"result_writer": "process", "intake": "process", "decode_processes": "1"}
        workers = [
            await stack.enter_async_context(running(null_config(cluster.url, prefix, name, **kw)))
            for name, kw in (("w1", {"result_writer": "loop", "intake": "loop"}), ("w2", apart))
        ]
        apart_report = workers[1].report()
        assert len(apart_report.writer_pids) == 1 and len(apart_report.intake_pids) == 3
        # The fleet's hot list is one key: its script runs on that key's node.
        hot = workers[0].stages.hot
        assert hot is not None and await hot.add({'["path","x","a.jpg"]': 1}) == 1
        assert [e.ref for e in await hot.top()] == ["a.jpg"]
        own = [Job(image=image, id=f"job-{i}") for i in range(60)]
        anonymous = [Job(image=image) for _ in range(30)]
        mine = [Job(image=image, id=f"mine-{i}", reply_to=f"{prefix}:mine") for i in range(9)]
        ids = await asyncio.to_thread(producer.submit_many, own + anonymous + mine)
        results = await asyncio.to_thread(producer.wait, ids, 60.0)
    assert set(results) == set(ids)
    assert all(r.ok for r in results.values()), [r.error for r in results.values() if not r.ok]
    # Each shard got jobs, and each job was answered once, on its shard's stream.
    assert all(client.xlen(s.stream) > 0 for s in shards)
    default = results_by_id(client, [s.results_stream for s in shards])
    replies = results_by_id(client, [s.reply_stream(f"{prefix}:mine") for s in shards])
    assert {i: len(v) for i, v in {**default, **replies}.items()} == {i: 1 for i in ids}
    assert set(replies) == {j.id for j in mine}
    for job in own:
        assert job.id is not None
        shard = shards[shard_of_id(job.id, 3)]
        assert client.hget(shard.result_key(job.id), "status") == b"ok"
    client.close()


async def test_priority_levels_of_each_shard_share_its_slot_and_are_all_served(
    cluster: RedisCluster,
) -> None:
    """GPUFEED_PRIORITIES with shards: each shard has a stream per level, in the shard's
    slot, and a worker reads them all; its writer's process routes each level's answers
    to its shard's writer."""
    prefix = "levels"
    image = jpeg_bytes(48, 48)
    client = SyncCluster.from_url(node_url(cluster))
    producer = Producer(client, shard_count=3, priorities="high,low", **names(prefix))
    config = null_config(
        node_url(cluster), prefix, "w-levels", priorities="high,low", result_writer="process"
    )
    async with running(config):
        high = [Job(image=image, id=f"hi-{i}") for i in range(12)]
        low = [Job(image=image, id=f"lo-{i}") for i in range(12)]
        ids = await asyncio.to_thread(producer.submit_many, high, priority="high")
        ids += await asyncio.to_thread(producer.submit_many, low, priority="low")
        results = await asyncio.to_thread(producer.wait, ids, 60.0)
    assert {i: r.status for i, r in results.items()} == {i: "ok" for i in ids}
    for shard in producer.shards:
        for level in ("high", "low"):
            stream = f"{shard.stream}:{level}"
            assert slot_of(stream) == slot_of(shard.stream)
            assert client.xlen(stream) > 0
    client.close()


async def test_a_reply_to_in_another_slot_is_answered_invalid_job(cluster: RedisCluster) -> None:
    prefix = "slots"
    client = SyncCluster.from_url(cluster.url)
    shard = layout(3, **names(prefix))[shard_of_id("x1", 3)]
    async with running(null_config(cluster.url, prefix, "w-slots")):
        # A client that does not use the producer names a reply stream of another slot.
        client.xadd(shard.stream, {"id": "x1", "image": jpeg_bytes(32, 32), "reply_to": "{x}:r"})
        producer = Producer(client, shard_count=3, **names(prefix))
        result = await asyncio.to_thread(producer.wait_one, "x1", 30.0)
    assert result.error_code == "invalid_job"
    assert f":{{{shard.tag}}}" in (result.error or "")
    client.close()


async def test_the_backlog_age_is_measured_on_each_shards_master(cluster: RedisCluster) -> None:
    """The degrade switch's check (one script per stream) runs on the cluster client, and
    a future entry ID on one shard does not hide the backlog behind it."""
    import redis.asyncio.cluster as aiocluster

    from worker.pipeline.degrade import WaitingClock

    shards = layout(3, **names("age"))
    sync = SyncCluster.from_url(node_url(cluster))
    for shard in shards:
        sync.xgroup_create(shard.stream, "gpufeed", id="0", mkstream=True)
    forged = shards[1].stream
    sync.xadd(forged, {"image": b"x"}, id="9999999999999-0")
    sync.xreadgroup("gpufeed", "c", {forged: ">"})
    sync.xadd(forged, {"image": b"x"})  # numbered after the forged one, and waiting
    client = aiocluster.RedisCluster.from_url(node_url(cluster))
    clock = WaitingClock()
    try:
        streams = [s.stream for s in shards]
        assert await clock.oldest_waiting_s(client, streams, "gpufeed") < 60
        await asyncio.sleep(1.1)
        assert 1.1 <= await clock.oldest_waiting_s(client, streams, "gpufeed") < 60
    finally:
        await client.aclose()
        sync.close()


@pytest.mark.slow
@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_a_master_killed_mid_run_every_job_ends_with_a_result(
    cluster: RedisCluster, wait_replicas: int, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"failover{wait_replicas}"
    image = jpeg_bytes(64, 48)
    client = SyncCluster.from_url(node_url(cluster))
    producer = Producer(client, shard_count=3, **names(prefix))
    shards = producer.shards
    jobs = [Job(image=image, id=f"f{i}") for i in range(600)]
    ids = producer.submit_many(jobs)
    # The jobs themselves are on the replicas before anything fails: what is measured is
    # what happens to results.
    cluster.wait_replicas_online()
    for shard in shards:
        client.execute_command("WAIT", 1, 5000, target_nodes=client.get_node_from_key(shard.stream))
    victim = shards[0].stream
    streams = [s.results_stream for s in shards]
    with ResultWatcher(node_url(cluster), streams) as watcher:
        async with AsyncExitStack() as stack:
            # k2 reads through its intake processes: they follow the failover too.
            intake = {"intake": "process", "decode_processes": "1"}
            for name, kw in (("k1", {}), ("k2", intake)):
                config = null_config(
                    node_url(cluster), prefix, name, wait_replicas=wait_replicas, **kw
                )
                await stack.enter_async_context(running(config))
            # Mid-run: some results written, most jobs still to do.
            await asyncio.to_thread(wait_for_results, client, shards[0].results_stream, 20)
            await asyncio.to_thread(cluster.kill_master_of, victim)
            after = Producer(
                SyncCluster.from_url(node_url(cluster)), shard_count=3, **names(prefix)
            )
            results = await asyncio.to_thread(after.wait, ids, 120.0)
        report = watcher.report()
    assert set(results) == set(ids), "every job ends with a result"
    assert all(r.ok for r in results.values())
    with capsys.disabled():
        print(f"\nfailover, GPUFEED_WAIT_REPLICAS={wait_replicas}: {report}")
    # The dead master comes back as a replica for the next test.
    for node in cluster.nodes:
        if not node.running:
            node.start()
    cluster.wait_ok()
    cluster.wait_replicas_online()
    client.close()


def test_keda_has_a_trigger_per_shard_on_the_contract_s_stream_names() -> None:
    from tests.project.test_deploy import ROOT, k8s, load_all

    (scaled,) = load_all(ROOT / "deploy" / "k8s-cluster" / "keda.yaml")
    triggers = scaled["spec"]["triggers"]
    assert scaled["spec"]["scaleTargetRef"] == k8s("ScaledObject")["spec"]["scaleTargetRef"]
    assert {t["type"] for t in triggers} == {"redis-cluster-streams"}
    streams = [s.stream for s in layout(3)]
    backlog = [t["metadata"] for t in triggers if "lagCount" in t["metadata"]]
    assert sorted(m["stream"] for m in backlog) == sorted(streams)
    assert all(m["consumerGroup"] == "gpufeed" for m in backlog)
    lengths = [t["metadata"]["stream"] for t in triggers if "streamLength" in t["metadata"]]
    assert sorted(lengths) == sorted(streams)
    auth = k8s("TriggerAuthentication")["metadata"]["name"]
    assert all(t["authenticationRef"]["name"] == auth for t in triggers)


async def test_the_producer_cli_submits_waits_and_shows_stats_per_shard(
    cluster: RedisCluster, tmp_path: Path
) -> None:
    prefix = "cli"
    for i in range(6):
        (tmp_path / f"img{i}.jpg").write_bytes(jpeg_bytes(32, 32, seed=i))
    env = {
        "REDIS_URL": cluster.url,
        "GPUFEED_SHARDS": "3",
        "GPUFEED_STREAM": f"{prefix}:jobs",
        "GPUFEED_RESULTS_STREAM": f"{prefix}:results",
        "GPUFEED_RESULT_PREFIX": f"{prefix}:result:",
        "GPUFEED_DEAD_STREAM": f"{prefix}:dead",
    }
    async with running(null_config(cluster.url, prefix, "w-cli")):
        submitted = await asyncio.to_thread(
            run_module, "producer", "submit", str(tmp_path), "--wait", "--json", env=env
        )
    assert submitted.returncode == 0, submitted.stderr
    answers = [json.loads(line) for line in submitted.stdout.splitlines() if line.strip()]
    assert sorted(a["id"] for a in answers) == [f"img{i}.jpg" for i in range(6)]
    assert all(a["status"] == "ok" for a in answers)
    stats = run_module("producer", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    shards = json.loads(stats.stdout)["shards"]
    assert [s["stream"]["name"] for s in shards] == [s.stream for s in layout(3, **names(prefix))]
    assert sum(s["stream"]["length"] for s in shards) == 6


async def test_a_wait_for_replicas_that_times_out_leaves_the_results_and_counts_them(
    tmp_path: Path,
) -> None:
    # A single Redis with no replica: every WAIT 1 times out.
    server = RedisServer(tmp_path / "single").start()
    try:
        config = null_config(
            server.url,
            "solo",
            "w-solo",
            shards=1,
            wait_replicas=1,
            wait_replicas_timeout_ms=20,
        )
        producer = Producer(server.url, **names("solo"))
        async with running(config) as worker:
            jobs = [Job(image=jpeg_bytes(32, 32), id=f"s{i}") for i in range(5)]
            ids = producer.submit_many(jobs)
            results = await asyncio.to_thread(producer.wait, ids, 30.0)
        assert {i: r.status for i, r in results.items()} == {i: "ok" for i in ids}
        assert worker.counters.events.get("replica_wait_timeout") == 5
        producer.close()
    finally:
        server.stop()


@pytest.mark.slow
async def test_a_batch_over_three_shards_rides_out_a_master_failover(
    cluster: RedisCluster, tmp_path: Path
) -> None:
    from producer.batch_runner import BatchOptions, Progress, run_batch

    pq = pytest.importorskip("pyarrow.parquet")
    prefix = "batchfailover"
    folder = tmp_path / "images"
    folder.mkdir()
    ids = {f"{i:05d}.jpg" for i in range(1500)}
    for n, name in enumerate(sorted(ids)):
        (folder / name).write_bytes(jpeg_bytes(32, 24, seed=n % 7))
    out = tmp_path / "out.parquet"
    client = SyncCluster.from_url(node_url(cluster))
    producer = Producer(client, shard_count=3, **names(prefix))
    victim = producer.shards[1].stream
    killed = asyncio.Event()
    loop = asyncio.get_running_loop()
    answered_at_kill: list[int] = []

    def kill() -> None:
        cluster.kill_master_of(victim)
        loop.call_soon_threadsafe(killed.set)

    def on_progress(p: Progress) -> None:
        # Mid-run: a third answered, most still to submit. The kill and the wait for the
        # replica to take over go on beside the run, which meets the outage as it is.
        if not answered_at_kill and p.answered >= 500:
            answered_at_kill.append(p.answered)
            threading.Thread(target=kill, daemon=True).start()

    async with AsyncExitStack() as stack:
        for name in ("b1", "b2"):
            config = null_config(node_url(cluster), prefix, name)
            await stack.enter_async_context(running(config))
        progress = await asyncio.to_thread(
            run_batch,
            str(folder),
            out,
            producer,
            BatchOptions(in_flight=48),
            on_progress=on_progress,
        )
        assert killed.is_set() and answered_at_kill[0] < len(ids)
        table = pq.read_table(out)
        assert sorted(table.column("id").to_pylist()) == sorted(ids), "every id once"
        assert set(table.column("status").to_pylist()) == {"ok"}
        assert progress.failovers >= 1

        # A run started while another shard's master is down, before its replica takes
        # over: what it asks once at its start (the reply streams' last entries) and at its
        # end waits the failover out as its lanes do.
        few = sorted(ids)[:300]
        (tmp_path / "few.txt").write_text("".join(f"{folder / name}\n" for name in few))
        cluster.master_of(producer.shards[0].stream).kill()
        again = await asyncio.to_thread(
            run_batch, str(tmp_path / "few.txt"), tmp_path / "again.parquet", producer,
            BatchOptions(in_flight=48, id_prefix="again/"),
        )  # fmt: skip
    table = pq.read_table(tmp_path / "again.parquet")
    assert sorted(table.column("id").to_pylist()) == [f"again/{folder / n}" for n in few]
    assert again.ok == len(few)
    # The dead masters come back as replicas for the next test.
    for node in cluster.nodes:
        if not node.running:
            node.start()
    cluster.wait_ok()
    cluster.wait_replicas_online()
    client.close()
