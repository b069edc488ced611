"""What holds the GIL per job (worker/decode/gil_account.py): the projection's arithmetic, and the
per-thread accounting on real decode threads."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from worker.decode import gil_account
from worker.decode.cpu import DecodeSpec, decode_pixels
from worker.decode.samples import synthetic_jpeg

_US = st.floats(min_value=0.0, max_value=1e5, allow_nan=False)
_HELD = st.fixed_dictionaries({k: _US for k in gil_account.KINDS})


def test_the_lower_bound_binds() -> None:
    # 50 µs of GIL per job allow 20,000 jobs/s; 400 µs of CPU on 16 cores, 40,000.
    held = {"event_loop": 30.0, "decode": 15.0, "launch": 4.0, "other": 1.0}
    p = gil_account.project(held, 400.0, 16)
    assert p["gil_bound_jobs_per_s"] == 20_000.0 and p["cores_bound_jobs_per_s"] == 40_000.0
    assert p["jobs_per_s"] == 20_000.0 and p["binds"] == "GIL"
    # On 2 cores the same job is bound by the cores: 5,000 jobs/s.
    two = gil_account.project(held, 400.0, 2)
    assert two["jobs_per_s"] == 5_000.0 and two["binds"] == "cores"


@given(_HELD, st.floats(min_value=1.0, max_value=1e5), st.integers(1, 256))
# A GIL time so small that 1e6 over it is past the largest float: no bound, as for none.
@example(
    held={"event_loop": 0.0, "decode": 0.0, "launch": 0.0, "other": 5e-324}, cpu_us=1.0, cores=1
)
def test_the_projection_is_the_lower_of_the_two_bounds(
    held: dict[str, float], cpu_us: float, cores: int
) -> None:
    p = gil_account.project(held, cpu_us, cores)
    gil_total = sum(held.values())
    assert p["cores_bound_jobs_per_s"] == pytest.approx(cores * 1e6 / cpu_us, rel=1e-3, abs=0.1)
    if gil_total > 0 and math.isfinite(1e6 / gil_total):
        assert p["gil_bound_jobs_per_s"] == pytest.approx(1e6 / gil_total, rel=1e-3, abs=0.1)
    else:
        assert p["gil_bound_jobs_per_s"] is None  # nothing measurable holds the GIL: no bound
    bounds = [b for b in (p["gil_bound_jobs_per_s"], p["cores_bound_jobs_per_s"]) if b]
    assert p["jobs_per_s"] == min(bounds)
    named = p["gil_bound_jobs_per_s"] if p["binds"] == "GIL" else p["cores_bound_jobs_per_s"]
    assert named == p["jobs_per_s"]
    # More cores never lower the projection, and never move the GIL bound.
    more = gil_account.project(held, cpu_us, cores + 1)
    assert more["gil_bound_jobs_per_s"] == p["gil_bound_jobs_per_s"]
    assert more["jobs_per_s"] >= p["jobs_per_s"]


def test_a_projection_for_no_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="cores"):
        gil_account.project({"event_loop": 1.0}, 1.0, 0)


def test_nothing_measured_projects_nothing() -> None:
    p = gil_account.project({}, 0.0, 16)
    assert p["jobs_per_s"] is None and p["binds"] is None


def test_decode_threads_hold_the_gil_for_less_than_their_cpu_time() -> None:
    """Real decodes on threads named as the pool names them: their time inside
    libjpeg-turbo and Pillow's resize is counted apart, the Python around it as held."""
    images = [synthetic_jpeg(320, 240, seed=i, quality=85) for i in range(4)]
    spec = DecodeSpec(size=128)
    decoded = threading.Barrier(3)
    release = threading.Event()

    def decode() -> None:
        for _ in range(5):
            for data in images:
                decode_pixels(data, spec)
        decoded.wait()
        release.wait()  # alive until read: an ended thread's clock is gone

    threads = [threading.Thread(target=decode, name=f"gpufeed-decode-{i}") for i in range(2)]
    before = gil_account.snapshot()
    try:
        with gil_account.timing_releases():
            for t in threads:
                t.start()
            # The loop thread's own work: plain Python, all of it holding the GIL.
            sum(i * i for i in range(100_000))
            decoded.wait()
            after = gil_account.snapshot()
    finally:
        release.set()
        for t in threads:
            t.join()
    assert not gil_account.switch.on
    jobs = 2 * 5 * len(images)
    figures = gil_account.gil_figures(
        before, after, jobs, loop_tid=threading.get_native_id(), cores=(2, 16)
    )
    assert figures is not None
    held, cpu = figures["gil_us_per_job"], figures["cpu_us_per_job"]
    assert figures["threads"]["decode"] == 2
    assert held["event_loop"] > 0
    # Every decode made timed calls (the decode, the resize), and they took part of the
    # threads' CPU time, not all of it.
    assert figures["timed_calls_per_job"] >= 2
    assert 0 < figures["decode_released_us_per_job"] < cpu["decode"]
    assert held["decode"] == pytest.approx(
        cpu["decode"] - figures["decode_released_us_per_job"], abs=0.2
    )
    assert [p["cores"] for p in figures["projections"]] == [2, 16]
    assert all(p["binds"] in ("GIL", "cores") for p in figures["projections"])
    assert math.isfinite(figures["process_cpu_us_per_job"])


def test_timing_is_off_and_the_decoder_untouched_outside_the_block() -> None:
    from worker.decode import cpu

    original = cpu.simplejpeg
    with gil_account.timing_releases():
        assert gil_account.switch.on and cpu.simplejpeg is not original
    assert not gil_account.switch.on and cpu.simplejpeg is original
    assert gil_account.timing_cost_us(1000) >= 0


def test_the_bench_reads_a_few_milliseconds_of_a_threads_cpu() -> None:
    # A tiny run's threads may not see one kernel tick (10 ms): the bench's per-thread CPU
    # must come from a finer clock, or a short run reads as no CPU at all.
    import time
    from pathlib import Path

    from worker.tools.harness.probe import thread_cpu_s

    tid = threading.get_native_id()
    if not Path(f"/proc/self/task/{tid}/schedstat").exists():
        pytest.skip("no schedstat on this kernel")
    before = thread_cpu_s()[tid]
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.002:
        pass
    assert thread_cpu_s()[tid] - before >= 0.0015
