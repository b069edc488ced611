"""Redis as the worker finds it at start-up: reachable and a Redis, a cluster or not, and the
keys it must write usable; `RedisLink`, the serving worker's client, which waits for it.
Torch-free, so that `python -m worker` can refuse a Redis it cannot use within a second,
before seconds of importing torch and loading the model.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError

from producer import wire
from producer.backoff import Backoff
from producer.reach import unreachable
from worker.base.errors import EXIT_REDIS, ConfigError, GpufeedError
from worker.config.settings import WorkerConfig
from worker.delivery.redis_errors import ANY, NO_REDIS, temporary
from worker.delivery.redis_scripts import CHECK_KEYS

log = structlog.get_logger("gpufeed.worker")

# What an operator does about exit 3, said once where the CLI reports it.
REDIS_FIX = "start one (make run-redis) or set REDIS_URL; without --no-wait the worker waits for it"
# A connect in the pre-flight that takes longer is as good as refused.
PREFLIGHT_CONNECT_S = 5.0


class RedisUnavailable(GpufeedError, RuntimeError):
    """Redis does not answer at start-up, or the worker's user may not do what it must."""

    exit_code = EXIT_REDIS

    def operator_line(self) -> str:
        return f"{self}; {REDIS_FIX}"


def heartbeat_key(worker_name: str) -> str:
    return f"{wire.DEFAULT_WORKER_PREFIX}{worker_name}"


def make_client(
    url: str, *, cluster: bool, connect_timeout_s: float | None = None
) -> aioredis.Redis:
    """The worker's client for GPUFEED_REDIS_URL `url`; `connect_timeout_s` bounds a connect
    that gets no answer (an address that drops packets) where waiting the system's minutes
    would be wrong."""
    if not cluster:
        # TCP keepalive is no option of a Unix socket connection (redis-py refuses it).
        tcp = not url.startswith("unix:")
        return aioredis.from_url(
            url,
            **({"socket_keepalive": True} if tcp else {}),
            health_check_interval=30,
            socket_connect_timeout=connect_timeout_s,
        )
    # RedisCluster speaks the same commands, each routed to the node of its key's slot
    # (MOVED and failovers followed); the stages take it where they take a Redis.
    cluster_client = RedisCluster.from_url(
        url, socket_keepalive=True, socket_connect_timeout=connect_timeout_s
    )
    return cast(aioredis.Redis, cluster_client)


def _not_now(exc: BaseException) -> bool:
    """Redis away, or refusing everyone for now (BUSY: a script past busy-reply-threshold):
    a worker that waits for Redis waits this out too, and never exits for it."""
    return isinstance(exc, NO_REDIS) or temporary(exc)


async def ping(client: aioredis.Redis, config: WorkerConfig) -> None:
    """One PING; RedisUnavailable with the operator's line when it gets no Redis answer."""
    try:
        await client.ping()
    except Exception as exc:
        if not _not_now(exc):
            raise
        raise RedisUnavailable(unreachable(config.redacted_url(), exc).rstrip(".")) from None


async def is_cluster_node(client: aioredis.Redis) -> bool:
    try:
        info = await client.info("cluster")
    except NoPermissionError:
        # An ACL user without INFO: a single Redis unless told otherwise.
        log.info("cluster_mode_unknown", note="INFO not permitted; set GPUFEED_REDIS_CLUSTER")
        return False
    return str(info.get("cluster_enabled", 0)) == "1"


async def check_keys(client: aioredis.Redis, config: WorkerConfig, *, cluster: bool) -> None:
    """ConfigError (exit 2) when the keys this worker writes are unusable: every job would
    stay pending otherwise."""
    check = client.register_script(CHECK_KEYS)
    problems: list[Any] = []
    for shard in config.shard_layout():
        result_key = wire.result_key("start-up-check", shard.result_prefix)
        for stream in config.lanes_of(shard.stream).streams:
            for problem in await check(
                keys=[
                    stream,
                    shard.results_stream,
                    shard.dead_stream,
                    result_key,
                    # A script's keys share one slot on a cluster: the heartbeat has its own.
                    result_key if cluster else heartbeat_key(config.worker_name),
                ]
            ):
                if problem not in problems:
                    problems.append(problem)
    if problems:
        listed = "; ".join(p.decode() if isinstance(p, bytes) else str(p) for p in problems)
        raise ConfigError(f"Redis keys this worker must write are unusable: {listed}")


async def preflight(config: WorkerConfig, *, wait: bool) -> None:
    """The worker's Redis checks before the model: RedisUnavailable when Redis does not
    answer (only with wait=False: a waiting worker loads its model meanwhile and retries
    later), ConfigError for a cluster layout or keys it cannot serve."""
    cluster = config.redis_cluster == "on"
    client = make_client(config.redis_url, cluster=cluster, connect_timeout_s=PREFLIGHT_CONNECT_S)
    try:
        try:
            await ping(client, config)
            if config.redis_cluster == "auto" and await is_cluster_node(client):
                await client.aclose()
                cluster = True
                client = make_client(
                    config.redis_url, cluster=True, connect_timeout_s=PREFLIGHT_CONNECT_S
                )
            if cluster:
                config.check_cluster_keys()
            await check_keys(client, config, cluster=cluster)
        except RedisUnavailable:
            if not wait:
                raise
        except Exception as exc:
            if not _not_now(exc):
                raise
            if not wait:
                message = unreachable(config.redacted_url(), exc).rstrip(".")
                raise RedisUnavailable(message) from None
    finally:
        with contextlib.suppress(*ANY):
            await client.aclose()


class RedisLink:
    """The serving worker's client: a cluster client where Redis is a cluster
    (GPUFEED_REDIS_CLUSTER, or asked once), waited for while it is away."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.cluster = config.redis_cluster == "on"
        self._cluster_known = config.redis_cluster != "auto"
        self.client = make_client(config.redis_url, cluster=self.cluster)

    async def ready(self, *, wait: bool, stop: asyncio.Event) -> None:
        """Redis answers (waited for with `wait` until `stop` is set, else RedisUnavailable),
        the client is of its kind, and the keys this worker writes are usable."""
        while True:
            await self._answers(wait, stop)
            try:
                await self._find_cluster()
                await check_keys(self.client, self.config, cluster=self.cluster)
                return
            except Exception as exc:
                # Away again, or a script began between the PING and the check.
                if not (wait and _not_now(exc)) or stop.is_set():
                    raise
                await asyncio.sleep(0.2)

    async def _answers(self, wait: bool, stop: asyncio.Event) -> None:
        backoff = Backoff(0.2, 5.0)
        logged = False
        url = self.config.redacted_url()
        while True:
            try:
                await self.client.ping()
                if logged:
                    log.info("redis_reachable", url=url)
                return
            except Exception as exc:
                if not _not_now(exc):
                    raise
                message = unreachable(url, exc)
                if not wait:
                    raise RedisUnavailable(message) from None
                if not logged:
                    log.warning("redis_unreachable_retrying", error=message)
                    logged = True
                if stop.is_set():
                    raise RedisUnavailable(message) from None
                await backoff.sleep()

    async def _find_cluster(self) -> None:
        """GPUFEED_REDIS_CLUSTER=auto: ask the node once whether it is a cluster node, and
        switch to the cluster client if so. A cluster with one shard needs its four key
        names in one slot."""
        cfg = self.config
        if not self._cluster_known:
            self._cluster_known = True
            if await is_cluster_node(self.client):
                await self.client.aclose()
                self.cluster = True
                self.client = make_client(cfg.redis_url, cluster=True)
        if self.cluster:
            cfg.check_cluster_keys()
            log.info("redis_cluster", shards=[s.stream for s in cfg.shard_layout()])

    async def close(self) -> None:
        """Take this worker's heartbeat away and close the client."""
        # Any Redis error: what answers may not even be a Redis server.
        with contextlib.suppress(*ANY):
            await asyncio.wait_for(self.client.delete(heartbeat_key(self.config.worker_name)), 2)
        await self.client.aclose()
