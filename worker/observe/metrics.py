"""Metrics, written off the hot path: Prometheus and rolling figures.

Everything here is fed from the event loop after a batch completed or a result was
published, never from the launch path. worker.observe.health serves them over HTTP.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from worker.observe.gpu_sampler import percentile


@dataclass(frozen=True)
class Stage:
    """One stage a job goes through: what its time measures and what moves it, said once
    for /metrics (the stage histogram's HELP), `worker top` (its legend) and the docs."""

    name: str  # the metric's `stage` label and the results' timings_ms key (the contract)
    shown: str  # `worker top`'s column
    measures: str
    moved_by: str


# In the order a job goes through them. `batch_wait` is shown as model_wait: it is the time
# a sealed batch waits to launch, not the wait for a batch to fill (GPUFEED_MAX_WAIT_MS,
# part of the latency, in no stage), which readers took it for; the metric label and the
# results' key keep the name.
STAGE_INFO = (
    Stage("redis_wait", "redis_wait", "in the stream until read",
          "more workers, GPUFEED_PROCESSES"),
    Stage("fetch", "fetch", "downloading a url job",
          "GPUFEED_FETCH_CONCURRENCY, _PER_HOST"),
    Stage("queue", "queue", "read, waiting for a batch row",
          "the model binds: a faster step"),
    Stage("decode", "decode", "decoding and resizing",
          "GPUFEED_DECODE_PROCESSES, GPUFEED_DECODE"),
    Stage("batch_wait", "model_wait", "sealed batch waiting to run",
          "faster step, not GPUFEED_MAX_WAIT_MS"),
    Stage("compute", "compute", "model step, per batch",
          "GPUFEED_MODEL, _PRECISION, _BATCH_SIZE"),
    Stage("write", "write", "publishing and acking",
          "Redis latency, GPUFEED_WAIT_REPLICAS"),
)  # fmt: skip
# The stages a job goes through, in order; per-stage seconds are observed under these names.
STAGES = tuple(stage.name for stage in STAGE_INFO)
STAGE_HELP = "Time a job spent in each pipeline stage: " + "; ".join(
    f"{st.name}: {st.measures}" for st in STAGE_INFO
)
# What can happen to a job's delivery besides a plain result: taken over from a dead
# worker, dead-lettered, deleted while pending, answered by an earlier result of its id,
# answered by another worker first, refused by Redis; and consumers of dead workers removed.
DELIVERY_EVENTS = (
    "reclaimed", "dead_lettered", "entry_deleted", "duplicate_id", "not_ours",
    "already_answered", "refused", "consumer_removed", "trimmed", "replica_wait_timeout",
)  # fmt: skip
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# How many observed values a BatchHistogram keeps before it counts them (a scrape counts
# them at once): a few hundred kilobytes at most.
FOLD_AT = 16384
_FILL = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


Values = Sequence[float] | npt.NDArray[np.float64]


class BatchHistogram(Collector):
    """A Prometheus histogram fed a flush of values at a time.

    prometheus_client's Histogram takes one value per `observe` call, each a lock and a
    bucket search in Python; here a whole flush is one `np.searchsorted` + `np.bincount`
    and one lock. Exposed through the client's custom-collector API, so the scrape reads
    the same `_bucket{le}`, `_sum` and `_count` series a Histogram writes (`le` <= bound,
    cumulative counts, a `+Inf` bucket). One series per label value, each exported from
    start-up, like a Histogram whose labelled children were made up front.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        *,
        label: str | None = None,
        values: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._les = [_le(b) for b in buckets] + ["+Inf"]
        keys = list(values) if label is not None else [""]
        # Per series: counts per bucket (not cumulative; the last one is +Inf) and the sum.
        self._counts = {k: np.zeros(len(buckets) + 1, dtype=np.int64) for k in keys}
        self._sums = dict.fromkeys(keys, 0.0)
        self._lock = threading.Lock()
        # Values observed and not yet counted, by (series, scale); see observe_series.
        self._pending: dict[tuple[str, float], list[float]] = {}
        self._waiting = 0
        if registry is not None:
            registry.register(self)

    def observe_many(self, values: Values, key: str = "") -> None:
        """Count every value of `values` (seconds) in the series `key` (the label value)."""
        self.observe_series({key: values})

    def observe_series(self, series: Mapping[str, Values], scale: float = 1.0) -> None:
        """Count each series' values times `scale` (giving seconds) in that series.

        The values are only kept here (a list extend per series, on the event loop); they
        are counted into the buckets in bulk, once FOLD_AT wait or a scrape reads the
        histogram: the numpy calls of a count cost about as much for 30 values as for
        thousands, so counting per flush cost the loop microseconds per job."""
        with self._lock:
            pending = self._pending
            for key, values in series.items():
                if len(values):
                    kept = pending.get((key, scale))
                    if kept is None:
                        if key not in self._counts:
                            raise KeyError(f"{self.name} has no series {key!r}")
                        pending[key, scale] = kept = []
                    kept.extend(values)
                    self._waiting += len(values)
            if self._waiting >= FOLD_AT:
                self._fold()

    def _fold(self) -> None:
        """Count the kept values into the buckets (the lock held)."""
        pending, self._pending, self._waiting = self._pending, {}, 0
        width = len(self._les)
        for (key, scale), values in pending.items():
            arr = np.asarray(values, dtype=np.float64)
            if scale != 1.0:
                arr *= scale
            # side="left": a value equal to a bound counts in that bound's bucket (le).
            slots = np.searchsorted(self._bounds, arr, side="left")
            self._counts[key] += np.bincount(slots, minlength=width)
            self._sums[key] += float(arr.sum())

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(
            self.name, self.documentation, labels=[self.label] if self.label else None
        )

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self.name, self.documentation, labels=[self.label] if self.label else None
        )
        with self._lock:
            self._fold()
            series = [(k, c.cumsum().tolist(), self._sums[k]) for k, c in self._counts.items()]
        for key, cumulative, total in series:
            family.add_metric(
                [key] if self.label else [],
                list(zip(self._les, (float(n) for n in cumulative), strict=True)),
                total,
            )
        yield family


# A bucket bound spelt as prometheus_client's Histogram writes it (the function is untyped).
_le: Callable[[float], str] = floatToGoString


class WorkerMetrics:
    """The worker's Prometheus metrics, in a registry of its own (one per worker)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Fed once per flush with all its jobs' values (worker.observe.observer).
        self.stage_seconds = BatchHistogram(
            "gpufeed_stage_seconds",
            STAGE_HELP,
            _SECONDS,
            label="stage",
            values=STAGES,
            registry=r,
        )
        self.job_seconds = BatchHistogram(
            "gpufeed_job_seconds",
            "End-to-end job latency, from XADD to published result.",
            _SECONDS,
            registry=r,
        )
        self.batch_gpu_seconds = Histogram(
            "gpufeed_batch_compute_seconds",
            "Device time per batch (CUDA events on GPU; wall time on CPU).",
            buckets=_SECONDS,
            registry=r,
        )
        self.batch_fill = Histogram(
            "gpufeed_batch_fill_ratio",
            "Real (not padding) rows per batch over batch size.",
            buckets=_FILL,
            registry=r,
        )
        self.results = Counter(
            "gpufeed_results",
            "Results published, by status and error code.",
            ["status", "code"],
            registry=r,
        )
        self.batches = Counter(
            "gpufeed_batches",
            "Batches run on the model, by the batch shape they ran on (measured at start-up).",
            ["size"],
            registry=r,
        )
        self.rows = Counter(
            "gpufeed_batch_rows", "Batch rows run, real or padding.", ["kind"], registry=r
        )
        self.events = Counter(
            "gpufeed_delivery_events",
            "Delivery events: " + ", ".join(DELIVERY_EVENTS) + ".",
            ["event"],
            registry=r,
        )
        self.decode_cache = Counter(
            "gpufeed_decode_cache",
            "Decode cache look-ups, by result (hit, miss).",
            ["result"],
            registry=r,
        )
        self.fetches = Counter(
            "gpufeed_fetch",
            "Fetches of `url` jobs, by source (http, s3, gs, az, other), host class (public; "
            "allowed: a non-public address let through GPUFEED_URL_ALLOW; store; refused; "
            "unknown) and status (ok, not_modified, 4xx, 5xx, timeout, forbidden, too_large, "
            "network, unresolved, invalid).",
            ["source", "host_class", "status"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "gpufeed_queue_depth",
            "Items waiting in each internal queue.",
            ["queue"],
            registry=r,
        )
        self.in_flight = Gauge(
            "gpufeed_in_flight_jobs", "Jobs read and not yet answered.", registry=r
        )
        self.ready = Gauge(
            "gpufeed_ready",
            "1 while /ready says 200: warm, reading, Redis answers, not draining.",
            registry=r,
        )
        # What this worker serves, as labels of one series (value 1): join on it to tell
        # two deployments apart, e.g. `... * on(instance) group_left(model) gpufeed_worker_info`.
        self.worker_info = Info(
            "gpufeed_worker",
            "The worker's model, weights, device, dtype, batch size, compile mode, stream "
            "and group.",
            registry=r,
        )
        self.gpu = Gauge(
            "gpufeed_device_utilisation",
            "Latest NVML/psutil sample, by metric.",
            ["metric"],
            registry=r,
        )
        self.stream_lag = Gauge(
            "gpufeed_stream_lag",
            "Entries not yet delivered to the group (-1: Redis does not know).",
            registry=r,
        )
        self.stream_pending = Gauge(
            "gpufeed_stream_pending",
            "Entries delivered to the group's workers and not yet answered (all workers).",
            registry=r,
        )
        # With GPUFEED_PRIORITIES the two above are the sums over the levels' streams.
        self.level_lag = Gauge(
            "gpufeed_level_lag",
            "A priority level's entries not yet delivered to the group (-1: unknown).",
            ["level"],
            registry=r,
        )
        self.level_pending = Gauge(
            "gpufeed_level_pending",
            "A priority level's entries delivered and not yet answered (all workers).",
            ["level"],
            registry=r,
        )

        # What this worker's warm start did (worker/lifecycle/warm_start.py), set once.
        self.warm_start_images = Gauge(
            "gpufeed_warm_start_images",
            "Images of the fleet's hot list at this worker's start, by state (listed; warmed: "
            "decoded into the decode cache before it joined the group; failed).",
            ["state"],
            registry=r,
        )
        self.warm_start_seconds = Gauge(
            "gpufeed_warm_start_seconds",
            "How long this worker's warm start took (0: it did not warm).",
            registry=r,
        )
        self.degraded = Gauge(
            "gpufeed_degraded",
            "1 while batches run on the cheaper degraded step (GPUFEED_DEGRADE_AFTER_S).",
            registry=r,
        )
        self.degrade_switches = Counter(
            "gpufeed_degrade_switches",
            "Switches to the degraded step (on) and back to the main step (off).",
            ["to"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Rolling:
    """The last N values, for percentiles in heartbeats and log lines."""

    def __init__(self, size: int = 4096) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def extend(self, values: list[float]) -> None:
        self._values.extend(values)

    def percentiles(self, *qs: float) -> list[float | None]:
        if not self._values:
            return [None for _ in qs]
        ordered = sorted(self._values)
        return [round(percentile(ordered, q), 3) for q in qs]

    def mean(self) -> float | None:
        return round(sum(self._values) / len(self._values), 3) if self._values else None


class RateMeter:
    """Results per second over the last interval."""

    def __init__(self) -> None:
        self._last_count = 0
        self._last_s = time.monotonic()
        self.rate = 0.0

    def update(self, count: int) -> float:
        now = time.monotonic()
        elapsed = now - self._last_s
        if elapsed > 0:
            self.rate = (count - self._last_count) / elapsed
        self._last_count, self._last_s = count, now
        return self.rate
