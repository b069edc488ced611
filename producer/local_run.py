"""`producer batch SOURCE --out FILE --local`: the whole service on one machine, for one run.

A private redis-server on a free loopback port and one worker per GPU (one CPU worker on a
host without one), each `python -m worker` with the model the usual settings name
(GPUFEED_MODEL, GPUFEED_WEIGHTS, ...). The batch then runs through the same code path as
against a deployed fleet, and when it ends, however it ends (done, ^C, SIGTERM, which
`producer batch` takes as ^C, a worker that dies), the workers are stopped (SIGTERM: each
drains and exits), then Redis, and the run's folder (Redis's working directory, the
workers' logs) is removed: only the output stays.

The children run in sessions of their own, so a ^C in the terminal reaches the client
alone, which then stops them in order (a worker that got the ^C itself would race Redis's
end). On Linux each child is also told to end with the client (PR_SET_PDEATHSIG), so not
even a client killed outright leaves them behind.

Imports no torch: the workers are processes of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from producer import wire

# How long a worker may take to drain and exit after SIGTERM before it is killed.
STOP_GRACE_S = 30.0
# How long the workers may take to load and compile their model.
START_TIMEOUT_S = 900.0
POLL_S = 0.2
# Settings of the deployed service that a local run replaces with its own.
REPLACED = ("REDIS_URL", "GPUFEED_WORKER_NAME", "GPUFEED_METRICS_PORT", "GPUFEED_PROCESSES")
PR_SET_PDEATHSIG = 1


class LocalRunError(RuntimeError):
    """The local service could not start, or a worker ended during the run."""


def replaced_settings(env: Mapping[str, str]) -> list[str]:
    """The settings `env` gives that a local run replaces with its own (said, not ignored
    silently): its Redis, the workers' names and metrics ports, one process per worker."""
    return [name for name in REPLACED if env.get(name)]


def gpu_count(env: Mapping[str, str]) -> int:
    """GPUs the workers may use: CUDA_VISIBLE_DEVICES where set, else what `nvidia-smi -L`
    lists (0 without it). GPUFEED_DEVICE=cpu: none."""
    if env.get("GPUFEED_DEVICE", "").strip().lower() == "cpu":
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def _end_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM when the client
    # that started it ends, whatever ends it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(argv: list[str], *, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_end_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509 - no threads of ours run in the child before exec
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalWorker:
    name: str
    device: str
    process: subprocess.Popen[bytes]
    log: Path
    state: str = "starting"  # the last event the worker logged, then "ready"

    def last_lines(self, count: int = 6) -> list[str]:
        """The end of its log, each JSON line shortened to its event and message."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [_readable(line) for line in lines[-count:] if line.strip()]


def _readable(line: str) -> str:
    try:
        record = json.loads(line)
    except ValueError:
        return line.strip()
    if not isinstance(record, dict):
        return line.strip()
    text = str(record.get("event", ""))
    for key in ("error", "message", "reason"):
        if record.get(key):
            text += f": {record[key]}"
    return text


@dataclass
class LocalService:
    """A private Redis and its workers, started by `local_service`."""

    redis_url: str
    folder: Path
    workers: list[LocalWorker] = field(default_factory=list)
    # Set when a worker ended while the run went on (then the client's run is interrupted).
    ended: LocalWorker | None = None

    def ended_message(self) -> str:
        worker = self.ended
        if worker is None:
            return ""
        tail = "; ".join(worker.last_lines(4))
        return (
            f"worker {worker.name} ({worker.device}) exited with status "
            f"{worker.process.returncode}" + (f": {tail}" if tail else "")
        )


def _worker_env(base: Mapping[str, str], url: str, name: str, gpu: int | None) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in REPLACED}
    env.update(
        REDIS_URL=url,
        GPUFEED_WORKER_NAME=name,
        GPUFEED_LOG_FORMAT="json",
        PYTHONUNBUFFERED="1",
    )
    if gpu is None:
        env["GPUFEED_DEVICE"] = "cpu"
    else:
        # As `make run-worker` does: each worker sees its own GPU as cuda:0.
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env.pop("GPUFEED_DEVICE", None)
    return env


def _start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise LocalRunError("redis-server is not installed: run `make setup`")
    port = _free_port()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(folder),
    ]  # fmt: skip
    process = _spawn(argv, env=os.environ, log=folder / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(400):
            if process.poll() is not None:
                said = (folder / "redis.log").read_text(errors="replace")[-300:]
                raise LocalRunError(f"redis-server exited at start: {said}")
            try:
                client.ping()
                return process, url
            except redis.ConnectionError:
                time.sleep(0.025)
    finally:
        client.close()
    process.kill()
    raise LocalRunError("redis-server did not answer within 10 s")


def _stop(process: subprocess.Popen[bytes], grace_s: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(10)


def _wait_ready(
    service: LocalService,
    client: redis.Redis,
    on_state: Callable[[LocalService], None] | None,
    timeout_s: float,
) -> None:
    """Until every worker's heartbeat is in Redis (it writes one once it serves); a worker
    that exits first is a LocalRunError with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        for worker in service.workers:
            if worker.process.poll() is not None:
                service.ended = worker
                raise LocalRunError(service.ended_message())
            if worker.state != "ready":
                if client.exists(wire.DEFAULT_WORKER_PREFIX + worker.name):
                    worker.state = "ready"
                else:
                    lines = worker.last_lines(1)
                    worker.state = lines[-1].split(":", 1)[0] if lines else "starting"
        if on_state is not None:
            on_state(service)
        if all(w.state == "ready" for w in service.workers):
            return
        if time.monotonic() > deadline:
            raise LocalRunError(f"the workers did not start within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _watch(service: LocalService, stop: threading.Event, on_end: Callable[[], None]) -> None:
    """While the run goes: the first worker that exits ends it (`on_end`)."""
    while not stop.wait(POLL_S):
        for worker in service.workers:
            if worker.process.poll() is not None:
                service.ended = worker
                on_end()
                return


@contextlib.contextmanager
def local_service(
    *,
    env: Mapping[str, str] | None = None,
    on_state: Callable[[LocalService], None] | None = None,
    on_end: Callable[[], None] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[LocalService]:
    """A private Redis and one worker per GPU (or one CPU worker), ready when this yields;
    all stopped and their folder removed when it exits. `env`: the workers' settings, over
    this process's environment. `on_state` is called as the workers load; `on_end`, from
    another thread, when a worker exits while the caller's run goes on (by default the
    main thread is interrupted, as by ^C: `service.ended` then says which worker)."""
    base = {**os.environ, **(env or {})}
    folder = Path(tempfile.mkdtemp(prefix="gpufeed-local-"))
    redis_process: subprocess.Popen[bytes] | None = None
    service: LocalService | None = None
    stop = threading.Event()
    watcher: threading.Thread | None = None
    try:
        redis_process, url = _start_redis(folder)
        service = LocalService(url, folder)
        gpus = gpu_count(base)
        tag = f"local-{os.getpid()}"
        for i, gpu in enumerate(range(gpus) if gpus else [None]):
            name = f"{tag}-{i}"
            log = folder / f"{name}.log"
            process = _spawn(
                [sys.executable, "-m", "worker"], env=_worker_env(base, url, name, gpu), log=log
            )
            device = "cpu" if gpu is None else f"GPU {gpu}"
            service.workers.append(LocalWorker(name, device, process, log))
        client = redis.Redis.from_url(url)
        try:
            _wait_ready(service, client, on_state, start_timeout_s)
        finally:
            client.close()
        end = on_end if on_end is not None else _interrupt_main
        watcher = threading.Thread(
            target=_watch, args=(service, stop, end), name="local-workers", daemon=True
        )
        watcher.start()
        yield service
    finally:
        try:
            _stop_all(service, redis_process, stop, watcher)
        finally:
            # Also when a second ^C cuts the workers' drain short: the children then end
            # with the client (PR_SET_PDEATHSIG), and nothing of the run stays on disk.
            shutil.rmtree(folder, ignore_errors=True)


def _stop_all(
    service: LocalService | None,
    redis_process: subprocess.Popen[bytes] | None,
    stop: threading.Event,
    watcher: threading.Thread | None,
) -> None:
    """The watcher, then the workers (SIGTERM to all, each drains), then Redis."""
    stop.set()
    if watcher is not None:
        watcher.join()
    if service is not None:
        for worker in service.workers:
            with contextlib.suppress(ProcessLookupError):
                if worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGTERM)
        for worker in service.workers:
            _stop(worker.process, STOP_GRACE_S)
    if redis_process is not None:
        _stop(redis_process, 10)


def _interrupt_main() -> None:
    import _thread  # noqa: PLC0415 - only when a worker ended

    _thread.interrupt_main()
