"""The benchmark: its tiny profile end to end (real workers, a real redis-server started by
the benchmark itself), the report's schema, and the formulas behind "pipeline efficiency"."""

from __future__ import annotations

import copy
import io
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from measure.bench.ablations import CpuPreprocess
from measure.bench.accuracy import SIZES, accuracy_section
from measure.bench.naive import NaivePreprocess
from measure.bench.profiles import make_profile
from measure.bench.report import (
    REPORT_CHECKS,
    RUN_CHECKS,
    accuracy_lines,
    render_markdown,
    validate_report,
)
from measure.bench.stage_rates import ideal_pipeline, ideal_sequential
from measure.bench.suite import run_bench
from measure.cli import cli
from worker.config.settings import WorkerConfig
from worker.decode import gil_account
from worker.decode.cache import cache_key
from worker.decode.cpu import DecodeSpec, decode_into, decode_to_array
from worker.tools.harness.images import ImageSetSpec, load_image_set
from worker.tools.harness.redis_env import job_image

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench-out")
    report = run_bench(
        make_profile("tiny", cuda=False),
        out_dir=out,
        base=WorkerConfig.load(env={}, overrides={"device": "cpu", "log_level": "warning"}),
        echo=lambda _line: None,
    )
    return report, out


@pytest.fixture(scope="module")
def accuracy() -> dict[str, Any]:
    return accuracy_section(torch.device("cpu"))


@pytest.mark.slow
def test_the_written_report_matches_the_schema(tiny: tuple[dict[str, Any], Path]) -> None:
    _, out = tiny
    written = json.loads((out / "report.json").read_text())
    assert validate_report(written) == []
    assert written["profile"] == "tiny"
    assert set(written["accuracy"]["placements"]) == {"host", "device"}
    for key in ("name", "image_set", "images_per_s", "p50_ms", "p99_ms", "jobs", "results"):
        assert all(key in run for run in written["runs"]), key
    assert set(written["summary"]) == {s["name"] for s in written["image_sets"]}
    for entry in written["summary"].values():
        for key in ("vs_naive", "vs_ceiling", "pipeline_efficiency", "ideal_ratio"):
            assert entry[key] > 0 and math.isfinite(entry[key])


@pytest.mark.slow
def test_every_job_of_every_run_was_answered(tiny: tuple[dict[str, Any], Path]) -> None:
    report, _ = tiny
    for run in report["runs"]:
        assert run["results"] == run["jobs"] == run["results_ok"], run["name"]
        # The timeline accounts for every result, in bins that cover the window.
        tl = run["timeline"]
        assert sum(tl["results"]) == run["results"]
        assert len(tl["results"]) == math.ceil(run["duration_s"] / tl["bin_s"] - 1e-6)
        assert tl["images_per_s"] == [pytest.approx(c / tl["bin_s"]) for c in tl["results"]]
    for point in report["curves"]:
        assert point["results"] == point["jobs"]


@pytest.mark.slow
def test_latency_under_load_puts_both_designs_at_the_same_offered_load(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    section = report["latency_under_load"]
    points = {(p["worker"], p["load"]): p for p in section["points"]}
    assert set(points) == {
        ("naive", "naive_80"),
        ("gpufeed", "naive_80"),
        ("gpufeed", "gpufeed_80"),
    }
    naive_rate = 0.8 * section["naive_capacity_per_s"]
    assert points["naive", "naive_80"]["offered_per_s"] == pytest.approx(naive_rate, abs=0.01)
    assert points["gpufeed", "naive_80"]["offered_per_s"] == pytest.approx(naive_rate, abs=0.01)
    for p in points.values():
        assert p["results"] == p["jobs"] and 0 < p["p50_ms"] <= p["p99_ms"]
    ours, theirs = points["gpufeed", "naive_80"]["p99_ms"], points["naive", "naive_80"]["p99_ms"]
    assert section["p99_over_naive_at_naive_80"] == pytest.approx(ours / theirs, abs=0.01)
    assert "## Latency under load" in (out / "report.md").read_text()


@pytest.mark.slow
def test_every_figure_is_a_real_measurement(tiny: tuple[dict[str, Any], Path]) -> None:
    report, _ = tiny
    for run in report["runs"]:
        # The cache pair (repeated images) has no ideal: it is outside the comparisons.
        ideal = () if run.get("variant") else ("ideal_images_per_s",)
        for key in ("images_per_s", "p50_ms", "p95_ms", "p99_ms", *ideal):
            assert run[key] > 0 and math.isfinite(run[key]), (run["name"], key)
        assert run["p50_ms"] <= run["p95_ms"] <= run["p99_ms"]
        # Throughput and the window agree: results / window.
        assert run["images_per_s"] == pytest.approx(run["results"] / run["duration_s"], rel=0.01)
        assert run["cpu_core_ms_per_image"]["total"] > 0
    for rate in report["stage_rates"]["decode"] + report["stage_rates"]["model"]:
        assert rate["images_per_s"] > 0 and math.isfinite(rate["images_per_s"])
    kinds = {m["kind"] for m in report["stage_rates"]["model"]}
    assert kinds == {"ceiling", "naive_batch_1"}
    # Decode processes alone, one and N, for each image set the defaults ran on.
    scaling = report["stage_rates"]["decode_processes"]
    assert {s["image_set"] for s in scaling} == {s["name"] for s in report["image_sets"]}
    for s in scaling:
        one, many = s["rates"]
        assert one["processes"] == 1 and many["processes"] >= 2
        assert one["images_per_s"] > 0 and many["images_per_s"] > 0
        assert s["scaling"] == pytest.approx(many["images_per_s"] / one["images_per_s"], abs=0.01)


@pytest.mark.slow
def test_the_runs_cover_naive_defaults_and_each_ablation(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, _ = tiny
    gpufeed = [r for r in report["runs"] if r["kind"] == "gpufeed"]
    by_name = {r["name"]: r["settings"] for r in gpufeed}
    # Decode processes and threads run side by side whichever the default is (threads
    # under 4 cores), and parallel decode off is one decoder of the default's kind.
    processes = by_name["gpufeed"]["decode_processes"]
    other, one = (
        ("gpufeed-decode-threads", "gpufeed-1-decode-process")
        if processes
        else ("gpufeed-decode-processes", "gpufeed-1-decode-thread")
    )
    expected = {"naive", "gpufeed", "gpufeed-no-dct", "gpufeed-cpu-preprocess", other, one}
    for image_set in report["summary"]:
        names = {r["name"] for r in report["runs"] if r["image_set"] == image_set}
        assert expected <= names
    assert all(r["settings"]["batch_size"] == 4 for r in gpufeed)
    assert (by_name[other]["decode_processes"] == 0) == bool(processes)
    assert (
        by_name["gpufeed-decode-processes" if not processes else "gpufeed"]["decode_processes"] >= 2
    )
    decoders = "decode processes" if processes else "decode threads"
    assert decoders in by_name["gpufeed"]["feed_plan"]
    assert 0 < by_name["gpufeed"]["staged_bytes_per_image"] <= 3 * 1024 * 1024
    assert {r["settings"]["dct_scaling"] for r in gpufeed} == {True, False}
    assert any(r["settings"]["cpu_preprocess"] for r in gpufeed)
    skipped = {s["what"] for s in report["skipped"]}
    assert "compile" in skipped  # CPU compile skipped in tiny
    assert "cache" not in skipped  # the decode cache is measured (the cache pair)
    assert {c["max_wait_ms"] for c in report["curves"]} == {2.0, 10.0, 50.0}
    for target in report["targets"]:
        assert target["met"] or (target["limiting_stage"] and target["detail"])


@pytest.mark.slow
def test_the_figure_is_a_png_and_the_markdown_lists_every_run(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    png = (out / "throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    assert width > 200 and height > 200
    with Image.open(out / "throughput.png") as im:
        im.verify()
    markdown = (out / "report.md").read_text()
    assert markdown == render_markdown(report)
    cache_section = markdown.split("## Decode cache, on repeated images", 1)[1].split("\n## ")[0]
    for run in report["runs"]:
        label = f"**{run['name']}**" if run["name"] in ("naive", "gpufeed") else run["label"]
        section = markdown.split(f"## {run['image_set']}:", 1)[1].split("\n## ", 1)[0]
        if run.get("variant"):
            # The cache pair has its own table, apart from the comparable runs.
            assert label not in section, (run["image_set"], run["name"])
            assert f"| {run['image_set']} | {run['model']} | gpufeed, {label} |" in cache_section
        else:
            assert label in section, (run["image_set"], run["name"])
    assert "## Stage rates" in markdown and "## Summary" in markdown
    assert "## Accuracy: the same pixels as torchvision's eval transforms" in markdown
    assert "every job's bytes are unique" in markdown


@pytest.mark.slow
def test_no_comparable_run_hits_the_cache_and_the_cache_pair_measures_it(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, _ = tiny
    pair = [r for r in report["runs"] if r.get("variant")]
    for run in report["runs"]:
        if run.get("variant"):
            continue
        # Unique job bytes: every run decodes every image, as the naive worker and the ideal.
        assert run["workload"] == "unique"
        assert not run.get("cache_hit_ratio"), (run["name"], run["image_set"])
        if run["kind"] == "gpufeed":
            assert run["cache_hit_ratio"] == 0 and run["cache_hits"] == 0
            assert run["cached_results"] == 0
    # The tiny profile runs the pair on its larger set, for its one model.
    large = next(s for s in report["image_sets"] if s["role"] == "large")
    by_variant = {r["variant"]: r for r in pair}
    assert set(by_variant) == {"cache_on_repeats", "cache_off_repeats"}
    on, off = by_variant["cache_on_repeats"], by_variant["cache_off_repeats"]
    for run in (on, off):
        assert run["image_set"] == large["name"] and run["workload"] == "repeats"
        assert run["results"] == run["jobs"] == run["results_ok"] == large["jobs"]
        assert run["distinct_images"] == large["distinct_images"]
        assert run["repeats"] == pytest.approx(large["jobs"] / large["distinct_images"], abs=0.01)
        # The flags in the results and the worker's counters agree.
        assert run["cache_hits"] == run["cached_results"]
        assert run["cache_hits"] + run["cache_misses"] == run["results"]
        for key in ("ideal_images_per_s", "efficiency", "optimisation_gain", "vs_naive"):
            assert key not in run, key  # outside the ideal and the comparisons
    assert off["settings"]["decode_cache_mb"] == 0 and on["settings"]["decode_cache_mb"] > 0
    assert off["cache_hit_ratio"] == 0 and off["cache_hits"] == 0
    assert 0 < on["cache_hit_ratio"] <= 1 - 1 / on["repeats"] + 1e-9
    assert on["cache_worth"] == pytest.approx(on["images_per_s"] / off["images_per_s"], rel=0.01)
    entry = report["summary"][large["name"]]
    assert entry["cache_worth"] == on["cache_worth"]
    assert entry["cache_hit_ratio"] == on["cache_hit_ratio"]
    assert (
        "cache_worth"
        not in report["summary"][
            next(s["name"] for s in report["image_sets"] if s["role"] != "large")
        ]
    )
    bad = copy.deepcopy(report)
    next(r for r in bad["runs"] if r["name"] == "gpufeed")["cache_hit_ratio"] = 0.5
    next(r for r in bad["runs"] if r.get("variant") == "cache_off_repeats")["cache_hit_ratio"] = 0.1
    problems = validate_report(bad)
    assert any("cache hits on unique job bytes" in p for p in problems)
    assert any("with the cache off" in p for p in problems)


@pytest.mark.slow
def test_the_overhead_section_runs_the_null_model_beside_the_queue_ceiling(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    o = report["overhead"]
    assert o["model"] == "null" and o["batch_size"] == 32
    assert o["image_set"]["label"].startswith("64x64 JPEG")
    queue = o["queue_ceiling"]
    assert queue["jobs"] == queue["published"] == o["image_set"]["jobs"]
    assert queue["batch"] == 32 and queue["jobs_per_s"] > 0
    assert set(o["runs"]) == {"cache_hits", "every_job_decoded"}
    hits, every = o["runs"]["cache_hits"], o["runs"]["every_job_decoded"]
    for r in (hits, every):
        assert r["results"] == r["results_ok"] == r["jobs"] == o["image_set"]["jobs"]
        assert r["settings"]["batch_size"] == 32 and r["settings"]["input_size"] == 64
        assert 0 < r["loop_cpu_us_per_job"] <= r["worker_cpu_us_per_job"]
        assert r["vs_queue_ceiling"] == pytest.approx(
            r["jobs_per_s"] / queue["jobs_per_s"], rel=0.01
        )
        assert r["binds"] in (*r["busy"], "host CPU, shared with other processes")
    # Repeats of 8 images with the cache on hit after the first round; unique bytes never do.
    assert hits["cache_hit_ratio"] > 0.5 and every["cache_hit_ratio"] == 0
    assert len(o["targets"]) == 5
    # What holds the GIL per job with every job decoded: the loop does, and the decode
    # threads (or, with decode processes, the threads that send them rows), less their
    # time in calls that release it; decode processes' own CPU counts in the projection.
    # The projection for 16 cores names the bound that is lower.
    gil = every["gil"]
    assert gil["jobs"] == every["jobs"]
    assert gil["gil_us_per_job"]["event_loop"] > 0 and gil["gil_us_per_job"]["decode"] > 0
    assert gil["decode_released_us_per_job"] > 0 and gil["launch_computes_model"] is False
    in_processes = gil["decode_processes_cpu_us_per_job"]
    assert (in_processes > 0) == bool(every["settings"]["decode_processes"])
    assert in_processes < gil["process_cpu_us_per_job"]
    sixteen = next(p for p in gil["projections"] if p["cores"] == 16)
    assert sixteen["binds"] in ("GIL", "cores")
    assert sixteen["jobs_per_s"] == min(
        sixteen["gil_bound_jobs_per_s"], sixteen["cores_bound_jobs_per_s"]
    )
    assert "## What holds the GIL, per job" in (out / "report.md").read_text()
    # Jobs pushed into a running worker faster than it answers them: every one answered,
    # and the batches sealed while the stream held a backlog counted apart.
    live = o["live_producer"]
    assert live["results"] == live["jobs"] > 0 and live["model"] == "null"
    assert live["offered_per_s"] == pytest.approx(3 * every["jobs_per_s"], rel=0.01)
    assert 0 <= live["backlog_batches"] <= live["batches"]
    fill = live["batch_fill_with_backlog"]
    assert (fill is None) == (live["backlog_batches"] == 0)
    assert fill is None or 0 < fill <= 1
    assert live["met"] == (fill is not None and fill >= 0.97)
    # The queue ceiling per image set is a bound of every comparable gpufeed run's ideal.
    queue = {q["image_set"]: q for q in report["stage_rates"]["queue"]}
    assert set(queue) == {s["name"] for s in report["image_sets"]}
    for run in report["runs"]:
        if run["kind"] == "gpufeed" and not run.get("variant"):
            bound = run["ideal_bounds"]["queue (Redis)"]
            assert bound == pytest.approx(queue[run["image_set"]]["jobs_per_s"], rel=0.01)
            assert run["ideal_images_per_s"] <= bound + 0.01
    for t in o["targets"]:
        assert t["met"] or t["binds"]
    markdown = (out / "report.md").read_text()
    assert "## Overhead: the null model" in markdown and "Queue ceiling" in markdown
    assert "Live producer:" in markdown
    bad = copy.deepcopy(report)
    bad["overhead"]["runs"]["cache_hits"]["results"] -= 1
    bad["overhead"]["queue_ceiling"]["jobs_per_s"] = 0
    bad["overhead"]["live_producer"]["results"] -= 1
    problems = validate_report(bad)
    assert any("overhead.runs.cache_hits" in p for p in problems)
    assert any("overhead.queue_ceiling" in p for p in problems)
    assert any("overhead.live_producer" in p for p in problems)


def test_the_priority_section_measures_high_jobs_behind_a_burst(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    p = report["priority"]
    assert set(p["runs"]) == {"fifo", "priorities"}
    fifo, prio = p["runs"]["fifo"], p["runs"]["priorities"]
    for r in (fifo, prio):
        assert r["results"] == r["jobs"] > r["burst_low_jobs"] > 0
        assert r["high"]["jobs"] == r["high_jobs"] >= 2
        assert 0 < r["high"]["p50_ms"] <= r["high"]["p99_ms"] <= r["high"]["max_ms"]
    # Both runs carry the same load; only the levels differ.
    assert fifo["burst_low_jobs"] == prio["burst_low_jobs"]
    assert fifo["settings"]["priorities"] == "" and prio["settings"]["priorities"] == "high,low"
    assert "## Priorities:" in (out / "report.md").read_text()
    bad = copy.deepcopy(report)
    bad["priority"]["runs"]["fifo"]["results"] -= 1
    assert any("priority.runs.fifo" in p for p in validate_report(bad))


def test_the_tenants_section_serves_a_live_tenant_beside_a_backlog(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    t = report["tenants"]
    assert list(t["runs"]) == ["fifo", "tenants"]
    fifo, fair = t["runs"]["fifo"], t["runs"]["tenants"]
    for r in (fifo, fair):
        s = r["settings"]
        assert r["results"] == r["jobs"] > r["burst_bulk_jobs"] >= 3 * s["in_flight_limit"]
        assert r["live"]["jobs"] == r["live_jobs"] >= 2
        assert r["bulk"]["jobs"] == r["burst_bulk_jobs"]
        assert 0 < r["live"]["p50_ms"] <= r["live"]["p99_ms"] <= r["live"]["max_ms"]
        # Batch times: the latency over batch size / the run's own capacity.
        assert r["batch_ms"] == pytest.approx(
            1000 * s["batch_size"] / r["capacity_jobs_per_s"], rel=0.01
        )
        for k in ("p50", "p99", "max"):
            assert r["live_batches"][k] == pytest.approx(
                r["live"][f"{k}_ms"] / r["batch_ms"], abs=0.06
            )
        assert r["lone_batch_ms"] > 0
        # Every job's bytes are unique: the decode cache serves none of them.
        assert r["cache_hits"] == 0
    # Both runs carry the same load; only the key layout differs.
    assert fifo["burst_bulk_jobs"] == fair["burst_bulk_jobs"]
    assert fifo["settings"]["tenants"] == "" and fifo["settings"]["streams"] == [""]
    assert fair["settings"]["tenants"] == "bulk=1,live=1"
    assert fair["settings"]["streams"] == ["", ":t:bulk", ":t:live"]
    # Each on its own stream, the live tenant no longer waits for the bulk tenant's backlog,
    # and the bulk tenant keeps being served while the live jobs arrive.
    assert fair["live"]["p50_ms"] < fifo["live"]["p50_ms"]
    assert t["live_p50_speedup"] > 1
    assert fair["bulk_answered_during_trickle"] > 0
    assert "## Tenants:" in (out / "report.md").read_text()
    bad = copy.deepcopy(report)
    bad["tenants"]["runs"]["tenants"]["results"] -= 1
    bad["tenants"]["runs"]["fifo"]["cache_hits"] = 3
    problems = validate_report(bad)
    assert any(p.startswith("tenants.runs.tenants:") for p in problems)
    assert any("tenants.runs.fifo: 3 cache hits" in p for p in problems)


def test_the_batch_section_runs_producer_batch_beside_the_same_images_inline(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    s = report["batch"]
    assert (s["model"], s["batch_size"], s["source"], s["output"]) == (
        "null",
        32,
        "folder",
        "parquet",
    )
    jobs = s["image_set"]["jobs"]
    assert jobs == 256 and s["image_set"]["label"].startswith("64x64 JPEG")
    inline, batch = s["inline"], s["batch"]
    assert inline["results"] == inline["jobs"] == jobs
    # Every image through the client: one ok row each in the Parquet file it wrote.
    assert batch["results"] == batch["rows"] == batch["ok"] == batch["jobs"] == jobs
    assert batch["errors"] == 0 and batch["client_cpu_s"] > 0
    # Nothing repeats, so the decode cache served none of them in either run.
    assert s["images_repeat"] is False
    assert batch["decode_cache_hits"] == 0 and inline["cache_hit_ratio"] == 0
    # The worker's rate: the higher of the two runs', so the ratio never flatters the client.
    assert s["worker_jobs_per_s"] == max(inline["images_per_s"], batch["images_per_s"]) > 0
    assert s["worker_jobs_per_s_from"] == (
        "inline" if s["worker_jobs_per_s"] == inline["images_per_s"] else "batch"
    )
    assert s["ratio_to_inline"] == pytest.approx(
        s["client_capacity_per_s"] / inline["images_per_s"], rel=0.01
    )
    assert s["client_capacity_per_s"] == pytest.approx(1e6 / s["client_cpu_us_per_job"], rel=0.01)
    assert s["ratio_to_worker"] == pytest.approx(
        s["client_capacity_per_s"] / s["worker_jobs_per_s"], rel=0.01
    )
    assert s["met"] == (s["ratio_to_worker"] >= s["target_ratio"] == 10)
    markdown = (out / "report.md").read_text()
    assert "## Batch jobs: `producer batch` over a folder" in markdown
    assert "client capacity (1 / CPU per job)" in markdown
    bad = copy.deepcopy(report)
    bad["batch"]["batch"]["rows"] -= 1
    bad["batch"]["client_cpu_us_per_job"] = 0
    problems = validate_report(bad)
    assert any(p.startswith("batch.batch:") for p in problems)
    assert any("batch.client_cpu_us_per_job" in p for p in problems)


def test_a_sharded_run_that_lost_an_id_or_a_field_makes_the_report_invalid(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, _ = tiny
    # The tiny profile runs no sharded batch (a cluster and three workers are the quick
    # profile's); its report says so and is valid.
    assert report["batch"]["sharded"] is None
    bad = copy.deepcopy(report)
    bad["batch"]["sharded"] = {
        "one_client": {}, "clients": {}, "aggregate_capacity_per_s": 1.0,
        "capacity_ratio": 1.0, "side_by_side": {}, "rows": 2, "failover": {},
        "killed_client": {}, "met": False, "every_id_once": False,
    }  # fmt: skip
    assert validate_report(bad) == [
        "batch.sharded: the dataset does not hold every id exactly once"
    ]
    del bad["batch"]["sharded"]["side_by_side"]
    assert "batch.sharded.side_by_side is missing" in validate_report(bad)


def test_the_accuracy_section_compares_both_placements_with_torchvision(
    accuracy: dict[str, Any],
) -> None:
    a = accuracy
    assert set(a["placements"]) == {"host", "device"}
    assert a["images"] == len(SIZES) * 8 and a["orientations"] == list(range(1, 9))
    classes = a["size_classes"]
    assert [c["dct_scaled"] for c in classes].count(True) >= 2
    assert [c["reduced_on_host"] for c in classes].count(True) == 1
    assert any(min(c["width"], c["height"]) < a["staging_size"] for c in classes)  # upscaled
    for name, p in a["placements"].items():
        assert p["met"] and p["misses"] == [], name
        assert p["top1_agreement"] >= 0.99
        assert 0.995 <= p["cosine_min"] <= p["cosine_mean"] <= 1.0
        assert 0 < p["pixel_diff_mean"] < p["pixel_diff_max"] <= 10.0
        assert len(p["by_size_class"]) == len(classes)
        assert max(c["pixel_diff_max"] for c in p["by_size_class"]) == p["pixel_diff_max"]
        assert p["resized_on"].startswith("cpu")
    assert 0 < a["placements_max_diff"] <= 1.0
    markdown = "\n".join(accuracy_lines({"accuracy": a}))
    assert "## Accuracy: the same pixels as torchvision's eval transforms" in markdown
    assert "| host | cpu" in markdown and "| device | cpu" in markdown
    bad = copy.deepcopy(a)
    del bad["placements"]["device"]
    assert validate_section(bad) == ["accuracy.placements must be host and device"]
    bad = copy.deepcopy(a)
    bad["placements"]["host"].update(top1_agreement=1.5, cosine_min=float("nan"), met=False)
    problems = validate_section(bad)
    assert any("host.top1_agreement" in p for p in problems)
    assert any("host.cosine_min" in p for p in problems)
    assert any("met must say" in p for p in problems)


def validate_section(accuracy: dict[str, Any]) -> list[str]:
    """The accuracy section's problems in an otherwise valid report."""
    return [
        p for p in validate_report({"accuracy": accuracy, **minimal_report()}) if "accuracy" in p
    ]


def test_the_per_job_trailer_keeps_the_pixels_and_makes_every_job_unique() -> None:
    data = load_image_set(ImageSetSpec("u", 1600, 1200, 2, quality=90, seed=4), None).images
    jobs = [job_image(data, i, f"run-{i}", unique=True) for i in range(6)]
    assert len({cache_key(j) for j in jobs}) == 6  # the decode cache never hits
    assert [job_image(data, i, f"run-{i}", unique=False) for i in range(4)] == [*data, *data]
    first, tagged = data[0], jobs[2]
    assert first.endswith(b"\xff\xd9") and tagged == first + b"gpufeed-bench-run-2"
    with Image.open(io.BytesIO(first)) as a, Image.open(io.BytesIO(tagged)) as b:
        assert np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))
    for dct in (True, False):
        spec = DecodeSpec(size=224, dct_scaling=dct)
        plain, info = decode_to_array(first, spec)
        out = np.zeros_like(plain)
        assert decode_into(tagged, out, spec) == info
        assert np.array_equal(plain, out)
    # The naive worker's CPU work (full decode and torchvision transforms) is unchanged too.
    naive = NaivePreprocess(resize=256, crop=224, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))
    assert torch.equal(naive(first), naive(tagged))


def minimal_report() -> dict[str, Any]:
    """A report with one run and no optional section, valid but for `accuracy`."""
    return {
        "schema_version": 1,
        "profile": "tiny",
        "host": {
            "host": "h",
            "platform": "Linux",
            "python": "3.12.3",
            "torch": "2.11.0",
            "cpu_count": 2,
            "torch_threads": 2,
            "device": "cpu",
            "load_avg_1m_at_start": 0.2,
            "load_avg_1m_at_end": 1.9,
        },
        "image_sets": [{"name": "s"}],
        "runs": [
            {
                "name": "gpufeed",
                "kind": "gpufeed",
                "model": "m",
                "image_set": "s",
                "jobs": 4,
                "results": 4,
                "results_ok": 4,
                "results_error": 0,
                "images_per_s": 10.0,
                "duration_s": 0.4,
                "p50_ms": 200.0,
                "p95_ms": 300.0,
                "p99_ms": 390.0,
                "ideal_images_per_s": 12.0,
                "efficiency": 0.83,
                "vs_ceiling": 0.5,
                "vs_naive": 3.0,
                "timeline": {"bin_s": 0.5, "results": [4], "images_per_s": [8.0]},
                "cpu_core_ms_per_image": {"total": 5.0},
                "gil": {
                    "gil_us_per_job": {"event_loop": 40, "decode": 9, "launch": 1, "other": 0},
                    "decode_released_us_per_job": 300,
                    "process_cpu_us_per_job": 400,
                    "projections": [gil_account.project({"event_loop": 50.0}, 400.0, 16)],
                },
            }
        ],
        "summary": {
            "s": {"vs_naive": 3.0, "vs_ceiling": 0.5, "pipeline_efficiency": 0.8, "ideal_ratio": 4}
        },
        "stage_rates": {"decode": [{"images_per_s": 5.0}], "model": [{"images_per_s": 9.0}]},
        "targets": [],
    }


def test_validation_catches_missing_results_and_unreal_figures(
    accuracy: dict[str, Any],
) -> None:
    report = {**minimal_report(), "accuracy": accuracy}
    assert any("accuracy must be an object" in p for p in validate_report(minimal_report()))
    assert validate_report(report) == []
    short = copy.deepcopy(report)
    short["runs"][0]["results"] = 3
    assert any("3 results for 4 jobs" in p for p in validate_report(short))
    unreal = copy.deepcopy(report)
    unreal["runs"][0]["images_per_s"] = float("nan")
    unreal["summary"]["s"]["vs_naive"] = 0.0
    problems = validate_report(unreal)
    assert any("not finite" in p for p in problems)
    assert any("summary[s].vs_naive" in p for p in problems)
    disordered = copy.deepcopy(report)
    disordered["runs"][0]["p99_ms"] = 100.0
    assert any("out of order" in p for p in validate_report(disordered))
    hits = copy.deepcopy(report)
    hits["runs"][0]["cache_hit_ratio"] = 0.75  # a comparable run answered from the cache
    assert any("cache hits on unique job bytes" in p for p in validate_report(hits))
    blind = copy.deepcopy(report)
    del blind["runs"][0]["gil"]["gil_us_per_job"]["decode"]
    blind["runs"][0]["gil"]["projections"][0]["binds"] = None
    problems = validate_report(blind)
    assert any("gil.gil_us_per_job.decode" in p for p in problems)
    assert any("names no binding" in p for p in problems)
    on = copy.deepcopy(report)
    on["runs"][0].update(
        variant="cache_on_repeats", workload="repeats", repeats=4.0, cache_hit_ratio=0.0
    )
    for key in ("ideal_images_per_s", "efficiency", "vs_ceiling", "vs_naive"):
        del on["runs"][0][key]  # the pair is outside the ideal: none of these is required
    assert validate_report(on) == [
        "runs[0] (gpufeed, m, s): no cache hit on repeated images with the cache on",
        "runs[0] (gpufeed, m, s): cache_worth must be a positive number",
    ]
    on["runs"][0].update(cache_hit_ratio=0.75, cache_worth=3.2)
    assert validate_report(on) == []


# Each named check of validate_report, a report broken where it looks, and what it says.
BROKEN_REPORTS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "schema_version": (lambda r: r.update(schema_version=2), "schema_version 2 != 1"),
    "numbers": (
        lambda r: r["runs"][0].update(duration_s=math.inf),
        ".runs[0].duration_s is not finite (inf)",
    ),
    "host": (lambda r: r["host"].pop("device"), "host: missing key 'device'"),
    "runs": (lambda r: r.update(runs=[]), "runs must be a non-empty list"),
    "summary": (lambda r: r.update(summary={}), "summary must have one entry per image set"),
    "stage_rates": (
        lambda r: r["stage_rates"].update(model=[]),
        "stage_rates needs decode and model entries",
    ),
    "overhead": (lambda r: r.update(overhead=[]), "overhead must be an object or null"),
    "batch": (lambda r: r.update(batch=[]), "batch must be an object or null"),
    "priority": (
        lambda r: r.update(priority={"runs": {}}),
        "priority.runs must be fifo and priorities",
    ),
    "tenants": (lambda r: r.update(tenants={"runs": {}}), "tenants.runs must be fifo and tenants"),
    "warm_start": (
        lambda r: r.update(warm_start={"runs": {}}),
        "warm_start.runs must be learn, cold and warm",
    ),
    "accuracy": (lambda r: r.update(accuracy=None), "accuracy must be an object"),
    "latency_under_load": (
        lambda r: r.update(latency_under_load={"points": []}),
        "latency_under_load has 0 points, want 3",
    ),
    "curves": (
        lambda r: r.update(curves=[{"offered_per_s": 1.0}]),
        "has no positive achieved_per_s",
    ),
}
# Each named check of a run, a run broken where it looks, and what it says.
BROKEN_RUNS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "identity": (lambda run: run.update(image_set="t"), "unknown image set 't'"),
    "numbers": (lambda run: run.update(duration_s=0), "duration_s must be a positive number"),
    "cache": (
        lambda run: run.update(cache_hit_ratio=1.5),
        "cache_hit_ratio must be between 0 and 1",
    ),
    "counts": (lambda run: run.update(results_error=1), "results_ok + results_error != results"),
    "percentiles": (lambda run: run.update(p95_ms=500.0), "percentiles out of order"),
    "timeline": (
        lambda run: run["timeline"].update(images_per_s=[-1.0]),
        "timeline has negative values",
    ),
    "vs_naive": (lambda run: run.pop("vs_naive"), "vs_naive must be a positive number"),
    "cpu": (
        lambda run: run.update(cpu_core_ms_per_image={"total": 0}),
        "cpu_core_ms_per_image.total must be positive",
    ),
    "gil": (lambda run: run.update(gil=None), "gil must be an object"),
}


def test_every_named_check_has_a_broken_report_below() -> None:
    assert set(BROKEN_REPORTS) == set(REPORT_CHECKS)
    assert set(BROKEN_RUNS) == {"identity", *RUN_CHECKS}


@pytest.mark.parametrize("name", list(BROKEN_REPORTS))
def test_each_check_of_the_report_finds_what_it_looks_for(
    name: str, accuracy: dict[str, Any]
) -> None:
    report = {**minimal_report(), "accuracy": accuracy}
    assert validate_report(report) == []
    breaks, says = BROKEN_REPORTS[name]
    breaks(report)
    problems = validate_report(report)
    assert any(says in p for p in problems), problems
    assert any(says in p for p in REPORT_CHECKS[name](report)), "found by another check"


@pytest.mark.parametrize("name", list(BROKEN_RUNS))
def test_each_check_of_a_run_finds_what_it_looks_for(name: str, accuracy: dict[str, Any]) -> None:
    report = {**minimal_report(), "accuracy": accuracy}
    breaks, says = BROKEN_RUNS[name]
    breaks(report["runs"][0])
    found = [p for p in validate_report(report) if says in p]
    assert len(found) == 1 and found[0].startswith("runs[0] (gpufeed, m, "), found
    if name != "identity":
        assert any(says in p for p in RUN_CHECKS[name]("runs[0]", report["runs"][0]))


def test_a_report_s_host_block_is_checked_by_the_shared_definition() -> None:
    report = json.loads((ROOT / "docs" / "figures" / "report.json").read_text())
    assert validate_report(report) == []
    report["host"]["device_name"] = "NVIDIA H200"  # the doctor's name for the bench's `gpu`
    report["host"]["cpu_count"] = "2"
    del report["host"]["commit"]  # reports from before it was recorded lack it
    assert validate_report(report) == [
        "host.cpu_count: expected integer, got str",
        "host: undocumented key 'device_name'",
    ]


def test_the_ideal_reproduces_the_orientation_figures_of_the_issue() -> None:
    # 4000x3000 on 2 cores: DCT-scaled decode ~39/s per core, resnet18 ~44/s at batch 8
    # (both cores); naive: full decode 12.5/s, resize 30/s, batch-1 forward 35/s.
    gpufeed = ideal_pipeline(decode_run=78, decode_all_cores=78, model=44, shared_cpu=True)
    assert gpufeed.limited_by == "shared CPU (decode + model)"
    naive_cpu = 1 / (1 / 12.5 + 1 / 30)
    naive = ideal_sequential(cpu_per_image=naive_cpu, model_batch_1=35)
    assert gpufeed.images_per_s / naive == pytest.approx(4.0, abs=0.1)  # "roughly 4x"
    # With its own device, the model is one bound and decode the other.
    gpu = ideal_pipeline(decode_run=600, decode_all_cores=600, model=3000, shared_cpu=False)
    assert (gpu.images_per_s, gpu.limited_by) == (600, "decode")
    # One decode thread caps the pipeline at one thread's rate.
    one = ideal_pipeline(decode_run=39, decode_all_cores=78, model=300, shared_cpu=True)
    assert (one.images_per_s, one.limited_by) == (39, "decode")


def test_the_queue_ceiling_bounds_the_ideal_where_it_binds() -> None:
    fast = ideal_pipeline(
        decode_run=20_000, decode_all_cores=20_000, model=90_000, shared_cpu=False, queue=9000
    )
    assert (fast.images_per_s, fast.limited_by) == (9000, "queue (Redis)")
    assert fast.bounds == {"decode": 20_000, "model": 90_000, "queue (Redis)": 9000}
    slow = ideal_pipeline(
        decode_run=600, decode_all_cores=600, model=3000, shared_cpu=False, queue=9000
    )
    assert (slow.images_per_s, slow.limited_by) == (600, "decode")


def test_image_sets_are_deterministic_and_cached(tmp_path: Path) -> None:
    spec = ImageSetSpec("t", 200, 150, 3, quality=80, seed=9)
    first = load_image_set(spec, tmp_path)
    again = load_image_set(spec, tmp_path)
    fresh = load_image_set(spec, None)
    assert first.images == again.images == fresh.images
    assert len(list((tmp_path / f"t-{spec.key()}").glob("*.jpg"))) == 3
    assert ImageSetSpec("t", 200, 150, 3, quality=81, seed=9).key() != spec.key()
    with Image.open(__import__("io").BytesIO(first.images[2])) as im:
        assert im.size == (200, 150) and im.format == "JPEG"
    portrait = ImageSetSpec("p", 200, 150, 4, portrait_every=4)
    assert portrait.size_of(3) == (150, 200) and portrait.size_of(0) == (200, 150)


def test_the_cpu_preprocessing_emulation_feeds_the_model_the_same_pixels() -> None:
    data = load_image_set(ImageSetSpec("e", 1600, 1200, 1, quality=90), None).images[0]
    spec = DecodeSpec(size=73)
    reference, _ = decode_to_array(data, spec)
    emulated = CpuPreprocess(
        spec, crop=64, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)
    ).to_array(data)
    off = (73 - 64) // 2
    a = reference[off : off + 64, off : off + 64].astype(np.int16)
    b = emulated[off : off + 64, off : off + 64].astype(np.int16)
    assert np.abs(a - b).mean() < 3.0


def test_the_cli_refuses_an_unknown_profile() -> None:
    result = CliRunner().invoke(cli, ["bench", "--profile", "huge"])
    assert result.exit_code == 2
    assert "tiny" in result.output and "quick" in result.output
    help_text = CliRunner().invoke(cli, ["bench", "--help"]).output
    assert "BENCH_PROFILE" in help_text


@pytest.mark.parametrize(
    ("args", "now"),
    [
        (["bench", "--profile", "tiny"], "python -m measure bench"),
        (["gpu-check", "--judge", "report.json"], "python -m measure gpu-check --judge"),
    ],
)
def test_the_worker_s_old_commands_say_where_the_measurements_went(
    args: list[str], now: str
) -> None:
    """`python -m worker bench` (and `gpu-check`) from before the measurements left the
    worker's package: one line naming the command that replaced it, exit 2."""
    from worker.cli import cli as worker_cli

    result = CliRunner().invoke(worker_cli, args, prog_name="python -m worker")
    assert result.exit_code == 2
    assert now in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_the_warm_start_section_measures_a_restarted_worker_cold_and_warm(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    report, out = tiny
    w = report["warm_start"]
    assert list(w["runs"]) == ["learn", "cold", "warm"]
    for r in w["runs"].values():
        assert r["results_ok"] == r["jobs"] == w["jobs"] and 0 <= r["hits"] <= r["jobs"]
    cold, warm = w["runs"]["cold"]["warm_start"], w["runs"]["warm"]["warm_start"]
    assert cold["why_not"] == "GPUFEED_TUNING warm_start_s=0" and cold["warmed"] == 0
    assert warm["why_not"] == "" and 0 < warm["warmed"] == warm["listed"] <= w["images"]
    # The same window of jobs: warmed, the images the last worker hit are hits from the start.
    assert w["hit_rate_warm"] > w["hit_rate_cold"]
    assert "## Warm start:" in (out / "report.md").read_text()
    bad = copy.deepcopy(report)
    bad["warm_start"]["runs"]["cold"]["results_ok"] -= 1
    assert any("warm_start.runs.cold" in p for p in validate_report(bad))
