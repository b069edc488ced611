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
end). On Linux each child is also killed with the client (PR_SET_PDEATHSIG), so not even a
client killed outright leaves them running; its folder, which nothing could remove then,
names its owner (pid and start time), and the next local run removes the folders whose
owner is gone.

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
from typing import TYPE_CHECKING

import redis

from producer import wire

if TYPE_CHECKING:
    from producer.batch_sources import Source

# How long a worker may take to drain and exit after SIGTERM before it is killed.
STOP_GRACE_S = 30.0
# How long the workers may take to load and compile their model.
START_TIMEOUT_S = 900.0
POLL_S = 0.2
# Settings of the deployed service that a local run replaces with its own.
REPLACED = ("REDIS_URL", "GPUFEED_WORKER_NAME", "GPUFEED_METRICS_PORT", "GPUFEED_PROCESSES")
PR_SET_PDEATHSIG = 1
FOLDER_PREFIX = "gpufeed-local-"
# In each run's folder: {"pid", "started", "children": [[pid, started], ...]}.
OWNER_FILE = "owner.json"


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


def _end_with(parent: int) -> Callable[[], None]:
    """What runs in the child between fork and exec: the kernel kills it when the client
    that started it ends, whatever ends the client.

    SIGKILL, not SIGTERM: with the client gone nothing reads what a drain would finish,
    and Redis ends with it, so a drain would only be a worker retrying a Redis that is gone
    for its whole grace period, holding its GPU. The parent-death signal rather than a pipe
    each child watches for EOF: redis-server cannot be given such a watcher, and the kernel
    needs none. It is not inherited across fork, so it reaches the worker and redis-server
    only; the worker's own processes (decoders, result writer, intake) are fed over socket
    pairs by it and end on their EOF once it is gone, so no grandchild outlives the chain.
    The signal follows the thread that forked: `local_service` spawns from the thread that
    holds it open, which outlives the children."""

    def preexec() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # A client that died between fork and prctl sent no signal: reparented already.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _spawn(argv: list[str], *, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_end_with(os.getpid()) if sys.platform == "linux" else None,  # noqa: PLW1509 - no threads of ours run in the child before exec
        )


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field):
    with the pid, it names one process, where a pid alone may have been reused. None
    without /proc or once the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(") ", 1)[1].split()  # the name, in parentheses, may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


def _running(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive, and not ours to judge
    if not Path("/proc").is_dir():
        return True  # no start times to compare: a live pid is taken as the owner
    return started is not None and start_time(pid) == started


def _write_owner(folder: Path, children: list[subprocess.Popen[bytes]]) -> None:
    record = {
        "pid": os.getpid(),
        "started": start_time(os.getpid()),
        "children": [[c.pid, start_time(c.pid)] for c in children],
    }
    part = folder / (OWNER_FILE + ".part")
    part.write_text(json.dumps(record))
    part.replace(folder / OWNER_FILE)  # never read half-written


def sweep_dead_runs(tmp: Path | None = None) -> list[Path]:
    """Remove the run folders of local runs whose client is gone (killed outright, so it
    could not remove its own), after killing any of its children still running (without
    PR_SET_PDEATHSIG, off Linux). A folder that names no owner is left alone: a run writes
    its owner right after creating its folder, and one of another user is not ours.
    Returns the folders removed."""
    removed: list[Path] = []
    for folder in sorted((tmp or Path(tempfile.gettempdir())).glob(FOLDER_PREFIX + "*")):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            record = json.loads((folder / OWNER_FILE).read_text())
            pid, started = int(record["pid"]), record["started"]
            children = [(int(c), s) for c, s in record.get("children", [])]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _running(pid, started):
            continue
        for child, child_started in children:
            if child_started is not None and start_time(child) == child_started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


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
        return [_readable(line) for line in self._lines()[-count:]]

    def last_meaningful_line(self) -> str:
        """What says why it ended: its last error or warning (a JSON line at that level, or
        a line it wrote outside its log, as a traceback's last), else its last line."""
        lines = self._lines()
        for line in reversed(lines):
            if _is_complaint(line):
                return _readable(line)
        return _readable(lines[-1]) if lines else ""

    def _lines(self) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()]


def _is_complaint(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        # Not its log: Python's own words (a traceback ends in the exception), not a
        # traceback's frames.
        return not line.startswith((" ", "\t", "Traceback "))
    if not isinstance(record, dict):
        return False
    return str(record.get("level", "")).lower() in {"warning", "error", "critical", "exception"}


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
        said = worker.last_meaningful_line()
        return (
            f"worker {worker.name} ({worker.device}) {how_it_ended(worker.process.returncode)}"
            + (f"; its last log line: {said}" if said else "")
        )


def how_it_ended(returncode: int | None) -> str:
    """A child's end in words: Popen's -N is signal N, said by its name."""
    if returncode is None or returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"ended by signal {-returncode}"
    if name == "SIGKILL":
        return "ended by SIGKILL: killed, e.g. by the kernel's out-of-memory killer"
    return f"ended by {name}"


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


def nothing_left(
    source: Source,
    out: str | os.PathLike[str],
    *,
    retry_failed: bool,
    job_id: Callable[[str], str] = str,
) -> bool:
    """Whether a run of `source` into `out` would submit nothing: every item's id
    (`job_id` of it, as the run makes it) has its row in the output already. Then a local
    run needs no worker, whose model takes seconds to load (minutes on a GPU that
    compiles). The source is listed up to its first item not done; the output is locked
    while read, as a run locks it (a run writing it is an OutputError)."""
    from producer.batch_ids import IdStore, id_hashes  # noqa: PLC0415 - numpy, Arrow
    from producer.batch_output import Output  # noqa: PLC0415

    output = Output(out)
    if not output.files():
        return False
    existing = output.start(retry_failed=retry_failed)
    try:
        done = IdStore(existing.done)
        for page in source.pages():
            if page and not done.seen(id_hashes([job_id(item.id) for item in page])).all():
                return False
        return True
    finally:
        output.release()


@contextlib.contextmanager
def local_service(
    *,
    env: Mapping[str, str] | None = None,
    on_state: Callable[[LocalService], None] | None = None,
    on_end: Callable[[], None] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    workers: bool = True,
) -> Iterator[LocalService]:
    """A private Redis and one worker per GPU (or one CPU worker), ready when this yields;
    all stopped and their folder removed when it exits. `env`: the workers' settings, over
    this process's environment. `on_state` is called as the workers load; `on_end`, from
    another thread, when a worker exits while the caller's run goes on (by default the
    main thread is interrupted, as by ^C: `service.ended` then says which worker).
    `workers=False`: the Redis alone, for a run with `nothing_left` to submit, which then
    finishes its output and counts its rows as any run does."""
    base = {**os.environ, **(env or {})}
    sweep_dead_runs()
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    redis_process: subprocess.Popen[bytes] | None = None
    service: LocalService | None = None
    stop = threading.Event()
    watcher: threading.Thread | None = None
    try:
        _write_owner(folder, [])
        redis_process, url = _start_redis(folder)
        service = LocalService(url, folder)
        gpus = gpu_count(base) if workers else 0
        tag = f"local-{os.getpid()}"
        for i, gpu in enumerate((range(gpus) if gpus else [None]) if workers else []):
            name = f"{tag}-{i}"
            log = folder / f"{name}.log"
            process = _spawn(
                [sys.executable, "-m", "worker"], env=_worker_env(base, url, name, gpu), log=log
            )
            device = "cpu" if gpu is None else f"GPU {gpu}"
            service.workers.append(LocalWorker(name, device, process, log))
        _write_owner(folder, [redis_process, *(w.process for w in service.workers)])
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
