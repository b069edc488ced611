"""docs/reference/configuration.md: every worker setting (worker/config/settings.py) with its flag,
default and meaning (worker/config/settings_help.py), and the tool variables a worker accepts."""

from __future__ import annotations

from dataclasses import fields

from worker.config import settings_help
from worker.config.settings import WorkerConfig
from worker.docs_gen.markdown import notice
from worker.tools.markdown import table

INTRO = """\
# Configuration

The worker reads its settings once at start-up, from environment variables; each has a
command-line flag of the same name in kebab case (`GPUFEED_BATCH_SIZE` = `--batch-size`),
which wins. An invalid value stops the worker with one line naming the variable and what it
accepts (exit code 2). A `GPUFEED_*` variable that is neither a setting nor one of the tool
variables below also stops it, naming the closest setting, so that a misspelt setting is
never ignored without a word. The variables Kubernetes adds for a Service named
`gpufeed...` (`GPUFEED_SERVICE_HOST`, `GPUFEED_PORT_9100_TCP`, ...) are accepted too.
`python -m worker --help` prints the same meanings.
"""


def settings_table() -> str:
    """Variable, flag, default and meaning of each setting, in the config's order."""
    rows = []
    for f in fields(WorkerConfig):
        env = f.metadata["env"]
        default, meaning = settings_help.SETTINGS[env]
        flag = f.name.replace("_", "-")
        # worker/cli.py gives every bool setting its --no- form.
        flags = f"`--{flag}`, `--no-{flag}`" if str(f.type) == "bool" else f"`--{flag}`"
        rows.append([f"`{env}`", flags, default, settings_help.relink(meaning, "../")])
    return table(["variable", "flag", "default", "meaning"], rows)


def render() -> str:
    tools = table(
        ["variable", "meaning"],
        [
            [f"`{name}`", settings_help.relink(meaning, "../")]
            for name, meaning in sorted(settings_help.TOOL_VARIABLES.items())
        ],
    )
    return (
        notice("worker/config/settings.py and worker/config/settings_help.py")
        + INTRO
        + "\n## Settings\n\n"
        + settings_table()
        + "\n\n## Tool variables\n\n"
        + "`GPUFEED_*` variables that are no worker setting, which a worker accepts in its "
        + "environment:\n\n"
        + tools
        + "\n"
    )
