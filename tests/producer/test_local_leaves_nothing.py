"""`producer batch --local` whose client is killed outright (SIGKILL: nothing of it runs
after): its private Redis, its workers and their own processes end within 2 s, and the
next local run removes the folder the killed one could not, never a live run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from producer.local_run import (
    OWNER_FILE,
    LocalWorker,
    how_it_ended,
    start_time,
    sweep_dead_runs,
)
from tests.producer.test_batch_signals import answered, local_run
from tests.producer.test_local_batch import alive, folder_of_images


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def run_folder(tmp: Path, owner: int | None, started: int | None) -> Path:
    folder = tmp / f"gpufeed-local-{len(list(tmp.iterdir()))}"
    folder.mkdir()
    (folder / "redis.log").write_text("")
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps({"pid": owner, "started": started}))
    return folder


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc: Linux")
@pytest.mark.slow
def test_a_client_killed_outright_leaves_no_process_and_the_next_run_sweeps_its_folder(
    tmp_path: Path, tiny_weights: Path
) -> None:
    photos = folder_of_images(tmp_path, 30)
    out, tmp = tmp_path / "out.parquet", tmp_path / "tmp"
    # One job at a time, each sealed alone after 200 ms: a run of several seconds.
    # Decode processes of the worker's own: grandchildren, which the kernel's
    # parent-death signal does not reach.
    slow = {"GPUFEED_MAX_WAIT_MS": "200", "GPUFEED_DECODE_PROCESSES": "2"}
    client = local_run(photos, out, tmp, tiny_weights, "--in-flight", "1", **slow)
    assert client.stdout is not None
    deadline = time.monotonic() + 240
    while not answered(json.loads(client.stdout.readline() or "{}"), 2):
        assert client.poll() is None and time.monotonic() < deadline, client.stderr
    children = descendants(client.pid)
    # Redis, the worker and the worker's own processes (two decoders, its intake).
    assert len(children) >= 4
    client.kill()
    client.communicate(timeout=30)
    killed_at = time.monotonic()
    while any(alive(pid) for pid in children) and time.monotonic() - killed_at < 5:
        time.sleep(0.05)
    left = sorted(pid for pid in children if alive(pid))
    assert left == [], f"still running {time.monotonic() - killed_at:.1f} s after: {left}"
    assert time.monotonic() - killed_at <= 2.0
    [orphan] = tmp.glob("gpufeed-local-*")  # nothing of the client ran to remove it

    # The same command again: it removes the dead run's folder, finishes the output, and
    # leaves no folder of its own.
    again = local_run(photos, out, tmp, tiny_weights)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 1, stderr[-3000:]  # the broken image's error row
    assert not orphan.exists()
    assert list(tmp.glob("gpufeed-local-*")) == []
    assert pq.read_table(out).num_rows == 31

    # Once more: nothing left to run, so no worker (no model to load); the same summary
    # and exit status as any run over a finished output.
    began = time.monotonic()
    idle = local_run(photos, out, tmp, tiny_weights)
    stdout, stderr = idle.communicate(timeout=120)
    assert idle.returncode == 1, stderr[-3000:]
    assert "local: every item has its row in the output already: no worker started" in stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [w for line in lines for w in line.get("local", [])] == []
    summary = lines[-1]["summary"]
    assert (summary["done_before"], summary["submitted"]) == (31, 0)
    assert time.monotonic() - began < 10
    assert pq.read_table(out).num_rows == 31


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="start times from /proc")
def test_the_sweep_removes_dead_owners_folders_only(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    me = os.getpid()
    live = run_folder(tmp_path, me, start_time(me))
    dead = run_folder(tmp_path, ended.pid, 12345)
    # A pid reused by another process: the owner named is gone all the same.
    reused = run_folder(tmp_path, me, (start_time(me) or 0) + 1)
    # Just created, its owner not written yet (or of a version that wrote none).
    unnamed = run_folder(tmp_path, None, None)

    assert sorted(sweep_dead_runs(tmp_path)) == sorted([dead, reused])
    assert live.exists() and unnamed.exists()
    assert not dead.exists() and not reused.exists()


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (-9, "ended by SIGKILL: killed, e.g. by the kernel's out-of-memory killer"),
        (-11, "ended by SIGSEGV"),
        (3, "exited with status 3"),
    ],
)
def test_a_workers_end_is_said_in_words(code: int, said: str) -> None:
    assert how_it_ended(code) == said


def worker_with_log(tmp_path: Path, lines: list[str]) -> LocalWorker:
    log = tmp_path / "w.log"
    log.write_text("\n".join(lines) + "\n")
    ended = subprocess.Popen(["true"])
    ended.wait()
    return LocalWorker("local-1-0", "cpu", ended, log)


def test_a_dead_workers_last_line_is_its_complaint_not_its_start_up(tmp_path: Path) -> None:
    start_up = [
        json.dumps({"event": "model loaded", "level": "info"}),
        json.dumps({"event": "worker ready", "level": "info"}),
    ]
    warned = json.dumps({"event": "redis unreachable", "level": "warning", "error": "refused"})
    worker = worker_with_log(tmp_path, [start_up[0], warned, start_up[1]])
    assert worker.last_meaningful_line() == "redis unreachable: refused"
    crashed = ["Traceback (most recent call last):", '  File "x.py", line 1', "MemoryError: x"]
    worker = worker_with_log(tmp_path, [*start_up, *crashed])
    assert worker.last_meaningful_line() == "MemoryError: x"
    # Nothing complained: its last line, not a list of its start-up.
    worker = worker_with_log(tmp_path, start_up)
    assert worker.last_meaningful_line() == "worker ready"
