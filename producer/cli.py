"""`gpufeed` / `python -m producer`: submit images, wait for results, inspect the queue.

Exit codes: 0 all good; 1 a job failed or its result did not arrive in time; 2 usage error
(bad option, no files); 3 Redis unreachable (or refused the credentials).
Machine-readable output (`--json`) goes to stdout; progress bars and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import click
import redis
from rich import box
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from producer import tenants, wire
from producer.admission import AdmissionRefused
from producer.client import Producer
from producer.core import DEFAULT_REDIS_URL
from producer.dead_letters import DeadLetter, DeadLetterNotFound, iso_utc
from producer.jobs import IMAGE_EXTENSIONS, Job, file_job_ids, read_url_list, url_job_ids
from producer.priorities import UnknownPriority, level_stream, pick_level
from producer.reach import UNREACHABLE, unreachable
from producer.stats import collect_stats, tenant_backlogs
from producer.tenants import TenantError

if TYPE_CHECKING:
    # The batch modules need the batch extras (pyarrow, numpy): imported when a command
    # runs, named here for the annotations only.
    from producer.batch_runner import BatchOptions
    from producer.batch_runner import Progress as BatchProgress
    from producer.batch_sources import Source
    from producer.local_run import LocalService, LocalWorker

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4  # admission control: the backlog or Redis's memory is full
EXIT_INTERRUPTED = 130

# Every option's default is shown in --help (those whose default is None show none).
CONTEXT_SETTINGS: dict[str, Any] = {
    "help_option_names": ["--help"],
    "max_content_width": 110,
    "show_default": True,
}

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class _Group(click.Group):
    """`gpufeed`: its commands share its context settings and are listed in --help in the
    order they are defined."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        # Click keeps a command's help option from the first context that asked for it: a
        # command run on its own (by a test or a tool) gets the settings it has under the
        # group, so its --help never depends on what ran first.
        cmd.context_settings = {**CONTEXT_SETTINGS, **cmd.context_settings}
        super().add_command(cmd, name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:
            # `gpufeed` alone: its help on stdout (click writes it to stderr), so that
            # `gpufeed | less` shows it, and exit 2 as for any usage error.
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(EXIT_USAGE)
        return super().parse_args(ctx, args)


# The --json of the commands that print one JSON object per line.
_json_flag = click.option(
    "--json", "json_out", is_flag=True, help="one JSON object per line on stdout"
)


@dataclass(frozen=True)
class Settings:
    redis_url: str = DEFAULT_REDIS_URL
    stream: str = wire.DEFAULT_STREAM
    group: str = wire.DEFAULT_GROUP
    results_stream: str = wire.DEFAULT_RESULTS_STREAM
    result_prefix: str = wire.DEFAULT_RESULT_PREFIX
    dead_stream: str = wire.DEFAULT_DEAD_STREAM
    priorities: str = ""
    redis_cluster: str = "auto"
    shards: str = "1"
    tenant: str = ""
    tenants: str = ""

    def merged(self, **given: str | None) -> Settings:
        return Settings(**{**self.__dict__, **{k: v for k, v in given.items() if v is not None}})


# The connection options are accepted both before and after the command name; the env
# variables are the ones the worker reads, so one environment configures both sides.
# Each `Settings` field's option: its env variable and what it is, in the order listed.
_CONNECTION_HELP = {
    "redis_url": ("REDIS_URL", "redis://, rediss:// or unix:// URL"),
    "stream": ("GPUFEED_STREAM", "job stream"),
    "group": ("GPUFEED_GROUP", "workers' consumer group"),
    "results_stream": ("GPUFEED_RESULTS_STREAM", "default results stream"),
    "result_prefix": ("GPUFEED_RESULT_PREFIX", "prefix of result hashes"),
    "dead_stream": ("GPUFEED_DEAD_STREAM", "dead-letter stream"),
    "priorities": ("GPUFEED_PRIORITIES", "priority levels, highest first, as the workers'"),
    "redis_cluster": ("GPUFEED_REDIS_CLUSTER", "Redis Cluster: auto, on or off"),
    "shards": ("GPUFEED_SHARDS", "job streams, one per hash tag"),
    "tenant": (
        "GPUFEED_TENANT",
        "the tenant whose streams to use (the workers' GPUFEED_TENANTS)",
    ),
    "tenants": ("GPUFEED_TENANTS", "the workers' tenants, to show each one's backlog"),
}


class UsageError(Exception):
    """A mistake in the command line; the message is the one line the user sees."""


def _fail(message: str, code: int) -> click.exceptions.Exit:
    print(f"error: {message}", file=sys.stderr)
    return click.exceptions.Exit(code)


def redact(url: str) -> str:
    """`url` without its password (in the userinfo or a `password=` query parameter)."""
    parts = urlsplit(url)
    if parts.password is not None:
        user = f"{parts.username}:" if parts.username else ""
        url = url.replace(parts.netloc, f"{user}***@{parts.netloc.rpartition('@')[2]}", 1)
    if "password=" in parts.query:
        params = parts.query.split("&")
        query = "&".join("password=***" if p.startswith("password=") else p for p in params)
        url = url.replace(parts.query, query, 1)
    return url


@contextmanager
def _session(settings: Settings) -> Iterator[Producer]:
    """A producer for the command; the ways Redis can fail become one line and an exit code."""
    url = settings.redis_url
    try:
        shard_count = int(settings.shards)
    except ValueError:
        message = f"GPUFEED_SHARDS: expected an integer, got {settings.shards!r}"
        raise _fail(message, EXIT_USAGE) from None
    try:
        producer = Producer(
            url,
            stream=settings.stream,
            results_stream=settings.results_stream,
            result_prefix=settings.result_prefix,
            dead_stream=settings.dead_stream,
            priorities=settings.priorities,
            shard_count=shard_count,
            cluster=settings.redis_cluster,
            tenant=settings.tenant,
        )
    except UNREACHABLE as exc:
        # GPUFEED_REDIS_CLUSTER=auto asks the node at once.
        raise _fail(unreachable(redact(url), exc), EXIT_UNREACHABLE) from None
    except ValueError as exc:
        if isinstance(exc, TenantError):
            raise _fail(f"GPUFEED_TENANT: {exc}", EXIT_USAGE) from None
        if "priorit" in str(exc):
            raise _fail(f"GPUFEED_PRIORITIES: {exc}", EXIT_USAGE) from None
        # redis-py rejects a malformed URL (unknown scheme, bad port) with ValueError.
        raise _fail(f"invalid Redis URL {redact(url)}: {exc}", EXIT_USAGE) from None
    password = urlsplit(url).password
    try:
        with producer:
            yield producer
    except UNREACHABLE as exc:
        reason = unreachable(redact(url), exc)
        for secret in {password, unquote(password or "")} - {None, ""}:
            reason = reason.replace(str(secret), "***")
        raise _fail(reason, EXIT_UNREACHABLE) from None
    except redis.RedisError as exc:
        raise _fail(f"Redis at {redact(url)} refused a command: {exc}", EXIT_FAILED) from None


def _settings(ctx: click.Context, **given: str | None) -> Settings:
    base = ctx.obj if isinstance(ctx.obj, Settings) else Settings()
    return base.merged(**given)


def _connection(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command --redis-url and the connection options `names`, after its own options
    (written above this decorator), and call it with `settings` first: those given after the
    command name over those given before it (kept in the context) and the defaults."""
    chosen = [n for n in _CONNECTION_HELP if n == "redis_url" or n in names]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            ctx = click.get_current_context()
            command(_settings(ctx, **{n: kwargs.pop(n) for n in chosen}), **kwargs)

        # Click lists the options in the reverse of the order they are added in: these,
        # added first, come after the command's own.
        for name in reversed(chosen):
            envvar, what = _CONNECTION_HELP[name]
            run = click.option(
                f"--{name.replace('_', '-')}",
                name,
                envvar=envvar,
                show_envvar=True,
                show_default=False,
                help=f"{what} (default: {getattr(Settings(), name) or 'none'})",
            )(run)
        return run

    return decorate


@click.group(
    "gpufeed",
    cls=_Group,
    context_settings=CONTEXT_SETTINGS,
    help="Submit image jobs to gpufeed workers and read their results.",
)
@_connection(*_CONNECTION_HELP)
def app(settings: Settings) -> None:
    click.get_current_context().obj = settings


def find_images(paths: Sequence[Path]) -> list[Path]:
    """Files named on the command line, plus image files found under named folders."""
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found.extend(
                sorted(
                    f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()
                )
            )
        elif p.is_file():
            found.append(p)
        else:
            raise UsageError(f"no such file or folder: {p}")
    if not found:
        raise UsageError(f"no image files found in {', '.join(map(str, paths))}")
    return found


def _read_urls(source: str | None) -> list[str]:
    """The URLs of `--urls FILE` (`-`: standard input)."""
    if source is None:
        return []
    try:
        if source == "-":
            found = read_url_list(sys.stdin)
        else:
            with open(source, encoding="utf-8") as f:
                found = read_url_list(f)
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{source} is not UTF-8 text") from None
    if not found:
        raise UsageError(f"no URLs in {'standard input' if source == '-' else source}")
    return found


def _progress(description: str, total: int) -> Progress:
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        # Rich on a pipe would print the final bar as clutter in logs.
        disable=not err.is_terminal,
    )
    progress.add_task(description, total=total)
    return progress


def _total_ms(details: dict[str, Any]) -> float | None:
    timings = details.get("timings_ms")
    value = timings.get("total") if isinstance(timings, dict) else details.get("total_ms")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _row(job_id: str, result: wire.JobResult | None) -> list[str]:
    if result is None:
        return [job_id, "missing", "", "", "", "no result yet", "", ""]
    total = _total_ms(result.details)
    return [
        job_id,
        result.status,
        "" if result.top1 is None else str(result.top1),
        _what(result),
        "" if result.score is None else f"{result.score:.4f}",
        result.error or "",
        "" if total is None else f"{total:.1f}",
        _marks(result),
    ]


# What the `mark` column's words say, printed under a table that shows them.
MARKS = {
    "dup": "the id had a result already (--json: duplicate_of, the entry that made it)",
    "cached": "the image came from the worker's decode cache (decoded before)",
    "degraded": "answered by the worker's cheaper degraded step, under backlog",
}


def _marks(result: wire.JobResult) -> str:
    marks = [
        name
        for name, on in (
            ("dup", result.duplicate_of is not None),
            ("cached", result.details.get("cached") is True),
            ("degraded", result.degraded),
        )
        if on
    ]
    return ",".join(marks)


def shown_ids(ids: Sequence[str]) -> list[str]:
    """Ids as a table shows them: a URL's by the tail of its path (its file name, with as
    many folders before it as it takes to tell the ids apart), prefixed `…/`; others whole.
    --json gives the whole ids."""
    parts = {i: _url_path(i) for i in ids}
    depth = dict.fromkeys(ids, 1)
    while True:
        tails = {i: "/".join(p[-depth[i] :]) for i, p in parts.items() if p}
        seen: dict[str, list[str]] = {}
        for i, tail in tails.items():
            seen.setdefault(tail, []).append(i)
        grow = [
            i for same in seen.values() if len(same) > 1 for i in same if depth[i] < len(parts[i])
        ]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    return [f"…/{tails[i]}" if i in tails else i for i in ids]


def _url_path(job_id: str) -> list[str]:
    """The path segments after a URL's host (none for an id that is no URL, or a URL with
    no path to show)."""
    scheme, sep, rest = job_id.partition("://")
    if not sep or "/" in scheme:
        return []
    return [s for s in rest.split("/")[1:] if s]


def _what(result: wire.JobResult) -> str:
    """The label column: the class name, the multi-label names, or what kind of vector."""
    if result.embedding is not None:
        return f"embedding: {result.dim} x {result.dtype}"
    if result.output is not None:
        return f"output: {list(result.shape or ())} {result.dtype}"
    if result.labels is not None and "threshold" in result.details:
        return ", ".join(result.labels) or "(no label above the threshold)"
    return result.label or ""


def _results_table(rows: list[list[str]]) -> Group:
    """The results, ids fitted (shown_ids) and never cut, the error and mark columns only
    where a row has one, and what the marks mean."""
    heads = ["id", "status", "top1", "label", "score", "error", "total ms", "mark"]
    keep = [
        i for i in range(len(heads)) if heads[i] not in ("error", "mark") or any(r[i] for r in rows)
    ]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for i in keep:
        # Ids, labels and errors fold onto more lines where they must; figures are never cut.
        wraps = heads[i] in ("id", "label", "error")
        table.add_column(heads[i], no_wrap=not wraps, overflow="fold")
    ids = shown_ids([row[0] for row in rows])
    for row, shown in zip(rows, ids, strict=True):
        style = {"ok": "", "error": "red", "missing": "yellow"}.get(row[1], "")
        cells = [shown, *row[1:]]
        table.add_row(*(cells[i] for i in keep), style=style)
    used = {m for row in rows for m in row[7].split(",") if m}
    notes = [f"{name}: {MARKS[name]}" for name in MARKS if name in used]
    if ids != [row[0] for row in rows]:
        notes.append("…/name: the tail of the job's URL (--json gives whole ids)")
    return Group(table, *(Text(note, style="dim") for note in notes))


def _print_json(obj: Any) -> None:
    # Plain print: rich would wrap long lines and break the one-object-per-line format.
    print(json.dumps(obj, ensure_ascii=False, default=str), flush=True)


@app.command()
@click.argument(
    "files_or_dirs",
    nargs=-1,
    type=click.Path(path_type=Path),
    help="image files, or folders to search",
)
@click.option(
    "--urls",
    metavar="FILE",
    help="submit url jobs instead: one URL a line (http(s)://, s3://...), - for stdin",
)
@click.option("--wait", is_flag=True, help="wait for the results and show them")
@_json_flag
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, help="seconds to wait")
@click.option("--reply-to", help="stream for the results")
@click.option("--meta", help="text echoed back with each result")
@click.option("--id-prefix", default="", show_default=False, help="prepended to each job id")
@click.option(
    "--batch", type=click.IntRange(min=1), default=256, help="jobs per pipelined round trip"
)
@click.option(
    "--priority",
    help="the jobs' priority level, one of GPUFEED_PRIORITIES (default: the lowest)",
)
@click.option(
    "--max-backlog",
    type=click.IntRange(min=0),
    default=0,
    help="refuse (exit 4) once this many jobs wait or are pending; 0: no limit",
)
@click.option(
    "--max-memory-share",
    type=click.FloatRange(min=0.0, max=1.0),
    default=0.0,
    help="refuse (exit 4) past this share of Redis's maxmemory; 0: off",
)
@_connection("stream", "results_stream", "result_prefix", "priorities", "tenant")
def submit(
    settings: Settings,
    *,
    files_or_dirs: tuple[Path, ...],
    urls: str | None,
    wait: bool,
    json_out: bool,
    timeout: float,
    reply_to: str | None,
    meta: str | None,
    id_prefix: str,
    batch: int,
    priority: str | None,
    max_backlog: int,
    max_memory_share: float,
) -> None:
    """Submit image files (job id: the file name), or with --urls the URLs of images (job id:
    the URL without its fragment and signing parameters), and optionally wait for their
    results."""
    if bool(files_or_dirs) == (urls is not None):
        raise _fail("give image files or folders, or --urls FILE (not both)", EXIT_USAGE)
    files: list[Path] = []
    url_list: list[str] = []
    try:
        if files_or_dirs:
            files = find_images(files_or_dirs)
        else:
            url_list = _read_urls(urls)
    except UsageError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if url_list:
        ids = url_job_ids(url_list, id_prefix=id_prefix)
    else:
        ids = file_job_ids(files, id_prefix=id_prefix)
        _refuse_empty_files(files)
    meta_bytes = None if meta is None else meta.encode()

    def job(i: int) -> Job:
        if url_list:
            return Job(url=url_list[i], id=ids[i], meta=meta_bytes, reply_to=reply_to)
        return Job.from_file(files[i], id=ids[i], meta=meta_bytes, reply_to=reply_to)

    with _session(settings) as producer:
        producer.max_backlog = max_backlog
        producer.max_memory_share = max_memory_share
        try:
            level = pick_level(producer.levels, priority)
        except UnknownPriority as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        target = level_stream(producer.stream, level)
        with _progress("submitting", len(ids)) as progress:
            for start in range(0, len(ids), batch):
                chunk = range(start, min(start + batch, len(ids)))
                try:
                    producer.submit_many((job(i) for i in chunk), priority=priority)
                except OSError as exc:
                    raise _fail(
                        f"cannot read {exc.filename}: {exc.strerror} ({start} jobs were submitted)",
                        EXIT_USAGE,
                    ) from None
                except ValueError as exc:  # an invalid option value, e.g. an empty --reply-to
                    raise _fail(str(exc), EXIT_USAGE) from None
                except AdmissionRefused as exc:
                    raise _fail(f"{exc} ({start} jobs were submitted)", EXIT_REFUSED) from None
                progress.advance(progress.task_ids[0], len(chunk))
        if not wait:
            if json_out:
                key = "url" if url_list else "file"
                sources = url_list or [str(f) for f in files]
                for job_id, source in zip(ids, sources, strict=True):
                    _print_json({"id": job_id, key: source})
            else:
                out.print(f"submitted {len(ids)} job(s) to {target}", soft_wrap=True)
            return
        # Said before the wait too: a minute of "waiting" on a stream nobody reads is lost.
        if (no_reader := _no_reader(producer, level, settings.group)) is not None:
            print(f"note: {no_reader}; waiting {timeout:g}s for one", file=sys.stderr)
        with _progress("waiting", len(ids)) as progress:
            results = producer.wait(
                ids, timeout, on_result=lambda _: progress.advance(progress.task_ids[0])
            )
        if len(results) < len(ids):
            # Asked again: a worker may have started, or gone, meanwhile.
            no_reader = _no_reader(producer, level, settings.group)
    _report(ids, results, timeout, json_out, no_reader=no_reader)


def _no_reader(producer: Producer, level: str, group: str) -> str | None:
    """Why no worker will answer, in one clause: the job streams jobs were sent to (each
    shard's, at `level`) whose consumer group does not exist or has no consumer, read as
    `producer stats` reads them. None when each has one, or when this Redis user may not
    look (a tenant's, docs/security.md): nothing is known then."""
    unread: list[str] = []
    try:
        for shard in producer.shards:
            stream = level_stream(shard.stream, level)
            snapshot = collect_stats(
                producer.client,
                stream,
                group,
                shard.results_stream,
                dead_stream=shard.dead_stream,
            )
            found = snapshot["group"]
            if snapshot["stream"]["exists"] is None:
                return None
            if found is None:
                unread.append(f"{stream} (its group {group} does not exist)")
            elif not found["consumers"]:
                unread.append(f"{stream} (its group {group} has 0 consumers)")
    except redis.exceptions.NoPermissionError:
        return None
    if not unread:
        return None
    return (
        f"no worker reads {', '.join(unread)}: start one with `make run-worker` or "
        "`python -m worker`"
    )


def _refuse_empty_files(files: list[Path]) -> None:
    """Exit 2 naming the empty files, before anything is submitted: an empty image can only
    fail, and a submit is all or nothing (`producer batch` records such a file as an error
    row and goes on)."""
    try:
        empty = [f for f in files if f.stat().st_size == 0]
    except OSError as exc:
        raise _fail(f"cannot read {exc.filename}: {exc.strerror}", EXIT_USAGE) from None
    if empty:
        named = ", ".join(str(f) for f in empty[:3])
        more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
        raise _fail(
            f"{named}{more}: empty (0 bytes), so nothing was submitted; remove "
            f"{'them' if len(empty) > 1 else 'it'}, or run `producer batch`, which records "
            "an empty file as an error row",
            EXIT_USAGE,
        )


def _report(
    ids: list[str],
    results: dict[str, wire.JobResult],
    timeout: float,
    json_out: bool,
    *,
    no_reader: str | None = None,
) -> None:
    if json_out:
        for job_id in ids:
            if job_id in results:
                _print_json(results[job_id].to_dict())
    else:
        out.print(_results_table([_row(i, results.get(i)) for i in ids]))
    failed = sum(1 for r in results.values() if not r.ok)
    missing = len(ids) - len(results)
    problems = [f"{failed} of {len(ids)} job(s) failed"] if failed else []
    if missing:
        problems.append(f"{missing} of {len(ids)} job(s) have no result after {timeout:g}s")
        if no_reader is not None:
            problems.append(no_reader)
    if problems:
        raise _fail("; ".join(problems), EXIT_FAILED)


def _ends_on_signals(command: Callable[..., None]) -> Callable[..., None]:
    """`batch`: SIGTERM ends it as ^C does, and either, at any step (counting the source,
    starting the local workers, the run, its end), exits 143 or 130 with one line, never
    click's "Aborted!" (exit 1)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        from producer.batch_runner import interruption, sigterm_as_interrupt

        with sigterm_as_interrupt():
            try:
                command(*args, **kwargs)
            except KeyboardInterrupt as exc:
                said, code = interruption(exc)
                raise _fail(f"{said}: run the same command again to go on", code) from None

    return run


@app.command()
@click.argument(
    "source",
    help="a folder, a manifest (.txt .csv .jsonl .parquet), an s3:// gs:// az:// prefix",
)
@click.option(
    "--out",
    "out_path",
    required=True,
    help="output file (.parquet or .jsonl), or a Parquet dataset: a folder or an s3:// gs:// "
    "az:// prefix, ending in /",
)
@click.option(
    "--part",
    "part_text",
    default="0/1",
    show_default=False,
    help="I/N: run part I of N of the source (0 <= I < N), one client each, into one "
    "dataset --out DIR/; each id is in exactly one part",
)
@click.option(
    "--in-flight",
    type=click.IntRange(min=1),
    help="jobs outstanding at most (default: twice the workers' batch sizes)",
)
@click.option("--priority", help="priority level, one of GPUFEED_PRIORITIES (default: the lowest)")
@click.option("--retry-failed", is_flag=True, help="submit the output's error rows again")
@click.option(
    "--deadline",
    type=click.FloatRange(min=0.001),
    help="seconds each job may wait once submitted (deadline_ms)",
)
@click.option(
    "--path-root",
    help="send local files as path jobs relative to this folder (the workers' "
    "GPUFEED_PATH_ROOT) instead of their bytes",
)
@click.option("--meta", help="text echoed back with each result")
@click.option(
    "--checkpoint",
    type=click.FloatRange(min=0.05),
    default=10.0,
    help="seconds between commits of the rows written so far",
)
@click.option(
    "--max-backlog",
    type=click.IntRange(min=0),
    default=0,
    help="wait while this many jobs wait or are pending; 0: no limit",
)
@click.option(
    "--max-memory-share",
    type=click.FloatRange(min=0.0, max=1.0),
    default=0.0,
    help="wait past this share of Redis's maxmemory; 0: off",
)
@click.option(
    "--max-image-bytes",
    type=click.IntRange(min=1024),
    default=wire.DEFAULT_MAX_IMAGE_BYTES,
    envvar="GPUFEED_MAX_IMAGE_BYTES",
    show_envvar=True,
    help="a local file over this is an error row, never read past it (the workers' limit)",
)
@click.option(
    "--keep-columns",
    default="",
    show_default=False,
    help="columns of a .csv, .jsonl or .parquet manifest to copy into each output row, "
    "separated by commas (e.g. product_id,caption), as text",
)
@click.option(
    "--id-prefix",
    default="",
    show_default=False,
    help="prepended to each job id: the same files as new jobs, not duplicate_of the "
    "results their ids got before (GPUFEED_RESULT_TTL_S)",
)
@click.option(
    "--local",
    is_flag=True,
    help="start a private Redis and one worker per GPU (one CPU worker without a GPU) for "
    "this run, with the model GPUFEED_MODEL names, and stop them after it (REDIS_URL unused)",
)
@click.option("--json", "json_out", is_flag=True, help="JSON progress lines and summary on stdout")
@_connection("stream", "group", "results_stream", "result_prefix", "priorities", "tenant")
@_ends_on_signals
def batch(
    settings: Settings,
    *,
    source: str,
    out_path: str,
    part_text: str,
    in_flight: int | None,
    priority: str | None,
    retry_failed: bool,
    deadline: float | None,
    path_root: str | None,
    meta: str | None,
    checkpoint: float,
    max_backlog: int,
    max_memory_share: float,
    max_image_bytes: int,
    keep_columns: str,
    id_prefix: str,
    local: bool,
    json_out: bool,
) -> None:
    """Run every image of SOURCE and write one row per job to --out, resumably: run the
    same command again after a crash and only the ids not in the output are submitted.
    With --local, on this machine alone: nothing needs to run before, nothing runs after."""
    from producer.batch_output import OutputError, output_format
    from producer.batch_parts import Part
    from producer.batch_runner import BatchOptions
    from producer.batch_sources import SourceError, open_source, read_extensions
    from producer.batch_view import (
        duplicates_message,
        failed_message,
        ignored_message,
        not_images_message,
        print_json,
        summary,
    )

    try:
        part = Part.parse(part_text)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    dataset = out_path.endswith("/")
    if not part.whole and not dataset:
        raise _fail(
            f"--part {part}: each part writes its own file into one dataset: give --out a "
            f"folder or prefix ending in / (e.g. {Path(out_path).stem or 'out'}/)",
            EXIT_USAGE,
        )
    options = BatchOptions(
        part=part,
        in_flight=in_flight,
        priority=priority,
        retry_failed=retry_failed,
        deadline_s=deadline,
        path_root=path_root,
        meta=None if meta is None else meta.encode(),
        checkpoint_s=checkpoint,
        max_image_bytes=max_image_bytes,
        id_prefix=id_prefix,
    )
    try:
        if not dataset:
            output_format(Path(out_path))
        src = open_source(source, path_root=path_root, keep_columns=keep_columns.split(","))
        # Before any output or service: a source with nothing to run is a mistake to say,
        # not an empty file and exit 0.
        passed_over = src.nothing_to_run()
    except (SourceError, OutputError) as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if passed_over is not None:
        what = (
            f"; passed over {passed_over.count}: {passed_over.summary()}"
            if passed_over.count
            else ""
        )
        raise _fail(
            f"nothing to run: {source} has no image batch reads ({read_extensions()}){what}",
            EXIT_USAGE,
        )
    if local:
        with contextlib.ExitStack() as stack:
            idle = not dataset and _nothing_left(src, Path(out_path), options)
            service = _local_service(stack, json_out=json_out, workers=not idle)
            local_settings = settings.merged(redis_url=service.redis_url)
            progress = _run_batch(
                local_settings, src, out_path, options, json_out=json_out, service=service
            )
    else:
        progress = _run_batch(
            settings,
            src,
            out_path,
            options,
            json_out=json_out,
            max_backlog=max_backlog,
            max_memory_share=max_memory_share,
        )
    if json_out:
        print_json({"summary": progress.to_dict()})
    else:
        summary(progress, out)
    if progress.ignored:
        print(f"warning: {ignored_message(progress)}", file=sys.stderr)
    if progress.not_images.count:
        print(f"note: {not_images_message(progress)}", file=sys.stderr)
    if progress.duplicates:
        print(f"note: {duplicates_message(progress)}", file=sys.stderr)
    # The exit code says what the output holds, whichever run wrote its rows.
    if progress.output_errors:
        raise _fail(failed_message(progress), EXIT_FAILED)


def _run_batch(
    settings: Settings,
    src: Source,
    out_path: str,
    options: BatchOptions,
    *,
    json_out: bool,
    max_backlog: int = 0,
    max_memory_share: float = 0.0,
    service: LocalService | None = None,
) -> BatchProgress:
    """The run, its errors as one line and an exit code; `service`: the --local one, whose
    ended worker is what a run interrupted from inside means."""
    from producer.batch_lanes import FAILOVER_ERRORS
    from producer.batch_runner import interruption, run_batch
    from producer.batch_view import BatchView

    with _session(settings) as producer:
        producer.group = settings.group
        producer.max_backlog = max_backlog
        producer.max_memory_share = max_memory_share
        try:
            with BatchView(err, json_lines=json_out) as on_progress:
                return run_batch(src, out_path, producer, options, on_progress=on_progress)
        except (ValueError, UnknownPriority) as exc:  # SourceError, OutputError among them
            raise _fail(str(exc), EXIT_USAGE) from None
        except FAILOVER_ERRORS as exc:
            # Lost mid-run (on a cluster: a shard unreachable past FAILOVER_LIMIT_S): the
            # output holds what was committed, and resumes from there.
            reason = unreachable(redact(settings.redis_url), exc)
            password = urlsplit(settings.redis_url).password
            for secret in {password, unquote(password or "")} - {None, ""}:
                reason = reason.replace(str(secret), "***")
            when = "to go on" if service is not None else "once Redis is back"
            raise _fail(
                f"{reason}; the output keeps the rows written so far: run the same command "
                f"again {when}",
                EXIT_UNREACHABLE,
            ) from None
        except KeyboardInterrupt as exc:
            if service is not None and service.ended is not None:
                raise _fail(
                    f"--local: {service.ended_message()}; the output keeps the rows written "
                    "so far: run the same command again to go on",
                    EXIT_FAILED,
                ) from None
            said, code = interruption(exc)
            raise _fail(f"{said}: run the same command again to go on", code) from None


def _nothing_left(src: Source, out_path: Path, options: BatchOptions) -> bool:
    """`batch --local` with every item's row in the output already: no worker to start."""
    from producer.batch_output import OutputError
    from producer.jobs import _fit_id
    from producer.local_run import nothing_left

    prefix = options.id_prefix
    try:
        return nothing_left(
            src,
            out_path,
            retry_failed=options.retry_failed,
            job_id=(lambda i: _fit_id(prefix + i)) if prefix else str,
        )
    except OutputError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


def _local_service(
    stack: contextlib.ExitStack, *, json_out: bool, workers: bool = True
) -> LocalService:
    """`batch --local`: a private Redis and workers of its own, ready, entered on `stack`
    (which stops them and removes their files when it closes, however it closes).
    `workers=False`: nothing left to submit, the Redis alone (the run still finishes its
    output and counts its rows, as against a deployment)."""
    from producer.batch_view import print_json
    from producer.local_run import LocalRunError, local_service, replaced_settings

    def on_state(svc: LocalService) -> None:
        if json_out:
            print_json({"local": [_worker_line(w) for w in svc.workers]})
        states = ", ".join(f"{w.name} ({w.device}): {w.state}" for w in svc.workers)
        status.update(f"starting {len(svc.workers)} local worker(s): {states}")

    with err.status("starting the local service") as status:
        try:
            service = stack.enter_context(local_service(on_state=on_state, workers=workers))
        except LocalRunError as exc:
            raise _fail(f"--local: {exc}", EXIT_FAILED) from None
    # Said before the workers drain and Redis stops (the stack unwinds last-in first).
    stack.callback(err.print, "local: stopping the workers and Redis")
    replaced = replaced_settings(os.environ)
    if replaced:
        err.print(f"local: {', '.join(replaced)} set here, not used: a local run has its own")
    if not workers:
        err.print("local: every item has its row in the output already: no worker started")
        return service
    err.print(
        f"local: Redis at {service.redis_url}, "
        + ", ".join(f"worker {w.name} on {w.device}" for w in service.workers)
    )
    return service


def _worker_line(worker: LocalWorker) -> dict[str, Any]:
    return {
        "worker": worker.name,
        "device": worker.device,
        "state": worker.state,
        "pid": worker.process.pid,
    }


@app.command()
@_json_flag
@_connection("stream", "group", "results_stream", "dead_stream", "priorities", "tenant", "tenants")
def stats(settings: Settings, *, json_out: bool) -> None:
    """Show the job backlog, the consumer group, its consumers and live workers.

    With GPUFEED_TENANTS (the workers' setting), each tenant's backlog too."""
    try:
        names = [] if settings.tenant else [n for n, _ in tenants.parse(settings.tenants)]
    except TenantError as exc:
        raise _fail(f"GPUFEED_TENANTS: {exc}", EXIT_USAGE) from None
    with _session(settings) as producer:
        by_tenant = tenant_backlogs(
            producer.client,
            [
                tenants.tenant_layout(
                    name,
                    len(producer.shards),
                    stream=settings.stream,
                    results_stream=settings.results_stream,
                    result_prefix=settings.result_prefix,
                    dead_stream=settings.dead_stream,
                )
                for name in names
            ],
            settings.group,
            settings.priorities,
        )
        snapshots = [
            collect_stats(
                producer.client,
                shard.stream,
                settings.group,
                shard.results_stream,
                dead_stream=shard.dead_stream,
                priorities=settings.priorities,
            )
            for shard in producer.shards
        ]
    if json_out:
        shown = snapshots[0] if len(snapshots) == 1 else {"shards": snapshots}
        _print_json({**shown, "tenants": by_tenant} if names else shown)
    else:
        for i, snapshot in enumerate(snapshots):
            if len(snapshots) > 1:
                out.print(f"[bold]shard {i}[/bold]")
            # The live workers (the same for every shard) once, after the last shard.
            _render_stats(snapshot, with_workers=i == len(snapshots) - 1)
        if names:
            _render_tenants(by_tenant)


def _render_tenants(rows: list[dict[str, Any]]) -> None:
    table = Table("tenant", "stream", "length", "lag", "pending", "consumers", title="tenants")
    for row in rows:
        table.add_row(
            *(
                "-" if row[key] is None else str(row[key])
                for key in ("tenant", "stream", "length", "lag", "pending", "consumers")
            )
        )
    out.print(table)


def _length(info: dict[str, Any]) -> str:
    if not info["exists"]:
        return "no such stream"
    if info["length"] is None:
        return str(info.get("error", "not a stream"))
    return f"{info['length']} entries"


def _render_levels(levels: list[dict[str, Any]]) -> None:
    table = Table("level", "stream", "length", "lag", "pending", "consumers", title="levels")
    for lv in levels:
        g = lv["group"]
        lag = "-" if g is None else "unknown" if g["lag"] is None else str(g["lag"])
        table.add_row(
            lv["level"],
            lv["stream"]["name"],
            _length(lv["stream"]),
            lag,
            "-" if g is None else str(g["pending"]),
            "-" if g is None else str(g["consumers"]),
        )
    out.print(table)


def _render_stats(snapshot: dict[str, Any], *, with_workers: bool = True) -> None:
    jobs, group = snapshot["stream"], snapshot["group"]
    overview = Table("", "", show_header=False, box=None)
    if snapshot["levels"]:
        # The plain stream is not read while there are levels: each level's row instead.
        _render_levels(snapshot["levels"])
    else:
        overview.add_row("job stream", f"{jobs['name']}: {_length(jobs)}")
        if group is None:
            overview.add_row("group", "none yet (no worker has started on this stream)")
        else:
            lag = "unknown" if group["lag"] is None else str(group["lag"])
            overview.add_row("group", group["name"])
            overview.add_row("  pending", str(group["pending"]))
            overview.add_row("  lag (not yet delivered)", lag)
            overview.add_row("  last delivered id", str(group["last_delivered_id"]))
            overview.add_row("  consumers", str(group["consumers"]))
    for key, title in (("results_stream", "results stream"), ("dead_stream", "dead letters")):
        info = snapshot[key]
        overview.add_row(title, f"{info['name']}: {_length(info)}")
    out.print(overview)
    for lv in snapshot["levels"] or [snapshot]:
        if lv["consumers"]:
            title = f"consumers of {lv['level']}" if lv.get("level") else "consumers"
            consumers = Table("consumer", "pending", "idle ms", title=title)
            for c in lv["consumers"]:
                consumers.add_row(c["name"], str(c["pending"]), str(c["idle_ms"]))
            out.print(consumers)
    if not with_workers:
        return
    # The heartbeat's compact figures; the full snapshot is in `stats --json`.
    columns = (
        ("worker", "name"), ("model", "model"), ("jobs/s", "jobs_per_s"),
        ("ok", "results_ok"), ("errors", "results_error"), ("p50 ms", "p50_ms"),
        ("p99 ms", "p99_ms"), ("fill", "batch_fill"),
    )  # fmt: skip
    workers = Table(*(title for title, _ in columns), title="live workers")
    for w in snapshot["workers"]:
        fields = w["fields"]
        cells = [str(fields.get(key, "")) for _, key in columns]
        cells[0] = cells[0] or w["name"]
        workers.add_row(*cells)
    if snapshot.get("workers_hidden"):
        workers.add_row("not visible to this Redis user", *([""] * (len(columns) - 1)))
    elif not snapshot["workers"]:
        workers.add_row("none", *([""] * (len(columns) - 1)))
    out.print(workers)


@app.command()
@click.option(
    "--count", type=click.IntRange(min=1), default=10, help="how many of the latest results"
)
@click.option("--follow", "-f", is_flag=True, help="keep printing new results")
@_json_flag
@_connection("results_stream", "tenant")
def results(settings: Settings, *, count: int, follow: bool, json_out: bool) -> None:
    """Print the latest results from the results stream, and with --follow, new ones."""
    with _session(settings) as producer:
        if follow and producer.sharded:
            names = ", ".join(shard.results_stream for shard in producer.shards)
            raise _fail(f"--follow reads one results stream; the shards have {names}", EXIT_USAGE)
        recent = producer.recent_results(count)
        if json_out:
            for _, result in recent:
                _print_json(result.to_dict())
        elif recent:
            out.print(_results_table([_row(r.id, r) for _, r in recent]))
        else:
            print(f"no results on {producer.results_stream}", file=sys.stderr)
        if not follow:
            return
        # Continue right after what was shown, so nothing slips between the two reads.
        start = recent[-1][0] if recent else "0-0"
        try:
            for _, result in producer.iter_results(start):
                if json_out:
                    _print_json(result.to_dict())
                else:
                    out.print("  ".join(c for c in _row(result.id, result) if c), soft_wrap=True)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


@app.command("wait")
@click.argument("id", nargs=-1, required=True, help="job ids")
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, help="seconds to wait")
@click.option("--reply-to", multiple=True, help="also watch this reply stream (repeatable)")
@_json_flag
@_connection("results_stream", "result_prefix", "tenant")
def wait_for(
    settings: Settings,
    *,
    id: tuple[str, ...],
    timeout: float,
    reply_to: tuple[str, ...],
    json_out: bool,
) -> None:
    """Show the results of job ids, decoded (the msgpack `result` too), waiting for those
    not published yet."""
    ids = list(id)
    with _session(settings) as producer:
        streams = [producer.results_stream, *reply_to] if reply_to else None
        results = producer.wait(ids, timeout, streams=streams)
    _report(ids, results, timeout, json_out)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _dead_row(d: DeadLetter) -> list[str]:
    at = d.dead_at
    if d.image_bytes is not None:
        image = f"{_size(d.image_bytes)} image"
    elif d.path is not None:
        image = f"path {d.path}"
    else:
        image = "no image or path"
    return [
        d.dead_id,
        d.id,
        "" if d.deliveries is None else str(d.deliveries),
        d.consumer or "",
        "" if at is None else iso_utc(at),
        image,
    ]


@app.command()
@click.option(
    "--count", type=click.IntRange(min=1), default=100, help="how many dead letters, oldest first"
)
@_json_flag
@_connection("dead_stream")
def dead(settings: Settings, *, count: int, json_out: bool) -> None:
    """List dead letters: jobs that kept killing or stalling workers past the delivery limit."""
    with _session(settings) as producer:
        letters = producer.dead_letters(count)
    if json_out:
        for d in letters:
            _print_json(d.to_dict())
    elif letters:
        table = Table("dead entry", "job id", "deliveries", "last consumer", "when (UTC)", "image")
        for d in letters:
            table.add_row(*_dead_row(d))
        out.print(table)
    else:
        print(f"no dead letters on {settings.dead_stream}", file=sys.stderr)


@app.command("replay-dead")
@click.argument(
    "entry_ids",
    nargs=-1,
    help="dead-letter stream entry IDs (as `dead` lists them)",
)
@click.option("--all", "all_", is_flag=True, help="replay every dead letter")
@click.option("--keep", is_flag=True, help="leave the dead letters in the dead-letter stream")
@_json_flag
@_connection("stream", "result_prefix", "dead_stream")
def replay_dead(
    settings: Settings,
    *,
    entry_ids: tuple[str, ...],
    all_: bool,
    keep: bool,
    json_out: bool,
) -> None:
    """Enqueue dead letters again with their original fields, to be run again.

    Deletes each replayed job id's stored dead_letter result, so the job is not a duplicate.
    """
    if bool(entry_ids) == all_:
        raise _fail("give the dead letters' entry IDs, or --all (not both)", EXIT_USAGE)
    with _session(settings) as producer:
        try:
            added = producer.replay_dead(list(entry_ids), all=all_, keep=keep)
        except DeadLetterNotFound as exc:
            raise _fail(str(exc), EXIT_FAILED) from None
        except ValueError as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
    if json_out:
        _print_json({"replayed": len(added), "stream": settings.stream, "entries": added})
        return
    kept = f", kept in {settings.dead_stream}" if keep else ""
    # A dead letter of a priority level goes back to that level's stream (`<level>:<id>`).
    where = f"{settings.stream}:<level>" if any(":" in e for e in added) else settings.stream
    out.print(f"re-enqueued {len(added)} dead letter(s) to {where}{kept}", soft_wrap=True)
    for entry_id in added:
        out.print(entry_id, soft_wrap=True)


def main() -> None:
    # A crash in a C extension (a signal mid-call) prints every thread's Python stack on
    # stderr instead of ending the process with nothing but its signal.
    faulthandler.enable()
    app(prog_name="gpufeed")
