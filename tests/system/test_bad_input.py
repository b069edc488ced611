"""The bad-input matrix through a running worker, and random input against job parsing.

Each case gets its one documented error code (or a correct ok result), and none of them
affects the others: they all travel in the same few batches. The worker runs in a small
host's shape and in a GPU host's (the `host_shape` fixture).
"""

from __future__ import annotations

import io
import os
import random
from collections import Counter
from pathlib import Path

import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from producer.wire import MAX_ID_BYTES, JobResult
from tests.support.images import (
    blank_png_bytes,
    encode,
    jpeg_bytes,
    jpeg_cut_short_with_eoi,
    jpeg_with_zeroed_scan,
    photo_like,
    png_bytes,
    png_header_only,
    rle_bmp_bytes,
)
from tests.support.worker_harness import HostShape, running_worker, wait_results
from worker.jobs import parse_job


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    return encode(photo_like(200, 100), "JPEG", exif=exif.tobytes())


def animated_gif() -> bytes:
    frames = [Image.new("P", (40, 30), i * 40) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    return buf.getvalue()


def corrupt_png() -> bytes:
    data = bytearray(png_bytes(64, 48))
    idat = data.find(b"IDAT")
    for i in range(idat + 8, idat + 40):
        data[i] ^= 0x5A
    return bytes(data)


def cmyk_jpeg() -> bytes:
    return encode(photo_like(80, 60).convert("CMYK"), "JPEG")


def sixteen_bit_png() -> bytes:
    img = Image.new("I;16", (50, 40))
    img.putdata([30000] * (50 * 40))
    return encode(img, "PNG")


async def test_the_bad_input_matrix(
    redis_url: str,
    redis_client: redis.Redis,
    tiny_weights: Path,
    tmp_path: Path,
    host_shape: HostShape,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.jpg").write_bytes(jpeg_bytes(seed=4))
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(jpeg_bytes(seed=5))
    os.symlink(outside, root / "link.jpg")
    big = os.urandom(300_000)

    cases: dict[str, tuple[dict[str, bytes], str | None]] = {
        "empty": ({"image": b""}, "empty_image"),
        "text": ({"image": b"just some words"}, "unsupported_format"),
        "truncated-jpeg": ({"image": jpeg_bytes()[:2000]}, "decode_error"),
        "corrupt-png": ({"image": corrupt_png()}, "decode_error"),
        "zero-sized": ({"image": png_header_only(0, 0)}, "decode_error"),
        "one-pixel": ({"image": png_bytes(1, 1)}, None),
        "bomb-header": ({"image": png_header_only(100_000, 100_000)}, "image_too_large"),
        # 5 KB, 30 s of Pillow's pure-Python RLE decoder: refused from the header.
        "slow-rle-bmp": ({"image": rle_bmp_bytes(100_000, 1000)}, "image_too_large"),
        # 35 KB of PNG that would take 69 MiB to decode, over the worker's 64 MiB.
        "decode-memory": ({"image": blank_png_bytes(3000, 3000, "RGBA")}, "image_too_large"),
        "jpeg-cut-with-eoi": ({"image": jpeg_cut_short_with_eoi()}, "decode_error"),
        "jpeg-zeroed-scan": ({"image": jpeg_with_zeroed_scan()}, "decode_error"),
        "over-byte-limit": ({"image": b"\xff\xd8\xff" + big}, "payload_too_large"),
        "grey": ({"image": png_bytes(40, 30, mode="L")}, None),
        "rgba": ({"image": png_bytes(40, 30, mode="RGBA")}, None),
        "palette": ({"image": png_bytes(40, 30, mode="P")}, None),
        "cmyk": ({"image": cmyk_jpeg()}, None),
        "16-bit": ({"image": sixteen_bit_png()}, None),
        "animated": ({"image": animated_gif()}, None),
        "exif-rotated": ({"image": exif_rotated_jpeg()}, None),
        "path-ok": ({"path": b"ok.jpg"}, None),
        "path-dotdot": ({"path": b"../outside.jpg"}, "forbidden_path"),
        "path-symlink": ({"path": b"link.jpg"}, "forbidden_path"),
        "path-absolute-outside": ({"path": str(outside).encode()}, "forbidden_path"),
        "both": ({"image": jpeg_bytes(), "path": b"ok.jpg"}, "invalid_job"),
        "neither": ({"note": b"hello"}, "invalid_job"),
    }
    long_id = "x" * (MAX_ID_BYTES + 1)
    async with running_worker(
        redis_url,
        tiny_weights,
        shape=host_shape,
        path_root=root,
        max_image_bytes=200_000,
        max_decode_mb=64,
        batch_size=4,
    ):
        for job_id, (fields, _) in cases.items():
            redis_client.xadd("gpufeed:jobs", {"id": job_id, **fields})
        long_entry = redis_client.xadd("gpufeed:jobs", {"id": long_id, "image": jpeg_bytes()})
        entries = await wait_results(redis_client, "gpufeed:results", len(cases) + 1)

    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(entries) == len(cases) + 1
    got = {job_id: results[job_id].error_code for job_id in cases}
    assert got == {job_id: code for job_id, (_, code) in cases.items()}
    assert results["exif-rotated"].details["width"] == 100  # oriented: 100 wide, 200 high
    assert results["exif-rotated"].details["height"] == 200
    # An id over the limit cannot be used as a key: the answer is under the entry ID.
    too_long = results[long_entry.decode()]
    assert too_long.error_code == "id_too_long"
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_random_and_mutated_payloads_always_get_one_result(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, host_shape: HostShape
) -> None:
    rng = random.Random(1234)
    seeds = [jpeg_bytes(120, 90, seed=1), png_bytes(60, 40, seed=2), animated_gif()]
    payloads: list[bytes] = []
    for i in range(120):
        if i % 3 == 0:
            payloads.append(rng.randbytes(rng.randint(0, 3000)))
            continue
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 12)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.4:
            data = data[: rng.randint(1, len(data))]
        payloads.append(bytes(data))
    async with running_worker(redis_url, tiny_weights, shape=host_shape, batch_size=8):
        pipe = redis_client.pipeline(transaction=False)
        for i, data in enumerate(payloads):
            pipe.xadd("gpufeed:jobs", {"id": f"fuzz-{i}", "image": data})
        pipe.execute()
        entries = await wait_results(redis_client, "gpufeed:results", len(payloads))
    counts = Counter(f[b"id"] for _, f in entries)
    assert len(counts) == len(payloads) and set(counts.values()) == {1}
    documented = {None, "empty_image", "unsupported_format", "decode_error", "image_too_large"}
    codes = {JobResult.from_fields(f).error_code for _, f in entries}
    assert codes <= documented


field_names = st.sampled_from([b"image", b"path", b"id", b"reply_to", b"meta", b"x", b""])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names, st.binary(max_size=300), max_size=6))
def test_job_parsing_never_raises(fields: dict[bytes, bytes]) -> None:
    job = parse_job("1-0", fields, "gpufeed:results")
    assert job.entry_id == "1-0"
    assert job.reply_to
    # Either runnable (exactly one source) or rejected with a documented code.
    if job.rejected is None:
        assert (job.image is None) != (job.path is None)
        assert len(job.job_id.encode()) <= MAX_ID_BYTES
    else:
        assert job.rejected[0].value in {
            "invalid_job",
            "id_too_long",
            "empty_image",
        }
