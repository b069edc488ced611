"""What holds the GIL, per job: each thread's CPU time, less what decode threads spend in
calls that release the GIL, grouped by what the thread does.

One process serves jobs no faster than its GIL lets the Python parts run one at a time, nor
faster than its cores run all of it:

- GIL-bound jobs/s = 1e6 / (GIL-holding µs per job, summed over every thread);
- core-bound jobs/s = N x 1e6 / (the process's CPU µs per job);

and the most it could serve on N cores is the lower of the two (`project`).

How "holding the GIL" is measured:

- threads whose work is Python (the event loop: reader, batcher, completion, writer and the
  Redis client; the launch thread; the metrics server and other named threads): their CPU
  time, an upper bound (what they spend in system calls or in torch ops, which release the
  GIL, counts as held);
- decode threads: their CPU time less the CPU time spent inside the calls that release the
  GIL: libjpeg-turbo's decode (simplejpeg.decode_jpeg), Pillow's decode (a file's, or a
  decoded array's copy into Pillow's layout), resize, transpose and new canvases, and the
  copy of the pixels into the staging row. What holds the GIL in C counts as held: the
  search for EXIF in the JPEG's bytes, Pillow's `tobytes` behind `np.asarray(image)`.
  `timing_releases()` times them (two `time.thread_time` reads per call, 2-3 calls per
  image: its cost is in docs/benchmarks.md#what-holds-the-gil-per-job) while it is on: the
  bench and `doctor` turn it on for their runs, a serving worker never does;
- threads no Python code started (torch's intra-op pool): C++ only, they never hold the
  GIL; their CPU counts towards the cores.

Per-thread CPU is read from /proc/self/task/<tid>/schedstat (the scheduler's run time in ns,
the clock `time.thread_time` reads), so threads are read from outside without stopping them.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import psutil
import simplejpeg  # type: ignore[import-untyped]
from PIL import Image, ImageFile

from worker.decode import cpu

KINDS = ("event_loop", "decode", "launch", "other")
# Threads without a Python name: they run no Python, so never hold the GIL.
NATIVE = "native"

_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Cell:
    """One thread's time inside GIL-releasing calls; written only by that thread."""

    __slots__ = ("calls", "depth", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0  # a timed call inside another (resize loading the image) counts once


class _Switch:
    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


_cells: dict[int, _Cell] = {}
_local = threading.local()
# Read on every row copy by the decode pool: one attribute lookup when off.
switch = _Switch()


def _cell() -> _Cell:
    cell: _Cell | None = getattr(_local, "cell", None)
    if cell is None:
        cell = _local.cell = _Cell()
        _cells[threading.get_native_id()] = cell
    return cell


def timed(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`fn(*args, **kwargs)`, its thread CPU time counted as spent without the GIL."""
    cell = _cell()
    if cell.depth:
        return fn(*args, **kwargs)
    cell.depth = 1
    t0 = time.thread_time()
    try:
        return fn(*args, **kwargs)
    finally:
        cell.seconds += time.thread_time() - t0
        cell.calls += 1
        cell.depth = 0


def released_s() -> dict[int, tuple[float, int]]:
    """Per native thread id: (seconds inside timed calls, calls), so far."""
    return {tid: (c.seconds, c.calls) for tid, c in list(_cells.items())}


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return timed(fn, *args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class _TimedSimplejpeg:
    """simplejpeg as the CPU decoder sees it, its decode timed."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.decode_jpeg = _wrap(module.decode_jpeg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@contextlib.contextmanager
def timing_releases() -> Iterator[None]:
    """Time the decode path's GIL-releasing calls in every thread while inside."""

    if switch.on:
        yield
        return
    patches: list[tuple[Any, str, Any]] = [
        (cpu, "simplejpeg", _TimedSimplejpeg(simplejpeg)),
        (Image.Image, "resize", _wrap(Image.Image.resize)),
        (Image.Image, "transpose", _wrap(Image.Image.transpose)),
        (ImageFile.ImageFile, "load", _wrap(ImageFile.ImageFile.load)),
        # Pillow keeps RGB 4 bytes a pixel: a libjpeg-turbo array becomes an image through
        # its raw decoder (a copy in C, without the GIL), as a canvas is filled in C.
        (Image, "frombuffer", _wrap(Image.frombuffer)),
        (Image, "new", _wrap(Image.new)),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    switch.on = True
    try:
        yield
    finally:
        switch.on = False
        for owner, name, value in saved:
            setattr(owner, name, value)


def timing_cost_us(calls: int = 20_000) -> float:
    """What timing one call adds on this host, in µs (a timed no-op less a bare one)."""

    def noop() -> None:
        return None

    bare = time.perf_counter()
    for _ in range(calls):
        noop()
    bare = time.perf_counter() - bare
    wrapped = _wrap(noop)
    t0 = time.perf_counter()
    for _ in range(calls):
        wrapped()
    spent = time.perf_counter() - t0
    # The no-op's own calls were counted in this thread's cell: take them back out.
    cell = _cell()
    cell.calls -= calls
    return max(0.0, (spent - bare) * 1e6 / calls)


# --------------------------------------------------------------------------- threads' CPU
def _task_cpu_s(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None  # the thread ended, or no schedstat on this kernel


def threads_cpu_s() -> dict[int, float]:
    """Every live thread's CPU seconds, by native id, to the nanosecond ({} without
    schedstat): a short run's threads may not see a single kernel tick."""
    tids: list[int] = []
    with contextlib.suppress(OSError):
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    return {tid: s for tid in tids if (s := _task_cpu_s(tid)) is not None}


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _task_system_s(tid: int) -> float:
    """The thread's system CPU (in the kernel: socket reads and writes, page faults), to
    the kernel's tick."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[12]) * _TICK_S
    except (OSError, ValueError, IndexError):
        return 0.0


def processes_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds the processes `pids` used so far; a process gone (a decode process
    replaced mid-run) counts as nothing."""
    return sum(_process_cpu_s(pid) for pid in pids)


def processes_cpu_by_pid(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds each of the processes `pids` used so far."""
    return {pid: _process_cpu_s(pid) for pid in pids}


def processes_cpu_since(before: dict[int, float], pids: Iterable[int]) -> float:
    """CPU seconds the processes `pids` used since `before` (processes_cpu_by_pid): each
    one's own difference, a process started since (a replacement) whole. A process gone
    since counts as nothing, rather than taking its earlier CPU off the others'."""
    total = 0.0
    for pid, now in processes_cpu_by_pid(pids).items():
        total += max(0.0, now - before.get(pid, 0.0))
    return total


def _process_cpu_s(pid: int) -> float:
    """Linux's scheduler account (/proc/PID/task/*/schedstat, nanoseconds on the CPU per
    thread) where there is one: the user and system times psutil reads are in clock ticks
    of 10 ms, coarser than a short run of decodes. Else psutil's."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        total_ns = 0
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    with contextlib.suppress(psutil.Error):
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    return 0.0


def thread_kind(name: str | None, *, is_loop: bool) -> str:
    if is_loop:
        return "event_loop"
    if name is None:
        return NATIVE
    if name.startswith(("gpufeed-decode", "bench-cpu-preprocess")):
        return "decode"
    if name.startswith("gpufeed-launch"):
        return "launch"
    return "other"


@dataclass(frozen=True)
class Snapshot:
    """Every thread's CPU seconds and time in timed calls at one moment, and the process's."""

    cpu_s: dict[int, float]
    system_s: dict[int, float]
    released: dict[int, tuple[float, int]]
    process_cpu_s: float
    names: dict[int, str]


def snapshot() -> Snapshot:
    cpu = threads_cpu_s()
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    system = {tid: _task_system_s(tid) for tid in cpu}
    return Snapshot(cpu, system, released_s(), time.process_time(), names)


def gil_figures(
    before: Snapshot,
    after: Snapshot,
    jobs: int,
    *,
    loop_tid: int,
    cores: tuple[int, ...] = (16,),
    exclude_loop_s: float = 0.0,
    model_on_cpu: bool = False,
    decoders_cpu_s: float = 0.0,
    writer_cpu_s: float = 0.0,
    intake_cpu_s: float = 0.0,
) -> dict[str, Any] | None:
    """Per job, by thread kind: GIL-holding µs and CPU µs between two snapshots, and the
    projection for each number of cores in `cores`. `after` names the threads: take it
    while they are alive. `exclude_loop_s`: CPU the loop thread spent on work that is not
    the worker's (the doctor's feeder). `model_on_cpu`: the launch thread computes a real
    model on the CPU, in torch ops that release the GIL, so its CPU time is a loose bound
    (the flag travels with the figures). `decoders_cpu_s`: the CPU of the worker's decode
    processes, which hold no GIL of this process but share its cores (the core-bound
    projection counts it); `writer_cpu_s`: the CPU of its result writer's process
    (where the result writer runs in one), and `intake_cpu_s` its intake's processes'
    (where jobs are read in them), counted alike. None without jobs or without
    per-thread clocks."""
    if jobs <= 0 or not after.cpu_s:
        return None
    held = dict.fromkeys(KINDS, 0.0)
    cpu = dict.fromkeys((*KINDS, NATIVE), 0.0)
    system = dict.fromkeys((*KINDS, NATIVE), 0.0)
    released = 0.0
    timed_calls = 0
    threads = dict.fromkeys((*KINDS, NATIVE), 0)
    for tid, end in after.cpu_s.items():
        spent = max(0.0, end - before.cpu_s.get(tid, 0.0))
        kind = thread_kind(after.names.get(tid), is_loop=tid == loop_tid)
        if kind == "event_loop":
            spent = max(0.0, spent - exclude_loop_s)
        threads[kind] += 1
        cpu[kind] += spent
        system[kind] += max(0.0, after.system_s.get(tid, 0.0) - before.system_s.get(tid, 0.0))
        if kind == NATIVE:
            continue
        r_end, c_end = after.released.get(tid, (0.0, 0))
        r_start, c_start = before.released.get(tid, (0.0, 0))
        free = min(spent, max(0.0, r_end - r_start)) if kind == "decode" else 0.0
        released += free
        timed_calls += c_end - c_start
        held[kind] += spent - free
    process_s = max(0.0, after.process_cpu_s - before.process_cpu_s - exclude_loop_s)
    per_job = 1e6 / jobs
    gil_us = {k: round(v * per_job, 1) for k, v in held.items()}
    cpu_us = {k: round(v * per_job, 1) for k, v in cpu.items()}
    process_us = (process_s + decoders_cpu_s + writer_cpu_s + intake_cpu_s) * per_job
    return {
        "jobs": jobs,
        "threads": threads,
        "gil_us_per_job": gil_us,
        "cpu_us_per_job": cpu_us,
        # Of that CPU, the part in the kernel: system calls release the GIL, so this is
        # how loose the bound of the threads whose whole CPU time counts as held is.
        "system_us_per_job": {k: round(v * per_job, 1) for k, v in system.items()},
        # The worker's CPU per job, its decode, writer and intake processes' included.
        "process_cpu_us_per_job": round(process_us, 1),
        "decode_processes_cpu_us_per_job": round(decoders_cpu_s * per_job, 1),
        "writer_process_cpu_us_per_job": round(writer_cpu_s * per_job, 1),
        "intake_process_cpu_us_per_job": round(intake_cpu_s * per_job, 1),
        "decode_released_us_per_job": round(released * per_job, 1),
        "timed_calls_per_job": round(timed_calls / jobs, 2),
        # True: the launch thread's figure (and so the projection) is the model's compute on
        # the CPU, not what launching costs on a GPU host; the null model's is the latter.
        "launch_computes_model": model_on_cpu,
        "projections": [project(gil_us, process_us, n) for n in cores],
    }


def project(
    gil_us_per_job: Mapping[str, float], cpu_us_per_job: float, cores: int
) -> dict[str, Any]:
    """The most one process could serve on `cores` cores, from what one job costs: GIL-bound
    1e6 / sum(GIL µs), core-bound cores x 1e6 / CPU µs, the lower binds (None: unbounded)."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1 (got {cores})")
    gil_total = sum(max(0.0, v) for v in gil_us_per_job.values())
    gil_bound = 1e6 / gil_total if gil_total > 0 else math.inf
    core_bound = cores * 1e6 / cpu_us_per_job if cpu_us_per_job > 0 else math.inf
    best = min(gil_bound, core_bound)

    def figure(x: float) -> float | None:
        return None if math.isinf(x) else round(x, 1)

    return {
        "cores": cores,
        "gil_us_per_job": round(gil_total, 1),
        "cpu_us_per_job": round(cpu_us_per_job, 1),
        "gil_bound_jobs_per_s": figure(gil_bound),
        "cores_bound_jobs_per_s": figure(core_bound),
        "jobs_per_s": figure(best),
        "binds": None if math.isinf(best) else ("GIL" if gil_bound <= core_bound else "cores"),
    }
