"""`python -m worker top` in a real terminal (tmux), as an operator sees it at 80 and 160
columns: the table fits by leaving out columns in the stated order, names stay whole, the
legend says what the stages are, `l` toggles it and `q` quits."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.support.cli_runner import clean_env
from tests.tools.test_top import snapshot
from worker.observe.observer import heartbeat_key, write_heartbeat

ROOT = Path(__file__).resolve().parents[2]
LONG_NAME = "vm-28001-a-long-worker-name"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Pane:
    """One tmux session of its own (a private server socket) running `top`."""

    def __init__(self, socket: str, width: int) -> None:
        self.socket = socket
        self.width = width

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=False
        )

    def text(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top").stdout

    def wait_for(self, ok: Callable[[str], bool], what: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            screen = self.text()
            if ok(screen):
                return screen
            assert time.monotonic() < deadline, f"no {what} on the screen:\n{screen}"
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", "top").returncode == 0


@pytest.fixture
def top_in_tmux(redis_url: str, tmp_path: Path) -> Iterator[Callable[[int], Pane]]:
    started: list[Pane] = []

    def start(width: int) -> Pane:
        pane = Pane(f"gpufeed-top-{tmp_path.name}-{width}", width)
        command = " ".join(
            shlex.quote(part)
            for part in (sys.executable, "-m", "worker", "top", "--interval", "0.5")
        )
        session = ["new-session", "-d", "-s", "top", "-x", str(width), "-y", "50"]
        shell = f"cd {shlex.quote(str(ROOT))} && exec {command}"
        subprocess.run(
            ["tmux", "-L", pane.socket, "-f", "/dev/null", *session, shell],
            env=clean_env(REDIS_URL=redis_url, TERM="xterm-256color"),
            check=True,
        )
        started.append(pane)
        return pane

    yield start
    for pane in started:
        pane.tmux("kill-server")


async def _heartbeats(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    try:
        stages = {
            "redis_wait": 143.0,
            "queue": 39.8,
            "decode": 2221.0,
            "batch_wait": 939.0,
            "compute": 2.2,
            "write": 3.1,
        }
        for name in (LONG_NAME, "vm-28002"):
            snap = snapshot(name, stage_ms=stages, errors_by_code={"decode_error": 2})
            await write_heartbeat(client, heartbeat_key(name), snap, ttl_s=300)
    finally:
        await client.aclose()


def _table(screen: str) -> list[str]:
    lines = screen.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["worker"])
    return lines[head : head + 4]


def test_top_fits_80_columns_by_leaving_out_columns_in_order(
    redis_url: str, top_in_tmux: Callable[[int], Pane]
) -> None:
    asyncio.run(_heartbeats(redis_url))
    pane = top_in_tmux(80)
    screen = pane.wait_for(lambda s: "vm-28002" in s and "left out" in s, "table")
    table = _table(screen)
    assert not any("…" in line for line in table), screen  # no cell is cut
    assert table[0].split() == ["worker", "j/s", "p99", "decode", "model_wait", "compute", "GPU"]
    assert LONG_NAME in screen  # whole
    # The backlog line breaks between its parts, not inside one.
    assert [line.rstrip() for line in screen.splitlines()[:2]] == [
        "stream gpufeed:jobs: length no such stream | group gpufeed: none yet | workers 2",
        "25.0 jobs/s",
    ], screen
    assert "left out to fit the terminal: in flight, ok, device, p50 ms, fill, CPU" in " ".join(
        screen.split()
    )
    # The legend explains the stage columns shown, and what model_wait is not.
    assert "model_wait sealed batch waiting to run | faster step, not GPUFEED_MAX_WAIT_MS" in screen
    # `l` hides the legend, `l` again shows it; `q` quits.
    pane.tmux("send-keys", "-t", "top", "l")
    pane.wait_for(lambda s: "l shows the legend" in s and "model_wait sealed" not in s, "no legend")
    pane.tmux("send-keys", "-t", "top", "l")
    pane.wait_for(lambda s: "model_wait sealed" in s, "legend again")
    pane.tmux("send-keys", "-t", "top", "q")
    deadline = time.monotonic() + 20
    while pane.alive():
        assert time.monotonic() < deadline, "q did not quit"
        time.sleep(0.2)


def test_top_at_160_columns_shows_every_column(
    redis_url: str, top_in_tmux: Callable[[int], Pane]
) -> None:
    asyncio.run(_heartbeats(redis_url))
    pane = top_in_tmux(160)
    screen = pane.wait_for(lambda s: "vm-28002" in s and "model_wait sealed" in s, "table")
    table = _table(screen)
    assert not any("…" in line for line in table), screen
    heads = table[0].split()
    for head in ("redis_wait", "queue", "decode", "model_wait", "compute", "write", "CPU"):
        assert head in heads, screen
    assert "left out" not in screen
    row = next(line for line in table if line.startswith(f" {LONG_NAME} "))
    assert "2221" in row and "939" in row
