"""The Makefile as a newcomer meets it: `make help` lists every target, and `make run-redis`
does not clash with the OS's own redis-server on 6379."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def makefile_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return re.findall(r"^([a-zA-Z0-9_-]+):(?!=)", text, re.M)


@needs_make
def test_make_help_lists_every_target() -> None:
    targets = makefile_targets()
    assert {"help", "setup", "test", "demo", "run-redis", "run-worker"} <= set(targets)
    out = subprocess.run(
        ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    listed = re.findall(r"^\s+make (\S+)\s+\S", out, re.M)
    assert sorted(listed) == sorted(targets)


def test_run_redis_takes_a_free_port_when_its_port_is_taken(tmp_path: Path) -> None:
    # Someone else (the OS's redis-server) listens on the port run-redis would use.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        err = tmp_path / "stderr"
        with err.open("w") as err_file:
            proc = subprocess.Popen(
                ["bash", "scripts/run-redis.sh"],
                cwd=ROOT,
                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "REDIS_PORT": str(taken)},
                # One file, as a terminal shows both: Redis's banner and log, then ours.
                stdout=err_file,
                stderr=err_file,
            )
        try:
            deadline = time.monotonic() + 20
            # What to use is printed once the server answers, after its own lines.
            while "REDIS_URL=" not in err.read_text():
                assert proc.poll() is None, err.read_text()
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            text = err.read_text()
            port = int(re.search(r"using (\d+) instead", text).group(1))  # type: ignore[union-attr]
            assert port != taken
            assert f"port {taken} is taken" in text
            assert f"REDIS_URL=redis://127.0.0.1:{port}/0" in text
            time.sleep(0.3)  # anything Redis would still say comes after this point
            last = err.read_text().strip().splitlines()[-1]
            assert last.strip() == f"REDIS_URL=redis://127.0.0.1:{port}/0 make run-worker"
            assert "Ready to accept connections" in text.partition("REDIS_URL=")[0]
            client = redis.Redis(port=port)
            while True:
                try:
                    assert client.ping()
                    break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            client.close()
        finally:
            proc.terminate()
            proc.wait(10)
