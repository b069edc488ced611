"""The benchmark's outputs: report.json (schema in docs/bench-schema.md), report.md, and
throughput.png; and `validate_report`, which checks a report against that schema and that
every figure is a real measurement."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from measure.bench.batch import batch_problems
from worker.model.sizes import batch_shapes_line
from worker.tools.harness import report_head
from worker.tools.markdown import table

SCHEMA_VERSION = 1

RUN_NUMBERS = ("images_per_s", "p50_ms", "p95_ms", "p99_ms", "duration_s")
SUMMARY_NUMBERS = ("vs_naive", "vs_ceiling", "pipeline_efficiency", "ideal_ratio")
# The decode-cache pair (measure/bench/ablations.py): repeated images, outside the ideal.
CACHE_VARIANTS = ("cache_on_repeats", "cache_off_repeats")


# --------------------------------------------------------------------------- helpers
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def is_cache_run(run: Mapping[str, Any]) -> bool:
    return run.get("variant") in CACHE_VARIANTS


def _runs_of(report: Mapping[str, Any], image_set: str, model: str) -> list[dict[str, Any]]:
    """The comparable runs (unique job bytes) of one image set and model."""
    return [
        r
        for r in report["runs"]
        if r["image_set"] == image_set and r["model"] == model and not is_cache_run(r)
    ]


def _groups(report: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for run in report["runs"]:
        if is_cache_run(run):
            continue
        key = (run["image_set"], run["model"])
        if key not in seen:
            seen.append(key)
    yield from seen


def _cpu(run: Mapping[str, Any]) -> str:
    return " / ".join(
        _fmt(run.get(k), 0) for k in ("cpu_process_pct", "cpu_redis_pct", "cpu_other_processes_pct")
    )


def _run_label(run: Mapping[str, Any]) -> str:
    if run["name"] in ("naive", "gpufeed"):
        return f"**{run['name']}**"
    return f"gpufeed, {run['label']}"


def _gain(run: Mapping[str, Any]) -> str:
    gain = run.get("optimisation_gain")
    return "" if gain is None else f"x{gain:.2f}"


# --------------------------------------------------------------------------- markdown
def render_markdown(report: Mapping[str, Any]) -> str:
    host = report["host"]
    sets = {s["name"]: s for s in report["image_sets"]}
    out: list[str] = [f"# gpufeed benchmark: {report['profile']} profile", ""]
    gpu = f", {host['gpu']}" if host.get("gpu") else ""
    out.append(
        f"{host['cpu_count']} CPU cores, device {host['device']}{gpu}, torch {host['torch']}, "
        f"load average {host['load_avg_1m_at_start']} at the start; {report['created_at']}; "
        f"the benchmark took {report['elapsed_s']:.0f} s."
    )
    out += [
        "",
        "Each run: every job's bytes are unique (a per-job trailer after the JPEG's "
        "end-of-image marker, which decoders ignore: the same pixels), so gpufeed's decode "
        "cache never hits and every run decodes every image, as the naive worker and the "
        "ideal do (the cache is measured apart, on repeated images); "
        "all jobs queued in Redis before the worker reads; images/s = results / "
        "(first read to last result); latency is end to end for that burst (so p50 is about "
        "half the run); CPU % = the benchmark process (the worker runs in it) / redis-server / "
        "every other process on the host, in % of one core; "
        "ideal = the throughput the isolated stage costs allow; efficiency = images/s / ideal; "
        "optimisation worth = gpufeed (defaults) images/s / the run's, with that one "
        "optimisation switched off.",
    ]
    for image_set, model in _groups(report):
        s = sets[image_set]
        runs = _runs_of(report, image_set, model)
        g = next((r for r in runs if r["name"] == "gpufeed"), runs[0])
        st = g.get("settings", {})
        out += [
            "",
            f"## {image_set}: {s['label']}, {s['distinct_images']} distinct images, "
            f"{s['jobs']} jobs per run; {model}",
            "",
            f"gpufeed: batch {st.get('batch_size')}, {st.get('dtype')}, compile "
            f"{st.get('compile')}, {st.get('decode_threads')} decode "
            f"{'processes' if st.get('decode_processes') else 'threads'}, max wait "
            f"{_fmt(st.get('max_wait_ms'), 0)} ms; weights {st.get('weights')}"
            # Reports from before the feed plan have neither.
            + (
                f"; {_fmt(st['staged_bytes_per_image'], 0)} bytes staged per image"
                if "staged_bytes_per_image" in st
                else ""
            )
            + ".",
            "",
            *([f"Feed plan: {st['feed_plan']}.", ""] if "feed_plan" in st else []),
            # Reports from before several batch shapes have none.
            *(
                [f"Batch shapes: {batch_shapes_line(st['batch_sizes'])}.", ""]
                if st.get("batch_sizes")
                else []
            ),
        ]
        rows = [
            [
                _run_label(r),
                _fmt(r["images_per_s"]),
                _fmt(r["p50_ms"], 0),
                _fmt(r["p95_ms"], 0),
                _fmt(r["p99_ms"], 0),
                _cpu(r),
                _fmt(r.get("gpu_util_pct"), 0),
                _fmt(r.get("vs_naive"), 2),
                _fmt(r.get("vs_ceiling"), 2),
                _fmt(r.get("ideal_images_per_s")),
                _fmt(r.get("efficiency"), 2),
                _gain(r),
            ]
            for r in runs
        ]
        out.append(
            table(
                [
                    "run",
                    "images/s",
                    "p50 ms",
                    "p95 ms",
                    "p99 ms",
                    "CPU %",
                    "GPU %",
                    "vs naive",
                    "vs ceiling",
                    "ideal images/s",
                    "efficiency",
                    "optimisation worth",
                ],
                rows,
                align="lr",
            )
        )
    out += ["", "## Summary", ""]
    rows = []
    for image_set, entry in report["summary"].items():
        for model, m in entry["by_model"].items():
            rows.append(
                [
                    image_set,
                    model,
                    _fmt(m["gpufeed_images_per_s"]),
                    _fmt(m["naive_images_per_s"]),
                    _fmt(m["ceiling_images_per_s"]),
                    f"{_fmt(m['ideal_images_per_s'])} ({m['ideal_limited_by']})",
                    _fmt(m["pipeline_efficiency"], 2),
                    _fmt(m["vs_naive"], 2),
                    _fmt(m["ideal_ratio"], 2),
                    _fmt(m["vs_naive_of_ideal_ratio"], 2),
                    _fmt(m["vs_ceiling"], 2),
                ]
            )
    out.append(
        table(
            [
                "image set",
                "model",
                "gpufeed images/s",
                "naive",
                "ceiling",
                "ideal (bound)",
                "pipeline efficiency",
                "gpufeed/naive",
                "ideal ratio",
                "of ideal ratio",
                "gpufeed/ceiling",
            ],
            rows,
            align="llr",
        )
    )
    out += _cache_lines(report)
    out += _url_lines(report)
    out += overhead_lines(report)
    out += batch_lines(report)
    out += gil_lines(report)
    out += priority_lines(report)
    out += tenants_lines(report)
    out += warm_start_lines(report)
    out += accuracy_lines(report)
    out += _stage_rate_lines(report)
    out += _target_lines(report)
    if report.get("curves"):
        out += ["", "## Latency against throughput, per batcher max wait", ""]
        out.append(
            table(
                ["max wait ms", "load", "offered/s", "achieved/s", "p50 ms", "p99 ms"],
                [
                    [
                        _fmt(c["max_wait_ms"], 0),
                        _fmt(c["load"], 2),
                        _fmt(c["offered_per_s"]),
                        _fmt(c["achieved_per_s"]),
                        _fmt(c["p50_ms"], 0),
                        _fmt(c["p99_ms"], 0),
                    ]
                    for c in report["curves"]
                ],
                align="lr",
            )
        )
    out += load_latency_lines(report)
    if report.get("skipped"):
        out += ["", "Not run:"]
        out += [f"- {s['what']}: {s['reason']}" for s in report["skipped"]]
    if report.get("notes"):
        out += ["", "Notes:"]
        out += [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


def overhead_lines(report: Mapping[str, Any]) -> list[str]:
    """The overhead section (measure/bench/overhead.py) as a table and its targets."""
    o = report.get("overhead")
    if not o:
        return []
    q = o["queue_ceiling"]
    s = o["image_set"]
    out = [
        "",
        f"## Overhead: the null model, {s['label']}, batch {o['batch_size']}, "
        f"{s['jobs']} jobs per run",
        "",
        f"Queue ceiling (gpufeed's Redis work alone: XREADGROUP COUNT {q['batch']}, one "
        f"pipelined publish script per job): {_fmt(q['jobs_per_s'])} jobs/s, "
        f"{_fmt(q['loop_cpu_us_per_job'])} µs of client CPU per job. CPU per job in µs: "
        "the event loop's thread, the worker process's threads together, redis-server.",
        "",
    ]
    rows = [
        [
            workload.replace("_", " "),
            _fmt(r["jobs_per_s"]),
            _fmt(r["loop_cpu_us_per_job"]),
            _fmt(r["worker_cpu_us_per_job"]),
            _fmt(r["redis_cpu_us_per_job"]),
            _fmt(r["vs_queue_ceiling"], 3),
            _fmt(r["batch_fill"], 3),
            _fmt(r["cache_hit_ratio"], 3),
            r["binds"],
        ]
        for workload, r in o["runs"].items()
    ]
    out.append(
        table(
            [
                "workload",
                "jobs/s",
                "event loop µs/job",
                "worker µs/job",
                "redis µs/job",
                "of queue ceiling",
                "batch fill",
                "cache hits",
                "busiest stage",
            ],
            rows,
            align="lrrrrrrrl",
        )
    )
    live = o.get("live_producer")
    if live:
        out += [
            "",
            f"Live producer: {_fmt(live['offered_per_s'])} jobs/s offered "
            f"({_fmt(live['pushed_per_s'])} pushed) into a running worker that answers about "
            f"{_fmt(live['capacity_per_s'])}, every job decoded, {live['jobs']} jobs: batch "
            f"fill {_fmt(live['batch_fill_with_backlog'], 3)} over the "
            f"{live['backlog_batches']} of {live['batches']} batches sealed while the stream "
            f"held at least a batch unread (at most {live['max_backlog']} jobs); "
            f"{_fmt(live['batch_fill_overall'], 3)} over all of them.",
        ]
    out += [""]
    for t in o["targets"]:
        sign = ">=" if t["at_least"] else "<="
        line = f"- {t['target']}: {_fmt(t['measured'], 3)} ({sign} {_fmt(t['threshold'], 3)}): "
        if t["met"]:
            line += "met"
        else:
            busy = ", ".join(f"{k} {v:.2f}" for k, v in t["busy"].items())
            line += f"missed; busiest stage {t['binds']} (busy fractions: {busy})"
        out.append(line)
    return out


def _gil_runs(report: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    """(label, GIL figures, jobs/s) of each gpufeed defaults run and each overhead run."""
    for run in report["runs"]:
        if run.get("kind") == "gpufeed" and run.get("name") == "gpufeed" and run.get("gil"):
            yield f"{run['model']}, {run['image_set']}", run["gil"], run["images_per_s"]
    o = report.get("overhead") or {}
    for workload, r in (o.get("runs") or {}).items():
        if r.get("gil"):
            label = f"null, {o['image_set']['name']}, {workload.replace('_', ' ')}"
            yield label, r["gil"], r["jobs_per_s"]


def batch_lines(report: Mapping[str, Any]) -> list[str]:
    """The batch section (measure/bench/batch.py)."""
    s = report.get("batch")
    if not s:
        return []
    inline, batch, images = s["inline"], s["batch"], s["image_set"]
    out = [
        "",
        f"## Batch jobs: `producer batch` over a folder, the null model, {images['label']}, "
        f"batch {s['batch_size']}, {images['jobs']} images",
        "",
        "Each image's bytes are unique (nothing repeats; decode cache hits: "
        f"{batch['decode_cache_hits']} in the batch run, ratio "
        f"{_fmt(inline['cache_hit_ratio'], 3)} inline). The client runs as its own process; "
        "its CPU is every thread of it from the start of the run.",
        "",
    ]
    out.append(
        table(
            ["run", "images/s", "client CPU µs/job", "worker CPU µs/job"],
            [
                [
                    "inline (jobs queued first)",
                    _fmt(inline["images_per_s"]),
                    _fmt(None),
                    _fmt(inline["worker_cpu_us_per_job"]),
                ],
                [
                    f"producer batch (in flight {s['in_flight']})",
                    _fmt(batch["images_per_s"]),
                    _fmt(s["client_cpu_us_per_job"]),
                    _fmt(None),
                ],
            ],
            align="lr",
        )
    )
    out += [
        "",
        f"- client capacity (1 / CPU per job): {_fmt(s['client_capacity_per_s'])} jobs/s, "
        f"{_fmt(s['ratio_to_worker'], 2)}x one null-model worker's "
        f"{_fmt(s['worker_jobs_per_s'])} jobs/s (the {s['worker_jobs_per_s_from']} run's, "
        f"the higher; {_fmt(s['ratio_to_inline'], 2)}x the inline run's) "
        f"(>= {_fmt(s['target_ratio'], 0)}): " + ("met" if s["met"] else "missed"),
    ]
    return out + sharded_lines(s.get("sharded"))


def sharded_lines(f: Mapping[str, Any] | None) -> list[str]:
    """The batch section's sharded run (measure/bench/batch_fleet.py)."""
    if not f:
        return []
    plan = f["plan"]
    rows = [
        [
            "one client, the whole manifest (twice)",
            _fmt(f["one_client"]["answered"]),
            _fmt(f["one_client"]["cpu_us_per_job"]),
            _fmt(f["one_client"]["capacity_per_s"]),
        ]
    ]
    for name, c in f["clients"].items():
        rows.append([f"{name}, alone", _fmt(c["answered"]), _fmt(c["cpu_us_per_job"]),
                     _fmt(c["capacity_per_s"])])  # fmt: skip
    side = f["side_by_side"]
    for name, c in side["clients"].items():
        rows.append([f"{name}, side by side", _fmt(c["answered"]), _fmt(c["cpu_us_per_job"]),
                     _fmt(c["capacity_per_s"])])  # fmt: skip
    killed, failover = f["killed_client"], f["failover"]
    return [
        "",
        f"### Sharded: {plan['clients']} clients, {plan['shards']}-master Redis Cluster with "
        f"replicas, {plan['workers']} null-model workers, {plan['jobs']} path jobs",
        "",
        "Each file's bytes unique (the decode cache serves none). One client over the whole "
        "manifest; each part's client alone (`--part I/N`, one after another); then the "
        "parts side by side into one dataset; mid-run "
        f"{killed.get('client', 'no client')} killed (SIGKILL at "
        f"{_fmt(killed.get('at_answered'))} answered) and started again, and the master of "
        f"shard 1 killed at {_fmt(failover.get('at_answered'))} answered (its replica took "
        f"over in {_fmt(failover.get('took_over_s'), 1)} s; failovers waited out by the "
        f"clients: {failover['waited_out']}, jobs found lost and submitted again: "
        f"{failover['jobs_submitted_again']}).",
        "",
        table(["client", "answered", "CPU µs/job", "capacity jobs/s"], rows, align="lrrr"),
        "",
        f"- the dataset: {_fmt(f['rows'])} rows, {_fmt(f['distinct_ids'])} ids, every id of "
        f"the manifest once: {'yes' if f['every_id_once'] else 'NO'}; `_SUCCESS`: "
        f"{'present' if f.get('success_marker') else 'missing'}",
        f"- the parts' capacity together (each alone, as on a machine of its own): "
        f"{_fmt(f['aggregate_capacity_per_s'])} jobs/s, {_fmt(f['capacity_ratio'], 2)}x one "
        f"client's (>= {_fmt(f['target_ratio'], 1)}): " + ("met" if f["met"] else "missed"),
        f"- side by side on this host, through the kill and the failover: "
        f"{_fmt(side['aggregate_capacity_per_s'])} jobs/s, {_fmt(side['capacity_ratio'], 2)}x",
        f"- on this host's wall clock (every process sharing its cores): one client "
        f"{_fmt(f['one_client']['jobs_per_s'])} jobs/s, the fleet "
        f"{_fmt(f['fleet_jobs_per_s'])} jobs/s",
    ]


def gil_lines(report: Mapping[str, Any]) -> list[str]:
    """What holds the GIL per job in each run, and the most one process could serve."""
    found = list(_gil_runs(report))
    if not found:
        return []
    cores = sorted({p["cores"] for _, g, _ in found for p in g["projections"]})
    rows = []
    for label, g, rate in found:
        held = g["gil_us_per_job"]
        mark = "*" if g.get("launch_computes_model") else ""
        by_cores = {p["cores"]: p for p in g["projections"]}
        rows.append(
            [
                label,
                _fmt(rate),
                _fmt(held["event_loop"]),
                f"{_fmt(held['decode'])} ({_fmt(g['decode_released_us_per_job'])})",
                _fmt(held["launch"]),
                _fmt(held["other"]),
                _fmt(sum(held.values())),
                _fmt(g["process_cpu_us_per_job"]),
                *(
                    f"{_fmt(by_cores[n]['jobs_per_s'])} ({by_cores[n]['binds']}{mark})"
                    if n in by_cores
                    else "-"
                    for n in cores
                ),
            ]
        )
    cost = found[0][1].get("timed_call_us")
    return [
        "",
        "## What holds the GIL, per job",
        "",
        "µs per job holding the GIL, by thread: the event loop (reader, batcher, completion, "
        "writer, Redis client) and the launch thread count their CPU time; decode threads "
        "their CPU time less the time inside calls that release the GIL (libjpeg-turbo, "
        "Pillow's decode and resize, the row copy: in brackets). With decode processes the "
        "decode column is the threads that send them rows (less the kernel's copy, in "
        "brackets); the processes hold GILs of their own, and their CPU counts in the CPU "
        "column. One process serves at most 1e6 / (the GIL µs of all threads) jobs/s, and N x "
        "1e6 / (the CPU µs per job) on N cores; the projection is the lower, with what binds"
        + (f" (timing a call costs {_fmt(cost, 2)} µs here)." if cost is not None else "."),
        "",
        table(
            [
                "run",
                "jobs/s",
                "event loop",
                "decode (released)",
                "launch",
                "other",
                "GIL µs/job",
                "CPU µs/job",
                *(f"{n} cores: jobs/s" for n in cores),
            ],
            rows,
            align="lr",
        ),
        *(
            [
                "",
                "\\* the model computes on the CPU, on the launch thread, in torch ops that "
                "release the GIL: its CPU time counted as held makes that projection a loose "
                "lower bound; the null model's runs measure what the feed itself holds.",
            ]
            if any(g.get("launch_computes_model") for _, g, _ in found)
            else []
        ),
    ]


def _gil_problems(where: str, g: Any) -> list[str]:
    if not isinstance(g, Mapping):
        return [f"{where}: gil must be an object"]
    problems = []
    held = g.get("gil_us_per_job") or {}
    for kind in ("event_loop", "decode", "launch", "other"):
        value = held.get(kind)
        if not isinstance(value, int | float) or value < 0:
            problems.append(f"{where}: gil.gil_us_per_job.{kind} must be a number >= 0")
    projections = g.get("projections") or []
    if not projections:
        problems.append(f"{where}: gil.projections missing")
    for p in projections:
        if p.get("binds") not in ("GIL", "cores") or not _positive(p.get("jobs_per_s")):
            problems.append(f"{where}: gil projection {p} names no binding and rate")
    return problems


def priority_lines(report: Mapping[str, Any]) -> list[str]:
    """The priority section (measure/bench/priority.py): high-priority latency behind a
    low-priority burst, with and without levels."""
    p = report.get("priority")
    if not p:
        return []
    fifo = p["runs"]["fifo"]
    out = [
        "",
        f"## Priorities: {p['model']}, a burst of {fifo['burst_low_jobs']} low jobs (3x what "
        f"the worker serves in {_fmt(p['seconds'], 1)} s) and {fifo['high_jobs']} high jobs "
        f"at {_fmt(fifo['high_per_s'], 1)}/s",
        "",
        "Latency: Redis time from a job's entry to its result. `fifo`: one stream, "
        f"as without priorities; `priorities`: levels {p['levels']}, weights {p['weights']}.",
        "",
    ]
    rows = [
        [
            mode,
            _fmt(r["capacity_jobs_per_s"]),
            _fmt(r["high"]["p50_ms"], 0),
            _fmt(r["high"]["p99_ms"], 0),
            _fmt(r["low"]["p50_ms"], 0),
            _fmt(r["low"]["p99_ms"], 0),
            str(r["low_answered_during_trickle"]),
        ]
        for mode, r in p["runs"].items()
    ]
    out.append(
        table(
            [
                "run",
                "capacity jobs/s",
                "high p50 ms",
                "high p99 ms",
                "low p50 ms",
                "low p99 ms",
                "low answered meanwhile",
            ],
            rows,
            align="lr",
        )
    )
    out += [
        "",
        f"High-priority p50 {_fmt(p['high_p50_speedup'], 2)}x and p99 "
        f"{_fmt(p['high_p99_speedup'], 2)}x lower with levels.",
    ]
    return out


def tenants_lines(report: Mapping[str, Any]) -> list[str]:
    """The tenants section (measure/bench/tenants.py): the live tenant's latency beside
    the bulk tenant's backlog, both on one stream and each on its own."""
    t = report.get("tenants")
    if not t:
        return []
    fifo = t["runs"]["fifo"]
    out = [
        "",
        f"## Tenants: {t['model']}, the bulk tenant's burst of {fifo['burst_bulk_jobs']} jobs "
        f"beside the live tenant's {fifo['live_jobs']} at {_fmt(fifo['live_per_s'], 1)}/s",
        "",
        "Latency: Redis time from a job's entry to its result; in batch times, over "
        "batch size / the run's measured capacity. `fifo`: both tenants on one stream; "
        f"`tenants`: {t['tenants']}, each on its own stream. A lone batch: one batch on the "
        "idle worker, entry to last result.",
        "",
    ]
    rows = [
        [
            mode,
            _fmt(r["capacity_jobs_per_s"]),
            _fmt(r["batch_ms"]),
            _fmt(r["lone_batch_ms"], 0),
            f"{_fmt(r['live']['p50_ms'], 0)} ({_fmt(r['live_batches']['p50'])})",
            f"{_fmt(r['live']['p99_ms'], 0)} ({_fmt(r['live_batches']['p99'])})",
            f"{_fmt(r['live']['max_ms'], 0)} ({_fmt(r['live_batches']['max'])})",
            f"{r['bulk_answered_during_trickle']} ({_fmt(r['bulk_share_during_trickle'], 2)})",
        ]
        for mode, r in t["runs"].items()
    ]
    out.append(
        table(
            [
                "run",
                "capacity jobs/s",
                "batch time ms",
                "lone batch ms",
                "live p50 ms (batches)",
                "live p99 ms (batches)",
                "live max ms (batches)",
                "bulk answered meanwhile (of capacity)",
            ],
            rows,
            align="lr",
        )
    )
    fair = t["runs"]["tenants"]["settings"]
    out += [
        "",
        f"Live p50 {_fmt(t['live_p50_speedup'], 2)}x and p99 {_fmt(t['live_p99_speedup'], 2)}x "
        f"lower with tenants; a live job still waits for the {fair['in_flight_limit']} jobs "
        f"the worker holds ({fair['in_flight_limit'] // max(1, fair['batch_size'])} batches).",
    ]
    return out


def warm_start_lines(report: Mapping[str, Any]) -> list[str]:
    """The warm-start section (measure/bench/warm_start.py): a restarted worker's
    first jobs, cold and warm."""
    w = report.get("warm_start")
    if not w:
        return []
    out = [
        "",
        f"## Warm start: {w['model']}, a restarted worker's first {w['jobs']:,} jobs over "
        f"{w['images']:,} Zipf-popular images ({w['distinct_in_window']:,} distinct in the "
        "window)",
        "",
        "Hit rate: results answered from the decode cache (`cached`) over ok results; every "
        "repeat is the same bytes, so the cache serves it. `learn` left its hits on the hot "
        "list; `cold` started without warming, `warm` decoded the list first.",
        "",
    ]
    rows = []
    for mode, r in w["runs"].items():
        warm = r.get("warm_start") or {}
        rows.append(
            [
                mode,
                f"{r['hit_rate']:.1%}",
                _fmt(r["window_s"], 2),
                _fmt(r["jobs_per_s"]),
                f"{warm.get('warmed', 0)} of {warm.get('listed', 0)} in "
                f"{_fmt(warm.get('seconds'), 2)} s"
                if mode == "warm"
                else "",
            ]
        )
    out.append(
        table(["run", "hit rate", "window s", "jobs/s", "warmed before joining"], rows, align="lr")
    )
    out += [
        "",
        f"Warm over cold: hit rate {w['hit_rate_warm']:.1%} against {w['hit_rate_cold']:.1%}; "
        f"the window took {_fmt(w['window_speedup'], 2)}x less time.",
    ]
    return out


def accuracy_lines(report: Mapping[str, Any]) -> list[str]:
    """Both resize placements against torchvision's eval transforms."""
    a = report.get("accuracy")
    if not a:
        return []
    t = a["thresholds"]
    sizes = ", ".join(f"{c['width']}x{c['height']} ({c['what']})" for c in a["size_classes"])
    out = [
        "",
        "## Accuracy: the same pixels as torchvision's eval transforms",
        "",
        f"Reference: {a['reference']}. {a['images']} generated photos: {sizes}, each in EXIF "
        f"orientations {a['orientations'][0]}-{a['orientations'][-1]}. Model: {a['model']}. "
        "Pixel differences in levels of 255; per size class, the worst image's mean and max. "
        f"Thresholds: top-1 >= {t['top1_agreement_min']}, cosine >= {t['cosine_min']}; pixels "
        f"{t['pixel_mean_full_size']} / {t['pixel_max_full_size']} (mean / max) decoded at "
        f"full size, {t['pixel_mean_dct_scaled']} / {t['pixel_max_dct_scaled']} at a DCT "
        "scale.",
        "",
    ]
    rows = [
        [
            name,
            p["resized_on"],
            _fmt(p["top1_agreement"], 3),
            _fmt(p["cosine_min"], 5),
            _fmt(p["cosine_mean"], 5),
            _fmt(p["pixel_diff_mean"], 2),
            _fmt(p["pixel_diff_max"], 1),
            "yes" if p["met"] else "**no**",
        ]
        for name, p in a["placements"].items()
    ]
    out.append(
        table(
            [
                "placement",
                "resized on",
                "top-1 agreement",
                "cosine min",
                "cosine mean",
                "pixels mean",
                "pixels max",
                "met",
            ],
            rows,
            align="llrrrrrl",
        )
    )
    out += [""]
    out.append(
        table(
            ["size class", *(f"{name} mean / max" for name in a["placements"])],
            [
                [
                    f"{c['width']}x{c['height']}"
                    + (", DCT-scaled" if c["dct_scaled"] else "")
                    + (", reduced on the host" if c["reduced_on_host"] else ""),
                    *(
                        f"{_fmt(p['by_size_class'][i]['pixel_diff_mean'], 2)} / "
                        f"{_fmt(p['by_size_class'][i]['pixel_diff_max'], 1)}"
                        for p in a["placements"].values()
                    ),
                ]
                for i, c in enumerate(a["size_classes"])
            ],
            align="lr",
        )
    )
    out += ["", f"Device against host placement: at most {_fmt(a['placements_max_diff'], 2)}."]
    for name, p in a["placements"].items():
        out += [f"- {name}: {m}" for m in p["misses"]]
    return out


def _accuracy_problems(a: Any) -> list[str]:
    if not isinstance(a, Mapping):
        return ["accuracy must be an object"]
    placements = a.get("placements") or {}
    if set(placements) != {"host", "device"}:
        return ["accuracy.placements must be host and device"]
    problems = []
    if not isinstance(a.get("images"), int) or a["images"] < 1:
        problems.append("accuracy.images must be a positive integer")
    classes = a.get("size_classes") or []
    if not classes:
        problems.append("accuracy.size_classes missing")
    for name, p in placements.items():
        where = f"accuracy.placements.{name}"
        bounds = {
            "top1_agreement": (0.0, 1.0),
            "cosine_min": (-1.0, 1.0),
            "cosine_mean": (-1.0, 1.0),
            "pixel_diff_mean": (0.0, 255.0),
            "pixel_diff_max": (0.0, 255.0),
        }
        for key, (low, high) in bounds.items():
            value = p.get(key)
            if not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and low <= value <= high
            ):
                problems.append(f"{where}.{key} must be a number in [{low}, {high}]")
        if (
            isinstance(p.get("cosine_min"), int | float)
            and isinstance(p.get("cosine_mean"), int | float)
            and p["cosine_min"] > p["cosine_mean"]
        ):
            problems.append(f"{where}: cosine_min above cosine_mean")
        if len(p.get("by_size_class") or []) != len(classes):
            problems.append(f"{where}.by_size_class needs one entry per size class")
        if not isinstance(p.get("met"), bool) or p["met"] == bool(p.get("misses")):
            problems.append(f"{where}: met must say whether it has no misses")
    return problems


def _priority_problems(p: Any) -> list[str]:
    if p is None:
        return []
    if not isinstance(p, Mapping):
        return ["priority must be an object or null"]
    problems = []
    runs = p.get("runs") or {}
    if set(runs) != {"fifo", "priorities"}:
        problems.append("priority.runs must be fifo and priorities")
    for name, r in runs.items():
        if r.get("results") != r.get("jobs"):
            problems.append(f"priority.runs.{name}: {r.get('results')} results for {r.get('jobs')}")
        for key in ("p50_ms", "p99_ms"):
            if not _positive((r.get("high") or {}).get(key)):
                problems.append(f"priority.runs.{name}.high.{key} must be a positive number")
    return problems


def _tenants_problems(t: Any) -> list[str]:
    if t is None:
        return []
    if not isinstance(t, Mapping):
        return ["tenants must be an object or null"]
    problems = []
    runs = t.get("runs") or {}
    if list(runs) != ["fifo", "tenants"]:
        problems.append("tenants.runs must be fifo and tenants")
    for name, r in runs.items():
        where = f"tenants.runs.{name}"
        if r.get("results") != r.get("jobs"):
            problems.append(f"{where}: {r.get('results')} results for {r.get('jobs')}")
        live, in_batches = r.get("live") or {}, r.get("live_batches") or {}
        for key in ("p50", "p99", "max"):
            if not _positive(live.get(f"{key}_ms")):
                problems.append(f"{where}.live.{key}_ms must be a positive number")
            if not _positive(in_batches.get(key)):
                problems.append(f"{where}.live_batches.{key} must be a positive number")
        if all(_positive(live.get(k)) for k in ("p50_ms", "p99_ms", "max_ms")) and not (
            live["p50_ms"] <= live["p99_ms"] <= live["max_ms"]
        ):
            problems.append(f"{where}.live: percentiles out of order")
        for key in ("capacity_jobs_per_s", "batch_ms", "lone_batch_ms"):
            if not _positive(r.get(key)):
                problems.append(f"{where}.{key} must be a positive number")
        if live.get("jobs") != r.get("live_jobs"):
            problems.append(f"{where}: {live.get('jobs')} live results for {r.get('live_jobs')}")
        holds = (r.get("settings") or {}).get("in_flight_limit")
        burst = r.get("burst_bulk_jobs")
        if not isinstance(burst, int) or not isinstance(holds, int) or burst < 3 * holds:
            problems.append(f"{where}: the burst must be at least 3x the in-flight limit")
        during = r.get("bulk_answered_during_trickle")
        if not isinstance(during, int) or during < 0:
            problems.append(f"{where}.bulk_answered_during_trickle must be a count")
        # Every job's bytes are unique: a hit would mean the runs did not decode.
        if r.get("cache_hits") != 0:
            problems.append(f"{where}: {r.get('cache_hits')} cache hits on unique job bytes")
    return problems


def _warm_start_problems(w: Any) -> list[str]:
    if w is None:
        return []
    if not isinstance(w, Mapping):
        return ["warm_start must be an object or null"]
    problems = []
    runs = w.get("runs") or {}
    if list(runs) != ["learn", "cold", "warm"]:
        problems.append("warm_start.runs must be learn, cold and warm")
    for name, r in runs.items():
        if r.get("results_ok") != r.get("jobs"):
            problems.append(
                f"warm_start.runs.{name}: {r.get('results_ok')} ok results for {r.get('jobs')}"
            )
    return problems


def _overhead_problems(o: Any) -> list[str]:
    if o is None:
        return []
    if not isinstance(o, Mapping):
        return ["overhead must be an object or null"]
    problems = []
    if not _positive((o.get("queue_ceiling") or {}).get("jobs_per_s")):
        problems.append("overhead.queue_ceiling.jobs_per_s must be a positive number")
    runs = o.get("runs") or {}
    if set(runs) != {"cache_hits", "every_job_decoded"}:
        problems.append("overhead.runs must be cache_hits and every_job_decoded")
    for name, r in runs.items():
        for key in ("jobs_per_s", "loop_cpu_us_per_job", "worker_cpu_us_per_job"):
            if not _positive(r.get(key)):
                problems.append(f"overhead.runs.{name}.{key} must be a positive number")
        if r.get("results") != r.get("jobs") or r.get("results_ok") != r.get("jobs"):
            problems.append(f"overhead.runs.{name}: {r.get('results')} results for {r.get('jobs')}")
        problems += _gil_problems(f"overhead.runs.{name}", r.get("gil"))
    live = o.get("live_producer")
    if live is not None:
        if live.get("results") != live.get("jobs"):
            problems.append(
                f"overhead.live_producer: {live.get('results')} results for {live.get('jobs')}"
            )
        fill = live.get("batch_fill_with_backlog")
        if fill is not None and not (_positive(fill) and fill <= 1):
            problems.append("overhead.live_producer.batch_fill_with_backlog must be in (0, 1]")
    return problems


def _url_lines(report: Mapping[str, Any]) -> list[str]:
    """`url` jobs against the inline runs of the same workload (defaults; cache on)."""
    runs = report.get("url_runs") or []
    if not runs:
        return []
    inline = {
        (r["model"], r["image_set"], "url_repeats" if r.get("variant") else "url_unique"): r
        for r in report["runs"]
        if r["name"] in ("gpufeed", "gpufeed-cache-on-repeats")
    }
    rows = []
    for r in runs:
        base = inline.get((r["model"], r["image_set"], r.get("variant")))
        base_rate = base["images_per_s"] if base else None
        rows.append(
            [
                r["image_set"],
                r["model"],
                r["label"],
                _fmt(base_rate),
                _fmt(r["images_per_s"]),
                "" if not base_rate else f"{r['images_per_s'] / base_rate:.2f}",
                _fmt(r.get("fetch_ms")),
                f"{r.get('downloads', 0)} / {r.get('not_modified', 0)}",
                _fmt(r.get("cache_hit_ratio"), 2),
            ]
        )
    out = [
        "",
        "## Images by URL (`url` jobs from a loopback HTTP server)",
        "",
        "The same jobs with each image fetched by URL instead of carried in the job: unique "
        "images against the defaults run, repeated URLs against the cache-on run. Downloads / "
        "304: what the server sent whole, and the conditional requests it answered 'not "
        "modified' (a repeated URL: neither downloaded nor decoded again).",
        "",
    ]
    out.append(
        table(
            [
                "image set",
                "model",
                "run",
                "inline images/s",
                "by URL images/s",
                "URL / inline",
                "fetch ms (mean)",
                "downloads / 304",
                "cache hit ratio",
            ],
            rows,
            align="lllr",
        )
    )
    return out


def _cache_lines(report: Mapping[str, Any]) -> list[str]:
    runs = [r for r in report["runs"] if is_cache_run(r)]
    if not runs:
        return []
    out = [
        "",
        "## Decode cache, on repeated images (not comparable with the runs above)",
        "",
        "gpufeed (defaults otherwise) on jobs that cycle through the set's distinct images "
        "as they are, each repeated jobs / distinct times, with its decode cache on and off. "
        "Not comparable with the ideal, the naive worker or the runs above (all of them decode "
        "every image); cache worth = images/s with the cache on / off. Hit ratio: results the "
        "worker answered from the cache (their `cached` flag) / results.",
        "",
    ]
    rows = [
        [
            r["image_set"],
            r["model"],
            f"gpufeed, {r['label']}",
            r.get("distinct_images"),
            f"{r['jobs']} (x{_fmt(r.get('repeats'), 1)})",
            _fmt(r["images_per_s"]),
            _fmt(r["p50_ms"], 0),
            _cpu(r),
            _fmt(r.get("cache_hit_ratio"), 2),
            "" if r.get("cache_worth") is None else f"x{r['cache_worth']:.2f}",
        ]
        for r in runs
    ]
    out.append(
        table(
            [
                "image set",
                "model",
                "run",
                "distinct images",
                "jobs (repeats)",
                "images/s",
                "p50 ms",
                "CPU %",
                "cache hit ratio",
                "cache worth (on / off)",
            ],
            rows,
            align="lllr",
        )
    )
    return out


def _stage_rate_lines(report: Mapping[str, Any]) -> list[str]:
    rates = report["stage_rates"]
    threads = sorted({int(d["threads"]) for d in rates["decode"]})
    rows: dict[tuple[str, int, str], dict[int, float]] = {}
    for d in rates["decode"]:
        key = (d["image_set"], int(d["input_size"]), d["method"])
        rows.setdefault(key, {})[int(d["threads"])] = d["images_per_s"]
    out = ["", "## Stage rates, each stage alone (images/s)", ""]
    out.append(
        table(
            [
                "image set",
                "input",
                "decode method",
                *(f"{t} thread{'s' * (t > 1)}" for t in threads),
            ],
            [[k[0], k[1], k[2], *(_fmt(v.get(t)) for t in threads)] for k, v in rows.items()],
            align="lrlr",
        )
    )
    out += [""]
    out.append(
        table(
            ["model", "measured", "batch", "images/s", "ms per batch", "core-ms per image"],
            [
                [
                    m["model"],
                    "direct-feed ceiling"
                    + ("" if m["variant"] == "gpufeed" else f" ({m['variant']})")
                    if m["kind"] == "ceiling"
                    else "naive forward, batch 1",
                    m["batch"],
                    _fmt(m["images_per_s"]),
                    _fmt(m["ms_per_batch"], 2),
                    _fmt(m.get("core_ms_per_image")),
                ]
                for m in rates["model"]
            ],
            align="llr",
        )
    )
    methods = rates.get("decode_methods", {})
    if methods:
        out += [""] + [f"- `{name}`: {text}" for name, text in methods.items()]
    scaling = rates.get("decode_processes") or []
    if scaling:
        out += ["", "Decode processes (every image decoded into the shared ring, alone):", ""]
        out += [
            f"- {s['image_set']}, staging {s['staging_size']} px: "
            + ", ".join(
                f"{r['processes']} process{'es' * (r['processes'] > 1)} "
                f"{_fmt(r['images_per_s'])} images/s"
                for r in s["rates"]
            )
            + f" ({_fmt(s['scaling'], 2)}x)"
            for s in scaling
        ]
    queue = rates.get("queue") or []
    if queue:
        out += ["", "Queue ceiling (gpufeed's Redis work alone, the jobs of the set):", ""]
        out += [
            f"- {q['image_set']}, batch {q['batch']}: {_fmt(q['jobs_per_s'])} jobs/s "
            f"({q['jobs']} jobs of {q['payload_bytes']} bytes, "
            f"{_fmt(q['loop_cpu_us_per_job'])} µs of client CPU per job)"
            for q in queue
        ]
    return out


def _target_lines(report: Mapping[str, Any]) -> list[str]:
    targets = report.get("targets") or []
    if not targets:
        return []
    out = ["", "## Targets", ""]
    out.append(
        table(
            ["target", "image set", "model", "measured", "threshold", "met", "limiting stage"],
            [
                [
                    t["target"] + (" (issue)" if t["named_in_issue"] else ""),
                    t["image_set"],
                    t["model"],
                    _fmt(t["measured"], 2),
                    _fmt(t["threshold"], 2),
                    "yes" if t["met"] else "**no**",
                    t["limiting_stage"] or "",
                ]
                for t in targets
            ],
            align="lllrrll",
        )
    )
    missed = [t for t in targets if not t["met"] and t.get("detail")]
    if missed:
        out += [""]
        out += [f"- {t['target']}, {t['image_set']}, {t['model']}: {t['detail']}" for t in missed]
    return out


# --------------------------------------------------------------------------- figure
def write_figure(report: Mapping[str, Any], path: Path) -> None:
    """Throughput over time per run, and the per-image stage breakdown, per image set and
    model; plus latency against throughput when the profile measured the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(_groups(report))
    curves = report.get("curves") or []
    rows = len(groups) + (1 if curves else 0)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 3.6 * rows), squeeze=False)
    stages = ("decode", "preprocess", "compute")
    colours = {"decode": "#4c72b0", "preprocess": "#dd8452", "compute": "#55a868"}
    for row, (image_set, model) in enumerate(groups):
        runs = _runs_of(report, image_set, model)
        ax = axes[row][0]
        for r in runs:
            tl = r["timeline"]
            series = list(tl["images_per_s"])
            # Each bin's rate held over the bin, from t0 to the end of the last bin.
            xs = [i * tl["bin_s"] for i in range(len(series) + 1)]
            ax.step(
                xs,
                [*series, series[-1]],
                where="post",
                label=r["name"],
                lw=2.2 if r["name"] == "gpufeed" else 1.2,
            )
        ax.set_title(f"{image_set}, {model}: throughput over time")
        ax.set_xlabel("seconds since the first read")
        ax.set_ylabel("images/s")
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
        ax = axes[row][1]
        names = [r["name"] for r in runs]
        left = [0.0] * len(runs)
        for stage in stages:
            widths = [float((r.get("work_ms_per_image") or {}).get(stage) or 0.0) for r in runs]
            if any(widths):
                ax.barh(
                    names, widths, left=left, label=f"{stage} (stage timer)", color=colours[stage]
                )
                left = [a + w for a, w in zip(left, widths, strict=True)]
        wall = [1000.0 / r["images_per_s"] for r in runs]
        ax.scatter(
            wall, names, marker="|", s=300, color="black", label="wall ms per image", zorder=3
        )
        ax.set_title(f"{image_set}, {model}: ms per image by stage")
        ax.set_xlabel("ms per image (compute: per batch / images in it)")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
    if curves:
        ax = axes[rows - 1][0]
        for wait in sorted({c["max_wait_ms"] for c in curves}):
            pts = [c for c in curves if c["max_wait_ms"] == wait]
            ax.plot(
                [c["achieved_per_s"] for c in pts],
                [c["p50_ms"] for c in pts],
                marker="o",
                label=f"max wait {wait:g} ms, p50",
            )
            ax.plot(
                [c["achieved_per_s"] for c in pts],
                [c["p99_ms"] for c in pts],
                marker="x",
                ls="--",
                label=f"max wait {wait:g} ms, p99",
            )
        ax.set_title(f"latency against throughput ({curves[0]['model']}, {curves[0]['image_set']})")
        ax.set_xlabel("images/s")
        ax.set_ylabel("end-to-end latency, ms")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        axes[rows - 1][1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- files
# matplotlib is in the `bench` extra only: the worker's own install goes without it.
NO_PLOT = "matplotlib is not installed here, so no throughput.png was drawn"
PLOT_FIX = "pip install 'gpufeed[bench]'"


def write_all(report: dict[str, Any], out_dir: Path) -> None:
    """report.json, report.md and throughput.png (the figure only where matplotlib is
    installed, as `make setup` does; the report says so otherwise)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        report.setdefault("notes", []).append(f"{NO_PLOT} ({PLOT_FIX})")
        has_matplotlib = False
    else:
        has_matplotlib = True
    report["figure"] = "throughput.png" if has_matplotlib else None
    # allow_nan=False: a NaN or infinity is a bug, never a measurement.
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    (out_dir / "report.md").write_text(render_markdown(report))
    if has_matplotlib:
        write_figure(report, out_dir / "throughput.png")


# --------------------------------------------------------------------------- validation
def _cache_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    """The decode cache's part of a run: no hit outside the cache pair (every other run's
    job bytes are unique), hits with the cache on, none with it off."""
    ratio = run.get("cache_hit_ratio")
    if ratio is not None and not (
        isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0 <= ratio <= 1
    ):
        return [f"{where}: cache_hit_ratio must be between 0 and 1, got {ratio!r}"]
    variant = run.get("variant")
    if variant is None:
        if ratio:
            return [f"{where}: {ratio} cache hits on unique job bytes (the runs must decode)"]
        return []
    if variant not in CACHE_VARIANTS:
        return [f"{where}: unknown variant {variant!r}"]
    problems = []
    if run.get("workload") != "repeats" or not _positive(run.get("repeats")):
        problems.append(f"{where}: the cache pair must run on repeated images")
    if ratio is None:
        problems.append(f"{where}: cache_hit_ratio missing")
    elif variant == "cache_off_repeats" and ratio != 0:
        problems.append(f"{where}: {ratio} cache hits with the cache off")
    elif variant == "cache_on_repeats" and ratio <= 0:
        problems.append(f"{where}: no cache hit on repeated images with the cache on")
    if variant == "cache_on_repeats" and not _positive(run.get("cache_worth")):
        problems.append(f"{where}: cache_worth must be a positive number")
    return problems


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _all_numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _all_numbers(v, f"{path}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _all_numbers(v, f"{path}[{i}]")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield path, float(obj)


def load_latency_lines(report: Mapping[str, Any]) -> list[str]:
    """The latency-under-load section (measure/bench/load_latency.py), if it ran."""
    section = report.get("latency_under_load")
    if not section:
        return []
    loads = {
        "naive_80": f"80% of the naive worker's {_fmt(section['naive_capacity_per_s'])}/s",
        "gpufeed_80": f"80% of gpufeed's {_fmt(section['gpufeed_capacity_per_s'])}/s",
    }
    out = [
        "",
        f"## Latency under load ({section['model']}, {section['image_set']}, XADD to result)",
        "",
        table(
            ["worker", "offered load", "offered/s", "achieved/s", "p50 ms", "p99 ms"],
            [
                [
                    p["worker"],
                    loads.get(p["load"], p["load"]),
                    _fmt(p["offered_per_s"]),
                    _fmt(p["achieved_per_s"]),
                    _fmt(p["p50_ms"], 0),
                    _fmt(p["p99_ms"], 0),
                ]
                for p in section["points"]
            ],
            align="llrrrr",
        ),
        "",
        f"- gpufeed's p99 over the naive worker's at the naive worker's 80%: "
        f"{_fmt(section['p99_over_naive_at_naive_80'], 2)} (target <= 1.5)",
        f"- gpufeed's p99 at its own 80% against 2 B / C + max wait "
        f"({_fmt(section['p99_bound_at_gpufeed_80_ms'], 0)} ms at batch "
        f"{section['batch_size']}): "
        + ("within" if section["p99_at_gpufeed_80_within_bound"] else "over"),
    ]
    return out


def _load_latency_problems(section: Any) -> list[str]:
    if section is None:
        return []
    problems = []
    points = section.get("points") or []
    if len(points) != 3:
        problems.append(f"latency_under_load has {len(points)} points, want 3")
    for p in points:
        problems += _load_point_problems("latency_under_load point", p)
    return problems


def _load_point_problems(what: str, point: Mapping[str, Any]) -> list[str]:
    """A point of offered load (a curve's, latency under load's): positive rates and
    latencies, and every job answered."""
    problems = [
        f"{what} {point} has no positive {key}"
        for key in ("offered_per_s", "achieved_per_s", "p50_ms", "p99_ms")
        if not _positive(point.get(key))
    ]
    if point.get("results") != point.get("jobs"):
        problems.append(
            f"{what} {point}: {point.get('results')} results for {point.get('jobs')} jobs"
        )
    return problems


def _curves_problems(curves: Any) -> list[str]:
    return [p for c in curves or [] for p in _load_point_problems("curve point", c)]


# --------------------------------------------------------------------------- a run's checks
def _run_identity_problems(where: str, run: Mapping[str, Any], sets: set[str]) -> list[str]:
    problems = [
        f"{where}: {key} must be a non-empty string"
        for key in ("name", "image_set", "model", "kind")
        if not isinstance(run.get(key), str) or not run.get(key)
    ]
    if run.get("image_set") not in sets:
        problems.append(f"{where}: unknown image set {run.get('image_set')!r}")
    return problems


def _run_number_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    # The cache pair is outside the ideal: it has no ideal, efficiency or ratios.
    compared = () if is_cache_run(run) else ("ideal_images_per_s", "efficiency", "vs_ceiling")
    return [
        f"{where}: {key} must be a positive number, got {run.get(key)!r}"
        for key in (*RUN_NUMBERS, *compared)
        if not _positive(run.get(key))
    ]


def _run_count_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    """Every job answered, each result ok or an error."""
    problems = []
    jobs, results = run.get("jobs"), run.get("results")
    if not isinstance(jobs, int) or jobs < 1:
        problems.append(f"{where}: jobs must be a positive integer")
    elif results != jobs:
        problems.append(f"{where}: {results} results for {jobs} jobs")
    if run.get("results_ok", 0) + run.get("results_error", 0) != results:
        problems.append(f"{where}: results_ok + results_error != results")
    return problems


def _run_percentile_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    keys = ("p50_ms", "p95_ms", "p99_ms")
    if all(_positive(run.get(k)) for k in keys) and not (
        run["p50_ms"] <= run["p95_ms"] <= run["p99_ms"]
    ):
        return [f"{where}: percentiles out of order"]
    return []


def _run_timeline_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    timeline = run.get("timeline") or {}
    series, counts = timeline.get("images_per_s"), timeline.get("results")
    if not isinstance(series, list) or not series or not _positive(timeline.get("bin_s")):
        return [f"{where}: timeline missing"]
    if any(not isinstance(v, int | float) or v < 0 for v in series):
        return [f"{where}: timeline has negative values"]
    if not isinstance(counts, list) or sum(counts) != run.get("results"):
        return [f"{where}: the timeline's results do not add up to {run.get('results')}"]
    return []


def _run_vs_naive_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    if (
        run.get("kind") == "gpufeed"
        and not is_cache_run(run)
        and not _positive(run.get("vs_naive"))
    ):
        return [f"{where}: vs_naive must be a positive number"]
    return []


def _run_cpu_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    cpu = run.get("cpu_core_ms_per_image")
    if not isinstance(cpu, Mapping) or not _positive(cpu.get("total")):
        return [f"{where}: cpu_core_ms_per_image.total must be positive"]
    return []


def _run_gil_problems(where: str, run: Mapping[str, Any]) -> list[str]:
    return _gil_problems(where, run.get("gil")) if run.get("kind") == "gpufeed" else []


# Each run's checks after its identity, in the order their problems are listed.
RUN_CHECKS: dict[str, Callable[[str, Mapping[str, Any]], list[str]]] = {
    "numbers": _run_number_problems,
    "cache": _cache_problems,
    "counts": _run_count_problems,
    "percentiles": _run_percentile_problems,
    "timeline": _run_timeline_problems,
    "vs_naive": _run_vs_naive_problems,
    "cpu": _run_cpu_problems,
    "gil": _run_gil_problems,
}


# --------------------------------------------------------------------------- the report's checks
TOP_LEVEL = ("schema_version", "profile", "host", "image_sets", "runs", "summary", "stage_rates",
             "targets")  # fmt: skip


def _version_problems(report: Mapping[str, Any]) -> list[str]:
    if report["schema_version"] != SCHEMA_VERSION:
        return [f"schema_version {report['schema_version']} != {SCHEMA_VERSION}"]
    return []


def _finite_problems(report: Mapping[str, Any]) -> list[str]:
    return [
        f"{path} is not finite ({v})" for path, v in _all_numbers(report) if not math.isfinite(v)
    ]


def _host_problems(report: Mapping[str, Any]) -> list[str]:
    """The head block, by the definition the doctor and the GPU check share."""
    return report_head.problems(report["host"], report_head.BENCH)


def _runs_problems(report: Mapping[str, Any]) -> list[str]:
    runs = report["runs"]
    if not isinstance(runs, list) or not runs:
        return ["runs must be a non-empty list"]
    sets = {s["name"] for s in report["image_sets"]}
    problems = []
    for i, run in enumerate(runs):
        where = f"runs[{i}] ({run.get('name')}, {run.get('model')}, {run.get('image_set')})"
        problems += _run_identity_problems(where, run, sets)
        for check in RUN_CHECKS.values():
            problems += check(where, run)
    return problems


def _summary_problems(report: Mapping[str, Any]) -> list[str]:
    summary, sets = report["summary"], {s["name"] for s in report["image_sets"]}
    if not isinstance(summary, Mapping) or set(summary) != sets:
        return [f"summary must have one entry per image set {sorted(sets)}"]
    problems = []
    for name, entry in summary.items():
        for key in SUMMARY_NUMBERS:
            if not _positive(entry.get(key)):
                problems.append(f"summary[{name}].{key} must be a positive number")
        for model, m in (entry.get("by_model") or {}).items():
            if "cache_worth" in m and not _positive(m["cache_worth"]):
                problems.append(f"summary[{name}].by_model[{model}].cache_worth not positive")
    return problems


def _stage_rate_problems(report: Mapping[str, Any]) -> list[str]:
    decode = report["stage_rates"].get("decode") or []
    model = report["stage_rates"].get("model") or []
    problems = [] if decode and model else ["stage_rates needs decode and model entries"]
    problems += [
        f"stage rate {d} is not a positive number"
        for d in [*decode, *model]
        if not _positive(d.get("images_per_s"))
    ]
    return problems


def _section(
    key: str, check: Callable[[Any], list[str]]
) -> Callable[[Mapping[str, Any]], list[str]]:
    """A section's check, given the section (None where the report has none)."""
    return lambda report: check(report.get(key))


# The report's checks once every top-level field is there, in the order their problems are
# listed: each a name (a field or section of docs/bench-schema.md) and what checks it.
REPORT_CHECKS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "schema_version": _version_problems,
    "numbers": _finite_problems,
    "host": _host_problems,
    "runs": _runs_problems,
    "summary": _summary_problems,
    "stage_rates": _stage_rate_problems,
    "overhead": _section("overhead", _overhead_problems),
    "batch": _section("batch", batch_problems),
    "priority": _section("priority", _priority_problems),
    "tenants": _section("tenants", _tenants_problems),
    "warm_start": _section("warm_start", _warm_start_problems),
    "accuracy": _section("accuracy", _accuracy_problems),
    "latency_under_load": _section("latency_under_load", _load_latency_problems),
    "curves": _section("curves", _curves_problems),
}


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """Everything wrong with `report` against docs/bench-schema.md (empty: nothing)."""
    missing = [f"missing top-level field {key!r}" for key in TOP_LEVEL if key not in report]
    if missing:
        return missing
    return [problem for check in REPORT_CHECKS.values() for problem in check(report)]
