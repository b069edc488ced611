"""Dead letters: reading them from their stream's entries, and planning their replay.

Nothing here does I/O: `Replay` is the list of commands one replay transaction sends.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from producer import wire
from producer.commands import Call, call
from producer.priorities import entry_ref, level_stream
from producer.replies import raw, text
from producer.tenants import names

# Dead letters replayed by `replay_dead(all=True)` per transaction: each holds its image.
REPLAY_CHUNK = 100
# A replay reads the dead-letter stream under WATCH; a worker adding a dead letter in
# between aborts the transaction, which is then simply run again.
REPLAY_ATTEMPTS = 10

# Deletes the keys given that hold a gpufeed result (a hash with `entry`), and nothing else:
# a dead letter's id may name any key under the result prefix. Returns how many it deleted.
DELETE_RESULTS = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' and redis.call('HGET', key, 'entry') then
    n = n + redis.call('DEL', key)
  end
end
return n
"""

# The fields a worker adds to a job's own fields when it copies it to the dead-letter stream.
DEAD_ENTRY = b"dead_entry"  # the job's entry ID in the job stream
DEAD_DELIVERIES = b"dead_deliveries"  # how many times it was delivered
DEAD_CONSUMER = b"dead_consumer"  # the consumer that had it last
DEAD_AT_MS = b"dead_at_ms"  # when it was dead-lettered, epoch milliseconds
DEAD_LEVEL = b"dead_level"  # its priority level (absent without priorities): replayed there
DEAD_TENANT = b"dead_tenant"  # its tenant (absent for the plain stream): replayed to its stream
DEAD_FIELDS = (DEAD_ENTRY, DEAD_DELIVERIES, DEAD_CONSUMER, DEAD_AT_MS, DEAD_LEVEL)

_ENTRY_ID = re.compile(r"[0-9]+-[0-9]+")
# A count or a time a worker wrote: ASCII digits only (int() also takes other scripts'
# digits, underscores and signs), few enough that int() never refuses them.
_NUMBER = re.compile(rb"[0-9]{1,19}")


class DeadLetterNotFound(LookupError):
    """`replay_dead` was given entry IDs that are not (or no longer) in the dead-letter stream;
    nothing was replayed. `missing` lists them."""

    def __init__(self, stream: str, missing: list[str]) -> None:
        super().__init__(f"no dead letter {', '.join(missing)} in {stream}")
        self.stream = stream
        self.missing = missing


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream: a job that kept killing or stalling its workers.

    `dead_id` is the entry's ID in the dead-letter stream (what `replay_dead` takes), `entry`
    the job's original entry ID in the job stream, and `id` the job id its results are stored
    under (its `id` field, or its entry reference where it has none: `entry`, or
    `<level>:<entry>` on a priority level). `level` is the priority level whose stream it
    came from (None without priorities); a replay puts it back there. Exactly one of
    `image_bytes` (the size of the encoded image) and `path` is set for a well-formed job.
    `fields` names the job's own fields, in order, as `replay_dead` would enqueue them again.
    """

    dead_id: str
    id: str
    entry: str
    deliveries: int | None
    consumer: str | None
    dead_at_ms: int | None
    image_bytes: int | None
    path: str | None
    reply_to: str | None
    has_meta: bool
    fields: tuple[bytes, ...] = field(default=(), repr=False)
    level: str | None = None

    @property
    def dead_at(self) -> datetime | None:
        """When the job was dead-lettered (UTC), if the entry says."""
        if self.dead_at_ms is None:
            return None
        try:
            return datetime.fromtimestamp(self.dead_at_ms / 1000, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            return None  # past year 9999: not a time a worker wrote

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view; `dead_at` in ISO 8601, UTC."""
        at = self.dead_at
        return {
            "dead_id": self.dead_id,
            "id": self.id,
            "entry": self.entry,
            "deliveries": self.deliveries,
            "consumer": self.consumer,
            "dead_at_ms": self.dead_at_ms,
            "dead_at": None if at is None else iso_utc(at),
            "image_bytes": self.image_bytes,
            "path": self.path,
            "reply_to": self.reply_to,
            "has_meta": self.has_meta,
            "level": self.level,
            "fields": [f.decode("utf-8", "backslashreplace") for f in self.fields],
        }


def iso_utc(at: datetime) -> str:
    """`at` as ISO 8601 in UTC with milliseconds and a `Z`."""
    return at.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _norm(fields: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """Stream entry fields with bytes keys and values, in the entry's order."""
    return {raw(k): raw(v) for k, v in fields.items()}


def _job_fields(fields: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """A dead letter's fields less those the worker added: the job exactly as enqueued."""
    return {k: v for k, v in fields.items() if k not in DEAD_FIELDS}


def _own_id(fields: Mapping[bytes, bytes]) -> str | None:
    """The job's `id` where a worker would honour it (the worker's rule), else None."""
    value = fields.get(wire.JOB_ID)
    if not value or len(value) > wire.MAX_ID_BYTES:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _opt_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "backslashreplace")


def _opt_int(value: bytes | None) -> int | None:
    if value is None or _NUMBER.fullmatch(value) is None:
        return None
    return int(value)


def dead_letter(dead_id: str, raw_fields: Mapping[Any, Any]) -> DeadLetter:
    """The dead letter in the dead-letter stream's entry `dead_id`."""
    fields = _norm(raw_fields)
    entry = _opt_text(fields.get(DEAD_ENTRY)) or ""
    level = _opt_text(fields.get(DEAD_LEVEL))
    image = fields.get(wire.JOB_IMAGE)
    return DeadLetter(
        dead_id=dead_id,
        id=_own_id(fields) or entry_ref(level or "", entry),
        level=level,
        entry=entry,
        deliveries=_opt_int(fields.get(DEAD_DELIVERIES)),
        consumer=_opt_text(fields.get(DEAD_CONSUMER)),
        dead_at_ms=_opt_int(fields.get(DEAD_AT_MS)),
        image_bytes=None if image is None else len(image),
        path=_opt_text(fields.get(wire.JOB_PATH)),
        reply_to=_opt_text(fields.get(wire.JOB_REPLY_TO)),
        has_meta=wire.JOB_META in fields,
        fields=tuple(_job_fields(fields)),
    )


def replay_selection(entry_ids: Sequence[str] | None, all: bool) -> list[str] | None:
    """The entry IDs to replay (deduplicated, in order), or None for all of them."""
    if all:
        if entry_ids:
            raise ValueError("give either entry IDs or all=True, not both")
        return None
    if entry_ids is None:
        raise ValueError("give the dead letters' entry IDs, or all=True")
    if isinstance(entry_ids, str):
        raise TypeError("entry_ids is a list of entry IDs, not one string")
    ids = list(dict.fromkeys(entry_ids))
    bad = [i for i in ids if not _ENTRY_ID.fullmatch(i)]
    if bad:
        raise ValueError(f"not a stream entry ID (ms-seq): {', '.join(map(repr, bad))}")
    return ids


@dataclass
class Replay:
    """What replaying some dead letters writes, worked out before the transaction."""

    dead_ids: list[str] = field(default_factory=list)
    jobs: list[dict[bytes, bytes]] = field(default_factory=list)
    # Each job's priority level ("" without priorities): it goes back to that stream.
    levels: list[str] = field(default_factory=list)
    # Each job's tenant ("": the plain stream): it goes back to the tenant's own stream.
    tenants: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    reply_to: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls, entries: Iterable[tuple[str, Mapping[Any, Any]]], result_prefix: str
    ) -> tuple[Replay, list[str]]:
        """The plan for `entries`, and the IDs of those with no job fields to replay."""
        plan, empty = cls(), []
        for dead_id, raw_fields in entries:
            fields = _norm(raw_fields)
            job = _job_fields(fields)
            if not job:
                empty.append(dead_id)
                continue
            plan.dead_ids.append(dead_id)
            plan.jobs.append(job)
            plan.levels.append(_opt_text(fields.get(DEAD_LEVEL)) or "")
            tenant = _opt_text(fields.get(DEAD_TENANT)) or ""
            plan.tenants.append(tenant)
            own_id = _own_id(job)
            if own_id is not None:
                # The dead_letter error result under this id would make workers answer the
                # replayed job as a duplicate of an id that already has a result.
                prefix = names(tenant, result_prefix=result_prefix)[2] if tenant else result_prefix
                plan.stale.append(wire.result_key(own_id, prefix))
            reply_to = _opt_text(job.get(wire.JOB_REPLY_TO))
            if reply_to:
                plan.reply_to.append(reply_to)
        return plan, empty

    def calls(self, stream: str, dead_stream: str, keep: bool) -> tuple[Call, ...]:
        """The writes, for one MULTI/EXEC; none where there is no job to replay."""
        out: list[Call] = []
        if self.stale:
            keys = list(dict.fromkeys(self.stale))
            # execute_command: a cluster pipeline has no eval().
            out.append(call("execute_command", "EVAL", DELETE_RESULTS, len(keys), *keys))
        out += [
            call("xadd", level_stream(names(t, stream=stream)[0] if t else stream, level), job)
            for job, level, t in zip(self.jobs, self.levels, self.tenants, strict=True)
        ]
        if not keep and self.dead_ids:
            out.append(call("xdel", dead_stream, *self.dead_ids))
        return tuple(out)

    def added(self, replies: list[Any]) -> list[str]:
        """The new job entry references (`<level>:<entry ID>` on a level), from the
        transaction's replies."""
        first = 1 if self.stale else 0
        added = replies[first : first + len(self.jobs)]
        return [entry_ref(lv, text(r)) for lv, r in zip(self.levels, added, strict=True)]
