"""What /live and /ready answer, and the HTTP server that answers them.

Both endpoints are served from their own thread, so they answer whatever the event loop
does; that is why they must not simply say 200. They read state that the worker keeps up
to date:

- **/live** fails when the worker stopped making progress and only a restart helps: the
  event loop has not run its beat task for LIVE_LOOP_STALL_S, or the launch thread has held
  one batch, or a launched batch has not finished on the device, for LIVE_LAUNCH_STALL_S,
  or the result writer has held answers it could not publish for LIVE_WRITER_STALL_S
  (logged once with the reason when it passes); the three are tuning constants
  (worker/config/tuning.py). During
  start-up (model download, compilation) nothing is checked yet: the start-up probe on
  /ready bounds that.
- **/ready** fails while the model is warming up, while Redis does not answer a PING (away,
  or refusing everyone for now: BUSY while a script runs past busy-reply-threshold,
  LOADING, a failover; the worker waits those out and never exits for them), and from the
  first SIGTERM on (draining), so a load balancer or an operator stops counting on this
  worker. `gpufeed_ready` says the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from worker.config import table
from worker.delivery import redis_errors
from worker.observe.metrics import WorkerMetrics

log = structlog.get_logger("gpufeed.health")

REDIS_PROBE_INTERVAL_S = 1.0
REDIS_PROBE_TIMEOUT_S = 2.0


def _limit(name: str, seconds: float) -> str:
    # A reason names the constant, not a variable: the worker refuses the old ones.
    return f"limit {seconds:g} s: {table.given(name, seconds)}"


class _Done(Protocol):
    def query(self) -> bool: ...


class _Seq(Protocol):
    @property
    def seq(self) -> int: ...


class LaunchedBatch(Protocol):
    """The part of worker.pipeline.launch.Launched the liveness check reads."""

    @property
    def batch(self) -> _Seq: ...
    @property
    def done(self) -> _Done: ...
    @property
    def launched_s(self) -> float: ...


class Health:
    """Liveness and readiness state; written on the event loop, read on the HTTP thread."""

    def __init__(
        self, *, loop_stall_s: float, launch_stall_s: float, writer_stall_s: float = 0.0
    ) -> None:
        self.loop_stall_s = loop_stall_s
        self.launch_stall_s = launch_stall_s
        self.writer_stall_s = writer_stall_s
        # How long the result writer has held answers it cannot publish, and why.
        self._writer_stalled: Callable[[], tuple[float, str]] = lambda: (0.0, "")
        self._writer_stall_logged = False
        self.warm = False  # the model is warm and the worker reads from the group
        self.draining = False
        self.redis_ok = True
        self._redis_why = "redis unreachable"  # /ready's reason while redis_ok is False
        # Monotonic time of the event loop's latest beat; None until the main loop runs.
        self._loop_beat_s: float | None = None
        self._launch_started: Callable[[], float | None] = lambda: None
        self._device: Any = None  # torch.device of the launches (None: not watched yet)
        # The latest launches: at most one per output slot can still be on the device, so a
        # deque of that length holds every unfinished one.
        self._launched: deque[LaunchedBatch] = deque(maxlen=1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ fed by the worker
    def watch_launches(
        self, started: Callable[[], float | None], slots: int, device: Any = None
    ) -> None:
        """`started` returns when the launch thread took its current batch (None: idle);
        `slots` is the number of batches that can be on the device at once; `device` (a
        torch.device) the one the batches run on."""
        self._launch_started = started
        self._device = device
        with self._lock:
            self._launched = deque(self._launched, maxlen=max(1, slots))

    def watch_writer(self, stalled: Callable[[], tuple[float, str]]) -> None:
        """`stalled` returns how long the writer has held answers it could not publish
        (0: none) and why."""
        self._writer_stalled = stalled

    def launched(self, launched: LaunchedBatch) -> None:
        with self._lock:
            self._launched.append(launched)

    async def beat(self) -> None:
        """Prove, several times per bound, that the event loop runs its tasks."""
        interval = min(1.0, self.loop_stall_s / 4) if self.loop_stall_s else 1.0
        while True:
            self._loop_beat_s = time.monotonic()
            self._log_writer_stall()
            await asyncio.sleep(interval)

    def _log_writer_stall(self) -> None:
        """Say once per stall, when it passes the bound, why /live now fails."""
        ok, reason = self._writer_live()
        if not ok and not self._writer_stall_logged:
            log.error("not_live", reason=reason, note="an orchestrator should restart the worker")
        self._writer_stall_logged = not ok

    def _writer_live(self) -> tuple[bool, str]:
        if not self.writer_stall_s:
            return True, "live"
        held_s, why = self._writer_stalled()
        if held_s > self.writer_stall_s:
            return False, (
                f"result writer stalled: answers unpublished for {held_s:.1f} s ({why}) "
                f"({_limit('live_writer_stall_s', self.writer_stall_s)})"
            )
        return True, "live"

    async def probe_redis(self, client: aioredis.Redis) -> None:
        """PING Redis every second; /ready fails while it does not answer."""
        while True:
            try:
                await asyncio.wait_for(client.ping(), REDIS_PROBE_TIMEOUT_S)
                ok, error = True, ""
            except redis_errors.ANY as exc:
                ok, error = False, str(exc) or type(exc).__name__
                # A refusal that passes is named: an operator looks for the script (SCRIPT
                # KILL) or the failover, not for the network.
                self._redis_why = (
                    f"redis busy ({redis_errors.error_code(exc)})"
                    if redis_errors.temporary(exc)
                    else "redis unreachable"
                )
            if ok != self.redis_ok:
                if ok:
                    log.info("ready_again", note="Redis answers again")
                else:
                    log.warning("not_ready", reason=self._redis_why, error=error)
                self.redis_ok = ok
            await asyncio.sleep(REDIS_PROBE_INTERVAL_S)

    # ------------------------------------------------------------------ answers
    def ready(self) -> tuple[bool, str]:
        if not self.warm:
            return False, "warming up"
        if self.draining:
            return False, "draining"
        if not self.redis_ok:
            return False, self._redis_why
        return True, "ready"

    def live(self) -> tuple[bool, str]:
        now = time.monotonic()
        beat = self._loop_beat_s
        if self.loop_stall_s and beat is not None and now - beat > self.loop_stall_s:
            return False, (
                f"event loop stalled: no beat for {now - beat:.1f} s "
                f"({_limit('live_loop_stall_s', self.loop_stall_s)})"
            )
        writer = self._writer_live()
        if not writer[0]:
            return writer
        if not self.launch_stall_s:
            return True, "live"
        started = self._launch_started()
        if started is not None and now - started > self.launch_stall_s:
            return False, (
                f"launch thread stuck: one batch for {now - started:.1f} s "
                f"({_limit('live_launch_stall_s', self.launch_stall_s)})"
            )
        with self._lock:
            launched = list(self._launched)
        stale = [item for item in launched if now - item.launched_s > self.launch_stall_s]
        if not stale:
            return True, "live"
        # query() never blocks, also from this thread; under the worker's device, or this
        # thread's first CUDA call would create a context on GPU 0 for a worker on cuda:N.
        with self._device_guard():
            for item in stale:
                if not item.done.query():
                    return False, (
                        f"batch {item.batch.seq} unfinished on the device after "
                        f"{now - item.launched_s:.1f} s "
                        f"({_limit('live_launch_stall_s', self.launch_stall_s)})"
                    )
        return True, "live"

    def _device_guard(self) -> contextlib.AbstractContextManager[Any]:
        device = self._device
        if device is None or getattr(device, "type", None) != "cuda":
            return contextlib.nullcontext()
        # The worker has torch loaded; health.py itself stays torch-free.
        import torch  # noqa: PLC0415

        return torch.cuda.device(device)


# How long a client has to send its request line and headers, and then to take the answer.
REQUEST_TIMEOUT_S = 5.0
# Connections that have not sent a whole request yet. A new one past this closes the oldest
# of them: a probe sends its request at once, so idle or trickling clients cannot crowd it
# out, and they cannot hold more sockets than this.
MAX_WAITING = 32
# All connections at once (waiting, or taking an answer); past it a new one is closed.
MAX_CONNECTIONS = 64
# Request line and headers; a probe's or a scrape's are a few hundred bytes.
MAX_HEAD_BYTES = 8192


class HealthServer:
    """/metrics (Prometheus), /live and /ready, served by an event loop on a thread of its
    own (never the worker's loop: the endpoints must answer whatever it does), bound to
    `host` (GPUFEED_METRICS_HOST, loopback by default).

    One thread whatever the number of clients; a connection that sends nothing is closed
    after REQUEST_TIMEOUT_S, or sooner when newer connections need its place."""

    def __init__(
        self, port: int, metrics: WorkerMetrics, health: Health, host: str = "127.0.0.1"
    ) -> None:
        self._metrics = metrics
        self._health = health
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound here, not in the thread: a taken port fails the caller at once.
        self._sock = socket.create_server((host, port), family=family)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        # Insertion-ordered: the oldest waiting connection first.
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[object]] = set()
        # Connections closed for want of room (evicted while waiting, or refused at once).
        self.shed = 0
        self._thread = threading.Thread(target=self._serve, name="gpufeed-metrics", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=5)
        else:
            self._sock.close()

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=MAX_HEAD_BYTES)
        async with server:
            await self._stopped.wait()
            # Close what is still open, and let each connection's task see it and end.
            for writer in list(self._writers):
                writer.transport.abort()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=1)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) >= MAX_WAITING:
            # The newcomer takes the place of the oldest connection that has not yet sent
            # its request; the evicted one stops counting at once (its own task ends
            # later), so a burst of idle connections never crowds out a probe behind it.
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            self._writers.discard(oldest)
            self.shed += 1
            oldest.transport.abort()
        if len(self._writers) >= MAX_CONNECTIONS:
            self.shed += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._writers.add(writer)
        self._tasks.add(task)
        try:
            self._waiting[writer] = None
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (
                asyncio.TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                OSError,
            ):
                return
            finally:
                self._waiting.pop(writer, None)
            if len(head) > MAX_HEAD_BYTES:
                return
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError):
            return
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            return _response(405, b"only GET /metrics, /live or /ready\n", head_only=False)
        path = parts[1].split(b"?", 1)[0]
        only_head = parts[0] == b"HEAD"
        if path == b"/metrics":
            return _response(200, self._metrics.render(), only_head, CONTENT_TYPE_LATEST)
        if path in (b"/live", b"/ready"):
            ok, reason = self._health.live() if path == b"/live" else self._health.ready()
            return _response(200 if ok else 503, f"{reason}\n".encode(), only_head)
        return _response(404, b"not found: try /metrics, /live or /ready\n", only_head)


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _response(
    code: int, body: bytes, head_only: bool, content_type: str = "text/plain; charset=utf-8"
) -> bytes:
    lines = (
        f"HTTP/1.1 {code} {_REASONS[code]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return lines.encode("latin-1") + (b"" if head_only else body)
