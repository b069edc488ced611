"""A private redis-server for tests: a free loopback port, nothing kept on disk by default.

`persistent=True` turns on the append-only file with an fsync per write (`appendonly yes`,
`appendfsync always`), so that a server stopped (or killed) and started again on the same
port and folder comes back with every write it acknowledged.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Starts `redis-server` as a child process and stops it on `stop()`."""

    def __init__(
        self,
        workdir: Path,
        *extra_args: str,
        port: int | None = None,
        persistent: bool = False,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make setup`")
        self.port = port or free_port()
        self.workdir = workdir
        self.persistent = persistent
        workdir.mkdir(parents=True, exist_ok=True)
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if persistent
            else ["--appendonly", "no"]
        )
        self._args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *persistence,
            "--dir",
            str(workdir),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30) -> RedisServer:
        """Start the server (again, after `stop()` or `kill()`: same port, same folder) and
        return once it answers PING, after loading its append-only file if it has one."""
        self.proc = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()  # BusyLoadingError (still loading) is a ConnectionError
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()
        return self

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (with persistence on, the AOF is flushed and fsynced)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown at all; with `appendfsync always` nothing acknowledged is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0, *, hard: bool = False) -> RedisServer:
        """Stop (or kill, with `hard`), stay down `down_s` seconds, start again."""
        if hard:
            self.kill()
        else:
            self.stop()
        if down_s > 0:
            time.sleep(down_s)
        return self.start()
