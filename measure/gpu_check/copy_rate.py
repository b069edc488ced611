"""Host-to-device copy rate for batches of packed rows: one pinned batch copied again and
again with non-blocking copies on a side stream, as the worker's transfer stage does, timed
by CUDA events. Its GB/s over the bytes a 640x480 image stages (its pixels and its 64-byte
record) is the most images/s the link carries in packed rows."""

from __future__ import annotations

import time
from typing import Any

import torch

from worker.decode.packed import HEADER_BYTES


def packed_image_bytes(width: int, height: int) -> int:
    """What one image of width x height stages in packed rows: its pixels and its record."""
    return width * height * 3 + HEADER_BYTES


def h2d_rate(
    device: torch.device, *, image_bytes: int, batch: int, seconds: float
) -> dict[str, Any]:
    """GB/s of `batch` x `image_bytes` copied from pinned host memory to `device`, and the
    images/s that is; a CUDA device only."""
    nbytes = batch * image_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    copies = 0
    with torch.cuda.stream(stream):
        dest.copy_(host, non_blocking=True)  # the first copy maps what it needs
        stream.synchronize()  # measurement
        start.record(stream)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                dest.copy_(host, non_blocking=True)
            copies += 4
            # Measurement: a few copies queued at a time, never an unbounded queue.
            stream.synchronize()
        end.record(stream)
        end.synchronize()
    gb_per_s = copies * nbytes / (start.elapsed_time(end) / 1000.0) / 1e9
    return {
        "batch": batch,
        "bytes_per_image": image_bytes,
        "bytes_per_batch": nbytes,
        "copies": copies,
        "gb_per_s": round(gb_per_s, 2),
        "images_per_s": round(gb_per_s * 1e9 / image_bytes),
    }
