"""GPU JPEG decode: routing, orientation, geometry and the fallback on the CPU; the real
GPU decoders under @pytest.mark.cuda (skipped without CUDA).

The decoder classes are device-agnostic, so the CPU tests drive the torchvision backend on
the CPU: the same code path as on the GPU, minus the stream.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from producer.wire import ErrorCode
from tests.support.images import encode, jpeg_bytes, photo_like, png_bytes
from worker.base.device import make_context
from worker.decode.codecs import GpuEnginesUnavailable
from worker.decode.cpu import DecodeError, DecodeSpec, decode_to_array
from worker.decode.gpu import (
    FIT_CHUNK_PIXELS,
    GpuDecoder,
    GpuDecodeRouter,
    fit_into,
    fit_many_into,
    make_backend,
    orient,
    same_size_groups,
    setup_gpu_decode,
    size_class,
)
from worker.decode.nvimgcodec import NvImgCodec
from worker.decode.pool import DecodePool
from worker.decode.torchvision_jpeg import TorchvisionJpeg
from worker.jobs import Job
from worker.pipeline.batcher import Batch
from worker.pipeline.gpu_decode import GpuDecodeStage
from worker.pipeline.launch import ModelRunner
from worker.pipeline.staging import InputRing, OutputRing
from worker.pipeline.transfer import DeviceTransfer

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ALL_GPU = GpuDecodeRouter({"small": True, "medium": True, "large": True})
SPEC = DecodeSpec(size=64, dct_scaling=False)


def jpeg_with_orientation(orientation: int, w: int = 90, h: int = 60) -> bytes:
    img = photo_like(w, h, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())


def jpeg_turned_only_by_its_second_exif(width: int = 150, height: int = 112) -> bytes:
    """A JPEG with two EXIF segments: the first without an orientation (which is what
    gpufeed and Pillow read), the second with orientation 6 (which nvImageCodec reads, as it
    reads every EXIF segment until it finds one)."""

    def app1(exif: Image.Exif) -> bytes:
        payload = exif.tobytes()  # b"Exif\0\0" and the TIFF data
        return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload

    plain, turned = Image.Exif(), Image.Exif()
    plain[0x010F] = "gpufeed"  # Make
    turned[0x0112] = 6
    data = jpeg_bytes(width, height, seed=3)
    return data[:2] + app1(plain) + app1(turned) + data[2:]


def make_job(i: int, data: bytes) -> Job:
    return Job.new(
        entry_id=f"0-{i}", job_id=f"j{i}", reply_to="r", meta=None, image=data, path=None
    )


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pillow(orientation: int) -> None:
    arr = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    table = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }
    im = Image.fromarray(arr)
    want = np.asarray(im.transpose(table[orientation]) if orientation in table else im)
    got = orient(torch.from_numpy(arr).permute(2, 0, 1), orientation).permute(1, 2, 0)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize(("w", "h"), [(200, 150), (150, 200), (64, 64), (64, 300), (90, 61)])
def test_fit_into_matches_the_cpu_decoder(w: int, h: int) -> None:
    data = jpeg_bytes(w, h, seed=w + h, quality=95)
    want, _ = decode_to_array(data, SPEC)
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    out = torch.empty((64, 64, 3), dtype=torch.uint8)
    fit_into(torch.from_numpy(full.copy()).permute(2, 0, 1), out)
    diff = np.abs(out.numpy().astype(int) - want.astype(int))
    # Same geometry; the two resamplers round differently by a level or two.
    assert diff.mean() < 1.0 and diff.max() <= 8


def test_size_classes() -> None:
    assert size_class(640, 480) == "small"
    assert size_class(1920, 1080) == "medium"
    assert size_class(6000, 4000) == "large"


def test_router_sends_only_jpegs_of_chosen_classes() -> None:
    small_only = GpuDecodeRouter({"small": True, "medium": False, "large": False})
    assert small_only.route(png_bytes(64, 48), SPEC) is None
    assert small_only.route(b"\xff\xd8\xff garbage", SPEC) is None  # header unreadable: CPU
    row = small_only.route(jpeg_bytes(120, 80), SPEC)
    assert row is not None and (row.info.width, row.info.height) == (120, 80)
    assert small_only.route(jpeg_bytes(1400, 1000), SPEC) is None  # medium: CPU
    assert GpuDecodeRouter({"small": False}).route(jpeg_bytes(120, 80), SPEC) is None
    cmyk = encode(photo_like(80, 60).convert("CMYK"), "JPEG")
    assert ALL_GPU.route(cmyk, SPEC) is None  # Adobe CMYK: Pillow's conversion, on the CPU


def test_router_applies_limits_and_reports_upright_size() -> None:
    with pytest.raises(DecodeError) as info:
        ALL_GPU.route(jpeg_bytes(200, 100), DecodeSpec(size=64, max_pixels=10_000))
    assert info.value.code == ErrorCode.IMAGE_TOO_LARGE
    with pytest.raises(DecodeError) as info:
        ALL_GPU.route(jpeg_bytes(200, 100), DecodeSpec(size=64, max_bytes=100))
    assert info.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    row = ALL_GPU.route(jpeg_with_orientation(6), SPEC)
    assert row is not None and row.orientation == 6
    assert (row.info.width, row.info.height) == (60, 90)


def test_decoder_on_cpu_writes_rows_and_isolates_a_bad_image() -> None:
    decoder = GpuDecoder(torch.device("cpu"), TorchvisionJpeg(torch.device("cpu")))
    try:
        images = [jpeg_bytes(100, 80, seed=1), jpeg_with_orientation(8), jpeg_bytes(80, 100)]
        rows = []
        for i, data in enumerate(images):
            r = ALL_GPU.route(data, SPEC)
            assert r is not None
            rows.append((i * 2, r))
        # A JPEG whose header parses but whose data is cut: nvJPEG/libjpeg fail on it.
        cut = jpeg_bytes(100, 80, seed=9)[:300]
        bad = ALL_GPU.route(cut, SPEC)
        if bad is not None:
            rows.append((1, bad))
        dest = torch.zeros((6, 64, 64, 3), dtype=torch.uint8)
        result = decoder.decode_rows_sync(rows, dest)
        assert result.ready is not None and result.ready.query()
        if bad is not None:
            assert 1 in result.failed
        for (row, _), data in zip(rows[:3], images, strict=True):
            want, _ = decode_to_array(data, SPEC)
            diff = np.abs(dest[row].numpy().astype(int) - want.astype(int))
            assert diff.mean() < 1.5, row
            assert row in result.decode_ms
        assert int(dest[3].sum()) == 0 and int(dest[5].sum()) == 0  # untouched rows
    finally:
        decoder.shutdown()


def test_a_row_the_decoder_turns_otherwise_than_the_header_goes_to_the_cpu() -> None:
    """nvImageCodec (its CPU-only backend here, the same library) reads an EXIF orientation
    the router does not: the row it decoded at the other shape is handed to the CPU
    decoder, counted; the rows around it are written as the CPU would write them."""
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")
    cpu = torch.device("cpu")
    decoder = GpuDecoder(cpu, NvImgCodec(None))
    images = [jpeg_bytes(100, 80, seed=1), jpeg_turned_only_by_its_second_exif()]
    images.append(jpeg_with_orientation(8))
    try:
        rows = [(i, r) for i, d in enumerate(images) if (r := ALL_GPU.route(d, SPEC)) is not None]
        assert len(rows) == 3 and (rows[1][1].info.width, rows[1][1].info.height) == (150, 112)
        dest = torch.zeros((3, 64, 64, 3), dtype=torch.uint8)
        result = decoder.decode_rows_sync(rows, dest)
    finally:
        decoder.shutdown()
    assert result.failed == [1]
    assert decoder.wrong_shape == 1
    assert sorted(result.decode_ms) == [0, 2]
    for row in (0, 2):
        want, _ = decode_to_array(images[row], SPEC)
        assert np.abs(dest[row].numpy().astype(int) - want.astype(int)).mean() < 1.5, row
    assert int(dest[1].sum()) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU backend answers here")
def test_without_a_gpu_backend_that_answers_nvimgcodec_refuses_to_decode() -> None:
    """nvImageCodec installed but none of its GPU backends decoding (here: no CUDA; on a GPU
    host: libnvjpeg missing) is said, never a decoder that silently runs on the CPU."""
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")
    with pytest.raises(GpuEnginesUnavailable, match="none of its GPU backends"):
        make_backend(torch.device("cuda", 0), "nvimgcodec")


def test_same_size_images_are_resized_together_exactly_as_one_by_one() -> None:
    """A batch of decoded images is resized per size group in a few ops (what bounds the
    GPU decode of many small images is the dispatches, six or seven per image one by one):
    the rows are the same, bit for bit, as resized one at a time, whatever the rows' order,
    sizes or chunking."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 80, 100), (3, 80, 100), (3, 100, 80), (3, 80, 100), (3, 64, 64), (3, 100, 80)]
    images = [torch.randint(0, 256, s, generator=gen, dtype=torch.uint8) for s in shapes]
    rows = [0, 1, 5, 2, 3, 7]  # a run of rows and scattered ones
    want = torch.zeros((8, 32, 32, 3), dtype=torch.uint8)
    for row, img in zip(rows, images, strict=True):
        fit_into(img, want[row])
    for max_pixels in (FIT_CHUNK_PIXELS, 80 * 100 * 2):  # one chunk per size; pairs
        groups = same_size_groups(list(zip(rows, images, strict=True)), max_pixels)
        assert sorted(r for g in groups for r, _ in g) == sorted(rows)
        assert all(len({tuple(img.shape) for _, img in g}) == 1 for g in groups)
        got = torch.zeros_like(want)
        for group in groups:
            fit_many_into([img for _, img in group], got, [row for row, _ in group])
        assert torch.equal(got, want)
    assert [len(g) for g in same_size_groups(list(zip(rows, images, strict=True)), 16000)] == [
        2, 1, 2, 1
    ]  # fmt: skip


async def test_decode_pool_defers_routed_jpegs_and_leaves_the_row_alone() -> None:
    pool = DecodePool(SPEC, 2, None, gpu_router=ALL_GPU)
    try:
        row = np.full((64, 64, 3), 7, dtype=np.uint8)
        deferred = await pool.submit(make_job(0, jpeg_bytes(100, 80)), row)
        assert deferred.gpu is not None and deferred.error is None and int(row.min()) == 7
        png = await pool.submit(make_job(1, png_bytes(64, 48)), row)
        assert png.gpu is None and png.error is None and not np.all(row == 7)
        forced = await pool.decode_on_cpu(make_job(2, jpeg_bytes(100, 80)), row)
        assert forced.gpu is None and forced.info is not None
    finally:
        pool.shutdown()


async def test_runner_on_cpu_decodes_deferred_rows_with_the_cpu_fallback() -> None:
    """Without a GPU decoder the deferred rows still get decoded, into their pinned row."""
    from tests.model.test_step import tiny_step

    step = tiny_step()
    spec = DecodeSpec(size=20, dct_scaling=False)
    pool = DecodePool(spec, 2, None, gpu_router=ALL_GPU)
    ctx = make_context(torch.device("cpu"))
    ring = InputRing(1, 4, 20, pin=False)
    out_ring = OutputRing(1, 4, 3, pin=False)
    transfer = DeviceTransfer(ctx, 1, 4, 20)
    runner = ModelRunner(ctx, step, transfer, cudagraphs=False)
    stage = GpuDecodeStage(transfer)
    stage.use_rows(None, pool.decode_on_cpu)  # type: ignore[arg-type]
    try:
        images = [jpeg_bytes(60 + 10 * i, 50, seed=i) for i in range(3)]
        slot = await ring.acquire()
        jobs = [make_job(i, d) for i, d in enumerate(images)]
        futures = [pool.submit(j, slot.array[i]) for i, j in enumerate(jobs)]
        batch = Batch(seq=1, slot=slot, jobs=jobs, futures=futures, opened_s=0.0)
        results = await batch.decoded()
        assert all(r.gpu is not None for r in results)
        launched = await runner.launch(
            batch, await out_ring.acquire(), rows=await stage.rows(batch)
        )
        assert all(r.gpu is None and r.error is None for r in batch.results)
        for i, data in enumerate(images):
            want, _ = decode_to_array(data, spec)
            assert np.array_equal(slot.array[i], want)
        with torch.inference_mode():
            ref_idx, _ = step(torch.from_numpy(np.stack([slot.array[i] for i in range(4)])))
        assert np.array_equal(launched.out.indices_np, ref_idx.numpy())
    finally:
        runner.shutdown()
        stage.shutdown()
        pool.shutdown()


def test_setup_is_off_for_cpu_mode_and_cpu_devices() -> None:
    assert setup_gpu_decode("cpu", torch.device("cpu"), SPEC, 2) is None
    assert setup_gpu_decode("auto", torch.device("cpu"), SPEC, 2) is None
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        setup_gpu_decode("gpu", torch.device("cpu"), SPEC, 2)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("backend", ["auto", "torchvision"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_matches_cpu_decode(backend: str) -> None:
    device = torch.device("cuda", 0)
    decoder = GpuDecoder(device, make_backend(device, backend))
    try:
        images = [jpeg_bytes(640, 480, seed=i) for i in range(6)]
        images += [jpeg_with_orientation(o, 300, 200) for o in (3, 6, 8)]
        images.append(encode(photo_like(320, 240).convert("L"), "JPEG"))
        rows = [(i, r) for i, d in enumerate(images) if (r := ALL_GPU.route(d, SPEC)) is not None]
        assert len(rows) == len(images)
        dest = torch.zeros((len(images), 64, 64, 3), dtype=torch.uint8, device=device)
        # The zero-fill (this stream) before the decoder's writes (its own stream).
        filled = torch.cuda.Event()  # type: ignore[no-untyped-call]
        filled.record(torch.cuda.current_stream(device))
        result = decoder.decode_rows_sync(rows, dest, after=filled)
        assert result.failed == []
        assert result.ready is not None
        torch.cuda.current_stream().wait_event(result.ready)  # type: ignore[arg-type]
        got = dest.cpu().numpy()
        for i, data in enumerate(images):
            want, _ = decode_to_array(data, SPEC)
            diff = np.abs(got[i].astype(int) - want.astype(int))
            # nvJPEG upsamples chroma differently from libjpeg: a few levels on average.
            assert diff.mean() < 4.0, (decoder.backend.name, i, diff.mean())
    finally:
        decoder.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_bad_image_fails_alone() -> None:
    device = torch.device("cuda", 0)
    decoder = GpuDecoder(device)
    try:
        good = ALL_GPU.route(jpeg_bytes(320, 240), SPEC)
        data = bytearray(jpeg_bytes(320, 240, seed=5))
        data[len(data) // 2 : len(data) // 2 + 400] = b"\x00" * 400  # corrupt entropy data
        data = data[: len(data) * 3 // 4]
        bad = ALL_GPU.route(bytes(data), SPEC)
        assert good is not None
        rows = [(0, good)] + ([(1, bad)] if bad is not None else [])
        dest = torch.zeros((2, 64, 64, 3), dtype=torch.uint8, device=device)
        filled = torch.cuda.Event()  # type: ignore[no-untyped-call]
        filled.record(torch.cuda.current_stream(device))
        result = decoder.decode_rows_sync(rows, dest, after=filled)
        assert 0 not in result.failed
    finally:
        decoder.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchvision_outputs_survive_a_decode_stream_held_back_by_compute() -> None:
    """Each call's decode stream waits on ~10 ms of 'compute' before the resize reads
    torchvision's outputs, while the next call already decodes: outputs and the resize's
    temporaries must never share memory across calls (wrong pixels, no error)."""
    device = torch.device("cuda", 0)
    decoder = GpuDecoder(device, make_backend(device, "torchvision"))
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    try:
        calls = [[jpeg_bytes(320, 240, seed=10 * c + i) for i in range(4)] for c in range(8)]
        dests = [torch.zeros((4, 64, 64, 3), dtype=torch.uint8, device=device) for _ in calls]
        # The zero-fills (this stream) come before any 'compute', hence before each decode.
        compute.wait_stream(torch.cuda.current_stream(device))
        for images, dest in zip(calls, dests, strict=True):
            with torch.cuda.stream(compute):
                torch.cuda._sleep(20_000_000)
            held = torch.cuda.Event()  # type: ignore[no-untyped-call]
            held.record(compute)
            rows = [(i, r) for i, d in enumerate(images) if (r := ALL_GPU.route(d, SPEC))]
            assert decoder.decode_rows_sync(rows, dest, after=held).failed == []
        torch.cuda.synchronize()
        for images, dest in zip(calls, dests, strict=True):
            got = dest.cpu().numpy()
            for i, data in enumerate(images):
                want, _ = decode_to_array(data, SPEC)
                diff = np.abs(got[i].astype(int) - want.astype(int))
                assert diff.mean() < 4.0, (i, diff.mean())
    finally:
        decoder.shutdown()


class HalfwayOnCuda:
    """The real decoder for the first image, then one the resize cannot take: the GPU
    decode fails after queuing work that writes a row of the twin."""

    name = "halfway"
    applies_exif = False

    def __init__(self, device: torch.device) -> None:
        self.real = make_backend(device, "torchvision")
        self.device = device

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        first = self.real.decode(datas[:1], stream)
        empty = torch.zeros((3, 0, 5), dtype=torch.uint8, device=self.device)
        return first + [empty] * (len(datas) - 1)


@pytest.mark.parametrize("gpu_decoder", ["working", "raising halfway"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_gpu_rows_and_copied_rows_meet_in_the_twin(gpu_decoder: str) -> None:
    """A batch mixing GPU-decoded JPEG rows and CPU-decoded PNG rows gives each row the
    same answer as an all-CPU decode of the same images; so does one whose GPU decoder
    raised part-way (its rows then decoded on the CPU)."""
    from tests.model.test_step import tiny_step

    device = torch.device("cuda", 0)
    ctx = make_context(device)
    spec = DecodeSpec(size=20, dct_scaling=False)
    step = tiny_step().to(device)
    pool = DecodePool(spec, 2, None, gpu_router=ALL_GPU)
    decoder = (
        GpuDecoder(device)
        if gpu_decoder == "working"
        else GpuDecoder(device, HalfwayOnCuda(device))
    )
    ring = InputRing(2, 6, 20, pin=True)
    out_ring = OutputRing(2, 6, 3, pin=True)
    transfer = DeviceTransfer(ctx, 2, 6, 20)
    runner = ModelRunner(ctx, step, transfer, cudagraphs=False)
    stage = GpuDecodeStage(transfer)
    stage.use_rows(decoder, pool.decode_on_cpu)
    try:
        images = [
            jpeg_bytes(80, 60, seed=1),
            png_bytes(50, 40, seed=2),
            jpeg_bytes(60, 90, seed=3),
            png_bytes(40, 40, seed=4),
            jpeg_bytes(70, 70, seed=5),
        ]
        slot = await ring.acquire()
        jobs = [make_job(i, d) for i, d in enumerate(images)]
        futures = [pool.submit(j, slot.array[i]) for i, j in enumerate(jobs)]
        batch = Batch(seq=1, slot=slot, jobs=jobs, futures=futures, opened_s=0.0)
        results = await batch.decoded()
        assert [r.gpu is not None for r in results] == [True, False, True, False, True]
        launched = await runner.launch(
            batch, await out_ring.acquire(), rows=await stage.rows(batch)
        )
        launched.done.synchronize()  # type: ignore[attr-defined]  # a test may wait
        # Reference: all rows decoded on the CPU, eager step on the device.
        ref = np.zeros((6, 20, 20, 3), dtype=np.uint8)
        for i, data in enumerate(images):
            ref[i], _ = decode_to_array(data, spec)
        with torch.inference_mode():
            _, ref_scores = step(torch.from_numpy(ref).to(device))
        got = torch.from_numpy(launched.out.scores_np[:5].copy())
        torch.testing.assert_close(got, ref_scores[:5].cpu(), atol=0.02, rtol=0.05)
    finally:
        runner.shutdown()
        stage.shutdown()
        pool.shutdown()
