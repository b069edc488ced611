"""Instruments a measurement puts around a running worker: host syncs (CUDA sync-debug
warnings, explicit synchronize calls and, with the profiler, blocking CUDA calls by call site),
compiled-step replays, and the rows the GPU decode stage decoded. bench, the GPU check and
doctor count with the same ones, so their figures mean the same thing."""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from worker.decode.gpu_packed import LANE_SCOPE

log = structlog.get_logger("gpufeed.instruments")

_SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"
# What torch says once when sync-debug mode is turned on; it names no operation (it was
# counted as a host sync on the first GPU host).
_SYNC_MODE_NOTICE = "synchronization debug mode is a prototype"
# The device-side copy activity names a pageable host side: "Memcpy HtoD (Pageable -> Device)".
PAGEABLE_COPY = "pageable"


# CUDA runtime and driver calls that block the calling host thread until the device (or a
# stream or event) catches up, whoever makes them: torch, torchvision, nvJPEG,
# nvImageCodec, cuDNN or cuBLAS, from Python or C++. Freeing device or pinned memory
# synchronises the device as well. The *Async copies and memsets are not in it: a copy
# that blocks because its host side is pageable is seen on the device side instead.
SYNC_CALL = re.compile(
    r"^(cuda(Device|Stream|Event|Thread)Synchronize"
    r"|cu(Ctx|Stream|Event)Synchronize"
    r"|cudaMemcpy(2D|3D|Peer)?(ToSymbol|FromSymbol|ToArray|FromArray)?"
    r"|cuMemcpy(DtoH|HtoD|DtoD|AtoH|HtoA|2D|3D|Peer)?"
    r"|cudaFree(Host|Array)?|cuMemFree(Host)?)$"
)
# CUPTI may name a call with its API version or per-thread-stream variant appended
# ("cuStreamSynchronize_v2", "cudaLaunchKernelExC_v11060", "cudaMemcpy_ptds").
_API_SUFFIX = re.compile(r"(_v\d+|_pt(sz|ds))+$")


def is_host_sync(name: str) -> bool:
    """A blocking CUDA runtime or driver call, or a copy from pageable host memory."""
    if name.startswith("Memcpy"):
        return PAGEABLE_COPY in name.lower()
    return SYNC_CALL.match(_API_SUFFIX.sub("", name)) is not None


class SyncCounter:
    """Counts host syncs while active: CUDA sync-debug warnings (any thread), explicit
    torch.cuda.synchronize / Event.synchronize / Stream.synchronize calls per thread, and,
    when profiled, every blocking CUDA runtime or driver call and pageable-memory copy the
    profiler saw, with where it happened."""

    def __init__(self) -> None:
        self.debug_warnings = 0
        self.explicit: dict[str, int] = {}
        self.examples: list[str] = []
        self.profiled: dict[str, int] = {}  # call or copy name -> count
        self.sites: list[str] = []
        # Blocking calls inside a GPU decode lane's call (LANE_SCOPE, on the lane's own
        # thread): the decoder waiting for its own previous batch, off the serving path.
        self.lane_waits: dict[str, int] = {}
        self.lane_sites: list[str] = []
        self.profile_error: str | None = None
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        # A synchronize seen by the profiler may also be an explicit call or a warning:
        # the larger of the counts, never their sum.
        return max(self.debug_warnings + sum(self.explicit.values()), sum(self.profiled.values()))

    def _explicit(self, what: str) -> None:
        key = f"{threading.current_thread().name}:{what}"
        with self._lock:
            self.explicit[key] = self.explicit.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "sync_debug_warnings": self.debug_warnings,
            "explicit_calls": self.explicit,
            "profiled": self.profiled,
            "profile_error": self.profile_error,
            "sites": self.sites[:10],
            "examples": self.examples[:5],
            "decode_lane_waits": {
                "total": sum(self.lane_waits.values()),
                "profiled": self.lane_waits,
                "sites": self.lane_sites[:5],
            },
        }

    def add_profiled(self, events: list[RawEvent]) -> None:
        """Blocking calls and pageable copies among the profiler's events, between the
        window's start and end markers (the profiler's own start and stop synchronise)."""
        starts = [e.start_ns for e in events if e.name == _WINDOW_START]
        ends = [e.start_ns for e in events if e.name == _WINDOW_END]
        lo = starts[0] if starts else None
        hi = ends[-1] if ends else None
        lanes = [e for e in events if e.on_cpu and e.name == LANE_SCOPE]
        flagged, waits = [], []
        for e in events:
            if (lo is not None and e.start_ns < lo) or (hi is not None and e.start_ns > hi):
                continue
            if not is_host_sync(e.name):
                continue
            if any(_inside(e, lane) for lane in lanes):
                self.lane_waits[e.name] = self.lane_waits.get(e.name, 0) + 1
                waits.append(e)
            else:
                self.profiled[e.name] = self.profiled.get(e.name, 0) + 1
                flagged.append(e)
        for e in flagged[:10]:
            self.sites.append(_call_site(e, events))
        for e in waits[:5]:
            self.lane_sites.append(_call_site(e, events))


@dataclass(frozen=True)
class RawEvent:
    """One profiler event, as read from kineto's results (cheap: no event tree built)."""

    name: str
    start_ns: int
    end_ns: int
    thread: int
    on_cpu: bool


_WINDOW_START = "gpufeed.sync_window_start"
_WINDOW_END = "gpufeed.sync_window_end"


def _inside(e: RawEvent, scope: RawEvent) -> bool:
    """`e` happened within `scope`, on the same thread."""
    return e.thread == scope.thread and scope.start_ns <= e.start_ns and e.end_ns <= scope.end_ns


def _call_site(e: RawEvent, events: list[RawEvent]) -> str:
    """Where a blocking call happened: the torch ops around it on its thread, innermost
    first (none: a library or C++ called it outside any op)."""
    around = sorted(
        (
            o
            for o in events
            if o.on_cpu
            and o is not e
            and o.thread == e.thread
            and o.start_ns <= e.start_ns
            and o.end_ns >= e.end_ns
            and not o.name.startswith(("cuda", "cu"))
        ),
        key=lambda o: -o.start_ns,
    )
    where = " < ".join(o.name for o in around[:6]) or "no torch op around it"
    return f"{e.name} in {where} (thread {e.thread})"


def _kineto_events(prof: Any) -> list[RawEvent]:
    """kineto's results as they are (no event tree built: cheap for a busy window)."""
    out = []
    for k in prof.profiler.kineto_results.events():
        start = int(k.start_ns())
        end = start + int(k.duration_ns())
        on_cpu = str(k.device_type()).endswith("CPU")
        out.append(RawEvent(str(k.name()), start, end, int(k.start_thread_id()), on_cpu))
    return out


def _raw_events(prof: Any) -> list[RawEvent]:
    try:
        return _kineto_events(prof)
    except (AttributeError, TypeError, RuntimeError):
        pass
    out = []
    for f in prof.events():  # the parsed FunctionEvents (slower), times in µs
        start = int(f.time_range.start * 1000)
        on_cpu = str(getattr(f, "device_type", "")).endswith("CPU")
        out.append(RawEvent(str(f.name), start, int(f.time_range.end * 1000), f.thread, on_cpu))
    return out


def sync_profiler(*, cuda: bool = True) -> Any:
    """The sync window's profiler: CUDA runtime calls from every thread (CUPTI), and torch
    ops from every thread too, so that a call is named by the ops around it wherever it
    happened (by default torch records the ops of the thread that started it only)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    try:
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: the sites name fewer ops
        return profile(activities=activities)
    return profile(activities=activities, experimental_config=config)


@contextlib.contextmanager
def _profiled(counter: SyncCounter) -> Iterator[None]:
    """The CUDA runtime calls of every thread, through the profiler (CUPTI): what
    set_sync_debug_mode cannot see (C++ callers, libraries, pageable copies)."""
    from torch.profiler import record_function

    prof = sync_profiler()
    try:
        prof.start()
    except Exception as exc:  # noqa: BLE001 - reported: the sync rule then fails as not measured
        counter.profile_error = f"profiler did not start: {type(exc).__name__}: {exc}"
        yield
        return
    with record_function(_WINDOW_START):
        pass
    try:
        yield
    finally:
        with record_function(_WINDOW_END):
            pass
        try:
            prof.stop()
            counter.add_profiled(_raw_events(prof))
        except Exception as exc:  # noqa: BLE001 - reported as not measured
            counter.profile_error = f"profiler failed: {type(exc).__name__}: {exc}"
            log.warning("sync_profile_failed", error=counter.profile_error)


@contextlib.contextmanager
def count_host_syncs(*, profile: bool = False) -> Iterator[SyncCounter]:
    """Host syncs while active. With `profile`, the profiler runs outside the counting
    (its own start and stop synchronise, and are not the code's)."""
    counter = SyncCounter()
    if not torch.cuda.is_available():
        if profile:
            counter.profile_error = "no CUDA device"
        yield counter
        return
    with _profiled(counter) if profile else contextlib.nullcontext(), _counting(counter):
        yield counter


@contextlib.contextmanager
def _counting(counter: SyncCounter) -> Iterator[None]:
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            counter._explicit(label)
            return original(*args, **kwargs)

        setattr(owner, name, counting)
        patched.append((owner, name, original))

    wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
    wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)
    for w in seen:
        text = str(w.message)
        if is_sync_warning(text):
            counter.debug_warnings += 1
            if len(counter.examples) < 5:
                counter.examples.append(f"{w.filename}:{w.lineno}: {text[:200]}")


def is_sync_warning(text: str) -> bool:
    """Whether a warning raised under sync-debug mode reports a synchronizing operation."""
    lowered = text.lower()
    return _SYNC_WARNING in lowered and _SYNC_MODE_NOTICE not in lowered


class StepReplays:
    """Launches of the serving step and the CUDA-graph replays inside each, counted while
    active: with CUDA graphs every launch is exactly one replay. Counting inside the
    launch (not over a time window) leaves out the capture and warm-up replays, and a
    launch cut by the window's edge."""

    def __init__(self) -> None:
        self.launches = 0
        self.replays = 0
        self.not_one = 0  # launches with no replay or more than one
        self.outside = 0  # replays outside a launch of the step
        self._local = threading.local()


@contextlib.contextmanager
def count_step_replays(owner: Any, attr: str = "step") -> Iterator[StepReplays]:
    """Wraps `owner.<attr>` (the runner's step, read at each launch) and
    torch.cuda.CUDAGraph.replay (graph trees replay through it) while active."""
    counts = StepReplays()
    graph_cls: Any = getattr(torch.cuda, "CUDAGraph", None)
    original_replay: Any = getattr(graph_cls, "replay", None) if graph_cls is not None else None
    step = getattr(owner, attr)

    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(counts._local, "inside", None) is None:
            counts.outside += 1
        else:
            counts._local.inside += 1
        return original_replay(self, *args, **kwargs)

    def launch(x: torch.Tensor) -> Any:
        counts._local.inside = 0
        try:
            return step(x)
        finally:
            n = counts._local.inside
            counts._local.inside = None
            counts.launches += 1
            counts.replays += n
            counts.not_one += n != 1

    if original_replay is not None:
        graph_cls.replay = replay
    setattr(owner, attr, launch)
    try:
        yield counts
    finally:
        setattr(owner, attr, step)
        if original_replay is not None:
            graph_cls.replay = original_replay


def gpu_decoder_of(stage: Any) -> str | None:
    """The GPU JPEG decoder the run's decode resolved to (None: the CPU decodes every row)."""
    if stage.packed_decoder is not None:
        return f"{stage.packed_decoder.backend_name} (packed rows)"
    if stage.gpu_decoder is not None:
        return f"{stage.gpu_decoder.backend.name} (decode threads)"
    return None


def gpu_engines_of(stage: Any) -> dict[str, bool] | None:
    """Which of nvImageCodec's GPU backends answered the decoder's start-up probe (the
    hardware JPEG engines among them); None where no nvImageCodec decoder runs."""
    if stage.packed_decoder is not None:
        return dict(stage.packed_decoder.engines) or None
    if stage.gpu_decoder is not None:
        engines = getattr(stage.gpu_decoder.backend, "engines", None)
        return dict(engines) if engines else None
    return None


def _wrong_shape(stage: Any) -> int:
    decoder = stage.packed_decoder if stage.packed_decoder is not None else stage.gpu_decoder
    return int(getattr(decoder, "wrong_shape", 0))


@dataclass
class GpuRows:
    """Rows the GPU JPEG decoder decoded, handed back to the CPU, and of those the ones
    decoded at another shape than their place, while counted."""

    decoded: int = 0
    failed: int = 0
    wrong_shape: int = 0


@contextlib.contextmanager
def count_gpu_rows(stage: Any) -> Iterator[GpuRows]:
    """The rows the GPU decode stage's JPEG decoder decoded while active (final when it ends):
    the packed rows' decoder counts its own; the decode threads' one is counted here, call
    by call, through its instance."""
    counts = GpuRows()
    wrong_shape = _wrong_shape(stage)
    packed = stage.packed_decoder
    if packed is not None:
        decoded, failed = packed.decoded, packed.failed
        try:
            yield counts
        finally:
            counts.decoded, counts.failed = packed.decoded - decoded, packed.failed - failed
            counts.wrong_shape = _wrong_shape(stage) - wrong_shape
        return
    threads = stage.gpu_decoder
    if threads is None:
        yield counts
        return
    original = threads.decode_rows

    async def counting(rows: Any, dest: Any, *, after: Any = None) -> Any:
        result = await original(rows, dest, after=after)
        counts.decoded += len(rows) - len(result.failed)
        counts.failed += len(result.failed)
        return result

    threads.decode_rows = counting
    try:
        yield counts
    finally:
        del threads.decode_rows  # the class's method again
        counts.wrong_shape = _wrong_shape(stage) - wrong_shape
