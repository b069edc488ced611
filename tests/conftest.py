from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
import structlog
from hypothesis import HealthCheck, settings

from tests.support.redis_server import RedisServer

# A suite started in the background by a shell without job control (`make test &`, a CI
# runner's script) inherits ^C ignored, and so would every process it starts: the tests that
# send a client ^C would wait on a process that cannot hear it. The suite takes ^C as a
# terminal gives it; its children then start with the default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if TYPE_CHECKING:
    from tests.support.worker_harness import HostShape

# Property tests: `make test` and CI draw the same examples on every run (derandomized, no
# local example database), so a submission fails only for what the code does; a property
# test that found something keeps that example as an explicit @example. `make fuzz`
# (HYPOTHESIS_PROFILE=fuzz) draws fresh ones to find the next such example.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    # Whether generation counts as slow depends on the host's load, not on the code.
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    derandomize=False,
    database=None,
    print_blob=True,
    deadline=None,
    max_examples=1000,  # tests that set their own count keep it; make fuzz runs them again
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A URL to an empty database on the session's private redis-server."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def sample_dir(tmp_path: Path) -> Path:
    d = tmp_path / "samples"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights for a small classifier, saved the way operators ship their own."""
    import torch
    from torchvision.models import get_model

    from worker.model.loader import save_weights_file

    torch.manual_seed(0)
    module = get_model("mobilenet_v3_small", weights=None, num_classes=10)
    path = tmp_path_factory.mktemp("weights") / "tiny.pt"
    save_weights_file(module, path, [f"class_{i}" for i in range(10)])
    return path


@pytest.fixture(scope="module", params=["small-host", "gpu-host"])
def host_shape(request: pytest.FixtureRequest) -> HostShape:
    """The end-to-end tests run in both shapes, whatever this host's cores: a small host's
    (decode threads, the intake and the result writer on the event loop) and a GPU host's
    (decode processes, the intake and the writer in processes of their own, packed rows,
    GPU decode through nvImageCodec). tests/support/worker_harness.py says how each is pinned and
    checked. Module-scoped, so that a module may share one worker per shape."""
    # Imported here: the harness imports the worker, which tests of other parts never need.
    from tests.support.worker_harness import HOST_SHAPES

    return HOST_SHAPES[request.param]


@pytest.fixture(autouse=True)
def _logging_configuration_restored() -> Iterator[None]:
    # A test that runs the CLI in-process configures structlog for the whole process (a
    # level filter of warning, say), which would hide the events a later test captures.
    config = structlog.get_config()
    yield
    structlog.configure(**config)
