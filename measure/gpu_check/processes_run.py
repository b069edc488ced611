"""The GPU check's `before_processes`: gpufeed as it fed a GPU before its JPEG engines, run
the way an operator runs it, to set the engines' gain against the best of it.

Each run is `python -m worker` in a process of its own with GPUFEED_PROCESSES=N (the
supervisor and its N workers, each with its share of the cores' decode processes), the GPU
decode off, the device placement and the check's other settings, fed the photo window's
jobs by the check's producer process. Its rate is the jobs its consumer group has answered
(XINFO GROUPS: entries read less those pending) over a timed window after a warm-up: the
workers' own counters live in their processes. The run ends with SIGTERM (a drain).
Imports no torch: everything heavy runs in the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from worker.base.errors import GpufeedError
from worker.config.settings import WorkerConfig
from worker.lifecycle.supervisor import config_env
from worker.tools.harness.feed import Feeder

_PROJECT = Path(__file__).resolve().parents[2]
_POLL_S = 0.05


class RunFailed(GpufeedError, RuntimeError):
    """The workers did not start, or stopped, before the window was measured."""


def answered(client: redis.Redis, stream: str, group: str) -> int:
    """Jobs of `stream` that `group` read and acknowledged (Redis 7's entries-read)."""
    for g in client.xinfo_groups(stream):
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            if "entries-read" not in g:
                raise RunFailed("this Redis does not count a group's reads (Redis 7 does)")
            # None until the group's first read.
            read = int(g["entries-read"] or 0)
            return max(0, read - int(g.get("pending") or 0))
    return 0


def _ready(log: Path) -> int:
    """worker_ready events in the run's log (its JSON lines)."""
    count = 0
    with contextlib.suppress(FileNotFoundError), log.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"worker_ready"' not in line:
                continue
            with contextlib.suppress(ValueError):
                count += json.loads(line).get("event") == "worker_ready"
    return count


def processes_rate(
    config: WorkerConfig,
    payloads: Sequence[bytes],
    field: str,
    *,
    seconds: float,
    warmup_s: float,
    backlog: int,
    log: Path,
    startup_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """images/s of `config` (GPUFEED_PROCESSES included) run as `python -m worker`, fed
    `payloads` as `field` jobs. Call from a thread of its own: it waits on the host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    env.update(config_env(config))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT), env.get("PYTHONPATH")]))
    t_start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    client = redis.Redis.from_url(config.redis_url)
    feeder: Feeder | None = None
    try:
        deadline = time.monotonic() + startup_timeout_s
        while _ready(log) < config.processes:
            if proc.poll() is not None:
                raise RunFailed(f"the workers exited with {proc.returncode} before ready")
            if time.monotonic() > deadline:
                raise RunFailed(f"not ready after {startup_timeout_s:.0f} s")
            time.sleep(_POLL_S)
        startup_s = time.monotonic() - t_start
        feeder = Feeder(
            config.redis_url,
            config.stream,
            payloads,
            backlog,
            prefix=f"p{config.processes}-",
            unique=field == "image",
            field=field,
        )
        feeder.start()

        def count() -> int:
            done = answered(client, config.stream, config.group)
            assert feeder is not None
            feeder.answered(done)
            if proc.poll() is not None:
                raise RunFailed(f"the workers exited with {proc.returncode} while measured")
            return done

        def run_for(s: float) -> None:
            end = time.monotonic() + s
            while time.monotonic() < end:
                count()
                time.sleep(_POLL_S)

        warm_until = time.monotonic() + 60
        while count() < config.batch_size * 4 and time.monotonic() < warm_until:
            time.sleep(_POLL_S)
        run_for(warmup_s)
        n0, t0 = count(), time.monotonic()
        run_for(seconds)
        n1, t1 = count(), time.monotonic()
    finally:
        if feeder is not None:
            feeder.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        client.close()
    return {
        "processes": config.processes,
        "images_per_s": round((n1 - n0) / max(t1 - t0, 1e-9), 1),
        "window_s": round(t1 - t0, 2),
        "startup_s": round(startup_s, 2),
        "decode_processes": config.decode_processes,
    }
