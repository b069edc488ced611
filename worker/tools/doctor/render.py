"""render(): the report for people, sections (a)-(e) as rich grids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from worker.model.sizes import batch_shapes_line


def _num(value: Any, fmt: str = ",.1f", unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{fmt}}{unit}"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _heading(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold underline"))


def render(report: Mapping[str, Any], console: Console) -> None:
    """The report for people: sections (a)-(e), each saying what it could not measure."""
    env, cfg = report["environment"], report["config"]
    console.print(
        Text(
            f"gpufeed doctor: {cfg['model']} ({cfg['weights']}) on {cfg['device']}, "
            f"batch {cfg['batch_size']}, {cfg['dtype']}, compile {cfg['compile_mode']}"
            + (" (CUDA graphs)" if cfg["cudagraphs"] else ""),
            style="bold",
        )
    )
    console.print(
        f"host {env['host']}: {env['cpu_count']} CPU cores, torch {env['torch']}, "
        + (f"CUDA device {env['device_name']}" if env["cuda_available"] else "no CUDA device")
        + f"; input {cfg['input_size']} px (staging {cfg['staging_size']}), "
        f"decode {cfg['decode']}"
    )
    console.print(f"feed plan: {cfg['feed_plan']}")
    console.print("batch shapes: " + batch_shapes_line(cfg["batch_sizes"]))
    mib = 1024 * 1024
    console.print(
        f"resize on the {cfg['resize']} ({cfg['resize_why']}); rows {cfg['row_side']} px, "
        f"input ring {cfg['ring_pinned_bytes'] / mib:.0f} MiB, "
        f"{cfg['h2d_bytes_per_batch'] / mib:.1f} MiB host-to-device per batch "
        f"({cfg['staged_bytes_per_image']:,} bytes per image)"
    )
    for note in cfg["notes"]:
        console.print(f"[yellow]note:[/] {note}")

    ceiling = report["ceiling"]
    _heading(console, "(a) direct-feed ceiling: a random batch already on the device")
    grid = _grid()
    for variant in ("eager", "compiled"):
        run = ceiling[variant]
        if run is None:
            continue
        extra = f", compiled in {run['compile_s']:.1f} s" if run.get("compile_s") else ""
        serving = "  <- serving" if ceiling["serving"] == variant else ""
        grid.add_row(
            variant,
            f"{run['images_per_s']:,.1f} images/s  ({run['ms_per_batch']:,.2f} ms per batch "
            f"of {run['batch']}, {run['iters']} batches, mode {run['mode']}{extra}){serving}",
        )
    _not_measured(grid, ceiling["not_measured"])
    console.print(grid)

    prof = report["profile"]
    unit = prof["unit"]
    what = "CUDA kernels" if unit == "kernels" else "CPU ops (outermost aten operators)"
    _heading(console, f"(b) profile of one forward ({prof['step']} step): {what}")
    grid = _grid()
    stats = prof["stats"]
    if stats is not None:
        grid.add_row(f"{unit} per forward", f"{stats['count']}")
        grid.add_row(
            f"{unit} time / wall",
            f"{stats['busy_us'] / 1000:,.2f} ms / {stats['wall_us'] / 1000:,.2f} ms"
            f" = {_num(stats['busy_ratio'], '.0%')}",
        )
        gaps = stats["gaps"]
        grid.add_row(
            f"gaps between {unit}",
            f"mean {_num(gaps['mean_us'])} µs, p50 {_num(gaps['p50_us'])} µs, "
            f"max {_num(gaps['max_us'])} µs, total {gaps['total_us'] / 1000:,.2f} ms "
            f"({gaps['count']} gaps)",
        )
        grid.add_row(
            f"{unit} under {stats['tiny_threshold_us']:.0f} µs",
            f"{_num(stats['tiny_share'], '.0%')} (median {_num(stats['median_us'])} µs)",
        )
        if prof["top"]:
            grid.add_row(
                "most time",
                ", ".join(
                    f"{t['name']} x{t['count']} {t['total_us'] / 1000:,.2f} ms"
                    for t in prof["top"][:4]
                ),
            )
    _not_measured(grid, prof["not_measured"])
    console.print(grid)

    syncs = report["host_syncs"]
    _heading(console, "(c) host syncs on the launch path (CUDA sync-debug mode)")
    grid = _grid()
    if syncs["measured"]:
        grid.add_row(
            "launch path", f"{syncs['count']} sync(s) in {syncs['launches']} launches (0 expected)"
        )
        for where in syncs["where"][:5]:
            grid.add_row("  at", where)
        if syncs["pipeline_count"] is not None:
            grid.add_row("end-to-end run", f"{syncs['pipeline_count']} sync(s)")
    _not_measured(grid, syncs["not_measured"])
    console.print(grid)

    e2e = report["end_to_end"]
    _heading(
        console,
        f"(d) end to end: {e2e['jobs']} JPEGs {e2e['image_size']} "
        + {"url": "by URL from a loopback HTTP server ", "path": "as files by path "}.get(
            e2e["source"], ""
        )
        + f"through Redis ({e2e['redis'] or 'none'}) and a real worker",
    )
    grid = _grid()
    if e2e["measured"]:
        grid.add_row(
            "throughput",
            f"{_num(e2e['images_per_s'])} images/s after the first batch (ok "
            f"{e2e['results_ok']}, error {e2e['results_error']}; first result at "
            f"{_num(e2e['first_result_s'], '.2f')} s, last at {_num(e2e['elapsed_s'], '.2f')} s)",
        )
        grid.add_row(
            "latency",
            f"p50 {_num(e2e['latency_p50_ms'], ',.0f')} ms, p99 "
            f"{_num(e2e['latency_p99_ms'], ',.0f')} ms from XADD to result (all jobs at once)",
        )
        if e2e["decode_delay_ms"]:
            grid.add_row("test hook", f"+{e2e['decode_delay_ms']:.0f} ms in every decode")
        stage_ms = e2e["stage_ms"] or {}
        grid.add_row(
            "stages (mean ms)",
            ", ".join(f"{s} {_num(v, ',.1f')}" for s, v in stage_ms.items() if v is not None),
        )
        grid.add_row("model per batch", f"{_num(e2e['gpu_ms_per_batch'], ',.1f')} ms")
        grid.add_row("batch fill", _num(e2e["batch_fill"], ".0%"))
        if e2e["source"] == "url":
            grid.add_row(
                "fetch capacity",
                f"{_num(e2e['fetch_capacity_images_per_s'])} images/s = "
                f"{report['config']['fetch_concurrency']} concurrent fetches / "
                f"{_num(stage_ms.get('fetch'), ',.1f')} ms",
            )
        decode_ms = stage_ms.get("decode")
        grid.add_row(
            "decode capacity",
            f"{_num(e2e['decode_capacity_images_per_s'])} images/s = "
            f"{e2e['decode_threads']} "
            f"{'processes' if report['config'].get('decode_processes') else 'threads'} / "
            f"{_num(decode_ms, ',.1f')} ms",
        )
        grid.add_row(
            "model capacity",
            f"{_num(e2e['model_capacity_images_per_s'])} images/s (ceiling), "
            f"{_num(e2e['model_in_pipeline_images_per_s'])} images/s inside the pipeline",
        )
        grid.add_row(
            "queue capacity",
            f"{_num(e2e['queue_capacity_jobs_per_s'])} jobs/s (Redis work alone, "
            f"{_num(e2e['queue_client_cpu_us_per_job'])} µs client CPU per job); the event "
            f"loop spent {_num(e2e['loop_cpu_us_per_job'])} µs of CPU per job in the run",
        )
        if e2e.get("redis_cpu_us_per_job") is not None:
            thread = "main thread" if e2e["redis_cpu_main_thread"] else "process"
            grid.add_row(
                "Redis",
                f"{_num(e2e['redis_cpu_us_per_job'], ',.1f')} µs of redis-server's {thread} "
                f"per job (its XADD, the reads, results and acks): one Redis serves at most "
                f"{_num(e2e['redis_jobs_per_s_max'], ',.0f')} such jobs/s",
            )
        gil = e2e.get("gil")
        if gil is not None:
            held = gil["gil_us_per_job"]
            grid.add_row(
                "GIL per job",
                ", ".join(f"{k.replace('_', ' ')} {_num(v, ',.1f')} µs" for k, v in held.items())
                + f" (decode threads also {_num(gil['decode_released_us_per_job'], ',.1f')} µs "
                f"without it); CPU {_num(gil['process_cpu_us_per_job'], ',.1f')} µs",
            )
            for p in gil["projections"]:
                grid.add_row(
                    f"{p['cores']} cores",
                    f"at most {_num(p['jobs_per_s'])} jobs/s, bound by the {p['binds']} "
                    f"(GIL {_num(p['gil_bound_jobs_per_s'])}, cores "
                    f"{_num(p['cores_bound_jobs_per_s'])})",
                )
        grid.add_row(
            "GPU",
            f"util {_num(e2e['gpu_util_pct'], '.0f', '%')}, "
            f"memory {_num(e2e['mem_bw_util_pct'], '.0f', '%')}",
        )
        grid.add_row(
            "CPU",
            f"process {_num(e2e['process_cpu_pct'], '.0f', '%')} (100% = one core), "
            f"host {_num(e2e['system_cpu_pct'], '.0f', '%')} (of all cores)",
        )
    _not_measured(grid, e2e["not_measured"])
    console.print(grid)

    hot = report["hot_list"]
    _heading(console, f"warm start: the fleet's hot list ({hot['key']})")
    grid = _grid()
    if hot["off"]:
        grid.add_row("off", hot["off"])
    elif hot["images"] is not None:
        grid.add_row(
            "images",
            f"{hot['images']:,} of at most {hot['size']:,}; a starting worker decodes them "
            + (
                f"into its cache for up to {hot['warm_start_s']:g} s before it joins the group"
                if hot["warm_start_s"] > 0
                else "into its cache only with a warm start: take warm_start_s=0 out of "
                "GPUFEED_TUNING"
            ),
        )
        for entry in hot["top"]:
            grid.add_row(
                f"{entry['score']:,.1f} hits",
                Text(f"{entry['kind']} {entry['ref']} (answered on {entry['reply_to']})"),
            )
    _not_measured(grid, hot["not_measured"])
    console.print(grid)

    v = report["verdict"]
    _heading(console, f"(e) verdict: {v['name'].upper()}")
    grid = _grid()
    _finding(grid, "", v)
    for other in v["also"]:
        grid.add_row("", "")
        _finding(grid, "hint" if other["hint"] else "also", other)
    console.print(grid)
    console.print(Text(f"\ndoctor ran {report['elapsed_s']:.1f} s", style="dim"))


def _finding(grid: Table, kind: str, finding: Mapping[str, Any]) -> None:
    """Headline, evidence and knob; wrapped lines stay in their column."""
    title = f"{kind}: {finding['name']}" if kind else "why"
    grid.add_row(title, finding["headline"])
    for line in finding["evidence"]:
        grid.add_row("", f"- {line}")
    grid.add_row("knob", finding["knob"])


def _not_measured(grid: Table, lines: list[str]) -> None:
    for line in lines:
        grid.add_row("not measured", Text(line, style="yellow"))
