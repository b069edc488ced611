"""docs/reference/configuration.md: every worker setting with its flag, default and meaning,
section by section, the tuning constants, and the other variables a worker accepts; all from
the one table of settings (worker/config/table.py)."""

from __future__ import annotations

from worker.config import table
from worker.docs_gen.markdown import notice
from worker.tools.markdown import table as markdown_table

INTRO = """\
# Configuration

The worker reads its settings once at start-up, from environment variables; each has a
command-line flag of the same name in kebab case (`GPUFEED_BATCH_SIZE` = `--batch-size`),
which wins. An invalid value stops the worker with one line naming the variable and what it
accepts (exit code 2). A `GPUFEED_*` variable that is neither a setting nor one of the
[other variables](#other-variables) also stops it, naming the closest setting, so that a
misspelt setting is never ignored without a word; a former setting (now a
[tuning constant](#tuning-constants)) stops it naming what replaced it. The variables
Kubernetes adds for a Service named `gpufeed...` (`GPUFEED_SERVICE_HOST`,
`GPUFEED_PORT_9100_TCP`, ...) are accepted too. `python -m worker --help` prints the same
meanings.
"""

TUNING = f"""\
## Tuning constants

What the worker's mechanisms run with: intervals, timeouts, queue depths, and mechanisms
that `auto` picks from the host. They are no settings. Each is a constant of
`worker/config/tuning.py` with a comment saying why it has its value: a setting is a promise
to keep, documented and validated, and one more thing an operator must judge safe to leave
alone, while these are values no operator can choose better than the code. As dramatiq and
Ray Data keep such knobs as module constants, gpufeed promotes one to a setting only when an
operator shows a need its value cannot meet. Each was a variable once: the worker now
refuses that variable with one line naming what replaced it.

`{table.TUNING_VARIABLE}` overrides them, for tests and experiments; it is not a contract:
`{table.TUNING_VARIABLE}=claim_interval_s=0.2,stats_interval_s=0.5`, with the names below (a
value may hold commas: `batch_sizes=1,16`). A name that is no tuning constant stops the
worker, and each value is checked as a setting's would be.
"""

ADDING = """\
## Adding a setting

A setting is one entry of `SETTINGS` in `worker/config/table.py` (its variable, default,
type, bounds or choices, meaning in Markdown, and section) and the field of the same name in
`WorkerConfig` (`worker/config/settings.py`), which takes its default from the entry:
`tests/config/test_settings_table.py` fails on either alone. Its flag, its line in `--help`, its
row on this page (`make docs-gen`) and its validation come from the entry; a check that
bounds or choices cannot say is the entry's `check`, and one that relates settings to each
other a named rule of `RULES` (settings.py). `deploy/systemd/worker.env.example` shows
every setting with its default (`tests/project/test_deploy.py` holds the two together). Unless an
operator can choose the value better than the code, make it a tuning constant instead: a
constant in `worker/config/tuning.py` and an entry without a variable.
"""


def settings_table(group: str) -> str:
    """Variable, flag, default and meaning of each setting of `group`, in the table's order."""
    rows = []
    for entry in table.PUBLIC:
        if entry.group != group:
            continue
        flag = entry.name.replace("_", "-")
        # worker/cli.py gives every bool setting its --no- form.
        flags = f"`--{flag}`, `--no-{flag}`" if entry.type_name == "bool" else f"`--{flag}`"
        meaning = table.relink(entry.help, "../")
        rows.append([f"`{entry.env}`", flags, entry.shown_default(), meaning])
    return markdown_table(["variable", "flag", "default", "meaning"], rows)


def tuning_table() -> str:
    """Each tuning constant's name in GPUFEED_TUNING, value, meaning and former variable."""
    rows = [
        [
            f"`{entry.name}`",
            entry.shown_default(),
            table.relink(entry.help, "../"),
            f"`GPUFEED_{entry.constant}`",
        ]
        for entry in table.TUNED
    ]
    return markdown_table(["name", "value", "meaning", "formerly"], rows)


def render() -> str:
    others = {**table.TOOL_VARIABLES, table.TUNING_VARIABLE: table.TUNING_HELP}
    tools = markdown_table(
        ["variable", "meaning"],
        [[f"`{name}`", table.relink(meaning, "../")] for name, meaning in sorted(others.items())],
    )
    sections = "".join(f"\n## {group}\n\n{settings_table(group)}\n" for group in table.GROUPS)
    return (
        notice("worker/config/table.py")
        + INTRO
        + sections
        + "\n"
        + TUNING
        + "\n"
        + tuning_table()
        + "\n\n## Other variables\n\n"
        + "`GPUFEED_*` variables that are no worker setting, which a worker accepts in its "
        + "environment:\n\n"
        + tools
        + "\n\n"
        + ADDING
    )
