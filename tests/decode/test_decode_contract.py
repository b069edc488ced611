"""The decode contract (worker/decode/executor.py): decode threads and decode processes are
used alike by the batcher, the GPU decode stage and the warm start, and answer alike; and
the one row policy both run (worker/decode/row_policy.py), its steps in their order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from producer.wire import ErrorCode
from tests.support.images import jpeg_bytes, png_bytes
from worker.decode.arena import DEFERRED, DONE, ArenaLayout, SharedArena
from worker.decode.cache import DecodeCache
from worker.decode.cpu import DecodeError, DecodeInfo, DecodeSpec, decode_to_array, write_row
from worker.decode.executor import DecodeExecutor, DecodeResult
from worker.decode.gpu import GpuDecodeRouter, GpuRow
from worker.decode.packed import SlotFull, packed_side
from worker.decode.pool import DecodePool
from worker.decode.process_main import RowDecoder
from worker.decode.processes import ProcessDecodePool
from worker.decode.row_policy import RowPolicy
from worker.decode.rows import DecodedRow, row_side
from worker.jobs import Job

SIZE = 40
SPEC = DecodeSpec(size=SIZE)
# Every executor the worker can run: a third one is a line here.
KINDS = ["threads", "processes"]


def _job(i: int, *, image: bytes | None = None, path: bytes | None = None) -> Job:
    return Job.new(
        entry_id=f"{i}-0", job_id=f"j{i}", reply_to="r", meta=None, image=image, path=path
    )


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


# ---------------------------------------------------------------- the row policy


class Recorder(RowPolicy[int, str]):
    """A row policy whose hooks note what they were asked, in order: rows are indices into
    `rows`, answers are strings."""

    def __init__(self, *, on_arrival: bool, take: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("row_side", 0)
        kwargs.setdefault("path_root", None)
        kwargs.setdefault("cache", None)
        super().__init__(SPEC, delay=lambda subject: self.log.append(f"delay {subject}"), **kwargs)
        self.offer_on_arrival = on_arrival
        self.take = take  # the GPU takes every row offered
        self.log: list[str] = []
        self.rows = np.zeros((2, SIZE, SIZE, 3), np.uint8)

    def offer(
        self,
        row: int,
        data: bytes | memoryview,
        namespace: str | None,
        start: float,
        *,
        staged: bool,
    ) -> str | None:
        self.log.append(f"offer {'staged' if staged else 'held'} {len(data)}")
        return "gpu" if self.take else None

    def check(self, row: int) -> None:
        self.log.append("check")

    def copy_kept(self, row: int, kept: npt.NDArray[np.uint8]) -> None:
        self.log.append("copy kept")
        self.rows[row] = kept

    def write(self, row: int, decoded: DecodedRow | npt.NDArray[np.uint8]) -> bool:
        self.log.append("write")
        assert isinstance(decoded, np.ndarray)
        write_row(self.rows[row], decoded)
        return True

    def entry(self, row: int) -> npt.NDArray[np.uint8]:
        return self.rows[row]

    def answer(
        self, row: int, info: DecodeInfo, start: float, *, cached: bool, reduced: bool
    ) -> str:
        self.log.append("cached" if cached else "decoded")
        return "done"

    def fail(self, row: int, error: DecodeError, start: float) -> str:
        self.log.append(f"{error.code.value}: {error.message}")
        return "failed"


IMAGE = jpeg_bytes(64, 48, seed=7)
KEPT = (np.full((SIZE, SIZE, 3), 9, np.uint8), DecodeInfo("JPEG", 64, 48, 1))


@pytest.mark.parametrize("on_arrival", [False, True], ids=["after-cache", "on-arrival"])
def test_a_kept_row_is_copied_after_the_delay_and_never_offered(on_arrival: bool) -> None:
    policy = Recorder(on_arrival=on_arrival, take=True)
    assert policy.run(0, IMAGE, None, namespace="r", kept=KEPT, gpu=True, subject="j") == "done"
    assert policy.log == ["delay j", "copy kept", "cached"]
    assert int(policy.rows[0].max()) == 9


def test_threads_offer_the_gpu_after_the_cache_missed() -> None:
    policy = Recorder(on_arrival=False, cache=DecodeCache(1 << 20))
    policy.run(0, IMAGE, None, namespace="r", gpu=True, subject="a")
    policy.run(1, IMAGE, None, namespace="r", gpu=True, subject="b")
    assert policy.log == [
        *("delay a", f"offer held {len(IMAGE)}", "check", "write", "decoded"),
        # The same bytes for the same stream: a copy of the first, never offered.
        *("delay b", "copy kept", "cached"),
    ]
    assert policy.cache is not None
    assert (policy.cache.hits, policy.cache.misses) == (1, 1)
    assert np.array_equal(policy.rows[0], policy.rows[1])


def test_processes_offer_the_gpu_the_bytes_a_job_brought_before_the_delay() -> None:
    policy = Recorder(on_arrival=True, take=True, cache=DecodeCache(1 << 20))
    assert policy.run(0, memoryview(IMAGE), None, namespace="r", gpu=True, subject="j") == "gpu"
    assert policy.log == [f"offer held {len(IMAGE)}"]
    assert policy.cache is not None and policy.cache.misses == 0  # the offer looks itself


@pytest.mark.parametrize("on_arrival", [False, True], ids=["after-cache", "on-arrival"])
def test_a_path_jobs_bytes_are_read_before_the_cache_look_up(
    on_arrival: bool, tmp_path: Path
) -> None:
    """Read first, then looked up under the bytes' key: the same image by path and by
    bytes meets one cached row. Processes offer the GPU the bytes they read (staged), before
    the cache: their offer declines what the cache holds."""
    (tmp_path / "a.jpg").write_bytes(IMAGE)
    policy = Recorder(on_arrival=on_arrival, path_root=tmp_path, cache=DecodeCache(1 << 20))
    policy.run(0, IMAGE, None, namespace="r", gpu=False, subject="bytes")
    policy.log.clear()
    policy.run(1, None, b"a.jpg", namespace="r", gpu=True, subject="path")
    offered = [f"offer staged {len(IMAGE)}"] if on_arrival else []
    assert policy.log == ["delay path", *offered, "copy kept", "cached"]


@pytest.mark.parametrize(
    ("data", "path", "want", "misses"),
    [
        (None, None, "invalid_job: nothing to decode", 0),
        (None, b"a.jpg", "path_disabled: path jobs are disabled: the worker has no ", 0),
        # No bytes, no look-up: the cache counts no miss.
        (b"", None, "empty_image: ", 0),
        (b"GIF87a" + bytes(20), None, "decode_error: ", 1),
    ],
    ids=["nothing", "no-root", "empty", "broken"],
)
def test_what_cannot_be_decoded_fails_after_the_delay_with_its_code(
    data: bytes | None, path: bytes | None, want: str, misses: int
) -> None:
    policy = Recorder(on_arrival=False, cache=DecodeCache(1 << 20))
    assert policy.run(0, data, path, namespace="r", gpu=False, subject="j") == "failed"
    assert policy.log[0] == "delay j" and policy.log[-1].startswith(want), policy.log
    assert policy.cache is not None and policy.cache.misses == misses


class _Breaks(Recorder):
    def __init__(self, error: Exception) -> None:
        super().__init__(on_arrival=False)
        self.error = error

    def write(self, row: int, decoded: DecodedRow | npt.NDArray[np.uint8]) -> bool:
        raise self.error


@pytest.mark.parametrize(
    ("error", "want"),
    [
        (RuntimeError("boom"), "internal_error: RuntimeError: boom"),
        (SlotFull("slot 0 is full"), "internal_error: slot 0 is full"),
        (DecodeError(ErrorCode.IMAGE_TOO_LARGE, "too big"), "image_too_large: too big"),
    ],
)
def test_whatever_a_row_raises_is_its_answer(error: Exception, want: str) -> None:
    policy = _Breaks(error)
    assert policy.run(0, IMAGE, None, namespace="r", gpu=False) == "failed"
    assert policy.log[-1] == want


class _CountingRouter(GpuDecodeRouter):
    def __init__(self) -> None:
        super().__init__({"small": True, "medium": True, "large": True})
        self.asked = 0

    def route(self, data: bytes, spec: DecodeSpec) -> GpuRow | None:
        self.asked += 1
        return super().route(data, spec)


async def test_decode_threads_serve_cached_rows_before_the_gpu_route() -> None:
    """The threads' order on a real pool: a kept row and a cached image are copied, never
    routed; an image not cached is left for the GPU."""
    router = _CountingRouter()
    cache = DecodeCache(1 << 20)
    pool = DecodePool(SPEC, 1, None, gpu_router=router, cache=cache)
    rows = np.zeros((3, SIZE, SIZE, 3), np.uint8)
    kept = _job(0, image=IMAGE)
    kept.cached_row = KEPT
    try:
        # Cached first, without the GPU: then routed rows would find it.
        await pool.redecode([_job(1, image=IMAGE)], [rows[1]])
        results = await pool.settle(
            [pool.submit_rows([kept, _job(1, image=IMAGE), _job(2, image=IMAGE + b"x")], rows)]
        )
    finally:
        pool.shutdown()
    assert [(r.cached, r.gpu is not None) for r in results] == [
        (True, False),
        (True, False),
        (False, True),
    ]
    assert router.asked == 1 and int(rows[0].max()) == 9


def test_a_decode_process_leaves_a_row_for_the_gpu_before_its_delay() -> None:
    """The processes' order: a JPEG flagged for the GPU is probed and left at once; the
    test hook's delay is for rows decoded here."""
    side = row_side(SIZE)
    arena = SharedArena.create(ArenaLayout(rows=2, side=packed_side(side), processes=1, batch=2))
    assert arena.packed is not None
    arena.packed.reset(0)
    decoder = RowDecoder(arena, SPEC, row_side=side, path_root=None, cache_bytes=0, delay_s=0.5)
    try:
        t0 = time.monotonic()
        decoder.decode(0, IMAGE, None, "r", gpu=True)
        left_s = time.monotonic() - t0
        decoder.decode(1, IMAGE, None, "r", gpu=False)
        decoded_s = time.monotonic() - t0 - left_s
        states = [int(arena.table[0]["state"]), int(arena.table[1]["state"])]
    finally:
        arena.close()
    assert states == [DEFERRED, DONE]
    assert left_s < 0.25 <= 0.5 <= decoded_s
