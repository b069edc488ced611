"""A bounded cache of decoded staging rows, keyed by a hash of the encoded bytes.

Batch workloads often send the same image many times (thumbnails, logos, re-submitted
jobs). Decoding a 4000x3000 JPEG costs tens of milliseconds of CPU; copying a cached
[S, S, 3] row costs microseconds. The key is a 128-bit BLAKE2b digest of the bytes (far
cheaper than a decode: docs/concepts.md#decode-processes), and the cache holds rows, not
tensors on the device, so it costs host memory only and never touches the hot path's
buffers.

The key includes the job's reply stream: a hit shows in the result (`cached`, and a decode
time near zero), so a cache shared between reply streams would tell one tenant that another
sent the same bytes recently. Jobs answered on the same stream share their hits.

Thread-safe: decode threads call it concurrently.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from worker.decode.cpu import DecodeInfo


def cache_key(data: bytes, namespace: str = "") -> bytes:
    """The key of `data` decoded for jobs answered on `namespace` (their reply stream)."""
    h = hashlib.blake2b(digest_size=16)
    name = namespace.encode("utf-8", "surrogatepass")
    # Length-prefixed, so that no (namespace, data) pair can collide with another.
    h.update(len(name).to_bytes(4, "big"))
    h.update(name)
    h.update(data)
    return h.digest()


class DecodeCache:
    """LRU by bytes held: `max_bytes` bounds the rows' memory (0 turns the cache off)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, tuple[npt.NDArray[np.uint8], DecodeInfo]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is kept (not counted as a hit or a miss)."""
        with self._lock:
            return key in self._rows

    def get(self, key: bytes) -> tuple[npt.NDArray[np.uint8], DecodeInfo] | None:
        """The cached row for `key` (read-only: never modified after insertion) and its
        info; None on a miss."""
        with self._lock:
            entry = self._rows.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: bytes, row: npt.NDArray[np.uint8], info: DecodeInfo) -> None:
        """Keep a private copy of `row` (the caller's buffer is a reused staging row)."""
        size = row.nbytes
        if not self.enabled or size > self.max_bytes:
            return
        copy = row.copy()
        copy.flags.writeable = False
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self._bytes -= old[0].nbytes
            self._rows[key] = (copy, info)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (evicted, _) = self._rows.popitem(last=False)
                self._bytes -= evicted.nbytes
