"""What the GIL costs one call of the GPU decode lane: a batch's images decoded by
nvImageCodec into their places, timed alone and beside a Python thread that never lets the
GIL go on its own (the event loop, the dispatcher, a busy decode thread), per executor
thread count, switch interval and call size.

nvImageCodec releases the GIL around a batch's decode, but takes it back and lets it go
several times per image while it prepares the call (each source parsed, each caller buffer
wrapped and reshaped with the GIL released), and a thread that wants the GIL back waits for
the holder to drop it: up to the switch interval (5 ms by default) when the holder is a busy
Python thread. A thread busy in native code (no GIL) shows what is CPU contention alone.

Without CUDA the decoder is the library's CPU-only backend (the same Python binding and
calls; the decode itself runs on its threads instead of the GPU's engines):

    .venv/bin/python scripts/lane_gil.py [--images 64] [--size 64x64] [--calls 200]

On a GPU host `--device 0` runs the lane's own decoder (the GPU backends that answer).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from worker.decode.codecs import Place
from worker.decode.nvimgcodec import NvImgCodec
from worker.decode.samples import synthetic_jpeg

BUSY = ("alone", "python", "native")


@contextmanager
def busy_thread(kind: str) -> Iterator[None]:
    """Until the block ends, a thread that runs pure Python (`python`: it holds the GIL but
    for the interpreter's switches) or native code without the GIL (`native`: hashing
    1 MB at a time, a core taken without the GIL), or none (`alone`)."""
    stop = threading.Event()
    block = bytes(1 << 20)

    def python() -> None:
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                n += 1

    def native() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    thread = threading.Thread(target=python if kind == "python" else native, daemon=True)
    if kind != "alone":
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if kind != "alone":
            thread.join()


def timed_calls(
    backend: NvImgCodec,
    images: list[bytes],
    buffer: torch.Tensor,
    places: list[Place],
    *,
    split: int,
    calls: int,
    stream: Any,
) -> list[float]:
    """Milliseconds per lane call (its images in `split` library calls, as one lane call
    cut into parts would make them)."""
    handle = int(stream.cuda_stream) if stream is not None else 0
    part = -(-len(images) // split)
    out: list[float] = []
    for _ in range(calls):
        t0 = time.perf_counter()
        for start in range(0, len(images), part):
            ok = backend.decode_into(
                images[start : start + part], buffer, places[start : start + part], handle
            )
            if not all(ok):
                raise RuntimeError("an image failed to decode")
        if stream is not None:
            stream.synchronize()  # measurement: the call's queued decode is part of it
        out.append((time.perf_counter() - t0) * 1000)
    return out


def summary(ms: list[float]) -> str:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"median {statistics.median(ms):7.2f}  mean {statistics.fmean(ms):7.2f}  "
        f"p99 {p99:7.2f}  max {max(ms):7.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT of each JPEG")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", type=int, default=None, help="CUDA device (default: CPU)")
    parser.add_argument("--threads", default="1,2,0", help="executor threads to try (0: cores)")
    parser.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals, s")
    parser.add_argument("--splits", default="1,2,4", help="library calls per lane call")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    images = [synthetic_jpeg(width, height, seed=i % 16, quality=85) for i in range(args.images)]
    size = width * height * 3
    places = [(i * size, height, width) for i in range(args.images)]
    cuda = args.device is not None
    device = torch.device("cuda", args.device) if cuda else torch.device("cpu")
    buffer = torch.empty(args.images * size, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
    default_interval = sys.getswitchinterval()
    print(f"{args.images} images of {width}x{height} per lane call, {args.calls} calls each")
    for threads in (int(t) for t in args.threads.split(",")):
        backend = NvImgCodec(device if cuda else None, threads=threads)
        print(f"\n{backend.name}, max_num_cpu_threads={threads}")
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            timed_calls(
                backend, images, buffer, places, split=1, calls=5, stream=stream
            )  # its state built
            for interval in (float(v) for v in args.intervals.split(",")):
                sys.setswitchinterval(interval)
                try:
                    for split in (int(v) for v in args.splits.split(",")):
                        for busy in BUSY:
                            with busy_thread(busy):
                                ms = timed_calls(
                                    backend,
                                    images,
                                    buffer,
                                    places,
                                    split=split,
                                    calls=args.calls,
                                    stream=stream,
                                )
                            print(
                                f"  switch {interval * 1000:5.2f} ms  calls {split}  "
                                f"{busy:6}  {summary(ms)}"
                            )
                finally:
                    sys.setswitchinterval(default_interval)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    main()
