"""The Redis the end-to-end run uses: the configured one or a private one, and the cleanup
of every key the run made.

A REDIS_URL the operator named is the one measured, or none: a private redis-server in its
place would answer "why is production slow?" with a throwaway server's figures. Only with
REDIS_URL unset does a silent Redis mean a private one (the offline use)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from pathlib import Path

import redis

from producer.shards import connect_async
from worker.base.errors import EXIT_REDIS, GpufeedError
from worker.config.settings import DEFAULT_REDIS_URL, WorkerConfig, redact_url


class RedisNotAnswering(GpufeedError, RuntimeError):
    """The REDIS_URL the operator gave does not answer (one line, password redacted)."""

    exit_code = EXIT_REDIS


def url_given(config: WorkerConfig) -> bool:
    """REDIS_URL came from the operator (environment or --redis-url), not the default. A flag
    that repeats the default while the variable is unset cannot be told from it."""
    return config.redis_url != DEFAULT_REDIS_URL or bool(os.environ.get("REDIS_URL", "").strip())


def require_answer(url: str) -> None:
    """Raise RedisNotAnswering when `url` does not answer a PING within 2 s."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise RedisNotAnswering(
            f"doctor: REDIS_URL {redact_url(url)} does not answer ({exc}), and doctor measures "
            "the Redis it is given, not a stand-in; to measure on a private redis-server on "
            "purpose, leave REDIS_URL unset (`REDIS_URL= python -m worker doctor`)"
        ) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _glob_escape(text: str) -> str:
    # SCAN MATCH is a glob: the stream name must match literally.
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def cleanup(url: str, base: str, worker_name: str) -> None:
    """Delete every key the run made: its streams, result hashes and heartbeat."""
    from worker.observe.observer import heartbeat_key

    client = await connect_async(url, socket_connect_timeout=2)
    try:
        queue = f"{base}:queue"  # the queue ceiling's (worker/tools/harness/queue_ceiling.py)
        keys = [f"{base}:jobs", f"{base}:results", f"{base}:dead", heartbeat_key(worker_name)]
        keys += [f"{queue}:jobs", f"{queue}:results", f"{queue}:dead"]
        for prefix in (f"{base}:result:", f"{queue}:result:"):
            async for key in client.scan_iter(match=_glob_escape(prefix) + "*", count=500):
                keys.append(key)
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
    finally:
        await client.aclose()


def open_redis(url: str, stack: contextlib.ExitStack, reasons: list[str]) -> str | None:
    """The configured Redis if it answers, else a private redis-server (worker/tools/demo.py's
    helper, stopped when `stack` closes); None when neither can be had."""
    from worker.tools.demo import redis_for_demo

    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpufeed-doctor-")))
    try:
        # The helper says which Redis it uses on stdout; stdout is the report's.
        with contextlib.redirect_stdout(sys.stderr):
            return str(stack.enter_context(redis_for_demo(url, workdir)))
    except SystemExit as exc:  # no redis-server binary
        reasons.append(f"no Redis: {url} does not answer and {exc}")
    except (OSError, RuntimeError) as exc:
        reasons.append(f"no Redis: {type(exc).__name__}: {exc}")
    return None
