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


def rle_bmp_bytes(width: int, height: int, *, rle4: bool = False) -> bytes:
    """An RLE8 (or RLE4) BMP at its slowest for Pillow, whose RLE decoder is pure Python:
    every row is one pixel, then an end-of-line code that Pillow pads out byte by byte. A
    100000x1000 image is 5 KB and takes Pillow about 30 s."""
    bits, colours, compression = (4, 16, 2) if rle4 else (8, 256, 1)
    palette = b"".join(struct.pack("<BBBB", i, i, i, 0) for i in range(colours))
    body = b"\x01\x07\x00\x00" * height + b"\x00\x01"  # (1 pixel, colour 7), EOL; EOB
    info = struct.pack(
        "<IiiHHIIiiII", 40, width, height, 1, bits, compression, len(body), 2835, 2835, colours, 0
    )
    offset = 14 + len(info) + len(palette)
    head = b"BM" + struct.pack("<IHHI", offset + len(body), 0, 0, offset)
    return head + info + palette + body


def blank_png_bytes(width: int, height: int, mode: str = "RGBA") -> bytes:
    """A black PNG of any size, made in milliseconds without holding its pixels: the zlib
    stream repeats one deflate block of zero rows. 10000x10000 RGBA is about 390 KB and
    decodes to 400 MB in Pillow."""
    channels, colour_type = {"L": (1, 0), "RGB": (3, 2), "RGBA": (4, 6)}[mode]
    total = (1 + width * channels) * height  # each row: filter byte 0, then zero samples
    block_bytes = 1 << 20

    def deflate(n: int, final: bool) -> bytes:
        # Raw deflate from a fresh compressor: no reference reaches into an earlier block,
        # and a full flush ends it on a byte boundary, so copies of it can be concatenated.
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        return c.compress(bytes(n)) + c.flush(zlib.Z_FINISH if final else zlib.Z_FULL_FLUSH)

    full, rest = divmod(total, block_bytes)
    body = deflate(block_bytes, final=False) * full + deflate(rest, final=True)
    adler = ((total % 65521) << 16) | 1  # Adler-32 of `total` zero bytes
    stream = b"\x78\xda" + body + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", stream)
        + png_chunk(b"IEND", b"")
    )


def jpeg_cut_short_with_eoi(width: int = 320, height: int = 240, **kwargs: object) -> bytes:
    """A JPEG whose scan is cut in the middle and closed with an end-of-image marker, as a
    careless proxy or a half-written upload leaves it: Pillow fills the rest with grey."""
    data = encode(photo_like(width, height), "JPEG", **kwargs)
    sos = data.index(b"\xff\xda")
    return data[: (sos + len(data)) // 2] + b"\xff\xd9"


def jpeg_with_zeroed_scan(width: int = 320, height: int = 240) -> bytes:
    """A JPEG with the middle third of its scan data overwritten with zero bytes."""
    data = bytearray(jpeg_bytes(width, height))
    sos = data.index(b"\xff\xda")
    third = (len(data) - 2 - sos) // 3
    data[sos + third : sos + 2 * third] = bytes(third)
    return bytes(data)
