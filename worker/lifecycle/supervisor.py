"""Several worker processes on one device (GPUFEED_PROCESSES > 1), under one supervisor.

When one Python process cannot keep a fast GPU busy (its own per-job work binds, not the
model), N processes each run the whole worker: their own consumer in the same group
(`<GPUFEED_WORKER_NAME>-<i>`), their own metrics port (GPUFEED_METRICS_PORT + i), the same
stream. The supervisor is what `python -m worker` becomes then:

- it starts every child as `python -m worker run` (a fresh interpreter: fork and exec, never
  a fork of a process holding torch or a CUDA context; the supervisor imports neither), with
  the settings it already validated passed in the environment, so a child reads exactly the
  supervisor's configuration, whatever came from flags;
- it forwards SIGTERM and SIGINT to every child (each drains its own jobs; a second signal,
  forwarded too, skips the drain) and exits once all of them have exited: 0 when they all
  stopped cleanly, else the first child's failing exit code;
- a child that dies unexpectedly (a crash, SIGKILL, the OOM killer) is started again under
  the same consumer name after a backoff (1 s doubling to 30 s; reset once a child has run
  for a minute); its pending jobs are reclaimed after GPUFEED_VISIBILITY_TIMEOUT_S, as a
  dead worker's are;
- a child that exits with a start-up failure (2 configuration, 3 Redis unreachable with
  --no-wait, 4 compiled step refused) would fail the same way again: the supervisor stops
  the others and exits with that code (so systemd's RestartPreventExitStatus still works).

Children run in their own process group, so a Ctrl+C on the terminal reaches them once,
through the supervisor, not twice (which would skip the drain); on Linux each child also
gets SIGTERM if the supervisor itself dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from producer.backoff import Backoff
from worker.config import table
from worker.config.settings import WorkerConfig, tuning_text
from worker.lifecycle.feed_plan import decode_processes_for, usable_cores

log = structlog.get_logger("gpufeed.supervisor")

# Exit codes of `python -m worker run` (worker/cli.py) that a restart cannot cure.
START_FAILURES = frozenset({2, 3, 4})

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# A child that ran this long before dying starts again after BACKOFF_FIRST_S.
STABLE_AFTER_S = 60.0
POLL_S = 0.1

_PR_SET_PDEATHSIG = 1


def child_name(config: WorkerConfig, index: int) -> str:
    return f"{config.worker_name}-{index}"


def child_metrics_port(config: WorkerConfig, index: int) -> int:
    return config.metrics_port + index if config.metrics_port else 0


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    return str(value)


def config_env(config: WorkerConfig) -> dict[str, str]:
    """`config` as the environment that gives it: each setting under its variable, and the
    tuning constants that differ from worker/config/tuning.py's once, as GPUFEED_TUNING:
    written even when empty, so that a GPUFEED_TUNING of the environment it is laid over
    never reaches a child in place of `config`'s."""
    env = {str(entry.env): _env_value(getattr(config, entry.name)) for entry in table.PUBLIC}
    env[table.TUNING_VARIABLE] = tuning_text(config)
    return env


def child_env(config: WorkerConfig, index: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of child `index`: `base`, then every setting as the supervisor
    resolved it (flags included), then the child's own name and metrics port."""
    env = {**base, **config_env(config)}
    env["GPUFEED_PROCESSES"] = "1"
    if config.decode_processes == "auto":
        # Each child plans for its share of the cores: N children each taking one decode
        # process per core would run N times as many as the host has cores.
        share = max(1, usable_cores() // config.processes)
        env["GPUFEED_DECODE_PROCESSES"] = str(decode_processes_for(config, share)[0])
    env["GPUFEED_WORKER_NAME"] = child_name(config, index)
    env["GPUFEED_METRICS_PORT"] = str(child_metrics_port(config, index))
    return env


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM (a drain) when the supervisor dies,
    so a supervisor killed with SIGKILL leaves no worker behind. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return


def _exit_code(returncode: int) -> int:
    """A child killed by signal N (Popen's -N) reads as 128 + N, as in a shell."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Child:
    index: int
    name: str
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0
    restart_at_s: float | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S))
    restarts: int = 0
    exit_code: int | None = None  # set once the child is finished for good

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Runs `config.processes` children until a signal, then waits for all of them."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        wait_for_redis: bool = True,
        base_env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.base_env = dict(os.environ if base_env is None else base_env)
        wait_flag = "--wait" if wait_for_redis else "--no-wait"
        self.command = list(command or [sys.executable, "-m", "worker", "run", wait_flag])
        # `--no-wait` asks the first start to fail fast when Redis is away. A restart comes
        # after the fleet already reached Redis once: a Redis blip at that moment must not end
        # every process, so restarted children always wait for Redis.
        self.restart_command = [("--wait" if a == "--no-wait" else a) for a in self.command]
        self.clock = clock
        self.children = [
            Child(index=i, name=child_name(config, i)) for i in range(config.processes)
        ]
        self.stopping = False
        self.failure: int | None = None
        self._signals: list[int] = []
        self._cwd = Path.cwd()

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Start the children, supervise them until all have exited; the exit code."""
        self.install_signal_handlers()
        log.info(
            "supervisor_started",
            processes=len(self.children),
            workers=[c.name for c in self.children],
            metrics_ports=[child_metrics_port(self.config, c.index) for c in self.children]
            if self.config.metrics_port
            else None,
            device=self.config.device,
        )
        for child in self.children:
            self.start(child)
        while not all(c.exit_code is not None for c in self.children):
            self.step()
            time.sleep(POLL_S)
        code = self.exit_code()
        log.info("supervisor_stopped", exit_code=code)
        return code

    def step(self) -> None:
        """One round: act on signals received, collect exited children, restart the due."""
        while self._signals:
            self.forward(self._signals.pop(0))
        now = self.clock()
        for child in self.children:
            if child.exit_code is not None:
                continue
            if child.proc is not None:
                returncode = child.proc.poll()
                if returncode is not None:
                    self.exited(child, _exit_code(returncode), now)
            elif child.restart_at_s is not None and now >= child.restart_at_s:
                self.start(child)

    def start(self, child: Child) -> None:
        child.restart_at_s = None
        child.proc = subprocess.Popen(
            self.restart_command if child.restarts else self.command,
            cwd=self._cwd,
            env=child_env(self.config, child.index, self.base_env),
            stdin=subprocess.DEVNULL,
            # Its own process group: a terminal's Ctrl+C reaches it once, forwarded.
            process_group=0,
            # The supervisor starts no thread, so running Python between fork and exec is safe.
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        child.started_s = self.clock()
        log.info(
            "worker_process_started",
            worker=child.name,
            pid=child.proc.pid,
            restarts=child.restarts,
        )

    def exited(self, child: Child, code: int, now: float) -> None:
        assert child.proc is not None
        pid = child.proc.pid
        child.proc = None
        ran_s = round(now - child.started_s, 1)
        if self.stopping or code == 0:
            # Stopped on a signal (ours, or one sent to the child itself): finished.
            child.exit_code = code
            log.info("worker_process_exited", worker=child.name, pid=pid, exit_code=code)
            return
        if code in START_FAILURES:
            child.exit_code = code
            log.error(
                "worker_process_failed",
                worker=child.name,
                pid=pid,
                exit_code=code,
                ran_s=ran_s,
                hint="a start-up failure: not restarted; stopping the other processes",
            )
            self.failure = code
            self.stop(signal.SIGTERM)
            return
        if ran_s >= STABLE_AFTER_S:
            child.backoff.reset()
        delay = child.backoff.next()
        child.restarts += 1
        child.restart_at_s = now + delay
        log.error(
            "worker_process_died",
            worker=child.name,
            pid=pid,
            exit_code=code,
            ran_s=ran_s,
            restart_in_s=delay,
        )

    def stop(self, sig: int) -> None:
        """Stop for good: no more restarts; every running child gets `sig`."""
        self.stopping = True
        for child in self.children:
            if child.proc is None and child.exit_code is None:
                child.restart_at_s = None
                child.exit_code = 0  # waiting for a restart: nothing to stop
            elif child.running:
                assert child.proc is not None
                try:
                    os.kill(child.proc.pid, sig)
                except ProcessLookupError:
                    continue

    def forward(self, sig: int) -> None:
        log.info(
            "supervisor_signal",
            signal=signal.Signals(sig).name,
            again=self.stopping,
            workers=[c.name for c in self.children if c.running],
        )
        self.stop(sig)

    def exit_code(self) -> int:
        if self.failure is not None:
            return self.failure
        return next((c.exit_code for c in self.children if c.exit_code), 0)

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a note: the loop forwards it (Popen and logging are not for a handler).
        self._signals.append(signum)


def run_supervisor(config: WorkerConfig, *, wait_for_redis: bool) -> int:
    return Supervisor(config, wait_for_redis=wait_for_redis).run()
