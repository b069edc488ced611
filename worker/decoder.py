"""The decode stage: encoded image bytes -> one S x S x 3 uint8 RGB staging row.

Pure functions, called concurrently from the decode thread pool: every call works on its own
PIL objects and numpy arrays and mutates no module or library state, so no lock is needed.
Pillow releases the GIL inside its codecs and its resampler, which is where nearly all the
time goes, so threads scale with cores.

The geometry matches torchvision's ``Resize(S)`` + ``CenterCrop(S)`` on a PIL image (bilinear
with antialias, shorter side to S, long side truncated to an int, crop offsets rounded), so a
model trained with the standard torchvision transforms sees the same pixels here, except that
large JPEGs are decoded DCT-scaled first (libjpeg's 1/2, 1/4, 1/8 decode), which trades a
little fidelity for a several-fold cheaper decode.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    JpegImagePlugin,
    PngImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

from producer.wire import ErrorCode

# Importing the plugins registers them now, at import time: otherwise the first
# Image.open(formats=["WEBP"]) would run Image.init() (a lazy, unlocked registry mutation)
# from inside a decode thread.
_PLUGINS = (BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin)
Image.preinit()

_MAX_MESSAGE = 200
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
    """

    size: int
    max_bytes: int = 50 * 1024 * 1024
    max_pixels: int = 100_000_000
    dct_scaling: bool = True
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


class DecodeError(Exception):
    """A job's image cannot be used; ``code`` is the wire error code for its result."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[DecodeError], tuple[ErrorCode, str]]:
        # The default reduce would call __init__ with the formatted string only, so the
        # error could not cross a process boundary (a process pool, multiprocessing queue).
        return (type(self), (self.code, self.message))


@dataclass(frozen=True)
class DecodeInfo:
    """What was decoded: the sniffed format, the upright size, and the DCT reduction used."""

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
    s = spec.size
    if out.shape != (s, s, 3) or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 of shape {(s, s, 3)}, got {out.dtype} {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out must be writable")

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

    try:
        pixels, info = _decode(data, fmt, spec)
    except DecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own bomb check runs inside Image.open, before ours can (the warning
        # only arrives here as an exception when warnings are errors, e.g. under pytest).
        raise DecodeError(ErrorCode.IMAGE_TOO_LARGE, _message(exc)) from None
    except MemoryError:
        raise DecodeError(ErrorCode.DECODE_ERROR, "out of memory decoding the image") from None
    except Exception as exc:  # noqa: BLE001
        # Pillow's parsers raise a long tail of types on hostile input (OSError,
        # SyntaxError, ValueError, struct.error, EOFError, IndexError, KeyError, TypeError
        # and more, as its fuzzers keep finding); whatever the type, one bad image must
        # fail alone, as a decode_error, never as a worker error.
        raise DecodeError(ErrorCode.DECODE_ERROR, _message(exc, fmt)) from None

    if pixels.ndim == 2:
        np.copyto(out, pixels[:, :, np.newaxis])
    else:
        np.copyto(out, pixels)
    return info


def _decode(data: bytes, fmt: str, spec: DecodeSpec) -> tuple[npt.NDArray[np.uint8], DecodeInfo]:
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

        im.load()
        orientation = _orientation(im)
        frame = _to_l_or_rgb(im)

    transpose = _ORIENTATION_TRANSPOSE.get(orientation)
    if transpose is not None:
        frame = frame.transpose(transpose)
    if orientation in _SWAPS_AXES:
        width, height = height, width

    if spec.geometry == "squash":
        pixels = np.asarray(frame.resize((s, s), Image.Resampling.BILINEAR), dtype=np.uint8)
    elif spec.geometry == "letterbox":
        pixels = _letterbox(frame, s)
    else:
        pixels = _resize_center_crop(frame, s)
    return pixels, DecodeInfo(format=fmt, width=width, height=height, draft_scale=draft_scale)


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


def _message(exc: BaseException, fmt: str | None = None) -> str:
    if isinstance(exc, UnidentifiedImageError):
        # Pillow's text names the BytesIO object (a memory address), which helps no one.
        return f"cannot identify the image data as {fmt or 'an image'}: corrupt header"
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return text
