"""The decode stage: encoded image bytes -> one S x S x 3 uint8 RGB staging row.

Pure functions, called concurrently from the decode thread pool: every call works on its own
PIL objects and numpy arrays and mutates no module or library state, so no lock is needed.
JPEGs (YCbCr, RGB, grey) are decoded by libjpeg-turbo through simplejpeg, the rest by
Pillow; both release the GIL inside their codecs, as Pillow does in its resampler, which is
where nearly all the time goes, so threads scale with cores. `decode_frame` stops before
the resize: worker/decode/rows.py keeps such frames for the device placement.

The geometry matches torchvision's ``Resize(S)`` + ``CenterCrop(S)`` on a PIL image (bilinear
with antialias, shorter side to S, long side truncated to an int, crop offsets rounded), so a
model trained with the standard torchvision transforms sees the same pixels here, except that
large JPEGs are decoded DCT-scaled first (libjpeg's 1/2, 1/4, 1/8 decode), which trades a
little fidelity for a several-fold cheaper decode.

What a hostile image can cost is bounded before any pixel is decoded: the pixel limit, the
memory its pixels would take in Pillow (at the DCT scale that would be used), and a size
limit for the decoders Pillow implements in Python (RLE-compressed BMP), which run about a
hundred times slower than its C codecs.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt
import simplejpeg  # type: ignore[import-untyped]
from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageFile,
    JpegImagePlugin,
    PngImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

from producer.wire import ErrorCode
from worker.base.errors import GpufeedError
from worker.decode.jpeg_header import jpeg_cost_problem, segments

# Importing the plugins registers them now, at import time: otherwise the first
# Image.open(formats=["WEBP"]) would run Image.init() (a lazy, unlocked registry mutation)
# from inside a decode thread.
_PLUGINS = (BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin)
Image.preinit()

_MAX_MESSAGE = 200
_T = TypeVar("_T")
_ORIENTATION_TAG = 0x0112

# EXIF Orientation -> the transpose that undoes it (the same table ImageOps.exif_transpose
# uses). Applied by hand so that a broken EXIF block costs us the rotation, not the image.
_ORIENTATION_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = frozenset({5, 6, 7, 8})

_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})

GEOMETRIES = ("shorter-crop", "squash", "letterbox")


@dataclass(frozen=True)
class DecodeSpec:
    """What a decode produces and which inputs it refuses.

    ``max_pixels`` is checked against the header before any pixel is decoded. Pillow runs its
    own decompression-bomb check inside ``Image.open``, before ours, and refuses anything over
    ``2 * Image.MAX_IMAGE_PIXELS`` (about 179 M pixels by default); such images are reported
    as ``image_too_large`` as well. A deployment wanting a ``max_pixels`` above that must raise
    ``Image.MAX_IMAGE_PIXELS`` once at startup: this module never touches it at call time.

    ``max_decode_bytes`` bounds the memory of one decode: the decoded frame as Pillow holds it
    (see `decoded_bytes`), at the DCT scale that would be used, plus the copy that converts
    it to RGB; also checked from the header. ``max_slow_decoder_pixels`` bounds images whose
    Pillow decoder is written in Python (RLE-compressed BMP), slow per pixel
    (docs/security.md#hostile-input gives its cost).
    """

    size: int
    max_bytes: int = 50 * 1024 * 1024
    max_pixels: int = 100_000_000
    dct_scaling: bool = True
    max_decode_bytes: int = 512 * 1024 * 1024
    max_slow_decoder_pixels: int = 1_000_000
    # How an image becomes S x S: "shorter-crop" (shorter side to S, centre crop),
    # "squash" (both sides to S) or "letterbox" (longer side to S, black bars).
    geometry: str = "shorter-crop"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1 (got {self.size})")
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be one of {', '.join(GEOMETRIES)}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 (got {self.max_bytes})")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1 (got {self.max_pixels})")
        if self.max_decode_bytes < 1:
            raise ValueError(f"max_decode_bytes must be >= 1 (got {self.max_decode_bytes})")
        if self.max_slow_decoder_pixels < 0:
            raise ValueError(
                f"max_slow_decoder_pixels must be >= 0 (got {self.max_slow_decoder_pixels})"
            )


class DecodeError(GpufeedError):
    """A job's image cannot be used; ``code`` is the wire error code for its result."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[DecodeError], tuple[ErrorCode, str]]:
        # The default reduce would call __init__ with the formatted string only, so the
        # error could not cross a process boundary (a process pool, multiprocessing queue).
        return (type(self), (self.code, self.message))


class DecodeInfo(NamedTuple):
    """What was decoded: the sniffed format, the upright size, and the DCT reduction used.
    A named tuple: one is made per image on the event loop (a frozen dataclass costs
    several times more to make)."""

    format: str
    width: int
    height: int
    draft_scale: int


def sniff_format(data: bytes) -> str | None:
    """The Pillow format name for `data`, from its magic bytes alone, or None."""
    head = bytes(data[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM"):
        return "BMP"
    return None


def decode_to_array(data: bytes, spec: DecodeSpec) -> tuple[npt.NDArray[np.uint8], DecodeInfo]:
    """Decode into a freshly allocated (S, S, 3) uint8 array."""
    out = np.empty((spec.size, spec.size, 3), dtype=np.uint8)
    info = decode_into(data, out, spec)
    return out, info


def decode_into(data: bytes, out: npt.NDArray[np.uint8], spec: DecodeSpec) -> DecodeInfo:
    """Decode `data` and write the resized, center-cropped RGB pixels into `out`.

    `out` must be a writable uint8 array of shape (S, S, 3); it is written only once the
    whole decode succeeded, with a single copy, so on DecodeError it is left untouched.
    Raises DecodeError for any input that is not a usable image, and nothing else for any
    byte string (a ValueError means the caller passed a wrong `out`).
    """
    check_row(out, spec)
    pixels, info = decode_pixels(data, spec)
    write_row(out, pixels)
    return info


def check_row(out: npt.NDArray[np.uint8], spec: DecodeSpec) -> None:
    """Raise ValueError unless `out` is a writable (S, S, 3) uint8 row for `spec`."""
    s = spec.size
    if out.shape != (s, s, 3) or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 of shape {(s, s, 3)}, got {out.dtype} {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out must be writable")


def write_row(out: npt.NDArray[np.uint8], pixels: npt.NDArray[np.uint8]) -> None:
    """Copy what `decode_pixels` returned into a staging row: (S, S) grey or (S, S, 3)."""
    if pixels.ndim == 2:
        np.copyto(out, pixels[:, :, np.newaxis])
    else:
        np.copyto(out, pixels)


def decode_pixels(data: bytes, spec: DecodeSpec) -> tuple[npt.NDArray[np.uint8], DecodeInfo]:
    """Decode `data` into a private (S, S) grey or (S, S, 3) RGB array, not yet in any row.

    The decode pool writes the array into its staging row only if the batch still waits
    for it (`write_row`): a decode that ran past its budget must not touch a row that a
    later batch may own by then. Raises DecodeError, and nothing else, for any byte string.
    """
    frame = decode_checked(data, spec)
    return guarded(lambda: shape_frame(frame, spec), frame.info.format), frame.info


def decode_checked(data: bytes, spec: DecodeSpec) -> Frame:
    """The checks and the decode of `decode_pixels`, without the resize: the frame at the
    DCT scale. Raises DecodeError, and nothing else, for any byte string."""
    if len(data) == 0:
        raise DecodeError(ErrorCode.EMPTY_IMAGE, "the image is empty")
    if len(data) > spec.max_bytes:
        raise DecodeError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"{len(data)} bytes is over the limit of {spec.max_bytes} bytes",
        )
    fmt = sniff_format(data)
    if fmt is None:
        raise DecodeError(ErrorCode.UNSUPPORTED_FORMAT, "not a JPEG, PNG, WebP, BMP or GIF image")

    return guarded(lambda: decode_frame(data, fmt, spec), fmt, max_pixels=spec.max_pixels)


def guarded(work: Callable[[], _T], fmt: str, *, max_pixels: int | None = None) -> _T:
    """`work()`, with whatever it raises turned into DecodeError as `decode_pixels` does.
    `max_pixels`: the limit an image too large for Pillow is said to be over."""
    try:
        return work()
    except DecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own bomb check runs inside Image.open, before ours can (the warning
        # only arrives here as an exception when warnings are errors, e.g. under pytest).
        # Its text quotes Pillow's limit (twice GPUFEED_MAX_IMAGE_PIXELS, as the worker sets
        # it): the answer quotes the setting, as the header check's does.
        raise DecodeError(ErrorCode.IMAGE_TOO_LARGE, _bomb_message(exc, max_pixels)) from None
    except MemoryError:
        raise DecodeError(ErrorCode.DECODE_ERROR, "out of memory decoding the image") from None
    except Exception as exc:  # noqa: BLE001
        # Pillow's parsers raise a long tail of types on hostile input (OSError,
        # SyntaxError, ValueError, struct.error, EOFError, IndexError, KeyError, TypeError
        # and more, as its fuzzers keep finding); whatever the type, one bad image must
        # fail alone, as a decode_error, never as a worker error.
        raise DecodeError(ErrorCode.DECODE_ERROR, _message(exc, fmt)) from None


@dataclass(frozen=True)
class Frame:
    """A decoded image before any resize: "L" or "RGB", as stored (not yet turned upright),
    its EXIF orientation (1: upright) and what was decoded (upright size, DCT scale)."""

    # Pillow's image, or None where the decoder gave an array (libjpeg-turbo's output):
    # `image()` wraps it only when a Pillow resize needs it (a copy into Pillow's layout).
    pil: Image.Image | None
    orientation: int
    info: DecodeInfo
    array: npt.NDArray[np.uint8] | None = None

    def image(self) -> Image.Image:
        if self.pil is not None:
            return self.pil
        assert self.array is not None
        h, w, channels = self.array.shape
        mode = "L" if channels == 1 else "RGB"
        return Image.frombuffer(mode, (w, h), self.array, "raw", mode, 0, 1)

    def pixels(self) -> npt.NDArray[np.uint8]:
        """(h, w) grey or (h, w, 3) RGB, as stored."""
        if self.array is not None:
            return self.array[:, :, 0] if self.array.shape[2] == 1 else self.array
        return np.asarray(self.pil, dtype=np.uint8)


def decode_frame(data: bytes, fmt: str, spec: DecodeSpec) -> Frame:
    """Decode `data` (already sniffed as `fmt`) at the DCT scale, not resized. JPEGs that
    libjpeg-turbo's TurboJPEG API reads (YCbCr, RGB and grey: nearly all) go through
    simplejpeg; the rest, and anything it cannot parse, through Pillow as before."""
    if fmt == "JPEG":
        frame = _turbo_frame(data, spec)
        if frame is not None:
            return frame
    return _pillow_frame(data, fmt, spec)


def _pillow_frame(data: bytes, fmt: str, spec: DecodeSpec) -> Frame:
    s = spec.size
    with Image.open(io.BytesIO(data), formats=[fmt]) as im:
        width, height = im.size
        if width <= 0 or height <= 0:
            raise DecodeError(
                ErrorCode.DECODE_ERROR, f"image has a zero dimension ({width}x{height})"
            )
        if width * height > spec.max_pixels:
            raise DecodeError(
                ErrorCode.IMAGE_TOO_LARGE,
                f"{width}x{height} is {width * height} pixels, over the limit of "
                f"{spec.max_pixels} pixels",
            )

        draft_scale = 1
        if fmt == "JPEG" and spec.dct_scaling:
            # Asking for at least S x S keeps the shorter side >= S whatever the EXIF
            # orientation turns out to be (a rotation swaps the sides, not their lengths);
            # draft() then picks the largest of 1/2, 1/4, 1/8 that still fits.
            drafted = im.draft("RGB", (s, s))
            if drafted is not None:
                draft_scale = max(1, round(width / drafted[1][2]))

        _check_cost(im, spec, width, height, draft_scale)
        if fmt == "JPEG":
            problem = jpeg_cost_problem(
                data, decoded_bytes(im.mode, *im.size), spec.max_decode_bytes
            )
            if problem is not None:
                raise DecodeError(ErrorCode.IMAGE_TOO_LARGE, problem)
        im.load()
        if fmt == "JPEG" and _looks_damaged(im, data):
            _check_jpeg_data(data, im.mode)
        orientation = _orientation(im)
        image = _to_l_or_rgb(im)
        image.load()
    return _framed(image, orientation, DecodeInfo(fmt, width, height, draft_scale))


def _framed(
    image: Image.Image | None,
    orientation: int,
    info: DecodeInfo,
    array: npt.NDArray[np.uint8] | None = None,
) -> Frame:
    """`info` with the stored size; the frame's info holds the upright one."""
    if orientation in _SWAPS_AXES:
        info = DecodeInfo(info.format, info.height, info.width, info.draft_scale)
    return Frame(pil=image, orientation=orientation, info=info, array=array)


def dct_scale(width: int, height: int, size: int) -> int:
    """The largest of libjpeg's 1/2, 1/4, 1/8 reductions that keeps both sides >= `size`
    (both, so that the shorter side stays >= size whatever the EXIF orientation), or 1.
    libjpeg rounds a scaled side up."""
    scale = 8
    while scale > 1 and (-(-width // scale) < size or -(-height // scale) < size):
        scale //= 2
    return scale


def _turbo_frame(data: bytes, spec: DecodeSpec) -> Frame | None:
    """The JPEG decoded by libjpeg-turbo (simplejpeg, which releases the GIL), or None when
    Pillow should decode it (CMYK/YCCK, or a header TurboJPEG refuses: Pillow then decodes
    it or reports the error as it always has)."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - whatever it is, Pillow's path judges the image
        return None
    if colorspace not in ("YCbCr", "RGB", "Gray") or width <= 0 or height <= 0:
        return None
    if width * height > spec.max_pixels:
        raise DecodeError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{width}x{height} is {width * height} pixels, over the limit of "
            f"{spec.max_pixels} pixels",
        )
    if width * height > 2 * (Image.MAX_IMAGE_PIXELS or width * height):
        # Pillow's own decompression-bomb limit, kept for the JPEGs it no longer opens.
        raise DecodeError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{width}x{height} is over Pillow's decompression-bomb limit of "
            f"{2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels",
        )
    scale = dct_scale(width, height, spec.size) if spec.dct_scaling else 1
    sw, sh = -(-width // scale), -(-height // scale)
    grey = colorspace == "Gray"
    need = decoded_bytes("L" if grey else "RGB", sw, sh)
    if need > spec.max_decode_bytes:
        at = f" (decoded at 1/{scale}: {sw}x{sh})" if scale > 1 else ""
        mib = 1024 * 1024
        mode = "L" if grey else "RGB"
        raise DecodeError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{width}x{height} {mode}{at} needs {-(-need // mib)} MiB to decode, over the "
            f"limit of {spec.max_decode_bytes // mib} MiB",
        )
    problem = jpeg_cost_problem(data, need, spec.max_decode_bytes)
    if problem is not None:
        raise DecodeError(ErrorCode.IMAGE_TOO_LARGE, problem)
    space = "GRAY" if grey else "RGB"
    try:
        # Strict: libjpeg-turbo's warnings raise, so data that ends before the image does is
        # seen here rather than decoded into grey fill.
        pixels = simplejpeg.decode_jpeg(
            data, colorspace=space, min_height=sh, min_width=sw, strict=True
        )
    except ValueError as exc:
        text = str(exc)
        # libjpeg's JWRN_HIT_MARKER and JWRN_JPEG_EOF; other warnings (extraneous bytes,
        # odd markers) leave the pixels whole and are not a reason to refuse the image.
        if "premature end" in text.lower():
            raise DecodeError(
                ErrorCode.DECODE_ERROR,
                f"the JPEG data is truncated: it ends before the image does ({text})",
            ) from None
        return None
    if pixels.shape[:2] != (sh, sw):
        return None  # not the scale asked for: let Pillow's draft decide, as before
    info = DecodeInfo("JPEG", width, height, scale)
    return _framed(None, jpeg_orientation(data), info, pixels)


def jpeg_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation of a JPEG (1 when absent or unreadable), from its APP1 segment:
    read by Pillow's EXIF parser, without opening the image."""
    exif = _jpeg_exif(data)
    if exif is None:
        return 1
    try:
        value = Image.Exif()
        value.load(exif)
        tag = value.get(_ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - broken metadata costs the rotation, not the image
        return 1
    return tag if isinstance(tag, int) and tag in _ORIENTATION_TRANSPOSE else 1


def _jpeg_exif(data: bytes | memoryview) -> bytes | None:
    """The first APP1 segment holding EXIF ("Exif\\0\\0" and its TIFF data), or None."""
    # The segments before the scan, never a search of the whole file: a search holds the
    # GIL for a share of a decode's time (docs/concepts.md#decode-and-resize).
    for marker, pos, length in segments(data):
        if marker == 0xE1 and data[pos + 4 : pos + 10] == b"Exif\x00\x00":
            return bytes(data[pos + 4 : pos + 2 + length])
    return None


def shape_frame(frame: Frame, spec: DecodeSpec) -> npt.NDArray[np.uint8]:
    """The frame turned upright and fitted to S x S by the spec's geometry: (S, S) grey or
    (S, S, 3) RGB."""
    s = spec.size
    image = frame.image()
    transpose = _ORIENTATION_TRANSPOSE.get(frame.orientation)
    if transpose is not None:
        image = image.transpose(transpose)
    if spec.geometry == "squash":
        return np.asarray(image.resize((s, s), Image.Resampling.BILINEAR), dtype=np.uint8)
    if spec.geometry == "letterbox":
        return _letterbox(image, s)
    return _resize_center_crop(image, s)


def decoded_bytes(mode: str, width: int, height: int) -> int:
    """Bytes Pillow holds for a `mode` frame of width x height, plus the copy converting it
    to RGB where the mode needs one: a pixel is 1 byte in modes 1, L and P, 2 in the 16-bit
    grey modes and one 32-bit word in every other mode (RGB included)."""
    if mode in ("1", "L", "P"):
        per_pixel = 1
    elif mode in _SIXTEEN_BIT_MODES:
        per_pixel = 2
    else:
        per_pixel = 4
    if mode not in ("L", "RGB"):
        per_pixel += 4
    return width * height * per_pixel


def _check_cost(
    im: ImageFile.ImageFile, spec: DecodeSpec, width: int, height: int, scale: int
) -> None:
    """Refuse, from the header alone, what would take too much memory or time to decode."""
    slow = [t.codec_name for t in im.tile if t.codec_name in Image.DECODERS]
    if slow and width * height > spec.max_slow_decoder_pixels:
        # Image.DECODERS holds the decoders written in Python (for the formats we accept,
        # only BMP's RLE8/RLE4): slow per pixel, holding the GIL most of the time
        # (docs/security.md#hostile-input gives the cost).
        raise DecodeError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{width}x{height} is {width * height} pixels of RLE-compressed data, over the "
            f"limit of {spec.max_slow_decoder_pixels} pixels for that slow decoder",
        )
    # After draft(), im.size and im.mode are what the decoder will produce.
    need = decoded_bytes(im.mode, *im.size)
    if need > spec.max_decode_bytes:
        at = f" (decoded at 1/{scale}: {im.size[0]}x{im.size[1]})" if scale > 1 else ""
        mib = 1024 * 1024
        raise DecodeError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{width}x{height} {im.mode}{at} needs {-(-need // mib)} MiB to decode, over the "
            f"limit of {spec.max_decode_bytes // mib} MiB",
        )


def _looks_damaged(im: Image.Image, data: bytes) -> bool:
    """Cheap signs of JPEG data that ran out, since Pillow drops libjpeg's warnings: the
    last pixel is libjpeg's fill for blocks it had no data for (every coefficient zero, so
    every sample 128; 127 in inverted Adobe CMYK), or the scan data holds a run of zero
    bytes (zero-filled damage), which decodes to garbage until the data runs out."""
    w, h = im.size
    pixel = im.getpixel((w - 1, h - 1))
    values = pixel if isinstance(pixel, tuple) else (pixel,)
    if len(set(values)) == 1 and values[0] in (127, 128):
        return True
    scan = _first_scan(data)
    return scan >= 0 and _has_zero_run(data, scan)


def _has_zero_run(data: bytes, start: int) -> bool:
    """Whether `data[start:]` holds 7 consecutive zero 8-byte words, which any run of 64 zero
    bytes does (512 zero bits: encoders write such runs only for large flat areas under
    optimised Huffman tables, which the strict look then clears). As 8-byte words in numpy,
    it costs a third of bytes.find and mostly runs without the GIL."""
    first = -(-start // 8) * 8
    count = (len(data) - first) // 8
    if count < 7:
        return False
    words = np.frombuffer(data, dtype=np.uint64, count=count, offset=first)
    zero = np.flatnonzero(words == 0)
    return bool(zero.size >= 7 and np.any(zero[6:] - zero[:-6] == 6))


def _first_scan(data: bytes) -> int:
    """Offset of the first scan's entropy-coded data (after its SOS header), or -1. Walks
    the marker segments, so zero padding inside EXIF blocks is not mistaken for scan data."""
    for marker, pos, length in segments(data):
        if marker == 0xDA:
            return pos + 2 + length
    return -1


def _check_jpeg_data(data: bytes, mode: str) -> None:
    """Raise DecodeError when libjpeg-turbo reports that the scan data ends before the image
    does (cut short and closed with an end-of-image marker, or damaged so that the decoder
    runs out): Pillow fills the rest with grey and says nothing. simplejpeg's strict mode
    is libjpeg-turbo's stop-on-warning, and thread-safe (unlike catching warnings); the
    1/8 scale keeps this second look cheap."""
    try:
        simplejpeg.decode_jpeg(
            data,
            colorspace="CMYK" if mode == "CMYK" else "GRAY",
            min_height=1,
            min_width=1,
            strict=True,
        )
    except ValueError as exc:
        text = str(exc)
        # libjpeg's JWRN_HIT_MARKER and JWRN_JPEG_EOF; other warnings (extraneous bytes,
        # odd markers) leave the pixels whole and are not a reason to refuse the image.
        if "premature end" in text.lower():
            raise DecodeError(
                ErrorCode.DECODE_ERROR, f"the JPEG data ends before the image does ({text})"
            ) from None


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001
        # Broken EXIF metadata on otherwise good pixels: browsers show such images
        # unrotated, and so do we, rather than failing the job over metadata.
        return 1
    return value if isinstance(value, int) and value in _ORIENTATION_TRANSPOSE else 1


def _to_l_or_rgb(im: Image.Image) -> Image.Image:
    """The frame as "L" or "RGB"; grey stays one channel so resizing it costs a third."""
    mode = im.mode
    if mode in ("L", "RGB"):
        return im
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        # Pillow's own convert clips 16-bit samples at 255, so anything above 1/256 of
        # full scale would come out white: take the high byte instead. Mode "I" (32-bit)
        # only arises from 16-bit samples in the formats we accept, so it is treated alike.
        wide = np.asarray(im)
        if mode == "I":
            wide = np.clip(wide, 0, 0xFFFF)
        return Image.fromarray((wide >> 8).astype(np.uint8))
    if mode in ("1", "F", "LA"):
        # F: convert clips to 0..255, the only sensible reading of float samples with no
        # declared range. LA: alpha dropped, see below.
        return im.convert("L")
    # Alpha (RGBA, LA, PA, P with transparency) is dropped, not composited onto a
    # background: that is what the ubiquitous Image.open(...).convert("RGB") in torchvision
    # training pipelines does, so the model sees what it was trained on. The colour under
    # fully transparent pixels is whatever the encoder left there.
    # P and PA expand through the palette; CMYK and YCbCr go through Pillow's conversions.
    # Forgetting the transparency first (on this call's own image object) is what dropping
    # it means; left in place, a per-entry tRNS table makes convert() warn on every image.
    im.info.pop("transparency", None)
    return im.convert("RGB")


def resize_geometry(w: int, h: int, s: int) -> tuple[int, int, int, int]:
    """(new width, new height, crop left, crop top) of torchvision's Resize(s) then
    CenterCrop(s) for a w x h image; shared by the CPU and GPU decoders so both put the
    same pixels in a row."""
    # torchvision's _compute_resized_output_size: the long side is truncated, not rounded.
    if w <= h:
        nw, nh = s, int(s * h / w)
    else:
        nw, nh = int(s * w / h), s
    # torchvision's center_crop offsets.
    return nw, nh, round((nw - s) / 2.0), round((nh - s) / 2.0)


def _resize_center_crop(im: Image.Image, s: int) -> npt.NDArray[np.uint8]:
    """torchvision Resize(s) (bilinear, antialias) then CenterCrop(s), in one resample."""
    w, h = im.size
    nw, nh, left, top = resize_geometry(w, h, s)

    if (nw, nh) == (w, h):
        cropped = im.crop((left, top, left + s, top + s))
    else:
        # Resampling only the source box that maps onto the crop gives the same pixels as
        # resizing the whole image and cropping afterwards (Pillow's filter still reads
        # source pixels outside the box), without computing the discarded margins.
        sx, sy = w / nw, h / nh
        box = (left * sx, top * sy, (left + s) * sx, (top + s) * sy)
        cropped = im.resize((s, s), Image.Resampling.BILINEAR, box=box)
    return np.asarray(cropped, dtype=np.uint8)


def letterbox_geometry(w: int, h: int, s: int) -> tuple[int, int, int, int]:
    """(new width, new height, left, top) of a w x h image fitted into s x s with its aspect
    ratio kept and centred: the longer side becomes s, the bars share the rest."""
    scale = s / max(w, h)
    nw, nh = max(1, min(s, round(w * scale))), max(1, min(s, round(h * scale)))
    return nw, nh, (s - nw) // 2, (s - nh) // 2


def _letterbox(im: Image.Image, s: int) -> npt.NDArray[np.uint8]:
    w, h = im.size
    nw, nh, left, top = letterbox_geometry(w, h, s)
    fitted = im if (nw, nh) == (w, h) else im.resize((nw, nh), Image.Resampling.BILINEAR)
    canvas = Image.new(fitted.mode, (s, s), 0)
    canvas.paste(fitted, (left, top))
    return np.asarray(canvas, dtype=np.uint8)


_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


def _bomb_message(exc: BaseException, max_pixels: int | None) -> str:
    """Pillow's decompression-bomb error, told against `max_pixels` where it is known."""
    found = _BOMB_PIXELS.search(str(exc))
    if max_pixels is None or found is None:
        return _message(exc)
    return f"the image is {found.group(1)} pixels, over the limit of {max_pixels} pixels"


def _message(exc: BaseException, fmt: str | None = None) -> str:
    if isinstance(exc, UnidentifiedImageError):
        # Pillow's text names the BytesIO object (a memory address), which helps no one.
        return f"cannot identify the image data as {fmt or 'an image'}: corrupt header"
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return text
