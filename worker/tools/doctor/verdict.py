"""The doctor's verdict: from measured evidence to one plain-words answer and the knob to turn.

`verdict(evidence)` is a pure function, so every rule is tested on constructed evidence.
The rules, in the order they are tried (the first that holds is the verdict; the others
that hold are listed under `also`):

1. sync-bound     host syncs were found on the launch path (any at all: there should be 0).
1b. fetch-bound   (`url` jobs) end-to-end < FEED_STARVED_RATIO of the ceiling, and the fetch
                  stage binds: GPUFEED_FETCH_CONCURRENCY fetches of the mean fetch time could
                  supply less than FETCH_BINDING_MARGIN (1.1x) the measured throughput.
2. feed-starved   end-to-end < FEED_STARVED_RATIO (70%) of the model's direct-feed ceiling,
                  and decode is the binding stage (the decoders could supply less than
                  DECODE_BINDING_MARGIN = 1.1x the measured throughput), or batches leave
                  less than LOW_FILL (50%) full while jobs were waiting in Redis.
3. launch-bound   one forward runs >= LAUNCH_MIN_COUNT (100) kernels, >= LAUNCH_TINY_SHARE
                  (50%) of them under 10 µs, the device is busy < LAUNCH_MAX_BUSY (60%) of
                  the forward's wall time, and the step does not replay CUDA graphs. On the
                  CPU (operators instead of kernels; an operator's time includes its
                  dispatch, so the busy share is not required) it is only a hint.
4. memory-bound   (CUDA) NVML's memory-controller utilisation >= MEMORY_BW_PCT (60%).
5. compute-bound  the model is the binding stage: (CUDA) GPU utilisation >=
                  COMPUTE_UTIL_PCT (85%); (CPU) end-to-end >= 70% of its ceiling; (both) the
                  model's own rate inside the pipeline is < MODEL_BINDING_MARGIN (1.1x) the
                  throughput (it runs slower there than alone: the device is shared).
6. feed-starved   (fallback) end-to-end < HEALTHY_RATIO (90%) of the ceiling and nothing
                  above holds, and decode binds (as in 2, between 70% and 90%).
6b. queue-bound   (fallback, decode does not bind) end-to-end >= QUEUE_BOUND_RATIO (80%)
                  of the queue ceiling: gpufeed's Redis work alone (read, publish, ack) for
                  the same jobs and batch is about as fast as the whole worker; or Redis's
                  command thread was busy >= QUEUE_BOUND_RATIO of the run with these jobs
                  (its CPU per job x jobs/s; INFO cpu, producers' XADDs included).
6c. worker-overhead-bound  (fallback, decode does not bind) end-to-end < QUEUE_BOUND_RATIO
                  of the queue ceiling, and the event loop's thread was busy >= LOOP_BUSY
                  (60%) of the run (its CPU per job x jobs/s): per-job work in the worker's
                  own process, not Redis, not decode, not the model, sets the pace.
6d. feed-starved  (fallback) none of 6-6c: the event loop, Redis round trips or writes.
7. healthy        end-to-end >= HEALTHY_RATIO (90%) of the ceiling, no other finding.
8. inconclusive   the end-to-end run or the ceiling could not be measured and nothing else
                  was found; the evidence says what is missing.

A hint is a finding that is not strong enough to be the verdict (rule 3 on the CPU); it is
listed under `also` whatever the verdict is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.config.table import TUNING_VARIABLE as TUNING

VERDICTS = (
    "sync-bound",
    "fetch-bound",
    "feed-starved",
    "queue-bound",
    "worker-overhead-bound",
    "launch-bound",
    "memory-bound",
    "compute-bound",
    "healthy",
    "inconclusive",
)

# The thresholds, by name, so reports can cite them and tests can sit on their edges.
FEED_STARVED_RATIO = 0.70  # end-to-end / ceiling below this: the model is starved
DECODE_BINDING_MARGIN = 1.10  # decode capacity below this x throughput: decode binds
LOW_FILL = 0.50  # mean real rows per batch / batch size below this, with a backlog
HEALTHY_RATIO = 0.90  # end-to-end / ceiling at or above this: healthy
LAUNCH_MIN_COUNT = 100  # kernels (CPU: operators) per forward
LAUNCH_TINY_SHARE = 0.50  # share of kernels under 10 µs
LAUNCH_MAX_BUSY = 0.60  # device busy share of the forward's wall time (CUDA only)
MEMORY_BW_PCT = 60.0  # NVML memory-controller utilisation, %
COMPUTE_UTIL_PCT = 85.0  # NVML GPU utilisation, %
MODEL_BINDING_MARGIN = 1.10  # model rate inside the pipeline below this x throughput
FETCH_BINDING_MARGIN = 1.10  # fetch capacity below this x throughput: fetching binds
QUEUE_BOUND_RATIO = 0.80  # end-to-end / queue ceiling at or above this: Redis binds
LOOP_BUSY = 0.60  # event-loop thread busy share of the run: the worker's own work binds

THRESHOLDS: dict[str, float] = {
    "feed_starved_ratio": FEED_STARVED_RATIO,
    "decode_binding_margin": DECODE_BINDING_MARGIN,
    "low_fill": LOW_FILL,
    "healthy_ratio": HEALTHY_RATIO,
    "launch_min_count": LAUNCH_MIN_COUNT,
    "launch_tiny_share": LAUNCH_TINY_SHARE,
    "launch_max_busy": LAUNCH_MAX_BUSY,
    "memory_bw_pct": MEMORY_BW_PCT,
    "compute_util_pct": COMPUTE_UTIL_PCT,
    "model_binding_margin": MODEL_BINDING_MARGIN,
    "fetch_binding_margin": FETCH_BINDING_MARGIN,
    "queue_bound_ratio": QUEUE_BOUND_RATIO,
    "loop_busy": LOOP_BUSY,
}


@dataclass(frozen=True)
class Evidence:
    """What the doctor measured; None wherever something could not be measured."""

    device_type: str = "cpu"  # "cuda" or "cpu"
    batch_size: int | None = None
    compile_mode: str = "off"  # the serving step's resolved torch.compile mode
    compiled: bool = False  # the serving step is compiled (no eager fallback)
    cudagraphs: bool = False  # the serving step replays CUDA graphs
    precision: str | None = None  # the serving dtype, e.g. "bfloat16"
    decode: str = "cpu"  # GPUFEED_DECODE
    dct_scaling: bool = True  # the tuning constant DCT_SCALING
    decode_threads: int | None = None  # decoders: processes, or threads without them
    decode_processes: int = 0  # GPUFEED_DECODE_PROCESSES as resolved (0: threads)
    cpu_count: int | None = None
    # (a) images/s of the serving step fed from device memory, and both variants
    ceiling_images_per_s: float | None = None
    eager_ceiling_images_per_s: float | None = None
    compiled_ceiling_images_per_s: float | None = None
    # (b) one forward under the profiler; unit "kernels" (CUDA) or "ops" (CPU)
    profile_unit: str = "kernels"
    kernel_count: int | None = None
    busy_ratio: float | None = None
    tiny_share: float | None = None
    gap_mean_us: float | None = None
    # (c) host syncs on the launch path
    host_syncs: int | None = None
    sync_locations: tuple[str, ...] = ()
    # (d) the end-to-end run
    e2e_images_per_s: float | None = None
    decode_ms_mean: float | None = None
    batch_fill: float | None = None
    backlog: bool = True  # jobs were waiting in Redis during the run
    model_in_pipeline_images_per_s: float | None = None
    stage_ms: Mapping[str, float | None] = field(default_factory=dict)
    gpu_util_pct: float | None = None
    mem_bw_util_pct: float | None = None
    process_cpu_pct: float | None = None
    missing: tuple[str, ...] = ()  # what could not be measured, in words
    # `url` jobs: the mean fetch stage time and GPUFEED_FETCH_CONCURRENCY
    fetch_ms_mean: float | None = None
    fetch_concurrency: int | None = None
    # The queue ceiling (worker/tools/harness/queue_ceiling.py) and the event loop thread's CPU per
    # job during the end-to-end run
    queue_ceiling_jobs_per_s: float | None = None
    loop_cpu_us_per_job: float | None = None
    # redis-server's command-thread CPU per job over the run (INFO cpu): each job's XADD and
    # the worker's reads, results and acks
    redis_cpu_us_per_job: float | None = None

    @property
    def loop_busy(self) -> float | None:
        """Share of the run the event loop's thread was on a CPU: CPU per job x jobs/s."""
        if self.loop_cpu_us_per_job is None or self.e2e_images_per_s is None:
            return None
        return self.loop_cpu_us_per_job * self.e2e_images_per_s / 1e6

    @property
    def redis_busy(self) -> float | None:
        """Share of the run Redis's command thread was on a CPU for these jobs."""
        if self.redis_cpu_us_per_job is None or self.e2e_images_per_s is None:
            return None
        return self.redis_cpu_us_per_job * self.e2e_images_per_s / 1e6

    @property
    def ratio(self) -> float | None:
        """End-to-end throughput over the model's ceiling."""
        if self.e2e_images_per_s is None or not self.ceiling_images_per_s:
            return None
        return self.e2e_images_per_s / self.ceiling_images_per_s

    @property
    def fetch_capacity_images_per_s(self) -> float | None:
        """Images/s the fetch stage could supply: concurrent fetches / mean fetch seconds."""
        if not self.fetch_concurrency or not self.fetch_ms_mean:
            return None
        return self.fetch_concurrency * 1000.0 / self.fetch_ms_mean

    @property
    def decode_capacity_images_per_s(self) -> float | None:
        """Images/s the decode threads could supply: threads / mean decode seconds."""
        if not self.decode_threads or not self.decode_ms_mean:
            return None
        return self.decode_threads * 1000.0 / self.decode_ms_mean


@dataclass(frozen=True)
class Finding:
    name: str
    headline: str
    evidence: tuple[str, ...]
    knob: str
    hint: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "headline": self.headline,
            "evidence": list(self.evidence),
            "knob": self.knob,
            "hint": self.hint,
        }


@dataclass(frozen=True)
class Verdict:
    name: str
    headline: str
    evidence: tuple[str, ...]
    knob: str
    also: tuple[Finding, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "headline": self.headline,
            "evidence": list(self.evidence),
            "knob": self.knob,
            "also": [f.as_dict() for f in self.also],
            "thresholds": dict(THRESHOLDS),
        }


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _rate(x: float) -> str:
    return f"{x:,.1f} images/s"


def _throughput_line(ev: Evidence) -> str | None:
    ratio = ev.ratio
    if ratio is None or ev.e2e_images_per_s is None or ev.ceiling_images_per_s is None:
        return None
    return (
        f"end-to-end {_rate(ev.e2e_images_per_s)} = {_pct(ratio)} of the model's "
        f"direct-feed ceiling ({_rate(ev.ceiling_images_per_s)})"
    )


def _lines(*lines: str | None) -> tuple[str, ...]:
    return tuple(line for line in lines if line)


def _sync_bound(ev: Evidence) -> Finding | None:
    if not ev.host_syncs:
        return None
    where = list(ev.sync_locations[:3])
    return Finding(
        "sync-bound",
        f"the hot path waits on the GPU: {ev.host_syncs} host sync(s) on the launch path, "
        "so the CPU stops queueing work until the GPU catches up",
        _lines(
            f"{ev.host_syncs} host sync(s) counted under CUDA sync-debug mode (0 expected)",
            *(f"at {w}" for w in where),
            _throughput_line(ev),
        ),
        "remove the sync"
        + (f" at {where[0]}" if where else "")
        + ": no .item(), .cpu(), .tolist(), .numpy() or synchronize() between launch and "
        "results; read results from the pinned output slot after the batch's done-event",
    )


def _fetch_bound(ev: Evidence) -> Finding | None:
    ratio, capacity = ev.ratio, ev.fetch_capacity_images_per_s
    if ratio is None or capacity is None or ev.e2e_images_per_s is None:
        return None
    if ratio >= FEED_STARVED_RATIO or capacity >= FETCH_BINDING_MARGIN * ev.e2e_images_per_s:
        return None
    return Finding(
        "fetch-bound",
        "the model waits for images to download: the fetch stage of `url` jobs cannot keep up",
        _lines(
            _throughput_line(ev),
            f"fetch capacity {_rate(capacity)} = {ev.fetch_concurrency} concurrent fetches / "
            f"{ev.fetch_ms_mean:,.1f} ms per image ({capacity / ev.e2e_images_per_s:.2f}x the "
            f"throughput; binding below {FETCH_BINDING_MARGIN:.1f}x)",
        ),
        f"raise GPUFEED_FETCH_CONCURRENCY (now {ev.fetch_concurrency}) and "
        "GPUFEED_FETCH_PER_HOST if the image hosts allow it; fetch from a store or CDN closer to "
        "the worker; or repeat URLs less (a repeated URL is served from the decode cache)",
    )


def _decoders(ev: Evidence) -> str:
    return "processes" if ev.decode_processes else "threads"


def _decode_knob(ev: Evidence) -> str:
    threads = ev.decode_threads if ev.decode_threads is not None else "?"
    cores = f"; this host has {ev.cpu_count} cores" if ev.cpu_count else ""
    if ev.cpu_count and ev.decode_threads and ev.decode_threads >= ev.cpu_count:
        cores += f", so more {_decoders(ev)} help only while decode waits on I/O"
    if ev.decode_processes:
        parts = [f"raise GPUFEED_DECODE_PROCESSES (now {threads}{cores})"]
    else:
        # The threads' count is a tuning constant: the operator's knob is processes.
        processes = max(1, ev.cpu_count - 1) if ev.cpu_count else "N"
        parts = [
            f"decode in processes: set GPUFEED_DECODE_PROCESSES={processes} (now {threads} "
            f"decode threads{cores}; the tuning constant DECODE_THREADS sizes them, and "
            f"{TUNING}=decode_threads=N overrides it for an experiment)"
        ]
    if ev.device_type == "cuda" and ev.decode != "gpu":
        parts.append(f"or set GPUFEED_DECODE=gpu (now {ev.decode}) to decode JPEGs on the GPU")
    elif ev.device_type != "cuda":
        parts.append("or run more worker processes / a CUDA host with GPUFEED_DECODE=gpu")
    knob = " ".join(parts)
    if not ev.dct_scaling:
        knob += (
            f"; large JPEGs: take dct_scaling=false out of {TUNING} to decode them at 1/2-1/8 "
            "scale (the tuning constant DCT_SCALING, on by default)"
        )
    return knob + "; or cache decoded, resized images upstream"


def _feed_starved(ev: Evidence, ratio_limit: float = FEED_STARVED_RATIO) -> Finding | None:
    ratio = ev.ratio
    if ratio is None or ratio >= ratio_limit or ev.e2e_images_per_s is None:
        return None
    capacity = ev.decode_capacity_images_per_s
    decode_binds = capacity is not None and capacity < DECODE_BINDING_MARGIN * ev.e2e_images_per_s
    low_fill = ev.batch_fill is not None and ev.batch_fill < LOW_FILL and ev.backlog
    if not (decode_binds or low_fill):
        return None
    evidence = [_throughput_line(ev)]
    if capacity is not None and ev.decode_ms_mean is not None:
        evidence.append(
            f"decode capacity {_rate(capacity)} = {ev.decode_threads} {_decoders(ev)} / "
            f"{ev.decode_ms_mean:.1f} ms per image "
            f"({capacity / ev.e2e_images_per_s:.2f}x the throughput; binding below "
            f"{DECODE_BINDING_MARGIN:.1f}x)"
        )
    if ev.batch_fill is not None:
        evidence.append(
            f"batches {_pct(ev.batch_fill)} full"
            + (" while jobs waited in Redis" if ev.backlog else "")
        )
    if ev.process_cpu_pct is not None and ev.cpu_count:
        evidence.append(
            f"worker process CPU {ev.process_cpu_pct:.0f}% of one core ({ev.cpu_count} cores)"
        )
    what = "CPU decode and preprocessing" if decode_binds else "the feed (batches leave part-empty)"
    return Finding(
        "feed-starved",
        f"the model waits for input: {what} cannot keep up, so the device idles between batches",
        _lines(*evidence),
        _decode_knob(ev),
    )


def _launch_bound(ev: Evidence) -> Finding | None:
    if ev.kernel_count is None or ev.tiny_share is None or ev.cudagraphs:
        return None
    if ev.kernel_count < LAUNCH_MIN_COUNT or ev.tiny_share < LAUNCH_TINY_SHARE:
        return None
    on_cpu = ev.device_type != "cuda"
    if not on_cpu and (ev.busy_ratio is None or ev.busy_ratio >= LAUNCH_MAX_BUSY):
        return None
    unit = ev.profile_unit
    evidence = [
        f"{ev.kernel_count} {unit} per forward, {_pct(ev.tiny_share)} of them under 10 µs",
    ]
    if ev.busy_ratio is not None:
        evidence.append(
            f"{unit} busy {_pct(ev.busy_ratio)} of the forward's wall time"
            + (f"; mean gap between {unit} {ev.gap_mean_us:.1f} µs" if ev.gap_mean_us else "")
        )
    if ev.eager_ceiling_images_per_s and ev.compiled_ceiling_images_per_s:
        evidence.append(
            f"ceiling eager {_rate(ev.eager_ceiling_images_per_s)} vs compiled "
            f"{_rate(ev.compiled_ceiling_images_per_s)}"
        )
    batch = ev.batch_size if ev.batch_size is not None else "?"
    if on_cpu:
        return Finding(
            "launch-bound",
            f"hint: the step is many tiny {unit}; per-{unit[:-1]} dispatch overhead is a large "
            "part of its time (on a GPU this is what leaves it idle between kernels)",
            _lines(*evidence),
            f"raise GPUFEED_BATCH_SIZE (now {batch}) so each {unit[:-1]} does more work; on a "
            "CUDA host keep GPUFEED_COMPILE=auto (CUDA graphs replay the whole step at once)",
            hint=True,
        )
    compile_note = (
        f"set GPUFEED_COMPILE=reduce-overhead (now {ev.compile_mode}): CUDA graphs replay "
        f"the step's {ev.kernel_count} launches as one"
        if not ev.compiled or ev.compile_mode != "reduce-overhead"
        else "check the start-up log for skipped CUDA graphs"
    )
    return Finding(
        "launch-bound",
        f"the GPU idles between hundreds of tiny kernels: launches from the host, not "
        f"arithmetic, set the pace ({ev.kernel_count} {unit}, device busy "
        f"{_pct(ev.busy_ratio or 0.0)})",
        _lines(*evidence, _throughput_line(ev)),
        f"{compile_note}; or raise GPUFEED_BATCH_SIZE (now {batch}) so each kernel does more work",
    )


def _memory_bound(ev: Evidence) -> Finding | None:
    if ev.device_type != "cuda" or ev.mem_bw_util_pct is None:
        return None
    if ev.mem_bw_util_pct < MEMORY_BW_PCT:
        return None
    util = f", GPU utilisation {ev.gpu_util_pct:.0f}%" if ev.gpu_util_pct is not None else ""
    precision = ev.precision or "?"
    return Finding(
        "memory-bound",
        "the GPU's memory bandwidth, not its arithmetic, is the limit",
        _lines(
            f"memory-controller utilisation {ev.mem_bw_util_pct:.0f}% (threshold "
            f"{MEMORY_BW_PCT:.0f}%){util}",
            _throughput_line(ev),
        ),
        f"GPUFEED_PRECISION=bf16 or fp16 (now {precision}) halves the bytes moved; "
        "GPUFEED_COMPILE=max-autotune fuses elementwise passes; a larger batch will not help",
    )


def _compute_bound(ev: Evidence) -> Finding | None:
    precision = ev.precision or "?"
    ratio, e2e = ev.ratio, ev.e2e_images_per_s
    in_pipe = ev.model_in_pipeline_images_per_s
    model_binds = e2e is not None and in_pipe is not None and in_pipe < MODEL_BINDING_MARGIN * e2e
    evidence = [_throughput_line(ev)]
    if in_pipe is not None and e2e:
        evidence.append(
            f"the model runs at {_rate(in_pipe)} inside the pipeline "
            f"({in_pipe / e2e:.2f}x the throughput)"
        )
    slower = ""
    if model_binds and ratio is not None and ratio < FEED_STARVED_RATIO:
        slower = (
            f"the model is the binding stage, and slower inside the pipeline than alone "
            f"({in_pipe:,.1f} vs {ev.ceiling_images_per_s:,.1f} images/s): "
        )
    if ev.device_type == "cuda":
        busy = ev.gpu_util_pct is not None and ev.gpu_util_pct >= COMPUTE_UTIL_PCT
        if not (busy or model_binds):
            return None
        if ev.gpu_util_pct is not None:
            evidence.insert(
                0, f"GPU utilisation {ev.gpu_util_pct:.0f}% (threshold {COMPUTE_UTIL_PCT:.0f}%)"
            )
        headline = (
            slower + "something else uses the GPU meanwhile (GPU decode, copies, other processes)"
            if slower and not busy
            else f"the GPU is busy {ev.gpu_util_pct or 0:.0f}% of the time running the model: "
            "the pipeline keeps it fed, the model itself is the limit"
        )
        return Finding(
            "compute-bound",
            headline,
            _lines(*evidence),
            f"make each image cheaper: GPUFEED_PRECISION=bf16/fp16 (now {precision}), a smaller "
            "GPUFEED_MODEL or GPUFEED_INPUT_SIZE; or add GPUs (one worker per GPU)",
        )
    if ratio is None or (ratio < FEED_STARVED_RATIO and not model_binds):
        return None
    capacity = ev.decode_capacity_images_per_s
    if capacity is not None:
        evidence.append(f"decode capacity {_rate(capacity)}: decode is not the binding stage")
    threads = ev.decode_threads if ev.decode_threads is not None else "?"
    cores = ev.cpu_count or "?"
    return Finding(
        "compute-bound",
        slower + "it shares the CPU cores with decode and the rest of the worker"
        if slower
        else "the model is the binding stage: the CPU runs it about as fast as it can",
        _lines(*evidence),
        "a CUDA device (GPUFEED_DEVICE=cuda), a smaller GPUFEED_MODEL or GPUFEED_INPUT_SIZE, "
        f"or more cores (decode {_decoders(ev)}, now {threads}, share the {cores} cores with the "
        "model)",
    )


def _feed_fallback(ev: Evidence) -> Finding | None:
    ratio = ev.ratio
    if ratio is None or ratio >= HEALTHY_RATIO or ev.e2e_images_per_s is None:
        return None
    # Between 70% and 90% of the ceiling a binding decode is still the answer.
    decode = _feed_starved(ev, ratio_limit=HEALTHY_RATIO)
    if decode is not None:
        return decode
    e2e = ev.e2e_images_per_s
    evidence = [_throughput_line(ev)]
    capacity = ev.decode_capacity_images_per_s
    if capacity is not None:
        evidence.append(
            f"decode capacity {_rate(capacity)} ({capacity / e2e:.2f}x the throughput): "
            "decode does not bind"
        )
    queue = _queue_or_overhead(ev, evidence)
    if queue is not None:
        return queue
    in_pipe = ev.model_in_pipeline_images_per_s
    if in_pipe is not None:
        evidence.append(
            f"the model runs at {_rate(in_pipe)} inside the pipeline ({in_pipe / e2e:.2f}x "
            "the throughput): the model does not bind"
        )
    # With a backlog every waiting stage is long (jobs queue behind the bottleneck), so
    # the stage times are cited as figures, not taken as the culprit.
    stages = [f"{k} {v:,.1f}" for k, v in ev.stage_ms.items() if v is not None]
    if stages:
        evidence.append("stage means (ms): " + ", ".join(stages))
    if ev.process_cpu_pct is not None:
        evidence.append(f"worker process CPU {ev.process_cpu_pct:.0f}% (100% = one core)")
    return Finding(
        "feed-starved",
        "the model waits on its feed, but neither decode nor the model binds: the worker's "
        "event loop, the Redis round trips or the result writes do",
        _lines(*evidence),
        "if the worker process's CPU is near 100% (its event loop), run a second worker "
        "process on the device (each its own GPUFEED_WORKER_NAME); if Redis is remote, check "
        "its latency; a deeper ring rides out short stalls: its depth is the tuning constant "
        f"RING_SLOTS, which {TUNING}=ring_slots=N overrides for an experiment",
    )


def _queue_or_overhead(ev: Evidence, evidence: list[str | None]) -> Finding | None:
    """Rules 6b and 6c, given the fallback's evidence so far (decode does not bind)."""
    queue, e2e, busy = ev.queue_ceiling_jobs_per_s, ev.e2e_images_per_s, ev.loop_busy
    redis_busy = ev.redis_busy
    if e2e is None or not (queue or redis_busy):
        return None
    share = e2e / queue if queue else 0.0
    lines = [*evidence]
    if queue:
        lines.append(
            f"end-to-end {e2e:,.1f} jobs/s = {_pct(share)} of the queue ceiling ({queue:,.1f} "
            "jobs/s: gpufeed's read, publish and ack alone on this Redis)"
        )
    if redis_busy is not None and ev.redis_cpu_us_per_job is not None:
        lines.append(
            f"redis-server's command thread {ev.redis_cpu_us_per_job:,.1f} µs per job (each "
            f"job's XADD, reads, results, acks) = busy {_pct(redis_busy)} of the run"
        )
    if busy is not None and ev.loop_cpu_us_per_job is not None:
        lines.append(
            f"event loop {ev.loop_cpu_us_per_job:,.1f} µs of CPU per job = busy {_pct(busy)} "
            "of the run"
        )
    if share >= QUEUE_BOUND_RATIO or (redis_busy or 0.0) >= QUEUE_BOUND_RATIO:
        return Finding(
            "queue-bound",
            "Redis is the limit: the worker goes about as fast as gpufeed's Redis work alone "
            "allows on this Redis",
            _lines(*lines),
            "a Redis closer to the worker (round trips), a faster or less loaded Redis, "
            "smaller jobs (a `path` or `url` instead of inline image bytes); or split the work "
            "over several streams, each with its own workers",
        )
    if busy is None or busy < LOOP_BUSY:
        return None
    return Finding(
        "worker-overhead-bound",
        "the worker process itself is the limit: its event loop is busy with per-job work "
        "(reading, batching, results, metrics) while Redis, decode and the model could go "
        "faster",
        _lines(*lines),
        "run a second worker process on the device (each its own GPUFEED_WORKER_NAME, same "
        "group), or raise GPUFEED_BATCH_SIZE so per-batch costs spread over more jobs",
    )


def verdict(ev: Evidence) -> Verdict:
    """The verdict for `ev`; see the module docstring for the rules and their order."""
    findings = [
        f
        for f in (
            _sync_bound(ev),
            _fetch_bound(ev),
            _feed_starved(ev),
            _launch_bound(ev),
            _memory_bound(ev),
            _compute_bound(ev),
        )
        if f is not None
    ]
    strong = [f for f in findings if not f.hint]
    hints = tuple(f for f in findings if f.hint)
    if strong:
        main, rest = strong[0], tuple(strong[1:]) + hints
        return Verdict(main.name, main.headline, main.evidence, main.knob, rest)
    fallback = _feed_fallback(ev)
    if fallback is not None:
        return Verdict(fallback.name, fallback.headline, fallback.evidence, fallback.knob, hints)
    ratio = ev.ratio
    if ratio is not None and ev.e2e_images_per_s is not None:
        return Verdict(
            "healthy",
            f"healthy: the pipeline delivers {_pct(ratio)} of what the model can run",
            _lines(
                _throughput_line(ev),
                "no host syncs" if ev.host_syncs == 0 else None,
            ),
            "nothing to turn; for more throughput add devices or make the model cheaper",
            hints,
        )
    missing = list(ev.missing) or ["the end-to-end run or the ceiling"]
    return Verdict(
        "inconclusive",
        "no verdict: the figures that decide it could not be measured here",
        tuple(f"not measured: {m}" for m in missing),
        "run the doctor where Redis and the configured device are available",
        hints,
    )
