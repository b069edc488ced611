"""The decode budget: a slow image is answered decode_timeout, its batch goes on without it,
its decode never writes a row that moved on, and stuck decodes do not starve the pool."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from producer.wire import ErrorCode, JobResult
from tests.support.images import jpeg_bytes, png_bytes, rle_bmp_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.decode.executor import DecodeResult
from worker.decode.pool import DecodePool
from worker.jobs import Job

S = 32
SPEC = DecodeSpec(size=S)


def make_job(job_id: str, data: bytes, entry: int = 0) -> Job:
    return Job.new(
        entry_id=f"{entry}-0",
        job_id=job_id,
        reply_to="gpufeed:results",
        meta=None,
        image=data,
        path=None,
    )


async def wait_until(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def decode_threads_alive() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("gpufeed-decode"))


def code(result: DecodeResult) -> ErrorCode | None:
    return result.error.code if result.error is not None else None


class Stuck:
    """A decode hook that holds the decodes of jobs named stuck-* until released: a decoder
    that hangs on some images and not on others."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered: list[str] = []
        self.left: list[str] = []

    def __call__(self, job: Job) -> None:
        if job.job_id.startswith("stuck"):
            self.entered.append(job.job_id)
            self.release.wait(60)
            self.left.append(job.job_id)


async def test_a_real_slow_decode_is_given_up_and_never_writes_its_row() -> None:
    # Pillow's RLE decoder in pure Python, allowed here past the worker's limit: ~1 s.
    spec = DecodeSpec(size=S, max_slow_decoder_pixels=10_000_000)
    pool = DecodePool(spec, 2, None, budget_s=0.2)
    slot = np.full((2, S, S, 3), 200, dtype=np.uint8)
    fast = png_bytes(64, 48, seed=1)
    try:
        slow_row = pool.submit(make_job("slow", rle_bmp_bytes(4000, 1000)), slot[0])
        fast_row = pool.submit(make_job("fast", fast), slot[1])
        slow, ok = await pool.settle([slow_row, fast_row])
        assert code(slow) is ErrorCode.DECODE_TIMEOUT
        assert slow.error is not None and "200 ms" in slow.error.message
        assert code(ok) is None
        assert np.array_equal(slot[1], decode_to_array(fast, spec)[0])
        # The slot moves on: a later batch puts its own image in the same row.
        later = png_bytes(64, 48, seed=2)
        [again] = await pool.settle([pool.submit(make_job("later", later), slot[0])])
        assert code(again) is None
        # The given-up decode ends on its own; its thread retires and the spare stays.
        assert pool.given_up == 1
        await wait_until(lambda: pool.spare_threads == 0)
        assert np.array_equal(slot[0], decode_to_array(later, spec)[0])
    finally:
        pool.shutdown()


async def test_stuck_decodes_do_not_starve_the_pool_and_spares_are_bounded() -> None:
    stuck = Stuck()
    pool = DecodePool(SPEC, 2, None, budget_s=0.2, delay_hook=stuck)
    rows = np.zeros((12, S, S, 3), dtype=np.uint8)
    try:
        # Both threads taken by decodes that hang, then six good images behind them.
        futures = [pool.submit(make_job(f"stuck-{i}", png_bytes(seed=i)), rows[i]) for i in (0, 1)]
        futures += [
            pool.submit(make_job(f"fast-{i}", png_bytes(seed=i)), rows[i]) for i in range(2, 8)
        ]
        results = await pool.settle(futures)
        assert [code(r) for r in results] == [ErrorCode.DECODE_TIMEOUT] * 2 + [None] * 6
        # Answered while both slow decodes were still hanging: spares did the work.
        assert sorted(stuck.entered) == ["stuck-0", "stuck-1"] and stuck.left == []
        assert pool.spare_threads == 2

        # Past the bound (one spare per thread) a hanging decode is still answered on time,
        # but no further thread is started for it.
        more = await pool.settle(
            [
                pool.submit(make_job("stuck-2", png_bytes(seed=8)), rows[8]),
                pool.submit(make_job("fast-9", png_bytes(seed=9)), rows[9]),
            ]
        )
        assert [code(r) for r in more] == [ErrorCode.DECODE_TIMEOUT, None]
        assert pool.spare_threads == 2
        assert decode_threads_alive() <= 4

        stuck.release.set()
        await wait_until(lambda: pool.spare_threads == 0 and len(stuck.left) == 3)
        # Back to two threads, and they still decode.
        [last] = await pool.settle([pool.submit(make_job("fast-10", png_bytes()), rows[10])])
        assert code(last) is None
    finally:
        stuck.release.set()
        pool.shutdown()
    await wait_until(lambda: decode_threads_alive() == 0)


async def test_the_gpu_fallback_decode_has_the_budget_too() -> None:
    stuck = Stuck()
    pool = DecodePool(SPEC, 1, None, budget_s=0.1, delay_hook=stuck)
    row = np.zeros((S, S, 3), dtype=np.uint8)
    try:
        result = await pool.decode_on_cpu(make_job("stuck-gpu", jpeg_bytes()), row)
        assert code(result) is ErrorCode.DECODE_TIMEOUT
        assert not row.any()
    finally:
        stuck.release.set()
        pool.shutdown()


async def test_jobs_behind_hanging_images_are_answered_while_they_hang(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    stuck = Stuck()
    ids = ["stuck-0", "stuck-1"] + [f"fast-{i}" for i in range(10)]
    try:
        async with running_worker(
            redis_url,
            tiny_weights,
            decode_hook=stuck,
            decode_threads=2,
            batch_size=4,
            decode_budget_ms=300,
        ):
            pipe = redis_client.pipeline(transaction=False)
            for i, job_id in enumerate(ids):
                pipe.xadd("gpufeed:jobs", {"id": job_id, "image": jpeg_bytes(seed=i)})
            pipe.execute()
            entries = await wait_results(redis_client, "gpufeed:results", len(ids))
            # Every job answered while both slow decodes still hang in their threads.
            assert sorted(stuck.entered) == ["stuck-0", "stuck-1"] and stuck.left == []
            stuck.release.set()
    finally:
        stuck.release.set()

    results = [JobResult.from_fields(f) for _, f in entries]
    assert Counter(r.id for r in results) == Counter(ids)  # exactly one result each
    codes = {r.id: r.error_code for r in results}
    assert codes == {job_id: "decode_timeout" if "stuck" in job_id else None for job_id in ids}
    stored = JobResult.from_fields(redis_client.hgetall("gpufeed:result:stuck-0"))
    assert stored.error is not None and stored.error.startswith("decode_timeout: ")
    assert "300 ms" in stored.error  # the worker's own setting
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("GPUFEED_TUNING", "decode_budget_ms=0"),
        ("GPUFEED_TUNING", "decode_budget_ms=soon"),
        ("GPUFEED_MAX_DECODE_MB", "0"),
    ],
)
def test_settings_refuse_what_cannot_work(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        WorkerConfig.load(env={var: value})


def test_settings_parse_with_their_defaults() -> None:
    config = WorkerConfig.load(
        env={"GPUFEED_TUNING": "decode_budget_ms=250", "GPUFEED_MAX_DECODE_MB": "64"}
    )
    assert (config.decode_budget_ms, config.max_decode_mb) == (250.0, 64)
    assert WorkerConfig.load(env={}).decode_budget_ms == 10_000.0
