"""The host a tool ran on: the doctor report's `environment` section, and the GPU check's."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from typing import Any

import torch


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def environment(*, build: bool = False) -> dict[str, Any]:
    """The host. The doctor's schema allows exactly these keys; with `build` (the GPU
    check's report) also the CUDA torch was built for, torchvision's version, and on CUDA
    the device count and the first device's compute capability."""
    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "cpu_count": _cpu_count(),
    }
    if build:
        env["torch_cuda"] = torch.version.cuda
        with contextlib.suppress(ImportError):
            import torchvision

            env["torchvision"] = torchvision.__version__
        if cuda:
            env["device_count"] = torch.cuda.device_count()
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env
