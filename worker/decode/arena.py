"""Staging memory shared between the worker and its decode processes.

One anonymous memory file (memfd) holds, side by side:

- the input ring's rows (`slots * batch` rows of R x R x 3 uint8), which decode processes
  write and the worker copies to the device from, registered once as pinned on CUDA;
- a result table, one record per row: what the decode of that row found (format, size,
  DCT scale, time, error), written by the process before it says the row is done;
- one progress record per decode process: which row it works on and since when, so the
  worker can end a decode over its budget without a message per image;
- with packed rows (worker/decode/packed.py), two fill counters per slot.

A memfd is anonymous shared memory: it is counted against the container's memory, not
against `/dev/shm` (64 MB under Docker's defaults), needs no file system and disappears
with the last process holding it. Its descriptor is inherited by the decode processes,
which map the same pages.

No torch here: the decode processes import this module and must not pay for it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from producer.wire import ErrorCode
from worker.decode.packed import PackedSlots

# Row states in the result table. The worker sets PENDING before it sends a row; the decode
# process writes the record's fields, then the state, last. DEFERRED: left for the GPU
# decoder (worker/decode/gpu_packed.py), its upright size in the record.
PENDING = 0
DONE = 1
FAILED = 2
DEFERRED = 3

MESSAGE_BYTES = 240
ERROR_CODES: tuple[ErrorCode, ...] = tuple(ErrorCode)

RESULT = np.dtype(
    [
        ("state", "<i4"),
        ("width", "<i4"),
        ("height", "<i4"),
        ("draft_scale", "<i4"),
        ("decode_us", "<i8"),
        ("cached", "u1"),
        ("reduced", "u1"),
        ("error", "<i2"),
        ("format", "S8"),
        # DEFERRED: the JPEG's bytes the process staged at the row's place in the slot (a
        # `path` job's, read here), 0 where the worker holds them (an `image` job's).
        ("staged", "<i4"),
        ("message", f"S{MESSAGE_BYTES}"),
    ]
)

# `token` names the work item (0: idle), `row` its row in the ring, `started_ns` when the
# process began its run of that item's rows (CLOCK_MONOTONIC, the same clock in every
# process): the decode budget counts from there.
PROGRESS = np.dtype([("token", "<i8"), ("row", "<i8"), ("started_ns", "<i8")])

_ALIGN = 4096


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Where each part lies in the memory file; sent to the decode processes as is."""

    rows: int  # rows in the ring: slots * batch
    side: int  # a row is side x side x 3 bytes
    processes: int  # progress records (the most decode processes alive at once)
    # Packed rows (worker/decode/packed.py): the rows per slot, whose memory each slot packs
    # its images into; 0: fixed rows.
    batch: int = 0

    @property
    def slots(self) -> int:
        return self.rows // self.batch if self.batch else 0

    @property
    def row_bytes(self) -> int:
        return self.side * self.side * 3

    @property
    def rows_offset(self) -> int:
        return 0

    @property
    def table_offset(self) -> int:
        return _aligned(self.rows * self.row_bytes)

    @property
    def progress_offset(self) -> int:
        return self.table_offset + _aligned(self.rows * RESULT.itemsize)

    @property
    def fill_offset(self) -> int:
        """Where the packed slots' fill counters lie (two int64 per slot: bottom, top)."""
        return self.progress_offset + _aligned(self.processes * PROGRESS.itemsize)

    @property
    def size(self) -> int:
        return self.fill_offset + _aligned(self.slots * 16)


class SharedArena:
    """The memory file and the three views over it; `open` maps an inherited one."""

    def __init__(self, layout: ArenaLayout, fd: int, memory: mmap.mmap) -> None:
        self.layout = layout
        self.fd = fd
        self.memory = memory
        self.rows: npt.NDArray[np.uint8] = np.ndarray(
            (layout.rows, layout.side, layout.side, 3),
            dtype=np.uint8,
            buffer=memory,
            offset=layout.rows_offset,
        )
        self.table: npt.NDArray[np.void] = np.ndarray(
            (layout.rows,), dtype=RESULT, buffer=memory, offset=layout.table_offset
        )
        self.progress: npt.NDArray[np.void] = np.ndarray(
            (layout.processes,), dtype=PROGRESS, buffer=memory, offset=layout.progress_offset
        )
        self.base = self.rows.__array_interface__["data"][0]
        self.packed: PackedSlots | None = None
        if layout.batch:
            slots = np.ndarray(
                (layout.slots, layout.batch * layout.row_bytes),
                dtype=np.uint8,
                buffer=memory,
                offset=layout.rows_offset,
            )
            fill: npt.NDArray[np.int64] = np.ndarray(
                (layout.slots, 2), dtype="<i8", buffer=memory, offset=layout.fill_offset
            )
            self.packed = PackedSlots(
                slots,
                fill,
                batch=layout.batch,
                row_side=layout.side - 1,
                fd=fd,
                fill_offset=layout.fill_offset,
            )

    @classmethod
    def create(cls, layout: ArenaLayout) -> SharedArena:
        fd = os.memfd_create("gpufeed-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.size)
            memory = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(fd)
            raise
        return cls(layout, fd, memory)

    @classmethod
    def open(cls, layout: ArenaLayout, fd: int) -> SharedArena:
        memory = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED)
        return cls(layout, fd, memory)

    def row_index(self, rows: npt.NDArray[np.uint8]) -> int:
        """The index of the first ring row `rows` (a view of `self.rows`) starts at."""
        offset = rows.__array_interface__["data"][0] - self.base
        index, rest = divmod(offset, self.layout.row_bytes)
        if rest or not 0 <= index < self.layout.rows:
            raise ValueError("rows are not ring rows of this arena")
        return int(index)

    def close(self) -> None:
        """Unmap and close; views still alive keep the mapping until they go."""
        # numpy views (the torch tensors over the ring) may still hold it: the mapping goes
        # with them then.
        with contextlib.suppress(BufferError):
            self.memory.close()
        os.close(self.fd)
