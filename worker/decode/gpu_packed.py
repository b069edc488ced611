"""Batched JPEG decode on the GPU's hardware engines, straight into packed rows.

With decode processes and packed rows (worker/decode/packed.py) a batch's images reach the
device as one run of bytes. The rows this module decodes never pass through the host: each
image's place is taken from the top of its slot (so the host-to-device copy, which takes
the header and the bytes counted from the bottom, leaves it alone), its record (geometry,
place, size) is written into the host header, which that copy carries, and the decoder
writes its pixels at that place in the slot's device twin. The step's resampler reads it
there like any other row.

The library is NVIDIA nvImageCodec: one `decode` call per batch takes the whole list and
releases the GIL around the native work (and briefly per image while it prepares the call,
which is why lanes on CUDA shorten the interpreter's switch interval); `images=` decodes
into caller buffers (here views of the twin) on our CUDA stream; it returns None for an
image it could not decode and keeps the list's length, so a bad image fails alone; it
applies EXIF orientation, so rows are recorded upright. Its hardware backend takes baseline
JPEGs (the decode processes route only those here); nvJPEG's CUDA decoder takes what it
passes on. Its CPU backend is never asked on CUDA: a row no GPU backend decodes goes back to
the decode processes. The same library decodes without a GPU (`NVIMGCODEC_DEVICE_CPU_ONLY`),
which is how the tests on a machine without CUDA exercise its real contract.

The library reshapes a caller's buffer to what it decoded and reports success, so each
row's decoded shape is checked against its place (the upright size the decode process read
from the header): a row the library turned otherwise goes back to the processes, counted.

A decoder is not shared between threads, so `PackedGpuDecoder` keeps two lanes, each a
decoder, a CUDA stream and a thread: two batches decode at once, neither waits for the
other's host work. Before writing a twin a lane's stream waits, on the GPU, for the event
after that twin's last read; after the call it records the event the step waits for. No
host thread waits on the device here.

Rows the decoder returns as failed, and every row of a call that raised, go back to the
CPU decoders (their records cleared first): a GPU failure never fails a row by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from worker.base.device import DoneEvent, Event, cuda_event
from worker.decode.codecs import IntoCodec, Place
from worker.decode.cpu import DecodeSpec
from worker.decode.nvimgcodec import HARDWARE_BACKEND
from worker.decode.packed import PackedSlots
from worker.decode.rows import decode_row
from worker.decode.samples import synthetic_jpeg

log = structlog.get_logger("gpufeed.gpu_decode")

# Lanes: decoders (each with its stream and thread) decoding batches side by side.
LANES = 2

# The interpreter's switch interval while lanes run on CUDA (never raised). nvImageCodec
# lets the GIL go and takes it back several times per image inside a call (each source
# parsed, each caller buffer wrapped and reshaped with it released), and each time a busy
# Python thread holds it (the event loop under load) the lane waits up to the interval for
# it: a call many times longer than alone at the default interval, a small multiple at
# this one (scripts/lane_gil.py measures it; docs/gpu-hosts.md#the-hot-path, step 7, gives
# the figures). The busy thread's own rate did not change; the executor's thread count and
# splitting the call did not help.
LANE_SWITCH_INTERVAL_S = 0.0002

# The profiler range around a lane's decode call. nvImageCodec's hardware decoder waits on
# the host, on the calling thread, for its own previous batch on that decoder to finish
# (one cudaEventSynchronize per call, hw_decoder.cpp): the GPU check's sync window reports
# the waits inside this range apart from the serving path's.
LANE_SCOPE = "gpufeed.gpu_decode_lane"


@dataclass(frozen=True)
class DeferredRow:
    """A JPEG a decode process left for the GPU: its ring row, its bytes, and what its
    header says it decodes to, upright (EXIF applied), with the row's geometry words."""

    row: int
    data: bytes | memoryview
    height: int
    width: int
    # The record's geometry words; None: the decode process wrote them into the record.
    geometry: tuple[int, ...] | None = None
    # Its place in the slot, taken already (-1: not yet): a `path` job's bytes, which the
    # decode process staged there, in host memory the copy to the device never takes.
    offset: int = -1


@dataclass
class PackedGpuResult:
    ready: Event | None  # the decoded rows are in the twin once this fired
    decoded: list[int]  # rows written
    failed: list[int]  # rows for the CPU decoders (records cleared)
    decode_ms: float  # the call, host side, per decoded row


@dataclass
class _Lane:
    backend: IntoCodec
    stream: Any  # torch.cuda.Stream, or None off CUDA


class PackedGpuDecoder:
    """Decodes a batch's deferred rows into its slot's device twin, on one of its lanes."""

    def __init__(
        self,
        packed: PackedSlots,
        make_backend: Callable[[], IntoCodec],
        *,
        device: torch.device,
        lanes: int = LANES,
        make_stream: Callable[[], Any] | None = None,
        record: Callable[[Any], Event] | None = None,
    ) -> None:
        """`make_stream` and `record` (a new stream per lane, an event recorded on one):
        CUDA's by default; the tests' fakes pin the order of the work on them."""
        self.packed = packed
        self.device = device
        if make_stream is None:
            cuda = device.type == "cuda"
            make_stream = (lambda: torch.cuda.Stream(device)) if cuda else (lambda: None)  # type: ignore[no-untyped-call]
        self._record = record or _record_event
        self._lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self.backend_name = ""
        # Per GPU backend, whether it decoded a JPEG at start-up (the GPU check reports it).
        self.engines: dict[str, bool] = {}
        for _ in range(lanes):
            backend = make_backend()
            self.backend_name = backend.name
            self.engines = dict(getattr(backend, "engines", {}))
            self._lanes.put(_Lane(backend, make_stream()))
        self._executor = ThreadPoolExecutor(lanes, thread_name_prefix="gpufeed-gpudecode")
        if device.type == "cuda" and sys.getswitchinterval() > LANE_SWITCH_INTERVAL_S:
            log.info(
                "gpu_decode_switch_interval",
                was_ms=sys.getswitchinterval() * 1000,
                now_ms=LANE_SWITCH_INTERVAL_S * 1000,
            )
            sys.setswitchinterval(LANE_SWITCH_INTERVAL_S)
        # Rows decoded, and rows handed back to the CPU, since start-up (both lanes); of
        # those, rows decoded at another shape than their place's.
        self.decoded = 0
        self.failed = 0
        self.wrong_shape = 0
        self._counts = threading.Lock()
        # Bytes and buffers queued device work may still read, kept until it ran.
        self._retained: deque[tuple[Event, list[Any]]] = deque()

    @property
    def hardware_engines_answered(self) -> bool:
        """Whether the GPU's JPEG engines decoded at start-up (False off CUDA)."""
        return self.engines.get(HARDWARE_BACKEND, False)

    async def decode(
        self, rows: Sequence[DeferredRow], twin: torch.Tensor, *, after: Event | None = None
    ) -> PackedGpuResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.decode_sync, rows, twin, after)

    def decode_sync(
        self, rows: Sequence[DeferredRow], twin: torch.Tensor, after: Event | None = None
    ) -> PackedGpuResult:
        """`twin`: the slot's device bytes (flat uint8, the slot's length); `after`: the
        event after the twin's last read, which the writes wait for on the GPU."""
        lane = self._lanes.get()
        try:
            return self._decode(lane, rows, twin, after)
        finally:
            self._lanes.put(lane)

    def _decode(
        self, lane: _Lane, rows: Sequence[DeferredRow], twin: torch.Tensor, after: Event | None
    ) -> PackedGpuResult:
        self._release_finished()
        t0 = time.perf_counter()
        placed: list[DeferredRow] = []
        places: list[Place] = []
        failed: list[int] = []
        # Rows placed already (a path job's, staged by its process) keep their place; the
        # others take theirs now, in order.
        new = [r for r in rows if r.offset < 0]
        taken = iter(
            self.packed.place_rows_on_device(
                [r.row for r in new],
                [r.height * r.width * 3 for r in new],
                [r.geometry for r in new],
            )
        )
        for r in rows:
            offset = r.offset if r.offset >= 0 else next(taken)
            if offset < 0:  # no room left in the slot: the CPU decodes it
                failed.append(r.row)
                continue
            placed.append(r)
            places.append((offset, r.height, r.width))
        # Off CUDA the "twin" is the host slot itself, where staged bytes lie under the very
        # place their pixels go: those are read out first.
        on_host = self.device.type != "cuda"
        datas = [bytes(r.data) if on_host and r.offset >= 0 else r.data for r in placed]
        ok: list[bool] = [False] * len(placed)
        misshapen: Sequence[tuple[int, tuple[int, ...]]] = ()
        with _stream_ctx(lane.stream):
            if after is not None and lane.stream is not None:
                lane.stream.wait_event(after)
            handle = int(lane.stream.cuda_stream) if lane.stream is not None else 0
            try:
                if placed:
                    with torch.profiler.record_function(LANE_SCOPE):
                        ok = lane.backend.decode_into(datas, twin, places, handle)
                    if len(ok) != len(placed):
                        raise RuntimeError(f"{len(ok)} answers for {len(placed)} images")
                    misshapen = getattr(lane.backend, "misshapen", ())
            except Exception as exc:  # noqa: BLE001 - whatever it raised: the CPU decodes them
                log.error(
                    "gpu_decode_failed",
                    decoder=lane.backend.name,
                    rows=len(placed),
                    error=f"{type(exc).__name__}: {exc}",
                    fallback="cpu decode",
                )
                ok = [False] * len(placed)
            ready = self._record(lane.stream)
        # The twin outlives the decoder; the bytes the queued work reads may not.
        self._retained.append((ready, [datas]))
        if misshapen:
            log.warning(
                "gpu_decode_wrong_shape",
                decoder=lane.backend.name,
                rows=[placed[i].row for i, _ in misshapen],
                expected=[(placed[i].height, placed[i].width, 3) for i, _ in misshapen],
                decoded=[shape for _, shape in misshapen],
                fallback="cpu decode",
            )
        decoded: list[int] = []
        for r, good in zip(placed, ok, strict=True):
            if good:
                decoded.append(r.row)
            else:
                self.packed.clear_record(r.row)
                failed.append(r.row)
        with self._counts:
            self.decoded += len(decoded)
            self.failed += len(failed)
            self.wrong_shape += len(misshapen)
        ms = (time.perf_counter() - t0) * 1000 / max(1, len(decoded))
        return PackedGpuResult(ready=ready, decoded=decoded, failed=failed, decode_ms=ms)

    def time_decode(self, datas: Sequence[bytes], height: int, width: int) -> float:
        """Start-up only (it waits for the device): the seconds one lane takes to decode
        `datas` (each height x width) into a buffer of its own, the second of two calls
        (the first builds the decoder's state). Raises RuntimeError when an image fails."""
        size = height * width * 3
        out = torch.empty(len(datas) * size, dtype=torch.uint8, device=self.device)
        places = [(i * size, height, width) for i in range(len(datas))]
        lane = self._lanes.get()
        try:
            elapsed = 0.0
            for _ in range(2):
                t0 = time.perf_counter()
                with _stream_ctx(lane.stream):
                    handle = int(lane.stream.cuda_stream) if lane.stream is not None else 0
                    ok = lane.backend.decode_into(datas, out, places, handle)
                    done = self._record(lane.stream)
                _wait(done)
                elapsed = time.perf_counter() - t0
        finally:
            self._lanes.put(lane)
        if not all(ok) or len(ok) != len(datas):
            raise RuntimeError(f"{lane.backend.name} could not decode its own sample JPEGs")
        return elapsed

    def _release_finished(self) -> None:
        # Appended and popped from the lanes' threads: deque's append and popleft are atomic.
        with contextlib.suppress(IndexError):
            while self._retained and self._retained[0][0].query():
                self._retained.popleft()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _share(gpu: float, cpu: float) -> float:
    return gpu / (gpu + cpu) if gpu + cpu > 0 else 0.0


@dataclass(frozen=True)
class DecodeRates:
    """The two decoders' rates on photo-sized and thumbnail JPEGs, measured at start-up."""

    sample: str  # the photo sample's size, e.g. 640x480
    gpu_images_per_s: float
    cpu_images_per_s: float  # all decode processes
    processes: int
    # The same on 64x64 JPEGs: a hardware decoder's cost per image barely falls with its
    # size, the CPU's does, so thumbnails get a share of their own.
    thumbnail_gpu_images_per_s: float = 0.0
    thumbnail_cpu_images_per_s: float = 0.0

    @property
    def share(self) -> float:
        """The GPU's share of the rows that keeps both decoders busy."""
        return _share(self.gpu_images_per_s, self.cpu_images_per_s)

    @property
    def thumbnail_share(self) -> float:
        return _share(self.thumbnail_gpu_images_per_s, self.thumbnail_cpu_images_per_s)

    @property
    def thumbnail_accept(self) -> float:
        """Of the thumbnails offered to the GPU at `share`, the fraction it takes so that it
        decodes `thumbnail_share` of them (1: all)."""
        return min(1.0, self.thumbnail_share / self.share) if self.share > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "gpu_images_per_s": round(self.gpu_images_per_s, 1),
            "cpu_images_per_s": round(self.cpu_images_per_s, 1),
            "processes": self.processes,
            "share": round(self.share, 3),
            "thumbnail_gpu_images_per_s": round(self.thumbnail_gpu_images_per_s, 1),
            "thumbnail_cpu_images_per_s": round(self.thumbnail_cpu_images_per_s, 1),
            "thumbnail_share": round(self.thumbnail_share, 3),
        }


def _rates(
    decoder: PackedGpuDecoder,
    spec: DecodeSpec,
    side: int,
    processes: int,
    *,
    width: int,
    height: int,
    samples: int,
) -> tuple[float, float]:
    """(GPU images/s, decode processes' images/s) on `samples` JPEGs of width x height."""
    images = [synthetic_jpeg(width, height, seed=i) for i in range(samples)]
    decode_row(images[0], spec, side)
    t0 = time.perf_counter()
    for data in images:
        decode_row(data, spec, side)
    cpu_one = samples / max(time.perf_counter() - t0, 1e-9)
    gpu_s = decoder.time_decode(images, height, width)
    return samples / max(gpu_s, 1e-9), cpu_one * processes


def measure_rates(
    decoder: PackedGpuDecoder, spec: DecodeSpec, side: int, processes: int, *, samples: int = 32
) -> DecodeRates:
    """Start-up only: the GPU decoder's images/s on a batch of photo-like JPEGs of the
    largest photo size a row holds (640x480 where it fits), and on 64x64 ones, against the
    decode processes' (one decode here, timed, times the processes: each has a core of its
    own)."""
    width, height = min(640, side), min(480, side - 1)
    gpu, cpu = _rates(decoder, spec, side, processes, width=width, height=height, samples=samples)
    thumb_gpu, thumb_cpu = _rates(
        decoder, spec, side, processes, width=64, height=64, samples=samples
    )
    return DecodeRates(
        sample=f"{width}x{height}",
        gpu_images_per_s=gpu,
        cpu_images_per_s=cpu,
        processes=processes,
        thumbnail_gpu_images_per_s=thumb_gpu,
        thumbnail_cpu_images_per_s=thumb_cpu,
    )


def _wait(event: Event) -> None:
    # Start-up measurement only (allow-listed in tests/pipeline/test_hot_path_static.py).
    if isinstance(event, torch.cuda.Event):
        event.synchronize()


def _record_event(stream: Any) -> Event:
    if stream is None:
        return DoneEvent(time.perf_counter())
    event = cuda_event()
    event.record(stream)
    return event


def _stream_ctx(stream: Any) -> contextlib.AbstractContextManager[Any]:
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()
