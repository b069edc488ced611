"""The result writer's client on a Redis Cluster: the master that serves one shard's slot.

redis-py's cluster pipeline refuses EVALSHA, and WAIT counts only the writes of its own
connection; so each shard's writer talks to the shard's master directly, with a plain
pipeline (which loads the publish script where it is missing: a promoted replica has none)
on one connection, WAIT after the scripts. Which node that is comes from the cluster
client's slot map; after a failover (the node does not answer, or answers MOVED) the map is
refreshed and the writer, which retries what Redis did not take, goes to the new master.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import SlotNotCoveredError

from worker.base.errors import GpufeedError
from worker.delivery.redis_errors import REDIRECTED, UNREACHABLE

log = structlog.get_logger("gpufeed.cluster")


class SlotMoved(GpufeedError, RedisConnectionError):
    """The node no longer serves the shard's slot: nothing was done there, try again."""


class ShardNodeClient:
    """What a ResultWriter needs of a client (register_script, pipeline, script_load), for
    the keys of one slot on a cluster."""

    def __init__(self, cluster: RedisCluster, url: str, key: str) -> None:
        self.cluster = cluster
        self.key = key
        # The URL's credentials and TLS settings, for a direct connection to each master.
        self._template = ConnectionPool.from_url(url)
        self._clients: dict[str, aioredis.Redis] = {}
        self._refreshing: asyncio.Future[None] | None = None

    def register_script(self, script: str) -> AsyncScript:
        return self.cluster.register_script(script)

    async def script_load(self, script: str) -> Any:
        return await self.cluster.script_load(script)

    def pipeline(self, transaction: bool = False) -> Pipeline:
        try:
            node = self.cluster.get_node_from_key(self.key)
        except SlotNotCoveredError:
            node = None
        if node is None:
            # No slot map yet (a client that has not met the cluster), or one without this
            # slot: read it again; the writer takes this for an outage and tries again.
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self.refresh())
            raise RedisConnectionError(f"no master known for the slot of {self.key!r} yet")
        client = self._clients.get(node.name)
        if client is None:
            kwargs = {**self._template.connection_kwargs, "host": node.host, "port": node.port}
            kwargs.pop("db", None)
            pool = ConnectionPool(connection_class=self._template.connection_class, **kwargs)
            client = self._clients[node.name] = aioredis.Redis.from_pool(pool)
        return NodePipeline(self, client, transaction)

    async def refresh(self) -> None:
        """Re-read the cluster's slot map (after a failover)."""
        try:
            await self.cluster.nodes_manager.initialize()
        except UNREACHABLE as exc:
            log.warning("cluster_map_refresh_failed", error=str(exc))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


class NodePipeline(Pipeline):
    """A plain pipeline to one node that turns 'this node does not serve the slot' (it
    died, or answers MOVED) into a refreshed slot map and a SlotMoved for the caller."""

    def __init__(self, owner: ShardNodeClient, client: aioredis.Redis, transaction: bool) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction, None)
        self._owner = owner

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            replies: list[Any] = await super().execute(raise_on_error)
        except (*UNREACHABLE, *REDIRECTED):
            await self._owner.refresh()
            raise
        if any(isinstance(r, REDIRECTED) for r in replies):
            await self._owner.refresh()
            raise SlotMoved(f"the slot of {self._owner.key!r} is moving (failover)")
        return replies
