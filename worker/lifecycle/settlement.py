"""What a published outcome settles between the result writer and the reader.

A job read from a stream holds three things until its result is published: its entry among
the held ones (the keep-alive refreshes it, the reclaimer leaves it alone), an in-flight
place (the readers ask Redis for no more entries than there are free places) and, read
through the intake's process, a span of the payload memory its image bytes lie in. The
writer publishes on the event loop or hears back from its process; either way it hands the
outcomes here, and each of the three comes free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from worker.delivery.in_flight import InFlight
from worker.jobs import Job, Outcome
from worker.observe.observer import Observer


class PayloadSpans(Protocol):
    """Where a job's payload span comes free: its stream's intake (IntakeProcess)."""

    def release(self, span: int) -> None: ...


class Settlement:
    """The worker's held entries, and what publishing their outcomes gives back."""

    def __init__(
        self,
        in_flight: InFlight,
        intakes: Mapping[str, PayloadSpans],
        observer: Observer,
    ) -> None:
        # Entries read and not yet answered, by (job stream, entry ID): the readers add to
        # it, the keep-alive refreshes it. Two streams (priority levels, shards) may hold
        # the same entry ID.
        self.held: dict[tuple[str, str], Job] = {}
        self._in_flight = in_flight
        self._intakes = intakes
        self._observer = observer

    def on_published(self, outcomes: list[Outcome], states: list[int]) -> None:
        """The writer published `outcomes` (each with its state): their entries are no longer
        held, their payloads' memory may come free, and their in-flight places go back."""
        held, intakes = self.held, self._intakes
        for outcome in outcomes:
            job = outcome.job
            held.pop((job.stream, job.entry_id), None)
            if job.payload_span >= 0:
                # Its payload is no longer read by anyone: its memory may come free.
                intakes[job.stream].release(job.payload_span)
                job.payload_span = -1
        self._observer.published(outcomes, states)
        self._in_flight.give_back(len(outcomes))
