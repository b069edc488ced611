"""Batched GPU decode into packed rows (worker/decode/gpu_packed.py).

The real nvImageCodec runs here on its CPU-only backend: the same `decode` call, the same
caller buffers, the same None for a bad image, EXIF applied; only the streams and the
hardware engines need a GPU. A fake backend pins the order of the work on the streams.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from structlog.testing import capture_logs

from measure.bench.accuracy import CROP, SIDE, STAGING, oriented_jpeg
from tests.decode.test_gpu_decode import jpeg_turned_only_by_its_second_exif
from tests.support.images import jpeg_bytes
from worker.decode import nvimgcodec as nvimgcodec_module
from worker.decode.codecs import GpuEnginesUnavailable, Place
from worker.decode.cpu import DecodeSpec
from worker.decode.gpu_packed import LANE_SWITCH_INTERVAL_S, DeferredRow, PackedGpuDecoder
from worker.decode.nvimgcodec import GPU_BACKENDS, NvImgCodec
from worker.decode.packed import BYTES_WORD, HEADER_BYTES, OFFSET_WORD, PackedSlots, packed_side
from worker.decode.rows import decode_row, gpu_placement
from worker.model.resample import PackedResampler

S, C, R = STAGING, CROP, SIDE
SPEC = DecodeSpec(size=S)
CPU = torch.device("cpu")


def nvimgcodec_or_skip() -> None:
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")


def new_slots(batch: int) -> PackedSlots:
    side = packed_side(R)
    memory = np.zeros((1, batch * side * side * 3), dtype=np.uint8)
    slots = PackedSlots(memory, np.zeros((1, 2), dtype=np.int64), batch=batch, row_side=R)
    slots.reset(0)
    return slots


def step_input(slots: PackedSlots) -> torch.Tensor:
    side = packed_side(R)
    slot = torch.from_numpy(slots.memory.reshape(slots.batch, side, side, 3))
    with torch.inference_mode():
        return PackedResampler(R, S, S, C)(slot)


def deferred(row: int, data: bytes | memoryview) -> DeferredRow:
    placed = gpu_placement(data, SPEC, R)
    assert placed is not None
    return DeferredRow(row, data, placed.height, placed.width, placed.geometry)


def cpu_only_decoder(slots: PackedSlots) -> PackedGpuDecoder:
    return PackedGpuDecoder(slots, lambda: NvImgCodec(None), device=CPU)


def twin_of(slots: PackedSlots) -> torch.Tensor:
    # Off CUDA the step reads the host slot in place: it is the "twin" the decoder writes.
    return torch.from_numpy(slots.memory[0])


def grey_jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg_bytes(width, height))).convert("L").save(buf, "JPEG")
    return buf.getvalue()


def test_gpu_rows_give_the_pixels_cpu_rows_give() -> None:
    """Native-size JPEGs in every EXIF orientation, grey among them, decoded by the real
    library into half of a batch while the CPU writes the other half: the step's input
    equals the all-CPU slot's, row for row: the same pixels, turned by the decoder instead
    of the resampler (which leaves float rounding apart, 1e-4 of a pixel value)."""
    nvimgcodec_or_skip()
    images = [oriented_jpeg(150, 112, o, seed=o) for o in range(1, 9)]
    images += [oriented_jpeg(100, 100, 6, seed=9), grey_jpeg(120, 90)]
    everything = new_slots(len(images))
    for i, data in enumerate(images):
        everything.write(i, decode_row(data, SPEC, R)[0])
    mixed = new_slots(len(images))
    for i in range(1, len(images), 2):
        mixed.write(i, decode_row(images[i], SPEC, R)[0])
    decoder = cpu_only_decoder(mixed)
    try:
        rows = [deferred(i, images[i]) for i in range(0, len(images), 2)]
        result = decoder.decode_sync(rows, twin_of(mixed))
    finally:
        decoder.shutdown()
    assert result.failed == []
    assert result.decoded == [r.row for r in rows]
    got, want = step_input(mixed), step_input(everything)
    assert torch.equal(got[1::2], want[1::2])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_bad_image_fails_alone_and_reads_empty() -> None:
    """Truncated JPEGs (their headers whole, so they were routed here: one ends with its
    header, one half way through its scan) come back failed, their records cleared for the
    CPU decoders; the rows around them are decoded."""
    nvimgcodec_or_skip()
    good = [jpeg_bytes(96, 64, seed=i) for i in range(3)]
    header_end = good[0].index(b"\xff\xda") + 20
    truncated = good[0][:header_end]
    half = good[1][: len(good[1]) // 2]
    # Payload memory reaches the decoder as memoryviews: taken as they are.
    datas: list[bytes | memoryview] = [good[0], truncated, memoryview(good[1]), half, good[2]]
    slots = new_slots(len(datas))
    decoder = cpu_only_decoder(slots)
    try:
        result = decoder.decode_sync([deferred(i, d) for i, d in enumerate(datas)], twin_of(slots))
    finally:
        decoder.shutdown()
    assert sorted(result.failed) == [1, 3]
    assert result.decoded == [0, 2, 4]
    records = slots.memory[0, : slots.header_bytes].view("<i4").reshape(len(datas), -1)
    assert not records[1].any() and not records[3].any()
    reference = new_slots(len(datas))
    for i in (0, 2, 4):
        reference.write(i, decode_row(bytes(datas[i]), SPEC, R)[0])
    assert torch.equal(step_input(slots), step_input(reference))


def test_a_row_the_library_turns_otherwise_than_its_place_goes_back_to_the_cpu() -> None:
    """nvImageCodec reshapes a place to what it decoded and reports success: a JPEG whose
    EXIF it reads otherwise than the decode process did (its second EXIF segment turns it),
    and a place given with its sides swapped, come back failed, their records cleared for
    the CPU decoders and counted; the rows beside them are the CPU's pixels."""
    nvimgcodec_or_skip()
    turned = jpeg_turned_only_by_its_second_exif(150, 112)
    plain = jpeg_bytes(96, 64, seed=5)
    images = [jpeg_bytes(120, 90, seed=1), turned, plain, jpeg_bytes(100, 100, seed=2)]
    slots = new_slots(len(images))
    rows = [deferred(i, data) for i, data in enumerate(images)]
    assert (rows[1].height, rows[1].width) == (112, 150)  # as the process read it: unturned
    rows[2] = DeferredRow(2, plain, 96, 64, rows[2].geometry)  # its sides swapped
    decoder = cpu_only_decoder(slots)
    try:
        with capture_logs() as logs:
            result = decoder.decode_sync(rows, twin_of(slots))
    finally:
        decoder.shutdown()
    assert sorted(result.failed) == [1, 2]
    assert result.decoded == [0, 3]
    assert (decoder.wrong_shape, decoder.failed) == (2, 2)
    records = slots.memory[0, : slots.header_bytes].view("<i4").reshape(len(images), -1)
    assert not records[1].any() and not records[2].any()
    [event] = [e for e in logs if e["event"] == "gpu_decode_wrong_shape"]
    assert event["rows"] == [1, 2] and event["decoded"] == [(150, 112, 3), (64, 96, 3)]
    reference = new_slots(len(images))
    for i in (0, 3):
        reference.write(i, decode_row(images[i], SPEC, R)[0])
    torch.testing.assert_close(step_input(slots), step_input(reference), rtol=0, atol=1e-4)


class DecoderCalls:
    """nvImageCodec's Decoder as the lane's code builds it: each call's arguments kept, the
    library's own class built (or, with `answer`, that stands in for what it returns)."""

    def __init__(self, real: Any, answer: Any = None) -> None:
        self.real, self.answer = real, answer
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.answer if self.answer is not None else self.real(**kwargs)

    def kinds(self, i: int) -> list[str]:
        return [b.backend_kind.name for b in self.calls[i]["backends"]]


@pytest.fixture
def decoder_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecoderCalls]:
    nvimgcodec_or_skip()
    import nvidia.nvimgcodec as nvimgcodec

    calls = DecoderCalls(nvimgcodec.Decoder)
    monkeypatch.setattr(nvimgcodec, "Decoder", calls)
    monkeypatch.setattr(nvimgcodec_module, "_engines", {})  # what a fresh process asks
    yield calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU backend answers here")
def test_a_lane_whose_gpu_backends_do_not_answer_refuses_to_start_and_says_so(
    decoder_calls: DecoderCalls,
) -> None:
    """Where nvImageCodec loads but none of its GPU backends decodes (here: no CUDA; on a
    GPU host: libnvjpeg missing), the lane asks each GPU backend alone, with one thread,
    never the CPU one, logs what answered once for both lanes, and does not start: GPU
    decode never runs CPU-only without a word (the worker then says why, as for a missing
    nvImageCodec)."""
    slots = new_slots(2)
    with capture_logs() as logs, pytest.raises(GpuEnginesUnavailable) as raised:
        PackedGpuDecoder(slots, lambda: NvImgCodec(torch.device("cuda", 0)), device=CPU)
    assert "none of its GPU backends (HW_GPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU)" in str(raised.value)
    assert "nvjpeg" in str(raised.value)
    assert [decoder_calls.kinds(i) for i in range(3)] == [[k] for k in GPU_BACKENDS]
    assert all(c["max_num_cpu_threads"] == 1 and c["device_id"] == 0 for c in decoder_calls.calls)
    [event] = [e for e in logs if e["event"] == "gpu_decode_engines"]
    assert event["engines"] == dict.fromkeys(GPU_BACKENDS, False)
    assert event["hardware_engines_answered"] is False
    assert event["log_level"] == "warning" and set(event["why_not"]) == set(GPU_BACKENDS)
    with capture_logs() as again, pytest.raises(GpuEnginesUnavailable):
        NvImgCodec(torch.device("cuda", 0))  # the other lane: asked once per process
    assert len(decoder_calls.calls) == 3 and again == []


def test_a_lane_decodes_with_the_gpu_backends_that_answered_and_one_thread(
    decoder_calls: DecoderCalls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane's decoder takes exactly the GPU backends that decoded at start-up and one
    executor thread, and says which answered (the GPU check reports them); the CPU-only
    decoder of the tests takes one thread too."""
    answered = {"HW_GPU_ONLY": True, "GPU_ONLY": False, "HYBRID_CPU_GPU": True}
    monkeypatch.setattr(nvimgcodec_module, "backend_engines", lambda *a, **k: dict(answered))
    decoder_calls.answer = object()  # no decoder of these backends can be built here
    decoder = PackedGpuDecoder(
        new_slots(2), lambda: NvImgCodec(torch.device("cuda", 0)), device=CPU
    )
    decoder.shutdown()
    assert len(decoder_calls.calls) == 2  # one per lane
    assert decoder_calls.kinds(0) == ["HW_GPU_ONLY", "HYBRID_CPU_GPU"]
    assert decoder_calls.calls[0]["max_num_cpu_threads"] == 1
    assert decoder_calls.calls[0]["device_id"] == 0
    assert decoder.engines == answered and decoder.hardware_engines_answered
    assert decoder.backend_name.endswith("(HW_GPU_ONLY, HYBRID_CPU_GPU)")
    decoder_calls.answer = None
    cpu_only = NvImgCodec(None)
    assert decoder_calls.kinds(2) == ["CPU_ONLY"] and cpu_only.engines == {}
    assert decoder_calls.calls[2]["max_num_cpu_threads"] == 1


def test_lanes_on_cuda_shorten_the_interpreters_switch_interval() -> None:
    """nvImageCodec hands the GIL over several times per image within a call: lanes on CUDA
    bound each wait for it by a short switch interval (never lengthening one set shorter);
    off CUDA nothing changes."""

    def lanes_on(device: torch.device) -> None:
        PackedGpuDecoder(
            new_slots(2),
            lambda: FakeBackend([], [True]),
            device=device,
            make_stream=lambda: None,
            record=lambda stream: "ready",
        ).shutdown()

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        lanes_on(CPU)
        assert sys.getswitchinterval() == 0.005
        lanes_on(torch.device("cuda", 0))
        assert sys.getswitchinterval() == pytest.approx(LANE_SWITCH_INTERVAL_S)
        sys.setswitchinterval(LANE_SWITCH_INTERVAL_S / 2)
        lanes_on(torch.device("cuda", 0))
        assert sys.getswitchinterval() == pytest.approx(LANE_SWITCH_INTERVAL_S / 2)
    finally:
        sys.setswitchinterval(before)


def test_gpu_rows_are_placed_where_the_host_copy_never_reaches() -> None:
    """A GPU row takes its bytes from the top of the slot: the bytes the host copies (the
    header and what the CPU wrote) stay as they were, and a batch with a GPU row is read
    over the whole slot."""
    nvimgcodec_or_skip()
    slots = new_slots(4)
    cpu_row, _ = decode_row(jpeg_bytes(96, 64, seed=1), SPEC, R)
    slots.write(0, cpu_row)
    host_bytes = slots.used_bytes(0)
    before = slots.memory[0, HEADER_BYTES * 4 : host_bytes].copy()
    assert slots.rows_spanned(0) < 4
    decoder = cpu_only_decoder(slots)
    try:
        decoder.decode_sync([deferred(1, jpeg_bytes(150, 112, seed=2))], twin_of(slots))
    finally:
        decoder.shutdown()
    assert slots.used_bytes(0) == host_bytes
    assert np.array_equal(slots.memory[0, HEADER_BYTES * 4 : host_bytes], before)
    assert slots.rows_spanned(0) == 4
    record = slots.memory[0, HEADER_BYTES : 2 * HEADER_BYTES].view("<i4")
    assert record[7] >= host_bytes + R * 3 and record[8] == 150 * 112 * 3


def test_only_what_the_hardware_takes_as_it_is_is_placed_on_the_gpu() -> None:
    """Baseline grey or YCbCr JPEGs that fit a row go to the GPU, upright (EXIF turns the
    size); progressive, CMYK, too large for a row or over a limit go to the CPU."""

    def saved(mode: str, **options: Any) -> bytes:
        buf = io.BytesIO()
        Image.open(io.BytesIO(jpeg_bytes(96, 64))).convert(mode).save(buf, "JPEG", **options)
        return buf.getvalue()

    placed = gpu_placement(oriented_jpeg(150, 112, 6, seed=1), SPEC, R)
    assert placed is not None and (placed.height, placed.width) == (150, 112)
    assert placed.geometry[:3] == (150, 112, 1)
    assert gpu_placement(saved("L"), SPEC, R) is not None
    assert gpu_placement(saved("RGB", subsampling=0), SPEC, R) is not None  # 4:4:4
    assert gpu_placement(saved("RGB", progressive=True), SPEC, R) is None
    assert gpu_placement(saved("CMYK"), SPEC, R) is None
    assert gpu_placement(jpeg_bytes(R + 1, 64), SPEC, R) is None
    assert gpu_placement(jpeg_bytes(96, 64), DecodeSpec(size=S, max_pixels=96 * 63), R) is None
    assert gpu_placement(b"\x89PNG\r\n\x1a\n" + bytes(64), SPEC, R) is None
    assert gpu_placement(saved("L")[:40], SPEC, R) is None


class FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.cuda_stream = log, name, id(self)

    def wait_event(self, event: Any) -> None:
        self.log.append(f"{self.name} waits {event}")


class FakeBackend:
    name = "fake"

    def __init__(self, log: list[str], answers: Sequence[bool] | Exception) -> None:
        self.log, self.answers = log, answers

    def decode_into(
        self, datas: Sequence[Any], twin: torch.Tensor, places: Sequence[Place], stream: int
    ) -> list[bool]:
        self.log.append(f"decode {len(datas)} on {stream}")
        if isinstance(self.answers, Exception):
            raise self.answers
        for offset, height, width in places:
            twin[offset : offset + height * width * 3].fill_(7)
        return list(self.answers)


def fake_decoder(
    slots: PackedSlots, log: list[str], answers: Sequence[bool] | Exception
) -> tuple[PackedGpuDecoder, list[FakeStream]]:
    streams: list[FakeStream] = []

    def make_stream() -> FakeStream:
        streams.append(FakeStream(log, f"s{len(streams)}"))
        return streams[-1]

    def record(stream: FakeStream) -> str:
        log.append(f"{stream.name} records ready")
        return "ready"

    decoder = PackedGpuDecoder(
        slots,
        lambda: FakeBackend(log, answers),
        device=CPU,
        make_stream=make_stream,
        record=record,
    )
    return decoder, streams


@pytest.mark.parametrize(
    ("answers", "failed"),
    [([True, True], []), ([True, False], [1]), (RuntimeError("engine lost"), [0, 1])],
)
def test_the_writes_wait_for_the_twins_last_read_and_the_step_waits_for_them(
    answers: Sequence[bool] | Exception, failed: list[int]
) -> None:
    """On the lane's own stream: first the wait for the event after the twin's last read,
    then the decode, then the event the step waits for; on every exit path, a raise too
    (rows it failed are cleared and returned for the CPU)."""
    slots = new_slots(2)
    log: list[str] = []
    decoder, streams = fake_decoder(slots, log, answers)
    rows = [deferred(i, jpeg_bytes(96, 64, seed=i)) for i in range(2)]
    try:
        result = decoder.decode_sync(rows, twin_of(slots), after="consumed")  # type: ignore[arg-type]
    finally:
        decoder.shutdown()
    lane = next(s for s in streams if s.name in log[0])
    assert log == [
        f"{lane.name} waits consumed",
        f"decode 2 on {lane.cuda_stream}",
        f"{lane.name} records ready",
    ]
    assert result.ready == "ready"
    assert sorted(result.failed) == failed
    assert result.decoded == [r for r in (0, 1) if r not in failed]
    records = slots.memory[0, : slots.header_bytes].view("<i4").reshape(2, -1)
    for row in failed:
        assert not records[row].any()


def test_the_decoders_call_runs_inside_the_lane_scope_the_sync_window_reads() -> None:
    """What the backend does on the lane (here: writing its outputs) lies inside the
    profiler range the GPU check's sync window reads, on the lane's thread: a wait the
    decoder makes there is reported as the lane's own."""
    from worker.decode.gpu_packed import LANE_SCOPE
    from worker.tools.harness.instruments import _inside, _raw_events, sync_profiler

    slots = new_slots(2)
    decoder, _ = fake_decoder(slots, [], [True, True])
    rows = [deferred(i, jpeg_bytes(96, 64, seed=i)) for i in range(2)]
    try:
        with sync_profiler(cuda=False) as prof:
            decoder._executor.submit(decoder.decode_sync, rows, twin_of(slots)).result(20)
    finally:
        decoder.shutdown()
    events = _raw_events(prof)
    scopes = [e for e in events if e.name == LANE_SCOPE]
    writes = [e for e in events if e.name == "aten::fill_"]
    assert len(scopes) == 1 and len(writes) == 2
    assert all(_inside(w, scopes[0]) for w in writes)


def test_the_outputs_are_the_places_the_records_name_in_a_twin_that_is_a_view() -> None:
    """A slot's twin may be a view into a larger buffer (it starts past the storage's
    start): each row's pixels land at its record's offset from the twin's start, and
    nothing is written outside the rows' places."""
    slots = new_slots(3)
    decoder, _ = fake_decoder(slots, [], [True, True, True])
    pad = 1000
    backing = torch.zeros(pad + slots.slot_bytes, dtype=torch.uint8)
    twin = backing[pad:]
    rows = [deferred(i, jpeg_bytes(96 - 8 * i, 64, seed=i)) for i in range(3)]
    try:
        result = decoder.decode_sync(rows, twin)
    finally:
        decoder.shutdown()
    assert result.decoded == [0, 1, 2]
    records = slots.memory[0, : slots.header_bytes].view("<i4").reshape(3, -1)
    written = torch.zeros_like(backing, dtype=torch.bool)
    for r in rows:
        offset, size = int(records[r.row, OFFSET_WORD]), int(records[r.row, BYTES_WORD])
        assert size == r.height * r.width * 3
        assert bool((twin[offset : offset + size] == 7).all())
        written[pad + offset : pad + offset + size] = True
    assert not bool(backing[~written].any())


def test_two_lanes_decode_side_by_side_each_on_its_own_stream() -> None:
    """Two batches in flight at once take the two lanes (a decoder is never shared between
    threads): each call runs on a stream no other running call holds."""
    import threading

    slots = new_slots(4)
    log: list[str] = []
    both_in = threading.Barrier(2, timeout=10)

    class Meeting(FakeBackend):
        def decode_into(
            self, datas: Sequence[Any], twin: torch.Tensor, places: Sequence[Place], stream: int
        ) -> list[bool]:
            both_in.wait()  # only returns once two calls run at once
            return super().decode_into(datas, twin, places, stream)

    streams: list[FakeStream] = []

    def make_stream() -> FakeStream:
        streams.append(FakeStream(log, f"s{len(streams)}"))
        return streams[-1]

    decoder = PackedGpuDecoder(
        slots,
        lambda: Meeting(log, [True]),
        device=CPU,
        make_stream=make_stream,
        record=lambda stream: "ready",
    )
    twin = twin_of(slots)
    try:
        calls = [
            decoder._executor.submit(decoder.decode_sync, [deferred(i, jpeg_bytes(96, 64))], twin)
            for i in (0, 2)
        ]
        results = [c.result(timeout=20) for c in calls]
    finally:
        decoder.shutdown()
    assert [r.decoded for r in results] == [[0], [2]]
    used = {line.split(" on ")[1] for line in log if line.startswith("decode")}
    assert used == {str(s.cuda_stream) for s in streams} and len(streams) == 2


async def test_the_processes_leave_the_share_spread_over_batches_and_only_what_fits() -> None:
    """A GPU decode share of 0.5 over two groups of image, path and url jobs: every
    second image job offered (the fraction left over carries to the next group), offered
    baseline JPEGs left DEFERRED with their upright size, offered others decoded; path and
    url jobs never offered; `gpu=False` offers none."""
    from worker.decode.arena import ArenaLayout, SharedArena
    from worker.decode.processes import ProcessDecodePool
    from worker.jobs import Job

    side = packed_side(R)
    arena = SharedArena.create(ArenaLayout(rows=16, side=side, processes=1, batch=8))
    packed = arena.packed
    assert packed is not None
    pool = ProcessDecodePool(SPEC, 1, None, arena=arena, budget_s=5, row_side=R)
    pool.gpu_share = 0.5

    def job(i: int, data: bytes, **more: Any) -> Job:
        fields: dict[str, Any] = {"image": data, "path": None, **more}
        return Job.new(entry_id=f"{i}-0", job_id=f"j{i}", reply_to="r", meta=None, **fields)

    progressive = io.BytesIO()
    Image.open(io.BytesIO(jpeg_bytes(96, 64))).save(progressive, "JPEG", progressive=True)
    first = [
        job(0, jpeg_bytes(96, 64, seed=0)),
        job(1, oriented_jpeg(150, 112, 6, seed=1)),
        job(2, jpeg_bytes(96, 64, seed=2)),
        job(3, progressive.getvalue()),
        job(4, jpeg_bytes(96, 64, seed=4), url="http://127.0.0.1:1/a.jpg"),
        job(5, jpeg_bytes(96, 64, seed=5)),
    ]
    second = [job(10 + i, jpeg_bytes(96, 64, seed=10 + i)) for i in range(3)]
    try:
        for slot in (0, 1):
            packed.reset(slot)
        got = await pool.settle([pool.submit_rows(first, arena.rows[:6])])
        more = await pool.settle([pool.submit_rows(second, arena.rows[8:11])])
        none = await pool.settle([pool.submit_rows(second, arena.rows[11:14], gpu=False)])
    finally:
        pool.shutdown()
        arena.close()
    left = [i for i, r in enumerate(got) if r.gpu is not None]
    # Offered: image jobs 0, 1, 2, 3, 5 (not the url job) -> the 2nd and 4th, 1 and 3; the
    # progressive 3 is decoded here. The half left over makes the next group's first offered.
    assert left == [1]
    assert got[3].error is None and got[3].gpu is None
    rotated = got[1].gpu
    assert isinstance(rotated, DeferredRow) and (rotated.height, rotated.width) == (150, 112)
    assert rotated.row == 1 and bytes(rotated.data) == first[1].image
    assert [i for i, r in enumerate(more) if r.gpu is not None] == [0, 2]
    assert all(r.gpu is None and r.error is None for r in none)
    assert pool.deferred == 3


def test_the_split_moves_toward_the_decoder_that_kept_the_dispatcher_waiting_less() -> None:
    from worker.decode.split import STEP, WINDOW, DecodeSplit

    seen: list[float] = []
    split = DecodeSplit(0.5, tune=True, on_change=seen.append)
    assert seen == [0.5]
    for _ in range(WINDOW):  # waited for the GPU's rows: the GPU gets less
        split.observe(cpu_wait_s=0.001, gpu_wait_s=0.004)
    assert split.share == pytest.approx(0.5 - STEP) and seen[-1] == split.share
    for _ in range(3 * WINDOW):  # waited for the CPU's rows: the GPU gets more
        split.observe(cpu_wait_s=0.01, gpu_wait_s=0.0)
    assert split.share == pytest.approx(0.5 + 2 * STEP)
    before = split.adjustments
    for _ in range(5 * WINDOW):  # neither kept it waiting (the model binds): no move
        split.observe(cpu_wait_s=0.00001, gpu_wait_s=0.0)
    assert split.adjustments == before
    for _ in range(100 * WINDOW):  # never past 1
        split.observe(cpu_wait_s=1.0, gpu_wait_s=0.0)
    assert split.share == 1.0
    fixed = DecodeSplit(0.3, tune=False, on_change=seen.append)
    for _ in range(10 * WINDOW):
        fixed.observe(cpu_wait_s=1.0, gpu_wait_s=0.0)
    assert fixed.share == 0.3 and fixed.adjustments == 0


async def test_thumbnails_get_a_share_of_their_own() -> None:
    """Where the GPU's rate on thumbnails gives it a smaller share of them than of photos,
    the processes decode the rest of the thumbnails offered (every other one at half),
    spread evenly; larger images are left to the GPU as offered."""
    from worker.decode.arena import ArenaLayout, SharedArena
    from worker.decode.gpu_packed import DecodeRates
    from worker.decode.processes import ProcessDecodePool
    from worker.decode.rows import THUMBNAIL_PIXELS
    from worker.jobs import Job

    rates = DecodeRates(
        "640x480",
        gpu_images_per_s=6000.0,
        cpu_images_per_s=4000.0,
        processes=8,
        thumbnail_gpu_images_per_s=20_000.0,
        thumbnail_cpu_images_per_s=80_000.0,
    )
    assert rates.share == pytest.approx(0.6) and rates.thumbnail_share == pytest.approx(0.2)
    assert rates.thumbnail_accept == pytest.approx(1 / 3)

    side = packed_side(R)
    arena = SharedArena.create(ArenaLayout(rows=8, side=side, processes=1, batch=8))
    assert arena.packed is not None
    pool = ProcessDecodePool(SPEC, 1, None, arena=arena, budget_s=5, row_side=R)
    pool.gpu_share = 1.0
    pool.gpu_thumbnail_accept = 0.5
    photo = jpeg_bytes(192, 190, seed=9)
    assert 192 * 190 > THUMBNAIL_PIXELS >= 96 * 64
    datas = [jpeg_bytes(96, 64, seed=i) for i in range(4)] + [photo, photo]
    jobs = [
        Job.new(entry_id=f"{i}-0", job_id=f"j{i}", reply_to="r", meta=None, image=d, path=None)
        for i, d in enumerate(datas)
    ]
    try:
        arena.packed.reset(0)
        got = await pool.settle([pool.submit_rows(jobs, arena.rows[: len(jobs)])])
    finally:
        pool.shutdown()
        arena.close()
    assert [r.gpu is not None for r in got] == [False, True, False, True, True, True]
    assert all(r.error is None for r in got)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_device_buffers_describe_themselves_as_torch_does() -> None:
    """What nvImageCodec reads from the description each output place gives it (no tensor
    view made) is the torch view of the same bytes: its pointer, shape, byte strides and
    type, in device memory, on the lane's own stream (a buffer tied to another stream would
    make the library wait for that one on the host)."""
    nvimgcodec_or_skip()
    import nvidia.nvimgcodec as nvimgcodec

    from worker.decode.gpu_packed import _DeviceImage

    twin = torch.empty(4096, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    offset, height, width = 256, 10, 20
    view = twin[offset : offset + height * width * 3].view(height, width, 3)
    described = _DeviceImage(twin.data_ptr() + offset, height, width, stream.cuda_stream)
    image = nvimgcodec.as_image(described, cuda_stream=stream.cuda_stream)
    assert image.buffer_kind == nvimgcodec.ImageBufferKind.STRIDED_DEVICE
    assert image.__cuda_array_interface__["data"][0] == view.data_ptr()
    assert tuple(image.shape) == tuple(view.shape) == (height, width, 3)
    assert tuple(image.strides) == tuple(s * view.element_size() for s in view.stride())
    assert np.dtype(image.dtype) == np.uint8
    assert image.cuda_stream == stream.cuda_stream
    assert image.device_id == twin.device.index


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_jpeg_engines_write_the_rows_the_cpu_would() -> None:
    """nvImageCodec on the GPU (the hardware engines where the GPU has them) decodes a
    batch's rows into a device twin at their records' places, each EXIF orientation and
    grey among them: read back into the host slot, the step's input is the all-CPU one's
    within the decoders' rounding, row by row."""
    nvimgcodec_or_skip()
    device = torch.device("cuda", 0)
    images = [oriented_jpeg(150, 112, o, seed=o) for o in range(1, 9)]
    images += [grey_jpeg(120, 90), jpeg_bytes(R, R - 1, seed=3)]
    everything = new_slots(len(images))
    for i, data in enumerate(images):
        everything.write(i, decode_row(data, SPEC, R)[0])
    slots = new_slots(len(images))
    twin = torch.zeros(slots.slot_bytes, dtype=torch.uint8, device=device)
    decoder = PackedGpuDecoder(slots, lambda: NvImgCodec(torch.device("cuda", 0)), device=device)
    try:
        rows = [deferred(i, data) for i, data in enumerate(images)]
        result = decoder.decode_sync(rows, twin)
        assert result.ready is not None
        result.ready.synchronize()  # type: ignore[attr-defined]
    finally:
        decoder.shutdown()
    assert result.failed == [] and result.decoded == list(range(len(images)))
    # The device's bytes where the records say, as the step would read them.
    slots.memory[0, slots.header_bytes :] = twin.cpu().numpy()[slots.header_bytes :]
    got, want = step_input(slots), step_input(everything)
    # Per row, the GPU check's measure of decoders that agree (a misplaced row is ~50 off).
    per_row = (got - want).abs().flatten(1).mean(1)
    assert per_row.tolist() == pytest.approx([0.0] * len(images), abs=4.0)


def test_the_gpu_checks_engine_rates_time_each_size_and_count_a_batchs_syncs() -> None:
    """The check's decode-only rates of the GPU decoder per image size, here through
    nvImageCodec's CPU-only backend: every image decoded, a rate per size, and the host
    syncs of one photo batch counted (none off CUDA)."""
    nvimgcodec_or_skip()
    from measure.gpu_check.engine_rates import engine_rates
    from worker.tools.harness.instruments import count_host_syncs

    found = engine_rates(
        CPU,
        seconds=0.05,
        sizes=((64, 64, 4, 2), (640, 480, 2, 1)),
        make_backend=lambda: NvImgCodec(None),
        count_syncs=count_host_syncs,
    )
    assert found["backend"].endswith("(cpu only)")
    assert [s["image"] for s in found["sizes"]] == ["64x64", "640x480"]
    assert all(s["images_per_s"] > 0 and s["failed"] == 0 for s in found["sizes"])
    assert "host_syncs_per_call" not in found["sizes"][0]
    assert found["sizes"][1]["host_syncs_per_call"] == 0
