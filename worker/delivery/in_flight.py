"""The in-flight places: how many jobs the worker holds between read and published result.

The worker holds a fixed number of places; a job holds one from the moment it is read (or
reclaimed) until its result is published. The reader asks Redis only for as many entries as
there are free places, the reclaimer sets some aside for stale jobs, and the fetch stage
lends a waiting job's place back meanwhile.
"""

from __future__ import annotations

import asyncio


def in_flight_places(batch_size: int, ring_slots: int) -> int:
    """The worker's places: a batch in each ring slot, one being gathered and one being
    published."""
    return batch_size * (ring_slots + 2)


class InFlight:
    """Counts jobs between read and published result; `room()` is what may be read now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        # Places set aside for stale jobs being reclaimed: new reads leave them free, so a
        # busy worker still takes over a dead one's jobs promptly.
        self.reserved = 0
        self._changed = asyncio.Event()

    def room(self) -> int:
        """Places free for new reads."""
        return self.limit - self.count - self.reserved

    def room_for_reclaim(self) -> int:
        return self.limit - self.count

    def reserve(self, n: int) -> None:
        self.reserved = max(0, min(n, self.limit))
        self._changed.set()

    def take(self, n: int) -> None:
        self.count += n

    def give_back(self, n: int) -> None:
        self.count -= n
        self._changed.set()

    async def wait_for_room(self) -> None:
        while self.room() <= 0:
            self._changed.clear()
            await self._changed.wait()

    async def wait_until_free(self, n: int, timeout_s: float) -> bool:
        """Wait until `n` places are free (reserved ones count); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.room_for_reclaim() < n:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True
