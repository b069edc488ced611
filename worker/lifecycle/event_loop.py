"""The event loop every command runs its coroutine in: uvloop where it is installed."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # noqa: PLC0415 - optional: not on every platform
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
