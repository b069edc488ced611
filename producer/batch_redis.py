"""The batch run's own Redis traffic: XADDs and XREADs in whole buffers on one connection.

A batch client is meant to outrun its workers many times over, and redis-py's pipeline
spends several microseconds of Python per command (argument checks, encoding, a response
callback per reply): more than everything else a job costs here. So a chunk of jobs goes
out as one call of a small script that XADDs each of them (one command packed by hiredis,
redis-py's own C parser and packer, and one reply: the entry ids), and an XREAD's reply is
taken as hiredis parsed it, with no per-entry conversion. Everything else (admission
control's script, the result-hash look-ups, a cluster) goes through the producer as usual.

The connection is one of the producer's pool, held for the run: errors reach the caller
as redis-py's own exceptions (ConnectionError, TimeoutError, ResponseError).
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import hiredis
import redis

Fields = dict[bytes, bytes]

# ^C and SIGTERM (producer/batch_runner.py raises them as exceptions) wait while a call is
# on the wire: raised inside redis-py's send or hiredis's read, one ended the client by
# SIGSEGV (seen twice under load). Held for one call, they are raised right after it.
_HELD = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ARGV: for each job, its number of field arguments and then those fields.
XADDS = b"""
local ids = {}
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return ids
"""
XADDS_SHA = hashlib.sha1(XADDS).hexdigest().encode()


class RawLink:
    """One connection of `client`'s pool, spoken to in packed buffers."""

    def __init__(self, client: redis.Redis, *, scripts: bool = True) -> None:
        """`scripts`: False for a user that may not run them (a tenant's, see
        producer/tenants.py): the XADDs then go out as one pipelined buffer instead."""
        self._pool = client.connection_pool
        self._conn: Any = self._pool.get_connection()
        self._scripts = scripts

    def close(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None

    def _broken(self) -> None:
        # A reply half read leaves the connection out of step: it is not reused.
        if self._conn is not None:
            self._conn.disconnect()

    def xadds(self, stream: bytes, jobs: Sequence[Sequence[bytes]]) -> list[bytes]:
        """XADD each job's fields (a flat key, value sequence) to `stream`: one script
        call, one reply (their entry ids, in order), however many jobs."""
        if not self._scripts:
            return self._pipelined(stream, jobs)
        args: list[bytes | int] = [b"EVALSHA", XADDS_SHA, 1, stream]
        for fields in jobs:
            args.append(len(fields))
            args += fields
        try:
            reply = self._call(args)
        except redis.exceptions.NoScriptError:
            self._call([b"SCRIPT", b"LOAD", XADDS])
            reply = self._call(args)
        return [bytes(e) for e in reply]

    def _pipelined(self, stream: bytes, jobs: Sequence[Sequence[bytes]]) -> list[bytes]:
        pack: Any = hiredis.pack_command
        conn = self._conn
        commands = [pack((b"XADD", stream, b"*", *fields)) for fields in jobs]
        try:
            with _signals_held():
                conn.send_packed_command(commands, check_health=False)
                return [bytes(conn.read_response()) for _ in commands]
        except (redis.RedisError, OSError):
            # Replies left unread (after an error reply) put the connection out of step.
            self._broken()
            raise

    def _call(self, args: list[bytes | int]) -> Any:
        # hiredis's stub types the command as a one-element tuple; it takes any length.
        pack: Any = hiredis.pack_command
        conn = self._conn
        try:
            with _signals_held():
                conn.send_packed_command([pack(tuple(args))], check_health=False)
                return conn.read_response()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._broken()
            raise

    def xread(
        self, stream: bytes, cursor: bytes, count: int, block_ms: int | None
    ) -> list[tuple[bytes, Any]]:
        """The entries after `cursor` (entry id, fields as hiredis gave them: a flat list,
        or a map under RESP3), at most `count`; with `block_ms`, waits that long for one."""
        args: list[bytes | int] = [b"XREAD", b"COUNT", count]
        if block_ms is not None:
            args += [b"BLOCK", block_ms]
        args += [b"STREAMS", stream, cursor]
        conn = self._conn
        try:
            with _signals_held():
                conn.send_command(*args, check_health=False)
                reply = conn.read_response()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._broken()
            raise
        return list(_entries(reply))


def _entries(reply: Any) -> Iterator[tuple[bytes, Any]]:
    # RESP2: [[stream, entries]]; RESP3: {stream: entries}; None when the block timed out.
    if not reply:
        return
    pairs = reply.values() if isinstance(reply, dict) else (p[1] for p in reply)
    for entries in pairs:
        yield from entries


def field_map(fields: Any) -> Fields:
    """An entry's fields as a dict, from a flat [k, v, k, v, ...] list or a map."""
    if isinstance(fields, dict):
        return fields
    it = iter(fields)
    return dict(zip(it, it, strict=False))
