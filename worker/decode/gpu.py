"""JPEG decode on the GPU (GPUFEED_DECODE=gpu|auto), CPU decode for everything else.

The library: NVIDIA nvImageCodec (`nvidia-nvimgcodec-cu12` / `-cu13`) where it is
installed; torchvision's nvJPEG decode otherwise. nvImageCodec is the maintained one: it
batches nvJPEG, uses the hardware JPEG engine of A100/H100/H200-class GPUs, applies EXIF
orientation itself, takes our CUDA stream, and returns None for an image it cannot decode
instead of failing the batch. torchvision's GPU decode (deprecated since torchvision 0.29)
needs nothing beyond torchvision, which is why it stays as the fallback: it fails a whole
batch on one bad image (we then retry image by image) and synchronises its own stream on the
calling thread, which is the GPU decode thread here, never the launch thread.

nvImageCodec is asked for its GPU backends only, each tried on a small JPEG at start-up
(none answering: no nvImageCodec decoder, said so), with one executor thread. Its EXIF
reading is not the router's (it reads every EXIF segment, Pillow the first): a row it
decodes at another upright size than the router read goes to the CPU decoder, counted.

torchvision allocates its outputs on the caller's current stream but writes them on a
stream of its own. Were that our working stream, a block freed there while our kernels are
still queued (the stream waits on compute) could come back as the next call's output and
be overwritten before it was read. So it runs under a stream that allocates nothing else,
our stream waits on it, and each output is `record_stream`ed on our stream, so the
allocator keeps it until the resize that reads it has run.

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
import importlib
import io
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from PIL import Image

from producer.wire import ErrorCode
from worker.base.device import DoneEvent, Event, cuda_event
from worker.base.errors import GpufeedError
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, decode_into, resize_geometry

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


class GpuDecodeUnavailable(GpufeedError, RuntimeError):
    """No usable GPU JPEG decoder here; the message says why."""


class GpuEnginesUnavailable(GpuDecodeUnavailable):
    """nvImageCodec loaded, but none of its GPU backends decoded a JPEG here (its nvJPEG
    library did not load, or the device has none of what they need)."""


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


class JpegBackend(Protocol):
    name: str
    applies_exif: bool

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        """[3, H, W] uint8 per image on the decoder's device (None: not decodable), queued
        on `stream` (the current stream of the calling thread)."""
        ...


# nvImageCodec's backends a GPU decoder takes, as its BackendKind names them: the JPEG
# engines of A100/H100/H200-class GPUs, the GPU-only decoders, and nvJPEG's CUDA decoder
# (Huffman decode on the host for small images, on the GPU for large ones; 0.8's sources
# register it as HYBRID_CPU_GPU). The library hands an image the engines cannot take to
# the next of them. Its CPU backend is left out: it decodes on its own threads into host
# memory, then copies to the device with host syncs on those threads, and a decoder
# allowed it turns CPU-only without a word when libnvjpeg does not load.
GPU_BACKENDS: tuple[str, ...] = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")
HARDWARE_BACKEND = "HW_GPU_ONLY"
# Threads of each decoder's executor. The library's default, one per core, makes every
# call wait at a barrier for all of them, on a host whose cores run the decode processes;
# what it gives them for a batch routed here (header checks, the host half of a small
# image's hybrid decode) is small, and the calling thread takes a share of it too.
DECODER_CPU_THREADS = 1
# The JPEG each backend is asked to decode at start-up: baseline 4:2:0, as photos are, and
# of a photo's order of size, not a few blocks, so that no limit of an engine's on small
# images passes for the engine being absent.
_PROBE_SIZE = (320, 240)

_engines: dict[tuple[int, tuple[str, ...], int], dict[str, bool]] = {}
# Why each backend that did not answer did not, for the error that says none did.
_why_not: dict[tuple[int, tuple[str, ...], int], dict[str, str]] = {}
_engines_lock = threading.Lock()


def nvimgcodec_decoder(
    nvimgcodec: Any,
    device_id: int,
    *,
    backends: Sequence[str] = GPU_BACKENDS,
    threads: int = DECODER_CPU_THREADS,
) -> tuple[Any, dict[str, bool]]:
    """An nvImageCodec decoder on `device_id` that takes only those of `backends` that
    decoded a JPEG here, with `threads` executor threads; and, per backend, whether it
    did. Raises GpuEnginesUnavailable when none did: GPU decode never runs CPU-only."""
    engines = backend_engines(nvimgcodec, device_id, backends=backends, threads=threads)
    answered = [kind for kind in backends if engines[kind]]
    if not answered:
        version = getattr(nvimgcodec, "__version__", "?")
        why = _why_not.get((device_id, tuple(backends), threads), {})
        reasons = "; ".join(sorted({reason for reason in why.values()}))
        raise GpuEnginesUnavailable(
            f"nvImageCodec {version}: none of its GPU backends ({', '.join(backends)}) "
            f"decoded a JPEG on device {device_id}"
            + (f" ({reasons})" if reasons else "")
            + "; is its nvJPEG library installed (pip install nvidia-nvjpeg-cu12 or -cu13, "
            "as the CUDA of nvImageCodec)?"
        )
    decoder = nvimgcodec.Decoder(
        device_id=device_id,
        max_num_cpu_threads=threads,
        backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k)) for k in answered],
    )
    return decoder, engines


def backend_engines(
    nvimgcodec: Any,
    device_id: int,
    *,
    backends: Sequence[str] = GPU_BACKENDS,
    threads: int = DECODER_CPU_THREADS,
) -> dict[str, bool]:
    """Per backend kind, whether a decoder allowed only that one decodes a small JPEG on
    `device_id`. Asked once per process (start-up: a decoder each), logged as one event."""
    key = (device_id, tuple(backends), threads)
    with _engines_lock:
        known = _engines.get(key)
        if known is not None:
            return dict(known)
        sample = synthetic_jpeg(*_PROBE_SIZE)
        why = {kind: _probe(nvimgcodec, device_id, kind, threads, sample) for kind in backends}
        engines = {kind: reason is None for kind, reason in why.items()}
        _engines[key] = engines
        _why_not[key] = {kind: reason for kind, reason in why.items() if reason is not None}
    hardware = engines.get(HARDWARE_BACKEND, False)
    (log.info if hardware else log.warning)(
        "gpu_decode_engines",
        nvimgcodec=getattr(nvimgcodec, "__version__", "?"),
        device=device_id,
        engines=engines,
        hardware_engines_answered=hardware,
        why_not={kind: reason for kind, reason in why.items() if reason is not None},
    )
    return dict(engines)


def _probe(nvimgcodec: Any, device_id: int, kind: str, threads: int, sample: bytes) -> str | None:
    """None when a decoder allowed only backend `kind` decodes `sample` upright at its
    size, else why not."""
    width, height = _PROBE_SIZE
    try:
        decoder = nvimgcodec.Decoder(
            device_id=device_id,
            max_num_cpu_threads=threads,
            backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))],
        )
        params = nvimgcodec.DecodeParams(
            apply_exif_orientation=True, color_spec=nvimgcodec.ColorSpec.SRGB
        )
        image = decoder.decode(sample, params=params)
    except Exception as exc:  # noqa: BLE001 - whatever the library raised: it did not answer
        return f"{type(exc).__name__}: {exc}"
    if image is None:
        return "it decoded nothing"
    shape = tuple(image.shape)
    return None if shape == (height, width, 3) else f"it decoded {shape}"


class NvImgCodecBackend:
    name = "nvimgcodec"
    applies_exif = True

    def __init__(self, device: torch.device, *, cpu_only: bool = False) -> None:
        """`cpu_only`: nvImageCodec's CPU backend into host memory, never on CUDA (the
        tests' way to run the real library without a GPU)."""
        try:
            nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
        except ImportError as exc:
            raise NvImgCodecMissing(f"nvImageCodec is not installed ({exc})") from None
        self._nv: Any = nvimgcodec
        self.device = device
        self._cuda = not cpu_only
        self.engines: dict[str, bool] = {}
        version = getattr(nvimgcodec, "__version__", "?")
        try:
            if cpu_only:
                self._decoder = nvimgcodec.Decoder(
                    device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                    max_num_cpu_threads=DECODER_CPU_THREADS,
                    backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
                )
                self.name = "nvimgcodec (cpu only)"
            else:
                self._decoder, self.engines = nvimgcodec_decoder(nvimgcodec, device.index or 0)
            # sRGB output, interleaved uint8 [H, W, 3] (the default sample format for it);
            # the colour spec is SRGB since nvImageCodec 0.7 (there is no RGB).
            self._params = nvimgcodec.DecodeParams(
                apply_exif_orientation=True, color_spec=nvimgcodec.ColorSpec.SRGB
            )
        except GpuDecodeUnavailable:
            raise
        except Exception as exc:  # whatever the library raises means: no decoder
            raise GpuDecodeUnavailable(
                f"nvImageCodec {version} could not build a decoder: {type(exc).__name__}: {exc}"
            ) from exc

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        handle = int(stream.cuda_stream) if stream is not None else 0
        # bytes convert to nvImageCodec CodeStreams; it returns None for an image it cannot
        # decode, and makes its outputs ready on `cuda_stream`.
        images = self._decoder.decode(list(datas), params=self._params, cuda_stream=handle)
        out: list[torch.Tensor | None] = []
        for img in images:
            if img is None:
                out.append(None)
                continue
            # Zero-copy through __cuda_array_interface__ (host memory: the array interface);
            # the tensor holds a reference to `img`, which owns the memory. [H, W, 3] uint8.
            hwc = (
                torch.as_tensor(img, device=self.device)
                if self._cuda
                else torch.from_numpy(np.asarray(img))
            )
            out.append(hwc.permute(2, 0, 1))
        return out


class NvImgCodecMissing(GpuDecodeUnavailable):
    """nvImageCodec is not installed (the usual case: not worth a warning)."""


class TorchvisionBackend:
    name = "torchvision"
    applies_exif = False  # its CUDA path ignores apply_exif_orientation

    def __init__(self, device: torch.device) -> None:
        # Only a GPU decoder loads torchvision.io's image library (and its nvJPEG).
        from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415

        self.device = device
        self._decode = decode_jpeg
        self._rgb = ImageReadMode.RGB
        # The current stream while torchvision allocates its outputs: nothing else is ever
        # allocated on it (see the module docstring).
        self.alloc_stream: Any = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        with _stream_ctx(self.alloc_stream):
            out = self._decode_all(datas)
        if stream is not None and self.alloc_stream is not None:
            # torchvision ordered alloc_stream after its own writes; `stream` (the readers')
            # after alloc_stream; the allocator keeps each output until `stream` read it.
            stream.wait_stream(self.alloc_stream)
            for img in out:
                if img is not None:
                    img.record_stream(stream)
        return out

    def _decode_all(self, datas: Sequence[bytes]) -> list[torch.Tensor | None]:
        # Encoded bytes stay on the host (nvJPEG parses them there); bytearray: writable.
        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        try:
            decoded = self._decode(encoded, mode=self._rgb, device=self.device)
            return list(decoded)
        except RuntimeError:
            pass
        # One bad image fails the whole call: retry one by one so it fails alone.
        out: list[torch.Tensor | None] = []
        for t in encoded:
            try:
                out.append(self._decode([t], mode=self._rgb, device=self.device)[0])
            except RuntimeError:
                out.append(None)
        return out


def make_backend(device: torch.device, prefer: str = "auto") -> JpegBackend:
    """nvImageCodec if installed (or asked for), else torchvision. Any failure to build
    nvImageCodec's decoder falls back to torchvision, logged; GpuDecodeUnavailable when
    neither can be built."""
    if prefer in ("auto", "nvimgcodec"):
        try:
            return NvImgCodecBackend(device)
        except Exception as exc:  # any failure: the next decoder, and say why
            if prefer == "nvimgcodec":
                if isinstance(exc, GpuDecodeUnavailable):
                    raise
                raise GpuDecodeUnavailable(f"nvImageCodec: {type(exc).__name__}: {exc}") from exc
            if not isinstance(exc, NvImgCodecMissing):
                log.warning(
                    "gpu_decoder_unavailable",
                    decoder="nvimgcodec",
                    reason=f"{exc}",
                    using="torchvision",
                )
    try:
        return TorchvisionBackend(device)
    except Exception as exc:  # ImportError, RuntimeError, CUDA errors alike
        raise GpuDecodeUnavailable(
            f"torchvision's JPEG decode is unusable: {type(exc).__name__}: {exc}"
        ) from exc


@dataclass
class GpuDecodeResult:
    ready: Event | None  # the decoded rows are in the destination once this fired
    failed: list[int]  # rows to decode on the CPU instead
    decode_ms: dict[int, float] = field(default_factory=dict)  # per decoded row


class GpuDecoder:
    """Decodes deferred JPEG rows into a device batch on its own thread and stream."""

    def __init__(self, device: torch.device, backend: JpegBackend | None = None) -> None:
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


def synthetic_jpeg(
    width: int, height: int, seed: int = 0, quality: int = 90, mode: str = "RGB"
) -> bytes:
    """A photo-like JPEG (gradient plus noise), for calibration and benchmarks; `mode`:
    the JPEG's colour mode as Pillow writes it (RGB, L for grey, CMYK as Adobe does)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1
    )
    noisy = np.clip(base + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy, "RGB").convert(mode).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


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
    # Start-up calibration only (allow-listed in tests/test_hot_path_static.py).
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
