"""Input that a check accepts and a later step chokes on: job fields, settings and model
directories are each parsed by one function that returns a value or its own error, never
anything else. Property tests throw arbitrary bytes and Unicode at every job field, every
setting and gpufeed.toml; the end-to-end tests send poison jobs to a real worker on a real
redis-server, straight and through a dead worker's pending list.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from producer import wire
from producer.dead_letters import dead_letter
from producer.wire import ErrorCode, JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import running_worker
from worker import jobs
from worker.base.errors import ConfigError
from worker.cli import cli
from worker.config import table
from worker.config.settings import WorkerConfig
from worker.delivery.redis_check import preflight
from worker.jobs import Job, job_of_entry, parse_job
from worker.lifecycle.service import Worker
from worker.model.manifest import read_labels, read_manifest

SMALL = jpeg_bytes(64, 48)
GOOD_DEADLINE = b"4000000000000"  # in the year 2096
# deadline_ms values that str.isdigit() or int() takes: superscript, circled, Arabic-Indic
# and full-width digits, underscores, and a number int() refuses for its length.
POISON_DEADLINES = [
    "1800000000000\u00b2".encode(),
    "\u2460800000000000".encode(),
    ("\u0661\u0668" + "\u0660" * 11).encode(),
    ("\uff11\uff18" + "\uff10" * 11).encode(),
    b"1_800_000_000_000",
    b"9" * 5000,
    b"+1800000000000",
    b"\xff\xfe1800000000000",
    b"1800000000000\x00",
]
JOB_FIELDS = [getattr(wire, name) for name in dir(wire) if name.startswith("JOB_")]
REJECTIONS = {ErrorCode.INVALID_JOB, ErrorCode.ID_TOO_LONG, ErrorCode.EMPTY_IMAGE}
FAST = {"visibility_timeout_s": 1.0, "claim_interval_s": 0.3, "consumer_expiry_s": 1.0}


# --------------------------------------------------------------------------- job fields
def field_values() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.sampled_from([*POISON_DEADLINES, GOOD_DEADLINE, b"", b" 4000000000000 "]),
        st.integers(min_value=-(10**30), max_value=10**30).map(lambda n: str(n).encode()),
    )


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(JOB_FIELDS), st.binary(max_size=8)), field_values(), max_size=7
    )
)
def test_every_job_field_parses_to_a_job_or_a_rejection(fields: dict[bytes, bytes]) -> None:
    job = parse_job("1700000000000-0", fields, "gpufeed:results")
    assert job.entry_id == "1700000000000-0" and job.reply_to
    if job.rejected is not None:
        assert job.rejected[0] in REJECTIONS
        return
    assert sum(f in fields for f in (wire.JOB_IMAGE, wire.JOB_PATH, wire.JOB_URL)) == 1
    if wire.JOB_DEADLINE_MS in fields:
        assert job.deadline_ms is not None and 10**12 <= job.deadline_ms < 10**14
        assert fields[wire.JOB_DEADLINE_MS].strip().isdigit()
        assert fields[wire.JOB_DEADLINE_MS].strip().isascii()


@pytest.mark.parametrize("deadline", POISON_DEADLINES)
def test_a_poison_deadline_is_an_invalid_job(deadline: bytes) -> None:
    job = parse_job("1-0", {b"id": b"p", b"image": SMALL, b"deadline_ms": deadline}, "r")
    assert job.rejected is not None and job.rejected[0] is ErrorCode.INVALID_JOB
    assert "deadline_ms" in job.rejected[1] and job.job_id == "p"


def test_a_good_deadline_with_blanks_around_it_still_counts() -> None:
    job = parse_job("1-0", {b"image": SMALL, b"deadline_ms": b" 4000000000000\n"}, "r")
    assert job.rejected is None and job.deadline_ms == 4_000_000_000_000


def test_a_url_over_the_bound_is_refused_by_its_length_before_it_is_decoded() -> None:
    longest = b"http://h/" + b"a" * (wire.MAX_URL_BYTES - 9)
    assert parse_job("1-0", {b"id": b"u", b"url": longest}, "r").rejected is None
    # Not UTF-8 either: the length alone decides, so a huge field is never decoded.
    job = parse_job("1-0", {b"id": b"u", b"url": longest + b"\xff"}, "r")
    assert job.rejected is not None and job.rejected[0] is ErrorCode.INVALID_JOB
    assert f"at most {wire.MAX_URL_BYTES:,}" in job.rejected[1] and job.url is None


def test_an_entry_that_cannot_be_parsed_at_all_is_answered_invalid_job() -> None:
    # Not the mapping Redis hands over: parsing fails, the stage still gets a job to answer.
    job = job_of_entry("5-0", [(b"image", b"x")], "gpufeed:results")
    assert job.rejected == (ErrorCode.INVALID_JOB, "the job's fields could not be read")
    assert job.job_id == "5-0" and job.reply_to == "gpufeed:results"


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.binary(max_size=16), field_values(), max_size=8))
def test_a_dead_letter_with_any_fields_is_listed(fields: dict[bytes, bytes]) -> None:
    for key in (b"dead_deliveries", b"dead_at_ms"):
        fields.setdefault(key, b"9" * 5000)
    letter = dead_letter("1-0", fields)
    letter.to_dict()  # what `producer dead list --json` prints
    assert letter.deliveries is None or letter.deliveries >= 0


# --------------------------------------------------------------------------- settings
SETTING_NAMES = [str(s.env) for s in table.PUBLIC] + [table.TUNING_VARIABLE]
setting_text = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=24).map(os.fsdecode),  # a variable that is not UTF-8, as Python sees it
    st.sampled_from(["nan", "inf", "-inf", "1e400", "\u00b2", "cuda:\u00b2", "9" * 5000, "1_0"]),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SETTING_NAMES), setting_text)
@example("GPUFEED_PATH_ROOT", "9" * 5000)  # a name too long for the file system
@example("GPUFEED_MODEL", "./" + "m" * 5000)
@example("GPUFEED_DEGRADE_MODEL", "~no-such-user-here/m")
@example("GPUFEED_WEIGHTS", "~no-such-user-here/w.pt")
@example("GPUFEED_WEIGHTS", "w/" * 3000)
@example("GPUFEED_MODEL", "9" * 300)  # a bare name, yet looked up as a folder for the hint
def test_any_text_at_any_setting_is_a_value_or_one_config_error(name: str, raw: str) -> None:
    try:
        WorkerConfig.load(env={name: raw})
    except ConfigError as exc:
        assert "\n" not in str(exc)


# Every setting whose text the worker looks up on the file system, with what it needs beside.
PATH_SETTINGS = {
    "GPUFEED_MODEL": {},
    "GPUFEED_DEGRADE_MODEL": {"GPUFEED_DEGRADE_AFTER_S": "5"},
    "GPUFEED_WEIGHTS": {},
    "GPUFEED_PATH_ROOT": {},
}


def unusable_paths(tmp: Path) -> dict[str, str]:
    (tmp / "loop").symlink_to(tmp / "loop")
    return {
        "a bare name over the name limit": "9" * 300,
        "a name over the limit": str(tmp / ("m" * 300)),
        "a path over the limit": str(tmp / "/".join(["d" * 200] * 30)),
        "a name under a link loop": str(tmp / "loop" / "m"),
        "a link loop": str(tmp / "loop"),
    }


@pytest.mark.parametrize("var", sorted(PATH_SETTINGS))
def test_a_path_setting_the_file_system_cannot_look_up_is_one_line_naming_it(
    tmp_path: Path, var: str
) -> None:
    for what, text in unusable_paths(tmp_path).items():
        with pytest.raises(ConfigError) as err:
            WorkerConfig.load(env={var: text, **PATH_SETTINGS[var]})
        message = str(err.value)
        assert message.startswith(f"{var}: ") and "\n" not in message, (what, message)
        assert len(message) < 600, (what, message)


def test_a_unix_socket_path_longer_than_the_kernel_takes_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        WorkerConfig.load(env={"REDIS_URL": "unix:///run/" + "s" * 300})
    assert str(err.value) == (
        "REDIS_URL: is not a usable Redis URL: its socket path is 305 bytes, a Unix "
        "socket's at most 107"
    )


def test_a_worker_reaches_redis_over_a_unix_socket(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "redis", "--unixsocket", str(socket_path)).start()
    try:
        config = WorkerConfig.load(
            env={"REDIS_URL": f"unix://{socket_path}", "GPUFEED_MODEL": "null"}
        )
        asyncio.run(preflight(config, wait=False))  # ping, cluster mode, the keys it writes
    finally:
        server.stop()


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", min_size=1, max_size=24))
def test_an_unknown_gpufeed_variable_is_refused(suffix: str) -> None:
    name = "GPUFEED_" + suffix
    # A former setting is refused too, naming what replaced it
    # (tests/config/test_settings_table.py).
    known = set(SETTING_NAMES) | set(table.REMOVED_SETTINGS) | {"GPUFEED_WORKER_NAME_PREFIX"}
    if name in known or "SERVICE_" in name or "_PORT" in name:
        return
    with pytest.raises(ConfigError, match=f"^{name}: no such setting"):
        WorkerConfig.load(env={name: "1"})


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"GPUFEED_DEVICE": "cuda:\u00b2"}, "GPUFEED_DEVICE: must be auto, cpu, cuda or cuda:N"),
        ({"GPUFEED_BATCH_SIZE": "\u0663"}, "GPUFEED_BATCH_SIZE: expected an integer"),
        ({"GPUFEED_MAX_WAIT_MS": "nan"}, "GPUFEED_MAX_WAIT_MS: expected a finite number"),
        ({"GPUFEED_VISIBILITY_TIMEOUT_S": "inf"}, "GPUFEED_VISIBILITY_TIMEOUT_S: expected a"),
        ({"GPUFEED_STREAM": os.fsdecode(b"jobs\xff")}, "GPUFEED_STREAM: expected UTF-8 text"),
        ({"REDIS_URL": "redis://host:99999/0"}, "REDIS_URL: is not a usable Redis URL"),
        ({"REDIS_URL": "redis://host/0?colour=red"}, "REDIS_URL: is not a usable Redis URL"),
        ({"GPUFEED_PATH_ROOT": "~no-such-user-here/x"}, "GPUFEED_PATH_ROOT: expected a path"),
        # Numbers Redis would refuse at run time, on every publish or every reclaim.
        ({"GPUFEED_RESULT_TTL_S": "9" * 18}, "GPUFEED_RESULT_TTL_S: must be between"),
        ({"GPUFEED_VISIBILITY_TIMEOUT_S": "1e20"}, "GPUFEED_VISIBILITY_TIMEOUT_S: must be"),
        ({"GPUFEED_TUNING": "stats_interval_s=0"}, "GPUFEED_TUNING stats_interval_s: must be"),
        ({"GPUFEED_BATCHSIZE": "2"}, "did you mean GPUFEED_BATCH_SIZE?"),
        ({"gpufeed_top_k": "3"}, "did you mean GPUFEED_TOP_K?"),
        ({"GPUFEED_METRIC_PORT": "9100"}, "did you mean GPUFEED_METRICS_PORT?"),
    ],
)
def test_each_kind_of_bad_setting_is_named(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        WorkerConfig.load(env=env)
    assert words in str(err.value)


def test_flags_that_bypass_parsing_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="GPUFEED_TUNING claim_interval_s: must be a finite"):
        WorkerConfig.load(env={}, overrides={"claim_interval_s": float("inf")})


def test_names_kubernetes_and_the_scripts_put_in_the_environment_are_not_settings() -> None:
    env = {
        "GPUFEED_WORKER_NAME_PREFIX": "host-a",  # scripts/run-workers.sh
        "GPUFEED_SERVICE_HOST": "10.0.0.1",  # a Service named gpufeed
        "GPUFEED_PORT": "tcp://10.0.0.1:9100",
        "GPUFEED_PORT_9100_TCP_ADDR": "10.0.0.1",
        "GPUFEED_REDIS_SERVICE_PORT_REDIS": "6379",  # a Service named gpufeed-redis
    }
    assert WorkerConfig.load(env=env).batch_size == 0


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"GPUFEED_BATCHSIZE": "2"}, "GPUFEED_BATCHSIZE: no such setting (did you mean "),
        ({"GPUFEED_DEVICE": "cuda:\u00b2"}, "GPUFEED_DEVICE: must be auto, cpu, cuda or cuda:N"),
        ({"GPUFEED_MODEL": "9" * 300}, "GPUFEED_MODEL: unknown model '999"),
    ],
)
def test_a_bad_setting_stops_the_worker_with_one_line_and_exit_2(
    env: dict[str, str], words: str
) -> None:
    proc = run_module("worker", "--no-wait", env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


# --------------------------------------------------------------------------- gpufeed.toml
MODEL = '[model]\nfile = "model.pt2"\ninput_size = 32\n'


def model_dir(root: Path, toml: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.pt2").write_bytes(b"not read here")
    (root / "gpufeed.toml").write_text(toml, encoding="utf-8")
    return root


def refused(root: Path) -> str:
    with pytest.raises(ConfigError) as err:
        read_manifest(root)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600, message
    return message


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("mean = [nan, 0.5, 0.5]\nstd = [0.2, 0.2, 0.2]", "[preprocess] mean: every value"),
        ("mean = [0.5, 0.5, 0.5]\nstd = [0.2, inf, 0.2]", "[preprocess] std: every value"),
        ("mean = [0.5, 0.5, 0.5]\nstd = [0.2, nan, 0.2]", "[preprocess] std: every value"),
        ("mean = [-inf, 0.5, 0.5]\nstd = [0.2, 0.2, 0.2]", "[preprocess] mean: every value"),
        ("mean = [0.5, 0.5, 0.5]\nstd = [0.2, -0.2, 0.2]", "above 0"),
        ("mean = [0.5, 0.5, 0.5]\nstd = [0.2, 1e-300, 0.2]", "from 0.001 to 100"),
        ("mean = [124, 116, 104]\nstd = [58, 57, 57]", "[preprocess] mean"),  # 0..255 values
        (f"mean = [{'9' * 4000}, 0, 0]\nstd = [1, 1, 1]", "[preprocess] mean"),
    ],
)
def test_mean_and_std_must_be_finite_and_in_range(tmp_path: Path, pre: str, words: str) -> None:
    root = model_dir(tmp_path / "m", f'{MODEL}[preprocess]\n{pre}\n[output]\nkind = "embed"\n')
    assert words in refused(root)


def test_model_check_refuses_a_nan_mean(tmp_path: Path) -> None:
    pre = "[preprocess]\nmean = [nan, 0.5, 0.5]\nstd = [0.2, 0.2, 0.2]\n"
    root = model_dir(tmp_path / "m", f'{MODEL}{pre}[output]\nkind = "embed"\n')
    result = CliRunner().invoke(cli, ["model", "check", str(root), "--device", "cpu"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "[preprocess] mean: every value" in lines[0]


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ("[model]\nx = " + "[" * 5000 + "]" * 5000, "not valid TOML: arrays or tables nested"),
        (MODEL + "[output]\nkind = 'classify'\ntop_k = " + "7" * 5000, "not valid TOML"),
        (MODEL + "[output]\nkind = 'classify'\ntop_k = " + "7" * 4000, "[output] top_k"),
        (MODEL + '[output]\nkind = "classify"\n"a\\nb" = 1', "[output] 'a\\nb': unknown key"),
        (MODEL + "[output]\nkind = " + "[" * 200 + "]" * 200, "[output] kind: must be one of"),
    ],
)
def test_hostile_toml_is_one_line(tmp_path: Path, toml: str, words: str) -> None:
    assert words in refused(model_dir(tmp_path / "m", toml))


def test_a_worker_refuses_a_hostile_manifest_with_one_line_and_exit_2(tmp_path: Path) -> None:
    root = model_dir(tmp_path / "m", "[model]\nx = " + "[" * 5000 + "]" * 5000)
    proc = run_module("worker", "--no-wait", env={"GPUFEED_MODEL": str(root)}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nested too deep" in lines[0], proc.stderr


TOML_VALUES = st.recursive(
    st.one_of(
        st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-0.0", "true", "'classify'"]),
        st.integers().map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.text(max_size=20).map(lambda t: '"' + t.replace("\\", "").replace('"', "") + '"'),
    ),
    lambda inner: st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
    max_leaves=10,
)
TOML_KEYS = st.sampled_from(
    [
        *("file", "entry", "weights", "input_size", "name", "resize", "resize_size", "mean"),
        *("std", "kind", "activation", "top_k", "threshold", "normalize", "dtype", "labels", "x"),
    ]
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=200),
        st.lists(
            st.tuples(
                st.sampled_from(["model", "preprocess", "output", "model.args"]),
                st.lists(st.tuples(TOML_KEYS, TOML_VALUES), max_size=5),
            ),
            max_size=4,
        ).map(
            lambda tables: "".join(
                f"[{t}]\n" + "".join(f"{k} = {v}\n" for k, v in kv) for t, kv in tables
            )
        ),
    )
)
def test_any_gpufeed_toml_is_a_manifest_or_one_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = model_dir(Path(tmp) / "m", text)
        try:
            manifest = read_manifest(root)
        except ConfigError as exc:
            assert "\n" not in str(exc)
            return
    assert all(0.001 <= s <= 100 for s in manifest.preprocess.std)


# --------------------------------------------------------------------------- labels.txt
def test_labels_split_at_newlines_only(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_bytes("cat\r\ndog\x0cfish\nowl\u2028bird\nant\n".encode())
    assert read_labels(path) == ("cat", "dog\x0cfish", "owl\u2028bird", "ant")


def classify_dir(root: Path) -> Path:
    return model_dir(root, MODEL + '[output]\nkind = "classify"\n')


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "dangling", "huge"])
def test_a_labels_file_that_is_no_small_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    root = classify_dir(tmp_path / "m")
    labels = root / "labels.txt"
    if kind == "dev-zero":
        labels.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(labels)
    elif kind == "dangling":
        labels.symlink_to(root / "gone.txt")
    else:
        with labels.open("wb") as f:
            f.truncate(65 * 1024 * 1024)  # sparse: no disk written
    words = {
        "dev-zero": "not a regular file",
        "fifo": "not a regular file",
        "dangling": "cannot read it",
        "huge": "larger than",
    }[kind]
    # Refused with the manifest, before any model is loaded, and when it is read.
    for read in (read_manifest, read_labels):
        with pytest.raises(ConfigError) as err:
            read(root if read is read_manifest else labels)
        assert words in str(err.value) and "labels.txt" in str(err.value)


def test_a_worker_refuses_labels_linked_to_dev_zero_with_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    root = classify_dir(tmp_path / "m")
    (root / "labels.txt").symlink_to("/dev/zero")
    proc = run_module("worker", "--no-wait", env={"GPUFEED_MODEL": str(root)}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "labels.txt: not a regular file" in lines[0], proc.stderr


def test_a_manifest_linked_to_dev_zero_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "gpufeed.toml").symlink_to("/dev/zero")
    assert "not a regular file" in refused(root)


# --------------------------------------------------------------------------- a real worker
def results_by_entry(client: redis.Redis) -> dict[str, list[JobResult]]:
    out: dict[str, list[JobResult]] = {}
    for _, f in client.xrange("gpufeed:results"):
        r = JobResult.from_fields(f)
        out.setdefault(r.entry, []).append(r)
    return out


async def wait_answered(
    client: redis.Redis, worker: Worker, entries: list[str], timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while not set(entries) <= set(results_by_entry(client)):
        ended = [t.get_name() for t in worker._tasks.values() if t.done()]
        assert not ended, f"stage tasks ended: {ended}"
        assert time.monotonic() < deadline, "not every job was answered"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # room for a wrong second answer
    assert all(not t.done() for t in worker._tasks.values())


def poison_jobs() -> list[dict[bytes, bytes]]:
    jobs = [
        {b"id": b"poison-%d" % i, b"image": SMALL, b"deadline_ms": d}
        for i, d in enumerate(POISON_DEADLINES)
    ]
    # Number fields that are no UTF-8 next to a good image, and a reply_to that is no UTF-8.
    jobs.append({b"id": b"garbage-deadline", b"image": SMALL, b"deadline_ms": b"\xff\xfe\x00"})
    jobs.append({b"id": b"garbage-reply", b"image": SMALL, b"reply_to": b"\xc3\x28"})
    return jobs


async def test_poison_jobs_are_answered_once_and_the_good_ones_behind_them_served(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    poison, good = [], []
    for i, job in enumerate(poison_jobs()):
        poison.append(redis_client.xadd("gpufeed:jobs", job).decode())
        good.append(
            redis_client.xadd(
                "gpufeed:jobs", {"id": f"good-{i}", "image": SMALL, "deadline_ms": GOOD_DEADLINE}
            ).decode()
        )
    async with running_worker(redis_url, tiny_weights) as worker:
        await wait_answered(redis_client, worker, poison + good)
    answers = results_by_entry(redis_client)
    for entry in poison:
        assert [r.error_code for r in answers[entry]] == ["invalid_job"], answers[entry]
    for entry in good:
        assert [r.ok for r in answers[entry]] == [True], answers[entry]
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.slow
async def test_poison_in_a_dead_workers_pending_list_is_reclaimed_and_answered(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    poison = [redis_client.xadd("gpufeed:jobs", f).decode() for f in poison_jobs()]
    # A worker read them and died before answering: they sit in its pending list.
    redis_client.xreadgroup("gpufeed", "dead-worker", {"gpufeed:jobs": ">"})
    # One more that already killed its workers max_deliveries times: it is dead-lettered.
    worst = redis_client.xadd(
        "gpufeed:jobs", {"id": "worst", "image": SMALL, "deadline_ms": POISON_DEADLINES[0]}
    ).decode()
    redis_client.xreadgroup("gpufeed", "dead-worker", {"gpufeed:jobs": ">"})
    for _ in range(4):
        redis_client.xclaim("gpufeed:jobs", "gpufeed", "dead-worker", 0, [worst])
    good = [redis_client.xadd("gpufeed:jobs", {"image": SMALL}).decode() for _ in range(6)]
    await asyncio.sleep(1.1)  # past the visibility timeout
    async with running_worker(redis_url, tiny_weights, max_deliveries=5, **FAST) as worker:
        await wait_answered(redis_client, worker, [*poison, worst, *good])
    answers = results_by_entry(redis_client)
    counts = Counter({e: len(rs) for e, rs in answers.items()})
    assert counts == Counter({e: 1 for e in [*poison, worst, *good]})
    assert {answers[e][0].error_code for e in poison} == {"invalid_job"}
    assert answers[worst][0].error_code == "dead_letter"
    assert all(answers[e][0].ok for e in good)
    (dead,) = redis_client.xrange("gpufeed:dead")
    assert dead[1][b"deadline_ms"] == POISON_DEADLINES[0]
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.slow
async def test_a_parser_failure_ends_no_stage_the_entry_is_answered_invalid_job(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: should parse_job ever fail on an entry (a bug in it, a field it does
    not yet expect), the reader and the reclaimer still answer that entry."""
    real = jobs.parse_job

    def failing(
        entry_id: str, fields: dict[bytes, bytes], default_reply_to: str, max_meta_bytes: int
    ) -> Job:
        if b"boom" in fields:
            raise RuntimeError("a parser bug")
        return real(entry_id, fields, default_reply_to, max_meta_bytes)

    monkeypatch.setattr(jobs, "parse_job", failing)
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    held = redis_client.xadd("gpufeed:jobs", {"boom": "1", "image": SMALL}).decode()
    redis_client.xreadgroup("gpufeed", "dead-worker", {"gpufeed:jobs": ">"})  # for the reclaimer
    fresh = redis_client.xadd("gpufeed:jobs", {"boom": "2", "image": SMALL}).decode()
    good = [redis_client.xadd("gpufeed:jobs", {"image": SMALL}).decode() for _ in range(4)]
    await asyncio.sleep(1.1)  # past the visibility timeout
    async with running_worker(redis_url, tiny_weights, **FAST) as worker:
        await wait_answered(redis_client, worker, [held, fresh, *good])
    answers = results_by_entry(redis_client)
    assert [r.error_code for r in answers[held]] == ["invalid_job"]
    assert [r.error_code for r in answers[fresh]] == ["invalid_job"]
    assert all([r.ok for r in answers[e]] == [True] for e in good)
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0
