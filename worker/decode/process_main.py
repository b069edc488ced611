"""A decode process: decodes the rows the worker sends it, straight into the shared ring.

Started by worker/decode/processes.py as ``python -m worker.decode.process_main`` (through
worker/ipc/child.py), with two sockets, the staging memory file and the payload memory
inherited; its settings (`DecodeInit`) are its first frame. It imports the decoders and
numpy, never torch, so it starts in a fraction of a second and holds tens of MB.

What crosses the sockets is typed messages in frames (worker/ipc/): per work item (a run of
one batch's rows, not an image) the worker sends a `Run` (row indices, payload lengths,
paths, reply streams) with the payload bytes as the frame's tail, back to back; the process
answers `RunDone` once every row of it has its record in the result table. The pixels and
each row's record go through shared memory, never through the socket; with packed rows
(worker/decode/packed.py) each image takes its place in its slot as its decode ends. A
run's rows are decoded cheapest first (by the pixels their headers announce), so that a
small image sent beside large ones is done before them; the decode budget bounds the run.

A row the worker flags for the GPU (GPUFEED_DECODE=gpu|auto, packed rows) is only probed
here: a JPEG the GPU's hardware decoder takes as it is, within every limit, gets its
geometry written into its record and is left DEFERRED for the worker's GPU decoder
(worker/decode/gpu_packed.py); anything else is decoded here as always.

The process has no state the worker needs: it can be killed at any moment (a decode over
its budget) and replaced, and the rows it had not finished are sent to its replacement.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import simplejpeg  # type: ignore[import-untyped]
from PIL import Image

from producer.wire import ErrorCode
from worker.decode.arena import (
    DEFERRED,
    DONE,
    ERROR_CODES,
    FAILED,
    MESSAGE_BYTES,
    ArenaLayout,
    SharedArena,
)
from worker.decode.cache import DecodeCache, cache_key
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, write_row
from worker.decode.jpeg_header import segments
from worker.decode.packed import SlotFull
from worker.decode.payloads import open_payloads
from worker.decode.row_policy import RowPolicy, described
from worker.decode.rows import (
    THUMBNAIL_PIXELS,
    DecodedRow,
    GpuPlacement,
    gpu_placement,
    write_decoded_row,
)
from worker.ipc.child import owned_by_the_worker
from worker.ipc.frames import Receiver
from worker.ipc.messages import Ready, Wire

_ERROR_INDEX = {code: i for i, code in enumerate(ERROR_CODES)}
_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_SIZE = struct.Struct(">II")  # IHDR: width, height
_JPEG_SIZE = struct.Struct(">HH")  # SOFn, after the precision: height, width
# Start-of-frame markers: SOFn, not DHT, JPG, DAC.
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class DecodeInit(NamedTuple):
    """A decode process's settings: the first frame the worker sends it."""

    slot: int  # its progress record in the arena
    layout: dict[str, int]  # the arena's ArenaLayout, by field
    spec: dict[str, Any]  # the DecodeSpec, by field
    row_side: int  # 0: rows of the input size, fitted on the device
    path_root: str  # "": path jobs are refused
    cache_bytes: int  # its share of the decode cache
    delay_s: float  # the test hook's sleep before each row
    max_image_pixels: int  # what Pillow may open (GPUFEED_MAX_IMAGE_PIXELS)
    payloads_size: int  # the payload memory's bytes (0: none, payloads come in the tail)


class Run(NamedTuple):
    """A run of one batch's rows; the payloads not in the payload memory come as the
    frame's tail, back to back."""

    token: int
    rows: list[int]  # the ring rows
    lengths: list[int]  # each payload's bytes; -1: a path job (read here); -2: nothing
    paths: list[bytes | None]
    namespaces: list[str | None]  # the reply streams the cache keys include (None: not cached)
    places: list[int]  # where each payload lies in the payload memory (-1: in the tail)
    gpu: list[bool]  # the worker would have the GPU decode this row if it can
    accept: float  # of the thumbnails offered to the GPU, the fraction left for it


class RunDone(NamedTuple):
    """Every row of the run `token` has its record in the result table."""

    token: int


DECODE = Wire("decode", DecodeInit, Run, RunDone)


class RowDecoder(RowPolicy[int, int]):
    """The row policy (worker/decode/row_policy.py) in a decode process: a row is a ring row
    of the shared memory, answered by its record (the answer is the state it is left in).
    The GPU is offered a row as soon as its bytes are here."""

    offer_on_arrival = True

    def __init__(
        self,
        arena: SharedArena,
        spec: DecodeSpec,
        *,
        row_side: int,
        path_root: Path | None,
        cache_bytes: int,
        delay_s: float,
    ) -> None:
        super().__init__(
            spec,
            row_side=row_side,
            path_root=path_root,
            cache=DecodeCache(cache_bytes) if cache_bytes > 0 else None,
            delay=partial(_sleep, delay_s) if delay_s else None,
        )
        self.arena = arena
        # Of the thumbnails offered to the GPU, the fraction left for it (the worker's, per
        # message); the rest are decoded here, spread evenly by a running credit.
        self.thumbnail_accept = 1.0
        self._thumbnail_credit = 0.0

    def decode(
        self,
        row: int,
        data: bytes | memoryview | None,
        path: bytes | None,
        ns: str | None,
        gpu: bool = False,
    ) -> None:
        """`ns`: the reply stream the cache key includes; None: not cached here (a `url`
        job's row, which the worker caches under its URL's key). `gpu`: the worker would
        have the GPU decode this row if it can."""
        self.run(row, data, path, namespace=ns, gpu=gpu)

    def offer(
        self,
        row: int,
        data: bytes | memoryview,
        namespace: str | None,
        start: float,
        *,
        staged: bool,
    ) -> int | None:
        """`_placement`, whose failure is this row's alone. Reading the header is total
        (worker/decode/jpeg_header.py), so a hostile one is decoded, or refused, here; an
        exception is a defect of ours, and the row's job is answered with it while the
        process goes on (the worker replies it under that job's id)."""
        try:
            placed = self._placement(row, data, namespace, staged=staged)
            if placed is None:
                return None
            self.arena.table[row]["staged"] = len(data) if staged else 0
            info = DecodeInfo("JPEG", placed.width, placed.height, 1)
            return self._record(row, info, start, DEFERRED, cached=False, reduced=False)
        except Exception as exc:  # noqa: BLE001 - one image's header must never end the process
            why = f"choosing the GPU or the CPU to decode this image failed: {described(exc)}"
            return self.fail(row, DecodeError(ErrorCode.INTERNAL_ERROR, why), start)

    def _placement(
        self, row: int, data: bytes | memoryview, ns: str | None, *, staged: bool
    ) -> GpuPlacement | None:
        """Where row `row` takes its place for the GPU when its JPEG allows; None: decode it
        here. `staged`: the worker does not hold the bytes (a `path` job's): they are copied
        into the slot's host memory at the place the decoded row takes on the device (bytes
        the copy to the device never takes), which the GPU decoder reads them from."""
        packed = self.arena.packed
        if packed is None or not self.row_side:
            return None
        if self.cache is not None and ns is not None and cache_key(bytes(data), ns) in self.cache:
            return None  # the cached row is a copy away
        placed = gpu_placement(data, self.spec, self.row_side)
        if placed is None:
            return None
        size = placed.height * placed.width * 3
        if staged and len(data) > size:
            return None  # more bytes than pixels (a large EXIF block): decoded here
        if placed.height * placed.width <= THUMBNAIL_PIXELS and self.thumbnail_accept < 1.0:
            self._thumbnail_credit += self.thumbnail_accept
            if self._thumbnail_credit < 1.0:
                return None
            self._thumbnail_credit -= 1.0
        if staged:
            try:
                offset = packed.place_on_device(row, size, placed.geometry)
            except SlotFull:
                return None
            slot = row // packed.batch
            packed.memory[slot, offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        else:
            packed.write_geometry(row, placed.geometry)
        return placed

    def copy_kept(self, row: int, kept: npt.NDArray[np.uint8]) -> None:
        copy_kept(self.arena, row, kept)

    def write(self, row: int, decoded: DecodedRow | npt.NDArray[np.uint8]) -> bool:
        packed = self.arena.packed
        if isinstance(decoded, np.ndarray):
            write_row(self.arena.rows[row], decoded)
        elif packed is not None:
            packed.write(row, decoded)
        else:
            write_decoded_row(self.arena.rows[row], decoded)
        return True

    def entry(self, row: int) -> npt.NDArray[np.uint8]:
        # Packed: the cache keeps the image at its own size, not a whole row.
        packed = self.arena.packed
        return packed.entry(row) if packed is not None else self.arena.rows[row]

    def answer(
        self, row: int, info: DecodeInfo, start: float, *, cached: bool, reduced: bool
    ) -> int:
        return self._record(row, info, start, DONE, cached=cached, reduced=reduced)

    def _record(
        self, row: int, info: DecodeInfo, start: float, state: int, *, cached: bool, reduced: bool
    ) -> int:
        """Write row `row`'s record, its state last: the worker reads the rest only once
        the state is no longer PENDING."""
        record = self.arena.table[row]
        record["width"] = info.width
        record["height"] = info.height
        record["draft_scale"] = info.draft_scale
        record["format"] = info.format.encode("ascii", "replace")[:8]
        record["cached"] = cached
        record["reduced"] = reduced
        record["error"] = -1
        record["decode_us"] = int((time.perf_counter() - start) * 1e6)
        record["state"] = state
        return state

    def fail(self, row: int, error: DecodeError, start: float) -> int:
        record = self.arena.table[row]
        record["error"] = _ERROR_INDEX[error.code]
        record["message"] = error.message.encode("utf-8", "replace")[:MESSAGE_BYTES]
        record["decode_us"] = int((time.perf_counter() - start) * 1e6)
        record["cached"] = 0
        record["reduced"] = 0
        record["state"] = FAILED
        return FAILED


def copy_kept(arena: SharedArena, row: int, kept: npt.NDArray[np.uint8]) -> None:
    """Copy a row a cache kept (the process's, or the worker's for a `url` job) into ring
    row `row`: packed in its slot, or the whole row."""
    packed = arena.packed
    if packed is not None:
        packed.write_entry(row, kept)
    else:
        np.copyto(arena.rows[row], kept)


def _sleep(seconds: float, subject: object) -> None:
    time.sleep(seconds)


def cheapest_first(datas: list[memoryview | None]) -> list[int]:
    """The order to decode a run's rows in: the fewest pixels first, so that the run's
    small images never wait behind its large ones (the sender chooses what shares a run)."""
    if len(datas) < 2:
        return list(range(len(datas)))
    costs = [decode_cost(d) for d in datas]
    return sorted(range(len(datas)), key=costs.__getitem__)


def decode_cost(data: memoryview | bytes | None) -> int:
    """What decoding `data` costs, roughly: the pixels its header announces (a PNG's or a
    JPEG's), its length for other formats, 0 for what is read here (a path job's bytes).
    Reads a few header fields, never raises: the decode judges the bytes."""
    if data is None:
        return 0
    if len(data) < 24:
        return len(data)
    first = data[0]
    if first == 0x89 and data[:8] == _PNG and data[12:16] == b"IHDR":
        width, height = _PNG_SIZE.unpack_from(data, 16)
        return int(width) * int(height)
    if first == 0xFF and data[1] == 0xD8:
        try:
            # libjpeg-turbo's own header read: a few microseconds, against a thumbnail's
            # 100 or so for its decode.
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return int(width) * int(height)
        except ValueError:
            pass  # a header TurboJPEG refuses (CMYK, say): read here, more slowly
        for marker, pos, length in segments(data):
            if marker in _FRAMES and length >= 7 and pos + 9 <= len(data):
                height, width = _JPEG_SIZE.unpack_from(data, pos + 5)
                return int(width) * int(height)
    return len(data)


def serve(
    receiver: Receiver,
    answers: socket.socket,
    arena: SharedArena,
    index: int,
    decoder: RowDecoder,
    *,
    payloads: memoryview | None = None,
) -> None:
    """`payloads`: the payload memory the intake's process fills (worker/decode/payloads.py);
    a row whose place is not -1 reads its bytes there instead of from the frame's tail."""
    progress = arena.progress[index : index + 1]
    answers.sendall(DECODE.frame(Ready()))
    while (frame := receiver.next()) is not None:
        body, tail = frame
        run = DECODE.message(body)
        if not isinstance(run, Run):
            raise SystemExit(f"decode process {index}: bad message from the worker")
        decode_run(run, tail, progress, decoder, payloads)
        answers.sendall(DECODE.frame(RunDone(run.token)))


def decode_run(
    run: Run,
    tail: memoryview,
    progress: Any,
    decoder: RowDecoder,
    payloads: memoryview | None,
) -> None:
    """Decode every row of `run` into the arena, cheapest first."""
    decoder.thumbnail_accept = run.accept
    # The run's start, then no row (the last run's is not this run's), then the token:
    # the worker reads the token first, so a token it knows comes with its run's time.
    # The budget bounds the run, not each row alone.
    progress["started_ns"] = time.monotonic_ns()
    progress["row"] = -1
    progress["token"] = run.token
    datas: list[memoryview | None] = []
    offset = 0
    for length, at in zip(run.lengths, run.places, strict=True):
        # length: the payload's bytes; -1: a path job (read here); -2: nothing to decode.
        if at >= 0 and payloads is not None:
            datas.append(payloads[at : at + length])
        elif length >= 0:
            datas.append(tail[offset : offset + length])
            offset += length
        else:
            datas.append(None)
    rows, paths, namespaces, gpus = run.rows, run.paths, run.namespaces, run.gpu
    for i in cheapest_first(datas):
        progress["row"] = rows[i]
        decoder.decode(rows[i], datas[i], paths[i], namespaces[i], gpus[i])
    progress["token"] = 0


def main(argv: list[str]) -> int:
    owned_by_the_worker()
    data_fd, answers_fd, arena_fd, *payloads_fd = (int(a) for a in argv)
    with (
        socket.socket(fileno=data_fd) as sock,
        socket.socket(fileno=answers_fd) as answers,
        contextlib.suppress(BrokenPipeError, ConnectionResetError),
    ):
        receiver = Receiver(sock, tail_bytes=1 << 20)
        first = receiver.next()
        if first is None:
            return 0
        init = DECODE.message(first[0])
        if not isinstance(init, DecodeInit):
            raise SystemExit("decode process: the worker's first message is not its settings")
        payloads = (
            open_payloads(payloads_fd[0], init.payloads_size, write=False) if payloads_fd else None
        )
        # What the worker sets at start-up (GPUFEED_MAX_IMAGE_PIXELS is checked from the header).
        Image.MAX_IMAGE_PIXELS = max(init.max_image_pixels, Image.MAX_IMAGE_PIXELS or 0)
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        arena = SharedArena.open(ArenaLayout(**init.layout), arena_fd)
        decoder = RowDecoder(
            arena,
            DecodeSpec(**init.spec),
            row_side=init.row_side,
            path_root=Path(init.path_root) if init.path_root else None,
            cache_bytes=init.cache_bytes,
            delay_s=init.delay_s,
        )
        serve(receiver, answers, arena, init.slot, decoder, payloads=payloads)
    return 0


if __name__ == "__main__":
    # The worker owns this process: it ends when the worker closes its end or kills it.
    sys.exit(main(sys.argv[1:]))
