"""`producer batch` ended by a signal, as `timeout`, systemd, Kubernetes or a terminal end
it: SIGTERM is taken as ^C (the rows answered so far committed, a --local service stopped
and its folder removed, exit 143), and ^C exits 130 at any step, the local workers' start
included. A real redis-server, null-model workers and the client as its own process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.producer.test_local_batch import alive, local_env
from tests.support.cli_runner import ROOT, clean_env
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

IMAGES = 24


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("signals") / "photos"
    folder.mkdir()
    for n in range(IMAGES):
        (folder / f"{n:02d}.jpg").write_bytes(jpeg_bytes(24, 16, seed=n, quality=70))
    return folder


def committed(out: Path) -> list[str]:
    """The ids of the rows the output's committed segments hold."""
    parts = out.with_name(out.name + ".parts")
    return [i for p in sorted(parts.glob("*.parquet")) for i in pq.read_table(p)["id"].to_pylist()]


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def signal_when(
    client: subprocess.Popen[str], sig: signal.Signals, ready: Any, timeout_s: float = 240
) -> list[dict[str, Any]]:
    """Read the client's --json lines until `ready(line)` holds, then send it `sig`; the
    lines read."""
    assert client.stdout is not None
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    for text in client.stdout:
        lines.append(json.loads(text))
        if ready(lines[-1]):
            client.send_signal(sig)
            return lines
        assert time.monotonic() < deadline, "the client never got there"
    raise AssertionError(f"the client ended first: {client.communicate()[1][-3000:]}")


def answered(line: dict[str, Any], at_least: int) -> bool:
    progress = line.get("progress", {})
    return int(progress.get("ok", 0)) + int(progress.get("errors", 0)) >= at_least


# ---------------------------------------------------------------------- a deployment
async def test_sigterm_commits_the_rows_answered_so_far_and_exits_143(
    redis_url: str, tiny_weights: Path, tmp_path: Path, photos: Path
) -> None:
    """Checkpoints far apart: what was answered before the SIGTERM is in the output all the
    same, the client says how it ended, and the same command finishes the rest."""
    out = tmp_path / "out.parquet"
    command = [
        sys.executable, "-m", "producer", "batch", str(photos), "--out", str(out),
        "--redis-url", redis_url, "--in-flight", "2", "--checkpoint", "600", "--json",
    ]  # fmt: skip
    # A decode of 250 ms an image on two threads: the run lasts 3 s, answered as it goes,
    # and the client's JSON lines come a second apart.
    slow = {"model": "null", "input_size": 64, "batch_size": 2, "max_wait_ms": 1.0}
    async with running_worker(redis_url, tiny_weights, decode_delay_s=0.25, **slow):
        client = await asyncio.to_thread(start, command, clean_env())
        lines = await asyncio.to_thread(
            signal_when, client, signal.SIGTERM, lambda line: answered(line, 4)
        )
        _, stderr = await asyncio.to_thread(client.communicate, timeout=60)
        kept, finished = committed(out), out.exists()
        again = await asyncio.to_thread(
            subprocess.run, command, cwd=ROOT, env=clean_env(), capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip

    assert client.returncode == 143, stderr[-3000:]
    assert "error: terminated (SIGTERM): run the same command again to go on" in stderr
    assert "Traceback" not in stderr
    seen = lines[-1]["progress"]
    assert len(kept) >= seen["ok"] + seen["errors"] >= 4
    assert len(kept) < IMAGES and not finished  # stopped part way
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["summary"]["done_before"] == len(kept)
    ids = pq.read_table(out)["id"].to_pylist()
    assert Counter(ids) == Counter(f"{n:02d}.jpg" for n in range(IMAGES))


# ---------------------------------------------------------------------- --local
def local_run(
    photos: Path, out: Path, tmp: Path, tiny_weights: Path, *more: str, **settings: str
) -> subprocess.Popen[str]:
    """`batch --local --json` as its own process, null-model workers, its run folder (a
    temporary one) under `tmp`."""
    tmp.mkdir(exist_ok=True)
    env = local_env(tiny_weights, GPUFEED_MODEL="null", TMPDIR=str(tmp), **settings)
    command = [sys.executable, "-m", "producer", "batch", str(photos), "--out", str(out)]
    return start([*command, "--local", "--json", *more], env)


def worker_pids(lines: list[dict[str, Any]]) -> set[int]:
    return {int(w["pid"]) for line in lines for w in line.get("local", [])}


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_a_signal_while_the_local_workers_start_stops_them_and_leaves_nothing(
    photos: Path, tmp_path: Path, tiny_weights: Path, sig: signal.Signals, code: int, said: str
) -> None:
    """^C or SIGTERM while the workers still load: the exit status says which, in one line
    (not click's "Aborted!", exit 1), and no worker, Redis or run folder is left."""
    out = tmp_path / "out.parquet"
    client = local_run(photos, out, tmp_path / "tmp", tiny_weights)
    lines = signal_when(
        client,
        sig,
        lambda line: "local" in line and all(w["state"] != "ready" for w in line["local"]),
    )
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == code, stderr[-3000:]
    assert f"error: {said}: run the same command again to go on" in stderr
    assert "Aborted" not in stderr and "Traceback" not in stderr
    pids = worker_pids(lines)
    assert pids and not any(alive(pid) for pid in pids)
    assert list((tmp_path / "tmp").glob("gpufeed-local-*")) == []
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_to_a_local_run_commits_its_rows_and_removes_its_folder(
    photos: Path, tmp_path: Path, tiny_weights: Path
) -> None:
    """What `timeout` does to `producer batch --local`: the answered rows committed, the
    workers drained and gone, the run folder removed, exit 143."""
    out = tmp_path / "out.parquet"
    # One job at a time, each sealed alone after a 200 ms wait: a run of about 5 s.
    client = local_run(
        photos, out, tmp_path / "tmp", tiny_weights, "--in-flight", "1", "--checkpoint", "600",
        GPUFEED_MAX_WAIT_MS="200",
    )  # fmt: skip
    lines = signal_when(client, signal.SIGTERM, lambda line: answered(line, 4))
    _, stderr = client.communicate(timeout=120)

    assert client.returncode == 143, stderr[-3000:]
    assert "error: terminated (SIGTERM): run the same command again to go on" in stderr
    assert "local: stopping the workers and Redis" in stderr
    seen = lines[-1]["progress"]
    assert len(committed(out)) >= seen["ok"] + seen["errors"] >= 4
    pids = worker_pids(lines)
    assert pids and not any(alive(pid) for pid in pids)
    assert list((tmp_path / "tmp").glob("gpufeed-local-*")) == []
