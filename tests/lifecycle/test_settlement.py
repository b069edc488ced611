"""What a published outcome settles (worker/lifecycle/settlement.py): its entry leaves the held
ones once, its in-flight place goes back to the readers, and the span of payload memory its
image lay in comes free once its last job is published, never twice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from producer.wire import ErrorCode
from worker.decode.payloads import PayloadMemory
from worker.delivery.in_flight import InFlight
from worker.delivery.intake_process import IntakeProcess
from worker.delivery.writer import PublishState
from worker.jobs import Job, Outcome, parse_job
from worker.lifecycle.settlement import Settlement
from worker.observe.observer import Observer

STREAM = "gpufeed:jobs"


@pytest.fixture
def memory() -> Iterator[PayloadMemory]:
    memory = PayloadMemory(1 << 16)
    yield memory
    memory.close()


@pytest.fixture
def intake(memory: PayloadMemory) -> IntakeProcess:
    # Never started: the ring of payload spans lives in the worker's process.
    return IntakeProcess(
        url="redis://127.0.0.1:1",
        group="g",
        consumer="c",
        connect_timeout_s=1.0,
        memory_fd=memory.fd,
        view=memory.view,
        region=(0, memory.size),
    )


def _read(
    settlement: Settlement, in_flight: InFlight, n: int, *, stream: str = STREAM
) -> list[Job]:
    """`n` entries read as the reader reads them: held, each in a place of its own."""
    jobs = []
    for i in range(n):
        job = parse_job(f"{i + 1}-0", {b"id": f"j{i}".encode(), b"image": b"x"}, "results")
        job.stream = stream
        settlement.held[(stream, job.entry_id)] = job
        jobs.append(job)
    in_flight.take(n)
    return jobs


def _in_span(intake: IntakeProcess, jobs: list[Job]) -> int:
    """The jobs' payloads put in one read's span of the payload memory."""
    start, end = intake.ring.offer()
    span = intake.ring.taken(start, start + 100 * len(jobs), len(jobs))
    assert start + 100 * len(jobs) <= end
    for job in jobs:
        job.payload_span = span
    return span


def _ok(jobs: list[Job]) -> tuple[list[Outcome], list[int]]:
    return [Outcome(job=j, ok=True) for j in jobs], [PublishState.PUBLISHED] * len(jobs)


def _observer() -> Observer:
    return Observer(worker_name="w", batch_size=4, stats_interval_s=60)


def test_published_outcomes_leave_the_held_entries_and_give_their_places_back() -> None:
    in_flight, observer = InFlight(8), _observer()
    settlement = Settlement(in_flight, {}, observer)
    jobs = _read(settlement, in_flight, 3)
    assert in_flight.room() == 5

    failed = Outcome.failure(jobs[2], ErrorCode.UNSUPPORTED_FORMAT, "not an image")
    outcomes, states = _ok(jobs[:2])
    settlement.on_published([*outcomes, failed], [*states, PublishState.PUBLISHED])

    assert settlement.held == {}
    assert in_flight.count == 0 and in_flight.room() == 8
    assert observer.counters.results_ok == 2
    assert observer.counters.errors_by_code == {"unsupported_format": 1}


def test_an_entry_is_released_once_and_the_others_stay_held() -> None:
    in_flight = InFlight(8)
    settlement = Settlement(in_flight, {}, _observer())
    jobs = _read(settlement, in_flight, 3)

    settlement.on_published(*_ok(jobs[:1]))
    assert sorted(settlement.held) == [(STREAM, "2-0"), (STREAM, "3-0")]
    # Published again (the writer retried a flush): nothing else leaves.
    settlement.on_published(*_ok(jobs[:1]))
    assert sorted(settlement.held) == [(STREAM, "2-0"), (STREAM, "3-0")]


def test_the_same_entry_id_on_two_streams_is_released_stream_by_stream() -> None:
    in_flight = InFlight(8)
    settlement = Settlement(in_flight, {}, _observer())
    (high,) = _read(settlement, in_flight, 1, stream="gpufeed:jobs:high")
    (low,) = _read(settlement, in_flight, 1, stream="gpufeed:jobs:low")
    assert high.entry_id == low.entry_id

    settlement.on_published(*_ok([high]))

    assert list(settlement.held) == [("gpufeed:jobs:low", low.entry_id)]
    assert in_flight.count == 1


def test_a_span_comes_free_with_its_last_job_and_only_once(intake: IntakeProcess) -> None:
    in_flight = InFlight(8)
    settlement = Settlement(in_flight, {STREAM: intake}, _observer())
    first = _read(settlement, in_flight, 2)
    span = _in_span(intake, first)
    later = _read(settlement, in_flight, 1)
    _in_span(intake, later)
    held_bytes = intake.ring.held_bytes

    settlement.on_published(*_ok(first[:1]))
    # The second job still reads its payload from the span, even when the first one's
    # outcome is published again: the span's memory is not offered to a new read.
    settlement.on_published(*_ok(first[:1]))
    assert intake.ring.owns(span)
    assert intake.ring.held_bytes == held_bytes
    assert first[0].payload_span == -1

    settlement.on_published(*_ok(first[1:]))
    assert not intake.ring.owns(span)
    assert intake.ring.held_bytes == 100
    settlement.on_published(*_ok(later))
    assert intake.ring.held_bytes == 0
    assert intake.ring.offer() == (0, intake.ring.hi)
