"""Rows for the device placement: decoded pixels at their own size, resized in the step.

A row is R x R x 3 uint8 (R = `row_side(S)`). Line 0 carries the row's geometry as int32
words; lines 1..R-1 hold the decoded pixels as stored (not turned upright), top-left, at the
DCT scale. The geometry travels in the row itself, so it is copied to the device with the
batch, by the same copy, into buffers allocated once. worker/model/resample.py reads it and
resamples every row into the model's input inside the compiled step.

An image whose decoded size does not fit (a panorama, a large PNG: anything over R - 1 lines
or R columns) is fitted to S x S on the host, as the host placement does, and stored with
the identity geometry; `DecodedRow.reduced` counts it apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worker.decode.cpu import (
    DecodeInfo,
    DecodeSpec,
    Frame,
    decode_checked,
    guarded,
    jpeg_orientation,
    letterbox_geometry,
    resize_geometry,
    shape_frame,
)
from worker.decode.jpeg_header import hardware_frame

# int32 words in line 0: stored height, stored width, EXIF orientation, then the upright
# target of the spec's geometry: resized height, resized width, crop top, crop left (negative
# for letterbox bars), all in staging-size pixels.
GEOMETRY_WORDS = 7


def row_side(size: int) -> int:
    """R for staging size S. DCT scaling leaves a JPEG's shorter side below 2S (up to 16S,
    where libjpeg's smallest scale, 1/8, runs out), so 3S columns and lines keep 4:3 and
    3:2 photos native, and 16:9 ones up to 1.69S on the scaled shorter side (1280x720 at
    S = 224, 1920x1080 at 256); rounded up to a multiple of 8, +1 for the geometry line."""
    return -(-(3 * size) // 8) * 8 + 1


@dataclass(frozen=True)
class DecodedRow:
    """What one decode leaves for its row: the pixels ((h, w) grey or (h, w, 3) RGB, as
    stored), the geometry words, and whether the host had to reduce the image first."""

    pixels: npt.NDArray[np.uint8]
    geometry: tuple[int, ...]
    reduced: bool


def target_geometry(spec: DecodeSpec, width: int, height: int) -> tuple[int, int, int, int]:
    """(resized height, resized width, crop top, crop left) of the spec's geometry for an
    upright width x height image: the numbers the host placement resizes and crops with."""
    s = spec.size
    if spec.geometry == "squash":
        return s, s, 0, 0
    if spec.geometry == "letterbox":
        nw, nh, left, top = letterbox_geometry(width, height, s)
        return nh, nw, -top, -left
    nw, nh, left, top = resize_geometry(width, height, s)
    return nh, nw, top, left


def decode_row(data: bytes, spec: DecodeSpec, side: int) -> tuple[DecodedRow, DecodeInfo]:
    """Decode `data` for a row of side `side`; raises DecodeError as `decode_pixels` does."""
    frame = decode_checked(data, spec)
    # Fitting an oversized image runs Pillow's resize: its failures are this image's too.
    return guarded(lambda: frame_row(frame, spec, side), frame.info.format), frame.info


def frame_row(frame: Frame, spec: DecodeSpec, side: int) -> DecodedRow:
    pixels = frame.pixels()
    h, w = pixels.shape[:2]
    if h <= side - 1 and w <= side:
        upright_w, upright_h = (h, w) if frame.orientation >= 5 else (w, h)
        target = target_geometry(spec, upright_w, upright_h)
        return DecodedRow(pixels, (h, w, frame.orientation, *target), reduced=False)
    s = spec.size
    return DecodedRow(shape_frame(frame, spec), (s, s, 1, s, s, 0, 0), reduced=True)


# Images of at most this many pixels count as thumbnails for the GPU decode's split: those
# nearer the 64x64 sample than the 640x480 one on a log scale (sqrt(4096 * 307200)).
THUMBNAIL_PIXELS = 35_500


@dataclass(frozen=True)
class GpuPlacement:
    """A JPEG a GPU decodes into a packed row as it is: its upright size (the decoder
    applies EXIF orientation) and the row's geometry words."""

    height: int
    width: int
    geometry: tuple[int, ...]


def gpu_placement(data: bytes | memoryview, spec: DecodeSpec, side: int) -> GpuPlacement | None:
    """Where the GPU can decode `data` for a row of side `side`: a JPEG its hardware decoder
    takes, within every limit the CPU path enforces, upright no larger than a row holds.
    None for anything else: the CPU decodes it, and refuses it there when it must."""
    if len(data) > spec.max_bytes:
        return None
    frame = hardware_frame(data)
    if frame is None:
        return None
    height, width = frame
    if width * height > spec.max_pixels or width * height * 3 > spec.max_decode_bytes:
        return None
    if jpeg_orientation(data) >= 5:
        height, width = width, height
    if height > side - 1 or width > side:
        return None
    target = target_geometry(spec, width, height)
    return GpuPlacement(height, width, (height, width, 1, *target))


def write_decoded_row(out: npt.NDArray[np.uint8], row: DecodedRow | npt.NDArray[np.uint8]) -> None:
    """Copy a decoded row (or a whole row kept by the decode cache) into a ring row."""
    if isinstance(row, np.ndarray):
        np.copyto(out, row)
        return
    words = np.array(row.geometry, dtype="<i4").view(np.uint8)
    out[0].reshape(-1)[: words.size] = words
    h, w = row.pixels.shape[:2]
    target = out[1 : 1 + h, :w]
    if row.pixels.ndim == 2:
        np.copyto(target, row.pixels[:, :, np.newaxis])
    else:
        np.copyto(target, row.pixels)
