"""A hostile JPEG header under GPU decode routing: a decode process reads each flagged
JPEG's header to choose between the GPU's hardware decoder and its own CPU decode. Headers
it cannot use (a frame 0 pixels wide, an Adobe segment the file ends inside) are decoded,
and refused, on the CPU like any other bad JPEG: their jobs are answered `decode_error`,
the good jobs beside them are decoded, and the process that read them goes on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from producer.wire import ErrorCode, JobResult
from tests.decode.test_jpeg_header import sof0_width_zero, truncated_adobe, with_adobe
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import process_pool, serving, tiny_config, wait_results
from worker.decode import process_main
from worker.decode.arena import DONE, ERROR_CODES, FAILED, ArenaLayout, SharedArena
from worker.decode.cpu import DecodeSpec
from worker.decode.packed import packed_side
from worker.decode.processes import ProcessDecodePool
from worker.decode.rows import row_side
from worker.jobs import Job
from worker.lifecycle.service import Worker

SIZE = 48
_HOSTILE = {"width-0": sof0_width_zero(), "adobe-cut": truncated_adobe()}


def _job(i: int, data: bytes) -> Job:
    return Job.new(
        entry_id=f"{i}-0", job_id=f"j{i}", reply_to="r", meta=None, image=data, path=None
    )


async def test_a_decode_process_refuses_hostile_headers_and_goes_on() -> None:
    """Every row flagged for the GPU: the good JPEG is left for it, the hostile ones are
    refused by the process's CPU decode, and no process is replaced."""
    r = row_side(SIZE)
    images = [jpeg_bytes(64, 48, seed=1), *_HOSTILE.values(), jpeg_bytes(40, 30, seed=2)]
    jobs = [_job(i, data) for i, data in enumerate(images)]
    batch = len(jobs)
    arena = SharedArena.create(
        ArenaLayout(rows=batch, side=packed_side(r), processes=1, batch=batch)
    )
    assert arena.packed is not None
    arena.packed.reset(0)
    pool = ProcessDecodePool(DecodeSpec(size=SIZE), 1, None, arena=arena, budget_s=30, row_side=r)
    pool.gpu_share = 1.0
    pids = pool.pids
    try:
        results = await pool.settle([pool.submit_rows(jobs, arena.rows)])
        # The process that read them decodes the next batch too.
        again = await pool.settle([pool.submit_rows(jobs[:1], arena.rows[:1])])
        after = pool.pids
    finally:
        pool.shutdown()
        arena.close()
    good, width0, adobe, small = results
    for hostile in (width0, adobe):
        assert hostile.error is not None, hostile
        assert hostile.error.code is ErrorCode.DECODE_ERROR, hostile.error
    assert good.error is None and good.gpu is not None
    assert small.error is None and small.gpu is not None
    assert again[0].error is None and again[0].gpu is not None
    assert (after, pool.replaced, pool.crashed) == (pids, 0, 0)


def test_a_routing_failure_fails_its_row_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should choosing between the GPU and the CPU ever raise (a defect of ours, not of
    the image), that row is answered with an internal error that says so, and the process
    decodes the next row: the routing runs inside a row's error handling."""
    r = row_side(SIZE)
    arena = SharedArena.create(ArenaLayout(rows=2, side=packed_side(r), processes=1, batch=2))
    assert arena.packed is not None
    arena.packed.reset(0)

    def broken(*args: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(process_main, "gpu_placement", broken)
    decoder = process_main.RowDecoder(
        arena, DecodeSpec(size=SIZE), row_side=r, path_root=None, cache_bytes=0, delay_s=0.0
    )
    try:
        decoder.decode(0, jpeg_bytes(64, 48, seed=1), None, "r", gpu=True)
        decoder.decode(1, jpeg_bytes(64, 48, seed=1), None, "r", gpu=False)
        record, next_record = arena.table[0], arena.table[1]
        assert record["state"] == FAILED
        assert ERROR_CODES[record["error"]] is ErrorCode.INTERNAL_ERROR
        message = bytes(record["message"]).decode()
        assert message == (
            "choosing the GPU or the CPU to decode this image failed: "
            "ZeroDivisionError: division by zero"
        )
        assert next_record["state"] == DONE and next_record["width"] == 64
    finally:
        arena.close()


pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")

from worker.decode.codecs import IntoCodec  # noqa: E402
from worker.decode.nvimgcodec import NvImgCodec  # noqa: E402


class CpuOnlyGpuDecode(Worker):
    """A worker whose GPU JPEG decoder is nvImageCodec's CPU-only backend."""

    def gpu_backend(self) -> Callable[[], IntoCodec] | None:
        return lambda: NvImgCodec(None)


async def test_a_worker_decoding_on_the_gpu_answers_hostile_headers_as_decode_errors(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """Through a worker whose decode processes leave every JPEG they can to the GPU
    decoder: the hostile jobs are `decode_error`, the good ones (an Adobe YCbCr JPEG among
    them) are classified, and the decode processes are the ones the worker started."""
    good = {
        "good": jpeg_bytes(96, 72, seed=3),
        "adobe-ycbcr": with_adobe(jpeg_bytes(80, 60, seed=4), 1),
    }
    config = tiny_config(
        redis_url,
        tiny_weights,
        decode_processes="2",
        decode_threads=0,
        resize="device",
        decode_cache_mb=0,
        decode="gpu",
        gpu_decode_share="1",
    )
    redis_client.delete("gpufeed:jobs", "gpufeed:results")
    worker = CpuOnlyGpuDecode(config)
    async with serving(worker):
        pool = process_pool(worker)
        pids = pool.pids
        for name, data in {**good, **_HOSTILE}.items():
            redis_client.xadd("gpufeed:jobs", {"id": name, "image": data})
        entries = await wait_results(redis_client, "gpufeed:results", len(good) + len(_HOSTILE))
        after, replaced, deferred = pool.pids, pool.replaced, pool.deferred
    results = {r.id: r for r in (JobResult.from_fields(fields) for _, fields in entries)}
    assert sorted(results) == sorted([*good, *_HOSTILE])
    for name in _HOSTILE:
        assert results[name].status == "error", results[name]
        assert (results[name].error or "").startswith("decode_error"), results[name]
    for name in good:
        assert results[name].ok, results[name]
    assert (after, replaced) == (pids, 0)
    assert deferred == len(good)
