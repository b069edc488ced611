"""torchvision's nvJPEG decode, the fallback GPU JPEG codec (worker/decode/codecs.py).

It needs nothing beyond torchvision, which is why it stays (deprecated since torchvision
0.29): it fails a whole batch on one bad image (retried here image by image), synchronises
its own stream on the calling thread (the GPU decode thread, never the launch thread), and
ignores EXIF orientation (the decode threads' GPU decoder turns its rows itself). It has no
`decode_into`, so the decode processes' packed rows take nvImageCodec only.

torchvision allocates its outputs on the caller's current stream but writes them on a
stream of its own. Were that our working stream, a block freed there while our kernels are
still queued (the stream waits on compute) could come back as the next call's output and
be overwritten before it was read. So it runs under a stream that allocates nothing else,
our stream waits on it, and each output is `record_stream`ed on our stream, so the
allocator keeps it until the resize that reads it has run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch


class TorchvisionJpeg:
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


def _stream_ctx(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """torch.cuda.stream(s) when s is a CUDA stream, nothing otherwise."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
