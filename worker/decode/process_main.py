"""A decode process: decodes the rows the worker sends it, straight into the shared ring.

Started by worker/decode/processes.py as ``python -m worker.decode.process_main``, with the
staging memory file and one end of a socket pair inherited. It imports the decoders and
numpy, never torch, so it starts in a fraction of a second and holds tens of MB.

What crosses the socket, per work item (a run of one batch's rows, not an image):
the worker sends a header, the item's description (msgpack: row indices, payload lengths,
paths, reply streams) and the payload bytes back to back; the process answers 16 bytes
(the item's token) once every row of it has its record in the result table. The pixels
and each row's record go through shared memory, never through the socket; with packed rows
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
import json
import signal
import socket
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import msgpack
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
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, decode_pixels, write_row
from worker.decode.job_path import read_job_path
from worker.decode.jpeg_header import segments
from worker.decode.packed import SlotFull
from worker.decode.payloads import open_payloads
from worker.decode.rows import THUMBNAIL_PIXELS, decode_row, gpu_placement, write_decoded_row

# magic, description length, payload length
HEADER = struct.Struct("<4sIQ")
MAGIC = b"GFDI"
# token (0: the process is ready), spare
ANSWER = struct.Struct("<qq")

_ERROR_INDEX = {code: i for i, code in enumerate(ERROR_CODES)}
_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_SIZE = struct.Struct(">II")  # IHDR: width, height
_JPEG_SIZE = struct.Struct(">HH")  # SOFn, after the precision: height, width
# Start-of-frame markers: SOFn, not DHT, JPG, DAC.
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def spec_args(spec: DecodeSpec) -> str:
    return json.dumps(spec.__dict__)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False at end of stream (the worker closed its end)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class RowDecoder:
    """Decodes one row at a time into the arena; everything a row may raise ends in its
    record."""

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
        self.arena = arena
        self.spec = spec
        self.row_side = row_side
        self.path_root = path_root
        self.cache = DecodeCache(cache_bytes) if cache_bytes > 0 else None
        self.delay_s = delay_s
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
        """`gpu`: the worker would have the GPU decode this row if it can."""
        record = self.arena.table[row]
        start = time.perf_counter()
        if gpu and data is not None and self._route(row, data, ns, record, start):
            return
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if path is not None:
                data = read_job_path(path, self.path_root, self.spec.max_bytes)
                # The bytes are here, not in the worker: staged in the slot for the GPU.
                if gpu and self._route(row, data, ns, record, start, stage=True):
                    return
            if data is None:
                raise DecodeError(ErrorCode.INVALID_JOB, "nothing to decode")
            info, cached, reduced = self._decode(row, data, ns)
        except DecodeError as exc:
            _failed(record, exc.code, exc.message, start)
            return
        except SlotFull as exc:
            _failed(record, ErrorCode.INTERNAL_ERROR, str(exc), start)
            return
        except Exception as exc:  # noqa: BLE001 - one bad image must never end the process
            _failed(record, ErrorCode.INTERNAL_ERROR, _described(exc), start)
            return
        record["width"] = info.width
        record["height"] = info.height
        record["draft_scale"] = info.draft_scale
        record["format"] = info.format.encode("ascii", "replace")[:8]
        record["cached"] = cached
        record["reduced"] = reduced
        record["error"] = -1
        record["decode_us"] = int((time.perf_counter() - start) * 1e6)
        record["state"] = DONE

    def _route(
        self,
        row: int,
        data: bytes | memoryview,
        ns: str | None,
        record: Any,
        start: float,
        *,
        stage: bool = False,
    ) -> bool:
        """`_defer`, whose failure is this row's alone: True when the row is answered (left
        for the GPU, or failed with why), False: decode it here. Reading the header is total
        (worker/decode/jpeg_header.py), so a hostile one is decoded, or refused, here; an
        exception is a defect of ours, and the row's job is answered with it while the
        process goes on (the worker replies it under that job's id)."""
        try:
            return self._defer(row, data, ns, record, start, stage=stage)
        except Exception as exc:  # noqa: BLE001 - one image's header must never end the process
            why = f"choosing the GPU or the CPU to decode this image failed: {_described(exc)}"
            _failed(record, ErrorCode.INTERNAL_ERROR, why, start)
            return True

    def _defer(
        self,
        row: int,
        data: bytes | memoryview,
        ns: str | None,
        record: Any,
        start: float,
        *,
        stage: bool = False,
    ) -> bool:
        """Leave row `row` for the GPU when its JPEG allows; False: decode it here. `stage`:
        the worker does not hold the bytes (a `path` job's): they are copied into the slot's
        host memory at the place the decoded row takes on the device (bytes the copy to the
        device never takes), which the GPU decoder reads them from."""
        packed = self.arena.packed
        if packed is None or not self.row_side:
            return False
        if self.cache is not None and ns is not None and cache_key(bytes(data), ns) in self.cache:
            return False  # the cached row is a copy away
        placed = gpu_placement(data, self.spec, self.row_side)
        if placed is None:
            return False
        size = placed.height * placed.width * 3
        if stage and len(data) > size:
            return False  # more bytes than pixels (a large EXIF block): decoded here
        if placed.height * placed.width <= THUMBNAIL_PIXELS and self.thumbnail_accept < 1.0:
            self._thumbnail_credit += self.thumbnail_accept
            if self._thumbnail_credit < 1.0:
                return False
            self._thumbnail_credit -= 1.0
        if stage:
            try:
                offset = packed.place_on_device(row, size, placed.geometry)
            except SlotFull:
                return False
            slot = row // packed.batch
            packed.memory[slot, offset : offset + len(data)] = np.frombuffer(data, np.uint8)
            record["staged"] = len(data)
        else:
            packed.write_geometry(row, placed.geometry)
            record["staged"] = 0
        record["width"] = placed.width
        record["height"] = placed.height
        record["draft_scale"] = 1
        record["format"] = b"JPEG"
        record["cached"] = 0
        record["reduced"] = 0
        record["error"] = -1
        record["decode_us"] = int((time.perf_counter() - start) * 1e6)
        record["state"] = DEFERRED
        return True

    def _decode(
        self, row: int, data: bytes | memoryview, ns: str | None
    ) -> tuple[DecodeInfo, bool, bool]:
        """`ns`: the reply stream the cache key includes; None: not cached here (a `url`
        job's row, which the worker caches under its URL's key)."""
        packed = self.arena.packed
        out: npt.NDArray[np.uint8] = self.arena.rows[row]
        blob = bytes(data)
        key = None
        if self.cache is not None and ns is not None:
            key = cache_key(blob, ns)
            entry = self.cache.get(key)
            if entry is not None:
                if packed is not None:
                    packed.write_entry(row, entry[0])
                else:
                    np.copyto(out, entry[0])
                return entry[1], True, False
        reduced = False
        if self.row_side:
            decoded, info = decode_row(blob, self.spec, self.row_side)
            if packed is not None:
                packed.write(row, decoded)
            else:
                write_decoded_row(out, decoded)
            reduced = decoded.reduced
        else:
            pixels, info = decode_pixels(blob, self.spec)
            write_row(out, pixels)
        if self.cache is not None and key is not None:
            # Packed: the cache keeps the image at its own size, not a whole row.
            self.cache.put(key, packed.entry(row) if packed is not None else out, info)
        return info, False, reduced


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _failed(record: Any, code: ErrorCode, message: str, start: float) -> None:
    record["error"] = _ERROR_INDEX[code]
    record["message"] = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
    record["decode_us"] = int((time.perf_counter() - start) * 1e6)
    record["cached"] = 0
    record["reduced"] = 0
    record["state"] = FAILED


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
    sock: socket.socket,
    answers: socket.socket,
    arena: SharedArena,
    index: int,
    decoder: RowDecoder,
    *,
    payloads: memoryview | None = None,
) -> None:
    """`payloads`: the payload memory the intake's process fills (worker/decode/payloads.py);
    a row whose place is not -1 reads its bytes there instead of from the message."""
    progress = arena.progress[index : index + 1]
    header = bytearray(HEADER.size)
    payload = bytearray(1 << 20)
    answers.sendall(ANSWER.pack(0, 0))
    while True:
        if not _recv_exact(sock, memoryview(header)):
            return
        magic, meta_len, payload_len = HEADER.unpack(header)
        if magic != MAGIC:
            raise SystemExit(f"decode process {index}: bad message from the worker")
        meta = bytearray(meta_len)
        if not _recv_exact(sock, memoryview(meta)):
            return
        if payload_len > len(payload):
            payload = bytearray(payload_len)
        view = memoryview(payload)[:payload_len]
        if not _recv_exact(sock, view):
            return
        token, rows, lengths, paths, namespaces, places, gpus, accept = msgpack.unpackb(meta)
        decoder.thumbnail_accept = accept
        # The run's start, then no row (the last run's is not this run's), then the token:
        # the worker reads the token first, so a token it knows comes with its run's time.
        # The budget bounds the run, not each row alone.
        progress["started_ns"] = time.monotonic_ns()
        progress["row"] = -1
        progress["token"] = token
        datas: list[memoryview | None] = []
        offset = 0
        for length, at in zip(lengths, places, strict=True):
            # length: the payload's bytes; -1: a path job (read here); -2: nothing to decode.
            if at >= 0 and payloads is not None:
                datas.append(payloads[at : at + length])
            elif length >= 0:
                datas.append(view[offset : offset + length])
                offset += length
            else:
                datas.append(None)
        for i in cheapest_first(datas):
            progress["row"] = rows[i]
            decoder.decode(rows[i], datas[i], paths[i], namespaces[i], gpus[i])
        progress["token"] = 0
        answers.sendall(ANSWER.pack(token, 0))


def main(argv: list[str]) -> int:
    # A terminal's Ctrl-C and systemd's stop signal reach the whole process group, this
    # process too: the worker drains its batches first and ends this process by closing
    # its socket (its own death closes it as well), so the signals are the worker's alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    arena_fd, sock_fd, answers_fd, index = (int(a) for a in argv[:4])
    layout = ArenaLayout.from_args(argv[4:8])
    spec = DecodeSpec(**json.loads(argv[8]))
    row_side = int(argv[9])
    path_root = Path(argv[10]) if argv[10] else None
    cache_bytes = int(argv[11])
    delay_s = float(argv[12])
    max_image_pixels = int(argv[13])
    payloads_fd, payloads_size = int(argv[14]), int(argv[15])
    payloads = open_payloads(payloads_fd, payloads_size, write=False) if payloads_fd >= 0 else None
    # What the worker sets at start-up (GPUFEED_MAX_IMAGE_PIXELS is checked from the header).
    Image.MAX_IMAGE_PIXELS = max(max_image_pixels, Image.MAX_IMAGE_PIXELS or 0)
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    arena = SharedArena.open(layout, arena_fd)
    decoder = RowDecoder(
        arena,
        spec,
        row_side=row_side,
        path_root=path_root,
        cache_bytes=cache_bytes,
        delay_s=delay_s,
    )
    with (
        socket.socket(fileno=sock_fd) as sock,
        socket.socket(fileno=answers_fd) as answers,
        contextlib.suppress(BrokenPipeError, ConnectionResetError),
    ):
        serve(sock, answers, arena, index, decoder, payloads=payloads)
    return 0


if __name__ == "__main__":
    # The worker owns this process: it ends when the worker closes its end or kills it.
    sys.exit(main(sys.argv[1:]))
