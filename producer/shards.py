"""Where gpufeed's keys live when the job stream is split into shards (Redis Cluster).

Redis Cluster runs a script only on keys of one hash slot, and gpufeed acknowledges a job and
publishes its result in one script. So every key that script touches for a job (the job
stream, the reply stream, the result hashes, the dead-letter stream) carries the hash tag of
the job's shard:

    job stream      <GPUFEED_STREAM>:{T}            gpufeed:jobs:{s0-0}
    results stream  <GPUFEED_RESULTS_STREAM>:{T}    gpufeed:results:{s0-0}
    result hash     <GPUFEED_RESULT_PREFIX>{T}:<id> gpufeed:result:{s0-0}:order-77
    dead letters    <GPUFEED_DEAD_STREAM>:{T}       gpufeed:dead:{s0-0}

Shard i of N has the tag `s<i>-<k>`, with the smallest k >= 0 whose slot falls in the i-th
N-th of the 16384 slots: on a cluster whose masters each own an equal run of slots (what
`redis-cli --cluster create` makes), N shards for N masters land on N different masters.
A job with its own id goes to shard `crc32(id) % N` (zlib's CRC-32 of the UTF-8 bytes, which
every language has), so its result is found from the id alone.

With one shard (the default) the keys are the configured names, unchanged.

This module is torch-free and small: producers and workers both import it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import NoPermissionError

from producer import wire
from producer.priorities import level_stream

SLOTS = 16384
MAX_SHARDS = 256
CLUSTER_MODES = ("auto", "on", "off")


class ShardLayoutError(ValueError):
    """The key names cannot be laid out for the asked shards (one line, for the operator)."""


def hash_tag(key: str) -> str | None:
    """The hash tag Redis Cluster hashes `key` by: what lies between the first `{` and the
    next `}`, when that is not empty; None when the whole key is hashed."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


@lru_cache(maxsize=1024)
def shard_tag(index: int, shards: int) -> str:
    """The hash tag of shard `index` of `shards`."""
    low, high = index * SLOTS // shards, (index + 1) * SLOTS // shards
    k = 0
    while True:
        tag = f"s{index}-{k}"
        if low <= slot_of(tag) < high:
            return tag
        k += 1


def shard_of_id(job_id: str, shards: int) -> int:
    """The shard a job with its own id goes to (and where its result is found)."""
    if shards <= 1:
        return 0
    return zlib.crc32(job_id.encode("utf-8")) % shards


@dataclass(frozen=True)
class Shard:
    """One shard's keys. `tag` is "" for the unsharded layout (the names as configured)."""

    index: int
    tag: str
    stream: str
    results_stream: str
    result_prefix: str
    dead_stream: str
    # "" for the operator's own keys; else the tenant these keys are (producer/tenants.py).
    tenant: str = ""

    def result_key(self, job_id: str) -> str:
        return wire.result_key(job_id, self.result_prefix)

    def reply_stream(self, reply_to: str) -> str:
        """A client's own reply stream placed in this shard's slot: `:{T}` appended to a
        name that has no hash tag; a tagged name is left as it is (the worker refuses it,
        with `invalid_job`, when its tag is not this shard's slot)."""
        if not self.tag or hash_tag(reply_to) is not None:
            return reply_to
        return f"{reply_to}:{{{self.tag}}}"


def layout(
    shards: int,
    *,
    stream: str = wire.DEFAULT_STREAM,
    results_stream: str = wire.DEFAULT_RESULTS_STREAM,
    result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
    dead_stream: str = wire.DEFAULT_DEAD_STREAM,
) -> list[Shard]:
    """The keys of every shard; raises ShardLayoutError for names that cannot be sharded."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ShardLayoutError(f"GPUFEED_SHARDS: must be between 1 and {MAX_SHARDS}")
    names = {
        "GPUFEED_STREAM": stream,
        "GPUFEED_RESULTS_STREAM": results_stream,
        "GPUFEED_RESULT_PREFIX": result_prefix,
        "GPUFEED_DEAD_STREAM": dead_stream,
    }
    if shards == 1:
        return [Shard(0, "", stream, results_stream, result_prefix, dead_stream)]
    for var, name in names.items():
        if "{" in name or "}" in name:
            raise ShardLayoutError(
                f"{var}: {name!r} must not contain '{{' or '}}' with GPUFEED_SHARDS={shards} "
                "(each shard adds its own hash tag)"
            )
    out = []
    for i in range(shards):
        tag = shard_tag(i, shards)
        out.append(
            Shard(
                index=i,
                tag=tag,
                stream=f"{stream}:{{{tag}}}",
                results_stream=f"{results_stream}:{{{tag}}}",
                result_prefix=f"{result_prefix}{{{tag}}}:",
                dead_stream=f"{dead_stream}:{{{tag}}}",
            )
        )
    return out


def owned_keys(layout_: Sequence[Shard], levels: Sequence[str]) -> list[str]:
    """Every fixed key gpufeed writes for `layout_`: each shard's job stream and its level
    streams, results stream and dead-letter stream. (Heartbeats are a family of keys under
    wire.DEFAULT_WORKER_PREFIX; result hashes a family under each shard's result prefix.)"""
    keys: list[str] = []
    for shard in layout_:
        keys.append(shard.stream)
        keys += [level_stream(shard.stream, level) for level in levels]
        keys += [shard.results_stream, shard.dead_stream]
    return keys


def result_prefix_problem(
    layout_: Sequence[Shard],
    levels: Sequence[str],
    families: Iterable[str] = (wire.DEFAULT_WORKER_PREFIX,),
) -> str | None:
    """Why a job id could put a result hash over a key gpufeed owns with this layout (its
    result key is the shard's result prefix followed by the id: a prefix that starts any
    owned key lets the id name that key); None when no id can.

    `families` are key prefixes of which gpufeed owns every key (heartbeats): a result
    prefix must neither start one nor lie under one."""
    keys = owned_keys(layout_, levels)
    for shard in layout_:
        prefix = shard.result_prefix
        for key in keys:
            if key.startswith(prefix):
                return (
                    f"GPUFEED_RESULT_PREFIX: {prefix!r} is the start of gpufeed's own key "
                    f"{key!r}: a job with id {key[len(prefix) :]!r} would have its result "
                    f"written over it; use a prefix no gpufeed key starts with (the default "
                    f"is {wire.DEFAULT_RESULT_PREFIX!r})"
                )
        for family in families:
            if prefix.startswith(family) or family.startswith(prefix):
                return (
                    f"GPUFEED_RESULT_PREFIX: {prefix!r} overlaps gpufeed's own keys "
                    f"{family}*: a job id could name one of them; use a prefix no gpufeed "
                    f"key starts with (the default is {wire.DEFAULT_RESULT_PREFIX!r})"
                )
    return None


def hot_list_key(stream: str) -> str:
    """The fleet's hot list for workers reading `stream` (GPUFEED_STREAM): a sorted set
    (worker/delivery/hot_list.py)."""
    return f"{stream}:hot"


@dataclass(frozen=True)
class OwnedKeys:
    """The keys and key families gpufeed owns for one deployment, each with what it is: no
    job's reply_to may name one (it would turn the key into a stream of results), nor may a
    priority level's stream be one. Built by `own_keys`; the settings check and the writer
    both ask `what`, so the two cannot drift apart.

    A name is owned when it is one of `keys`, or starts with one of `families`, or starts
    with one of `spaces` without being a reply stream of gpufeed's: one of `replies` or a
    name under one followed by ':' (the batch client's own streams, a tenant's results)."""

    keys: dict[str, str]
    families: dict[str, str]
    spaces: dict[str, str]
    replies: tuple[str, ...] = ()

    def what(self, name: str) -> str | None:
        """What `name` is of gpufeed's (e.g. "the fleet's hot list"); None: not gpufeed's."""
        what = self.keys.get(name)
        if what is not None:
            return what
        for prefix, what in self.families.items():
            if name.startswith(prefix):
                return what
        if any(name == r or name.startswith(r + ":") for r in self.replies):
            return None
        for prefix, what in self.spaces.items():
            if name.startswith(prefix):
                return what
        return None

    def problem(self, name: str) -> str | None:
        """`name` is gpufeed's own key, in one line; None when it is not."""
        what = self.what(name)
        return None if what is None else f"{name!r} is one of gpufeed's own keys ({what})"

    def rows(self) -> list[tuple[str, str, str]]:
        """The rule as plain rows (kind, name, what), for a process of the worker's."""
        return [
            *(("key", k, w) for k, w in self.keys.items()),
            *(("family", k, w) for k, w in self.families.items()),
            *(("space", k, w) for k, w in self.spaces.items()),
            *(("reply", k, "") for k in self.replies),
        ]

    @classmethod
    def of_rows(cls, rows: Iterable[Sequence[str]]) -> OwnedKeys:
        parts: dict[str, dict[str, str]] = {"key": {}, "family": {}, "space": {}, "reply": {}}
        for kind, name, what in rows:
            parts[kind][name] = what
        return cls(parts["key"], parts["family"], parts["space"], tuple(parts["reply"]))


def own_keys(
    stream: str,
    layout_: Sequence[Shard],
    levels: Sequence[str],
    *,
    extra_keys: Iterable[str] = (),
    extra_families: Iterable[str] = (),
    job_space: bool = True,
) -> OwnedKeys:
    """Every key and key family gpufeed owns with GPUFEED_STREAM `stream` laid out as
    `layout_` with `levels`: the job streams (each shard's, each level's), the fleet's hot
    list, the dead-letter streams, the workers' heartbeats, the result hashes, and, with
    `job_space`, every name under `<stream>:` (shards, levels, tenants' streams, the hot
    list, and what comes next there) that is not under a results stream. `extra_keys` and
    `extra_families` add names or prefixes of keys owned elsewhere (a tenant's streams).
    The results streams are not owned: they are the default reply streams."""
    keys: dict[str, str] = {stream: "the job stream"}
    for shard in layout_:
        keys.setdefault(shard.stream, f"shard {shard.index}'s job stream")
        for level in levels:
            keys.setdefault(level_stream(shard.stream, level), f"priority level {level}'s stream")
    keys.setdefault(hot_list_key(stream), "the fleet's hot list, a sorted set")
    for shard in layout_:
        keys.setdefault(shard.dead_stream, "the dead-letter stream")
    for name in extra_keys:
        keys.setdefault(name, "a job stream")
    families = {wire.DEFAULT_WORKER_PREFIX: "the workers' heartbeats"}
    for shard in layout_:
        # The name before the shard's hash tag too: tenants' result hashes lie under it.
        base = shard.result_prefix.removesuffix(f"{{{shard.tag}}}:") if shard.tag else ""
        for prefix in (base, shard.result_prefix):
            if prefix:
                families.setdefault(prefix, "the result hashes")
    for prefix in extra_families:
        families.setdefault(prefix, "job streams")
    spaces = {f"{stream}:": f"a name under the job stream's, {stream}:*"} if job_space else {}
    # Each shard's results stream, and the name they share before the shard's hash tag.
    replies: dict[str, None] = {}
    for shard in layout_:
        replies[shard.results_stream] = None
        if shard.tag:
            replies[shard.results_stream.removesuffix(f":{{{shard.tag}}}")] = None
    return OwnedKeys(keys, families, spaces, tuple(replies))


def own_key_problem(
    name: str,
    stream: str,
    layout_: Sequence[Shard],
    levels: Sequence[str],
    *,
    extra_keys: Iterable[str] = (),
    extra_families: Iterable[str] = (),
) -> str | None:
    """Why `name` may not be written as a stream of results: it is one of gpufeed's own
    keys (see `own_keys`); None when it is not."""
    owned = own_keys(stream, layout_, levels, extra_keys=extra_keys, extra_families=extra_families)
    return owned.problem(name)


def check_one_slot(
    *, stream: str, results_stream: str, result_prefix: str, dead_stream: str
) -> None:
    """On a cluster with one shard, the names must share a hash tag (the publish script
    touches all of them at once); raises ShardLayoutError otherwise."""
    names = {
        "GPUFEED_STREAM": stream,
        "GPUFEED_RESULTS_STREAM": results_stream,
        "GPUFEED_RESULT_PREFIX": result_prefix,
        "GPUFEED_DEAD_STREAM": dead_stream,
    }
    tags = {var: hash_tag(name) for var, name in names.items()}
    if None in tags.values() or len(set(tags.values())) > 1:
        listed = ", ".join(f"{var}={names[var]!r}" for var in names)
        raise ShardLayoutError(
            "on Redis Cluster with GPUFEED_SHARDS=1 the four key names must share one hash "
            f"tag, e.g. {{gpufeed}}:jobs ({listed}); or set GPUFEED_SHARDS to the number "
            "of masters and leave the braces out"
        )


def check_cluster_mode(mode: str) -> None:
    if mode not in CLUSTER_MODES:
        raise ShardLayoutError(
            f"GPUFEED_REDIS_CLUSTER: must be one of {', '.join(CLUSTER_MODES)} (got {mode!r})"
        )


def is_cluster(url: str, mode: str) -> bool:
    """Whether `url` names a Redis Cluster node: asked once (INFO cluster) when `mode` is
    auto; Redis errors propagate."""
    if mode != "auto":
        return mode == "on"
    client = redis.Redis.from_url(url)
    try:
        return _enabled(client.info("cluster"))
    except NoPermissionError:
        # An ACL user without INFO: a single Redis unless told otherwise (mode "on").
        return False
    finally:
        client.close()


async def is_cluster_async(url: str, mode: str) -> bool:
    if mode != "auto":
        return mode == "on"
    client = aioredis.Redis.from_url(url)
    try:
        return _enabled(await client.info("cluster"))
    except NoPermissionError:
        return False
    finally:
        await client.aclose()


async def connect_async(url: str, mode: str = "auto", **kwargs: Any) -> aioredis.Redis:
    """A client for `url`: redis-py's cluster client when it names a cluster node (it takes
    the same commands, each routed to its key's slot), else a plain one."""
    if await is_cluster_async(url, mode):
        return cast(aioredis.Redis, aioredis.RedisCluster.from_url(url, **kwargs))
    return aioredis.Redis.from_url(url, **kwargs)


def _enabled(info: dict[str, object]) -> bool:
    return str(info.get("cluster_enabled", 0)) == "1"
