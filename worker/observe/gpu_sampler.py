"""A background sampler of GPU and CPU utilisation, through NVML and psutil.

It never touches the CUDA context (NVML is a separate driver interface), so it can watch
the pipeline without perturbing it. Samples go into a bounded deque; `summary()` gives
mean, p50 and p95 per metric. Without NVML (no driver, no nvidia-ml-py) it still samples
the CPU and says why the GPU metrics are missing.

The sampler is given the CUDA device index the process computes on. That is not an NVML
index: NVML numbers every GPU of the host in PCI order, while CUDA numbers only the
devices CUDA_VISIBLE_DEVICES lets through, in its own order (fastest first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID). So the device is found in NVML by what identifies it on
both sides: its UUID, else its PCI bus id (both asked of CUDA when this process already
initialised it), else the CUDA_VISIBLE_DEVICES entry it came from (a UUID, or a physical
ordinal, read in PCI order).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from worker.base.errors import GpufeedError

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


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML lists it."""

    index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-..."
    pci_bus_id: str  # "00000000:3B:00.0"


@dataclass(frozen=True)
class CudaIdentity:
    """What CUDA says identifies the device this process computes on."""

    uuid: str | None = None  # with or without the "GPU-" prefix
    pci_bus_id: str | None = None


class DeviceNotFound(GpufeedError, LookupError):
    """The CUDA device could not be found among NVML's devices."""


def _uuid_key(uuid: str) -> str:
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def _pci_key(bus_id: str) -> tuple[int, int, int, int]:
    """(domain, bus, device, function) of "DDDDDDDD:BB:DD.F" or "DDDD:BB:DD.F"."""
    domain, bus, rest = bus_id.strip().split(":")
    device, _, function = rest.partition(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function or "0", 16)


def nvml_index_for(
    cuda_index: int,
    devices: Sequence[NvmlDevice],
    *,
    identity: CudaIdentity | None = None,
    visible: str | None = None,
    order: str | None = None,
) -> tuple[int, str]:
    """The NVML index of CUDA device `cuda_index`, and how it was matched ("uuid", "pci bus
    id", "CUDA_VISIBLE_DEVICES uuid", "CUDA_VISIBLE_DEVICES ordinal"). `visible` and
    `order` are CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER. Raises DeviceNotFound."""
    if identity is not None and identity.uuid:
        key = _uuid_key(identity.uuid)
        for d in devices:
            if _uuid_key(d.uuid) == key:
                return d.index, "uuid"
    if identity is not None and identity.pci_bus_id:
        key4 = _pci_key(identity.pci_bus_id)
        for d in devices:
            if _pci_key(d.pci_bus_id)[:3] == key4[:3]:
                return d.index, "pci bus id"
    # NVML lists GPUs in PCI order; CUDA's ordinals (before CUDA_VISIBLE_DEVICES) follow
    # it under CUDA_DEVICE_ORDER=PCI_BUS_ID and, on a host of identical GPUs, by default.
    by_pci = sorted(devices, key=lambda d: _pci_key(d.pci_bus_id))
    if visible is None:
        if cuda_index >= len(by_pci):
            raise DeviceNotFound(f"CUDA device {cuda_index}: NVML lists {len(by_pci)} GPU(s)")
        return by_pci[cuda_index].index, "ordinal"
    if not visible.strip():
        raise DeviceNotFound("CUDA_VISIBLE_DEVICES is empty: no CUDA device is visible")
    entries = [e.strip() for e in visible.split(",")]
    if cuda_index >= len(entries):
        raise DeviceNotFound(
            f"CUDA device {cuda_index} is not visible (CUDA_VISIBLE_DEVICES={visible})"
        )
    entry = entries[cuda_index]
    if entry.upper().startswith("MIG-"):
        raise DeviceNotFound(f"CUDA_VISIBLE_DEVICES entry {entry}: MIG instances are not mapped")
    if entry.upper().startswith("GPU-"):
        key = _uuid_key(entry)
        matches = [d for d in devices if _uuid_key(d.uuid).startswith(key)]
        if len(matches) != 1:
            raise DeviceNotFound(
                f"CUDA_VISIBLE_DEVICES entry {entry} matches {len(matches)} NVML device(s)"
            )
        return matches[0].index, "CUDA_VISIBLE_DEVICES uuid"
    try:
        ordinal = int(entry, 0)
    except ValueError:
        raise DeviceNotFound(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not understood") from None
    if not 0 <= ordinal < len(by_pci):
        raise DeviceNotFound(
            f"CUDA_VISIBLE_DEVICES entry {ordinal}: NVML lists {len(by_pci)} GPU(s)"
        )
    how = "CUDA_VISIBLE_DEVICES ordinal"
    if (order or "").upper() != "PCI_BUS_ID":
        how += " (CUDA_DEVICE_ORDER is not PCI_BUS_ID: PCI order assumed)"
    return by_pci[ordinal].index, how


def cuda_identity(cuda_index: int) -> CudaIdentity | None:
    """UUID and PCI bus id of a CUDA device, asked of torch only when this process has
    already initialised CUDA (the sampler never creates a CUDA context of its own)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        props = torch.cuda.get_device_properties(cuda_index)
    except (RuntimeError, AssertionError, ValueError):
        return None
    uuid = str(getattr(props, "uuid", "") or "") or None
    pci = None
    if hasattr(props, "pci_bus_id"):
        pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return CudaIdentity(uuid=uuid, pci_bus_id=pci)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Nvml:
    """The few NVML calls used, behind one object (pynvml from nvidia-ml-py)."""

    def __init__(
        self, cuda_index: int, *, nv: Any = None, identity: CudaIdentity | None = None
    ) -> None:
        self.nv: Any = nv if nv is not None else importlib.import_module("pynvml")
        self.nv.nvmlInit()
        devices = []
        for i in range(self.nv.nvmlDeviceGetCount()):
            h = self.nv.nvmlDeviceGetHandleByIndex(i)
            bus_id = _text(self.nv.nvmlDeviceGetPciInfo(h).busId)
            devices.append(NvmlDevice(i, _text(self.nv.nvmlDeviceGetUUID(h)), bus_id))
        self.nvml_index, self.mapping = nvml_index_for(
            cuda_index,
            devices,
            identity=identity if identity is not None else cuda_identity(cuda_index),
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            order=os.environ.get("CUDA_DEVICE_ORDER"),
        )
        self.handle = self.nv.nvmlDeviceGetHandleByIndex(self.nvml_index)
        self.uuid = devices[self.nvml_index].uuid
        self.name = _text(self.nv.nvmlDeviceGetName(self.handle))

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
            # KB/s over NVML's own counting window (nvmlDeviceGetPcieThroughput).
            tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
            out["pcie_tx_mib_s"] = tx / 1024.0
            out["pcie_rx_mib_s"] = rx / 1024.0
        # The hardware JPEG engines (NVJPG) where the GPU has them and NVML reports them:
        # what GPU decode leaves of them idle.
        with contextlib.suppress(nv.NVMLError, AttributeError):
            out["jpg_util_pct"] = float(nv.nvmlDeviceGetJpgUtilization(h)[0])
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


class GpuSampler:
    """start() -> ... -> stop() -> summary(). Thread-safe to read while running."""

    def __init__(
        self,
        device_index: int = 0,  # the CUDA device index (not NVML's: see the module doc)
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
        self.nvml_mapping: dict[str, Any] = {}
        factory = nvml_factory or _Nvml
        try:
            self._nvml = factory(device_index)
            self.available = True
            self.gpu_name = str(getattr(self._nvml, "name", ""))
            if hasattr(self._nvml, "nvml_index"):
                self.nvml_mapping = {
                    "cuda_index": device_index,
                    "nvml_index": self._nvml.nvml_index,
                    "uuid": getattr(self._nvml, "uuid", None),
                    "matched_by": self._nvml.mapping,
                }
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
            "nvml_device": self.nvml_mapping,
            "interval_s": self.interval_s,
            "samples": len(self._samples),
            "metrics": summarize(self.samples()),
        }
