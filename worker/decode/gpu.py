"""JPEG decode on the GPU for the decode threads (GPUFEED_DECODE=gpu|auto), CPU decode for
everything else.

The codec is one of worker/decode/codecs.py's table (nvImageCodec where it is installed,
torchvision's nvJPEG otherwise), through its `decode` call. nvImageCodec's EXIF reading is
not the router's (it reads every EXIF segment, Pillow the first): a row it decodes at
another upright size than the router read goes to the CPU decoder, counted.

Any failure to build a GPU decoder (nvImageCodec missing or failing, torchvision without
nvJPEG, no device) leaves the worker on CPU decode with a log line; a decoder that raises
on a batch sends that batch's rows to the CPU decoder (the runner does that), after the
event recorded on every exit path so the device buffer is not reused while queued work
may still write it.

Flow: a decode thread probes a JPEG's header (limits, mode, orientation, size class) and, if
the router sends it to the GPU, defers the row. Before the launch, `GpuDecoder.decode_rows`
decodes the batch's deferred rows in one call on its own thread and stream, resizes and
center-crops each on the GPU exactly as the CPU path does (torchvision Resize + CenterCrop
geometry), and writes it into the slot's device twin row; the launch makes the compute stream
wait on the returned event. Rows the GPU fails on go back to the CPU decoder.

`auto` times both decoders at start-up on a few synthetic JPEGs per size class and sends to
the GPU only the classes where it is faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from PIL import Image

from producer.wire import ErrorCode
from worker.base.device import DoneEvent, Event, cuda_event
from worker.base.errors import GpufeedError
from worker.decode.codecs import (
    CODECS,
    GpuDecodeUnavailable,
    JpegCodec,
    NvImgCodecMissing,
    codec_class,
)
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, decode_into, resize_geometry
from worker.decode.samples import synthetic_jpeg

log = structlog.get_logger("gpufeed.gpu_decode")

_ORIENTATION_TAG = 0x0112
_JPEG_MAGIC = b"\xff\xd8\xff"
# Modes nvJPEG turns into RGB the way Pillow does; CMYK/YCCK JPEGs stay on the CPU.
_GPU_MODES = frozenset({"RGB", "L"})

# (name, upper bound in pixels): the router decides per class.
SIZE_CLASSES: tuple[tuple[str, float], ...] = (
    ("small", 0.5e6),
    ("medium", 4e6),
    ("large", float("inf")),
)
_CLASS_SAMPLES = {"small": (480, 360), "medium": (1280, 960), "large": (2600, 1950)}


class GpuDecodeFailed(GpufeedError, RuntimeError):
    """The GPU decoder raised on a batch. `ready` fires once the work it had queued on the
    device (possibly writing rows of the destination) has run; None when nothing was."""

    def __init__(self, message: str, ready: Event | None) -> None:
        super().__init__(message)
        self.ready = ready


def size_class(width: int, height: int) -> str:
    pixels = width * height
    for name, bound in SIZE_CLASSES:
        if pixels <= bound:
            return name
    return SIZE_CLASSES[-1][0]


@dataclass(frozen=True)
class GpuRow:
    """A JPEG left for the GPU: its bytes and what the header probe found."""

    data: bytes
    info: DecodeInfo  # upright size, as the CPU decode would report it
    orientation: int  # EXIF orientation, 1..8


class GpuDecodeRouter:
    """Decides, per image, whether its decode is deferred to the GPU (decode threads)."""

    def __init__(self, use_gpu: Mapping[str, bool]) -> None:
        self.use_gpu = dict(use_gpu)

    @property
    def any_gpu(self) -> bool:
        return any(self.use_gpu.values())

    def route(self, data: bytes, spec: DecodeSpec) -> GpuRow | None:
        """A GpuRow when this image goes to the GPU, None for the CPU path. Raises
        DecodeError for the limits the CPU path would enforce too."""
        if not self.any_gpu or bytes(data[:3]) != _JPEG_MAGIC:
            return None
        if len(data) > spec.max_bytes:
            raise DecodeError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"{len(data)} bytes is over the limit of {spec.max_bytes} bytes",
            )
        try:
            with Image.open(io.BytesIO(data), formats=["JPEG"]) as im:
                width, height = im.size
                mode = im.mode
                orientation = _orientation(im)
        except Exception:  # noqa: BLE001 - a header Pillow cannot read: the CPU path reports it
            return None
        if mode not in _GPU_MODES or width <= 0 or height <= 0:
            return None
        if width * height > spec.max_pixels:
            raise DecodeError(
                ErrorCode.IMAGE_TOO_LARGE,
                f"{width}x{height} is {width * height} pixels, over the limit of "
                f"{spec.max_pixels} pixels",
            )
        if not self.use_gpu.get(size_class(width, height), False):
            return None
        if orientation in (5, 6, 7, 8):
            width, height = height, width
        info = DecodeInfo(format="JPEG", width=width, height=height, draft_scale=1)
        return GpuRow(data=bytes(data), info=info, orientation=orientation)


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - broken EXIF: shown unrotated, like the CPU path
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def orient(chw: torch.Tensor, orientation: int) -> torch.Tensor:
    """Undo EXIF `orientation` on x: [C, H, W] (Pillow's transpose table, as views)."""
    if orientation == 2:
        return chw.flip(2)
    if orientation == 3:
        return chw.flip(1, 2)
    if orientation == 4:
        return chw.flip(1)
    if orientation == 5:
        return chw.transpose(1, 2)
    if orientation == 6:
        return chw.rot90(-1, (1, 2))
    if orientation == 7:
        return chw.transpose(1, 2).flip(1, 2)
    if orientation == 8:
        return chw.rot90(1, (1, 2))
    return chw


def fit_into(chw: torch.Tensor, out: torch.Tensor) -> None:
    """Resize the shorter side to S (bilinear, antialias), center-crop S x S, write `out`.

    chw: [3, H, W] uint8; out: [S, S, 3] uint8, same device. The geometry is the CPU
    decoder's (torchvision Resize(S) + CenterCrop(S): long side truncated, offsets rounded).
    """
    s = int(out.shape[0])
    h, w = int(chw.shape[1]), int(chw.shape[2])
    nw, nh, left, top = resize_geometry(w, h, s)
    x = chw.unsqueeze(0).float()  # [1, 3, H, W]
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
    x = x[0, :, top : top + s, left : left + s]
    out.copy_(x.round_().clamp_(0, 255).permute(1, 2, 0))


# Decoded pixels resized in one call: the float copy a resize needs is 12 bytes a pixel, so
# this bounds it near 400 MB (about fourteen 2600x1950 images, a whole batch of 640x480).
FIT_CHUNK_PIXELS = 32_000_000


def fit_many_into(chws: Sequence[torch.Tensor], out: torch.Tensor, rows: Sequence[int]) -> None:
    """`fit_into` for upright [3, H, W] uint8 images of one size into rows `rows` of `out`
    ([B, S, S, 3]), a handful of ops for them all instead of six or seven per image: the
    per-image dispatches, not the GPU, bound the decode of a batch of small images."""
    if len(chws) == 1:
        fit_into(chws[0], out[rows[0]])
        return
    s = int(out.shape[1])
    h, w = int(chws[0].shape[1]), int(chws[0].shape[2])
    nw, nh, left, top = resize_geometry(w, h, s)
    x = torch.stack(list(chws)).float()  # [N, 3, H, W]
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
    y = x[:, :, top : top + s, left : left + s].round_().clamp_(0, 255).permute(0, 2, 3, 1)
    first = rows[0]
    if list(rows) == list(range(first, first + len(rows))):
        out[first : first + len(rows)].copy_(y)
    else:
        for i, row in enumerate(rows):
            out[row].copy_(y[i])


def same_size_groups(
    images: Sequence[tuple[int, torch.Tensor]], max_pixels: int = FIT_CHUNK_PIXELS
) -> list[list[tuple[int, torch.Tensor]]]:
    """(row, [3, H, W]) pairs grouped by size, in order of first appearance, each group cut
    into chunks of at most `max_pixels` decoded pixels (at least one image each)."""
    by_size: dict[tuple[int, int], list[list[tuple[int, torch.Tensor]]]] = {}
    for row, img in images:
        size = (int(img.shape[1]), int(img.shape[2]))
        chunks = by_size.setdefault(size, [[]])
        if chunks[-1] and (len(chunks[-1]) + 1) * size[0] * size[1] > max_pixels:
            chunks.append([])
        chunks[-1].append((row, img))
    return [chunk for chunks in by_size.values() for chunk in chunks]


def make_backend(device: torch.device, prefer: str = "auto") -> JpegCodec:
    """The codec `prefer` names (codecs.CODECS), or with `auto` the first of the table that
    builds here. `auto` passes over a codec that fails to build, logged (a missing
    library silently); GpuDecodeUnavailable when none can be built, or the one named
    cannot."""
    names = list(CODECS) if prefer == "auto" else [prefer]
    reasons: list[str] = []
    for name in names:
        try:
            codec: JpegCodec = codec_class(name)(device)
            return codec
        except Exception as exc:  # any failure: the next codec, and say why
            if prefer != "auto":
                if isinstance(exc, GpuDecodeUnavailable):
                    raise
                raise GpuDecodeUnavailable(f"{name}: {type(exc).__name__}: {exc}") from exc
            reasons.append(f"{name}: {exc}")
            later = names[names.index(name) + 1 :]
            if later and not isinstance(exc, NvImgCodecMissing):
                log.warning(
                    "gpu_decoder_unavailable", decoder=name, reason=f"{exc}", using=later[0]
                )
    raise GpuDecodeUnavailable("no GPU JPEG codec builds here: " + "; ".join(reasons))


@dataclass
class GpuDecodeResult:
    ready: Event | None  # the decoded rows are in the destination once this fired
    failed: list[int]  # rows to decode on the CPU instead
    decode_ms: dict[int, float] = field(default_factory=dict)  # per decoded row


class GpuDecoder:
    """Decodes deferred JPEG rows into a device batch on its own thread and stream."""

    def __init__(self, device: torch.device, backend: JpegCodec | None = None) -> None:
        self.device = device
        self.backend = backend or make_backend(device)
        self.stream: Any = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-gpudecode")
        # Decoded images and bytes referenced by queued GPU work, kept until it ran.
        self._retained: deque[tuple[Event, list[Any]]] = deque()
        # Rows decoded upright at another size than the header read here gave (the
        # decoder's EXIF orientation was not ours), sent to the CPU since start-up.
        self.wrong_shape = 0

    async def decode_rows(
        self,
        rows: Sequence[tuple[int, GpuRow]],
        dest: torch.Tensor,
        *,
        after: Event | None = None,
    ) -> GpuDecodeResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.decode_rows_sync, rows, dest, after)

    def decode_rows_sync(
        self,
        rows: Sequence[tuple[int, GpuRow]],
        dest: torch.Tensor,
        after: Event | None = None,
    ) -> GpuDecodeResult:
        """dest: [B, S, S, 3] uint8 on the device; row r of each (r, GpuRow) is written.
        `after`: an event to wait for (on the GPU) before writing `dest`. Raises
        GpuDecodeFailed (with the event after the work it queued) if the decoder raises."""
        self._release_finished()
        t0 = time.perf_counter()
        failed: list[int] = []
        decoded_rows: list[int] = []
        datas = [r.data for _, r in rows]
        images: list[torch.Tensor | None] = []
        with torch.inference_mode(), _stream_ctx(self.stream):
            try:
                if after is not None and self.stream is not None:
                    self.stream.wait_event(after)
                images = self.backend.decode(datas, self.stream)
                upright: list[tuple[int, torch.Tensor]] = []
                misshapen: list[tuple[int, tuple[int, ...], tuple[int, int]]] = []
                for (row, r), img in zip(rows, images, strict=True):
                    if img is None or img.dim() != 3 or img.shape[0] != 3:
                        failed.append(row)
                        continue
                    turned = img if self.backend.applies_exif else orient(img, r.orientation)
                    if tuple(turned.shape[1:]) != (r.info.height, r.info.width):
                        # Turned otherwise than the header read here says: the CPU path
                        # decodes it as every other decode of it would.
                        failed.append(row)
                        misshapen.append((row, tuple(turned.shape), (r.info.height, r.info.width)))
                        continue
                    upright.append((row, turned))
                if misshapen:
                    self.wrong_shape += len(misshapen)
                    log.warning(
                        "gpu_decode_wrong_shape",
                        decoder=self.backend.name,
                        rows=[row for row, _, _ in misshapen],
                        decoded=[shape for _, shape, _ in misshapen],
                        expected=[size for _, _, size in misshapen],
                        fallback="cpu decode",
                    )
                for group in same_size_groups(upright):
                    fit_many_into([img for _, img in group], dest, [row for row, _ in group])
                    decoded_rows.extend(row for row, _ in group)
            except Exception as exc:
                # Rows may be half written and kernels still queued: whoever reuses `dest`
                # must wait for this event, recorded on this exit path too.
                ready = self._record_ready()
                self._retained.append((ready, [images, datas]))
                raise GpuDecodeFailed(
                    f"GPU decode ({self.backend.name}) of {len(rows)} rows failed: "
                    f"{type(exc).__name__}: {exc}",
                    ready,
                ) from exc
            ready = self._record_ready()
        self._retained.append((ready, [images, datas]))
        per_row_ms = (time.perf_counter() - t0) * 1000 / max(1, len(rows))
        return GpuDecodeResult(
            ready=ready, failed=failed, decode_ms=dict.fromkeys(decoded_rows, per_row_ms)
        )

    def _record_ready(self) -> Event:
        if self.stream is None:
            return DoneEvent(time.perf_counter())
        ev = cuda_event()
        ev.record(self.stream)
        return ev

    def _release_finished(self) -> None:
        while self._retained and self._retained[0][0].query():
            self._retained.popleft()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _stream_ctx(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """torch.cuda.stream(s) when s is a CUDA stream, nothing otherwise."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class Calibration:
    use_gpu: dict[str, bool]
    cpu_images_per_s: dict[str, float]
    gpu_images_per_s: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "use_gpu": self.use_gpu,
            "cpu_images_per_s": {k: round(v, 1) for k, v in self.cpu_images_per_s.items()},
            "gpu_images_per_s": {k: round(v, 1) for k, v in self.gpu_images_per_s.items()},
        }


def calibrate(
    decoder: GpuDecoder,
    spec: DecodeSpec,
    cpu_threads: int,
    *,
    samples: int = 4,
    gpu_batch: int = 16,
) -> Calibration:
    """Time CPU decode (scaled by the decode threads) against batched GPU decode per size
    class. Start-up only: it waits for the GPU (event.synchronize), off the launch path."""
    cpu_rate: dict[str, float] = {}
    gpu_rate: dict[str, float] = {}
    s = spec.size
    dest = torch.empty((gpu_batch, s, s, 3), dtype=torch.uint8, device=decoder.device)
    scratch = np.empty((spec.size, spec.size, 3), dtype=np.uint8)
    for name, (w, h) in _CLASS_SAMPLES.items():
        images = [synthetic_jpeg(w, h, seed=i) for i in range(samples)]
        decode_into(images[0], scratch, spec)  # warm caches
        t0 = time.perf_counter()
        for data in images:
            decode_into(data, scratch, spec)
        per_image_s = (time.perf_counter() - t0) / len(images)
        cpu_rate[name] = cpu_threads / max(per_image_s, 1e-9)

        rows = [
            (i, GpuRow(images[i % samples], DecodeInfo("JPEG", w, h, 1), 1))
            for i in range(gpu_batch)
        ]
        _wait(decoder.decode_rows_sync(rows, dest).ready)  # warm-up: handles, buffers
        t0 = time.perf_counter()
        result = decoder.decode_rows_sync(rows, dest)
        _wait(result.ready)
        elapsed = time.perf_counter() - t0
        gpu_rate[name] = 0.0 if result.failed else gpu_batch / max(elapsed, 1e-9)
    use_gpu = {name: gpu_rate[name] > cpu_rate[name] for name in cpu_rate}
    return Calibration(use_gpu, cpu_rate, gpu_rate)


def _wait(event: Event | None) -> None:
    # Start-up calibration only (allow-listed in tests/pipeline/test_hot_path_static.py).
    if isinstance(event, torch.cuda.Event):
        event.synchronize()


def setup_gpu_decode(
    mode: str,
    device: torch.device,
    spec: DecodeSpec,
    cpu_threads: int,
    *,
    make_decoder: Callable[[torch.device], GpuDecoder] = GpuDecoder,
) -> tuple[GpuDecodeRouter, GpuDecoder, dict[str, Any]] | None:
    """GPUFEED_DECODE -> (router for the decode pool, decoder for the runner, log fields),
    or None for CPU decode. `gpu` on a device that is not CUDA raises
    GpuDecodeUnavailable (a configuration error). Any failure to build or calibrate a GPU
    decoder leaves decode on the CPU, logged (at error level when `gpu` asked for it)."""
    if mode == "cpu":
        return None
    if device.type != "cuda":
        if mode == "gpu":
            raise GpuDecodeUnavailable("GPUFEED_DECODE=gpu needs a CUDA device")
        return None
    decoder: GpuDecoder | None = None
    try:
        decoder = make_decoder(device)
        fields: dict[str, Any] = {"decode": mode, "gpu_decoder": decoder.backend.name}
        if mode == "gpu":
            router = GpuDecodeRouter(dict.fromkeys(_CLASS_SAMPLES, True))
        else:
            cal = calibrate(decoder, spec, cpu_threads)
            router = GpuDecodeRouter(cal.use_gpu)
            fields["calibration"] = cal.as_dict()
    except Exception as exc:  # noqa: BLE001 - any failure to build it: decode on the CPU
        if decoder is not None:
            decoder.shutdown()
        quiet = mode == "auto" and isinstance(exc, GpuDecodeUnavailable)
        (log.warning if quiet else log.error)(
            "gpu_decode_unavailable",
            decode=mode,
            reason=f"{type(exc).__name__}: {exc}",
            using="cpu decode",
        )
        return None
    if not router.any_gpu:
        decoder.shutdown()
        return None
    return router, decoder, fields
