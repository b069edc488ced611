"""docs/reference/cli.md: `--help` of every command of the worker (`python -m worker`) and of
the producer (`python -m producer`, installed as `gpufeed`), as plain text.

The worker's commands that take the worker settings show them once, on the configuration
page, rather than sixty lines under each command.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import click

from producer.cli import app
from worker.cli import DefaultGroup, cli
from worker.config.table import PUBLIC
from worker.docs_gen.markdown import notice

# A fixed width: the page must not depend on the terminal that wrote it.
WIDTH = 100
# The flags every command that takes settings has (tuning constants have none).
_SETTINGS = {s.name for s in PUBLIC}


def worker_command() -> click.Command:
    return cli


def producer_command() -> click.Command:
    return app


def walk(
    command: click.Command, name: str, parent: click.Context | None = None
) -> Iterator[tuple[click.Command, click.Context]]:
    """Each command with the context its --help is written in, depth first."""
    # The command's own context settings (its help option names among them), as when it runs.
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = command.context_class(command, info_name=name, parent=parent, **settings)
    yield command, ctx
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, sub_name, ctx)


SETTINGS_HEADING = "Worker settings"
SETTINGS_POINTER = "  Every worker setting, with its meaning and variable: see Configuration.\n"


def elide_settings(text: str) -> str:
    """`text` with the body of its worker-settings section replaced by a pointer to the
    configuration page (the same settings, written from the same source), every other line
    where --help prints it."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if skipping and line.strip() and not line.startswith(" "):
            skipping = False
            out.append("\n")
        if skipping:
            continue
        out.append(line)
        if line.startswith(SETTINGS_HEADING):
            out.append(SETTINGS_POINTER)
            skipping = True
    return "".join(out)


def plain_help(command: click.Command, ctx: click.Context) -> str:
    """`command`'s --help, without the worker settings (listed on the configuration page)."""
    takes_settings = {p.name for p in command.params} >= _SETTINGS
    if isinstance(command, DefaultGroup):
        # What `python -m worker --help` prints, section by section in its order: only the
        # settings' 350 lines are a pointer to the configuration page.
        return elide_settings(str(command.get_help(ctx)).rstrip() + "\n")
    if takes_settings:
        command = copy.copy(command)
        command.params = [p for p in command.params if p.name not in _SETTINGS]
        ctx.command = command
    text = str(command.get_help(ctx)).rstrip() + "\n"
    if takes_settings:
        text += "\nIt also takes every worker setting as a flag: see Configuration.\n"
    return text


def commands_table(command: click.Group, prog: str) -> str:
    """The group's commands, each with its one line and a link to its --help below: what a
    newcomer looks for first, ahead of the settings."""
    ctx = click.Context(command, info_name=prog, terminal_width=WIDTH, max_content_width=WIDTH)
    rows = ["| Command | What it does |", "|---|---|"]
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        path = f"{prog} {name}"
        anchor = slug(path)
        rows.append(f"| [`{path}`](#{anchor}) | {sub.get_short_help_str(limit=200)} |")
    return "\n".join(rows) + "\n"


def slug(path: str) -> str:
    """The anchor mkdocs' toc gives a heading `` `path` `` (its slugify, which the strict
    build holds this to)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", path).strip().lower())


def _section(title: str, command: click.Command, prog: str) -> list[str]:
    out = [f"## {title}\n"]
    if isinstance(command, click.Group):
        out.append(commands_table(command, prog))
    for sub, ctx in walk(command, prog):
        out.append(f"### `{ctx.command_path}`\n")
        out.append("```text\n" + plain_help(sub, ctx) + "```\n")
    return out


def render() -> str:
    out = [
        notice("the commands' own --help (worker/cli.py, producer/cli.py)").rstrip() + "\n",
        "# Command line\n",
        "Each command's `--help`, as it prints it. The worker's settings (`--batch-size`, "
        "...), which `run`, `demo`, `doctor`, `top`, `model check` and `python -m measure bench` "
        "all take, are on the [configuration page](configuration.md).\n",
    ]
    out += _section("The worker: `python -m worker`", worker_command(), "python -m worker")
    out += _section(
        "The producer: `python -m producer` (or `gpufeed`)",
        producer_command(),
        "python -m producer",
    )
    return "\n".join(out)
