"""GPU decode into packed rows, end to end: a worker whose decode processes leave their
share of each batch to the GPU decoder (here nvImageCodec's CPU-only backend, the real
library without a GPU) answers every job as a worker that decodes everything on the CPU.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from PIL import Image

from measure.bench.accuracy import oriented_jpeg
from producer.wire import JobResult
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.worker_harness import process_pool, serving, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.decode.codecs import IntoCodec
from worker.decode.gpu_packed import PackedGpuDecoder
from worker.decode.nvimgcodec import NvImgCodec
from worker.lifecycle.service import Worker

pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")


class CpuOnlyGpuDecode(Worker):
    """A worker whose GPU JPEG decoder is nvImageCodec's CPU-only backend."""

    def gpu_backend(self) -> Callable[[], IntoCodec] | None:
        return lambda: NvImgCodec(None)


def _saved(data: bytes, mode: str, **options: object) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert(mode).save(buf, "JPEG", **options)
    return buf.getvalue()


def _images() -> tuple[list[bytes], int]:
    """Jobs of every kind, and how many of them the GPU's hardware takes as they are."""
    baseline = [oriented_jpeg(200, 150, o, seed=o) for o in range(1, 9)]
    baseline += [
        jpeg_bytes(96, 72, seed=1),
        _saved(jpeg_bytes(120, 90, seed=2), "L"),
        _saved(jpeg_bytes(100, 100, seed=3), "RGB", subsampling=0),
    ]
    truncated = jpeg_bytes(150, 100, seed=4)
    baseline.append(truncated[: len(truncated) // 2])  # taken, failed, answered by the CPU
    others = [
        _saved(jpeg_bytes(96, 72, seed=5), "RGB", progressive=True),
        _saved(jpeg_bytes(96, 72, seed=6), "CMYK"),
        jpeg_bytes(640, 480, seed=7),  # larger than a row
        png_bytes(64, 48),
        b"not an image",
    ]
    return baseline + others, len(baseline)


def _config(redis_url: str, weights: Path, **settings: str) -> WorkerConfig:
    """Two decode processes, packed rows (the device placement), the decode cache off."""
    return tiny_config(
        redis_url,
        weights,
        decode_processes="2",
        decode_threads=0,
        resize="device",
        decode_cache_mb=0,
        **settings,
    )


async def _answers(
    redis_url: str,
    client: redis.Redis,
    weights: Path,
    images: list[bytes],
    *,
    files: Path | None = None,
    worker_class: type[Worker] = CpuOnlyGpuDecode,
    **settings: str,
) -> tuple[list[tuple[str, str, object]], Worker]:
    """Every image answered: in its job, or (`files`) as a file there its job names."""
    client.delete("gpufeed:jobs", "gpufeed:results")
    if files is not None:
        settings["path_root"] = str(files)
        for i, data in enumerate(images):
            (files / f"img{i}.jpg").write_bytes(data)
    worker = worker_class(_config(redis_url, weights, **settings))
    async with serving(worker):
        for i, data in enumerate(images):
            job = {"path": f"img{i}.jpg"} if files is not None else {"image": data}
            client.xadd("gpufeed:jobs", {"id": f"img{i}", **job})
        results = await wait_results(client, "gpufeed:results", len(images))
    parsed = [JobResult.from_fields(fields) for _, fields in results]
    return sorted(
        (r.id, r.status, r.error if r.error else (r.top1, r.score or 0.0, r.details.get("scores")))
        for r in parsed
    ), worker


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["image", "path"])
async def test_the_gpu_decodes_its_share_and_every_job_is_answered_as_on_the_cpu(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path, jobs: str
) -> None:
    """`path` jobs too: the decode processes read the files and stage the bytes of those
    the GPU takes in the slot, where the GPU decoder reads them."""
    images, taken = _images()
    files = tmp_path if jobs == "path" else None
    cpu, _ = await _answers(
        redis_url, redis_client, tiny_weights, images, files=files, decode="cpu"
    )
    gpu, worker = await _answers(
        redis_url,
        redis_client,
        tiny_weights,
        images,
        files=files,
        decode="gpu",
        gpu_decode_share="1",
    )
    assert len(gpu) == len(cpu) == len(images)
    for (gid, gstatus, ganswer), (cid, cstatus, canswer) in zip(gpu, cpu, strict=True):
        assert (gid, gstatus) == (cid, cstatus)
        if isinstance(canswer, tuple):
            assert isinstance(ganswer, tuple) and ganswer[0] == canswer[0]
            assert ganswer[1] == pytest.approx(canswer[1], abs=1e-3)
            assert ganswer[2] == pytest.approx(canswer[2], abs=1e-3)
        else:
            assert ganswer == canswer
    decoder = worker.engine.feed.gpu_decode.packed_decoder
    assert isinstance(decoder, PackedGpuDecoder)
    # Every JPEG the hardware takes went to the GPU; the truncated one came back to the CPU.
    assert process_pool(worker).deferred == taken
    assert (decoder.decoded, decoder.failed) == (taken - 1, 1)
    plan = worker.engine.feed.plan
    assert plan.gpu_decode_share == 1.0
    split = worker.engine.feed.gpu_decode.split
    assert split is not None and not split.tune and split.share == 1.0
    line = plan.line()
    assert "the GPU decodes 100% of each batch's rows (GPUFEED_TUNING gpu_decode_share=1)" in line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_the_jpeg_engines_decode_their_share_and_answer_as_the_cpu(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """A worker as a GPU host runs it (decode processes, packed rows, GPU decode on, no
    decoder swapped in): each JPEG the hardware takes is decoded by the GPU's engines, the
    rest by the CPU, and every answer is the one the same worker gives with decode=cpu
    (top-5 scores within what two JPEG decoders' rounding moves them)."""
    images, taken = _images()
    # Not the truncated one: what a hardware decoder makes of half a JPEG is its own.
    del images[taken - 1]
    taken -= 1
    on_cuda = {"device": "cuda", "compile": "off", "precision": "fp32"}
    cpu, _ = await _answers(
        redis_url, redis_client, tiny_weights, images, worker_class=Worker, decode="cpu",
        **on_cuda,
    )  # fmt: skip
    gpu, worker = await _answers(
        redis_url, redis_client, tiny_weights, images, worker_class=Worker, decode="gpu",
        gpu_decode_share="1", **on_cuda,
    )  # fmt: skip
    decoder = worker.engine.feed.gpu_decode.packed_decoder
    assert isinstance(decoder, PackedGpuDecoder)
    assert decoder.hardware_engines_answered, decoder.engines
    assert process_pool(worker).deferred == taken
    assert (decoder.decoded, decoder.failed, decoder.wrong_shape) == (taken, 0, 0)
    assert [(i, status) for i, status, _ in gpu] == [(i, status) for i, status, _ in cpu]
    for (_, _, ganswer), (_, _, canswer) in zip(gpu, cpu, strict=True):
        if isinstance(canswer, tuple):
            assert isinstance(ganswer, tuple)
            assert ganswer[2] == pytest.approx(canswer[2], abs=0.05)
        else:
            assert ganswer == canswer


@pytest.mark.slow
async def test_gpu_decode_with_processes_says_what_it_cannot_do(
    redis_url: str, tiny_weights: Path
) -> None:
    """Off CUDA without a decoder given, `gpu` is a configuration error that says why;
    `auto` decodes on the CPU and the plan says so."""

    def config(decode: str) -> WorkerConfig:
        return _config(redis_url, tiny_weights, decode=decode)

    with pytest.raises(ConfigError, match="GPUFEED_DECODE=gpu: the GPU decoder needs a CUDA"):
        async with serving(Worker(config("gpu"))):
            pass
    auto = Worker(config("auto"))
    async with serving(auto):
        assert auto.engine.feed.plan.gpu_decode_share == 0.0
        assert (
            "GPUFEED_DECODE=auto: the GPU decoder needs a CUDA device"
            in auto.engine.feed.plan.line()
        )
        assert auto.engine.feed.gpu_decode.packed_decoder is None


class SlowBackend(NvImgCodec):
    """The CPU-only decoder, each call held 0.3 s, counting calls that overlap."""

    lock = threading.Lock()
    running = 0
    most = 0

    def decode_into(
        self, datas: Sequence[Any], twin: Any, places: Sequence[Any], stream: int
    ) -> list[bool]:
        cls = SlowBackend
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        try:
            time.sleep(0.3)
            return super().decode_into(datas, twin, places, stream)
        finally:
            with cls.lock:
                cls.running -= 1


class SlowGpuDecode(Worker):
    def gpu_backend(self) -> Callable[[], IntoCodec] | None:
        return lambda: SlowBackend(None)


@pytest.mark.slow
async def test_the_next_batch_decodes_on_the_other_lane_while_one_launches(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """While a batch waits for its GPU decode, the next batch's starts on the decoder's
    other lane: two calls at once, never more (two lanes), every job answered."""
    config = _config(redis_url, tiny_weights, decode="gpu", gpu_decode_share="1")
    images = [jpeg_bytes(96, 72, seed=i) for i in range(24)]
    async with serving(SlowGpuDecode(config)):
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"s{i}", "image": data})
        results = await wait_results(redis_client, "gpufeed:results", len(images))
    assert len(results) == len(images)
    assert {JobResult.from_fields(f).status for _, f in results} == {"ok"}
    assert SlowBackend.most == 2


@pytest.mark.slow
async def test_a_measured_share_moves_toward_the_cpu_when_the_cpu_is_slow(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """A GPU decode share of auto: both decoders' rates measured at start-up, the share
    between 0 and 1 and in the plan line with the rates; then decode processes held 40 ms
    an image keep the dispatcher waiting for their rows, so the share grows while the
    worker runs."""
    worker = CpuOnlyGpuDecode(_config(redis_url, tiny_weights, decode="gpu"), decode_delay_s=0.04)
    images = [jpeg_bytes(96, 72, seed=i) for i in range(96)]
    async with serving(worker):
        split = worker.engine.feed.gpu_decode.split
        assert split is not None and split.tune
        start = split.share
        plan = worker.engine.feed.plan
        assert plan.gpu_decode_share == start and 0.0 < start < 1.0
        assert plan.gpu_decode_why.startswith("auto: measured on")
        assert "decode processes'" in plan.gpu_decode_why and "of thumbnails" in plan.gpu_decode_why
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"d{i}", "image": data})
        results = await wait_results(redis_client, "gpufeed:results", len(images))
    assert len(results) == len(images)
    assert split.adjustments > 0 and split.share > start
    assert process_pool(worker).gpu_share == split.share
