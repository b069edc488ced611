"""A JPEG decoded scan by scan holds every coefficient of the whole image at full size,
whatever the DCT scale, and each scan is a pass over them: its memory limit counts that
buffer, and a JPEG of more scans than any encoder writes is refused before it is decoded."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import simplejpeg
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image

from producer.wire import ErrorCode
from tests.support.images import photo_like
from worker.decode import cpu
from worker.decode.cpu import DecodeError, DecodeSpec, decode_frame
from worker.decode.jpeg_header import (
    MAX_SCANS,
    hardware_frame,
    jpeg_cost,
    jpeg_cost_problem,
    segments,
)
from worker.decode.rows import GEOMETRY_WORDS, gpu_placement, row_side

MIB = 1024 * 1024


def jpeg(width: int, height: int, *, progressive: bool, subsampling: int = 2) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(
        out, "JPEG", quality=80, progressive=progressive, subsampling=subsampling
    )
    return out.getvalue()


def with_scans(data: bytes, scans: int) -> bytes:
    """`data` (progressive) with its last scan repeated until it has `scans` of them."""
    last = data.rindex(b"\xff\xda")
    have = data.count(b"\xff\xda")
    return data[:-2] + data[last:-2] * (scans - have) + b"\xff\xd9"


def test_a_progressive_jpeg_counts_its_whole_coefficient_buffer() -> None:
    # 4000x3000, 4:2:0: 35 MiB of coefficients, though decoded at 1/8 it is 500x375.
    spec = DecodeSpec(size=224, max_decode_bytes=32 * MIB)
    baseline = decode_frame(jpeg(4000, 3000, progressive=False), "JPEG", spec)
    assert baseline.info.draft_scale == 8
    with pytest.raises(DecodeError) as refused:
        decode_frame(jpeg(4000, 3000, progressive=True), "JPEG", spec)
    assert refused.value.code == ErrorCode.IMAGE_TOO_LARGE
    assert "4000x3000 progressive JPEG needs 36 MiB" in str(refused.value)
    assert "over the limit of 32 MiB" in str(refused.value)
    # Under a limit that holds the buffer it decodes as the baseline one does.
    roomy = DecodeSpec(size=224, max_decode_bytes=64 * MIB)
    frame = decode_frame(jpeg(4000, 3000, progressive=True), "JPEG", roomy)
    assert frame.pixels().shape == baseline.pixels().shape


def test_the_buffer_counted_is_what_libjpeg_turbo_holds(tmp_path: Path) -> None:
    # Measured in a process of its own: its peak memory grows by the buffer counted. The
    # peak is the kernel's VmHWM of this process image: ru_maxrss would start from the
    # forking test process's own.
    path = tmp_path / "p.jpg"
    path.write_bytes(jpeg(6000, 6000, progressive=True))
    estimated = jpeg_cost(path.read_bytes())
    assert estimated is not None
    probe = (
        "import json, sys, simplejpeg\n"
        "def peak():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "before = peak()\n"
        "simplejpeg.decode_jpeg(data, min_height=750, min_width=750)\n"
        "print(json.dumps(peak() - before))\n"
    )
    grew = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe, str(path)], capture_output=True, check=True, text=True
        ).stdout
    )
    assert 0.9 * estimated.coefficient_bytes <= grew <= 1.2 * estimated.coefficient_bytes + 8 * MIB


def test_a_jpeg_of_too_many_scans_is_refused_before_it_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile = with_scans(jpeg(2000, 2000, progressive=True), 1500)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", never)
    monkeypatch.setattr(cpu.simplejpeg, "decode_jpeg", never)
    with pytest.raises(DecodeError) as refused:
        decode_frame(hostile, "JPEG", DecodeSpec(size=224))
    assert refused.value.code == ErrorCode.IMAGE_TOO_LARGE
    assert f"of 1500 scans: at most {MAX_SCANS}" in str(refused.value)


def test_scans_are_counted_from_the_first_scan_and_a_thumbnail_is_not_one() -> None:
    # An EXIF thumbnail is a JPEG of its own inside the header: its SOS is no scan.
    image = photo_like(320, 240, 0)
    thumb = io.BytesIO()
    image.resize((80, 60)).save(thumb, "JPEG")
    exif = Image.Exif()
    exif[0x0112] = 1
    raw = exif.tobytes() + thumb.getvalue()
    out = io.BytesIO()
    image.save(out, "JPEG", exif=raw)
    cost = jpeg_cost(out.getvalue())
    assert cost is not None
    assert (cost.scans, cost.progressive, cost.coefficient_bytes) == (1, False, 0)
    progressive = jpeg_cost(jpeg(640, 480, progressive=True))
    assert progressive is not None
    assert progressive.progressive and 2 <= progressive.scans <= 12


def test_a_sequential_jpeg_of_one_scan_is_not_searched_and_later_scans_are_refused() -> None:
    # Its markers are read without a search of the data: its first scan holds every
    # component, so libjpeg decodes it as the only one. Scans appended after it cannot cost
    # a pass each: the decode refuses the file at the second.
    clean = io.BytesIO()
    photo_like(640, 480, 0).save(clean, "JPEG", quality=80)
    data = clean.getvalue()
    first = data.index(b"\xff\xda")
    header = data[first : first + 2 + int.from_bytes(data[first + 2 : first + 4], "big")]
    hostile = data[:-2] + (header + data[first + len(header) : first + len(header) + 500]) * 1500
    hostile += b"\xff\xd9"
    for each in (data, hostile):
        cost = jpeg_cost(each)
        assert cost is not None
        assert (cost.scans, cost.progressive, cost.coefficient_bytes) == (1, False, 0)
    assert cpu.decode_checked(data, DecodeSpec(size=224)).info.width == 640
    with pytest.raises(DecodeError) as refused:
        cpu.decode_checked(hostile, DecodeSpec(size=224))
    assert refused.value.code == ErrorCode.DECODE_ERROR


@given(st.integers(min_value=0, max_value=2000), st.binary(max_size=8))
@example(cut=163, junk=b"\xff")
def test_any_cut_or_damage_of_the_markers_is_a_cost_or_none(cut: int, junk: bytes) -> None:
    data = jpeg(64, 48, progressive=True)
    damaged = data[:cut] + junk + data[cut + len(junk) :]
    cost = jpeg_cost(damaged)
    assert cost is None or (cost.scans >= 1 and cost.coefficient_bytes >= 0)


# ------------------------------------------------------------------ hostile headers
# The GPU routing of a decode process (worker/decode/rows.py's gpu_placement) reads the
# header before any decode, so every reader here must answer any bytes without raising.

_SPEC = DecodeSpec(size=48)
_SIDE = row_side(48)
_HEADER_MARKERS = frozenset({0xC0, 0xC2, 0xC4, 0xDA, 0xDB, 0xE0, 0xE1, 0xEE})


def _saved(image: Image.Image, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=80, **options)
    return out.getvalue()


def with_adobe(data: bytes, transform: int) -> bytes:
    """`data` with an Adobe APP14 segment after its SOI saying colour transform
    `transform` (1: YCbCr), as Photoshop writes it."""
    app14 = b"Adobe" + (100).to_bytes(2, "big") + bytes(4) + bytes([transform])
    return data[:2] + b"\xff\xee" + (2 + len(app14)).to_bytes(2, "big") + app14 + data[2:]


def _segment(data: bytes, marker: int) -> tuple[int, int]:
    """(offset, length) of `data`'s first segment of `marker`."""
    return next((pos, length) for m, pos, length in segments(data) if m == marker)


def sof0_width_zero() -> bytes:
    """A baseline JPEG whose SOF0 says it is 0 pixels wide."""
    data = bytearray(_saved(photo_like(32, 24, 1)))
    pos, _ = _segment(bytes(data), 0xC0)
    data[pos + 7 : pos + 9] = b"\x00\x00"
    return bytes(data)


def truncated_adobe() -> bytes:
    """A JPEG that ends inside its Adobe APP14 segment, before the transform byte."""
    data = with_adobe(_saved(photo_like(32, 24, 2)), 1)
    pos, _ = _segment(data, 0xEE)
    return data[: pos + 12]


def _bases() -> list[bytes]:
    """Small JPEGs of every kind the readers tell apart: their headers are most of them."""
    image = photo_like(24, 16, 3)
    exif = Image.Exif()
    exif[0x0112] = 6
    return [
        _saved(image),
        _saved(image, subsampling=0),
        _saved(image.convert("L")),
        _saved(image, progressive=True),
        _saved(image.convert("CMYK")),
        _saved(image, exif=exif.tobytes()),
        with_adobe(_saved(image), 1),
        with_adobe(_saved(image), 0),
    ]


_BASES = _bases()


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A real JPEG with a few bytes of its header segments (markers, lengths and bodies of
    its SOF, DHT, SOS, DQT, APP0, APP1 and APP14) changed, then cut short anywhere."""
    base = draw(st.sampled_from(_BASES))
    spans = [
        (pos, min(pos + 2 + length, len(base)))
        for marker, pos, length in segments(base)
        if marker in _HEADER_MARKERS
    ]
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        start, end = draw(st.sampled_from(spans))
        value = draw(st.sampled_from([0, 1, 2, 3, 8, 12, 0x11, 0x22, 0xC2, 0xDA, 0xFF]))
        data[draw(st.integers(start, end - 1))] = draw(st.just(value) | st.integers(0, 255))
    header_end = spans[-1][1]
    cut = draw(st.integers(0, header_end + 4) | st.just(len(data)))
    return bytes(data[:cut])


def assert_total(data: bytes) -> None:
    """Every header reader answers `data` with one of its documented answers."""
    for view in (data, memoryview(data)):
        for marker, pos, length in segments(view):
            assert 0 <= marker <= 0xFF and pos >= 2 and pos + 4 <= len(data)
            assert 0 <= length <= 0xFFFF
        frame = hardware_frame(view)
        assert frame is None or (1 <= frame[0] <= 0xFFFF and 1 <= frame[1] <= 0xFFFF)
        placed = gpu_placement(view, _SPEC, _SIDE)
        if placed is not None:
            assert 1 <= placed.height <= _SIDE - 1 and 1 <= placed.width <= _SIDE
            assert len(placed.geometry) == GEOMETRY_WORDS
    cost = jpeg_cost(data)
    if cost is not None:
        assert 0 <= cost.width <= 0xFFFF and 0 <= cost.height <= 0xFFFF
        assert cost.scans >= 1 and cost.coefficient_bytes >= 0
    problem = jpeg_cost_problem(data, 0, 512 * MIB)
    assert problem is None or isinstance(problem, str)


@given(
    st.binary(max_size=300)
    | st.binary(max_size=300).map(lambda tail: b"\xff\xd8\xff" + tail)
    | mutated_headers()
)
@example(sof0_width_zero())
@example(truncated_adobe())
def test_any_header_is_read_without_an_exception(data: bytes) -> None:
    assert_total(data)


def test_every_cut_of_every_kind_of_header_is_read_without_an_exception() -> None:
    for data in [*_BASES, sof0_width_zero(), with_adobe(_saved(photo_like(32, 24, 2)), 1)]:
        header_end = max(pos + 2 + length for _, pos, length in segments(data))
        for cut in range(min(len(data), header_end + 8) + 1):
            assert_total(data[:cut])


def test_what_the_hardware_takes_is_read_from_the_header() -> None:
    image = photo_like(40, 30, 4)
    assert hardware_frame(_saved(image)) == (30, 40)
    assert hardware_frame(_saved(image.convert("L"))) == (30, 40)
    # An Adobe segment: YCbCr samples are the hardware's, RGB (or a transform the file ends
    # before) are not.
    assert hardware_frame(with_adobe(_saved(image), 1)) == (30, 40)
    assert hardware_frame(with_adobe(_saved(image), 0)) is None
    assert hardware_frame(_saved(image.convert("CMYK"))) is None
    assert hardware_frame(truncated_adobe()) is None
    # A frame 0 pixels wide, or of 12-bit samples, is no picture the hardware places.
    assert hardware_frame(sof0_width_zero()) is None
    assert gpu_placement(sof0_width_zero(), _SPEC, _SIDE) is None
    twelve = bytearray(_saved(image))
    pos, _ = _segment(bytes(twelve), 0xC0)
    twelve[pos + 4] = 12
    assert hardware_frame(bytes(twelve)) is None


@pytest.mark.parametrize("hostile", [sof0_width_zero(), truncated_adobe()], ids=["w0", "adobe"])
def test_a_hostile_header_is_the_cpu_decoders_to_refuse(hostile: bytes) -> None:
    """What the routing leaves to the CPU gets the CPU decoder's usual answer."""
    with pytest.raises(DecodeError) as refused:
        cpu.decode_checked(hostile, _SPEC)
    assert refused.value.code == ErrorCode.DECODE_ERROR
