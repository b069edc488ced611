"""`python -m worker`: run the worker (default), or one of its tools.

Every setting is a flag (`--batch-size` for GPUFEED_BATCH_SIZE, ...), built from the one table
of settings (worker/config/table.py) with its meaning, as docs/reference/configuration.md
shows it; flags win over environment variables.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import click

from worker.base.errors import GpufeedError
from worker.config import table
from worker.config.settings import WorkerConfig
from worker.lifecycle.event_loop import run_async
from worker.quick_exit import exit_now

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"gpufeed: {message}", err=True)
    sys.exit(code)


def exit_for(exc: BaseException) -> tuple[int, str] | None:
    """The exit code and line `exc` ends a command with (worker/base/errors.py); None for an
    error that does not end one that way."""
    if isinstance(exc, GpufeedError) and exc.exit_code is not None:
        return exc.exit_code, exc.operator_line()
    return None


@contextlib.contextmanager
def exits(prefix: str = "") -> Iterator[None]:
    """Ends the command on an error that carries an exit code, with its line; any other
    error goes on up."""
    try:
        yield
    except Exception as exc:
        found = exit_for(exc)
        if found is None:
            raise
        code, line = found
        fail(prefix + line, code)


def config_options(func: F) -> F:
    """Decorate a click command with one option per setting (tuning constants have none)."""
    for entry in reversed(table.PUBLIC):
        flag = "--" + entry.name.replace("_", "-")
        default = table.plain(entry.shown_default())
        help_text = f"{table.plain(entry.help)} [env {entry.env}; default {default}]"
        if entry.type_name == "bool":
            opt = click.option(f"{flag}/--no-{flag[2:]}", entry.name, default=None, help=help_text)
        else:
            click_type: Any = {"int": int, "float": float}.get(entry.type_name, str)
            opt = click.option(flag, entry.name, type=click_type, default=None, help=help_text)
        func = opt(func)
    return func


def load_config(options: dict[str, Any]) -> WorkerConfig:
    overrides = {k: v for k, v in options.items() if k in WorkerConfig.__dataclass_fields__}
    if overrides.get("path_root") is not None:
        overrides["path_root"] = Path(overrides["path_root"])
    return WorkerConfig.load(overrides=overrides)


CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


class DefaultGroup(click.Group):
    """`python -m worker [flags]` means `python -m worker run [flags]`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # `python -m worker` runs the worker, so its --help shows what `run` takes: every
        # setting with its meaning, then the tools.
        run_command = self.commands["run"]
        run_ctx = click.Context(run_command, info_name="run", parent=ctx)
        records = [
            record
            for param in run_command.get_params(run_ctx)
            if "--help" not in param.opts and (record := param.get_help_record(run_ctx)) is not None
        ]
        with formatter.section("Worker settings (flags win over the environment)"):
            formatter.write_dl(records)
        # Accepted in the worker's environment though no setting of its own: listed so that
        # an example using one can be looked up here too.
        others = {**table.TOOL_VARIABLES, table.TUNING_VARIABLE: table.TUNING_HELP}
        with formatter.section("Other variables"):
            formatter.write_dl([(name, table.plain(text)) for name, text in others.items()])
        super().format_options(ctx, formatter)


@click.group(
    cls=DefaultGroup,
    context_settings=CONTEXT_SETTINGS,
)
def cli() -> None:
    """gpufeed worker: image jobs from Redis Streams through a GPU, results back.

    `python -m worker [SETTINGS]` runs the worker (the same as `python -m worker run`)
    until SIGTERM or SIGINT. The tools below take the same settings.
    """


@cli.command()
@config_options
@click.option(
    "--wait/--no-wait",
    "wait_for_redis",
    default=True,
    help="Retry until Redis answers (default), or exit at once with --no-wait.",
)
def run(wait_for_redis: bool, **options: Any) -> None:
    """Run the worker until SIGTERM or SIGINT (a second one skips the drain); with
    GPUFEED_PROCESSES > 1, a supervisor of that many worker processes."""
    from worker.base.logs import configure_logging

    with exits():
        config = load_config(options)
    configure_logging(config.log_format, config.log_level)
    # Everything that needs neither torch nor the model is checked before torch is imported
    # (seconds): the settings above (model name, model directory manifest), now Redis.
    from worker.delivery.redis_check import preflight

    with exits():
        run_async(preflight(config, wait=wait_for_redis))
    if config.processes > 1:
        # The supervisor never imports torch: its children are fresh interpreters.
        from worker.lifecycle.supervisor import run_supervisor

        sys.exit(run_supervisor(config, wait_for_redis=wait_for_redis))

    # Until the worker's own handlers take over (its event loop, once torch is imported and
    # the service built: seconds, more on a busy host), SIGTERM would kill the process with
    # -15. Nothing has been read from the stream yet, so stopping is simply exiting.
    signal.signal(signal.SIGTERM, _exit_before_serving)

    from worker.lifecycle.service import Worker

    worker = Worker(config)
    with exits():
        run_async(worker.serve(wait_for_redis=wait_for_redis))


def _exit_before_serving(signum: int, frame: FrameType | None) -> None:
    import structlog

    structlog.get_logger("gpufeed.worker").info(
        "stopped_while_starting", signal=signal.Signals(signum).name
    )
    exit_now()


@cli.command()
@click.option("--count", default=48, show_default=True, help="Sample images to submit.")
def demo(count: int) -> None:
    """Local Redis, a worker, sample jobs: prints each result and a throughput line."""
    from worker.tools.demo import run_demo

    sys.exit(run_demo(count))


def _image_size(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    width, sep, height = value.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise click.BadParameter(f"expected WIDTHxHEIGHT, e.g. 640x480 (got {value!r})")
    return int(width), int(height)


@cli.command()
@config_options
@click.option("--json", "json_out", is_flag=True, help="One JSON object (docs/doctor-schema.md).")
@click.option(
    "--jobs", type=int, default=None, help="Synthetic JPEGs in the run [default: 200; CUDA 3000]."
)
@click.option(
    "--image-size",
    default="640x480",
    show_default=True,
    callback=_image_size,
    help="WIDTHxHEIGHT of the synthetic JPEGs.",
)
@click.option(
    "--compile-ceiling",
    is_flag=True,
    help="On CPU, also compile the step to measure the compiled ceiling (tens of seconds).",
)
@click.option(
    "--ceiling-seconds", default=3.0, show_default=True, help="Timed run per ceiling variant."
)
@click.option(
    "--sync-launches", default=20, show_default=True, help="Launches checked for host syncs."
)
@click.option(
    "--timeout", "timeout_s", default=300.0, show_default=True, help="Limit of the run, s."
)
@click.option(
    "--urls",
    is_flag=True,
    help="Send url jobs: the synthetic JPEGs served by a loopback HTTP server (fetch stage).",
)
@click.option(
    "--paths",
    is_flag=True,
    help="Send path jobs: the synthetic JPEGs written to a folder of the run's, which the "
    "worker reads as its GPUFEED_PATH_ROOT (the image bytes never pass through Redis).",
)
@click.option(
    "--decode-delay-ms",
    default=0.0,
    hidden=True,
    help="For testing the verdict: sleep this long in every decode.",
)
def doctor(
    *,
    json_out: bool,
    jobs: int | None,
    image_size: tuple[int, int],
    compile_ceiling: bool,
    ceiling_seconds: float,
    sync_launches: int,
    timeout_s: float,
    decode_delay_ms: float,
    urls: bool,
    paths: bool,
    **options: Any,
) -> None:
    """Why is the device not busier? Ceiling, profile, host syncs, a run, and a verdict."""
    if urls and paths:
        raise click.UsageError("--urls and --paths each choose where the jobs' images are: one")
    from worker.base.logs import configure_logging
    from worker.tools.doctor import DoctorOptions, print_json, render, report_console, run_doctor

    with exits():
        config = load_config(options)
    # The report is the output: the worker's own log says only what goes wrong.
    level = "warning" if config.log_level == "info" else config.log_level
    configure_logging(config.log_format, level)
    settings = DoctorOptions(
        jobs=0 if jobs is None else max(1, jobs),
        image_size=image_size,
        compile_ceiling=compile_ceiling,
        ceiling_seconds=ceiling_seconds,
        sync_launches=max(1, sync_launches),
        timeout_s=timeout_s,
        decode_delay_s=max(0.0, decode_delay_ms) / 1000,
        urls=urls,
        paths=paths,
    )
    with exits():
        report = run_async(run_doctor(config, settings))
    if json_out:
        print_json(report)
    else:
        render(report, report_console())


class LegendCommand(click.Command):
    """`top --help` ends with the dashboard's legend: what each column says."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from worker.tools.top.screen import legend_lines

        formatter.write_paragraph()
        formatter.write_text("Columns (l toggles this legend in the dashboard):")
        for line in legend_lines():
            formatter.write(f"  {line}\n")


@cli.command(cls=LegendCommand)
@config_options
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
def top(interval: float, once: bool, **options: Any) -> None:
    """Live dashboard of the workers of a group: rates, latency, stages, GPU, backlog.
    Keys: l shows or hides the legend, q quits. Narrow terminals get short headers, then
    lose columns in a fixed order (in flight, ok, device, p50, fill, CPU, write, queue,
    fetch, errors, redis_wait), named under the table."""
    from worker.tools.top.screen import run_top

    with exits():
        config = load_config(options)
    sys.exit(run_top(config, interval_s=max(0.2, interval), once=once))


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, hidden=True
)
def bench() -> None:
    """Moved: `python -m measure bench` (`make bench`)."""
    fail("the benchmark is `python -m measure bench` (or `make bench`) now", 2)


@cli.group()
def model() -> None:
    """Models: the torchvision names GPUFEED_MODEL takes, and checking a model directory
    before serving it."""


@model.command("list")
def model_list() -> None:
    """Every torchvision classification model GPUFEED_MODEL takes by name, one a line.
    (GPUFEED_MODEL also takes a model directory, written as a path, and `null`.)"""
    from worker.model.names import registered_models

    names = registered_models()
    if not names:
        from worker.model.loader import classification_models

        names = frozenset(classification_models())
    click.echo("\n".join(sorted(names)))


@model.command("check")
@config_options
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "json_out", is_flag=True, help="One JSON object instead of the lines.")
@click.option("--seconds", default=2.0, show_default=True, help="Timed run of the step (images/s).")
def model_check(directory: Path, json_out: bool, seconds: float, **options: Any) -> None:
    """Load DIRECTORY (gpufeed.toml beside the model), build and compile its step, run it on
    generated images: kind, shapes, dtype, compile report, images/s. Exit 2 with a one-line
    reason for a broken directory, 4 when the compiled step is refused."""
    import json

    from worker.base.logs import configure_logging
    from worker.model.check import check_model, render
    from worker.model.manifest import looks_like_model_dir
    from worker.model.names import is_null_model

    # The path as typed, made unmistakably a path for GPUFEED_MODEL ("tagger" -> "./tagger");
    # `null` is the null model.
    typed = str(directory)
    named = looks_like_model_dir(typed) or is_null_model(typed)
    options["model"] = typed if named else f"./{typed}"
    with exits("model check: "):
        config = load_config(options)
        level = "warning" if config.log_level == "info" else config.log_level
        configure_logging(config.log_format, level)
        report = check_model(config, seconds=max(0.1, seconds))
    click.echo(json.dumps(report) if json_out else render(report))


@cli.command(
    "gpu-check",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    hidden=True,
)
def gpu_check() -> None:
    """Moved: `python -m measure gpu-check --judge REPORT`."""
    fail("judging a GPU-check report is `python -m measure gpu-check --judge REPORT` now", 2)


def _share_context_settings(group: click.Group) -> None:
    # Click keeps a command's help option from the first time it is asked for: a command
    # invoked on its own (by a test or a tool) would keep `--help` alone from then on, and
    # `-h` and the width would differ with what ran first.
    for command in group.commands.values():
        command.context_settings = {**CONTEXT_SETTINGS, **command.context_settings}
        if isinstance(command, click.Group):
            _share_context_settings(command)


_share_context_settings(cli)


def main() -> None:
    cli(prog_name="python -m worker")


if __name__ == "__main__":
    main()
