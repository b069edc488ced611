"""What a run costs the machine: CPU per thread group, Redis's CPU, GPU utilisation and memory.

CPU time is read per thread (from /proc: the scheduler's nanoseconds) before and after the
run and grouped by what the thread does, so a run's CPU can be split into decode, model,
event loop and the rest without instrumenting the pipeline:

- decode: the decode pool's threads (`gpufeed-decode*`, the ablation's `bench-cpu-*`, the
  stage-rate threads);
- model: the launch thread (`gpufeed-launch*`) and the threads no Python code named, which
  in this process are torch's intra-op pool computing the model on the CPU;
- event loop: the main thread (reader, batcher, writer, Redis client, result collection);
- naive: the naive worker's one thread (decode, transforms and model launch, in turn);
- other: every other named thread (samplers, executors).

Outside the process: redis-server's CPU, and the CPU every other process (and the
hypervisor's steal) took meanwhile, from the host's counters: on a shared host that is CPU
the pipeline could not have.

GPU figures come from NVML through `GpuSampler` (worker/observe/gpu_sampler.py); peak memory from
torch's allocator. Neither touches the CUDA stream the pipeline runs on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from worker.decode import gil_account
from worker.observe.gpu_sampler import GpuSampler

GROUPS = ("decode", "model", "event_loop", "naive", "other")


def _group(name: str | None) -> str:
    if name is None:
        return "model"  # torch's intra-op (OpenMP) threads carry no Python name
    if name.startswith(("gpufeed-decode", "bench-cpu-preprocess", "bench-decode")):
        return "decode"
    if name.startswith("gpufeed-launch"):
        return "model"
    if name == "MainThread":
        return "event_loop"
    if name.startswith("bench-naive"):
        return "naive"
    return "other"


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every live thread of this process, by native id: from
    the scheduler's nanosecond count where the kernel keeps one, else to the kernel's tick
    (psutil), which a short run's threads may not reach."""
    return gil_account.threads_cpu_s() or {
        t.id: t.user_time + t.system_time for t in psutil.Process().threads()
    }


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of the process `pid` and its live children:
    a worker and the processes it started (decode, intake, writer)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def host_busy_s() -> float:
    """CPU seconds all cores of the host spent busy (not idle, not waiting for I/O)."""
    t = psutil.cpu_times()
    return float(sum(t)) - float(t.idle) - float(getattr(t, "iowait", 0.0))


def _names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class RunProbe:
    """start() before the measured window, stop() after it; `result()` then says what it cost."""

    def __init__(
        self,
        device: torch.device,
        *,
        redis_pid: int | None = None,
        decoder_pids: Sequence[int] = (),
        writer_pids: Sequence[int] = (),
        intake_pids: Sequence[int] = (),
    ) -> None:
        """`decoder_pids` and `writer_pids`: the worker's decode processes and its result
        writer's, `intake_pids` its intake's, whose CPU counts as the worker's in the
        projection (their GIL is their own)."""
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.sampler = GpuSampler(device.index or 0, interval_s=0.1)
        if not self.is_cuda:
            self.sampler.available = False
            self.sampler.reason = "CPU device: no GPU to sample"
        self._redis: psutil.Process | None = None
        if redis_pid is not None:
            with contextlib.suppress(psutil.Error):
                self._redis = psutil.Process(redis_pid)
        self._decoder_pids = tuple(decoder_pids)
        self._writer_pids = tuple(writer_pids)
        self._writer_before: dict[int, float] = {}
        self._writer_s = 0.0
        self._intake_pids = tuple(intake_pids)
        self._intake_before: dict[int, float] = {}
        self._intake_s = 0.0
        self._decoders_before = 0.0
        self._decoders_after = 0.0
        self._before: dict[int, float] = {}
        self._after: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._redis_before = 0.0
        self._redis_after = 0.0
        self._host_before = 0.0
        self._host_after = 0.0
        self._t0 = 0.0
        self.wall_s = 0.0
        # What holds the GIL (worker/decode/gil_account.py): the thread that started the probe is
        # the event loop's.
        self._loop_tid = 0
        self._gil_before: gil_account.Snapshot | None = None
        self._gil_after: gil_account.Snapshot | None = None

    def _redis_cpu_s(self) -> float:
        if self._redis is None:
            return 0.0
        try:
            times = self._redis.cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    def _decoders_cpu_s(self) -> float:
        return gil_account.processes_cpu_s(self._decoder_pids)

    def start(self) -> RunProbe:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sampler.start()
        self._redis_before = self._redis_cpu_s()
        self._decoders_before = self._decoders_cpu_s()
        self._writer_before = gil_account.processes_cpu_by_pid(self._writer_pids)
        self._intake_before = gil_account.processes_cpu_by_pid(self._intake_pids)
        self._host_before = host_busy_s()
        self._before = thread_cpu_s()
        self._loop_tid = threading.get_native_id()
        self._gil_before = gil_account.snapshot()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> RunProbe:
        """Call while the run's threads are still alive (before the worker shuts down)."""
        self.wall_s = time.perf_counter() - self._t0
        self._gil_after = gil_account.snapshot()
        self._after = thread_cpu_s()
        self._names = _names()
        self._redis_after = self._redis_cpu_s()
        self._decoders_after = self._decoders_cpu_s()
        self._writer_s = gil_account.processes_cpu_since(self._writer_before, self._writer_pids)
        self._intake_s = gil_account.processes_cpu_since(self._intake_before, self._intake_pids)
        self._host_after = host_busy_s()
        self.sampler.stop()
        return self

    def gil(self, jobs: int, cores: int, *, model_on_cpu: bool) -> dict[str, Any] | None:
        """GIL-holding and CPU µs per job by thread kind, and the projection for 16 cores
        and for this host's (worker/decode/gil_account.py)."""
        if self._gil_before is None or self._gil_after is None:
            return None
        figures = gil_account.gil_figures(
            self._gil_before,
            self._gil_after,
            jobs,
            loop_tid=self._loop_tid,
            cores=tuple(sorted({16, cores})),
            model_on_cpu=model_on_cpu,
            decoders_cpu_s=max(0.0, self._decoders_after - self._decoders_before),
            writer_cpu_s=self._writer_s,
            intake_cpu_s=self._intake_s,
        )
        if figures is not None:
            figures["timed_call_us"] = round(gil_account.timing_cost_us(), 3)
        return figures

    def cpu_s_by_group(self) -> dict[str, float]:
        out = dict.fromkeys(GROUPS, 0.0)
        for tid, cpu in self._after.items():
            delta = cpu - self._before.get(tid, 0.0)
            if delta > 0:
                out[_group(self._names.get(tid))] += delta
        out["redis_server"] = max(0.0, self._redis_after - self._redis_before)
        out["decode_processes"] = max(0.0, self._decoders_after - self._decoders_before)
        out["writer_process"] = self._writer_s
        out["intake_process"] = self._intake_s
        ours = sum(out.values())
        out["other_processes"] = max(0.0, self._host_after - self._host_before - ours)
        return out

    def result(self, images: int) -> dict[str, Any]:
        """CPU (percent of one core, and core-ms per image by group), GPU figures."""
        cpu = self.cpu_s_by_group()
        process_s = sum(v for k, v in cpu.items() if k in GROUPS)
        wall = max(self.wall_s, 1e-9)
        summary = self.sampler.summary()
        metrics = summary["metrics"]
        self.sampler.close()
        per_image = {k: round(v * 1000 / max(images, 1), 3) for k, v in cpu.items()}
        per_image["total"] = round(
            sum(
                v
                for k, v in per_image.items()
                if k
                in (*GROUPS, "redis_server", "decode_processes", "writer_process", "intake_process")
            ),
            3,
        )
        out: dict[str, Any] = {
            "cpu_process_pct": round(100 * process_s / wall, 1),
            "cpu_redis_pct": round(100 * cpu["redis_server"] / wall, 1),
            "cpu_other_processes_pct": round(100 * cpu["other_processes"] / wall, 1),
            "cpu_system_pct": metrics.get("system_cpu_pct", {}).get("mean"),
            "cpu_core_ms_per_image": per_image,
            "gpu_util_pct": None,
            "gpu_mem_used_mib": None,
            "gpu_mem_peak_allocated_mib": None,
        }
        if self.is_cuda:
            out["gpu_util_pct"] = metrics.get("gpu_util_pct", {}).get("mean")
            out["gpu_util_p50_pct"] = metrics.get("gpu_util_pct", {}).get("p50")
            out["gpu_mem_used_mib"] = metrics.get("mem_used_mib", {}).get("mean")
            out["gpu_mem_peak_allocated_mib"] = round(
                torch.cuda.max_memory_allocated(self.device) / 2**20, 1
            )
            if not summary["available"]:
                out["gpu_note"] = summary["reason"]
        return out
