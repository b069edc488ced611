"""`python -m measure`: the measurements that start a gpufeed worker of their own and report
on it: the benchmark (`bench`, `make bench`) and the GPU check's judge (`gpu-check --judge`;
the check itself runs on a GPU host through `make gpu-check`).

They live outside the `worker` package: the worker serves without them, and they read the
worker only through what it offers every caller (its settings, its public objects and the
shared measurement harness in worker/tools/harness/). The operator's own diagnostics,
`python -m worker doctor` and `python -m worker top`, stay commands of the worker.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from worker.cli import CONTEXT_SETTINGS, config_options, exits, load_config


@click.group(context_settings=CONTEXT_SETTINGS)
def cli() -> None:
    """gpufeed's measurements: the benchmark and the GPU check's judge. Each takes the
    worker's settings as flags (`python -m worker --help` lists them)."""


@cli.command()
@config_options
@click.option(
    "--profile",
    "profile_name",
    type=click.Choice(["tiny", "quick", "full"]),
    envvar="BENCH_PROFILE",
    default=None,
    help="[env BENCH_PROFILE] tiny (seconds), quick (minutes; default on CPU hosts) or full "
    "(default on CUDA hosts).",
)
@click.option(
    "--models",
    default=None,
    help="Comma-separated torchvision models or model directories to run instead of the "
    "profile's (--model: one).",
)
@click.option(
    "--out",
    "out_dir",
    default="bench/out",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where report.json, report.md, throughput.png and the image cache go.",
)
@click.option(
    "--figures-page",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write this docs page (docs/figures.md) from the report, keep the report and "
    "figure beside it (docs/figures/), and rewrite the figures blocks of README.md and docs/.",
)
def bench(
    profile_name: str | None,
    models: str | None,
    out_dir: Path,
    figures_page: Path | None,
    **options: Any,
) -> None:
    """Benchmark: direct-feed ceiling, the naive worker, gpufeed and its ablations.

    Runs on a private redis-server (or the one --redis-url names) with random weights unless
    --weights is given; writes report.json, report.md and throughput.png, and prints the
    markdown report. Exit 1 if a run did not answer every job.
    """
    from dataclasses import replace

    from measure.bench.profiles import make_profile
    from measure.bench.report import NO_PLOT, PLOT_FIX, render_markdown, validate_report
    from measure.bench.suite import run_bench
    from worker.base.device import resolve_device
    from worker.base.logs import configure_logging

    with exits():
        base = load_config(options)
        explicit = {k: v for k, v in options.items() if v is not None}
        device = resolve_device(str(explicit.get("device") or base.device))
    configure_logging(base.log_format, str(explicit.get("log_level") or "warning"))
    cuda = device.type == "cuda"
    profile = make_profile(profile_name or ("full" if cuda else "quick"), cuda=cuda)
    chosen = [m.strip() for m in models.split(",") if m.strip()] if models else []
    if not chosen and explicit.get("model"):
        chosen = [str(explicit["model"])]
    if chosen:
        profile = profile.with_models(tuple(replace(profile.models[0], model=m) for m in chosen))
    explicit.pop("model", None)
    report = run_bench(
        profile,
        out_dir=out_dir,
        base=base,
        explicit=explicit,
        external_redis=explicit.get("redis_url"),
    )
    click.echo(render_markdown(report))
    if report.get("figure"):
        click.echo(f"wrote {out_dir}/report.json, report.md and throughput.png", err=True)
    else:
        click.echo(f"wrote {out_dir}/report.json and report.md; {NO_PLOT}: {PLOT_FIX}", err=True)
    problems = validate_report(report)
    if problems:
        for problem in problems:
            click.echo(f"gpufeed bench: {problem}", err=True)
        if figures_page is not None:
            click.echo(f"gpufeed bench: {figures_page} left as it was", err=True)
        sys.exit(1)
    if figures_page is not None:
        from measure.bench.figures_page import publish

        for path in publish(out_dir, figures_page):
            click.echo(f"wrote {path}", err=True)


@cli.command("gpu-check")
@click.option(
    "--judge",
    "report_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A report.json from `make gpu-check` (any host) to judge by the current rules.",
)
def gpu_check(report_path: Path) -> None:
    """Judge a saved GPU-check report by the current rules: each rule, the measured value,
    its target and pass/fail. Exit 0 only when every rule passes (1 otherwise, 2 for a file
    that is not a report). The check itself runs on a GPU host: `make gpu-check`."""
    from measure.gpu_check.report import judge_file

    sys.exit(judge_file(report_path))


def main() -> None:
    cli()
