"""Real worker processes (`python -m worker`) for fault tests and the soak run.

A `WorkerProcess` is one operating-system process, started the way an operator starts it:
settings in environment variables, JSON logs on stderr. Its stderr goes to a file, so a
test can read the log at any time without a pipe filling up, and signals (SIGKILL,
SIGSTOP, SIGCONT, SIGTERM) go to the process itself.

The helpers that read results count them per job entry (the `entry` field), which is what
"exactly one result per job" means on the wire, whatever the job's own id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]

JOBS = "gpufeed:jobs"
GROUP = "gpufeed"
RESULTS = "gpufeed:results"
DEAD = "gpufeed:dead"

# A small, fast worker: the tiny random-weights classifier at input 64, batches of 8.
TINY_ENV = {
    "GPUFEED_MODEL": "mobilenet_v3_small",
    "GPUFEED_INPUT_SIZE": "64",
    "GPUFEED_BATCH_SIZE": "8",
    "GPUFEED_DEVICE": "cpu",
    "GPUFEED_TUNING": "decode_threads=2",
    "GPUFEED_MAX_WAIT_MS": "10",
    "GPUFEED_LOG_FORMAT": "json",
    "GPUFEED_LOG_LEVEL": "info",
}

# Fault-test delivery settings: a job held by a dead or frozen worker is reclaimed in ~3 s.
FAST_RECLAIM_ENV = {
    "GPUFEED_VISIBILITY_TIMEOUT_S": "3",
    "GPUFEED_TUNING": "claim_interval_s=0.5,consumer_expiry_s=3",
}


def merged(*envs: Mapping[str, str]) -> dict[str, str]:
    """`envs` one over the other, their GPUFEED_TUNING constants joined (a later one wins
    a constant both name)."""
    out: dict[str, str] = {}
    for env in envs:
        tuning = ",".join(filter(None, [out.get("GPUFEED_TUNING"), env.get("GPUFEED_TUNING")]))
        out.update(env)
        if tuning:
            out["GPUFEED_TUNING"] = tuning
    return out


def worker_env(redis_url: str, weights: Path | str, **settings: str) -> dict[str, str]:
    """The environment of a worker process: ours without any GPUFEED_* variable, then the
    tiny-model settings, then `settings` (GPUFEED_* names, or REDIS_URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    # Several workers share two cores: one intra-op thread each keeps them from thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["REDIS_URL"] = redis_url
    env["GPUFEED_WEIGHTS"] = str(weights)
    return merged(env, TINY_ENV, settings)


class WorkerExited(RuntimeError):
    """A worker process ended when it should have been running."""


@dataclass
class WorkerProcess:
    """One `python -m worker` process; its stderr (JSON lines) goes to `log_path`."""

    name: str
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    ready_s: float | None = None
    started_s: float | None = None
    _log_file: Any = field(default=None, repr=False)
    _ready_before: int = 0

    def start(self) -> WorkerProcess:
        env = dict(self.env)
        env["GPUFEED_WORKER_NAME"] = self.name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a restarted worker (same name) keeps writing to the same log.
        self._ready_before = self.event_count("worker_ready")
        self._log_file = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=self._log_file,
        )
        self.started_s = time.monotonic()
        self.ready_s = None
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far (other lines are skipped)."""
        out: list[dict[str, Any]] = []
        for raw in self.log_text().splitlines():
            line = raw.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    def errors(self) -> list[dict[str, Any]]:
        """Error-level events: what an operator's alerting would page on."""
        return [e for e in self.events() if e.get("level") in ("error", "critical")]

    def event_count(self, name: str) -> int:
        return sum(1 for e in self.events() if e.get("event") == name)

    def is_ready(self) -> bool:
        """Ready once this start logged `worker_ready` (a restarted worker appends to the
        log of its earlier starts)."""
        if self.ready_s is None and self.event_count("worker_ready") > self._ready_before:
            self.ready_s = time.monotonic()
        return self.ready_s is not None

    def check_alive(self) -> None:
        if not self.alive:
            raise WorkerExited(
                f"worker {self.name} exited with {self.returncode}; log tail:\n"
                + self.log_text()[-4000:]
            )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the process dies holding whatever it read."""
        if self.alive:
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(10)
        self._close_log()

    def terminate(self, timeout_s: float = 60, *, send: bool = True) -> int:
        """SIGTERM (once: a second one skips the drain) and wait for the exit code; SIGKILL
        and raise if it does not exit in time. `send=False` only waits."""
        assert self.proc is not None
        if send and self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped process would not see SIGTERM
            self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            self._close_log()
        return int(self.proc.returncode)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def start_workers(
    names: Sequence[str],
    redis_url: str,
    weights: Path | str,
    log_dir: Path,
    *,
    ready_timeout_s: float = 120,
    **settings: str,
) -> list[WorkerProcess]:
    """Start workers in parallel (each spends seconds importing torch) and wait until all
    of them joined the group."""
    env = worker_env(redis_url, weights, **settings)
    workers = [WorkerProcess(n, env, log_dir / f"{n}.log").start() for n in names]
    try:
        wait_ready(workers, ready_timeout_s)
    except BaseException:
        stop_all(workers, timeout_s=5)
        raise
    return workers


def wait_ready(workers: Iterable[WorkerProcess], timeout_s: float = 120) -> None:
    pending = list(workers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for w in list(pending):
            w.check_alive()
            if w.is_ready():
                pending.remove(w)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"workers not ready after {timeout_s}s: {[w.name for w in pending]}")
        time.sleep(0.1)


def stop_all(workers: Iterable[WorkerProcess], timeout_s: float = 60) -> dict[str, int | None]:
    """SIGTERM every live worker at once, then collect exit codes (None: did not exit in
    time, or was never started)."""
    workers = list(workers)
    for w in workers:
        if w.alive:
            w.signal(signal.SIGCONT)
            w.signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for w in workers:
        if w.proc is None:
            codes[w.name] = None
            continue
        try:
            codes[w.name] = w.terminate(timeout_s, send=False)
        except subprocess.TimeoutExpired:
            codes[w.name] = None
    return codes


# --------------------------------------------------------------------- jobs and results
def submit(
    client: redis.Redis, jobs: Sequence[Mapping[str, bytes | str]], *, stream: str = JOBS
) -> list[str]:
    """XADD each job (one pipelined round trip per 500); returns the entry IDs in order."""
    ids: list[str] = []
    for i in range(0, len(jobs), 500):
        pipe = client.pipeline(transaction=False)
        for job in jobs[i : i + 500]:
            pipe.xadd(stream, dict(job))
        ids += [raw.decode() for raw in pipe.execute()]
    return ids


class ResultTally:
    """Reads a results stream incrementally and counts results per job entry."""

    def __init__(self, *streams: str) -> None:
        self.streams = streams or (RESULTS,)
        self.cursors = dict.fromkeys(self.streams, "-")
        self.per_entry: Counter[str] = Counter()
        self.fields: dict[str, list[dict[bytes, bytes]]] = {}
        # The stream each result of an entry was read from.
        self.where: dict[str, list[str]] = {}
        self.total = 0

    def poll(self, client: redis.Redis, page: int = 5000) -> int:
        """Read what arrived since the last call; returns how many results were new."""
        return sum(self._poll(client, stream, page) for stream in self.streams)

    def _poll(self, client: redis.Redis, stream: str, page: int) -> int:
        new = 0
        while True:
            cursor = self.cursors[stream]
            start = "-" if cursor == "-" else f"({cursor}"  # exclusive
            batch = client.xrange(stream, start, "+", count=page)
            for raw_id, fields in batch:
                entry = fields.get(b"entry", b"").decode()
                self.per_entry[entry] += 1
                self.fields.setdefault(entry, []).append(fields)
                self.where.setdefault(entry, []).append(stream)
                self.total += 1
                new += 1
                self.cursors[stream] = raw_id.decode()
            if len(batch) < page:
                return new

    def answered(self, entries: Iterable[str]) -> int:
        return sum(1 for e in entries if self.per_entry[e] > 0)

    def duplicates(self) -> dict[str, int]:
        return {e: n for e, n in self.per_entry.items() if n > 1}

    def missing(self, entries: Iterable[str]) -> list[str]:
        return [e for e in entries if self.per_entry[e] == 0]


def wait_until_answered(
    client: redis.Redis,
    tally: ResultTally,
    entries: Sequence[str],
    *,
    timeout_s: float,
    workers: Iterable[WorkerProcess] = (),
    at_least: int | None = None,
) -> int:
    """Poll until `at_least` (default: all) of `entries` have a result; fail fast if one of
    `workers` died. Returns how many are answered."""
    want = len(entries) if at_least is None else at_least
    watched = list(workers)
    deadline = time.monotonic() + timeout_s
    while True:
        tally.poll(client)
        done = tally.answered(entries)
        if done >= want:
            return done
        for w in watched:
            w.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{done} of {len(entries)} jobs answered after {timeout_s}s (wanted {want})"
            )
        time.sleep(0.1)


def pending_of(client: redis.Redis, consumer: str | None = None) -> int:
    """Pending entries of the group (or of one consumer)."""
    if consumer is None:
        return int(client.xpending(JOBS, GROUP)["pending"])
    rows = client.xpending_range(
        JOBS, GROUP, min="-", max="+", count=100_000, consumername=consumer
    )
    return len(rows)


def pending_ids(client: redis.Redis, consumer: str) -> list[str]:
    rows = client.xpending_range(
        JOBS, GROUP, min="-", max="+", count=100_000, consumername=consumer
    )
    return [r["message_id"].decode() for r in rows]
