"""The feed plan: how many decode processes (or threads), how deep the ring, where images
are resized; chosen at start-up from the host and the settings, each choice with its reason.

The worker logs it as one line (`feed_plan`); `doctor` and the bench print it. Every
choice follows a setting when one is given; `auto` picks from the host:

- decode processes: unless the tuning constant DECODE_THREADS is set (a run that sized
  the threads keeps them), on 4 cores or more, one per core but one, left to the worker's own
  process (the event loop, Redis, the launches), at most 32. Where one process's GIL binds
  (many cores), processes take decode out of it: decode threads beside a busy Python
  thread wait out the GIL for every image, processes do not. Where the cores bind (few),
  the worker's own CPU competes with K busy processes, and threads serve more, so below 4
  cores `auto` keeps threads (docs/concepts.md#decode-processes gives the figures of
  both). Threads stay too where
  processes cannot run: a decode hook that only a thread can run (tests), or no memory
  files (memfd, Linux only). GPU decode (GPUFEED_DECODE) works with either: with processes
  the GPU's engines decode their share of each batch into its packed rows
  (worker/decode/gpu_packed.py), with threads the worker routes images to it;
- ring slots: the tuning constant RING_SLOTS;
- resize placement: worker/model/resample.py (`choose_placement`);
- the result writer: unless the tuning constant RESULT_WRITER names it, in a process of its own on 4
  cores or more (worker/delivery/writer_process.py), for the reason decode goes to
  processes there: building and publishing results is per-job Python, and on a GPU host
  the worker's GIL binds. On fewer cores the writer's process would compete for the same
  cores as the rest, so it stays on the event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from worker.base.errors import ConfigError
from worker.config import table
from worker.config.settings import WorkerConfig

# Below this many cores `auto` decodes on threads (see the module's docstring).
MIN_CORES_FOR_PROCESSES = 4
MAX_AUTO_PROCESSES = 32


@dataclass(frozen=True)
class FeedPlan:
    decode_processes: int  # 0: decode threads in the worker's process
    decode_threads: int  # threads when decode_processes is 0
    decoders_why: str
    ring_slots: int
    ring_why: str
    placement: str  # where images are resized: device or host
    placement_why: str
    cores: int
    result_writer: str = "loop"  # process: worker/delivery/writer_process.py
    writer_why: str = ""
    intake: str = "loop"  # process: worker/delivery/intake_process.py
    intake_why: str = ""
    # GPU decode into packed rows (worker/decode/gpu_packed.py): the share of each batch's
    # rows offered to the GPU's JPEG decoder (None: not asked for), and why.
    gpu_decode_share: float | None = None
    gpu_decode_why: str = ""

    @property
    def decoders(self) -> str:
        if self.decode_processes:
            return f"{self.decode_processes} decode processes"
        return f"{self.decode_threads} decode threads"

    @property
    def packed(self) -> bool:
        """Whether a slot holds its images packed at their decoded size (the device
        placement fed by decode processes, worker/decode/packed.py)."""
        return self.placement == "device" and self.decode_processes > 0

    def line(self) -> str:
        """The plan in one line, for a log or a report."""
        staged = (
            "; rows packed at their decoded size (decode processes, device placement)"
            if self.packed
            else ""
        )
        if self.gpu_decode_share is not None:
            staged += (
                f"; the GPU decodes {self.gpu_decode_share:.0%} of each batch's rows "
                f"({self.gpu_decode_why})"
            )
        writer = "a process of its own" if self.result_writer == "process" else "the event loop"
        intake = "a process of its own" if self.intake == "process" else "the event loop"
        return (
            f"{self.decoders} ({self.decoders_why}); ring {self.ring_slots} slots "
            f"({self.ring_why}); resize on the {self.placement} ({self.placement_why})"
            f"{staged}; jobs read from {intake} ({self.intake_why}); results published from "
            f"{writer} ({self.writer_why})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "decode_processes": self.decode_processes,
            "decode_threads": self.decode_threads if not self.decode_processes else 0,
            "decoders_why": self.decoders_why,
            "ring_slots": self.ring_slots,
            "ring_why": self.ring_why,
            "placement": self.placement,
            "placement_why": self.placement_why,
            "packed_rows": self.packed,
            "gpu_decode_share": self.gpu_decode_share,
            "gpu_decode_why": self.gpu_decode_why,
            "result_writer": self.result_writer,
            "writer_why": self.writer_why,
            "intake": self.intake,
            "intake_why": self.intake_why,
            "cores": self.cores,
            "line": self.line(),
        }


def usable_cores() -> int:
    """The cores this process may run on (a cpuset or taskset narrows them), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def shared_memory_files() -> bool:
    """Whether this system has anonymous memory files (memfd), which decode processes use."""
    return hasattr(os, "memfd_create")


def plan_feed(
    cfg: WorkerConfig,
    *,
    placement: str,
    placement_why: str,
    thread_only_hook: bool,
    default_threads: int,
    cores: int | None = None,
) -> FeedPlan:
    """The plan for `cfg` on this host. `thread_only_hook`: a decode hook is set that only
    a thread can run. Raises ConfigError where the settings ask for what cannot be."""
    cores = cores or usable_cores()
    threads = cfg.decode_threads or default_threads
    k, why = decode_processes_for(cfg, cores, thread_only_hook=thread_only_hook)
    sized = table.given("decode_threads", cfg.decode_threads)
    if k and cfg.decode_threads:
        why += f"; {sized} unused (it sizes decode threads)"
    if k == 0:
        why += f"; {threads} threads ({sized if cfg.decode_threads else 'per core'})"
    writer, writer_why = result_writer_for(cfg, cores)
    intake, intake_why = intake_for(cfg, k)
    return FeedPlan(
        decode_processes=k,
        decode_threads=threads,
        decoders_why=why,
        ring_slots=cfg.ring_slots,
        ring_why=table.given("ring_slots", cfg.ring_slots),
        placement=placement,
        placement_why=placement_why,
        cores=cores,
        result_writer=writer,
        writer_why=writer_why,
        intake=intake,
        intake_why=intake_why,
    )


def intake_for(cfg: WorkerConfig, decode_processes: int) -> tuple[str, str]:
    """(`process` or `loop`, why): where the reads run, given the decode processes chosen.
    Only decode processes can read a payload from the intake's shared memory (on a Redis
    Cluster, one intake's process per shard reads its master)."""
    given = table.given("intake", cfg.intake)
    if cfg.intake == "loop":
        return "loop", given
    if cfg.intake == "process":
        if not decode_processes:
            raise ConfigError(
                f"{given}: image bytes go from the intake's process to decode processes only; "
                "set GPUFEED_DECODE_PROCESSES to 1 or more, or take intake out of "
                f"{table.TUNING_VARIABLE}"
            )
        return "process", given
    if not decode_processes:
        return "loop", "auto: decode threads read image bytes from the worker's memory"
    return "process", "auto: image bytes straight from Redis to the decode processes"


def result_writer_for(cfg: WorkerConfig, cores: int) -> tuple[str, str]:
    """(`process` or `loop`, why) for `cfg` on a host of `cores`."""
    if cfg.result_writer != "auto":
        return cfg.result_writer, table.given("result_writer", cfg.result_writer)
    if cores < MIN_CORES_FOR_PROCESSES:
        return "loop", (
            f"auto: {cores} cores, under {MIN_CORES_FOR_PROCESSES}: a writer process would "
            "compete for them"
        )
    return "process", f"auto: {cores} cores, off the worker's GIL"


def decode_processes_for(
    cfg: WorkerConfig, cores: int, *, thread_only_hook: bool = False
) -> tuple[int, str]:
    """(decode processes, why) for `cfg` on a host of `cores`; 0: decode threads."""
    setting = cfg.decode_processes
    if setting == "auto":
        if not shared_memory_files():
            k, why = 0, "auto: this system has no memory files (memfd) to share with processes"
        elif thread_only_hook:
            k, why = 0, "auto: a decode hook is set that runs in threads only"
        elif cfg.decode_threads:
            # An operator who sized the decode threads keeps them.
            k, why = 0, f"auto: {table.given('decode_threads', cfg.decode_threads)} is set"
        elif cores < MIN_CORES_FOR_PROCESSES:
            k = 0
            why = (
                f"auto: {cores} cores, under {MIN_CORES_FOR_PROCESSES}: the worker's own CPU "
                "would compete with busy decode processes"
            )
        else:
            k = min(MAX_AUTO_PROCESSES, cores - 1)
            why = f"auto: {cores} cores, one left to the worker"
    else:
        k = int(setting)
        why = f"GPUFEED_DECODE_PROCESSES={k}"
        if k and not shared_memory_files():
            raise ConfigError(
                f"GPUFEED_DECODE_PROCESSES={k}: this system has no memory files (memfd); "
                "set GPUFEED_DECODE_PROCESSES=0"
            )
        if k and thread_only_hook:
            raise ConfigError(f"GPUFEED_DECODE_PROCESSES={k}: a decode hook runs in threads only")
    return k, why
