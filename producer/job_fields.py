"""The job fields' rules, one table both sides read.

A producer (`Job.fields`) refuses, before anything is sent, a job the workers would answer
`invalid_job`; a worker (worker/jobs.py `parse_job`) answers a job that came another way
(redis-cli, another language's client) with the same code and the same words. A rule
changed here changes both at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from producer import wire
from producer.wire import ErrorCode

# The fields a job gives its image by: exactly one of them.
SOURCES = ("image", "path", "url")
# A Unix time in milliseconds: ASCII digits only (str.isdigit() and int() also take
# superscripts, other scripts' digits and underscores), at most 20 of them so that int()
# never meets a number it refuses; ASCII white space around it.
_DEADLINE = re.compile(rb"\s*([0-9]{1,20})\s*")

Problem = tuple[ErrorCode, str]


@dataclass(frozen=True)
class FieldRule:
    """What one field's value must be. `limit`: its most bytes (None: no fixed limit; meta's
    is the worker's GPUFEED_MAX_META_BYTES); `text`: UTF-8; `blank`: spaces alone are a
    value (else only the empty string is refused); `hint`: said after the problem, how to
    put it right."""

    name: str
    limit: int | None = None
    over_code: ErrorCode = ErrorCode.INVALID_JOB
    text: bool = False
    blank: bool = False
    # The empty value is a value (meta: nothing to echo).
    empty: bool = False
    empty_code: ErrorCode = ErrorCode.INVALID_JOB
    hint: str = ""


RULES: dict[str, FieldRule] = {
    "id": FieldRule(
        "id",
        wire.MAX_ID_BYTES,
        ErrorCode.ID_TOO_LONG,
        text=True,
        blank=True,
        hint="leave it out to use the stream entry ID",
    ),
    "reply_to": FieldRule("reply_to", wire.MAX_REPLY_TO_BYTES, text=True),
    "url": FieldRule("url", wire.MAX_URL_BYTES, text=True),
    "path": FieldRule("path"),
    "image": FieldRule("image", empty_code=ErrorCode.EMPTY_IMAGE),
    "meta": FieldRule("meta", empty=True, hint="it is not echoed"),
}


def field_problem(
    name: str, raw: bytes | bytearray | memoryview, *, limit: int = 0
) -> Problem | None:
    """Why field `name`'s value `raw` breaks its rule, or None. `limit`: the most bytes
    where the rule has no fixed limit (meta: the worker's setting); 0: none."""
    rule = RULES[name]
    if rule.text:
        return text_field(name, raw)[1]
    return _size_problem(rule, len(raw), limit)


def text_field(name: str, raw: bytes | bytearray | memoryview) -> tuple[str, Problem | None]:
    """A text field's value, decoded once, and why it breaks its rule (then the value is
    ""): what the worker reads every job's id and reply_to with."""
    rule = RULES[name]
    problem = _size_problem(rule, len(raw), 0)
    if problem is not None:
        return "", problem
    try:
        text = (raw if isinstance(raw, bytes) else bytes(raw)).decode("utf-8")
    except UnicodeDecodeError:
        return "", (rule.empty_code, _said(rule, f"{name} is not valid UTF-8"))
    if not (text if rule.blank else text.strip()):
        return "", (rule.empty_code, _said(rule, f"{name} is empty"))
    return text, None


def _size_problem(rule: FieldRule, size: int, limit: int) -> Problem | None:
    most = rule.limit if rule.limit is not None else (limit or None)
    if most is not None and size > most:
        setting = " (GPUFEED_MAX_META_BYTES)" if rule.name == "meta" else ""
        return rule.over_code, _said(
            rule, f"{rule.name} is {size:,} bytes; at most {most:,} are allowed{setting}"
        )
    if size == 0 and not rule.empty and not rule.text:
        return rule.empty_code, _said(rule, f"{rule.name} is empty")
    return None


def _said(rule: FieldRule, problem: str) -> str:
    return f"{problem}; {rule.hint}" if rule.hint else problem


def sources_problem(given: Sequence[str]) -> Problem | None:
    """Why a job that gives the fields `given` of SOURCES does not give exactly one."""
    if len(given) == 1:
        return None
    if given:
        return ErrorCode.INVALID_JOB, (
            f"give exactly one of image, path or url, not {' and '.join(given)}"
        )
    return ErrorCode.INVALID_JOB, "give exactly one of image, path or url; the job has none"


DEADLINE_PROBLEM: Problem = (
    ErrorCode.INVALID_JOB,
    "deadline_ms is not a Unix time in milliseconds (a positive integer)",
)


def deadline_of(raw: bytes) -> int | None:
    """deadline_ms's value, or None when it is not a Unix time in milliseconds."""
    match = _DEADLINE.fullmatch(raw)
    if match is None:
        return None
    return deadline_in_range(int(match.group(1)))


def deadline_in_range(value: int) -> int | None:
    # Milliseconds since 1970 have 13 digits until 2286; seconds (10 digits) are a mistake
    # that would pass every job's deadline at once.
    return value if 10**12 <= value < 10**14 else None
