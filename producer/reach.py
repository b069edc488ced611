"""An unusable Redis in one line: away, or something other than Redis on its port."""

from __future__ import annotations

import redis
from redis.exceptions import InvalidResponse

# What a client gets when REDIS_URL leads nowhere usable; each is "exit 3" for the CLIs.
UNREACHABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    # An HTTP server, a database, a proxy's banner: it answered, but not in RESP.
    InvalidResponse,
    OSError,
)


def unreachable(url: str, exc: BaseException) -> str:
    """The operator's line for `exc` at `url` (already redacted)."""
    if isinstance(exc, InvalidResponse):
        return f"{url} is not a Redis server (it answered, but not as Redis does: {exc})"
    return f"cannot reach Redis at {url}: {exc}"
