"""The host a tool ran on, measured: the doctor's and the GPU check's `environment` block
and the bench's `host` block, each through report_head.block (the fields, their names and
which report carries which: report_head.FIELDS, docs/report-common.md)."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from typing import Any

import torch

from worker.tools.harness.provenance import host_extras
from worker.tools.harness.report_head import BENCH, DOCTOR, GPU_CHECK, block


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _common() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def environment(*, build: bool = False) -> dict[str, Any]:
    """The doctor's block; with `build`, the GPU check's: also the CUDA torch was built for,
    torchvision's version, on CUDA the device count and the first device's compute
    capability, and the CPU model and source commit measured."""
    cuda = torch.cuda.is_available()
    measured: dict[str, Any] = {
        **_common(),
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "cpu_count": _cpu_count(),
    }
    if not build:
        return block(DOCTOR, measured)
    measured["torch_cuda"] = torch.version.cuda
    with contextlib.suppress(ImportError):
        import torchvision

        measured["torchvision"] = torchvision.__version__
    if cuda:
        measured["device_count"] = torch.cuda.device_count()
        measured["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return block(GPU_CHECK, {**measured, **host_extras()})


def bench_host(device: torch.device, cores: int) -> dict[str, Any]:
    """The bench's block at its start, on `device` with `cores` (the host's: its figures are
    per host); the bench adds `load_avg_1m_at_end` when it ends."""
    measured: dict[str, Any] = {
        **_common(),
        "platform": platform.platform(),
        "cpu_count": cores,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        **host_extras(),
    }
    if device.type == "cuda":
        measured["device_name"] = torch.cuda.get_device_name(device)
    return block(BENCH, measured)
