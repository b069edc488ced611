"""Ring-slot bookkeeping, copy runs and padding masks, on the CPU with hand-driven events."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from producer.wire import ErrorCode
from worker.decode.cpu import DecodeError, DecodeInfo
from worker.decode.executor import DecodeResult
from worker.pipeline.batcher import Batch
from worker.pipeline.staging import InputRing, OutputRing
from worker.pipeline.transfer import copy_runs


class FakeEvent:
    """A CUDA event stand-in that fires when the test says so."""

    def __init__(self) -> None:
        self.fired = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.fired

    def elapsed_time(self, end_event: Any) -> float:
        return 1.0


def test_slot_array_is_a_view_of_the_tensor() -> None:
    ring = InputRing(2, 4, 8, pin=False)
    slot = ring.slots[0]
    assert slot.images.shape == (4, 8, 8, 3) and slot.images.dtype == torch.uint8
    slot.array[2, 3, 4] = (7, 8, 9)  # what a decode thread does: write its row in place
    assert slot.images[2, 3, 4].tolist() == [7, 8, 9]
    assert np.shares_memory(slot.array, slot.images.numpy())


async def test_acquire_hands_out_each_slot_once() -> None:
    ring = InputRing(3, 2, 4, pin=False)
    got = [await ring.acquire() for _ in range(3)]
    assert len({s.index for s in got}) == 3
    assert ring.free_count == 0
    waiter = asyncio.create_task(ring.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    ring.release_now(got[1])
    assert (await asyncio.wait_for(waiter, 1)) is got[1]


async def test_slot_is_reused_only_after_its_copy_event_fired() -> None:
    ring = InputRing(1, 2, 4, pin=False)
    slot = await ring.acquire()
    slot.array[:] = 11  # "decoded" pixels of batch 1
    copied = FakeEvent()
    slot.copy_done = copied
    ring.release_after_copy(slot)
    assert ring.free_count == 0

    waiter = asyncio.create_task(ring.acquire(poll_interval_s=0.001))
    await asyncio.sleep(0.03)
    # Still copying: the slot must not be handed out (its pixels are still being read).
    assert not waiter.done()
    assert copied.queries > 1, "the ring polls the event instead of blocking on it"
    assert int(slot.images.min()) == 11
    copied.fired = True
    again = await asyncio.wait_for(waiter, 1)
    assert again is slot and again.copy_done is None


async def test_poll_frees_slots_out_of_order() -> None:
    ring = InputRing(3, 1, 2, pin=False)
    slots = [await ring.acquire() for _ in range(3)]
    events = [FakeEvent() for _ in slots]
    for s, e in zip(slots, events, strict=True):
        s.copy_done = e
        ring.release_after_copy(s)
    events[1].fired = True
    assert ring.poll() == 1 and ring.free_count == 1
    assert (await ring.acquire()) is slots[1]
    events[0].fired = events[2].fired = True
    assert ring.poll() == 2


async def test_output_ring_round_trip() -> None:
    ring = OutputRing(2, 4, 3, pin=False)
    a = await ring.acquire()
    b = await ring.acquire()
    assert a is not b and ring.free_count == 0
    assert a.indices.shape == (4, 3) and a.indices.dtype == torch.int32
    assert a.scores.dtype == torch.float32
    a.indices[1, 2] = 42
    assert a.indices_np[1, 2] == 42  # the watcher's view sees the copy's bytes
    ring.release(a)
    assert (await ring.acquire()) is a


@pytest.mark.parametrize(
    ("rows", "skip", "runs"),
    [
        (4, set(), [(0, 4)]),
        (4, {0, 1, 2, 3}, []),
        (6, {0}, [(1, 6)]),
        (6, {5}, [(0, 5)]),
        (8, {2, 3, 6}, [(0, 2), (4, 6), (7, 8)]),
    ],
)
def test_copy_runs(rows: int, skip: set[int], runs: list[tuple[int, int]]) -> None:
    assert copy_runs(rows, skip) == runs
    covered = [r for a, b in runs for r in range(a, b)]
    assert covered == [r for r in range(rows) if r not in skip]


async def test_padding_mask_marks_only_decoded_rows() -> None:
    ring = InputRing(1, 8, 4, pin=False)
    slot = await ring.acquire()
    ok = DecodeResult(DecodeInfo("JPEG", 4, 4, 1), None, 1.0)
    bad = DecodeResult(None, DecodeError(ErrorCode.DECODE_ERROR, "truncated"), 1.0)
    loop = asyncio.get_running_loop()
    futures = []
    for r in (ok, bad, ok, ok, ok):
        f: asyncio.Future[DecodeResult] = loop.create_future()
        f.set_result(r)
        futures.append(f)
    batch = Batch(seq=1, slot=slot, jobs=[object()] * 5, futures=futures, opened_s=0.0)  # type: ignore[list-item]
    await batch.decoded()
    assert batch.valid_rows == [0, 2, 3, 4]
    assert batch.fill_ratio(8) == 0.5
