"""Both resize placements give the pixels of torchvision's eval transforms.

The cases, the reference, both placements and the classifier are the bench's
(measure/bench/accuracy.py, whose section of the bench report shows the same figures);
the device placement runs here on the CPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from torch import nn

from measure.bench.accuracy import (
    CROP,
    MEAN,
    SIDE,
    SIZES,
    STAGING,
    STD,
    Measured,
    cases,
    classifier_agreement,
    decode_rows,
    host_placement,
    measure,
    oriented_jpeg,
)
from producer.wire import JobResult
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.decode.cache import DecodeCache
from worker.decode.cpu import DecodeSpec, decode_pixels
from worker.decode.pool import DecodePool
from worker.decode.rows import GEOMETRY_WORDS, decode_row, write_decoded_row
from worker.jobs import Job
from worker.model.resample import RowResampler, choose_placement, use_rows
from worker.model.step import InferenceStep, check_step

S, C, R = STAGING, CROP, SIDE


def device_rows(images: list[bytes]) -> torch.Tensor:
    return decode_rows(images)[0]


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [c.data for c in cases()]


@pytest.fixture(scope="module")
def measured() -> Measured:
    return measure(cases(), torch.device("cpu"))


@pytest.mark.parametrize("placement", ["host", "device"])
def test_pixels_match_torchvision(placement: str, measured: Measured) -> None:
    """In levels of 255, per image: decoded at full size, within 1 everywhere (rounding),
    0.5 on average; decoded at a DCT scale (shorter side >= 2S), 1.5 on average and 10 at
    most: libjpeg's reduced IDCT drops detail finer than the scaled grid."""
    got = measured.placement(placement)
    diff = (got - measured.reference).abs().reshape(len(SIZES), 8, -1)
    for (w, h, _), per_image in zip(SIZES, diff, strict=True):
        scaled = min(w, h) >= 2 * S
        assert per_image.mean(dim=1).max() <= (1.5 if scaled else 0.5), (w, h)
        assert per_image.max() <= (10.0 if scaled else 1.0), (w, h)


def test_the_placements_agree(measured: Measured) -> None:
    """Same decode, same geometry: only Pillow's 8-bit rounding between passes differs."""
    assert (measured.device - measured.host).abs().max() <= 1.0


@pytest.mark.parametrize("placement", ["host", "device"])
def test_classifier_agrees_with_the_reference(placement: str, measured: Measured) -> None:
    """fp32 on the CPU: top-1 agreement >= 99% and embedding cosine >= 0.995."""
    agreement = classifier_agreement(measured.reference, measured.placement(placement))
    assert agreement.top1 >= 0.99
    assert agreement.cosine.min().item() >= 0.995


def test_other_pixels_fail_the_agreement(measured: Measured) -> None:
    """The comparison tells images apart: each image against another size class's."""
    others = torch.roll(measured.host, shifts=8, dims=0)
    agreement = classifier_agreement(measured.reference, others)
    assert agreement.cosine.min().item() < 0.995


def test_rows_carry_their_geometry(images: list[bytes]) -> None:
    rows = device_rows(images[:8]).numpy()
    words = rows[:, 0].reshape(8, -1)[:, : 4 * GEOMETRY_WORDS].copy().view("<i4")
    w, h, _ = SIZES[0]
    assert [tuple(r[:3]) for r in words] == [(h, w, o) for o in range(1, 9)]


def test_a_row_too_long_is_reduced_on_the_host() -> None:
    panorama = oriented_jpeg(600, 90, 1, seed=1)
    row, _ = decode_row(panorama, DecodeSpec(size=S), R)
    assert row.reduced and row.pixels.shape == (S, S, 3)
    native, _ = decode_row(oriented_jpeg(150, 112, 1, seed=1), DecodeSpec(size=S), R)
    assert not native.reduced and native.pixels.shape == (112, 150, 3)


@pytest.mark.parametrize("geometry", ["squash", "letterbox"])
def test_other_geometries_match_the_host(geometry: str) -> None:
    spec = DecodeSpec(size=S, geometry=geometry)
    images = [oriented_jpeg(w, h, 6, seed=2) for w, h in [(150, 90), (90, 150), (40, 30)]]
    rows = np.zeros((len(images), R, R, 3), dtype=np.uint8)
    host = []
    for i, data in enumerate(images):
        row, _ = decode_row(data, spec, R)
        write_decoded_row(rows[i], row)
        host.append(torch.from_numpy(decode_pixels(data, spec)[0].copy()).permute(2, 0, 1))
    with torch.inference_mode():
        got = RowResampler(R, S, S, S)(torch.from_numpy(rows))
    assert (got - torch.stack(host).float()).abs().max() <= 1.5


def test_any_row_bytes_give_finite_pixels() -> None:
    """Garbage geometry (a padded row never written, random bytes) must not give NaN or
    read outside the row: the step's output for such rows is discarded, but it must run."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (6, R, R, 3), dtype=torch.uint8, generator=gen)
    rows[0] = 0
    with torch.inference_mode():
        out = RowResampler(R, S, S, C)(rows)
    assert out.shape == (6, 3, C, C) and torch.isfinite(out).all()
    assert out.min() >= 0 and out.max() <= 255


def test_degraded_step_scales_the_geometry(images: list[bytes]) -> None:
    """A smaller staging size reads the same rows: the same as the host placement at it."""
    small, crop = 40, 32
    with torch.inference_mode():
        got = RowResampler(R, S, small, crop)(device_rows(images[:8]))
    for i, data in enumerate(images[:8]):
        pixels, _ = decode_pixels(data, DecodeSpec(size=small))
        off = round((small - crop) / 2)
        want = torch.from_numpy(pixels[off : off + crop, off : off + crop].copy())
        assert (got[i] - want.permute(2, 0, 1).float()).abs().mean() < 1.5


def test_a_half_precision_step_with_rows_rounds_its_input_once(images: list[bytes]) -> None:
    # The resampled pixels stay fp32 through the normalisation: rounding them to bf16
    # first (8 bits of mantissa, fractional levels above 128) would round twice.
    from tests.model.test_step import Seen

    rows = device_rows(images[:4])
    inputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        seen = Seen()
        step = InferenceStep(
            seen, staging_size=S, crop_size=C, mean=MEAN, std=STD, top_k=3, dtype=dtype
        ).eval()
        use_rows(step, R, S)
        with torch.inference_mode():
            step(rows)
        inputs[dtype] = seen.input
    assert inputs[torch.bfloat16].dtype == torch.bfloat16
    assert torch.equal(inputs[torch.bfloat16], inputs[torch.float32].to(torch.bfloat16))


def test_step_with_rows_runs_and_matches_the_host_step(images: list[bytes]) -> None:
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 5))
    kwargs = {"staging_size": S, "crop_size": C, "mean": MEAN, "std": STD, "top_k": 5}
    host_step = InferenceStep(head, dtype=torch.float32, **kwargs).eval()
    device_step = InferenceStep(head, dtype=torch.float32, **kwargs).eval()
    use_rows(device_step, R, S)
    check_step(device_step, torch.zeros((2, R, R, 3), dtype=torch.uint8), what="rows")
    batch = images[8:16]
    host_in = torch.stack(
        [torch.from_numpy(decode_pixels(d, DecodeSpec(size=S))[0].copy()) for d in batch]
    )
    with torch.inference_mode():
        _, host_scores = host_step(host_in)
        _, device_scores = device_step(device_rows(batch))
    torch.testing.assert_close(device_scores, host_scores, atol=2e-3, rtol=0)


def test_placement_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_placement("auto", cpu, "cpu")[0] == "host"
    assert choose_placement("auto", cuda, "cpu")[0] == "device"
    assert choose_placement("auto", cpu, "cpu", 3)[0] == "host"
    assert choose_placement("device", cpu, "cpu")[0] == "device"
    # GPU decode from threads writes resized rows: resized on the host.
    assert choose_placement("auto", cuda, "gpu")[0] == "host"
    with pytest.raises(ConfigError, match=r"^GPUFEED_TUNING resize=device: with decode threads"):
        choose_placement("device", cuda, "gpu")
    placement, why = choose_placement("device", cuda, "auto")
    assert placement == "device" and "GPUFEED_DECODE=auto decodes on the CPU here" in why
    # From decode processes it writes packed rows at their own size: resized on the device.
    for decode in ("gpu", "auto"):
        assert choose_placement("auto", cuda, decode, 4)[0] == "device"
        assert choose_placement("device", cpu, decode, 4)[0] == "device"
    with pytest.raises(ConfigError, match=r"^GPUFEED_TUNING resize=host: .*packed rows"):
        choose_placement("host", cuda, "gpu", 4)
    assert choose_placement("host", cuda, "auto", 4)[0] == "host"


async def test_pool_writes_rows_and_counts_reductions() -> None:
    spec = DecodeSpec(size=S)
    pool = DecodePool(spec, 2, None, row_side=R)
    try:
        jobs = [
            Job.new("1-0", "native", "r", image=oriented_jpeg(150, 112, 6, seed=3)),
            Job.new("2-0", "panorama", "r", image=oriented_jpeg(600, 90, 1, seed=3)),
        ]
        rows = np.zeros((2, R, R, 3), dtype=np.uint8)
        results = await pool.settle([pool.submit_rows(jobs, rows)])
    finally:
        pool.shutdown()
    assert [r.error for r in results] == [None, None]
    assert results[0].info is not None and (results[0].info.width, results[0].info.height) == (
        112,
        150,
    )
    assert pool.reduced == 1
    with torch.inference_mode():
        got = RowResampler(R, S, S, C)(torch.from_numpy(rows))
    for i, job in enumerate(jobs):
        assert job.image is not None
        assert (got[i] - host_placement(job.image)).abs().max() <= 1.5


@pytest.mark.slow
async def test_worker_serves_with_the_device_placement_on_the_cpu(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """The device placement (the tuning constant resize) is honoured on the CPU too, and
    answers as the host does."""
    images = [oriented_jpeg(200 + 10 * i, 150, 1 + i % 8, seed=i) for i in range(5)]
    scores = {}
    for placement in ("device", "host"):
        stream = f"gpufeed:results:{placement}"
        async with running_worker(redis_url, tiny_weights, batch_size=4, resize=placement):
            for i, data in enumerate(images):
                redis_client.xadd(
                    "gpufeed:jobs", {"id": f"{placement}{i}", "image": data, "reply_to": stream}
                )
            entries = await wait_results(redis_client, stream, len(images))
        results = [JobResult.from_fields(f) for _, f in entries]
        assert all(r.ok for r in results) and len(results) == len(images)
        scores[placement] = {r.id[len(placement) :]: r.details["scores"] for r in results}
        await asyncio.sleep(0)
    for key, got in scores["device"].items():
        np.testing.assert_allclose(got, scores["host"][key], atol=2e-3)


async def test_a_cached_row_is_the_decoded_row() -> None:
    """The decode cache keeps whole rows, geometry line included, for the device placement."""
    pool = DecodePool(DecodeSpec(size=S), 1, None, row_side=R, cache=DecodeCache(64 * R * R * 3))
    data = oriented_jpeg(150, 112, 6, seed=4)
    rows = np.zeros((2, R, R, 3), dtype=np.uint8)
    rows[1] = 7  # stale pixels of an earlier batch
    try:
        first = await pool.settle([pool.submit(Job.new("1-0", "a", "r", image=data), rows[0])])
        again = await pool.settle([pool.submit(Job.new("2-0", "b", "r", image=data), rows[1])])
    finally:
        pool.shutdown()
    assert not first[0].cached and again[0].cached
    np.testing.assert_array_equal(rows[1], rows[0])


async def test_the_degraded_step_reads_the_same_rows(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """With the device placement the degraded step resamples the main step's rows itself."""
    async with running_worker(
        redis_url,
        tiny_weights,
        resize="device",
        batch_size=4,
        degrade_after_s=3600.0,  # the test turns the switch
        degrade_input_size=32,
    ) as worker:
        switch, report = worker.stages.steps.switch, worker.report()
        assert switch is not None and report.ring_side == report.row_side
        switch.on = True
        for i in range(3):
            data = oriented_jpeg(120 + 20 * i, 90, 6, seed=i)
            redis_client.xadd("gpufeed:jobs", {"id": f"d{i}", "image": data})
        entries = await wait_results(redis_client, "gpufeed:results", 3)
    results = [JobResult.from_fields(f) for _, f in entries]
    assert all(r.ok and r.degraded for r in results)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_captured_resampling_matches_the_cpu() -> None:
    rows = device_rows([c.data for c in cases()])
    with torch.inference_mode():
        want = RowResampler(R, S, S, C)(rows)
    resampler = RowResampler(R, S, S, C).cuda()
    compiled = torch.compile(resampler, mode="reduce-overhead", fullgraph=True, dynamic=False)
    on_device = rows.cuda()
    with torch.inference_mode():
        for _ in range(3):  # record, then replay the graph
            got = compiled(on_device)
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode_processes", ["0", "2"])
async def test_on_cuda_the_device_placement_replays_one_graph(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, decode_processes: str
) -> None:
    """Rows (decode threads) and packed rows (decode processes: one copy of the used bytes
    out of registered shared memory) both run in the captured graph."""
    images = [oriented_jpeg(200 + 10 * i, 150, 1 + i % 8, seed=i) for i in range(8)]
    async with running_worker(
        redis_url,
        tiny_weights,
        device="cuda",
        compile="reduce-overhead",
        batch_size=4,
        decode_processes=decode_processes,
    ) as worker:
        report = worker.report()
        assert report.placement == "device"
        assert report.plan.packed == (decode_processes == "2")
        compiled = report.compile_report
        assert compiled.compiled and compiled.cudagraph_replays > 0
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"g{i}", "image": data})
        entries = await wait_results(redis_client, "gpufeed:results", len(images))
        assert worker.observer.compile_check() == []
    assert all(JobResult.from_fields(f).ok for _, f in entries)
