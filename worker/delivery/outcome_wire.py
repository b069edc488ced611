"""Outcomes as the result writer's process receives them: rows of plain values.

The worker hands a batch's outcomes to its writer process (worker/delivery/writer_process.py)
as one list of plain tuples, packed into its frame by one msgpack call, so the worker's own
Python per job is a tuple of attribute reads: the result fields, their msgpack map and the
publish call's arguments are built in the writer's process, under a GIL of its own. What
travels is what the result fields are made of, never the job's image bytes.
"""

from __future__ import annotations

from typing import Any

from producer.wire import ErrorCode
from worker.jobs import Job, Outcome
from worker.model.answers import Answer, Classification, Embedding, RawOutput

# The answer kinds by their index on the wire (a model answers with one of them).
_KINDS: tuple[type[Any], ...] = (Classification, Embedding, RawOutput)
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}
_CODES = {code.value: code for code in ErrorCode}

Row = tuple[Any, ...]


def outcome_rows(outcomes: list[Outcome]) -> list[Row]:
    """`outcomes` as rows that msgpack packs as they are (see `outcomes_of`)."""
    kinds = _KIND_INDEX
    return [
        (
            (j := o.job).entry_id, j.job_id, j.reply_to, j.meta, j.stream, j.level,
            j.has_own_id, j.timings_ms, o.ok,
            None if (a := o.answer) is None else (kinds[type(a)], a),
            None if (c := o.error_code) is None else c.value,
            o.error_message, o.extra, o.dead_fields,
        )
        for o in outcomes
    ]  # fmt: skip


def outcomes_of(rows: list[Row]) -> list[Outcome]:
    """The outcomes of `outcome_rows`, as msgpack unpacked them (`raw=False`), each with a
    job of its own that carries what its result is made of (no image bytes)."""
    out: list[Outcome] = []
    for row in rows:
        (
            entry_id, job_id, reply_to, meta, stream, level, has_own_id, timings, ok, answer,
            code, message_text, extra, dead,
        ) = row  # fmt: skip
        job = Job(
            entry_id=entry_id,
            job_id=job_id,
            reply_to=reply_to,
            meta=meta,
            image=None,
            path=None,
            timings_ms=timings,
            has_own_id=has_own_id,
            stream=stream,
            level=level,
        )
        out.append(
            Outcome(
                job=job,
                ok=ok,
                answer=None if answer is None else _answer(answer),
                error_code=None if code is None else _CODES.get(code, ErrorCode.INTERNAL_ERROR),
                error_message=message_text,
                extra=extra,
                dead_fields=dead,
            )
        )
    return out


def _answer(packed: list[Any]) -> Answer:
    kind, fields = packed
    answer: Answer = _KINDS[kind](*fields)
    return answer
