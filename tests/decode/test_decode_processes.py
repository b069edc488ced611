"""Decode processes (worker/decode/processes.py): the same rows as the decode threads, a
decode over budget ends its process and the batch goes on, a crash loses no row, and the
worker switches between processes and threads with one setting."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.wire import ErrorCode, JobResult
from tests.support.images import (
    encode,
    jpeg_bytes,
    photo_like,
    png_bytes,
    truncated_jpeg_bytes,
)
from tests.support.worker_harness import running_worker, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.decode import processes
from worker.decode.arena import ArenaLayout, SharedArena
from worker.decode.cpu import DecodeSpec
from worker.decode.executor import DecodeResult
from worker.decode.packed import BYTES_WORD, HEADER_BYTES, packed_side
from worker.decode.pool import DecodePool
from worker.decode.processes import DecodeProcessesFailed, ProcessDecodePool
from worker.decode.rows import row_side
from worker.jobs import Job
from worker.lifecycle.feed_plan import plan_feed
from worker.model.resample import PackedResampler, RowResampler

SIZE = 48


def _job(i: int, data: bytes, reply_to: str = "r") -> Job:
    return Job.new(
        entry_id=f"{i}-0", job_id=f"j{i}", reply_to=reply_to, meta=None, image=data, path=None
    )


def _images() -> list[bytes]:
    rotated = photo_like(80, 60, seed=5)
    exif = rotated.getexif()
    exif[0x0112] = 6
    return [
        jpeg_bytes(640, 480, seed=1),
        jpeg_bytes(64, 64, seed=2),
        png_bytes(90, 30, seed=3),
        encode(photo_like(70, 50, seed=4).convert("L"), "JPEG"),
        encode(rotated, "JPEG", exif=exif.tobytes()),
        b"not an image at all",
        truncated_jpeg_bytes(),
        png_bytes(3000, 100, seed=6),  # too wide for a device row: fitted on the host
    ]


@pytest.fixture
async def shared_pool() -> AsyncIterator[tuple[ProcessDecodePool, SharedArena]]:
    """Two decode processes, rows for the device placement (the CUDA default)."""
    side = row_side(SIZE)
    arena = SharedArena.create(ArenaLayout(rows=16, side=side, processes=2))
    pool = ProcessDecodePool(DecodeSpec(size=SIZE), 2, None, arena=arena, budget_s=5, row_side=side)
    yield pool, arena
    pool.shutdown()
    arena.close()


def _same(a: DecodeResult, b: DecodeResult) -> None:
    assert (a.error is None) == (b.error is None), (a, b)
    if a.error is not None and b.error is not None:
        assert a.error.code == b.error.code
        assert a.error.message == b.error.message
    assert a.info == b.info


@pytest.mark.parametrize("device_rows", [True, False], ids=["device-rows", "host-rows"])
async def test_processes_write_the_rows_threads_write(device_rows: bool) -> None:
    side = row_side(SIZE) if device_rows else SIZE
    spec = DecodeSpec(size=SIZE)
    images = _images()
    jobs = [_job(i, d) for i, d in enumerate(images)]
    arena = SharedArena.create(ArenaLayout(rows=len(jobs), side=side, processes=2))
    procs = ProcessDecodePool(spec, 2, None, arena=arena, row_side=side if device_rows else 0)
    threads = DecodePool(spec, 2, None, row_side=side if device_rows else 0)
    try:
        expected_rows = np.zeros((len(jobs), side, side, 3), np.uint8)
        expected = await threads.settle([threads.submit_rows(jobs, expected_rows)])
        got = await procs.settle([procs.submit_rows(jobs, arena.rows)])
    finally:
        procs.shutdown()
        threads.shutdown()
    assert len(got) == len(jobs)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        _same(a, b)
        if a.error is None:
            assert np.array_equal(arena.rows[i], expected_rows[i]), f"row {i} differs"
    codes = [r.error.code if r.error else None for r in got]
    assert codes[5] is ErrorCode.UNSUPPORTED_FORMAT
    assert codes[6] is not None and codes[0] is None
    if device_rows:
        assert procs.reduced == 1
    arena.close()


async def test_packed_processes_stage_what_threads_stage_in_rows() -> None:
    """Decode processes packing a slot (the device placement's default with processes):
    every image's step input equals the one from the rows decode threads write, errors
    are the same, and an image met twice is served by the process's cache, packed too."""
    spec = DecodeSpec(size=SIZE)
    r = row_side(SIZE)
    images = [*_images(), _images()[0]]
    jobs = [_job(i, d) for i, d in enumerate(images)]
    batch = len(jobs)
    layout = ArenaLayout(rows=batch, side=packed_side(r), processes=2, batch=batch)
    arena = SharedArena.create(layout)
    assert arena.packed is not None
    arena.packed.reset(0)
    procs = ProcessDecodePool(spec, 2, None, arena=arena, row_side=r, cache_bytes=8 << 20)
    threads = DecodePool(spec, 2, None, row_side=r)
    try:
        rows = np.zeros((batch, r, r, 3), np.uint8)
        expected = await threads.settle([threads.submit_rows(jobs[:-1], rows[:-1])])
        # The repeated image after the first is in, so that the cache has it.
        first = await procs.settle([procs.submit_rows(jobs[:-1], arena.rows[:-1])])
        again = await procs.settle([procs.submit_rows(jobs[-1:], arena.rows[-1:])])
    finally:
        procs.shutdown()
        threads.shutdown()
    for a, b in zip(first, expected, strict=True):
        _same(a, b)
    assert again[0].cached and again[0].info == first[0].info
    rows[-1] = rows[0]
    slot = torch.from_numpy(arena.rows.reshape(1, -1)).view(batch, *arena.rows.shape[1:])
    with torch.inference_mode():
        got = PackedResampler(r, SIZE, SIZE, SIZE)(slot)
        want = RowResampler(r, SIZE, SIZE, SIZE)(torch.from_numpy(rows))
    ok = [i for i, res in enumerate([*first, *again]) if res.error is None]
    assert len(ok) == 7
    assert torch.equal(got[ok], want[ok])
    # Staged: a record per row and each image's stored pixels, nothing more.
    records = arena.rows.reshape(-1)[: batch * HEADER_BYTES].view("<i4").reshape(batch, -1)
    stored = records[:, 0] * records[:, 1] * 3
    assert (records[ok, BYTES_WORD] == stored[ok]).all()
    assert arena.packed.used_bytes(0) == batch * HEADER_BYTES + int(stored[ok].sum())
    assert arena.packed.used_bytes(0) < rows.nbytes // 5
    arena.close()


@pytest.mark.parametrize("with_root", [True, False], ids=["root", "no-root"])
async def test_path_jobs_are_read_by_the_decode_process_as_threads_read_them(
    tmp_path: Path, with_root: bool
) -> None:
    """The process reads a path job's file itself (its bytes never cross the worker), with
    the same checks and answers as a decode thread."""
    root = tmp_path / "images"
    root.mkdir()
    (root / "ok.jpg").write_bytes(jpeg_bytes(80, 60, seed=3))
    (tmp_path / "secret.jpg").write_bytes(jpeg_bytes(80, 60, seed=4))
    names = [b"ok.jpg", b"../secret.jpg", b"missing.jpg", b"", str(root / "ok.jpg").encode()]
    jobs = [
        Job.new(entry_id=f"{i}-0", job_id=f"p{i}", reply_to="r", meta=None, image=None, path=name)
        for i, name in enumerate(names)
    ]
    base = root if with_root else None
    spec = DecodeSpec(size=SIZE)
    arena = SharedArena.create(ArenaLayout(rows=len(jobs), side=SIZE, processes=2))
    procs = ProcessDecodePool(spec, 2, base, arena=arena)
    threads = DecodePool(spec, 2, base)
    try:
        rows = np.zeros((len(jobs), SIZE, SIZE, 3), np.uint8)
        expected = await threads.settle([threads.submit_rows(jobs, rows)])
        got = await procs.settle([procs.submit_rows(jobs, arena.rows)])
    finally:
        procs.shutdown()
        threads.shutdown()
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        _same(a, b)
        if a.error is None:
            assert np.array_equal(arena.rows[i], rows[i])
    codes = [r.error.code if r.error else None for r in got]
    if with_root:
        assert codes[0] is None and codes[4] is None
        assert codes[1] is ErrorCode.FORBIDDEN_PATH and codes[2] is ErrorCode.PATH_NOT_FOUND
    else:
        assert set(codes) == {ErrorCode.PATH_DISABLED}
    arena.close()


async def test_the_staging_memory_is_an_anonymous_memory_file() -> None:
    # Docker gives /dev/shm 64 MB by default: the ring must not live there.
    arena = SharedArena.create(ArenaLayout(rows=64, side=row_side(224), processes=2))
    try:
        assert arena.layout.size > 64 * 1024 * 1024
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:gpufeed-staging")
    finally:
        arena.close()


@pytest.mark.slow
async def test_a_decode_over_budget_ends_its_process_and_the_batch_goes_on() -> None:
    spec = DecodeSpec(size=SIZE)
    arena = SharedArena.create(ArenaLayout(rows=4, side=SIZE, processes=1))
    # One process, so the small image waits behind the slow one in the same run.
    pool = ProcessDecodePool(spec, 1, None, arena=arena, budget_s=0.05)
    slow = png_bytes(3000, 3000, seed=7)
    try:
        first_pid = pool.pids[0]
        results = await pool.settle(
            [pool.submit_rows([_job(0, slow), _job(1, jpeg_bytes(64, 64))], arena.rows[:2])]
        )
        assert results[0].error is not None
        assert results[0].error.code is ErrorCode.DECODE_TIMEOUT
        assert "budget of 50 ms" in results[0].error.message
        assert results[1].error is None and results[1].info is not None
        assert pool.given_up == 1 and pool.replaced == 1
        assert pool.pids[0] != first_pid
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)
        # The replacement decodes what comes next.
        small = _job(2, jpeg_bytes(64, 64))
        again = await pool.settle([pool.submit_rows([small], arena.rows[2:3])])
        assert again[0].error is None
    finally:
        pool.shutdown()
        arena.close()


async def test_processes_that_cannot_start_are_an_error_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "CHILD_MODULE", "worker.decode.no_such_module")
    arena = SharedArena.create(ArenaLayout(rows=2, side=SIZE, processes=2))
    try:
        with pytest.raises(DecodeProcessesFailed, match="exited with 1 before it was ready"):
            ProcessDecodePool(DecodeSpec(size=SIZE), 2, None, arena=arena)
    finally:
        arena.close()


async def test_rows_whose_processes_keep_ending_before_any_row_fail_instead_of_looping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "CHILD_MODULE", "tests.support.decoder_that_dies")
    arena = SharedArena.create(ArenaLayout(rows=4, side=SIZE, processes=1))
    pool = ProcessDecodePool(DecodeSpec(size=SIZE), 1, None, arena=arena)
    try:
        jobs = [_job(i, jpeg_bytes(64, 64, seed=i)) for i in range(3)]
        results = await asyncio.wait_for(
            pool.settle([pool.submit_rows(jobs, arena.rows[:3])]), timeout=60
        )
        assert [r.error.code if r.error else None for r in results] == [
            ErrorCode.INTERNAL_ERROR
        ] * 3
        assert all("ended 3 times" in (r.error.message if r.error else "") for r in results)
        assert pool.replaced == 3
    finally:
        pool.shutdown()
        arena.close()


async def test_a_process_that_dies_loses_no_row() -> None:
    spec = DecodeSpec(size=SIZE)
    arena = SharedArena.create(ArenaLayout(rows=8, side=SIZE, processes=2))
    # Every decode sleeps 0.3 s first, so the kill lands while a row is being decoded.
    pool = ProcessDecodePool(spec, 2, None, arena=arena, budget_s=30, delay_s=0.3)
    try:
        jobs = [_job(i, jpeg_bytes(64, 64, seed=i)) for i in range(6)]
        group = pool.submit_rows(jobs, arena.rows[:6])
        await asyncio.sleep(0.45)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        results = await pool.settle([group])
        assert len(results) == 6
        failed = [r for r in results if r.error is not None]
        assert len(failed) == 1, results
        assert failed[0].error is not None
        assert failed[0].error.code is ErrorCode.INTERNAL_ERROR
        assert "decode process ended" in failed[0].error.message
        assert pool.crashed == 1 and victim not in pool.pids
    finally:
        pool.shutdown()
        arena.close()


def test_the_plan_follows_the_settings_and_the_host(tmp_path: Path) -> None:
    weights = tmp_path / "w.pt"
    url = "redis://127.0.0.1:1/0"
    cfg = tiny_config(url, weights, decode_threads=0)
    kw: dict[str, Any] = {"placement": "host", "placement_why": "test", "default_threads": 3}
    auto = plan_feed(cfg, thread_only_hook=False, cores=16, **kw)
    assert auto.decode_processes == 15
    assert "16 cores" in auto.line()
    few = plan_feed(cfg, thread_only_hook=False, cores=2, **kw)
    assert few.decode_processes == 0 and "2 cores, under 4" in few.line()
    assert "3 decode threads" in few.line()
    assert plan_feed(cfg, thread_only_hook=False, cores=4, **kw).decode_processes == 3
    hooked = plan_feed(cfg, thread_only_hook=True, cores=16, **kw)
    assert hooked.decode_processes == 0 and "decode hook" in hooked.line()
    # Decode threads sized by GPUFEED_TUNING are kept under auto, and named where unused.
    sized = tiny_config(url, weights, decode_threads=2)
    kept = plan_feed(sized, thread_only_hook=False, cores=16, **kw)
    assert kept.decode_processes == 0 and "2 decode threads" in kept.line()
    both = tiny_config(url, weights, decode_threads=2, decode_processes="4")
    line = plan_feed(both, thread_only_hook=False, cores=16, **kw).line()
    assert line.startswith("4 decode processes")
    assert "; GPUFEED_TUNING decode_threads=2 unused (it sizes decode threads)" in line
    off = tiny_config(url, weights, decode_processes="0")
    assert plan_feed(off, thread_only_hook=False, cores=16, **kw).decode_processes == 0
    # GPU decode takes decode processes as it takes threads (packed rows, gpu_packed.py).
    for count in ("4", "auto"):
        gpu = tiny_config(url, weights, decode_processes=count, decode="gpu", decode_threads=0)
        assert plan_feed(gpu, thread_only_hook=False, cores=16, **kw).decode_processes >= 4
    with pytest.raises(ConfigError, match="GPUFEED_DECODE_PROCESSES"):
        tiny_config(url, weights, decode_processes="many")
    # The result writer: a process of its own from 4 cores, as decode processes; the
    # setting wins either way, and the line says which and why.
    assert auto.result_writer == "process" and "results published from a process" in auto.line()
    assert few.result_writer == "loop" and "results published from the event loop" in few.line()
    for setting in ("process", "loop"):
        named = tiny_config(url, weights, result_writer=setting)
        for cores in (2, 16):
            plan = plan_feed(named, thread_only_hook=False, cores=cores, **kw)
            assert plan.result_writer == setting
            assert f"(GPUFEED_TUNING result_writer={setting})" in plan.line()
    with pytest.raises(ConfigError, match="GPUFEED_TUNING result_writer"):
        tiny_config(url, weights, result_writer="thread")


@pytest.mark.slow
@pytest.mark.parametrize("resize", ["host", "device"])
async def test_the_worker_answers_the_same_with_processes_and_with_threads(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, resize: str
) -> None:
    """The switch back: the same answers either way; with the device placement the
    processes' slots are packed and the threads' are rows, and both give the same pixels.
    The feed of processes publishes from the result writer's process, the threads' from the
    event loop: both answer alike."""
    images = _images()
    answers: dict[str, list[tuple[str, str, object]]] = {}
    for setting in ("2", "0"):
        redis_client.delete("gpufeed:jobs", "gpufeed:results")
        writer = "process" if setting == "2" else "loop"
        async with running_worker(
            redis_url,
            tiny_weights,
            decode_processes=setting,
            decode_cache_mb=0,
            resize=resize,
            result_writer=writer,
        ) as worker:
            report = worker.report()
            assert report.decoders == ("processes" if setting == "2" else "threads")
            assert report.plan.result_writer == writer
            assert len(report.writer_pids) == (1 if writer == "process" else 0)
            assert report.plan.packed == (setting == "2" and resize == "device")
            for i, data in enumerate(images):
                redis_client.xadd("gpufeed:jobs", {"id": f"img{i}", "image": data})
            results = await wait_results(redis_client, "gpufeed:results", len(images))
            staged = worker.engine.staged_bytes_per_image()
        row_bytes = report.ring_budget["h2d_bytes_per_batch"] // report.batch_size
        if worker.engine.feed.plan.packed:
            # Measured: what the images took, against the fixed rows' bytes (one 640x480
            # photo among thumbnails: a quarter of them on average).
            assert 0 < staged < row_bytes // 4
        else:
            assert staged == row_bytes
        parsed = [JobResult.from_fields(fields) for _, fields in results]
        answers[setting] = sorted(
            (r.id, r.status, r.error if r.error else (r.top1, round(r.score or 0, 4)))
            for r in parsed
        )
    assert len(answers["2"]) == len(images)
    assert answers["2"] == answers["0"]
    assert [s for _, s, _ in answers["2"]].count("ok") == 6


_SMALL_JPEG = jpeg_bytes(96, 72, seed=9)


@st.composite
def _damaged_jpegs(draw: st.DrawFn) -> bytes:
    data = bytearray(_SMALL_JPEG)
    at = draw(st.integers(0, len(data) - 1))
    data[at] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40), _damaged_jpegs()), min_size=1, max_size=10))
def test_processes_answer_any_bytes_as_threads_do(blobs: list[bytes]) -> None:
    """Whatever a job carries, a decode process answers it as a decode thread does: the
    same error code and message, or the same size and pixels."""

    async def compare() -> None:
        spec = DecodeSpec(size=SIZE)
        arena = SharedArena.create(ArenaLayout(rows=len(blobs), side=SIZE, processes=2))
        procs = ProcessDecodePool(spec, 2, None, arena=arena)
        threads = DecodePool(spec, 2, None)
        jobs = [_job(i, b) for i, b in enumerate(blobs)]
        try:
            rows = np.zeros((len(jobs), SIZE, SIZE, 3), np.uint8)
            expected = await threads.settle([threads.submit_rows(jobs, rows)])
            got = await procs.settle([procs.submit_rows(jobs, arena.rows)])
            assert len(got) == len(jobs)
            for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                _same(a, b)
                if a.error is None:
                    assert np.array_equal(arena.rows[i], rows[i])
        finally:
            procs.shutdown()
            threads.shutdown()
            arena.close()

    asyncio.run(compare())


async def test_a_row_left_for_the_gpu_with_nothing_to_decode_from_is_an_internal_error(
    shared_pool: tuple[ProcessDecodePool, SharedArena],
) -> None:
    """A record left DEFERRED with no bytes anywhere (none staged, none in the job) is
    answered as an internal error that says so, never as some other row's code."""
    from worker.decode.arena import DEFERRED

    pool, arena = shared_pool
    arena.table[3] = 0
    arena.table["state"][3] = DEFERRED
    arena.table["error"][3] = -1
    job = Job.new("1-0", "j1", "r", path=b"a.jpg")
    (result,) = pool._results([3], [job])
    assert result.gpu is None and result.error is not None
    assert result.error.code is ErrorCode.INTERNAL_ERROR
    assert "left row 3 in state 3 with no answer" in result.error.message
