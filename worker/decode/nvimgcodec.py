"""NVIDIA nvImageCodec, the maintained GPU JPEG codec (worker/decode/codecs.py): it batches
nvJPEG, uses the hardware JPEG engine of A100/H100/H200-class GPUs, applies EXIF
orientation itself, takes our CUDA stream, and returns None for an image it cannot decode
instead of failing the batch.

It is asked for its GPU backends only, each tried on a small JPEG at start-up (none
answering: no decoder, said so), with one executor thread. The same library decodes
without a GPU (`NVIMGCODEC_DEVICE_CPU_ONLY`), which is how the tests on a machine without
CUDA run its real contract.

`decode_into` writes into caller buffers (views of the slot's device twin) through
`images=`; the library reshapes a caller's buffer to what it decoded and reports success,
so each image's decoded shape is checked against its place, and one turned otherwise is
answered False (counted in `misshapen`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from worker.decode.codecs import (
    GpuDecodeUnavailable,
    GpuEnginesUnavailable,
    NvImgCodecMissing,
    Place,
)
from worker.decode.samples import synthetic_jpeg

log = structlog.get_logger("gpufeed.gpu_decode")

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


class _DeviceImage:
    """A device buffer as __cuda_array_interface__ describes it, without a tensor view: the
    library reads the dict once per image (a tensor builds it anew in Python each time)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, pointer: int, height: int, width: int, stream: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (height, width, 3),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            # The decode's own stream: a buffer tied to another stream would make the
            # library wait for that stream on the host.
            "stream": stream,
            "version": 3,
        }


class NvImgCodec:
    """nvImageCodec's decoder, both shapes of the codec call (worker/decode/codecs.py). On
    CUDA it takes only the GPU backends that decoded a JPEG at start-up (`engines` says
    which did; none raises GpuEnginesUnavailable) and `threads` executor threads.
    `device` None: its CPU-only backend into host memory (no GPU needed; the tests' way to
    run the real library)."""

    applies_exif = True

    def __init__(self, device: torch.device | None, *, threads: int = DECODER_CPU_THREADS) -> None:
        try:
            nvimgcodec: Any = importlib.import_module("nvidia.nvimgcodec")
        except ImportError as exc:
            raise NvImgCodecMissing(f"nvImageCodec is not installed ({exc})") from None
        self._nv = nvimgcodec
        version = getattr(nvimgcodec, "__version__", "?")
        self.name = f"nvimgcodec {version}"
        self.device = device if device is not None else torch.device("cpu")
        self._cuda = device is not None
        # Per GPU backend, whether it decoded a JPEG at start-up (empty off CUDA).
        self.engines: dict[str, bool] = {}
        try:
            if device is None:
                self._decoder = nvimgcodec.Decoder(
                    device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                    max_num_cpu_threads=threads,
                    backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
                )
                self.name += " (cpu only)"
            else:
                self._decoder, self.engines = nvimgcodec_decoder(
                    nvimgcodec, device.index or 0, threads=threads
                )
                self.name += f" ({', '.join(k for k, ok in self.engines.items() if ok)})"
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
        self._last: tuple[Any, Any] = ((), ())
        # The last `decode_into` call's images decoded at another shape than their place's:
        # (index in the call, the shape the library reports). Their rows were answered False.
        self.misshapen: list[tuple[int, tuple[int, ...]]] = []

    @property
    def hardware_engines_answered(self) -> bool:
        return self.engines.get(HARDWARE_BACKEND, False)

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

    def decode_into(
        self, datas: Sequence[Any], twin: torch.Tensor, places: Sequence[Place], stream: int
    ) -> list[bool]:
        nvimgcodec = self._nv
        self.misshapen = []
        if self._cuda:
            base = twin.data_ptr()
            buffers: list[Any] = [_DeviceImage(base + o, h, w, stream) for o, h, w in places]
        else:
            host = twin.numpy()
            buffers = [host[o : o + h * w * 3].reshape(h, w, 3) for o, h, w in places]
        images = nvimgcodec.as_images(buffers, cuda_stream=stream)
        # bytes as they are; payload memory (a memoryview) as a numpy view of it, no copy:
        # the library takes either, not a memoryview.
        sources = [d if isinstance(d, bytes) else np.frombuffer(d, np.uint8) for d in datas]
        decoded = self._decoder.decode(
            sources, images=images, params=self._params, cuda_stream=stream
        )
        # The library's image objects live until the next call has decoded (which waits for
        # this batch's work): none is destroyed while its decode may still be queued.
        self._last = (images, decoded)
        ok: list[bool] = []
        for i, (image, (_, height, width)) in enumerate(zip(decoded, places, strict=True)):
            if image is None:
                ok.append(False)
                continue
            # The library reshapes a place to what it decoded (the same bytes or fewer) and
            # reports success: an image it turned otherwise than the header read here (its
            # EXIF reading is not ours) lies in the place at another shape.
            shape = tuple(image.shape)
            if shape != (height, width, 3):
                self.misshapen.append((i, shape))
                ok.append(False)
                continue
            ok.append(True)
        return ok


def nvimgcodec_available() -> str | None:
    """None when nvImageCodec imports, else why not (for the plan line and the docs)."""
    try:
        importlib.import_module("nvidia.nvimgcodec")
    except ImportError as exc:
        return f"nvImageCodec is not installed ({exc})"
    except Exception as exc:  # noqa: BLE001 - a broken install says why, never ends start-up
        return f"nvImageCodec does not load: {type(exc).__name__}: {exc}"
    return None
