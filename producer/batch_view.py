"""What a person (or a script) sees of `producer batch`: a progress bar on a terminal,
JSON progress lines with --json, and a summary table at the end."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from producer.batch_runner import Progress as RunProgress

JSON_EVERY_S = 1.0
# Without a terminal (a CI log, a file, a pipe) and without --json: one plain line this often,
# so that a long run is not silent until its summary.
PLAIN_EVERY_S = 10.0
# Entries passed over that the table names (--json names more).
NAMED_IN_TABLE = 10


class BatchView:
    """A context manager whose `update` is the run's `on_progress`."""

    def __init__(
        self, err: Console, *, json_lines: bool, plain_every_s: float = PLAIN_EVERY_S
    ) -> None:
        self.json_lines = json_lines
        self._last_json = 0.0
        self._err = err
        self._plain_every_s = plain_every_s if not (err.is_terminal or json_lines) else None
        self._last_plain = 0.0
        self._bar: Progress | None = None
        self._task = None
        if err.is_terminal and not json_lines:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:.0f}/s"),
                TimeRemainingColumn(),
                TextColumn("ok {task.fields[ok]}  errors {task.fields[errors]}"),
                TextColumn("skipped {task.fields[skipped]}"),
                TextColumn("in flight {task.fields[in_flight]}"),
                TimeElapsedColumn(),
                console=err,
                transient=True,
            )
            self._task = self._bar.add_task(
                "batch", total=None, rate=0.0, ok=0, errors=0, in_flight=0, skipped=0
            )

    def __enter__(self) -> Callable[[RunProgress], None]:
        if self._bar is not None:
            self._bar.start()
        return self.update

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, p: RunProgress) -> None:
        if self._bar is not None and self._task is not None:
            # This run's work only: what the output held is skipped, not done (else the
            # rate and the time left would count it).
            self._bar.update(
                self._task,
                completed=p.answered,
                total=p.todo,
                rate=p.rate,
                ok=p.ok,
                errors=p.errors,
                in_flight=p.in_flight,
                skipped=p.skipped,
            )
        every = self._plain_every_s
        if every is not None and not p.finished and p.elapsed_s - self._last_plain >= every:
            self._last_plain = p.elapsed_s
            print(plain_line(p), file=self._err.file, flush=True)
        if self.json_lines and (p.finished or p.elapsed_s - self._last_json >= JSON_EVERY_S):
            self._last_json = p.elapsed_s
            print(json.dumps({"progress": p.to_dict()}), flush=True)


def plain_line(p: RunProgress) -> str:
    """The progress bar's figures as one line of text, for a log."""
    todo = "?" if p.todo is None else str(p.todo)
    return (
        f"batch: {p.answered}/{todo} answered, ok {p.ok}, errors {p.errors}, "
        f"skipped {p.skipped}, in flight {p.in_flight}, {p.rate:.0f}/s, {p.elapsed_s:.0f} s"
    )


def summary(p: RunProgress, out: Console) -> None:
    """This run's counts, what it passed over and ignored, then the whole output's rows by
    status and error code, the rate and the wall time."""
    table = Table("", "jobs", title=f"batch {p.source} -> {p.output}", title_justify="left")
    if p.part is not None:
        table.add_row(f"part {p.part}: the other parts' items", str(p.other_parts))
    table.add_row("rows in the output before", str(p.done_before))
    if p.retried:
        table.add_row("  error rows run again", str(p.retried))
    table.add_row("skipped (done before, or a repeated id)", str(p.skipped))
    if p.not_regular:
        table.add_row("passed over (not a regular file)", str(p.not_regular), style="yellow")
        for named in p.not_regular_files[:NAMED_IN_TABLE]:
            table.add_row(f"  {named}", "", style="yellow")
        if p.not_regular > NAMED_IN_TABLE:
            table.add_row(f"  ... and {p.not_regular - NAMED_IN_TABLE} more", "")
    if p.not_images.count:
        table.add_row("passed over (not an image name)", str(p.not_images.count), style="yellow")
        table.add_row(f"  {p.not_images.summary()}", "", style="yellow")
    table.add_row("ok (this run)", str(p.ok))
    table.add_row("error (this run)", str(p.errors), style="red" if p.errors else "")
    for code, n in p.error_codes.most_common():
        table.add_row(f"  {code}", str(n), style="red")
    if p.duplicates:
        table.add_row("  duplicate_of (id answered before)", str(p.duplicates), style="yellow")
    if p.ignored:
        table.add_row("answers ignored (to no job of this run)", str(p.ignored), style="red")
    if p.failovers:
        table.add_row("shard failovers waited out", str(p.failovers), style="yellow")
    if p.resubmitted:
        table.add_row("  jobs lost there, submitted again", str(p.resubmitted), style="yellow")
    table.add_row("rows in the output", str(p.rows))
    table.add_row("  ok", str(p.output_ok))
    table.add_row("  error", str(p.output_errors), style="red" if p.output_errors else "")
    for code, n in p.output_error_codes.most_common():
        table.add_row(f"    {code}", str(n), style="red")
    table.add_row("  from this run", str(p.answered))
    table.add_row("rate (this run)", f"{p.rate:.1f} jobs/s")
    table.add_row("wall time", f"{p.elapsed_s:.1f} s")
    out.print(table)


def duplicates_message(p: RunProgress) -> str:
    """What `duplicate_of` rows mean and what to do, in one line."""
    return (
        f"{p.duplicates} row(s) of this run are marked duplicate_of: their id had a result "
        "already (ids default to file names, and results are kept per id for "
        "GPUFEED_RESULT_TTL_S, 24 h by default); each row holds this run's own answer, but "
        "the id's stored result is the earlier one. To run the same files as new jobs, give "
        "them new ids (--id-prefix run2/)"
    )


def not_images_message(p: RunProgress) -> str:
    from producer.batch_sources import read_extensions

    return (
        f"{p.not_images.count} file(s) passed over, not an image name batch reads "
        f"({read_extensions()}): {p.not_images.summary()}"
    )


def failed_message(p: RunProgress) -> str:
    return (
        f"{p.output_errors} row(s) of {p.output} are errors ({p.errors} from this run): "
        "the rows with status 'error' (run again with --retry-failed to submit them again)"
    )


def ignored_message(p: RunProgress) -> str:
    return (
        f"{p.ignored} answer(s) to no job of this run were ignored (an earlier run's late "
        "answers, repeats, or answers someone else wrote): none is in the output"
    )


def print_json(obj: object) -> None:
    print(json.dumps(obj, ensure_ascii=False), file=sys.stdout, flush=True)
