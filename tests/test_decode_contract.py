"""The decode contract (worker/decode/executor.py): decode threads and decode processes are
used alike by the batcher, the GPU decode stage and the warm start, and answer alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from producer.wire import ErrorCode
from tests.images import jpeg_bytes, png_bytes
from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.decode.executor import DecodeExecutor, DecodeResult
from worker.decode.pool import DecodePool
from worker.decode.processes import ProcessDecodePool
from worker.jobs import Job

SIZE = 40
SPEC = DecodeSpec(size=SIZE)
# Every executor the worker can run: a third one is a line here.
KINDS = ["threads", "processes"]


def _job(i: int, *, image: bytes | None = None, path: bytes | None = None) -> Job:
    return Job(entry_id=f"{i}-0", job_id=f"j{i}", reply_to="r", meta=None, image=image, path=path)


@asynccontextmanager
async def executor_of(
    kind: str, *, rows: int = 8, path_root: Path | None = None, delay_s: float = 0.0
) -> AsyncIterator[tuple[DecodeExecutor, npt.NDArray[np.uint8]]]:
    """An executor of `kind` decoding S x S rows for the host placement, and its ring's
    rows (the processes' shared memory; an array of the threads' own)."""
    executor: DecodeExecutor
    if kind == "threads":
        hook = (lambda job: time.sleep(delay_s)) if delay_s else None
        executor = DecodePool(SPEC, 2, path_root, delay_hook=hook, budget_s=5)
        try:
            yield executor, np.zeros((rows, SIZE, SIZE, 3), np.uint8)
        finally:
            executor.shutdown()
        return
    arena = SharedArena.create(ArenaLayout(rows=rows, side=SIZE, processes=2))
    try:
        executor = ProcessDecodePool(SPEC, 2, path_root, arena=arena, budget_s=5, delay_s=delay_s)
        try:
            yield executor, arena.rows
        finally:
            executor.shutdown()
    finally:
        arena.close()


def _codes(results: Sequence[DecodeResult]) -> list[ErrorCode | None]:
    return [r.error.code if r.error is not None else None for r in results]


@pytest.mark.parametrize("kind", KINDS)
async def test_results_come_in_row_order_across_groups_with_each_rows_pixels(
    kind: str, tmp_path: Path
) -> None:
    photo = jpeg_bytes(120, 90, seed=1)
    (tmp_path / "a.png").write_bytes(png_bytes(30, 50, seed=2))
    jobs = [
        _job(0, image=photo),
        _job(1, image=b"not an image"),
        _job(2, path=b"a.png"),
        _job(3),
        _job(4, image=jpeg_bytes(64, 64, seed=3)),
    ]
    async with executor_of(kind, path_root=tmp_path) as (executor, rows):
        assert executor.kind == kind and executor.spec == SPEC
        # Two groups, as two reads fill one batch: settled together, in row order.
        groups = [
            executor.submit_rows(jobs[:2], rows[:2]),
            executor.submit_rows(jobs[2:], rows[2:5]),
        ]
        results = await executor.settle(groups)
        assert all(g.done() for g in groups)
        # Read while the processes' memory is still there.
        written = rows[:5].copy()
    assert _codes(results) == [
        None,
        ErrorCode.UNSUPPORTED_FORMAT,
        None,
        ErrorCode.INVALID_JOB,
        None,
    ]
    error = results[3].error
    assert error is not None and error.message == "nothing to decode"
    for row, data in ((0, photo), (2, png_bytes(30, 50, seed=2)), (4, jpeg_bytes(64, 64, seed=3))):
        want, info = decode_to_array(data, SPEC)
        assert results[row].info == info
        assert np.array_equal(written[row], want), f"row {row}"


@pytest.mark.parametrize("kind", KINDS)
async def test_redecode_decodes_every_row_here(kind: str) -> None:
    images = [jpeg_bytes(80, 60, seed=i) for i in range(3)]
    async with executor_of(kind) as (executor, rows):
        results = await executor.redecode(
            [_job(i, image=d) for i, d in enumerate(images)], [rows[5], rows[6], rows[7]]
        )
        written = rows[5:8].copy()
    assert [r.gpu for r in results] == [None, None, None]
    for row, data in enumerate(images):
        assert np.array_equal(written[row], decode_to_array(data, SPEC)[0])


@pytest.mark.parametrize("kind", KINDS)
async def test_rows_past_until_are_answered_decode_timeout(kind: str) -> None:
    jobs = [_job(i, image=jpeg_bytes(64, 48, seed=i)) for i in range(3)]
    async with executor_of(kind, delay_s=1.5) as (executor, rows):
        t0 = time.monotonic()
        group = executor.submit_rows(jobs, rows[:3], until=time.monotonic() + 0.2)
        results = await executor.settle([group])
        waited = time.monotonic() - t0
        assert executor.given_up == 3
    assert _codes(results) == [ErrorCode.DECODE_TIMEOUT] * 3
    assert waited < 1.0


class _Foreign:
    """A group no executor made."""

    def done(self) -> bool:
        return True


@pytest.mark.parametrize("kind", KINDS)
async def test_an_executor_settles_only_the_groups_it_made(kind: str) -> None:
    async with executor_of(kind) as (executor, _):
        with pytest.raises(TypeError, match="settle only"):
            await executor.settle([_Foreign()])


async def test_a_future_of_one_row_is_a_group_the_threads_settle() -> None:
    """What `DecodePool.submit` returns (and a test's finished future) settles with the
    groups: the GPU decode stage's tests build batches of them."""
    async with executor_of("threads") as (executor, rows):
        assert isinstance(executor, DecodePool)
        made: asyncio.Future[DecodeResult] = asyncio.get_running_loop().create_future()
        made.set_result(DecodeResult(None, None, 0.0))
        one = executor.submit(_job(0, image=jpeg_bytes(64, 48, seed=1)), rows[0])
        results = await executor.settle([one, made])
    assert results[0].info is not None and results[1] == DecodeResult(None, None, 0.0)
