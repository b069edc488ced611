"""The one table of settings (worker/config/table.py): `WorkerConfig` has a field per entry
and nothing else, the operator sees at most 50 settings, a former setting is refused with
the line that names what replaced it, and GPUFEED_TUNING is checked as settings are."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.support.cli_runner import run_module
from worker.base.errors import ConfigError
from worker.config import table, tuning
from worker.config.settings import WorkerConfig, tuning_text
from worker.lifecycle.supervisor import child_env

FIELDS = dataclasses.fields(WorkerConfig)


def test_each_field_is_one_entry_of_the_table_and_each_entry_a_field() -> None:
    fields = {f.name: f for f in FIELDS}
    assert sorted(set(fields) - set(table.BY_NAME)) == [], "a field without a table entry"
    assert sorted(set(table.BY_NAME) - set(fields)) == [], "a table entry without a field"
    for entry in table.SETTINGS:
        f = fields[entry.name]
        assert str(f.type) == entry.type_name, entry.name
        assert f.default == entry.default, entry.name


def test_the_defaults_are_valid_and_load_as_written() -> None:
    config = WorkerConfig.load(env={})
    for entry in table.SETTINGS:
        if entry.name not in ("worker_name", "consumer_expiry_s"):
            assert getattr(config, entry.name) == entry.default, entry.name
    assert tuning_text(config) == ""


def test_an_operator_has_at_most_fifty_settings() -> None:
    assert len(table.PUBLIC) <= 50
    assert len(table.BY_ENV) == len(table.PUBLIC), "two entries share a variable"


def test_each_tuning_constant_is_tunings_value_and_no_setting() -> None:
    for entry in table.TUNED:
        assert entry.default == getattr(tuning, entry.constant), entry.name
        assert f"GPUFEED_{entry.constant}" in table.REMOVED_SETTINGS
    constants = {name for name in vars(tuning) if name.isupper()}
    assert constants == {entry.constant for entry in table.TUNED}


@pytest.mark.parametrize(("var", "line"), sorted(table.REMOVED_SETTINGS.items()))
def test_a_removed_setting_stops_the_worker_naming_what_replaced_it(var: str, line: str) -> None:
    proc = run_module("worker", "--no-wait", env={var: "1"}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"gpufeed: {var} is no longer a setting: {line}"]
    assert "tuning.py" in line or "GPUFEED_DECODE_PROCESSES" in line


def test_the_refusal_comes_before_any_other_setting_is_read() -> None:
    with pytest.raises(ConfigError, match=r"^GPUFEED_RING_SLOTS is no longer a setting: "):
        WorkerConfig.load(env={"GPUFEED_RING_SLOTS": "4", "GPUFEED_BATCH_SIZE": "lots"})


def test_gpufeed_tuning_sets_constants_and_is_checked_as_settings_are() -> None:
    config = WorkerConfig.load(
        env={"GPUFEED_TUNING": "claim_interval_s=0.2, batch_sizes=1,4 ,dct_scaling=false"}
    )
    assert (config.claim_interval_s, config.batch_sizes, config.dct_scaling) == (0.2, "1,4", False)
    assert tuning_text(config) == "batch_sizes=1,4,dct_scaling=false,claim_interval_s=0.2"
    for raw, words in [
        ("claim_interval_s=0", "GPUFEED_TUNING claim_interval_s: must be positive"),
        ("ring_slots=many", "GPUFEED_TUNING ring_slots: expected an integer"),
        ("intake=thread", "GPUFEED_TUNING intake: must be one of auto, process, loop"),
        (
            "claim_interval=1",
            "'claim_interval' is no tuning constant (did you mean claim_interval_s?",
        ),
        ("batch_size=4", "GPUFEED_TUNING: batch_size is a setting: set GPUFEED_BATCH_SIZE"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            WorkerConfig.load(env={"GPUFEED_TUNING": raw})


def test_a_configs_fields_handed_on_keep_its_tuning_constants() -> None:
    # As the bench hands a base config's fields on, each constant among them by name.
    base = WorkerConfig.load(env={"GPUFEED_TUNING": "decode_threads=2"})
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(WorkerConfig)}
    assert WorkerConfig.load(env={}, overrides=values).decode_threads == 2
    values["decode_threads"] = 1
    assert WorkerConfig.load(env={}, overrides=values).decode_threads == 1


def test_the_consumer_expiry_follows_a_longer_visibility_timeout() -> None:
    assert WorkerConfig.load(env={}).consumer_expiry_s == tuning.CONSUMER_EXPIRY_S
    longer = WorkerConfig.load(env={"GPUFEED_VISIBILITY_TIMEOUT_S": "7200"})
    assert longer.consumer_expiry_s == 7200.0
    with pytest.raises(ConfigError, match="consumer_expiry_s: must be at least GPUFEED_VISIB"):
        WorkerConfig.load(env={"GPUFEED_TUNING": "consumer_expiry_s=10"})


def test_a_supervisors_children_get_its_tuning_constants() -> None:
    config = WorkerConfig.load(
        env={"GPUFEED_TUNING": "ring_slots=3"},
        overrides={"processes": 2, "worker_name": "w", "intake": "loop"},
    )
    env = child_env(config, 1, {})
    assert env["GPUFEED_TUNING"] == tuning_text(config) == "ring_slots=3,intake=loop"
    # Each setting under its own variable, the constants only in GPUFEED_TUNING.
    assert set(env) == {*table.BY_ENV, "GPUFEED_TUNING"}
    child = WorkerConfig.load(env=env)
    assert (child.ring_slots, child.intake, child.processes) == (3, "loop", 1)
    # All but what the supervisor sets per child: its name, its port, its decode processes.
    own = {"worker_name": "w", "processes": 2, "metrics_port": 0, "decode_processes": "auto"}
    assert dataclasses.replace(child, **own) == config


def test_a_child_gets_the_supervisors_tuning_not_its_environments() -> None:
    # The supervisor read GPUFEED_TUNING, then a flag set the constant back: the child must
    # not read the environment's value again.
    base = {"GPUFEED_TUNING": "ring_slots=9"}
    config = WorkerConfig.load(
        env=base, overrides={"processes": 2, "worker_name": "w", "ring_slots": 4}
    )
    env = child_env(config, 0, base)
    assert env["GPUFEED_TUNING"] == ""
    assert WorkerConfig.load(env=env).ring_slots == 4
