"""A background sampler of GPU and CPU utilisation, through NVML and psutil.

It never touches the CUDA context (NVML is a separate driver interface), so it can watch
the pipeline without perturbing it. Samples go into a bounded deque; `summary()` gives
mean, p50 and p95 per metric. Without NVML (no driver, no nvidia-ml-py) it still samples
the CPU and says why the GPU metrics are missing.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import psutil

Sample = dict[str, float]


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted, non-empty list (q in 0..100)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def summarize(samples: Iterable[Sample]) -> dict[str, dict[str, float]]:
    """{metric: {mean, p50, p95, n}} over the samples that carry the metric."""
    columns: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.items():
            if key != "t" and value is not None and not math.isnan(value):
                columns.setdefault(key, []).append(float(value))
    out: dict[str, dict[str, float]] = {}
    for key, values in columns.items():
        values.sort()
        out[key] = {
            "mean": round(sum(values) / len(values), 3),
            "p50": round(percentile(values, 50), 3),
            "p95": round(percentile(values, 95), 3),
            "n": len(values),
        }
    return out


class _Nvml:
    """The few NVML calls used, behind one object (pynvml from nvidia-ml-py)."""

    def __init__(self, index: int) -> None:
        self.nv: Any = importlib.import_module("pynvml")
        self.nv.nvmlInit()
        self.handle = self.nv.nvmlDeviceGetHandleByIndex(index)
        name = self.nv.nvmlDeviceGetName(self.handle)
        self.name = name.decode() if isinstance(name, bytes) else str(name)

    def sample(self) -> Sample:
        nv, h = self.nv, self.handle
        out: Sample = {}
        util = nv.nvmlDeviceGetUtilizationRates(h)
        out["gpu_util_pct"] = float(util.gpu)
        out["mem_bw_util_pct"] = float(util.memory)
        out["mem_used_mib"] = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
        with contextlib.suppress(nv.NVMLError):
            out["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        with contextlib.suppress(nv.NVMLError):
            out["sm_clock_mhz"] = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        with contextlib.suppress(nv.NVMLError):
            # KB/s over the last ~20 ms, per NVML.
            tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
            out["pcie_tx_mib_s"] = tx / 1024.0
            out["pcie_rx_mib_s"] = rx / 1024.0
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


class GpuSampler:
    """start() -> ... -> stop() -> summary(). Thread-safe to read while running."""

    def __init__(
        self,
        device_index: int = 0,
        *,
        interval_s: float = 0.1,
        max_samples: int = 36_000,
        nvml_factory: Callable[[int], Any] | None = None,
    ) -> None:
        self.device_index = device_index
        self.interval_s = interval_s
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._nvml: Any = None
        self.available = False
        self.reason = ""
        self.gpu_name = ""
        factory = nvml_factory or _Nvml
        try:
            self._nvml = factory(device_index)
            self.available = True
            self.gpu_name = str(getattr(self._nvml, "name", ""))
        except Exception as exc:  # noqa: BLE001 - no module, no driver, no device: all "unavailable"
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}".strip()
        self._proc = psutil.Process()

    def start(self) -> GpuSampler:
        if self._thread is not None:
            return self
        self._stop.clear()
        # Prime psutil's CPU counters: their first reading is always 0.
        self._proc.cpu_percent(None)
        psutil.cpu_percent(None)
        self._thread = threading.Thread(target=self._run, name="gpufeed-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def sample_once(self) -> Sample:
        sample: Sample = {
            "t": time.monotonic(),
            "process_cpu_pct": self._proc.cpu_percent(None),
            "system_cpu_pct": psutil.cpu_percent(None),
        }
        if self.available:
            try:
                sample.update(self._nvml.sample())
            except Exception as exc:  # noqa: BLE001 - a failing driver stops GPU sampling, not us
                self.available = False
                self.reason = f"NVML failed while sampling: {type(exc).__name__}: {exc}"
        with self._lock:
            self._samples.append(sample)
        return sample

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        self.stop()
        if self._nvml is not None and hasattr(self._nvml, "close"):
            self._nvml.close()

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def summary(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "reason": self.reason,
            "gpu": self.gpu_name,
            "interval_s": self.interval_s,
            "samples": len(self._samples),
            "metrics": summarize(self.samples()),
        }
