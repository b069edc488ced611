"""The decode stage: formats, modes, orientation, DCT scaling, geometry and every refusal."""

from __future__ import annotations

import io
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from producer.wire import ErrorCode
from tests.support.images import (
    blank_png_bytes,
    encode,
    jpeg_bytes,
    jpeg_cut_short_with_eoi,
    jpeg_with_zeroed_scan,
    photo_like,
    png_bytes,
    png_chunk,
    png_header_only,
    rle_bmp_bytes,
    truncated_jpeg_bytes,
)
from worker.decode.cpu import (
    DecodeError,
    DecodeInfo,
    DecodeSpec,
    decode_into,
    decode_to_array,
    decoded_bytes,
    sniff_format,
)
from worker.decode.rows import decode_row, row_side, write_decoded_row

S = 64
SPEC = DecodeSpec(size=S)

RED = (255, 0, 0)
BLUE = (0, 0, 255)

Pixels = npt.NDArray[np.uint8]


def decode(data: bytes, spec: DecodeSpec = SPEC) -> tuple[Pixels, DecodeInfo]:
    out, info = decode_to_array(data, spec)
    assert out.shape == (spec.size, spec.size, 3)
    assert out.dtype == np.uint8
    return out, info


def decode_error(data: bytes, spec: DecodeSpec = SPEC) -> DecodeError:
    with pytest.raises(DecodeError) as caught:
        decode_to_array(data, spec)
    return caught.value


def mean_colour(pixels: Pixels) -> npt.NDArray[np.float64]:
    means: npt.NDArray[np.float64] = (
        np.asarray(pixels, dtype=np.float64).reshape(-1, 3).mean(axis=0)
    )
    return means


def assert_colour(pixels: Pixels, colour: tuple[int, int, int], tol: float = 2.0) -> None:
    got = mean_colour(pixels)
    assert np.abs(got - np.array(colour)).max() <= tol, f"mean colour {got}, want {colour}"


def halves(width: int = 300, height: int = 200, mode: str = "RGB") -> Image.Image:
    """Left half black, right half white."""
    img = Image.new("RGB", (width, height), (0, 0, 0))
    img.paste((255, 255, 255), (width // 2, 0, width, height))
    return img.convert(mode)


def top_red_bottom_blue(width: int = 120, height: int = 60) -> Image.Image:
    img = Image.new("RGB", (width, height), RED)
    img.paste(BLUE, (0, height // 2, width, height))
    return img


# --- sniffing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff\xd8\xff\xe0rest", "JPEG"),
        (b"\x89PNG\r\n\x1a\nrest", "PNG"),
        (b"GIF87a...", "GIF"),
        (b"GIF89a...", "GIF"),
        (b"RIFF\x10\x00\x00\x00WEBPVP8 ", "WEBP"),
        (b"BM\x00\x00", "BMP"),
        (b"RIFF\x10\x00\x00\x00WAVEfmt ", None),
        (b"\xff\xd8", None),
        (b"GIF90a", None),
        (b"II*\x00", None),  # TIFF: not a format we accept
        (b"", None),
        (b"<svg/>", None),
    ],
)
def test_sniff_format(data: bytes, expected: str | None) -> None:
    assert sniff_format(data) == expected


# --- formats -------------------------------------------------------------------------------

FORMAT_KWARGS: dict[str, dict[str, object]] = {
    "JPEG": {"quality": 95},
    "PNG": {},
    "WEBP": {"lossless": True},
    "BMP": {},
    "GIF": {},
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_KWARGS))
def test_solid_red_in_every_format(fmt: str) -> None:
    data = encode(Image.new("RGB", (90, 70), RED), fmt, **FORMAT_KWARGS[fmt])
    out, info = decode(data)
    assert info == DecodeInfo(format=fmt, width=90, height=70, draft_scale=1)
    assert_colour(out, RED, tol=4.0 if fmt == "JPEG" else 0.0)


@pytest.mark.parametrize("fmt", sorted(FORMAT_KWARGS))
def test_halves_survive_resize_and_crop(fmt: str) -> None:
    # 300x200 -> shorter side 64 -> 96x64 -> centre crop 64x64: the edge between the halves
    # stays in the middle.
    out, _ = decode(encode(halves(), fmt, **FORMAT_KWARGS[fmt]))
    left, right = out[:, : S // 2 - 4], out[:, S // 2 + 4 :]
    assert left.max() <= 12
    assert right.min() >= 243


def reference(img: Image.Image, size: int) -> Pixels:
    """Resize(size) + CenterCrop(size) the long way: whole-image resize, then crop."""
    width, height = img.size
    if width <= height:
        nw, nh = size, int(size * height / width)
    else:
        nw, nh = int(size * width / height), size
    left, top = round((nw - size) / 2), round((nh - size) / 2)
    full = img.convert("RGB").resize((nw, nh), Image.Resampling.BILINEAR)
    return np.asarray(full.crop((left, top, left + size, top + size)))


def test_matches_full_resize_then_crop() -> None:
    """The single boxed resample equals Resize(S) + CenterCrop(S) done the long way."""
    for width, height, size in [(320, 240, 224), (240, 320, 224), (50, 30, 64), (333, 1000, 100)]:
        img = photo_like(width, height, seed=3)
        out, _ = decode(encode(img, "PNG"), DecodeSpec(size=size))
        assert np.abs(out.astype(np.int16) - reference(img, size)).max() <= 1


def test_matches_torchvision_transforms() -> None:
    transforms = pytest.importorskip("torchvision.transforms")
    img = photo_like(300, 200, seed=5)
    out, _ = decode(encode(img, "PNG"), DecodeSpec(size=128))
    pipeline = transforms.Compose([transforms.Resize(128), transforms.CenterCrop(128)])
    ref = np.asarray(pipeline(img))
    assert np.abs(out.astype(np.int16) - ref).max() <= 1


def test_small_image_is_upsampled() -> None:
    out, info = decode(encode(halves(20, 10), "PNG"))
    assert (info.width, info.height) == (20, 10)
    assert out[:, :4].max() <= 12
    assert out[:, -4:].min() >= 243


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_one_pixel_image(fmt: str) -> None:
    out, info = decode(encode(Image.new("RGB", (1, 1), BLUE), fmt))
    assert (info.width, info.height) == (1, 1)
    assert_colour(out, BLUE, tol=8.0)


def test_square_image_at_exact_size_is_copied() -> None:
    img = photo_like(S, S, seed=1)
    out, _ = decode(encode(img, "PNG"))
    assert np.array_equal(out, np.asarray(img))


# --- modes ---------------------------------------------------------------------------------


def palette_red_green() -> Image.Image:
    img = Image.new("P", (40, 30), 0)
    img.putpalette([255, 0, 0, 0, 255, 0] + [0, 0, 0] * 254)
    return img


def test_grey() -> None:
    out, _ = decode(encode(Image.new("L", (40, 30), 128), "PNG"))
    assert_colour(out, (128, 128, 128), tol=0.0)


def test_grey_jpeg() -> None:
    out, _ = decode(encode(Image.new("L", (40, 30), 200), "JPEG"))
    assert_colour(out, (200, 200, 200), tol=2.0)


def test_grey_alpha_drops_alpha() -> None:
    out, _ = decode(encode(Image.new("LA", (40, 30), (100, 0)), "PNG"))
    assert_colour(out, (100, 100, 100), tol=0.0)


def test_rgba_drops_alpha() -> None:
    # Fully transparent red is red: alpha is dropped, not composited onto a background.
    img = Image.new("RGBA", (40, 30), (255, 0, 0, 255))
    img.paste((255, 0, 0, 0), (0, 0, 20, 30))
    out, _ = decode(encode(img, "PNG"))
    assert_colour(out, RED, tol=0.0)


def test_rgba_webp() -> None:
    img = Image.new("RGBA", (40, 30), (0, 0, 255, 128))
    out, info = decode(encode(img, "WEBP", lossless=True, exact=True))
    assert info.format == "WEBP"
    assert_colour(out, BLUE, tol=0.0)


def test_palette() -> None:
    img = palette_red_green()
    img.paste(1, (20, 0, 40, 30))
    out, _ = decode(encode(img, "PNG"))
    assert out[:, :8].reshape(-1, 3).tolist() == [list(RED)] * (S * 8)
    assert out[:, -8:].reshape(-1, 3).tolist() == [[0, 255, 0]] * (S * 8)


@pytest.mark.parametrize("transparency", [0, b"\x00\x80"])
def test_palette_with_transparency(transparency: int | bytes) -> None:
    img = palette_red_green()
    data = encode(img, "PNG", transparency=transparency)
    with Image.open(io.BytesIO(data)) as check:
        assert "transparency" in check.info
    out, _ = decode(data)
    assert_colour(out, RED, tol=0.0)


def test_palette_bmp() -> None:
    out, info = decode(encode(palette_red_green(), "BMP"))
    assert info.format == "BMP"
    assert_colour(out, RED, tol=0.0)


def test_cmyk_jpeg() -> None:
    data = encode(Image.new("CMYK", (40, 30), (0, 255, 255, 0)), "JPEG", quality=95)
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == "CMYK"
    out, _ = decode(data)
    assert_colour(out, RED, tol=4.0)


@pytest.mark.parametrize(("value", "expected"), [(0x8000, 128), (0x4000, 64), (0xFFFF, 255)])
def test_sixteen_bit_grey_png_is_scaled_not_clipped(value: int, expected: int) -> None:
    img = Image.fromarray(np.full((30, 40), value, dtype=np.uint16))
    data = encode(img, "PNG")
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode.startswith("I")
    out, _ = decode(data)
    assert_colour(out, (expected, expected, expected), tol=0.0)


def test_sixteen_bit_gradient_keeps_its_order() -> None:
    ramp = np.tile(np.linspace(0, 0xFFFF, 64, dtype=np.uint16), (64, 1))
    out, _ = decode(encode(Image.fromarray(ramp), "PNG"))
    row = out[S // 2, :, 0].astype(int)
    assert row[0] <= 2
    assert row[-1] >= 253
    assert np.all(np.diff(row) >= 0)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "GIF"])
def test_bilevel(fmt: str) -> None:
    out, _ = decode(encode(halves(mode="1"), fmt))
    assert out[:, : S // 2 - 4].max() == 0
    assert out[:, S // 2 + 4 :].min() == 255


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_image_uses_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (40, 30), colour) for colour in (RED, BLUE, (0, 255, 0))]
    extra: dict[str, object] = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, **extra)
    with Image.open(io.BytesIO(data)) as check:
        assert getattr(check, "n_frames", 1) == 3
    out, info = decode(data)
    assert info.format == fmt
    assert_colour(out, RED, tol=0.0)


# --- EXIF orientation ----------------------------------------------------------------------


def jpeg_with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif)


@pytest.mark.parametrize(
    ("orientation", "red_side"),
    [
        (1, "top"),
        (3, "bottom"),
        (4, "bottom"),
        (6, "right"),  # displayed rotated 90 degrees clockwise: the top goes right
        (8, "left"),  # rotated 90 degrees anticlockwise: the top goes left
        (5, "left"),  # transpose: top row becomes left column
        (7, "right"),
    ],
)
def test_exif_orientation(orientation: int, red_side: str) -> None:
    data = jpeg_with_orientation(top_red_bottom_blue(120, 60), orientation)
    out, info = decode(data)
    swapped = orientation >= 5
    assert (info.width, info.height) == ((60, 120) if swapped else (120, 60))
    regions = {
        "top": out[: S // 2 - 4],
        "bottom": out[S // 2 + 4 :],
        "left": out[:, : S // 2 - 4],
        "right": out[:, S // 2 + 4 :],
    }
    opposite = {"top": "bottom", "bottom": "top", "left": "right", "right": "left"}
    assert_colour(regions[red_side], RED, tol=6.0)
    assert_colour(regions[opposite[red_side]], BLUE, tol=6.0)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_imageops(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(photo_like(90, 50, seed=4), "PNG", exif=exif)
    with Image.open(io.BytesIO(data)) as opened:
        upright = ImageOps.exif_transpose(opened)
    out, info = decode(data, DecodeSpec(size=40))
    assert (info.width, info.height) == upright.size
    assert np.abs(out.astype(np.int16) - reference(upright, 40)).max() <= 1


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_exif_orientation_outside_jpeg(fmt: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    extra: dict[str, object] = {"lossless": True} if fmt == "WEBP" else {}
    out, info = decode(encode(top_red_bottom_blue(), fmt, exif=exif, **extra))
    assert (info.width, info.height) == (60, 120)
    assert_colour(out[:, S // 2 + 4 :], RED, tol=0.0)
    assert_colour(out[:, : S // 2 - 4], BLUE, tol=0.0)


def test_multi_picture_jpeg() -> None:
    # Phone cameras write MPO (several JPEGs in one file); Pillow opens it as its own
    # format, but it is still a JPEG to the wire contract and still DCT-scales.
    first, second = photo_like(1000, 800, seed=1), photo_like(1000, 800, seed=2)
    data = encode(first, "MPO", save_all=True, append_images=[second])
    out, info = decode(data, DecodeSpec(size=224))
    assert info == DecodeInfo(format="JPEG", width=1000, height=800, draft_scale=2)
    ref, _ = decode(encode(first, "JPEG"), DecodeSpec(size=224))
    assert np.abs(out.astype(np.float64) - ref).mean() < 2.0


def test_exif_orientation_with_dct_scaling() -> None:
    # Tall after rotation; the shorter side must still be >= S after the DCT-scaled decode.
    img = top_red_bottom_blue(1200, 600)
    out, info = decode(jpeg_with_orientation(img, 6))
    assert info.draft_scale == 8  # 600 // 64 = 9 -> 1/8
    assert (info.width, info.height) == (600, 1200)
    assert_colour(out[:, S // 2 + 4 :], RED, tol=6.0)
    assert_colour(out[:, : S // 2 - 4], BLUE, tol=6.0)


# Pillow warns about the corrupt block while parsing the header; this suite turns warnings
# into errors, which a worker does not, so the warning is allowed here to see what a worker
# does with such an image.
@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")
def test_broken_exif_is_ignored() -> None:
    data = encode(top_red_bottom_blue(), "JPEG", quality=95, exif=b"Exif\x00\x00MM\x00*garbage")
    out, _ = decode(data)
    assert_colour(out[: S // 2 - 4], RED, tol=6.0)


# --- DCT scaling ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    # Upscaling a small noisy picture is far cheaper than generating 12 M noisy pixels and
    # still gives the 4000x3000 image real texture at the scales the test compares.
    small = photo_like(500, 375, seed=7)
    return encode(small.resize((4000, 3000), Image.Resampling.BICUBIC), "JPEG", quality=90)


def test_dct_scaling_big_jpeg(big_jpeg: bytes) -> None:
    spec = DecodeSpec(size=256)
    scaled, info = decode(big_jpeg, spec)
    assert info == DecodeInfo(format="JPEG", width=4000, height=3000, draft_scale=8)

    full, full_info = decode(big_jpeg, DecodeSpec(size=256, dct_scaling=False))
    assert full_info.draft_scale == 1
    assert (full_info.width, full_info.height) == (4000, 3000)

    diff = np.abs(scaled.astype(np.float64) - full.astype(np.float64)).mean()
    assert diff < 1.5, diff


@pytest.mark.parametrize(
    ("size", "shape", "scale"),
    [
        ((1000, 800), 224, 2),  # 800 // 224 = 3 -> 1/2
        ((1000, 800), 100, 8),  # 800 // 100 = 8
        ((1000, 800), 400, 2),
        ((1000, 800), 401, 1),  # 1/2 would leave 400 < 401
        ((300, 200), 224, 1),  # smaller than S: nothing to gain
    ],
)
def test_dct_scale_keeps_shorter_side(size: tuple[int, int], shape: int, scale: int) -> None:
    data = jpeg_bytes(*size)
    _, info = decode(data, DecodeSpec(size=shape))
    assert info.draft_scale == scale
    assert (info.width, info.height) == size


def test_dct_scaling_only_applies_to_jpeg() -> None:
    _, info = decode(encode(photo_like(1000, 800), "PNG"), DecodeSpec(size=100))
    assert info.draft_scale == 1


# --- refusals ------------------------------------------------------------------------------


def test_error_format() -> None:
    err = DecodeError(ErrorCode.DECODE_ERROR, "image file is truncated")
    assert err.code is ErrorCode.DECODE_ERROR
    assert err.message == "image file is truncated"
    assert str(err) == "decode_error: image file is truncated"
    again = pickle.loads(pickle.dumps(err))
    assert (again.code, again.message, str(again)) == (err.code, err.message, str(err))


def test_empty() -> None:
    assert decode_error(b"").code is ErrorCode.EMPTY_IMAGE


def test_random_bytes_are_unsupported() -> None:
    err = decode_error(np.random.default_rng(0).bytes(1000))
    assert err.code is ErrorCode.UNSUPPORTED_FORMAT
    assert err.message == "not a JPEG, PNG, WebP, BMP or GIF image"


def test_tiff_is_unsupported() -> None:
    err = decode_error(encode(Image.new("RGB", (8, 8)), "TIFF"))
    assert err.code is ErrorCode.UNSUPPORTED_FORMAT


def test_payload_too_large() -> None:
    data = png_bytes(64, 48)
    err = decode_error(data, DecodeSpec(size=S, max_bytes=len(data) - 1))
    assert err.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert str(len(data)) in err.message
    decode(data, DecodeSpec(size=S, max_bytes=len(data)))


def test_truncated_jpeg() -> None:
    err = decode_error(truncated_jpeg_bytes())
    assert err.code is ErrorCode.DECODE_ERROR
    assert "truncated" in err.message


def test_truncated_png() -> None:
    data = png_bytes(64, 48)
    err = decode_error(data[: len(data) // 2])
    assert err.code is ErrorCode.DECODE_ERROR


def idat_offset(data: bytes) -> int:
    offset = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[offset - 4 : offset])
    assert length > 32
    return offset + 4


def test_png_with_bad_idat_crc() -> None:
    data = bytearray(png_bytes(64, 48))
    start = idat_offset(bytes(data))
    data[start + 10] ^= 0xFF
    err = decode_error(bytes(data))
    assert err.code is ErrorCode.DECODE_ERROR


def test_png_with_corrupt_idat_and_valid_crc() -> None:
    # Garbage zlib data behind a correct CRC: the failure comes from the inflater itself.
    data = png_bytes(64, 48)
    start = idat_offset(data)
    (length,) = struct.unpack(">I", data[start - 8 : start - 4])
    garbage = bytes(range(256))[:length]
    rebuilt = data[: start - 8] + png_chunk(b"IDAT", garbage) + data[start + length + 4 :]
    err = decode_error(rebuilt)
    assert err.code is ErrorCode.DECODE_ERROR


def test_png_signature_only() -> None:
    err = decode_error(b"\x89PNG\r\n\x1a\n")
    assert err.code is ErrorCode.DECODE_ERROR


def test_huge_png_header_is_refused_before_decoding() -> None:
    err = decode_error(png_header_only(100_000, 100_000))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE


def test_pixel_limit_names_dimensions_and_limit() -> None:
    # Under Pillow's own bomb limit, so it is our header check that refuses it.
    err = decode_error(png_header_only(5000, 4000), DecodeSpec(size=S, max_pixels=10_000_000))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert "5000x4000" in err.message
    assert "10000000" in err.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("side", [12_000, 15_000, 60_000])
def test_a_too_large_image_quotes_the_workers_limit(fmt: str, side: int) -> None:
    """Under, at twice and past twice GPUFEED_MAX_IMAGE_PIXELS as the worker sets it up
    (Pillow's own bomb check refuses from twice the limit, inside its open, with a text of
    its own): the answer quotes the setting's limit, whichever check refused the image."""
    data = png_header_only(side, side) if fmt == "PNG" else jpeg_with_dimensions(side, side)
    limit = 100_000_000
    before = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = limit  # what allow_large_images leaves at the default
        err = decode_error(data, DecodeSpec(size=S, max_pixels=limit))
    finally:
        Image.MAX_IMAGE_PIXELS = before
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert f"over the limit of {limit} pixels" in err.message
    assert str(side * side) in err.message
    assert str(2 * limit) not in err.message


def test_pixel_limit_is_inclusive() -> None:
    _, info = decode(png_bytes(64, 48), DecodeSpec(size=S, max_pixels=64 * 48))
    assert info.width == 64
    err = decode_error(png_bytes(64, 48), DecodeSpec(size=S, max_pixels=64 * 48 - 1))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE


def jpeg_with_dimensions(width: int, height: int) -> bytes:
    data = bytearray(jpeg_bytes(64, 48))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def test_huge_jpeg_header_is_refused() -> None:
    err = decode_error(jpeg_with_dimensions(65_000, 65_000))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    err = decode_error(jpeg_with_dimensions(6000, 5000), DecodeSpec(size=S, max_pixels=1_000_000))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert "6000x5000" in err.message


@pytest.mark.parametrize(
    "data",
    [png_header_only(0, 10), png_header_only(10, 0), jpeg_with_dimensions(0, 48)],
    ids=["png-zero-width", "png-zero-height", "jpeg-zero-width"],
)
def test_zero_dimension(data: bytes) -> None:
    assert decode_error(data).code is ErrorCode.DECODE_ERROR


def test_header_only_png_within_limits_is_a_decode_error() -> None:
    assert decode_error(png_header_only(100, 100)).code is ErrorCode.DECODE_ERROR


# --- slow decoders and decode memory -------------------------------------------------------


@pytest.fixture
def worker_pixel_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's own bomb limit raised to the worker's default, as the worker does at start-up
    (100 M pixels would warn, and warnings are errors in this suite)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000_000)


@pytest.mark.usefixtures("worker_pixel_limit")
@pytest.mark.parametrize("rle4", [False, True], ids=["rle8", "rle4"])
def test_big_rle_bmp_is_refused_from_its_header(rle4: bool) -> None:
    # 5 KB, under the pixel limit, ~30 s in Pillow's pure-Python RLE decoder: refused at once.
    data = rle_bmp_bytes(100_000, 1000, rle4=rle4)
    assert len(data) < 6000
    err = decode_error(data)
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert "100000x1000" in err.message and "RLE" in err.message


def test_small_rle_bmp_still_decodes() -> None:
    out, info = decode(rle_bmp_bytes(300, 200))
    assert info == DecodeInfo(format="BMP", width=300, height=200, draft_scale=1)
    assert out.max() <= 7  # one pixel of grey 7 a row, the rest black


def test_rle_limit_is_inclusive() -> None:
    data = rle_bmp_bytes(100, 50)
    decode(data, DecodeSpec(size=S, max_slow_decoder_pixels=5000))
    err = decode_error(data, DecodeSpec(size=S, max_slow_decoder_pixels=4999))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE


def test_uncompressed_bmp_has_no_slow_decoder_limit() -> None:
    data = encode(photo_like(100, 50), "BMP")
    _, info = decode(data, DecodeSpec(size=S, max_slow_decoder_pixels=0))
    assert info.format == "BMP"


@pytest.mark.usefixtures("worker_pixel_limit")
def test_huge_rgba_png_is_refused_for_its_decode_memory() -> None:
    # 390 KB of PNG that Pillow would inflate to 400 MB, then copy to RGB: 800 MB.
    data = blank_png_bytes(10_000, 10_000, "RGBA")
    assert len(data) < 400_000
    err = decode_error(data, DecodeSpec(size=S, max_pixels=100_000_000))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert "10000x10000 RGBA" in err.message
    assert "763 MiB" in err.message and "512 MiB" in err.message


@pytest.mark.parametrize(
    ("mode", "per_pixel"), [("L", 1), ("RGB", 4), ("P", 5), ("RGBA", 8), ("I;16", 6)]
)
def test_decoded_bytes_counts_pillow_storage_and_the_rgb_copy(mode: str, per_pixel: int) -> None:
    assert decoded_bytes(mode, 30, 20) == 600 * per_pixel


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P"])
def test_decode_memory_limit_is_inclusive(mode: str) -> None:
    img = photo_like(40, 30).convert(mode)
    data = encode(img, "PNG")
    with Image.open(io.BytesIO(data)) as check:
        need = decoded_bytes(check.mode, 40, 30)
    decode(data, DecodeSpec(size=S, max_decode_bytes=need))
    err = decode_error(data, DecodeSpec(size=S, max_decode_bytes=need - 1))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE


def test_decode_memory_is_counted_at_the_dct_scale(big_jpeg: bytes) -> None:
    # 4000x3000 RGB is 46 MiB at full scale; DCT-scaled to 1/8 (500x375) it is 0.7 MiB.
    limit = 2 * 1024 * 1024
    _, info = decode(big_jpeg, DecodeSpec(size=S, max_decode_bytes=limit))
    assert info.draft_scale == 8
    err = decode_error(big_jpeg, DecodeSpec(size=S, max_decode_bytes=limit, dct_scaling=False))
    assert err.code is ErrorCode.IMAGE_TOO_LARGE
    assert "4000x3000" in err.message


# --- JPEG data that ends before the image ----------------------------------------------------


def cut_short(data: bytes) -> bytes:
    sos = data.index(b"\xff\xda")
    return data[: (sos + len(data)) // 2] + b"\xff\xd9"


@pytest.mark.parametrize(
    "data",
    [
        jpeg_cut_short_with_eoi(),
        jpeg_cut_short_with_eoi(1200, 900),  # DCT-scaled
        jpeg_cut_short_with_eoi(subsampling=0),  # 4:4:4
        cut_short(encode(photo_like(320, 240).convert("L"), "JPEG")),
        cut_short(encode(photo_like(320, 240).convert("CMYK"), "JPEG")),
        jpeg_with_zeroed_scan(),
        jpeg_with_zeroed_scan(1200, 900),
    ],
    ids=["cut", "cut-scaled", "cut-444", "cut-grey", "cut-cmyk", "zeroed", "zeroed-scaled"],
)
def test_jpeg_data_ending_before_the_image_is_a_decode_error(data: bytes) -> None:
    # Pillow decodes each of these without a word, the missing part as flat grey.
    with Image.open(io.BytesIO(data)) as im:
        im.load()
    err = decode_error(data)
    assert err.code is ErrorCode.DECODE_ERROR
    assert "ends before the image does" in err.message
    assert "premature end" in err.message


def test_jpeg_ending_in_grey_is_not_taken_for_damage() -> None:
    # A grey letterbox puts libjpeg's fill colour in the last pixel of a whole image.
    img = Image.new("RGB", (320, 240), (128, 128, 128))
    img.paste(photo_like(320, 160), (0, 0))
    out, _ = decode(encode(img, "JPEG", quality=95))
    assert_colour(out[-4:], (128, 128, 128), tol=1.0)


def test_jpeg_with_a_zero_run_in_its_scan_is_not_taken_for_damage() -> None:
    # A large flat area under optimised Huffman tables encodes to runs of zero bytes.
    img = Image.new("RGB", (2000, 1500), (30, 60, 90))
    img.paste(photo_like(200, 150), (0, 0))
    data = encode(img, "JPEG", optimize=True)
    assert data.find(bytes(64), data.index(b"\xff\xda")) > 0
    out, _ = decode(data)
    assert_colour(out[-8:], (30, 60, 90), tol=3.0)


def test_zero_padding_in_exif_is_not_scan_data() -> None:
    data = encode(photo_like(320, 240), "JPEG", exif=Image.Exif().tobytes() + bytes(200))
    assert data.find(bytes(64)) < data.index(b"\xff\xda")
    _, info = decode(data)
    assert info.width == 320


# --- the output buffer ---------------------------------------------------------------------


def test_decode_into_a_batch_row() -> None:
    batch = np.full((3, S, S, 3), 7, dtype=np.uint8)
    info = decode_into(encode(Image.new("RGB", (50, 50), BLUE), "PNG"), batch[1], SPEC)
    assert info.format == "PNG"
    assert_colour(batch[1], BLUE, tol=0.0)
    assert (batch[0] == 7).all()
    assert (batch[2] == 7).all()


def test_output_untouched_on_error() -> None:
    out = np.full((S, S, 3), 7, dtype=np.uint8)
    with pytest.raises(DecodeError):
        decode_into(truncated_jpeg_bytes(), out, SPEC)
    assert (out == 7).all()


@pytest.mark.parametrize(
    "out",
    [
        np.zeros((S, S, 4), dtype=np.uint8),
        np.zeros((S + 1, S, 3), dtype=np.uint8),
        np.zeros((S, S, 3), dtype=np.float32),
    ],
)
def test_wrong_output_buffer_is_a_caller_error(out: npt.NDArray[np.generic]) -> None:
    with pytest.raises(ValueError, match="out must be"):
        decode_into(png_bytes(), out, SPEC)  # type: ignore[arg-type]


def test_read_only_output_buffer() -> None:
    out = np.zeros((S, S, 3), dtype=np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        decode_into(png_bytes(), out, SPEC)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": 0},
        {"size": 8, "max_bytes": 0},
        {"size": 8, "max_pixels": 0},
        {"size": 8, "max_decode_bytes": 0},
        {"size": 8, "max_slow_decoder_pixels": -1},
    ],
)
def test_spec_validation(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        DecodeSpec(**kwargs)  # type: ignore[arg-type]


def test_concurrent_decodes_match_serial() -> None:
    inputs = [jpeg_bytes(400, 300, seed=i) for i in range(6)] + [
        png_bytes(seed=i) for i in range(6)
    ]
    inputs += [truncated_jpeg_bytes(), b"junk"]

    def run(data: bytes) -> Pixels | str:
        try:
            return decode(data)[0]
        except DecodeError as exc:
            return exc.code.value

    serial = [run(d) for d in inputs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(run, inputs * 3))
    for i, got in enumerate(parallel):
        want = serial[i % len(inputs)]
        if isinstance(want, str):
            assert got == want
        else:
            assert isinstance(got, np.ndarray)
            assert np.array_equal(got, want)


# --- fuzzing -------------------------------------------------------------------------------

FUZZ_SPEC = DecodeSpec(size=32, max_pixels=1_000_000)
SEEDS: list[bytes] = [
    jpeg_bytes(48, 40, quality=80),
    png_bytes(24, 20),
    png_bytes(24, 20, mode="P"),
    encode(photo_like(24, 20), "GIF"),
    encode(photo_like(24, 20), "WEBP", quality=50),
    encode(photo_like(12, 10), "BMP"),
    jpeg_with_orientation(photo_like(40, 30), 6),
    encode(photo_like(40, 30), "JPEG", progressive=True),
    encode(photo_like(24, 20).convert("CMYK"), "JPEG"),
    encode(Image.fromarray(np.full((10, 12), 0x8000, dtype=np.uint16)), "PNG"),
    encode(photo_like(12, 10), "PNG", save_all=True, append_images=[photo_like(12, 10, seed=1)]),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[pos : pos + draw(st.integers(1, 16))]
    return bytes(data)


# Garbage behind a real signature gets past the sniffer and into each format's parser.
MAGICS = [b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF\x00\x01\x00\x00WEBPVP8 ", b"BM"]
behind_magic = st.builds(lambda magic, tail: magic + tail, st.sampled_from(MAGICS), st.binary())


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.one_of(st.binary(max_size=512), behind_magic, mutated()))
def test_fuzz_only_decode_errors(data: bytes) -> None:
    out = np.zeros((32, 32, 3), dtype=np.uint8)
    try:
        info = decode_into(data, out, FUZZ_SPEC)
    except DecodeError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert str(exc).startswith(f"{exc.code.value}: ")
    else:
        assert info.format in {"JPEG", "PNG", "WEBP", "BMP", "GIF"}
        assert info.width >= 1
        assert info.height >= 1
        assert info.draft_scale in {1, 2, 4, 8}


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.one_of(st.binary(max_size=512), behind_magic, mutated()))
def test_fuzz_rows_for_the_device_only_decode_errors(data: bytes) -> None:
    """The device placement's decode: any bytes give a DecodeError or a row whose geometry
    fits it."""
    side = row_side(FUZZ_SPEC.size)
    out = np.zeros((side, side, 3), dtype=np.uint8)
    try:
        row, info = decode_row(data, FUZZ_SPEC, side)
    except DecodeError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        write_decoded_row(out, row)
        h, w, orientation = row.geometry[:3]
        assert 1 <= h <= side - 1 and 1 <= w <= side and 1 <= orientation <= 8
        assert info.width >= 1 and info.height >= 1
