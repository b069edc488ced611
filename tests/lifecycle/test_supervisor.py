"""Several worker processes on one device (GPUFEED_PROCESSES): the supervisor.

The process tests run `python -m worker` as an operator does, with the null model on a
private redis-server, and check what a user sees on the wire: every job answered exactly
once, by both processes, each its own consumer; SIGTERM drains and exits 0; a process killed
with SIGKILL comes back and the jobs it held are answered. The supervisor's own decisions
(restart, give up with the child's exit code) are also checked with stand-in children.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import redis

from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.process_harness import (
    FAST_RECLAIM_ENV,
    JOBS,
    ROOT,
    ResultTally,
    WorkerProcess,
    merged,
    pending_ids,
    pending_of,
    submit,
    wait_until_answered,
    worker_env,
)
from tests.support.redis_server import RedisServer
from worker.config.settings import WorkerConfig
from worker.lifecycle import supervisor
from worker.lifecycle.supervisor import Supervisor, child_env

HEALTHCHECK = ROOT / "deploy" / "container" / "healthcheck.py"
IMAGES = [jpeg_bytes(64, 64, seed=i) for i in range(8)]

NULL_ENV = {
    "GPUFEED_MODEL": "null",
    "GPUFEED_BATCH_SIZE": "16",
    "GPUFEED_TUNING": "decode_threads=1",
    "GPUFEED_PROCESSES": "2",
}


def jobs(n: int, prefix: str) -> list[dict[str, bytes | str]]:
    return [{"id": f"{prefix}-{i}", "image": IMAGES[i % len(IMAGES)]} for i in range(n)]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


class SupervisedWorkers(WorkerProcess):
    """`python -m worker` with GPUFEED_PROCESSES=2: the supervisor and its children share
    one log (the children inherit its stderr)."""

    def child_events(self, event: str, worker: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == event and e.get("worker") == worker]

    def child_pid(self, worker: str) -> int:
        return int(self.child_events("worker_process_started", worker)[-1]["pid"])

    def wait_ready(self, workers: int, timeout_s: float = 180) -> None:
        def ready() -> bool:
            self.check_alive()
            return self.event_count("worker_ready") >= workers

        wait_for(ready, timeout_s, f"{workers} worker_ready events")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def start_supervised(
    tmp_path: Path, server: RedisServer, tiny_weights: Path
) -> Iterator[Callable[..., SupervisedWorkers]]:
    started: list[SupervisedWorkers] = []

    def start(name: str, **settings: str) -> SupervisedWorkers:
        env = worker_env(server.url, tiny_weights, **merged(NULL_ENV, settings))
        sup = SupervisedWorkers(name, env, tmp_path / f"{name}.log")
        sup.start()
        started.append(sup)
        return sup

    yield start
    for sup in started:
        pids = [c.pid for c in psutil.Process(sup.pid).children()] if sup.alive else []
        sup.kill()
        for pid in pids:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


def answered_by(tally: ResultTally, entries: list[str]) -> Counter[str]:
    return Counter(
        str(JobResult.from_fields(f).details.get("worker"))
        for e in entries
        for f in tally.fields.get(e, [])
    )


@pytest.mark.slow
def test_two_processes_share_a_backlog_and_drain_on_sigterm(
    server: RedisServer, start_supervised: Callable[..., SupervisedWorkers]
) -> None:
    client = redis.Redis.from_url(server.url)
    sup = start_supervised("pair")
    sup.wait_ready(2)

    entries = submit(client, jobs(1500, "backlog"))
    tally = ResultTally()
    wait_until_answered(client, tally, entries, timeout_s=120, workers=[sup])
    assert not tally.duplicates()
    consumers = {c["name"].decode() for c in client.xinfo_consumers(JOBS, "gpufeed")}
    assert consumers == {"pair-0", "pair-1"}
    by_worker = answered_by(tally, entries)
    assert set(by_worker) == {"pair-0", "pair-1"}, by_worker
    assert sum(by_worker.values()) == len(entries)

    # SIGTERM while a second backlog is being worked through: each process stops reading,
    # answers what it holds, and the supervisor exits 0 once both have.
    more = submit(client, jobs(3000, "more"))
    wait_until_answered(client, tally, more, timeout_s=120, workers=[sup], at_least=100)
    children = [sup.child_pid("pair-0"), sup.child_pid("pair-1")]
    assert sup.terminate(timeout_s=90) == 0
    assert not any(psutil.pid_exists(pid) for pid in children)
    assert pending_of(client) == 0, "a job read before SIGTERM was left unanswered"
    tally.poll(client)
    assert not tally.duplicates()
    exits = [e["exit_code"] for e in sup.events() if e.get("event") == "worker_process_exited"]
    assert exits == [0, 0]


@pytest.mark.slow
def test_a_process_killed_with_sigkill_is_restarted_and_its_jobs_answered(
    server: RedisServer, start_supervised: Callable[..., SupervisedWorkers]
) -> None:
    client = redis.Redis.from_url(server.url)
    sup = start_supervised("kill", **FAST_RECLAIM_ENV)
    sup.wait_ready(2)

    entries = submit(client, jobs(4000, "kill"))
    tally = ResultTally()
    wait_until_answered(client, tally, entries, timeout_s=120, workers=[sup], at_least=200)
    victim = sup.child_pid("kill-0")
    psutil.Process(victim).kill()
    held = pending_ids(client, "kill-0")
    assert held, "the killed process held no job: nothing to reclaim"

    wait_for(lambda: bool(sup.child_events("worker_process_died", "kill-0")), 30, "the death")
    died = sup.child_events("worker_process_died", "kill-0")[0]
    assert died["exit_code"] == 128 + signal.SIGKILL and died["pid"] == victim
    sup.wait_ready(3)  # the first two, and kill-0 again
    assert sup.child_pid("kill-0") != victim

    wait_until_answered(client, tally, entries, timeout_s=120, workers=[sup])
    assert not tally.duplicates()
    assert set(tally.per_entry) == set(entries)
    # What the killed process held was answered too (by reclaim, after the visibility timeout).
    assert tally.answered(held) == len(held)
    assert pending_of(client) == 0
    assert sup.terminate(timeout_s=90) == 0


# ------------------------------------------------------------------ configuration
def test_a_configuration_error_exits_2_before_any_process_starts() -> None:
    done = run_module(
        "worker",
        "--processes",
        "2",
        env={"GPUFEED_BATCH_SIZE": "99999", "GPUFEED_LOG_FORMAT": "json"},
        timeout=60,
    )
    assert done.returncode == 2
    assert "GPUFEED_BATCH_SIZE" in done.stderr
    assert "worker_process_started" not in done.stderr


def test_processes_out_of_range_is_a_configuration_error() -> None:
    done = run_module("worker", env={"GPUFEED_PROCESSES": "0"}, timeout=60)
    assert done.returncode == 2
    assert "GPUFEED_PROCESSES" in done.stderr


def test_metrics_ports_must_fit_below_65536() -> None:
    with pytest.raises(ValueError, match="GPUFEED_METRICS_PORT"):
        WorkerConfig.load(env={"GPUFEED_PROCESSES": "4", "GPUFEED_METRICS_PORT": "65534"})


def test_children_get_the_supervisors_settings_their_own_name_and_port() -> None:
    config = WorkerConfig.load(
        env={"GPUFEED_BATCH_SIZE": "32"},
        overrides={
            "processes": 3,
            "worker_name": "host-gpu0",
            "metrics_port": 9400,
            "model": "null",
            "dct_scaling": False,
        },
    )
    envs = [child_env(config, i, {"PATH": "/bin", "GPUFEED_MODEL": "resnet50"}) for i in range(3)]
    assert [e["GPUFEED_WORKER_NAME"] for e in envs] == ["host-gpu0-0", "host-gpu0-1", "host-gpu0-2"]
    assert [e["GPUFEED_METRICS_PORT"] for e in envs] == ["9400", "9401", "9402"]
    # A child reads exactly what the supervisor resolved, flags included: back through
    # the config's own parser it gives the same settings.
    child = WorkerConfig.load(env=envs[1])
    assert child.processes == 1
    assert (child.model, child.batch_size, child.dct_scaling) == ("null", 32, False)
    assert envs[1]["PATH"] == "/bin"


@pytest.mark.parametrize(("children", "each"), [(2, "7"), (4, "3"), (8, "0")])
def test_each_child_plans_decode_processes_for_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, children: int, each: str
) -> None:
    """16 cores shared by N children: each takes its share less one (threads below 4)."""
    monkeypatch.setattr(supervisor, "usable_cores", lambda: 16)
    config = WorkerConfig.load(env={}, overrides={"processes": children, "worker_name": "w"})
    assert {child_env(config, i, {})["GPUFEED_DECODE_PROCESSES"] for i in range(children)} == {each}
    chosen = WorkerConfig.load(
        env={}, overrides={"processes": 2, "worker_name": "w", "decode_processes": "5"}
    )
    assert child_env(chosen, 0, {})["GPUFEED_DECODE_PROCESSES"] == "5"


def test_metrics_stay_off_for_every_child_when_off() -> None:
    config = WorkerConfig.load(env={}, overrides={"processes": 2, "worker_name": "w"})
    assert {child_env(config, i, {})["GPUFEED_METRICS_PORT"] for i in range(2)} == {"0"}


def test_the_supervisor_imports_no_torch() -> None:
    code = (
        "import sys, worker.cli, worker.lifecycle.supervisor; "
        "sys.exit(1 if any(m.split('.')[0] == 'torch' for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


# ------------------------------------------------------------------ decisions, stand-ins
def stand_in(tmp_path: Path, script: str) -> list[str]:
    """A child that is a few lines of Python. Like the real worker it stops with 0 on
    SIGTERM; each start leaves a file `<name>.run<n>` (n = 0, 1, ...) once it is set up."""
    path = tmp_path / "child.py"
    path.write_text(
        "import os, pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        f"runs = pathlib.Path({str(tmp_path)!r})\n"
        "name = os.environ['GPUFEED_WORKER_NAME']\n"
        "run = len(list(runs.glob(name + '.run*')))\n"
        "(runs / f'{name}.run{run}').touch()\n" + script + "while True:\n    time.sleep(0.05)\n"
    )
    return [sys.executable, str(path)]


def supervise(
    tmp_path: Path,
    script: str,
    until: Callable[[Supervisor], bool],
    timeout_s: float = 30,
    args: Sequence[str] = (),
) -> Supervisor:
    """Two stand-in children under a supervisor, stepped until `until`, then stopped."""
    config = WorkerConfig.load(env={}, overrides={"processes": 2, "worker_name": "s"})
    sup = Supervisor(config, command=[*stand_in(tmp_path, script), *args])
    for child in sup.children:
        sup.start(child)
    deadline = time.monotonic() + timeout_s
    try:
        while not until(sup):
            assert time.monotonic() < deadline, "the supervisor did not get there in time"
            sup.step()
            time.sleep(0.05)
    finally:
        if not all(c.exit_code is not None for c in sup.children):
            sup.stop(signal.SIGTERM)
            while not all(c.exit_code is not None for c in sup.children):
                sup.step()
                time.sleep(0.05)
    return sup


def test_a_crashed_child_is_started_again_and_sigterm_then_stops_all(tmp_path: Path) -> None:
    # s-0 crashes (exit 1) on its first start only; s-1 serves throughout.
    script = "if name == 's-0' and run == 0:\n    sys.exit(1)\n"
    sup = supervise(tmp_path, script, lambda s: (tmp_path / "s-0.run1").exists())
    assert sup.children[0].restarts == 1
    assert [c.exit_code for c in sup.children] == [0, 0]
    assert sup.exit_code() == 0


def test_a_restarted_child_waits_for_redis_even_under_no_wait(tmp_path: Path) -> None:
    # `--no-wait` is for the first start; a child restarted during a Redis blip must wait
    # for Redis, or the blip would end every process one restart at a time.
    script = (
        "(runs / f'{name}.argv{run}').write_text(' '.join(sys.argv[1:]))\n"
        "if name == 's-0' and run == 0:\n    sys.exit(1)\n"
    )
    written = ("s-0.argv1", "s-1.argv0")
    supervise(
        tmp_path,
        script,
        lambda s: all((tmp_path / n).exists() for n in written),
        args=["--no-wait"],
    )
    assert (tmp_path / "s-0.argv0").read_text() == "--no-wait"
    assert (tmp_path / "s-0.argv1").read_text() == "--wait"
    assert (tmp_path / "s-1.argv0").read_text() == "--no-wait"


def test_a_start_up_failure_stops_the_others_and_keeps_its_exit_code(tmp_path: Path) -> None:
    # s-1 fails as a worker with a configuration error does, once s-0 is up.
    script = (
        "if name == 's-1':\n"
        "    while not (runs / 's-0.run0').exists():\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(2)\n"
    )
    sup = supervise(tmp_path, script, lambda s: all(c.exit_code is not None for c in s.children))
    assert sup.children[1].restarts == 0  # not restarted: it would fail the same way
    assert sup.children[0].exit_code == 0  # stopped by the supervisor's SIGTERM
    assert sup.exit_code() == 2


# ------------------------------------------------------------------ container health check
class _Live(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def two_live_ports() -> Iterator[int]:
    """Two HTTP servers answering /live 200 on consecutive ports; yields the first."""
    for _ in range(20):
        first = HTTPServer(("127.0.0.1", 0), _Live)
        try:
            second = HTTPServer(("127.0.0.1", first.server_address[1] + 1), _Live)
        except OSError:
            first.server_close()
            continue
        servers = [first, second]
        threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
        for t in threads:
            t.start()
        yield first.server_address[1]
        for s in servers:
            s.shutdown()
            s.server_close()
        return
    pytest.skip("no two consecutive free ports")


def test_the_container_health_check_asks_every_process(two_live_ports: int) -> None:
    module = ModuleType("gpufeed_healthcheck")
    exec(compile(HEALTHCHECK.read_text(), str(HEALTHCHECK), "exec"), module.__dict__)
    base = str(two_live_ports)
    assert module.check({"GPUFEED_METRICS_PORT": base, "GPUFEED_PROCESSES": "2"})[0] is True
    # A third process whose port does not answer fails the check.
    ok, message = module.check({"GPUFEED_METRICS_PORT": base, "GPUFEED_PROCESSES": "3"})
    assert ok is False and str(two_live_ports + 2) in message
