"""The GPU JPEG codecs, side by side behind one contract, chosen by name from one table.

A codec decodes a batch of JPEGs in one call on the caller's CUDA stream, upright and sRGB,
returning per image either pixels or a failure: a bad image never fails the batch. Two
shapes of the same call:

- `decode` (`JpegCodec`): the codec allocates each image's [3, H, W] uint8 tensor; the
  decode threads' GPU decoder (worker/decode/gpu.py) resizes them into their rows.
- `decode_into` (`IntoCodec`): the codec writes each image into a caller buffer, at a place
  taken in the slot's device twin; the decode processes' packed rows
  (worker/decode/gpu_packed.py) need it.

`CODECS` names each codec's module and class, tried in its order where the operator left
the choice to the worker. Adding a codec is one module beside these and one line here; the
modules are imported only when a codec is built, so a host without a codec's library still
starts.

| codec | module | `decode` | `decode_into` |
| --- | --- | --- | --- |
| nvimgcodec | `nvimgcodec.py` (NVIDIA nvImageCodec) | yes | yes |
| torchvision | `torchvision_jpeg.py` (torchvision's nvJPEG) | yes | no |

The CPU decoders (worker/decode/cpu.py) are of another shape: one image into one row,
resized on the host; they stay apart.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from worker.base.errors import GpufeedError

# Name -> "module:class", in the order `auto` tries them.
CODECS: dict[str, str] = {
    "nvimgcodec": "worker.decode.nvimgcodec:NvImgCodec",
    "torchvision": "worker.decode.torchvision_jpeg:TorchvisionJpeg",
}

# Where a decoder writes image i: (byte offset in the twin, height, width), [h, w, 3] uint8.
Place = tuple[int, int, int]


class GpuDecodeUnavailable(GpufeedError, RuntimeError):
    """No usable GPU JPEG decoder here; the message says why."""


class GpuEnginesUnavailable(GpuDecodeUnavailable):
    """nvImageCodec loaded, but none of its GPU backends decoded a JPEG here (its nvJPEG
    library did not load, or the device has none of what they need)."""


class NvImgCodecMissing(GpuDecodeUnavailable):
    """nvImageCodec is not installed (the usual case: not worth a warning)."""


class JpegCodec(Protocol):
    """A GPU JPEG decoder that allocates its outputs."""

    name: str
    applies_exif: bool

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        """[3, H, W] uint8 per image on the decoder's device (None: not decodable), queued
        on `stream` (the current stream of the calling thread)."""
        ...


class IntoCodec(Protocol):
    """A GPU JPEG decoder that writes into caller buffers. One decoder: not shared between
    threads."""

    name: str

    def decode_into(
        self, datas: Sequence[Any], twin: torch.Tensor, places: Sequence[Place], stream: int
    ) -> list[bool]:
        """Decode image i into `twin` (flat uint8 on the decoder's device) at places[i],
        upright, queued on the CUDA stream `stream` (0 off CUDA); False where it could
        not."""
        ...


def codec_class(name: str) -> type[Any]:
    """The class `CODECS` names for `name` (its module imported now)."""
    if name not in CODECS:
        raise GpuDecodeUnavailable(f"no GPU JPEG codec is named {name!r}: {', '.join(CODECS)}")
    module, _, cls = CODECS[name].partition(":")
    found: type[Any] = getattr(importlib.import_module(module), cls)
    return found
