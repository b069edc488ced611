"""Which device runs the model, its streams, and events that work the same on CPU and CUDA.

The pipeline's stage boundaries speak of streams and events on every device: on CUDA they are
real (a side stream for copies, a compute stream, events recorded after each step); on the
CPU the work is done by the time the launch call returns, so events are born completed.
Nothing downstream branches on the device type except through this module.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.base.errors import ConfigError, GpufeedError


class Event(Protocol):
    """The part of torch.cuda.Event the pipeline uses; `query()` never blocks."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class FencedError(GpufeedError, RuntimeError):
    """A stage raised after it had queued device work for a batch's slot. `fence` fires once
    that work has run: the pinned slot is released after it (its twin already waits for
    it), never on a host wait."""

    def __init__(self, message: str, fence: Event) -> None:
        super().__init__(message)
        self.fence = fence


class DoneEvent:
    """A CPU 'event': the work it marks finished before it was created."""

    def __init__(self, wall_s: float = 0.0) -> None:
        self._wall_s = wall_s

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        if not isinstance(end_event, DoneEvent):
            raise TypeError("elapsed_time needs two events of the same device")
        return (end_event._wall_s - self._wall_s) * 1000.0


@dataclass
class DeviceContext:
    device: torch.device
    # Host-to-device copies run here so that they overlap the previous batch's compute.
    copy_stream: torch.cuda.Stream | None
    compute_stream: torch.cuda.Stream | None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def name(self) -> str:
        if self.is_cuda:
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return "cpu"


def resolve_device(spec: str) -> torch.device:
    """Turn GPUFEED_DEVICE into a torch.device, failing with an operator-friendly line."""
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::([0-9]{1,3}))?", spec)
    if match is None:
        raise ConfigError(f"GPUFEED_DEVICE: must be auto, cpu, cuda or cuda:N (got {spec!r})")
    if not torch.cuda.is_available():
        raise ConfigError(f"GPUFEED_DEVICE: {spec} requested but CUDA is not available here")
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"GPUFEED_DEVICE: {spec} requested but only {count} CUDA device(s) are visible"
        )
    return torch.device("cuda", index)


def make_context(device: torch.device) -> DeviceContext:
    if device.type != "cuda":
        return DeviceContext(device=device, copy_stream=None, compute_stream=None)
    torch.cuda.set_device(device)
    return DeviceContext(
        device=device,
        copy_stream=torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        compute_stream=torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
    )


def cuda_event(*, timing: bool = False) -> torch.cuda.Event:
    """A CUDA event; timing ones cost a little more to record, so only where read."""
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def prepare_graph_thread() -> None:
    """Give the calling thread its own CUDA-graph tree managers; call it first thing on the
    thread that compiles, records and replays the step.

    Inductor keeps them in a `threading.local` that it fills only on the thread that first
    imported `torch._inductor.cudagraph_trees` (and, through torch's TLS stash, in
    autograd's threads). Anywhere else, a reduce-overhead step's first call fails an
    assertion inside inductor, which dynamo reports as a graph break, and start-up refuses
    the step: so it went on a GPU host, where the module was imported on the main thread
    and the step compiled on the launch thread. Every graph of a worker is recorded and
    replayed on its launch thread, so one set of managers there is all it needs."""
    # torch's compiler internals load when a step is compiled, not with the worker.
    from torch._inductor import cudagraph_trees  # noqa: PLC0415

    local = getattr(cudagraph_trees, "local", None)
    if local is None or hasattr(local, "tree_manager_containers"):
        return
    initialize = getattr(cudagraph_trees, "_initialize_tls", None)
    if callable(initialize):
        initialize(local)
        return
    # Releases without the helper: the same two objects it sets up.
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


def mark_cudagraph_step() -> None:
    """Tell CUDA-graph trees that a new step begins: outputs of the previous replay are no
    longer referenced (their values were already copied out), so it may overwrite them."""
    torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
