"""`python -m worker` as an operator runs it: config errors, a real process, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import redis

from tests.support.cli_runner import clean_env, run_module
from tests.support.images import jpeg_bytes
from tests.support.redis_server import free_port
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return run_module("worker", *args, env=env, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--batch-size", "lots"], {}, "'lots' is not a valid integer"),
        ([], {"GPUFEED_BATCH_SIZE": "lots"}, "GPUFEED_BATCH_SIZE: expected an integer"),
        ([], {"GPUFEED_DEVICE": "tpu"}, "GPUFEED_DEVICE: must be auto, cpu, cuda or cuda:N"),
        ([], {"GPUFEED_COMPILE": "fast"}, "GPUFEED_COMPILE: must be one of off, auto"),
        ([], {"REDIS_URL": "http://localhost"}, "REDIS_URL: must start with redis://"),
        ([], {"GPUFEED_PATH_ROOT": "/no/such/dir"}, "GPUFEED_PATH_ROOT: /no/such/dir is not"),
    ],
)
def test_config_errors_give_one_clear_line(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    proc = run_worker(*args, env=env, timeout=60)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    if not args:  # our own messages are exactly one line
        assert len(proc.stderr.strip().splitlines()) == 1


def importtime_modules(stderr: str) -> tuple[set[str], list[str]]:
    """`python -X importtime`'s report split off stderr: the modules imported, and the
    other lines (what the operator sees)."""
    imported: set[str] = set()
    lines: list[str] = []
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            imported.add(line.rsplit("|", 1)[-1].strip())
        else:
            lines.append(line)
    return imported, lines


def run_worker_importtime(
    *args: str, env: dict[str, str], cwd: Path = ROOT
) -> tuple[subprocess.CompletedProcess[str], set[str], list[str]]:
    """The real command under `python -X importtime`, which lists every module imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "worker", *args],
        cwd=cwd,
        env={**clean_env(**env), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    imported, lines = importtime_modules(proc.stderr)
    assert "worker.cli" in imported  # the report is there: its absence proves nothing
    return proc, imported, lines


@pytest.mark.parametrize("processes", ["1", "2"])
def test_no_wait_with_redis_down_exits_3_in_one_line_before_torch(processes: str) -> None:
    port = free_port()
    proc, imported, lines = run_worker_importtime(
        "--no-wait",
        env={
            "REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "GPUFEED_LOG_FORMAT": "json",
            # A supervisor checks before it starts any worker process.
            "GPUFEED_PROCESSES": processes,
        },
    )
    assert proc.returncode == 3, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gpufeed: cannot reach Redis at redis://127.0.0.1:{port}/0")
    assert "make run-redis" in lines[0] and "REDIS_URL" in lines[0]
    assert "torch" not in imported and "torchvision" not in imported
    # No worker started, so none is said to shut down or stop.
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("model", "hint"),
    [
        ("resnet5", "did you mean resnet50"),
        ("nul", "did you mean null?"),
        ("my-embedder", "did you mean `./my-embedder`?"),
    ],
)
def test_a_wrong_model_name_gets_a_hint_before_redis_and_torch(
    model: str, hint: str, tmp_path: Path
) -> None:
    (tmp_path / "my-embedder").mkdir()
    # Redis is down: the name is checked first, and without importing torch.
    proc, imported, lines = run_worker_importtime(
        "--no-wait",
        env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "GPUFEED_MODEL": model},
        cwd=tmp_path,
    )
    assert proc.returncode == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gpufeed: GPUFEED_MODEL: unknown model {model!r}; {hint}")
    # The full list only on request.
    assert "mobilenet_v3_small" not in lines[0]
    assert "torch" not in imported


def test_a_model_name_in_another_case_is_the_model() -> None:
    proc, _, lines = run_worker_importtime(
        "--no-wait",
        env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "GPUFEED_MODEL": "Resnet18"},
    )
    # Accepted as resnet18: what stops it is Redis, the next check.
    assert proc.returncode == 3, lines
    assert "cannot reach Redis" in lines[0]
    config = WorkerConfig.load(env={"GPUFEED_MODEL": "MobileNet_V3_Small"})
    assert config.model == "mobilenet_v3_small"


def test_model_list_prints_every_torchvision_model_on_request() -> None:
    proc = run_worker("model", "list", timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()
    assert "resnet50" in names and "mobilenet_v3_small" in names and "vit_b_16" in names
    assert names == sorted(names)


@pytest.mark.slow
def test_bad_weights_name_lists_the_valid_ones() -> None:
    proc = run_worker(
        env={
            "GPUFEED_MODEL": "resnet18",
            "GPUFEED_WEIGHTS": "IMAGENET9K",
            "GPUFEED_LOG_LEVEL": "error",
        }
    )
    assert proc.returncode == 2
    assert "IMAGENET1K_V1" in proc.stderr and "none" in proc.stderr


def test_dead_redis_with_no_wait_exits_with_a_clear_message(tiny_weights: Path) -> None:
    port = free_port()
    proc = run_worker(
        "--no-wait",
        env={
            "REDIS_URL": f"redis://gpufeed:s3cret@127.0.0.1:{port}/0",
            "GPUFEED_MODEL": "mobilenet_v3_small",
            "GPUFEED_WEIGHTS": str(tiny_weights),
            "GPUFEED_INPUT_SIZE": "64",
            "GPUFEED_LOG_FORMAT": "json",
        },
    )
    assert proc.returncode == 3
    assert f"cannot reach Redis at redis://gpufeed:***@127.0.0.1:{port}/0" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout
    # Redis is checked first: the model was never loaded, no worker started or stopped.
    assert len(proc.stderr.strip().splitlines()) == 1
    assert '"event"' not in proc.stderr


@pytest.fixture
def not_redis() -> Iterator[int]:
    """A loopback port where an HTTP server, not Redis, answers."""
    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_that_is_not_redis_is_said_so_with_exit_3(not_redis: int) -> None:
    proc = run_worker(
        "--no-wait",
        env={
            "REDIS_URL": f"redis://127.0.0.1:{not_redis}/0",
            "GPUFEED_MODEL": "null",
            "GPUFEED_DEVICE": "cpu",
            "GPUFEED_LOG_LEVEL": "error",
        },
    )
    assert proc.returncode == 3, proc.stderr
    assert f"redis://127.0.0.1:{not_redis}/0 is not a Redis server" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # The other command-line tools say the same, with their exit 3.
    env = {"REDIS_URL": f"redis://127.0.0.1:{not_redis}/0"}
    for module, args in (("producer", ["stats"]), ("worker", ["top", "--once"])):
        tool = run_module(module, *args, env=env, timeout=60)
        assert tool.returncode == 3, (module, tool.stderr)
        assert "is not a Redis server" in tool.stderr and "Traceback" not in tool.stderr


def test_a_waiting_worker_still_refuses_unusable_keys_before_the_model(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The results stream is a string: no result could ever be written. Refused in a second,
    # before torch, even by a worker that would wait for Redis to come up.
    redis_client.set("gpufeed:results", "not a stream")
    proc, imported, lines = run_worker_importtime(
        env={"REDIS_URL": redis_url, "GPUFEED_LOG_LEVEL": "error"}
    )
    assert proc.returncode == 2, lines
    assert "Redis keys this worker must write are unusable" in lines[0]
    assert "torch" not in imported


def test_config_precedence_flags_over_env_over_defaults() -> None:
    config = WorkerConfig.load(
        env={"GPUFEED_BATCH_SIZE": "16", "GPUFEED_MODEL": "resnet18"},
        overrides={"batch_size": 32},
    )
    assert config.batch_size == 32
    assert config.model == "resnet18"
    assert config.stream == "gpufeed:jobs"
    with pytest.raises(ConfigError, match="GPUFEED_TOP_K"):
        WorkerConfig.load(env={"GPUFEED_TOP_K": "0"})


@contextmanager
def worker_process(
    env: dict[str, str], *, own_group: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """`python -m worker` with `env`, its output captured; killed on the way out if a test
    left it running. `own_group`: in a process group of its own, as a terminal or a service
    manager starts it, so a signal can go to the group."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("decode_processes", ["0", "2"], ids=["decode-threads", "decode-processes"])
def test_a_real_worker_process_answers_and_drains_on_sigterm(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, decode_processes: str
) -> None:
    """With decode processes the signal goes to the whole process group (a terminal's
    Ctrl-C, systemd's stop): the decode processes must outlive it until the drain ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    env.update(
        {
            "REDIS_URL": redis_url,
            "GPUFEED_MODEL": "mobilenet_v3_small",
            "GPUFEED_WEIGHTS": str(tiny_weights),
            "GPUFEED_INPUT_SIZE": "64",
            "GPUFEED_BATCH_SIZE": "4",
            "GPUFEED_LOG_FORMAT": "json",
            "GPUFEED_WORKER_NAME": "cli-worker",
            "GPUFEED_DECODE_PROCESSES": decode_processes,
        }
    )
    group = decode_processes != "0"
    with worker_process(env, own_group=group) as proc:
        redis_client.xadd("gpufeed:jobs", {"id": "t1", "image": jpeg_bytes()})
        deadline = time.monotonic() + 90
        while not redis_client.exists("gpufeed:result:t1"):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no result from the worker process"
            time.sleep(0.1)
        # A burst, then SIGTERM at once: everything already read must still be answered.
        for i in range(12):
            redis_client.xadd("gpufeed:jobs", {"id": f"late-{i}", "image": jpeg_bytes(seed=i)})
        time.sleep(0.3)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert redis_client.hget("gpufeed:result:t1", "status") == b"ok"
    assert '"event": "stopped"' in stderr
    # Nothing read was dropped: every entry is either answered or still unread/pending
    # for the group (and so available to other workers).
    answered = redis_client.xlen("gpufeed:results")
    pending = redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"]
    group = redis_client.xinfo_groups("gpufeed:jobs")[0]
    unread = group["lag"] if group["lag"] is not None else 0
    assert pending == 0
    assert answered + unread == 13
    # Answered means answered well: no row lost to a decoder stopped by the signal, and no
    # decode process ended before the drain did.
    statuses = {f[b"status"] for _, f in redis_client.xrange("gpufeed:results")}
    assert statuses == {b"ok"}, stderr
    assert "decode_process_replaced" not in stderr


def test_sigterm_while_starting_exits_cleanly(redis_url: str, tiny_weights: Path) -> None:
    """A worker stopped while it still imports torch and loads its model (a scale-down
    right after a scale-up) exits 0 like a drained one, not killed by the signal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    env.update(
        {
            "REDIS_URL": redis_url,
            "GPUFEED_MODEL": "mobilenet_v3_small",
            "GPUFEED_WEIGHTS": str(tiny_weights),
            "GPUFEED_LOG_FORMAT": "json",
        }
    )
    with worker_process(env) as proc:
        # Importing torch alone takes seconds: the signal arrives long before serving.
        time.sleep(0.8)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr


async def test_a_worker_whose_start_up_failed_is_not_said_to_stop(tiny_weights: Path) -> None:
    # In-process (the tools' way): Redis down with --no-wait's checks; the one error is
    # what is said, no "shutting_down"/"stopped" for a worker that never served.
    import structlog.testing

    from tests.support.worker_harness import tiny_config
    from worker.lifecycle.service import RedisUnavailable, Worker

    worker = Worker(tiny_config(f"redis://127.0.0.1:{free_port()}/0", tiny_weights))
    with structlog.testing.capture_logs() as logs, pytest.raises(RedisUnavailable):
        await worker.serve(wait_for_redis=False, install_signals=False)
    events = [entry["event"] for entry in logs]
    assert "starting" in events
    assert "shutting_down" not in events and "stopped" not in events
