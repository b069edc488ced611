"""Outcomes as the result writer's process receives them: rows of plain values.

The worker hands a batch's outcomes to its writer process (worker/delivery/writer_process.py)
as one list of plain tuples, packed into its frame by one msgpack call, so the worker's own
Python per job is a few attribute reads made in C: the result fields, their msgpack map and
the publish call's arguments are built in the writer's process, under a GIL of its own. What
travels is what the result fields are made of, never the job's image bytes.

Which fields cross, and in which order, is written once: `JOB_FIELDS` and `OUTCOME_FIELDS`,
by the Job's and the Outcome's own names, read and rebuilt by name on both sides. Every other
field of a Job or an Outcome is named in `JOB_LEFT` or `OUTCOME_LEFT`, with why it stays:
tests/test_writer_process.py fails on a field named in neither, so a field added to Job
is either carried or left on purpose, never dropped unseen.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from producer.wire import ErrorCode
from worker.jobs import Job, Outcome
from worker.model.answers import Answer, Classification, Embedding, RawOutput

# The job's fields its result is made of, carried as they are.
JOB_FIELDS = (
    "entry_id",
    "job_id",
    "reply_to",
    "meta",
    "stream",
    "level",
    "has_own_id",
    "timings_ms",
)
# The job's fields that stay in the worker: its bytes and where they came from (the result
# never holds them), and the stages' bookkeeping, done with before the outcome is made.
JOB_LEFT = frozenset(
    {
        "image",
        "path",
        "url",
        "deadline_ms",
        "received_s",
        "ready_s",
        "cache_key",
        "cached_row",
        "rejected",
        "deliveries",
        "payload_at",
        "payload_span",
    }
)
# The outcome's fields carried as they are; `answer` and `error_code` cross converted (an
# answer kind's index and fields, a code's value) and `job` as JOB_FIELDS.
OUTCOME_FIELDS = ("ok", "error_message", "extra", "dead_fields")
# The writer's own bookkeeping, kept where it publishes.
OUTCOME_LEFT = frozenset({"refused_logged"})

# The answer kinds by their index on the wire (a model answers with one of them).
_KINDS: tuple[type[Any], ...] = (Classification, Embedding, RawOutput)
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}
_CODES = {code.value: code for code in ErrorCode}
_job_values = attrgetter(*JOB_FIELDS)
_outcome_values = attrgetter(*OUTCOME_FIELDS)

# (JOB_FIELDS' values, OUTCOME_FIELDS' values, (answer kind, answer) or None, code or None)
Row = tuple[Any, ...]


def outcome_rows(outcomes: list[Outcome]) -> list[Row]:
    """`outcomes` as rows that msgpack packs as they are (see `outcomes_of`)."""
    kinds = _KIND_INDEX
    return [
        (
            _job_values(o.job),
            _outcome_values(o),
            None if (a := o.answer) is None else (kinds[type(a)], a),
            None if (c := o.error_code) is None else c.value,
        )
        for o in outcomes
    ]


def outcomes_of(rows: list[Row]) -> list[Outcome]:
    """The outcomes of `outcome_rows`, as msgpack unpacked them (`raw=False`), each with a
    job of its own that carries what its result is made of (no image bytes)."""
    out: list[Outcome] = []
    for job_values, outcome_values, answer, code in rows:
        job = Job(image=None, path=None, **dict(zip(JOB_FIELDS, job_values, strict=True)))
        out.append(
            Outcome(
                job=job,
                answer=None if answer is None else _answer(answer),
                error_code=None if code is None else _CODES.get(code, ErrorCode.INTERNAL_ERROR),
                **dict(zip(OUTCOME_FIELDS, outcome_values, strict=True)),
            )
        )
    return out


def _answer(packed: list[Any]) -> Answer:
    kind, fields = packed
    answer: Answer = _KINDS[kind](*fields)
    return answer
