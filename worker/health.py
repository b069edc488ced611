"""What /live and /ready answer, and the HTTP server that answers them.

Both endpoints are served from their own thread, so they answer whatever the event loop
does; that is why they must not simply say 200. They read state that the worker keeps up
to date:

- **/live** fails when the worker stopped making progress and only a restart helps: the
  event loop has not run its beat task for GPUFEED_LIVE_LOOP_STALL_S, or the launch thread
  has held one batch, or a launched batch has not finished on the device, for
  GPUFEED_LIVE_LAUNCH_STALL_S. During start-up (model download, compilation) nothing is
  checked yet: the start-up probe on /ready bounds that.
- **/ready** fails while the model is warming up, while Redis does not answer a PING, and
  from the first SIGTERM on (draining), so a load balancer or an operator stops counting
  on this worker. `gpufeed_ready` says the same.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from worker.metrics import WorkerMetrics

log = structlog.get_logger("gpufeed.health")

REDIS_PROBE_INTERVAL_S = 1.0
REDIS_PROBE_TIMEOUT_S = 2.0


class _Done(Protocol):
    def query(self) -> bool: ...


class _Seq(Protocol):
    @property
    def seq(self) -> int: ...


class LaunchedBatch(Protocol):
    """The part of worker.runner.Launched the liveness check reads."""

    @property
    def batch(self) -> _Seq: ...
    @property
    def done(self) -> _Done: ...
    @property
    def launched_s(self) -> float: ...


class Health:
    """Liveness and readiness state; written on the event loop, read on the HTTP thread."""

    def __init__(self, *, loop_stall_s: float, launch_stall_s: float) -> None:
        self.loop_stall_s = loop_stall_s
        self.launch_stall_s = launch_stall_s
        self.warm = False  # the model is warm and the worker reads from the group
        self.draining = False
        self.redis_ok = True
        # Monotonic time of the event loop's latest beat; None until the main loop runs.
        self._loop_beat_s: float | None = None
        self._launch_started: Callable[[], float | None] = lambda: None
        # The latest launches: at most one per output slot can still be on the device, so a
        # deque of that length holds every unfinished one.
        self._launched: deque[LaunchedBatch] = deque(maxlen=1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ fed by the worker
    def watch_launches(self, started: Callable[[], float | None], slots: int) -> None:
        """`started` returns when the launch thread took its current batch (None: idle);
        `slots` is the number of batches that can be on the device at once."""
        self._launch_started = started
        with self._lock:
            self._launched = deque(self._launched, maxlen=max(1, slots))

    def launched(self, launched: LaunchedBatch) -> None:
        with self._lock:
            self._launched.append(launched)

    async def beat(self) -> None:
        """Prove, several times per bound, that the event loop runs its tasks."""
        interval = min(1.0, self.loop_stall_s / 4) if self.loop_stall_s else 1.0
        while True:
            self._loop_beat_s = time.monotonic()
            await asyncio.sleep(interval)

    async def probe_redis(self, client: aioredis.Redis) -> None:
        """PING Redis every second; /ready fails while it does not answer."""
        while True:
            try:
                await asyncio.wait_for(client.ping(), REDIS_PROBE_TIMEOUT_S)
                ok, error = True, ""
            except (RedisError, OSError, TimeoutError) as exc:
                ok, error = False, str(exc) or type(exc).__name__
            if ok != self.redis_ok:
                if ok:
                    log.info("ready_again", note="Redis answers again")
                else:
                    log.warning("not_ready", reason="redis unreachable", error=error)
                self.redis_ok = ok
            await asyncio.sleep(REDIS_PROBE_INTERVAL_S)

    # ------------------------------------------------------------------ answers
    def ready(self) -> tuple[bool, str]:
        if not self.warm:
            return False, "warming up"
        if self.draining:
            return False, "draining"
        if not self.redis_ok:
            return False, "redis unreachable"
        return True, "ready"

    def live(self) -> tuple[bool, str]:
        now = time.monotonic()
        beat = self._loop_beat_s
        if self.loop_stall_s and beat is not None and now - beat > self.loop_stall_s:
            return False, (
                f"event loop stalled: no beat for {now - beat:.1f} s "
                f"(GPUFEED_LIVE_LOOP_STALL_S={self.loop_stall_s:g})"
            )
        if not self.launch_stall_s:
            return True, "live"
        started = self._launch_started()
        if started is not None and now - started > self.launch_stall_s:
            return False, (
                f"launch thread stuck: one batch for {now - started:.1f} s "
                f"(GPUFEED_LIVE_LAUNCH_STALL_S={self.launch_stall_s:g})"
            )
        with self._lock:
            launched = list(self._launched)
        for item in launched:
            # query() never blocks, also from this thread.
            if now - item.launched_s > self.launch_stall_s and not item.done.query():
                return False, (
                    f"batch {item.batch.seq} unfinished on the device after "
                    f"{now - item.launched_s:.1f} s "
                    f"(GPUFEED_LIVE_LAUNCH_STALL_S={self.launch_stall_s:g})"
                )
        return True, "live"


class HealthServer:
    """/metrics (Prometheus), /live and /ready, on a thread of their own."""

    def __init__(
        self, port: int, metrics: WorkerMetrics, health: Health, host: str = "0.0.0.0"
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    outer._send(self, 200, metrics.render(), CONTENT_TYPE_LATEST)
                elif path in ("/live", "/ready"):
                    ok, reason = health.live() if path == "/live" else health.ready()
                    outer._send(self, 200 if ok else 503, f"{reason}\n".encode())
                else:
                    outer._send(self, 404, b"not found: try /metrics, /live or /ready\n")

            def log_message(self, format: str, *args: Any) -> None:
                # Scrapes every few seconds would drown the worker's own log.
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpufeed-metrics", daemon=True
        )

    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
