"""`producer batch FOLDER --out FILE --local`: one command on a machine with nothing running,
a Parquet file with one row per image, and no process or file left behind, also when a
worker dies or the client is interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.images import jpeg_bytes
from tests.support.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def folder_of_images(root: Path, count: int) -> Path:
    folder = root / "photos"
    folder.mkdir()
    for i in range(count):
        (folder / f"img-{i:03d}.jpg").write_bytes(jpeg_bytes(96 + i, 72, seed=i))
    (folder / "broken.jpg").write_bytes(jpeg_bytes(seed=99)[:300])
    return folder


def local_env(weights: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFEED_", "REDIS_"))}
    env.update(
        GPUFEED_MODEL="mobilenet_v3_small",
        GPUFEED_WEIGHTS=str(weights),
        GPUFEED_INPUT_SIZE="64",
        GPUFEED_BATCH_SIZE="4",
        GPUFEED_DEVICE="cpu",
        # Nothing answers there: a local run must not use it.
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
    )
    env.update(more)
    return env


def batch_command(folder: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "producer", "batch", str(folder), "--out", str(out)]


def local_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("gpufeed-local-*")}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that ended but was not reaped yet is gone all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def started_pids(stdout: str) -> list[int]:
    """The local workers' pids, from the --json progress lines."""
    pids: set[int] = set()
    for line in stdout.splitlines():
        record = json.loads(line)
        for worker in record.get("local", []):
            pids.add(int(worker["pid"]))
    return sorted(pids)


def test_a_folder_becomes_a_parquet_file_and_nothing_is_left_running(
    tmp_path: Path, tiny_weights: Path
) -> None:
    folder = folder_of_images(tmp_path, 9)
    out = tmp_path / "out.parquet"
    before = local_folders()
    done = subprocess.run(
        [*batch_command(folder, out), "--local", "--json"],
        cwd=ROOT,
        env=local_env(tiny_weights),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # An error row (the broken file) makes the exit status 1, as for any batch.
    assert done.returncode == 1, done.stderr[-3000:]
    table = pq.read_table(out).to_pylist()
    assert len(table) == 10
    by_path = {Path(row["source"]).name: row for row in table}
    assert by_path["broken.jpg"]["status"] == "error"
    assert by_path["broken.jpg"]["error_code"] == "decode_error"
    assert all(by_path[f"img-{i:03d}.jpg"]["status"] == "ok" for i in range(9))
    assert all(row["model"] == "mobilenet_v3_small" for row in table)
    summary = json.loads(done.stdout.splitlines()[-1])["summary"]
    assert summary["ok"] == 9 and summary["errors"] == 1
    pids = started_pids(done.stdout)
    assert len(pids) == 1  # one CPU worker on a host without a GPU
    assert not any(alive(pid) for pid in pids)
    assert local_folders() == before
    assert "local: Redis at redis://127.0.0.1:" in done.stderr
    # The environment's REDIS_URL is said to be unused, not ignored silently.
    assert "local: REDIS_URL set here, not used: a local run has its own" in done.stderr


def test_a_worker_that_dies_ends_the_run_with_its_reason_and_nothing_is_left(
    tmp_path: Path, tiny_weights: Path
) -> None:
    """The worker killed mid-run: the client says which worker ended and how, and stops
    the rest."""
    folder = folder_of_images(tmp_path, 60)
    out = tmp_path / "out.parquet"
    before = local_folders()
    # One job at a time, each sealed alone after a 200 ms max wait: a run of 12 s, killed
    # in its first seconds.
    client = subprocess.Popen(
        [*batch_command(folder, out), "--local", "--json", "--in-flight", "1"],
        cwd=ROOT,
        env=local_env(tiny_weights, GPUFEED_MAX_WAIT_MS="200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    pids: list[int] = []
    deadline = time.monotonic() + 240
    for line in client.stdout:
        record = json.loads(line)
        if "local" in record:
            pids = [int(w["pid"]) for w in record["local"]]
        elif "progress" in record and record["progress"].get("ok", 0) >= 4:
            break
        assert time.monotonic() < deadline
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 1, stderr[-3000:]
    assert "ended by SIGKILL: killed, e.g. by the kernel's out-of-memory killer" in stderr
    assert "run the same command again" in stderr
    assert not any(alive(pid) for pid in pids)
    assert local_folders() == before

    # What was answered before the kill is committed in the output's segments, for the
    # same command to go on from (tests/producer/test_batch_resume.py has the resuming).
    segments = sorted((tmp_path / "out.parquet.parts").glob("r*.parquet"))
    assert sum(pq.read_metadata(s).num_rows for s in segments) >= 2


def test_a_worker_that_cannot_start_is_named_with_its_error(
    tmp_path: Path, tiny_weights: Path
) -> None:
    folder = folder_of_images(tmp_path, 2)
    before = local_folders()
    done = subprocess.run(
        [*batch_command(folder, tmp_path / "out.parquet"), "--local"],
        cwd=ROOT,
        env=local_env(tiny_weights, GPUFEED_BATCH_SIZE="-3"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "--local: worker local-" in done.stderr
    assert "GPUFEED_BATCH_SIZE" in done.stderr
    assert local_folders() == before
    assert not (tmp_path / "out.parquet").exists()
