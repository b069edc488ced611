"""Exponential back-off: the wait before the next try, growing after each failure.

One for every loop that retries (the producer's admission waits, the worker's reads,
writes, Redis waits and child restarts), each with its own numbers. Here in producer/,
which imports neither torch nor worker/, so that both sides can use it.
"""

from __future__ import annotations

import asyncio


class Backoff:
    """Waits of `min_s`, then `factor` times longer each, up to `max_s`; `reset()` starts
    again from `min_s` (after a success)."""

    def __init__(self, min_s: float, max_s: float, factor: float = 2.0) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.factor = factor
        # The wait the next failure gets.
        self.delay_s = min_s

    def next(self) -> float:
        """The wait for this failure; the next one waits longer."""
        delay = self.delay_s
        self.delay_s = min(delay * self.factor, self.max_s)
        return delay

    def reset(self) -> None:
        self.delay_s = self.min_s

    async def sleep(self) -> None:
        """Wait this failure's time."""
        await asyncio.sleep(self.next())
