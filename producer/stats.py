"""A snapshot of a gpufeed deployment as Redis sees it: backlog, group, consumers, workers.

Everything is read with O(1) or cursor-based commands (XLEN, XINFO, SCAN, never KEYS), so
it is safe to run against a busy production Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import redis
from redis.exceptions import NoPermissionError

from producer import wire
from producer.priorities import level_stream, parse_levels
from producer.shards import Shard

_SNAPSHOT_FIELD = "snapshot"


def _text(value: Any) -> Any:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _glob_escape(prefix: str) -> str:
    # SCAN MATCH is a glob: a prefix such as "{gpufeed}:worker:" must match literally.
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


def _stream_length(client: redis.Redis, key: str) -> dict[str, Any]:
    try:
        kind = _text(client.type(key))
    except NoPermissionError:
        # A tenant's user sees only its own keys (the dead letters are the operator's).
        return {"name": key, "exists": None, "length": None, "error": "not visible to this user"}
    if kind == "none":
        return {"name": key, "exists": False, "length": 0}
    if kind != "stream":
        return {"name": key, "exists": True, "length": None, "error": f"key holds a {kind}"}
    return {"name": key, "exists": True, "length": client.xlen(key)}


def _group(client: redis.Redis, stream: str, group: str) -> dict[str, Any] | None:
    for info in client.xinfo_groups(stream):
        if _text(info.get("name")) != group:
            continue
        return {
            "name": group,
            "consumers": info.get("consumers"),
            "pending": info.get("pending"),
            "last_delivered_id": _text(info.get("last-delivered-id")),
            # Redis < 7 has neither; Redis 7 reports lag as nil when it cannot compute it
            # (e.g. after XDEL): that is "unknown", not "caught up".
            "entries_read": info.get("entries-read"),
            "lag": info.get("lag"),
        }
    return None


def _consumers(client: redis.Redis, stream: str, group: str) -> list[dict[str, Any]]:
    out = []
    for info in client.xinfo_consumers(stream, group):
        row = {"name": _text(info.get("name")), "pending": info.get("pending")}
        row["idle_ms"] = info.get("idle")
        if "inactive" in info:  # Redis >= 7.2
            row["inactive_ms"] = info.get("inactive")
        out.append(row)
    return out


def _decode_worker_field(name: str, value: bytes) -> Any:
    if name == _SNAPSHOT_FIELD:
        try:
            return msgpack.unpackb(value, raw=False)
        except (ValueError, msgpack.ExtraData):
            pass
    return _text(value)


def _workers(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    keys = sorted(_text(k) for k in client.scan_iter(match=_glob_escape(prefix) + "*", count=500))
    if not keys:
        return []
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        kinds = [_text(k) for k in pipe.execute()]
    hashes = [k for k, kind in zip(keys, kinds, strict=True) if kind == "hash"]
    with client.pipeline(transaction=False) as pipe:
        for key in hashes:
            pipe.hgetall(key)
        replies = pipe.execute()
    workers = []
    for key, reply in zip(hashes, replies, strict=True):
        # A worker that exited between SCAN and HGETALL leaves an empty reply: skip it.
        if reply:
            fields = {_text(f): _decode_worker_field(_text(f), v) for f, v in reply.items()}
            workers.append({"key": key, "name": key[len(prefix) :], "fields": fields})
    return workers


def collect_stats(
    client: redis.Redis,
    stream: str = wire.DEFAULT_STREAM,
    group: str = wire.DEFAULT_GROUP,
    results_stream: str = wire.DEFAULT_RESULTS_STREAM,
    *,
    dead_stream: str = wire.DEFAULT_DEAD_STREAM,
    worker_prefix: str = wire.DEFAULT_WORKER_PREFIX,
    priorities: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """A JSON-serialisable snapshot. A missing stream reports `exists: False` and length 0;
    a missing group reports `group: None` and no consumers; an unknown lag is None.

    With `priorities` (GPUFEED_PRIORITIES), `levels` lists each level's stream, group and
    consumers, highest first; `stream`, `group` and `consumers` still describe the plain
    `stream`, which workers do not read while there are levels. Without, `levels` is []."""
    snapshot = _backlog(client, stream, group)
    snapshot["levels"] = [
        {"level": level, **_backlog(client, level_stream(stream, level), group)}
        for level in parse_levels(priorities)
    ]
    snapshot["results_stream"] = _stream_length(client, results_stream)
    snapshot["dead_stream"] = _stream_length(client, dead_stream)
    try:
        snapshot["workers"] = _workers(client, worker_prefix)
    except NoPermissionError:
        # A tenant's user may not list keys (SCAN would show other tenants' key names):
        # the workers are not seen from here, which is not "none".
        snapshot["workers"] = []
        snapshot["workers_hidden"] = True
    return snapshot


def _backlog(client: redis.Redis, stream: str, group: str) -> dict[str, Any]:
    jobs = _stream_length(client, stream)
    group_info = (
        _group(client, stream, group) if jobs["length"] is not None and jobs["exists"] else None
    )
    return {
        "stream": jobs,
        "group": group_info,
        "consumers": _consumers(client, stream, group) if group_info else [],
    }


def tenant_backlogs(
    client: redis.Redis,
    layouts: Sequence[Sequence[Shard]],
    group: str = wire.DEFAULT_GROUP,
    priorities: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per tenant's job stream (each shard's, each level's): its length, the
    group's lag and pending count, and its consumers: what an operator reads to see which
    tenant's backlog grows (producer/tenants.py)."""
    levels = parse_levels(priorities) or [""]
    rows = []
    for layout in layouts:
        for shard in layout:
            for level in levels:
                stream = level_stream(shard.stream, level)
                backlog = _backlog(client, stream, group)
                g = backlog["group"]
                rows.append(
                    {
                        "tenant": shard.tenant,
                        "level": level,
                        "stream": stream,
                        "length": backlog["stream"]["length"],
                        "lag": None if g is None else g["lag"],
                        "pending": None if g is None else g["pending"],
                        "consumers": None if g is None else g["consumers"],
                    }
                )
    return rows
