"""The host the doctor ran on: the report's `environment` section."""

from __future__ import annotations

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


def environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "cpu_count": _cpu_count(),
    }
