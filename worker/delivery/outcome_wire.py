"""Outcomes as the result writer's process receives them: rows of plain values.

The worker hands a batch's outcomes to its writer process (worker/delivery/writer_process.py)
as one list of plain tuples, packed into its frame by one msgpack call, so the worker's own
Python per job is a few attribute reads made in C: the result fields, their msgpack map and
the publish call's arguments are built in the writer's process, under a GIL of its own. What
travels is what the result fields are made of, never the job's image bytes.

Which fields cross, and in which order, is written once: `JOB_FIELDS` and `OUTCOME_FIELDS`,
by the Job's and the Outcome's own names, read and rebuilt by name on both sides. Every other
field of a Job (its own or its entry's, which it reads through) or an Outcome is named in
`JOB_LEFT` or `OUTCOME_LEFT`, with why it stays: tests/delivery/test_writer_process.py fails on a
field named in neither, so a field added to Job is either carried or left on purpose,
never dropped unseen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producer.wire import ErrorCode
from worker.jobs import Job, JobEntry, Outcome
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
# The job's fields (its own and its entry's) that stay in the worker: its bytes and where
# they came from (the result never holds them), the entry's own id and problem (the job's
# id, has_own_id and rejected, settled from them, are what the result is made of), and the
# stages' bookkeeping, done with before the outcome is made.
JOB_LEFT = frozenset(
    {
        "id",
        "problem",
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

# A row: JOB_FIELDS' values, OUTCOME_FIELDS' values, then the answer ((its kind's index,
# its fields) or None) and the error code's value (or None), flat.
Row = tuple[Any, ...]

# Both functions are written from the field lists once, at import (as dataclasses writes an
# __init__): the worker packs a batch with the bytecode of a hand-written tuple, one
# attribute read per field, and the order stands in one place.
_carried = [f"j.{name}" for name in JOB_FIELDS] + [f"o.{name}" for name in OUTCOME_FIELDS]
_names = [f"job_{name}" for name in JOB_FIELDS] + [f"outcome_{name}" for name in OUTCOME_FIELDS]
_SOURCE = f"""
def outcome_rows(outcomes):
    kinds = _KIND_INDEX
    return [
        (
            {", ".join(_carried)},
            None if (a := o.answer) is None else (kinds[type(a)], a),
            None if (c := o.error_code) is None else c.value,
        )
        for o in outcomes
        for j in (o.job,)
    ]


def outcomes_of(rows):
    out = []
    for {", ".join(_names)}, answer, code in rows:
        job = Job(
            JobEntry(job_entry_id, None, None, None, None, None),
            image=None,
            {", ".join(f"{n}=job_{n}" for n in JOB_FIELDS if n != "entry_id")},
        )
        out.append(
            Outcome(
                job=job,
                answer=None if answer is None else _answer(answer),
                error_code=None if code is None else _CODES.get(code, _INTERNAL_ERROR),
                {", ".join(f"{n}=outcome_{n}" for n in OUTCOME_FIELDS)},
            )
        )
    return out
"""


def _answer(packed: list[Any]) -> Answer:
    kind, fields = packed
    answer: Answer = _KINDS[kind](*fields)
    return answer


_written: dict[str, Any] = {
    "Job": Job,
    "JobEntry": JobEntry,
    "Outcome": Outcome,
    "_KIND_INDEX": _KIND_INDEX,
    "_CODES": _CODES,
    "_INTERNAL_ERROR": ErrorCode.INTERNAL_ERROR,
    "_answer": _answer,
}
exec(compile(_SOURCE, f"<{__name__}: rows>", "exec"), _written)

outcome_rows: Callable[[list[Outcome]], list[Row]] = _written["outcome_rows"]
outcome_rows.__doc__ = """`outcomes` as rows that msgpack packs as they are (see `outcomes_of`)."""
outcomes_of: Callable[[list[Row]], list[Outcome]] = _written["outcomes_of"]
outcomes_of.__doc__ = """The outcomes of `outcome_rows`, as msgpack unpacked them (`raw=False`),
each with a job of its own that carries what its result is made of (no image bytes)."""
