"""The doctor's verdict on constructed evidence: each verdict, its evidence and knob, the
order of the rules, and both sides of every threshold."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from worker.config import table
from worker.tools.doctor import verdict as V
from worker.tools.doctor.verdict import Evidence, verdict


def gpu(**changes: Any) -> Evidence:
    """A CUDA worker at 95% of its ceiling, GPU moderately busy, decode keeping up."""
    base = Evidence(
        device_type="cuda",
        batch_size=64,
        compile_mode="reduce-overhead",
        compiled=True,
        cudagraphs=True,
        precision="bfloat16",
        decode="cpu",
        decode_threads=8,
        cpu_count=16,
        ceiling_images_per_s=1000.0,
        eager_ceiling_images_per_s=600.0,
        compiled_ceiling_images_per_s=1000.0,
        kernel_count=40,
        busy_ratio=0.9,
        tiny_share=0.1,
        host_syncs=0,
        e2e_images_per_s=950.0,
        decode_ms_mean=4.0,  # 8 threads / 4 ms = 2000 images/s
        batch_fill=1.0,
        model_in_pipeline_images_per_s=1050.0,
        stage_ms={"redis_wait": 5.0, "decode": 4.0, "compute": 60.0, "write": 1.0},
        gpu_util_pct=60.0,
        mem_bw_util_pct=20.0,
    )
    return replace(base, **changes)


def cpu(**changes: Any) -> Evidence:
    """A CPU worker: eager, 2 cores, at 95% of its ceiling."""
    base = Evidence(
        device_type="cpu",
        batch_size=8,
        compile_mode="off",
        precision="float32",
        profile_unit="ops",
        decode_threads=2,
        cpu_count=2,
        ceiling_images_per_s=40.0,
        eager_ceiling_images_per_s=40.0,
        kernel_count=70,
        busy_ratio=0.96,
        tiny_share=0.05,
        e2e_images_per_s=38.0,
        decode_ms_mean=7.0,
        batch_fill=1.0,
        model_in_pipeline_images_per_s=39.0,
        stage_ms={"decode": 7.0, "compute": 200.0},
    )
    return replace(base, **changes)


def names(v: V.Verdict) -> list[str]:
    return [v.name, *(f.name for f in v.also)]


# --------------------------------------------------------------------------- each verdict
def test_sync_bound_cites_the_count_and_where() -> None:
    where = "worker/pipeline/launch.py:131: called a synchronizing CUDA operation"
    v = verdict(gpu(host_syncs=3, sync_locations=(where,)))
    assert v.name == "sync-bound"
    assert any("3 host sync(s)" in line for line in v.evidence)
    assert any(where in line for line in v.evidence)
    assert "worker/pipeline/launch.py:131" in v.knob and ".item()" in v.knob


def test_sync_bound_comes_first_even_when_starved() -> None:
    v = verdict(gpu(host_syncs=1, e2e_images_per_s=200.0, decode_ms_mean=40.0))
    assert v.name == "sync-bound"
    assert "feed-starved" in [f.name for f in v.also]


def test_feed_starved_when_decode_binds() -> None:
    # 4 threads / 13 ms = 307.7 images/s, under 1.1 x 300.
    v = verdict(gpu(e2e_images_per_s=300.0, decode_threads=4, decode_ms_mean=13.0))
    assert v.name == "feed-starved"
    text = "\n".join(v.evidence)
    assert "30% of the model's direct-feed ceiling (1,000.0 images/s)" in text
    assert "decode capacity 307.7 images/s = 4 threads / 13.0 ms" in text
    # Threads are sized by a tuning constant: the knob is decode processes.
    assert "set GPUFEED_DECODE_PROCESSES=15 (now 4 decode threads; this host has 16" in v.knob
    assert "tuning constant DECODE_THREADS" in v.knob
    assert "GPUFEED_DECODE=gpu" in v.knob
    assert "dct_scaling" not in v.knob
    processes = gpu(e2e_images_per_s=300.0, decode_processes=4, decode_threads=4)
    knob = verdict(replace(processes, decode_ms_mean=13.0)).knob
    assert "raise GPUFEED_DECODE_PROCESSES (now 4; this host has 16 cores)" in knob


def test_feed_starved_knob_turns_dct_scaling_on() -> None:
    v = verdict(gpu(e2e_images_per_s=300.0, decode_ms_mean=26.0, dct_scaling=False))
    assert v.name == "feed-starved"
    assert "take dct_scaling=false out of GPUFEED_TUNING to decode them at 1/2-1/8" in v.knob


def test_feed_starved_on_low_fill_with_a_backlog() -> None:
    v = verdict(gpu(e2e_images_per_s=300.0, batch_fill=0.3))
    assert v.name == "feed-starved"
    assert any("batches 30% full while jobs waited in Redis" in e for e in v.evidence)
    # Without a backlog, part-empty batches are light load, not a starved model.
    light = verdict(gpu(e2e_images_per_s=300.0, batch_fill=0.3, backlog=False))
    assert "part-empty" not in light.headline


def test_launch_bound_on_gpu_when_eager() -> None:
    v = verdict(
        gpu(
            compiled=False,
            cudagraphs=False,
            compile_mode="off",
            kernel_count=320,
            tiny_share=0.8,
            busy_ratio=0.3,
            gap_mean_us=12.5,
        )
    )
    assert v.name == "launch-bound"
    text = "\n".join(v.evidence)
    assert "320 kernels per forward, 80% of them under 10 µs" in text
    assert "kernels busy 30% of the forward's wall time; mean gap between kernels 12.5" in text
    assert "ceiling eager 600.0 images/s vs compiled 1,000.0 images/s" in text
    assert "GPUFEED_COMPILE=reduce-overhead (now off)" in v.knob
    assert "GPUFEED_BATCH_SIZE (now 64)" in v.knob


def test_launch_bound_is_a_hint_on_cpu() -> None:
    v = verdict(cpu(kernel_count=450, tiny_share=0.98, busy_ratio=0.6))
    assert v.name == "compute-bound"
    hint = next(f for f in v.also if f.name == "launch-bound")
    assert hint.hint
    assert "450 ops per forward, 98% of them under 10 µs" in hint.evidence[0]
    assert "GPUFEED_BATCH_SIZE (now 8)" in hint.knob


def test_memory_bound_before_compute_bound() -> None:
    v = verdict(gpu(mem_bw_util_pct=75.0, gpu_util_pct=95.0))
    assert v.name == "memory-bound"
    assert "memory-controller utilisation 75%" in v.evidence[0]
    assert "GPUFEED_PRECISION=bf16 or fp16 (now bfloat16)" in v.knob
    assert "compute-bound" in [f.name for f in v.also]


def test_compute_bound_on_gpu() -> None:
    v = verdict(gpu(gpu_util_pct=97.0))
    assert v.name == "compute-bound"
    assert v.evidence[0] == "GPU utilisation 97% (threshold 85%)"
    assert "95% of the model's direct-feed ceiling" in v.evidence[1]
    assert "GPUFEED_PRECISION" in v.knob


def test_compute_bound_on_gpu_when_the_model_is_slower_in_the_pipeline() -> None:
    v = verdict(gpu(e2e_images_per_s=500.0, model_in_pipeline_images_per_s=520.0))
    assert v.name == "compute-bound"
    assert "slower inside the pipeline than alone (520.0 vs 1,000.0 images/s)" in v.headline
    assert "GPU decode, copies, other processes" in v.headline


def test_compute_bound_on_cpu_when_the_model_binds() -> None:
    v = verdict(cpu())
    assert v.name == "compute-bound"
    assert any("decode capacity 285.7 images/s" in e for e in v.evidence)
    assert "GPUFEED_DEVICE=cuda" in v.knob
    # Below 70% of the ceiling too, when the model's own rate in the pipeline binds
    # (decode threads and the model share the cores).
    v = verdict(cpu(e2e_images_per_s=20.0, model_in_pipeline_images_per_s=21.0))
    assert v.name == "compute-bound"
    assert any("inside the pipeline (1.05x the throughput)" in e for e in v.evidence)
    assert "slower inside the pipeline than alone (21.0 vs 40.0 images/s)" in v.headline


def test_healthy() -> None:
    v = verdict(gpu())
    assert v.name == "healthy"
    assert "95%" in v.headline
    assert v.evidence == (
        "end-to-end 950.0 images/s = 95% of the model's direct-feed ceiling (1,000.0 images/s)",
        "no host syncs",
    )


def test_feed_starved_fallback_when_neither_decode_nor_model_binds() -> None:
    v = verdict(gpu(e2e_images_per_s=500.0, process_cpu_pct=99.0))
    assert v.name == "feed-starved"
    assert "neither decode nor the model binds" in v.headline
    assert "decode capacity 2,000.0 images/s (4.00x the throughput): decode does not bind" in (
        v.evidence
    )
    assert "worker process CPU 99% (100% = one core)" in v.evidence
    assert any(e.startswith("stage means (ms): redis_wait 5.0") for e in v.evidence)
    assert "second worker process" in v.knob


def test_queue_bound_when_the_worker_runs_near_the_queue_ceiling() -> None:
    v = verdict(gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=600.0))
    assert v.name == "queue-bound" and "Redis is the limit" in v.headline
    assert (
        "end-to-end 500.0 jobs/s = 83% of the queue ceiling (600.0 jobs/s: gpufeed's read, "
        "publish and ack alone on this Redis)" in v.evidence
    )
    assert "decode capacity 2,000.0 images/s (4.00x the throughput): decode does not bind" in (
        v.evidence
    )
    assert "`path` or `url`" in v.knob


def test_queue_bound_when_redis_s_command_thread_is_busy_all_the_run() -> None:
    # 84 KB jobs: the worker is far below the queue ceiling measured with small reads, but
    # Redis's one command thread spends 1.8 ms per job of XADD and reads: 90% of the run.
    v = verdict(
        gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=5000.0, redis_cpu_us_per_job=1800.0)
    )
    assert v.name == "queue-bound" and "Redis is the limit" in v.headline
    assert (
        "redis-server's command thread 1,800.0 µs per job (each job's XADD, reads, results, "
        "acks) = busy 90% of the run" in v.evidence
    )
    assert "`path` or `url`" in v.knob
    # Not busy enough: the usual fallbacks.
    idle = verdict(
        gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=5000.0, redis_cpu_us_per_job=1500.0)
    )
    assert idle.name == "feed-starved"


def test_worker_overhead_bound_when_the_event_loop_is_busy_far_below_the_queue() -> None:
    v = verdict(
        gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=5000.0, loop_cpu_us_per_job=1800.0)
    )
    assert v.name == "worker-overhead-bound"
    assert "event loop 1,800.0 µs of CPU per job = busy 90% of the run" in v.evidence
    assert any("10% of the queue ceiling" in line for line in v.evidence)
    assert "second worker process" in v.knob


def test_decode_binding_comes_before_the_queue() -> None:
    v = verdict(gpu(e2e_images_per_s=500.0, decode_ms_mean=16.0, queue_ceiling_jobs_per_s=550.0))
    assert v.name == "feed-starved" and "CPU decode" in v.headline


@pytest.mark.parametrize(("queue", "name"), [(626.0, "feed-starved"), (625.0, "queue-bound")])
def test_edge_queue_bound_ratio(queue: float, name: str) -> None:
    # 500 / 625 = 0.8 exactly; the event loop is idle enough not to bind.
    ev = gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=queue, loop_cpu_us_per_job=100.0)
    assert verdict(ev).name == name


@pytest.mark.parametrize(
    ("loop_us", "name"), [(1190.0, "feed-starved"), (1200.0, "worker-overhead-bound")]
)
def test_edge_loop_busy(loop_us: float, name: str) -> None:
    # 1200 µs x 500 jobs/s = 0.6 of the run.
    ev = gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=5000.0, loop_cpu_us_per_job=loop_us)
    assert verdict(ev).name == name


def test_inconclusive_says_what_is_missing() -> None:
    v = verdict(
        cpu(e2e_images_per_s=None, missing=("end-to-end: no Redis: redis-server not installed",))
    )
    assert v.name == "inconclusive"
    assert v.evidence == ("not measured: end-to-end: no Redis: redis-server not installed",)


def test_inconclusive_keeps_hints() -> None:
    v = verdict(Evidence(profile_unit="ops", kernel_count=300, tiny_share=0.99, busy_ratio=0.5))
    assert v.name == "inconclusive"
    assert [(f.name, f.hint) for f in v.also] == [("launch-bound", True)]


def test_as_dict_carries_the_thresholds() -> None:
    d = verdict(gpu()).as_dict()
    assert d["thresholds"]["feed_starved_ratio"] == 0.70
    assert set(d) == {"name", "headline", "evidence", "knob", "also", "thresholds"}


# --------------------------------------------------------------------------- the edges
@pytest.mark.parametrize(("e2e", "name"), [(699.0, "feed-starved"), (700.0, "launch-bound")])
def test_edge_feed_starved_ratio(e2e: float, name: str) -> None:
    # Decode binds in both (capacity 600 < 1.1 x e2e), and the step is launch-bound too:
    # below 70% of the ceiling the starved feed comes first, from 70% on the launches.
    launches = {"cudagraphs": False, "kernel_count": 300, "tiny_share": 0.8, "busy_ratio": 0.3}
    v = verdict(gpu(e2e_images_per_s=e2e, decode_ms_mean=8000.0 / 600.0, **launches))
    assert v.name == name
    # Below 70% both hold; from 70% on the starved feed is only the fallback, not a finding.
    assert [f.name for f in v.also] == (["launch-bound"] if name == "feed-starved" else [])


def test_decode_binding_between_70_and_90_percent_is_still_named() -> None:
    v = verdict(gpu(e2e_images_per_s=800.0, decode_ms_mean=8000.0 / 850.0))
    assert v.name == "feed-starved" and "CPU decode" in v.headline


# Just either side of each threshold (1.1 x 20 is not exactly 22 in binary floating point).
@pytest.mark.parametrize(("capacity_x", "binds"), [(1.099, True), (1.101, False)])
def test_edge_decode_binding_margin(capacity_x: float, binds: bool) -> None:
    e2e = 500.0
    decode_ms = 8 * 1000.0 / (capacity_x * e2e)
    v = verdict(gpu(e2e_images_per_s=e2e, decode_ms_mean=decode_ms))
    assert ("CPU decode" in v.headline) is binds


@pytest.mark.parametrize(("fill", "starved"), [(0.49, True), (0.50, False)])
def test_edge_low_fill(fill: float, starved: bool) -> None:
    v = verdict(gpu(e2e_images_per_s=500.0, batch_fill=fill))
    assert ("batches leave part-empty" in v.headline) is starved


@pytest.mark.parametrize(
    ("changes", "launch_bound"),
    [
        ({}, True),
        ({"kernel_count": 99}, False),
        ({"kernel_count": 100}, True),
        ({"tiny_share": 0.49}, False),
        ({"tiny_share": 0.50}, True),
        ({"busy_ratio": 0.60}, False),
        ({"busy_ratio": 0.59}, True),
        ({"cudagraphs": True}, False),
    ],
)
def test_edge_launch_bound(changes: dict[str, Any], launch_bound: bool) -> None:
    ev = gpu(compiled=False, cudagraphs=False, kernel_count=300, tiny_share=0.8, busy_ratio=0.3)
    assert (verdict(replace(ev, **changes)).name == "launch-bound") is launch_bound


@pytest.mark.parametrize(("bw", "name"), [(59.9, "healthy"), (60.0, "memory-bound")])
def test_edge_memory_bw(bw: float, name: str) -> None:
    assert verdict(gpu(mem_bw_util_pct=bw)).name == name


@pytest.mark.parametrize(("util", "name"), [(84.9, "healthy"), (85.0, "compute-bound")])
def test_edge_compute_util(util: float, name: str) -> None:
    assert verdict(gpu(gpu_util_pct=util)).name == name


@pytest.mark.parametrize(("e2e", "name"), [(899.0, "feed-starved"), (900.0, "healthy")])
def test_edge_healthy_ratio(e2e: float, name: str) -> None:
    assert verdict(gpu(e2e_images_per_s=e2e)).name == name


@pytest.mark.parametrize(("in_pipe", "name"), [(21.9, "compute-bound"), (22.1, "feed-starved")])
def test_edge_cpu_model_binding(in_pipe: float, name: str) -> None:
    # 20 images/s = 50% of the ceiling; decode keeps up (285 images/s).
    assert verdict(cpu(e2e_images_per_s=20.0, model_in_pipeline_images_per_s=in_pipe)).name == name


# One evidence per verdict.
EACH_VERDICT = [
    gpu(host_syncs=1),
    gpu(e2e_images_per_s=300.0, fetch_ms_mean=300.0, fetch_concurrency=64),
    gpu(e2e_images_per_s=300.0, decode_ms_mean=26.0),
    gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=600.0),
    gpu(e2e_images_per_s=500.0, queue_ceiling_jobs_per_s=5e3, loop_cpu_us_per_job=1800.0),
    gpu(cudagraphs=False, kernel_count=300, tiny_share=0.8, busy_ratio=0.3),
    gpu(mem_bw_util_pct=80.0),
    gpu(gpu_util_pct=99.0),
    gpu(),
    Evidence(),
]


def test_every_verdict_name_is_reachable() -> None:
    assert {verdict(ev).name for ev in EACH_VERDICT} == set(V.VERDICTS)


def test_every_knob_names_only_variables_the_worker_takes() -> None:
    """A knob naming a variable the worker refuses (a former setting) sends the operator
    to a refusal: each verdict's knob, and its hints', under each way of decoding."""
    takes = set(table.BY_ENV) | set(table.TOOL_VARIABLES) | {table.TUNING_VARIABLE}
    knobs: list[str] = []
    for ev in [*EACH_VERDICT, cpu(), cpu(e2e_images_per_s=10.0, decode_ms_mean=200.0)]:
        for changes in [{}, {"decode_processes": 4}, {"dct_scaling": False}, {"backlog": True}]:
            v = verdict(replace(ev, **changes))
            knobs += [v.knob, *(f.knob for f in v.also)]
    named = {name for knob in knobs for name in re.findall(r"GPUFEED_[A-Z0-9_]+", knob)}
    assert named and named <= takes, sorted(named - takes)
    starved = verdict(gpu(e2e_images_per_s=500.0, process_cpu_pct=99.0))
    assert "the tuning constant RING_SLOTS, which GPUFEED_TUNING=ring_slots=N" in starved.knob
