"""The payload memory: image bytes as the intake's process read them from Redis, shared
with the decode processes, so they never pass through the worker's process.

One anonymous memory file (memfd, like the staging arena of worker/decode/arena.py: counted
against the container's memory, not `/dev/shm`). The intake's process
(worker/delivery/intake_main.py) writes each read's payloads into it; the decode processes
read them where they lie; the worker's process maps it read-only and holds only each job's
offset and length. Which part may be written next is the worker's to say
(worker/delivery/payload_ring.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os

# What each job's payload may take on average before the ring sends the rest as bytes
# through the socket; the memory is only committed where written.
PER_JOB_BYTES = 256 * 1024
MIN_BYTES = 16 << 20
MAX_BYTES = 1 << 30


def payload_bytes(in_flight: int) -> int:
    """The payload memory for a worker that holds `in_flight` jobs at most."""
    return max(MIN_BYTES, min(MAX_BYTES, in_flight * PER_JOB_BYTES))


class PayloadMemory:
    """The worker's side: the memory file, its size, and a read-only view of it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("gpufeed-payloads", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._memory = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            os.close(self.fd)
            raise
        # Read-only: the worker never writes a payload, and a read-only view of bytes can be
        # hashed and sliced as bytes can.
        self.view = memoryview(self._memory)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        with contextlib.suppress(BufferError):
            # A job's view still alive keeps the mapping until it goes.
            self._memory.close()
        os.close(self.fd)
        self.fd = -1


def open_payloads(fd: int, size: int, *, write: bool) -> memoryview:
    """A process's view of the payload memory it inherited as `fd`."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot))
