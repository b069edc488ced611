"""No sender can pile its rows onto one decode process (worker/decode/processes.py).

Images that share a length and a tail (what the decode cache's routing once went by, and
what any sender controls) spread over the processes like any others; a small image sent
beside slow ones is decoded first and is answered without waiting for all of them; and a
process's run of a batch's rows is bounded by the decode budget as a whole, however many
images under the budget it holds.

The slow images are slow by a hook (tests/support/slow_decoder.py, run in place of the decode
process): a sleep before decoding an image with the slow tail, and a note of which process
started it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.wire import ErrorCode
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.slow_decoder import LOG_ENV, SLOW_ENV, TAIL
from worker.decode import processes
from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cpu import DecodeSpec
from worker.decode.packed import packed_side
from worker.decode.process_main import decode_cost
from worker.decode.processes import ProcessDecodePool, shares
from worker.decode.rows import row_side
from worker.jobs import Job

SIZE = 48


def slow_images(n: int) -> list[bytes]:
    """`n` different PNGs of one length, ending in the same 64 bytes (Pillow stops at the
    PNG's end: what follows it is never read)."""
    images = [png_bytes(240, 180, seed=100 + i) for i in range(n)]
    length = max(len(i) for i in images) + 16
    return [i + b"\0" * (length - len(i)) + TAIL for i in images]


def _job(i: int, data: bytes, reply_to: str) -> Job:
    return Job.new(
        entry_id=f"{i}-0", job_id=f"j{i}", reply_to=reply_to, meta=None, image=data, path=None
    )


@pytest.fixture
def slow_decoders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Decode processes that take `slow_s` (set by each test) over every slow image; the
    file they name their pid in, once per slow image they start."""
    log = tmp_path / "slow.log"
    log.write_text("")
    monkeypatch.setattr(processes, "CHILD_MODULE", "tests.support.slow_decoder")
    monkeypatch.setenv(LOG_ENV, str(log))
    yield log


def _pool(k: int, batch: int, *, budget_s: float) -> tuple[ProcessDecodePool, SharedArena]:
    """The GPU host's shape: decode processes packing a slot, the decode cache on."""
    r = row_side(SIZE)
    arena = SharedArena.create(
        ArenaLayout(rows=batch, side=packed_side(r), processes=k, batch=batch)
    )
    assert arena.packed is not None
    arena.packed.reset(0)
    pool = ProcessDecodePool(
        DecodeSpec(size=SIZE),
        k,
        None,
        arena=arena,
        budget_s=budget_s,
        row_side=r,
        cache_bytes=8 << 20,
    )
    return pool, arena


def _decoded_by(log: Path) -> Counter[str]:
    """How many slow images each decode process started."""
    return Counter(log.read_text().split())


def _code(result: Any) -> ErrorCode | None:
    return result.error.code if result.error is not None else None


async def test_images_sharing_a_fingerprint_spread_and_a_small_one_is_not_kept_waiting(
    slow_decoders: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_s = 0.5
    monkeypatch.setenv(SLOW_ENV, str(slow_s))
    # One tenant's six slow images, then another tenant's thumbnail, in one batch.
    jobs = [_job(i, data, "tenant-a:out") for i, data in enumerate(slow_images(6))]
    jobs.append(_job(6, jpeg_bytes(64, 64, seed=1), "tenant-b:out"))
    pool, arena = _pool(3, len(jobs), budget_s=30)
    try:
        t0 = time.monotonic()
        results = await pool.settle([pool.submit_rows(jobs, arena.rows[: len(jobs)])])
        waited = time.monotonic() - t0
    finally:
        pool.shutdown()
        arena.close()
    assert [_code(r) for r in results] == [None] * len(jobs)
    # Two slow images a process: the batch waits for two in a row, not six.
    per_process = _decoded_by(slow_decoders)
    assert sorted(per_process.values()) == [2, 2, 2], per_process
    assert waited < 4 * slow_s, f"the thumbnail waited {waited:.2f} s"


@pytest.mark.slow
async def test_a_run_of_images_under_the_budget_is_bounded_by_the_budget(
    slow_decoders: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each slow image decodes within the budget; together they would hold the batch for
    several. Once a run reaches the budget, the image it is on and the ones behind it are
    answered decode_timeout and the batch goes on; the thumbnail beside them was decoded
    first."""
    slow_s, budget_s = 0.7, 1.0
    monkeypatch.setenv(SLOW_ENV, str(slow_s))
    jobs = [_job(i, data, "tenant-a:out") for i, data in enumerate(slow_images(6))]
    jobs.append(_job(6, jpeg_bytes(64, 64, seed=2), "tenant-b:out"))
    pool, arena = _pool(2, len(jobs), budget_s=budget_s)
    try:
        t0 = time.monotonic()
        results = await pool.settle([pool.submit_rows(jobs, arena.rows[: len(jobs)])])
        waited = time.monotonic() - t0
    finally:
        pool.shutdown()
        arena.close()
    assert _code(results[-1]) is None and results[-1].info is not None
    slow = [_code(r) for r in results[:-1]]
    # Each process decoded one slow image in its budget, no more.
    assert slow.count(None) == 2, results
    assert slow.count(ErrorCode.DECODE_TIMEOUT) == 4, results
    messages = [r.error.message for r in results[:-1] if r.error is not None]
    assert sum("waited behind other images" in m for m in messages) == 2, messages
    assert waited < budget_s + 0.7, f"the batch waited {waited:.2f} s"


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 40), min_size=1, max_size=16),
    rows=st.integers(1, 256),
    start=st.integers(0, 15),
)
def test_shares_make_the_longest_queue_as_short_as_it_can_be(
    loads: list[int], rows: int, start: int
) -> None:
    plan = shares(loads, rows, start % len(loads))
    taken = [max(b, 0) for b in plan.base]
    for k in plan.order[: plan.extra]:
        taken[k] += 1
    assert sum(taken) == rows
    assert all(plan.base[k] >= 0 for k in plan.order)
    assert plan.extra < len(plan.order)
    longest = max(load + t for load, t in zip(loads, taken, strict=True))
    # The best any sharing can do: the lowest level the shorter queues can be filled to
    # with `rows`, unless a queue is longer than that already.
    level = min(loads)
    while sum(max(0, level - load) for load in loads) < rows:
        level += 1
    assert longest == max(level, *loads)


def test_the_cost_a_run_is_ordered_by_comes_from_the_header() -> None:
    assert decode_cost(memoryview(slow_images(1)[0])) == 240 * 180
    assert decode_cost(jpeg_bytes(64, 48)) == 64 * 48
    assert decode_cost(b"not an image") == len(b"not an image")
    assert decode_cost(None) == 0
