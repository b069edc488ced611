from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

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
