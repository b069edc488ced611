"""A JPEG's header, read before any pixel is decoded: its segments, and what its markers
say its decode will cost.

A JPEG of one interleaved scan (nearly every baseline JPEG) is decoded a band of rows at a
time. Any other (progressive, or sequential with a scan per component) is decoded scan by
scan into a buffer of every DCT coefficient of the whole image at full size, whatever DCT
scale the output uses (libjpeg's whole-image coefficient buffer: 64 coefficients of 2 bytes
a block), and each scan is another pass over it. So such a JPEG's memory is that buffer
beside the output, and its time grows with its scans: a 400 KB progressive JPEG declaring
10000x10000 with 1,500 scans holds 286 MiB and takes minutes of CPU.

The scans are counted with one search for the SOS marker after the first scan: in
entropy-coded data a 0xFF byte is always followed by 0x00 or a restart marker, so FF DA
there is always a marker. A sequential JPEG whose first scan holds every component has no
other (libjpeg refuses a second one), so it is not searched: the search costs a share of a
photo's decode worth saving (docs/concepts.md#decode-and-resize).

The header is the sender's: every function here answers any bytes at all with a result or
None ("cannot be read", "not for the GPU"), never an exception, since some of them run
before a decode's own error handling does (the GPU routing in a decode process).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# More scans than any encoder writes for a real image (libjpeg's progressive script has 10,
# jpegtran's and mozjpeg's optimised ones a few dozen at most); each is a pass over the
# whole coefficient buffer.
MAX_SCANS = 100
_SOS = b"\xff\xda"
# Start-of-frame markers of the processes that need the whole coefficient buffer whatever
# their scans: progressive (SOF2, SOF6) and progressive arithmetic (SOF10, SOF14).
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn, not DHT, JPG, DAC


@dataclass(frozen=True)
class JpegCost:
    width: int
    height: int
    progressive: bool
    scans: int
    # The whole-image coefficient buffer the decode holds; 0 when it decodes band by band.
    coefficient_bytes: int


def segments(data: bytes | memoryview) -> Iterator[tuple[int, int, int]]:
    """(marker, offset, length) of each segment of a JPEG's header, up to and including the
    first scan's (SOS); it ends early where the header is not a JPEG's. A walk over a
    handful of segments, never a search of the whole file."""
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        yield marker, pos, length
        if marker == 0xDA:
            return
        pos += 2 + length


def jpeg_cost(data: bytes) -> JpegCost | None:
    """The cost the markers of `data` declare; None when they cannot be read (the decoder
    then judges the file as it always has)."""
    frame: tuple[int, int, int, list[tuple[int, int]]] | None = None
    for marker, pos, length in segments(data):
        if marker in _FRAMES:
            frame = _frame(marker, data[pos + 4 : pos + 2 + length])
        elif marker == 0xDA and frame is not None:
            sof, height, width, sampling = frame
            in_scan = data[pos + 4] if pos + 4 < len(data) else 0
            if sof not in _PROGRESSIVE and in_scan >= len(sampling) > 0:
                # A sequential first scan of every component is the only scan: libjpeg
                # decides so at that scan and refuses any later one ("Didn't expect more
                # than one scan"), so the file (nearly every baseline JPEG) is not searched.
                scans = 1
            else:
                scans = data.count(_SOS, pos)
            whole = sof in _PROGRESSIVE or scans > 1
            return JpegCost(
                width=width,
                height=height,
                progressive=sof in _PROGRESSIVE,
                scans=scans,
                coefficient_bytes=_coefficient_bytes(width, height, sampling) if whole else 0,
            )
    return None


def _frame(marker: int, body: bytes) -> tuple[int, int, int, list[tuple[int, int]]] | None:
    """(marker, height, width, [(h, v) sampling of each component]) of a SOF segment; None
    when it does not hold every component it declares."""
    if len(body) < 6:
        return None
    height = int.from_bytes(body[1:3], "big")
    width = int.from_bytes(body[3:5], "big")
    count = body[5]
    sampling = [
        (body[i + 1] >> 4, body[i + 1] & 0x0F)
        for i in range(6, 6 + 3 * count, 3)
        if i + 1 < len(body)
    ]
    if len(sampling) != count:
        return None
    return marker, height, width, sampling


def _coefficient_bytes(width: int, height: int, sampling: list[tuple[int, int]]) -> int:
    """libjpeg's whole-image coefficient buffer: each component's blocks, padded to whole
    MCUs, 64 coefficients of 2 bytes each."""
    if not sampling or width <= 0 or height <= 0:
        return 0
    max_h = max(1, *(h for h, _ in sampling))
    max_v = max(1, *(v for _, v in sampling))
    mcus_x = -(-width // (8 * max_h))
    mcus_y = -(-height // (8 * max_v))
    blocks = sum(mcus_x * h * mcus_y * v for h, v in sampling)
    return blocks * 64 * 2


def jpeg_cost_problem(data: bytes, output_bytes: int, max_decode_bytes: int) -> str | None:
    """Why a JPEG costs too much to decode (its scans, or its coefficient buffer beside
    `output_bytes` of output, over the limits); None when it does not, or when its markers
    cannot be read."""
    cost = jpeg_cost(data)
    if cost is None:
        return None
    what = f"{cost.width}x{cost.height} {'progressive ' if cost.progressive else ''}JPEG"
    if cost.scans > MAX_SCANS:
        return (
            f"{what} of {cost.scans} scans: at most {MAX_SCANS} are decoded (each is a pass "
            "over the whole image)"
        )
    need = cost.coefficient_bytes + output_bytes
    if cost.coefficient_bytes and need > max_decode_bytes:
        mib = 1024 * 1024
        return (
            f"{what} needs {-(-need // mib)} MiB to decode "
            f"({-(-cost.coefficient_bytes // mib)} MiB of coefficients at full size, whatever "
            f"the scale), over the limit of {max_decode_bytes // mib} MiB"
        )
    return None


# Chroma subsampling a GPU's hardware JPEG decoder takes, as the luma component's (h, v)
# sampling factors with both chroma components at (1, 1): 4:4:4, 4:2:2, 4:2:0, 4:4:0.
_HARDWARE_SAMPLING = frozenset({(1, 1), (2, 1), (2, 2), (1, 2)})
_ADOBE = b"Adobe"
# An Adobe APP14 segment's body: "Adobe", version (2 bytes), flags0 (2), flags1 (2), then
# the colour transform this byte holds (0: RGB or CMYK, 1: YCbCr, 2: YCCK).
_ADOBE_TRANSFORM = 11


def hardware_frame(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) of a JPEG that a GPU's hardware decoder takes as it is: baseline
    (SOF0) of 8-bit samples, grey or YCbCr with the usual subsampling, every component in
    its first scan, both sides at least 1; None for anything else (progressive, arithmetic,
    12-bit, CMYK, Adobe RGB, odd sampling, a header that cannot be read), which the CPU
    decodes, or refuses, as it always has.

    Total: any bytes give one of those two answers, never an exception. The header is the
    sender's, and this runs before a decode's own error handling would see it."""
    if bytes(data[:3]) != b"\xff\xd8\xff":
        return None
    frame: tuple[int, int, int, list[tuple[int, int]]] | None = None
    for marker, pos, length in segments(data):
        if marker == 0xEE:
            body = bytes(data[pos + 4 : pos + 2 + length])
            if body.startswith(_ADOBE) and not _adobe_ycbcr(body):
                return None  # RGB, CMYK or YCCK samples, or a transform cut off
        elif marker in _FRAMES:
            if marker != 0xC0 or frame is not None:
                return None  # not baseline, or a second frame (libjpeg refuses one)
            body = bytes(data[pos + 4 : pos + 2 + length])
            frame = _frame(marker, body)
            if frame is None or body[0] != 8:
                return None
        elif marker == 0xDA:
            in_scan = data[pos + 4] if pos + 4 < len(data) else -1
            return _hardware_size(frame, in_scan)
    return None


def _adobe_ycbcr(body: bytes) -> bool:
    """Whether an Adobe APP14 segment's body says its samples are YCbCr; False for any
    other transform, or a body that ends before its transform."""
    return len(body) > _ADOBE_TRANSFORM and body[_ADOBE_TRANSFORM] == 1


def _hardware_size(
    frame: tuple[int, int, int, list[tuple[int, int]]] | None, in_scan: int
) -> tuple[int, int] | None:
    """(height, width) of a baseline frame whose first scan holds its `in_scan` components,
    when the hardware decoder takes it; None otherwise. A side of 0 is refused: a height
    of 0 is one a DNL marker gives later, and neither makes a picture a row can place."""
    if frame is None:
        return None
    _, height, width, sampling = frame
    if in_scan != len(sampling) or height <= 0 or width <= 0:
        return None
    if not all(1 <= h <= 4 and 1 <= v <= 4 for h, v in sampling):
        return None  # libjpeg's bounds: anything else is no JPEG it decodes
    if len(sampling) == 1 or (
        len(sampling) == 3
        and sampling[0] in _HARDWARE_SAMPLING
        and sampling[1] == sampling[2] == (1, 1)
    ):
        return height, width
    return None
