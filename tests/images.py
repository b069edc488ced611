"""Images made on the fly with PIL, so tests ship no binary fixtures."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def photo_like(width: int = 320, height: int = 240, seed: int = 0) -> Image.Image:
    """A smooth gradient with noise: compresses like a photo, unlike flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            (x * 255 / max(width - 1, 1)),
            (y * 255 / max(height - 1, 1)),
            ((x + y) * 127 / max(width + height - 2, 1)) + (seed * 37 % 128),
        ],
        axis=-1,
    )
    noisy = base + rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str = "JPEG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def jpeg_bytes(width: int = 320, height: int = 240, seed: int = 0, quality: int = 90) -> bytes:
    return encode(photo_like(width, height, seed), "JPEG", quality=quality)


def png_bytes(width: int = 64, height: int = 48, seed: int = 0, mode: str = "RGB") -> bytes:
    return encode(photo_like(width, height, seed).convert(mode), "PNG")


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk with a correct CRC, for crafting headers by hand."""
    body = kind + payload
    return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR announces width x height but that carries no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")


def truncated_jpeg_bytes(width: int = 320, height: int = 240) -> bytes:
    """A valid JPEG cut in half: decoding it must fail as truncated."""
    data = jpeg_bytes(width, height)
    return data[: len(data) // 2]
