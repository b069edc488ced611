"""The reference pages (docs/reference/) must name every setting, error code, result field,
metric, make target and command, exactly as their generator writes them from the code; and
`--help` must say what each setting does, in plain text."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner as ClickRunner

from producer import wire, wire_help
from producer.cli import app as producer_app
from producer.wire import ErrorCode
from worker import docs_gen
from worker.cli import cli
from worker.config import table
from worker.config.table import TOOL_VARIABLES
from worker.docs_gen import cli_page, make_page, wire_pages
from worker.observe.metrics import STAGES, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = ROOT / "docs" / "reference"


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


@pytest.mark.parametrize("name", sorted(docs_gen.PAGES))
def test_each_reference_page_is_what_the_generator_writes(name: str) -> None:
    path = docs_gen.DOCS / name
    expected = docs_gen.PAGES[name]()
    assert path.is_file(), f"{name} is missing; run: {docs_gen.FIX_COMMAND}"
    assert path.read_text() == expected, (
        f"docs/{name} differs from what its source in the code says; run: {docs_gen.FIX_COMMAND}"
    )


def test_every_setting_is_documented() -> None:
    text = page("configuration.md")
    for entry in table.PUBLIC:
        flag = "--" + entry.name.replace("_", "-")
        assert re.search(rf"^\| `{entry.env}` \| `{flag}`", text, re.M), entry.env
    # Each section of the table is a section of the page.
    for group in table.GROUPS:
        assert f"\n## {group}\n" in text, group


def test_every_tuning_constant_is_documented_with_its_former_variable() -> None:
    text = page("configuration.md")
    for entry in table.TUNED:
        assert re.search(rf"^\| `{entry.name}` \| .* \| `GPUFEED_{entry.constant}` \|$", text, re.M)


OTHER_VARIABLES = {**TOOL_VARIABLES, table.TUNING_VARIABLE: table.TUNING_HELP}


def test_every_other_variable_is_documented() -> None:
    text = page("configuration.md")
    for name in OTHER_VARIABLES:
        assert f"| `{name}` |" in text


def test_worker_help_names_the_other_variables() -> None:
    result = ClickRunner().invoke(cli, ["--help"], prog_name="python -m worker")
    assert result.exit_code == 0, result.output
    shown = _squeeze(result.output)
    for name, meaning in OTHER_VARIABLES.items():
        assert _squeeze(f"{name} {table.plain(meaning)}") in shown


def test_every_setting_has_a_meaning() -> None:
    for entry in table.SETTINGS:
        assert entry.help.strip() and entry.group in table.GROUPS, entry.name


def test_every_error_code_is_documented() -> None:
    assert set(wire_help.ERROR_CODES) == set(ErrorCode), "producer/wire_help.py ERROR_CODES"
    text = page("error-codes.md")
    missing = [code.value for code in ErrorCode if f"| `{code.value}` |" not in text]
    assert missing == []


def test_every_result_field_is_documented() -> None:
    names = wire_pages.result_field_names()
    # The constants are what the worker writes and the producer reads: a sample of them.
    assert {wire.RES_ID, wire.RES_STATUS, wire.RES_ERROR, wire.RES_RESULT} <= names
    text = page("result-fields.md")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    documented = {n.encode() for row in rows for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert names <= documented


def test_every_metric_and_stage_is_documented() -> None:
    text = page("metrics.md")
    families = list(WorkerMetrics().registry.collect())
    assert len(families) > 10
    for family in families:
        assert f"`{family.name}" in text, family.name
        assert family.documentation in text, family.name
    for stage in STAGES:
        assert f"| `{stage}` |" in text


def test_every_make_target_is_documented() -> None:
    text = page("make-targets.md")
    makefile = (ROOT / "Makefile").read_text()
    listed = set(re.findall(r"^([a-zA-Z0-9_-]+):.*## ", makefile, re.M))
    assert {t.name for t in make_page.targets(ROOT / "Makefile")} == listed
    for target in listed:
        assert f"## `make {target}`" in text


def test_every_command_is_documented() -> None:
    text = page("cli.md")
    for top, prog in ((cli_page.worker_command(), "python -m worker"),
                      (cli_page.producer_command(), "python -m producer")):  # fmt: skip
        for _, ctx in cli_page.walk(top, prog):
            assert f"### `{ctx.command_path}`" in text


def _outline(help_text: str) -> list[str]:
    """A --help's section headings and command names, in the order it prints them."""
    return re.findall(r"^(\S[^\n]*:)$|^  ([a-z][\w-]*) {2,}", help_text, flags=re.M)


def test_the_cli_page_shows_the_workers_help_as_it_prints_it() -> None:
    text = page("cli.md")
    block = text.split("### `python -m worker`\n\n```text\n", 1)[1].split("```", 1)[0]
    printed = ClickRunner().invoke(cli, ["--help"], prog_name="python -m worker")
    assert printed.exit_code == 0, printed.output
    # Each section where --help prints it (the settings' lines only a pointer to their page).
    assert _outline(block) == _outline(printed.output)
    assert "Worker settings (flags win over the environment):" in block
    assert "see Configuration" in block.split("Worker settings", 1)[1].split("\n\n", 1)[0]
    # Ahead of all of it, the commands: each a link to its own --help on the page.
    worker = text.split("## The worker", 1)[1].split("### ", 1)[0]
    for name, command in cli.commands.items():
        if command.hidden:  # a command that moved, kept only to say where
            continue
        assert f"[`python -m worker {name}`](#python-m-worker-{name})" in worker


def test_the_documented_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test     #" in README
    assert ci.strip().splitlines()[-1] == "make test"


def _squeeze(text: str) -> str:
    # Help text is wrapped (sometimes after a hyphen): compare without any whitespace.
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_worker_help_shows_every_setting_with_its_meaning(args: list[str]) -> None:
    result = ClickRunner().invoke(cli, args, prog_name="python -m worker")
    assert result.exit_code == 0, result.output
    shown = _squeeze(result.output)
    for entry in table.PUBLIC:
        flag = "--" + entry.name.replace("_", "-")
        assert flag in result.output, flag
        assert _squeeze(f"{table.plain(entry.help)} [env {entry.env};") in shown, entry.env
    # A tuning constant is no setting: no flag.
    for entry in table.TUNED:
        assert "--" + entry.name.replace("_", "-") not in result.output, entry.name
    assert result.output.count("--help") == 1
    if args == ["--help"]:
        for command in ("run", "demo", "doctor", "top"):
            assert re.search(rf"^\s+{command}\s", result.output, re.M), command


def _command_paths(top: object, prog: str) -> Iterator[list[str]]:
    for _, ctx in cli_page.walk(top, prog):
        yield ctx.command_path.split()[len(prog.split()) :]


# A Markdown link, or a page anchor such as `#priorities`, has no place in a terminal.
_MARKUP = re.compile(r"\]\(|(?<![\w&])#[a-z][a-z0-9-]*")


@pytest.mark.parametrize(
    "path", list(_command_paths(cli_page.worker_command(), "python -m worker")), ids=" ".join
)
def test_worker_help_is_plain_text(path: list[str]) -> None:
    result = ClickRunner().invoke(cli, [*path, "--help"], prog_name="python -m worker")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert _MARKUP.findall(result.output) == []


@pytest.mark.parametrize(
    "path", list(_command_paths(cli_page.producer_command(), "python -m producer")), ids=" ".join
)
def test_producer_help_is_plain_text(path: list[str]) -> None:
    result = ClickRunner().invoke(producer_app, [*path, "--help"], prog_name="gpufeed")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert _MARKUP.findall(result.output) == []


def test_a_link_in_a_meaning_is_plain_words_in_help() -> None:
    assert "[Priorities](priorities.md)" in table.BY_ENV["GPUFEED_PRIORITIES"].help
    assert table.plain(table.BY_ENV["GPUFEED_PRIORITIES"].help).endswith("See Priorities")
    assert "[Priorities](../priorities.md)" in page("configuration.md")


def test_the_cli_page_is_the_same_whatever_ran_before() -> None:
    # Click keeps a command's help option from the first context that asked for it: a
    # command invoked on its own first (as a tool or a test may) must not change the page.
    from worker import cli as worker_cli

    for name, command in worker_cli.cli.commands.items():
        result = ClickRunner().invoke(command, ["--help"], prog_name=name)
        assert result.exit_code == 0, result.output
        assert "-h, --help" in result.output, name
    assert (docs_gen.DOCS / "reference/cli.md").read_text() == docs_gen.PAGES["reference/cli.md"]()


def _heartbeat_commands() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Heartbeats and the log line", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")
def test_the_documented_heartbeat_commands_print_it_readably(redis_url: str) -> None:
    import msgpack
    import redis

    name = "gpu-host-1-gpu0"  # the worker the page names
    snap = {
        "name": name,
        "jobs_per_s": 12.5,
        "p50_ms": 41.2,
        "p99_ms": 97.5,
        "batch_fill": 0.75,
        "gpu_util_pct": 87.0,
        "in_flight": 7,
        "stage_ms": {"decode": 5.1, "compute": 18.0},
        "errors_by_code": {},
    }
    # As the worker writes it (worker.observe.observer.write_heartbeat, which imports torch):
    # the plain fields as text, the whole snapshot as msgpack.
    plain: dict[str, str | bytes] = {
        k: str(v) for k, v in snap.items() if not isinstance(v, dict | list)
    }
    plain["snapshot"] = msgpack.packb(snap, use_bin_type=True)
    redis.Redis.from_url(redis_url).hset(f"gpufeed:worker:{name}", mapping=plain)
    from tests.support.cli_runner import clean_env

    commands = _heartbeat_commands()
    assert any(c.startswith("python -m producer stats --json") for c in commands), commands
    env = clean_env()
    for command in commands:
        argv = shlex.split(command.split("#", 1)[0])
        if argv[0] == "redis-cli":
            done = subprocess.run(
                [argv[0], "-u", redis_url, *argv[1:]],
                env=env,
                capture_output=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, (command, done.stderr)
            output = done.stdout
        else:
            assert argv[:3] == ["python", "-m", "producer"], command
            ran = ClickRunner().invoke(producer_app, argv[3:], env={"REDIS_URL": redis_url})
            assert ran.exit_code == 0, (command, ran.output)
            output = ran.stdout_bytes
        # What a terminal shows: text, not msgpack's bytes.
        shown = output.decode("utf-8")
        if "stats" in argv:
            (worker,) = json.loads(shown)["workers"]
            assert worker["name"] == name
            assert worker["fields"]["snapshot"]["stage_ms"]["compute"] == 18.0
        elif "HMGET" in argv:
            assert shown.split() == ["12.5", "41.2", "97.5", "0.75", "87.0", "7"], shown
        else:
            assert shown.split() == [f"gpufeed:worker:{name}"], shown


NEWCOMER_PAGES = ("troubleshooting.md", "coming-from.md")


def _command(argv: list[str]) -> tuple[click.Command, list[str]] | None:
    """The click command a documented `python -m worker|producer ...` line runs, and the
    words after it; None for another program."""
    if argv[:2] != ["python", "-m"] or len(argv) < 3 or argv[2] not in ("worker", "producer"):
        return None
    command: click.Command = cli if argv[2] == "worker" else producer_app
    rest = argv[3:]
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


@pytest.mark.parametrize("name", NEWCOMER_PAGES)
def test_the_newcomer_pages_name_what_exists(name: str) -> None:
    from worker.observe.metrics import DELIVERY_EVENTS
    from worker.tools.doctor.verdict import VERDICTS

    text = (ROOT / "docs" / name).read_text()
    # In the site's navigation, so the strict build (tests/project/test_docs_site.py) checks
    # its links.
    assert re.search(rf"^  - [^:\n]+: {re.escape(name)}$", (ROOT / "mkdocs.yml").read_text(), re.M)
    settings = set(table.BY_ENV) | set(OTHER_VARIABLES)
    for setting in set(re.findall(r"\bGPUFEED_[A-Z0-9_]+\b", text)):
        assert setting in settings, f"{name}: {setting} is no setting"
    metrics = page("metrics.md")
    for metric in set(re.findall(r"`(gpufeed_[a-z_]+)", text)):
        assert f"`{metric}" in metrics, f"{name}: {metric} is no metric"
    for label, names in (("stage", STAGES), ("event", DELIVERY_EVENTS)):
        for value in re.findall(rf'{label}="(\w+)"', text):
            assert value in names, f"{name}: {label}={value}"
    for verdict in re.findall(r"^\| `([a-z-]+-bound|feed-starved|healthy)`", text, re.M):
        assert verdict in VERDICTS, f"{name}: verdict {verdict}"
    # Each command, and each of its options, is one the command takes.
    commands = re.findall(r"`(python -m [^`]+)`", text) + re.findall(
        r"^    (python -m .+?)(?:  +#.*)?$", text, re.M
    )
    assert commands
    for line in commands:
        found = _command(shlex.split(line))
        assert found is not None, line
        command, rest = found
        assert not isinstance(command, click.Group) or not rest, f"{name}: {line}"
        options = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        options |= {"--help", "-h"}
        for word in rest:
            if word.startswith("-"):
                assert word.split("=", 1)[0] in options, f"{name}: {line}: {word}"


def test_the_mapping_page_maps_tritons_batching_to_gpufeeds_settings() -> None:
    rows = (ROOT / "docs" / "coming-from.md").read_text().splitlines()
    for triton, setting in (
        ("max_queue_delay_microseconds", "GPUFEED_MAX_WAIT_MS"),
        # No setting: the shapes are measured at start-up (a tuning constant).
        ("preferred_batch_size", "`batch_sizes`"),
        ("instance_group", "GPUFEED_PROCESSES"),
        ("max_batch_size", "GPUFEED_BATCH_SIZE`"),
    ):
        (row,) = [r for r in rows if r.startswith("|") and triton in r.split(" | ")[0]]
        assert setting in row.split(" | ", 1)[1], row
