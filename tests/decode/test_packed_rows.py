"""Packed rows: each image staged at its decoded size, and the same pixels out of the step.

The cases are the resample bench's (every size class in every EXIF orientation, a panorama
reduced on the host, a thumbnail); the device placement runs here on the CPU, and on CUDA
through a captured graph.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from measure.bench.accuracy import CROP, SIDE, STAGING, cases, decode_rows
from tests.support.images import jpeg_bytes
from worker.decode.cpu import DecodeSpec
from worker.decode.packed import (
    HEADER_BYTES,
    OFFSET_WORD,
    PackedSlots,
    SlotFull,
    packed_side,
)
from worker.decode.rows import decode_row
from worker.model.resample import PackedResampler, RowResampler

S, C, R = STAGING, CROP, SIDE


def packed_slot(
    images: list[bytes],
    *,
    order: list[int] | None = None,
    batch: int = 0,
    spec: DecodeSpec | None = None,
) -> tuple[torch.Tensor, PackedSlots]:
    """One slot of `batch` (default len(images)) packed rows, the images written in `order`
    (the order decodes end in)."""
    batch = batch or len(images)
    side = packed_side(R)
    memory = np.zeros((1, batch * side * side * 3), dtype=np.uint8)
    slots = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=batch, row_side=R)
    slots.reset(0)
    for i in order if order is not None else range(len(images)):
        decoded, _ = decode_row(images[i], spec or DecodeSpec(size=S), R)
        slots.write(i, decoded)
    return torch.from_numpy(memory.reshape(batch, side, side, 3)), slots


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [c.data for c in cases()]


def test_packed_rows_give_the_pixels_rows_give(images: list[bytes]) -> None:
    """The same images, as rows and packed (written in a shuffled order, as parallel
    decodes end): the step's input is equal, bit for bit, for every size class and EXIF
    orientation, and at a smaller staging size (the degraded step's)."""
    order = list(np.random.default_rng(0).permutation(len(images)))
    slot, _ = packed_slot(images, order=order)
    rows = decode_rows(images)[0]
    with torch.inference_mode():
        for staging, crop in ((S, C), (40, 32)):
            want = RowResampler(R, S, staging, crop)(rows)
            got = PackedResampler(R, S, staging, crop)(slot)
            assert torch.equal(got, want), (staging, crop)


def test_staged_bytes_are_the_decoded_pixels_and_a_record(images: list[bytes]) -> None:
    _, slots = packed_slot(images)
    decoded = [decode_row(data, DecodeSpec(size=S), R)[0] for data in images]
    pixels = sum(d.pixels.shape[0] * d.pixels.shape[1] * 3 for d in decoded)
    assert slots.used_bytes(0) == len(images) * HEADER_BYTES + pixels
    # Against the fixed rows: a 40x30 thumbnail stages 3,664 bytes, not R * R * 3.
    thumbnail = decoded[0].pixels
    assert thumbnail.shape[:2] == (30, 40)
    assert 30 * 40 * 3 + HEADER_BYTES < R * R * 3 // 10


def test_a_cached_entry_is_placed_back_as_it_was_read(images: list[bytes]) -> None:
    """A row kept by a cache (its record and pixels) and written into another batch's slot
    reads as the original."""
    first, slots = packed_slot(images[:4])
    entries = [slots.entry(i) for i in range(4)]
    assert all(e.flags.owndata for e in entries)
    memory = np.zeros_like(slots.memory)
    again = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=4, row_side=R)
    again.reset(0)
    for i in (2, 0, 3, 1):
        again.write_entry(i, entries[i])
    second = torch.from_numpy(memory.reshape(first.shape))
    with torch.inference_mode():
        resampler = PackedResampler(R, S, S, C)
        assert torch.equal(resampler(second), resampler(first))


def test_a_slot_refuses_what_it_cannot_hold_and_a_reset_empties_it(images: list[bytes]) -> None:
    big, _ = decode_row(images[-9], DecodeSpec(size=S), R)  # a DCT-scaled photo
    side = packed_side(R)
    memory = np.zeros((1, side * side * 3), dtype=np.uint8)
    slots = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=1, row_side=R)
    slots.reset(0)
    # Even one row of the largest size fits a slot of one (B = 1).
    largest = np.zeros((R - 1, R, 3), dtype=np.uint8)
    slots.write(0, replace(big, pixels=largest))
    with pytest.raises(SlotFull, match="no room"):
        slots.write(0, big)
    slots.reset(0)
    assert slots.used_bytes(0) == HEADER_BYTES
    slots.write(0, big)


@pytest.mark.parametrize("written", [1, 3, 8])
def test_a_smaller_batch_shape_reads_the_same_pixels_from_the_rows_the_slot_spans(
    images: list[bytes], written: int
) -> None:
    """A batch of `written` images in a slot of 64 rows runs on a shape of its first k rows
    (worker/model/sizes.py): k holds its rows and every byte their lines reach, so the step
    reads from them what it reads from the whole slot. Images of the largest size a row
    holds, (R - 1) x R, take more rows than they are, with the header of 64 records."""
    largest = DecodeSpec(size=S, dct_scaling=False), [jpeg_bytes(R, R - 1, seed=3)] * written
    for spec, chosen in ((DecodeSpec(size=S), images[:written]), largest):
        slot, slots = packed_slot(chosen, batch=64, spec=spec)
        k = max(written, slots.rows_spanned(0))
        with torch.inference_mode():
            want = PackedResampler(R, S, S, C)(slot)[:written]
            got = PackedResampler(R, S, S, C)(slot[:k])[:written]
        assert torch.equal(got, want)
        reach = slots.used_bytes(0) + R * 3
        assert (k - 1) * slot[0].numel() < reach <= k * slot[0].numel() or k == written
    if written == 1:
        # One image of the largest size and the header of 64 records reach a second row.
        assert k == 2


def test_unwritten_and_damaged_records_read_inside_the_slot() -> None:
    """A padded row's record is zeros; random bytes anywhere (a record never written right)
    give finite pixels and no read outside the slot."""
    gen = torch.Generator().manual_seed(0)
    side = packed_side(R)
    slot = torch.randint(0, 256, (6, side, side, 3), dtype=torch.uint8, generator=gen)
    slot.view(-1)[: 2 * HEADER_BYTES] = 0
    with torch.inference_mode():
        out = PackedResampler(R, S, S, C)(slot)
    assert out.shape == (6, 3, C, C) and torch.isfinite(out).all()
    assert out.min() >= 0 and out.max() <= 255


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_captured_packed_resampling_matches_the_cpu(images: list[bytes]) -> None:
    slot, _ = packed_slot(images)
    with torch.inference_mode():
        want = PackedResampler(R, S, S, C)(slot)
    resampler = PackedResampler(R, S, S, C).cuda()
    compiled = torch.compile(resampler, mode="reduce-overhead", fullgraph=True, dynamic=False)
    on_device = slot.cuda()
    with torch.inference_mode():
        for _ in range(3):  # record, then replay the graph
            got = compiled(on_device)
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=0)


def slot_rows(row_side: int) -> st.SearchStrategy[tuple[int, list[tuple[int, int, bool]]]]:
    """(R, one (h, w, from the GPU) per row of the batch): the largest image often, as the
    promise is about the worst case."""
    h = st.just(row_side - 1) | st.integers(1, row_side - 1)
    w = st.just(row_side) | st.integers(1, row_side)
    rows = st.lists(st.tuples(h, w, st.booleans()), min_size=1, max_size=64)
    return st.tuples(st.just(row_side), rows)


# The worst cases: the smallest R whose slot holds its promise, every row the largest
# image and the GPU's (its alignment gaps come out of the slot's spare bytes).
@example(case=(12, [(11, 12, True)]))
@example(case=(12, [(11, 12, True)] * 64))
@settings(max_examples=60, deadline=None)
@given(case=st.integers(12, 300).flatmap(slot_rows))
def test_any_b_rows_of_up_to_r_minus_1_by_r_fit_whichever_end_they_take(
    case: tuple[int, list[tuple[int, int, bool]]],
) -> None:
    """The slot's promise with GPU rows in it: B images of up to (R - 1) x R pixels always
    fit, each from either end (the GPU's from the top, on the slot's device alignment);
    no two places overlap, and the host's copy (the bottom's bytes) reaches no GPU row."""
    row_side, rows = case
    batch = len(rows)
    side = packed_side(row_side)
    memory = np.zeros((1, batch * side * side * 3), dtype=np.uint8)
    slots = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=batch, row_side=row_side)
    slots.reset(0)
    decoded, _ = decode_row(jpeg_bytes(8, 8), DecodeSpec(size=8), row_side)
    places = []
    for row, (h, w, gpu) in enumerate(rows):
        size = h * w * 3
        if gpu:
            offset = slots.place_on_device(row, size)
            assert offset % slots.device_align == 0
            places.append((offset, size, "gpu"))
        else:
            slots.write(row, replace(decoded, pixels=np.zeros((h, w, 3), dtype=np.uint8)))
            record = memory[0, row * HEADER_BYTES : (row + 1) * HEADER_BYTES].view("<i4")
            places.append((int(record[OFFSET_WORD]), size, "host"))
    places.sort()
    for (a, size, _), (b, _, _) in itertools.pairwise(places):
        assert a + size <= b
    copied = slots.used_bytes(0)
    assert all(offset >= copied for offset, _, kind in places if kind == "gpu")
    assert slots.header_bytes <= places[0][0] and places[-1][0] + places[-1][1] <= (
        slots.header_bytes + slots.capacity
    )


@settings(max_examples=30, deadline=None)
@given(case=st.integers(12, 64).flatmap(slot_rows), already=st.integers(0, 3))
def test_a_batch_placed_at_once_is_placed_as_one_at_a_time_would_be(
    case: tuple[int, list[tuple[int, int, bool]]], already: int
) -> None:
    """The GPU lane places a batch's rows under one lock: the same offsets, records and
    counters as placing them in turn, a row with no room left (-1) included, its record
    untouched. The slot may hold host rows already; each row's geometry, where given, is
    recorded with its place."""
    row_side, rows = case
    batch = len(rows)
    side = packed_side(row_side)
    # Twice the rows' room: the later rows of a large batch find none left.
    sizes = [2 * h * w * 3 for h, w, _ in rows]
    geometries = [(i, 2, 3, 4, 5, 6, 7) if gpu else None for i, (_, _, gpu) in enumerate(rows)]
    decoded, _ = decode_row(jpeg_bytes(8, 8), DecodeSpec(size=8), row_side)
    slots = []
    for _ in range(2):
        memory = np.zeros((1, batch * side * side * 3), dtype=np.uint8)
        one = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=batch, row_side=row_side)
        one.reset(0)
        for row in range(min(already, batch)):
            one.write(row, replace(decoded, pixels=np.zeros((row_side - 1, row_side, 3), np.uint8)))
        slots.append(one)
    together = slots[0].place_rows_on_device(list(range(batch)), sizes, geometries)
    in_turn = []
    for row, size, geometry in zip(range(batch), sizes, geometries, strict=True):
        try:
            in_turn.append(slots[1].place_on_device(row, size, geometry))
        except SlotFull:
            in_turn.append(-1)
    assert together == in_turn
    assert np.array_equal(slots[0].memory, slots[1].memory)
    assert np.array_equal(slots[0].fill, slots[1].fill)
