"""What the worker tells the outside world about itself, all of it off the hot path.

- Prometheus metrics and /live, /ready on GPUFEED_METRICS_PORT;
- a heartbeat hash `gpufeed:worker:<name>` (with a TTL), so `redis-cli`, `producer stats`
  and `worker top` see every live worker;
- one structured summary log line every STATS_INTERVAL_S (a tuning constant).

It is fed by the completion watcher and the result writer (both on the event loop, after
the GPU work is done) and by a sampler thread that reads NVML and psutil.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from prometheus_client import Counter

from worker.config.lanes import Lanes
from worker.delivery import redis_check, redis_errors
from worker.delivery.writer import PublishState
from worker.jobs import Job, Outcome
from worker.observe.gpu_sampler import GpuSampler
from worker.observe.health import Health, HealthServer
from worker.observe.metrics import STAGES, RateMeter, Rolling, WorkerMetrics
from worker.pipeline.launch import Launched

log = structlog.get_logger("gpufeed.observer")

# The key of a worker's heartbeat hash (callers have long imported it from here).
heartbeat_key = redis_check.heartbeat_key

HEARTBEAT_INTERVAL_S = 2.0

# The delivery event counted for a PublishState other than PUBLISHED (states below 0 not
# listed here count as "refused").
_EVENT_OF_STATE = {
    PublishState.NOT_OURS: "not_ours",
    PublishState.ALREADY_ANSWERED: "already_answered",
    PublishState.DUPLICATE_ID: "duplicate_id",
}


@dataclass
class Counters:
    started_s: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    results_ok: int = 0
    results_error: int = 0
    batches: int = 0
    real_rows: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    # Delivery events by name (worker.observe.metrics.DELIVERY_EVENTS), as exported in
    # gpufeed_delivery_events_total.
    events: dict[str, int] = field(default_factory=dict)

    @property
    def results(self) -> int:
        return self.results_ok + self.results_error


class Observer:
    def __init__(self, *, worker_name: str, batch_size: int, stats_interval_s: float) -> None:
        self.worker_name = worker_name
        self.batch_size = batch_size
        self.stats_interval_s = stats_interval_s
        self.counters = Counters()
        self.metrics = WorkerMetrics()
        self.latency_ms = Rolling()
        self.stage_ms = {stage: Rolling(1024) for stage in STAGES}
        self.gpu_ms = Rolling(256)
        self.fill = Rolling(256)
        self.rate = RateMeter()
        self.sampler: GpuSampler | None = None
        self.http: HealthServer | None = None
        self._info: dict[str, Any] = {}
        self.lag: int | None = None
        self.pending: int | None = None
        # Returns problems that appeared since start-up (graph breaks, recompiles...).
        self.compile_check: Callable[[], list[str]] = list
        self._compile_problems: list[str] = []
        # Labelled children, looked up once.
        self._results_ok = self.metrics.results.labels("ok", "")
        self._results_error: dict[str, Counter] = {}
        self._events: dict[str, Counter] = {}

    # ------------------------------------------------------------------ set-up
    def serve_http(self, port: int, health: Health, host: str = "127.0.0.1") -> None:
        """Start /metrics, /live, /ready (before the model loads: /live must answer during a
        long warm-up, and /ready says 503 until the worker reads)."""
        self.metrics.ready.set_function(lambda: 1.0 if health.ready()[0] else 0.0)
        if port:
            self.http = HealthServer(port, self.metrics, health, host=host).start()
            log.info("metrics_listening", host=host, port=self.http.port)

    @property
    def info(self) -> dict[str, Any]:
        """What this worker serves (model, weights, device...): in the heartbeat, and as the
        labels of gpufeed_worker_info."""
        return self._info

    @info.setter
    def info(self, info: dict[str, Any]) -> None:
        self._info = info
        self.metrics.worker_info.info(
            {"worker": self.worker_name, **{k: str(v) for k, v in info.items()}}
        )

    def start_sampler(self, device_index: int | None) -> None:
        self.sampler = GpuSampler(
            device_index if device_index is not None else 0, interval_s=1.0, max_samples=120
        )
        if device_index is None:
            self.sampler.available = False
            self.sampler.reason = "CPU device: no GPU to sample"
        self.sampler.start()

    def watch(self, **gauges: Callable[[], float]) -> None:
        """Queue depths and the in-flight count, read at scrape time."""
        for name, fn in gauges.items():
            if name == "in_flight":
                self.metrics.in_flight.set_function(fn)
            else:
                self.metrics.queue_depth.labels(name).set_function(fn)

    # ------------------------------------------------------------------ feeding
    def batch_done(self, launched: Launched, gpu_ms: float) -> None:
        real = len(launched.batch.valid_rows)
        fill = launched.batch.fill_ratio(self.batch_size)
        c = self.counters
        c.batches += 1
        c.real_rows += real
        m = self.metrics
        # The rows the step ran: the batch shape it ran on, padding past its real rows.
        size = launched.size or self.batch_size
        m.batches.labels(str(size)).inc()
        m.rows.labels("real").inc(real)
        m.rows.labels("padding").inc(size - real)
        m.batch_fill.observe(fill)
        m.batch_gpu_seconds.observe(gpu_ms / 1000)
        self.gpu_ms.add(gpu_ms)
        self.fill.add(fill)
        hits = sum(1 for r in launched.batch.results if r.error is None and r.cached)
        c.cache_hits += hits
        c.cache_misses += real - hits
        m.decode_cache.labels("hit").inc(hits)
        m.decode_cache.labels("miss").inc(real - hits)

    def published(self, outcomes: list[Outcome], states: list[int]) -> None:
        """Count a flush's published outcomes: tallied here, then each counter incremented
        once per label set (the labelled children cached) and each histogram fed the
        flush's values in one call."""
        c = self.counters
        now_ms = time.time() * 1000
        ok = 0
        errors: dict[str, int] = {}
        events: dict[str, int] = {}
        jobs: list[Job] = []
        for outcome, state in zip(outcomes, states, strict=True):
            if state != PublishState.PUBLISHED:
                event = _EVENT_OF_STATE.get(state)
                if event is None and state < 0:
                    # The keys were unusable: nothing was written, the job stays pending.
                    event = "refused"
                if event is not None:
                    events[event] = events.get(event, 0) + 1
                if state != PublishState.DUPLICATE_ID:
                    continue
            jobs.append(outcome.job)
            if outcome.ok:
                ok += 1
            else:
                code = outcome.error_code.value if outcome.error_code else "unknown"
                errors[code] = errors.get(code, 0) + 1
        # Each stage's values gathered by one comprehension over the flush, not per job.
        timings = [job.timings_ms for job in jobs]
        stage_values = {
            stage: [v for t in timings if (v := t.get(stage)) is not None] for stage in STAGES
        }
        latencies = [max(0.0, now_ms - e) for job in jobs if (e := job.enqueued_ms)]
        for event, count in events.items():
            self.delivery_event(event, count)
        if ok:
            c.results_ok += ok
            self._results_ok.inc(ok)
        for code, count in errors.items():
            c.results_error += count
            c.errors_by_code[code] = c.errors_by_code.get(code, 0) + count
            self._child(self._results_error, code, self.metrics.results, "error", code).inc(count)
        self.metrics.stage_seconds.observe_series(stage_values, scale=1 / 1000)
        for stage, values in stage_values.items():
            if values:
                self.stage_ms[stage].extend(values)
        if latencies:
            self.metrics.job_seconds.observe_series({"": latencies}, scale=1 / 1000)
            self.latency_ms.extend(latencies)

    def delivery_event(self, event: str, count: int = 1) -> None:
        """Count `count` occurrences of a delivery event (one of
        worker.observe.metrics.DELIVERY_EVENTS)."""
        if count:
            events = self.counters.events
            events[event] = events.get(event, 0) + count
            self._child(self._events, event, self.metrics.events, event).inc(count)

    @staticmethod
    def _child(cache: dict[str, Counter], key: str, metric: Counter, *labels: str) -> Counter:
        """The labelled child of `metric`, looked up once (.labels() costs a lock and a
        dict look-up per call)."""
        child = cache.get(key)
        if child is None:
            child = cache[key] = metric.labels(*labels)
        return child

    # ------------------------------------------------------------------ reporting
    def snapshot(self, in_flight: int) -> dict[str, Any]:
        c = self.counters
        p50, p99 = self.latency_ms.percentiles(50, 99)
        sample = self._latest_sample()
        return {
            **self.info,
            "name": self.worker_name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - c.started_s, 1),
            "started_at": int(c.started_wall),
            "results_ok": c.results_ok,
            "results_error": c.results_error,
            "duplicates": c.events.get("duplicate_id", 0),
            "delivery_events": dict(c.events),
            "jobs_per_s": round(self.rate.rate, 2),
            "p50_ms": p50,
            "p99_ms": p99,
            "batches": c.batches,
            "batch_fill": self.fill.mean(),
            "cache_hit_ratio": round(c.cache_hits / (c.cache_hits + c.cache_misses), 3)
            if c.cache_hits + c.cache_misses
            else None,
            "gpu_ms_per_batch": self.gpu_ms.mean(),
            "in_flight": in_flight,
            "stage_ms": {s: self.stage_ms[s].mean() for s in STAGES},
            "errors_by_code": dict(c.errors_by_code),
            "gpu_util_pct": sample.get("gpu_util_pct"),
            "mem_bw_util_pct": sample.get("mem_bw_util_pct"),
            "mem_used_mib": sample.get("mem_used_mib"),
            "process_cpu_pct": sample.get("process_cpu_pct"),
            "system_cpu_pct": sample.get("system_cpu_pct"),
            "stream_lag": self.lag,
            "stream_pending": self.pending,
        }

    def _latest_sample(self) -> dict[str, float]:
        if self.sampler is None:
            return {}
        samples = self.sampler.samples()
        return samples[-1] if samples else {}

    async def run(
        self,
        client: aioredis.Redis,
        *,
        key: str,
        lanes: Lanes,
        group: str,
        in_flight: Callable[[], int],
    ) -> None:
        """Heartbeat every few seconds, a log line every stats interval."""
        next_log = time.monotonic() + self.stats_interval_s
        outage = False
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            self.rate.update(self.counters.results)
            for metric, value in self._latest_sample().items():
                if metric != "t":
                    self.metrics.gpu.labels(metric).set(value)
            try:
                self.lag, self.pending = await self._backlog(client, lanes, group)
                self.metrics.stream_lag.set(-1 if self.lag is None else self.lag)
                if self.pending is not None:
                    self.metrics.stream_pending.set(self.pending)
                snap = self.snapshot(in_flight())
                await write_heartbeat(client, key, snap, ttl_s=int(HEARTBEAT_INTERVAL_S * 5))
                outage = False
            except redis_errors.ANY as exc:
                if not outage:
                    log.warning("heartbeat_failed", error=str(exc))
                    outage = True
            problems = self.compile_check()
            if problems and problems != self._compile_problems:
                log.error(
                    "compile_degraded",
                    problems=problems,
                    note="the step is no longer one compiled graph; see the start-up "
                    "compile report and GPUFEED_COMPILE",
                )
            self._compile_problems = problems
            if time.monotonic() >= next_log:
                next_log += self.stats_interval_s
                snap = self.snapshot(in_flight())
                log.info(
                    "stats",
                    jobs_per_s=snap["jobs_per_s"],
                    results_ok=snap["results_ok"],
                    results_error=snap["results_error"],
                    p50_ms=snap["p50_ms"],
                    p99_ms=snap["p99_ms"],
                    batch_fill=snap["batch_fill"],
                    in_flight=snap["in_flight"],
                    stage_ms=snap["stage_ms"],
                    gpu_util_pct=snap["gpu_util_pct"],
                    cpu_pct=snap["process_cpu_pct"],
                    lag="unknown" if self.lag is None else self.lag,
                )

    async def _backlog(
        self, client: aioredis.Redis, lanes: Lanes, group: str
    ) -> tuple[int | None, int | None]:
        """The lag and pending count of all the worker's job streams together (None where
        Redis does not know one); with priority levels, each level's own as well (over
        every shard). The plain job stream, read as one more lowest level while there are
        levels, counts in the totals."""
        per_lane = await _lanes_backlog(client, lanes, group)
        lag: int | None = 0
        pending: int | None = 0
        levels: dict[str, tuple[int | None, int | None]] = {}
        for level, lv_lag, lv_pending in per_lane:
            lag = _add(lag, lv_lag)
            pending = _add(pending, lv_pending)
            if level:
                had_lag, had_pending = levels.get(level, (0, 0))
                levels[level] = (_add(had_lag, lv_lag), _add(had_pending, lv_pending))
        for level, (lv_lag, lv_pending) in levels.items():
            self.metrics.level_lag.labels(level).set(-1 if lv_lag is None else lv_lag)
            if lv_pending is not None:
                self.metrics.level_pending.labels(level).set(lv_pending)
        return lag, pending

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        if self.http is not None:
            self.http.stop()


async def write_heartbeat(
    client: aioredis.Redis, key: str, snap: dict[str, Any], ttl_s: int
) -> None:
    """Plain fields for redis-cli, plus the whole snapshot as msgpack for tools."""
    plain = {
        k: ("" if v is None else str(v)) for k, v in snap.items() if not isinstance(v, dict | list)
    }
    plain["snapshot"] = msgpack.packb(snap, use_bin_type=True)  # type: ignore[assignment]
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=plain)  # type: ignore[arg-type]
    pipe.expire(key, ttl_s)
    await pipe.execute()


async def _lanes_backlog(
    client: aioredis.Redis, lanes: Lanes, group: str
) -> list[tuple[str, int | None, int | None]]:
    return [(lane.level, *await _group_backlog(client, lane.stream, group)) for lane in lanes]


async def _group_backlog(
    client: aioredis.Redis, stream: str, group: str
) -> tuple[int | None, int | None]:
    """The group's lag and pending count; the lag None where Redis does not know it (it
    reports nil after deletions), never a made-up 0."""
    for g in await client.xinfo_groups(stream):
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            lag, pending = g.get("lag"), g.get("pending")
            return (
                None if lag is None else int(lag),
                None if pending is None else int(pending),
            )
    return None, None


def _add(total: int | None, value: int | None) -> int | None:
    """A sum that is unknown (None) once any of its parts is."""
    return None if total is None or value is None else total + value
