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
from tests.images import photo_like
from worker.decode import cpu
from worker.decode.cpu import DecodeError, DecodeSpec, decode_frame
from worker.decode.jpeg_header import MAX_SCANS, jpeg_cost

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
