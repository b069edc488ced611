"""A child process of the worker, from its start to its end.

Started by `spawn` as ``python -m <module> <socket fds> <other fds>``, with the project on
its PYTHONPATH and nothing imported yet; its settings come as its first frame, never on its
command line (they may hold credentials). It answers `Ready` once it has imported what it
runs; the worker waits for that with a timeout at start-up (`Child.wait_ready`) and on its
event loop afterwards, when a child replaces one that ended.

The worker learns of a child's end from its socket: the end of the stream
(`Child.receive` gives None), whatever the cause (a crash, a kill, an exit). What that end
means is the protocol's to say (a decode row blamed, a read failed, outcomes sent again),
and so is what proves a child sound (ready, a read answered, a publish); `Restarts` counts
the children that ended before that, in a row, and says when to give up rather than start
another. `Child.end` ends a child: its input closed, a while to exit, then killed.

A child owns no signal: the worker's Ctrl-C and stop signal reach the whole process group,
and the worker ends its children by closing their sockets once it has drained
(`owned_by_the_worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker.base.errors import GpufeedError
from worker.ipc.frames import Buffer, FrameBuffer, Sender
from worker.ipc.messages import Ready, Wire

_PROJECT = str(Path(__file__).resolve().parents[2])
# How long a child may take to import what it runs and answer `Ready`.
READY_TIMEOUT_S = 60.0
# How long a sender thread may take to end once its socket is shut.
_JOIN_S = 5.0


def spawn(
    module: str, *, sockets: int, fds: Sequence[int] = ()
) -> tuple[subprocess.Popen[bytes], list[socket.socket]]:
    """Start ``python -m module`` with one end of `sockets` socket pairs and `fds`
    inherited, their numbers as its arguments in that order; the worker's ends of the
    pairs, in the same order."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(sockets)]
    passed = (*(theirs.fileno() for _, theirs in pairs), *fds)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT, env.get("PYTHONPATH")) if p)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *map(str, passed)],
            pass_fds=passed,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        for mine, _ in pairs:
            mine.close()
        raise
    finally:
        for _, theirs in pairs:
            theirs.close()
    return popen, [mine for mine, _ in pairs]


def reap(popen: subprocess.Popen[bytes], wait_s: float) -> int:
    """The exit code of a child told to end: `wait_s` to exit by itself, then killed."""
    try:
        return popen.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()


def owned_by_the_worker() -> None:
    """In the child: the terminal's Ctrl-C and systemd's stop signal are the worker's alone
    (it drains its batches, then ends this process by closing its socket)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ChildNotReady(GpufeedError, RuntimeError):
    """A child ended, or did not answer in time, before it was ready."""

    def __init__(self, child_exit: int | None) -> None:
        super().__init__("a child process was not ready")
        self.child_exit = child_exit  # the child's exit code; None: it did not answer in time

    def said(self, one: str, all_of_them: str | None = None) -> str:
        """What happened, of `one` child (`all_of_them`: of all that were started)."""
        if self.child_exit is None:
            return f"{all_of_them or one} did not start in {READY_TIMEOUT_S:g} s"
        return f"{one} exited with {self.child_exit} before it was ready (its error is above)"


class Restarts:
    """The children of one kind that ended in a row before they proved themselves (what
    proves one is the protocol's to say): at `limit` of them the protocol gives up instead
    of starting another."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def charge(self) -> bool:
        """One more child not proved; True: give up."""
        self.in_a_row += 1
        return self.given_up

    def proved(self) -> None:
        self.in_a_row = 0

    @property
    def given_up(self) -> bool:
        return self.in_a_row >= self.limit


class Child:
    """A child with two sockets: frames go to it from a sender thread of its own (blocking
    sends), its messages come back on the other, read on the event loop without blocking."""

    def __init__(
        self,
        module: str,
        *,
        wire: Wire,
        sender: str,
        fds: Sequence[int] = (),
        send_buffer: int = 0,
        sendmsg: Callable[[socket.socket, list[memoryview]], int] | None = None,
    ) -> None:
        """`sender`: its sender thread's name; `send_buffer`: the socket's send buffer in
        bytes (0: the system's)."""
        self.wire = wire
        self.popen, (data, self.answers) = spawn(module, sockets=2, fds=fds)
        if send_buffer:
            with contextlib.suppress(OSError):
                data.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.answers.setblocking(False)
        self.sender = Sender(data, sender, sendmsg=sendmsg)
        self.sender.start()
        self.ready = False
        self._frames = FrameBuffer()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, message: Any) -> None:
        self.sender.put((self.wire.frame(message),))

    def send_parts(self, buffers: Sequence[Buffer]) -> None:
        """A frame made by `Wire.parts`: its tail goes from the caller's buffers."""
        self.sender.put(buffers)

    def watch(
        self, loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any
    ) -> None:
        """Call `callback(*args)` on `loop` whenever the child's messages (or its end) come."""
        self._loop = loop
        loop.add_reader(self.answers.fileno(), callback, *args)

    def unwatch(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self.answers.fileno())

    def receive(self) -> list[Any] | None:
        """The child's messages received so far (`[]`: none whole yet); None: it has ended."""
        messages = self._frames.receive(self.answers, self.wire.message)
        if messages and not self.ready:
            self.ready = any(isinstance(m, Ready) for m in messages)
        return messages

    def wait_ready(self, deadline: float, handle: Callable[[Any], None]) -> None:
        """Start-up only: block until the child is ready (`deadline`: a time.monotonic());
        each message that comes meanwhile, `Ready` included, goes to `handle`. Raises
        ChildNotReady."""
        sock = self.answers
        sock.setblocking(True)
        try:
            while not self.ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildNotReady(None)
                sock.settimeout(left)
                messages = self.receive()
                if messages is None:
                    raise ChildNotReady(self.popen.wait())
                for message in messages:
                    handle(message)
        finally:
            sock.setblocking(False)

    def close(self) -> None:
        """No more frames: the child reads the end of its socket once those queued are sent,
        and ends by itself."""
        self.sender.close()

    def end(self, wait_s: float) -> int:
        """End the child: its input closed, `wait_s` to exit by itself, then killed; its
        sockets closed. Its exit code."""
        self.unwatch()
        self.sender.close()
        code = reap(self.popen, wait_s)
        # Shut, a socket ends a sender blocked on it, its child gone.
        with contextlib.suppress(OSError):
            self.sender.sock.shutdown(socket.SHUT_RDWR)
        self.sender.join(_JOIN_S)
        self.sender.sock.close()
        self.answers.close()
        return code
