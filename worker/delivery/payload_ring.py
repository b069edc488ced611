"""Where the intake's process may put the next read's image payloads, and when it may reuse
that memory.

The payload memory (worker/decode/payloads.py) is used as a ring: each read's
payloads take one contiguous span, after the span of the read before. A span comes free
once every job it holds has had its result published; the ring reuses memory in the order
it handed it out, so a span that frees early waits for the older ones before its memory
is offered again. A job held long (its batch stalled behind a Redis outage) therefore
narrows what later reads may use; a payload that does not fit the region offered travels
through the socket as bytes instead, so a full ring slows the intake, never stops it.

The worker's process keeps this ring, not the intake's process: the intake can be killed
and replaced at any moment and the spans still holding jobs stay exactly where they are.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

# Span ids are unique across every ring of the worker (one ring per shard).
_SPAN_IDS = itertools.count(1)


@dataclass(eq=False)
class Span:
    start: int
    end: int
    left: int  # jobs of the span whose result is not yet published


class PayloadRing:
    """A ring over [lo, hi) of the payload memory."""

    def __init__(self, lo: int, hi: int) -> None:
        if not 0 <= lo < hi:
            raise ValueError(f"a payload ring needs lo < hi (got {lo}, {hi})")
        self.lo = lo
        self.hi = hi
        self._order: deque[int] = deque()  # span ids, oldest first
        self._spans: dict[int, Span] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes between the oldest span still holding a job and the newest span's end."""
        if not self._order:
            return 0
        first = self._spans[self._order[0]].start
        last = self._spans[self._order[-1]].end
        return last - first if last > first else (self.hi - first) + (last - self.lo)

    def offer(self) -> tuple[int, int]:
        """The region [start, end) the next read may fill: free memory, contiguous."""
        if not self._order:
            return self.lo, self.hi
        tail = self._spans[self._order[0]].start  # oldest memory still held
        head = self._spans[self._order[-1]].end  # where the newest span ended
        if head > tail:
            # Spans lie in [tail, head): free from head to the end, and from the start up to
            # tail; the larger of the two.
            return (head, self.hi) if self.hi - head >= tail - self.lo else (self.lo, tail)
        # Wrapped: spans run from tail towards the end, then from the start up to head.
        return head, tail

    def taken(self, start: int, end: int, jobs: int) -> int:
        """A read put `jobs` payloads in [start, end) of the region it was offered: the span's
        id, which each of those jobs carries until its result is published; -1 when the read
        placed nothing."""
        if jobs <= 0 or end <= start:
            return -1
        # Not checked against a fresh offer: results published while the read ran may have
        # freed older spans and changed which region `offer` would pick now; what was
        # offered then is free still, since memory only comes free while a read runs.
        span_id = next(_SPAN_IDS)
        self._spans[span_id] = Span(start, end, jobs)
        self._order.append(span_id)
        return span_id

    def release(self, span_id: int) -> None:
        """One job of span `span_id` had its result published."""
        span = self._spans.get(span_id)
        if span is None:
            return
        span.left -= 1
        while self._order and self._spans[self._order[0]].left <= 0:
            del self._spans[self._order.popleft()]

    def owns(self, span_id: int) -> bool:
        return span_id in self._spans
