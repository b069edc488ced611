from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import structlog

from tests.redis_server import RedisServer


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


@pytest.fixture(autouse=True)
def _logging_configuration_restored() -> Iterator[None]:
    # A test that runs the CLI in-process configures structlog for the whole process (a
    # level filter of warning, say), which would hide the events a later test captures.
    config = structlog.get_config()
    yield
    structlog.configure(**config)
