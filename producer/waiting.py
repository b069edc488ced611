"""The client-independent half of `wait` and `iter_results`: what to read next, and what
the replies mean. Nothing here does I/O."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from redis.typing import KeyT, StreamIdT

from producer import wire
from producer.commands import Batch, Call, Steps, call
from producer.replies import last_id, parse_result, stored_result, xread_entries

# redis-py's default socket timeout is 5 s: a longer XREAD BLOCK would look like a dead
# server, so long waits are made of short blocking reads.
MAX_BLOCK_MS = 1000
READ_COUNT = 1000
# Results whose stream entry we cannot see (another reply_to stream, a trimmed stream)
# still land in their hash; look there again this often while waiting.
RECHECK_S = 2.0
HASH_CHUNK = 5000

OnResult = Callable[[wire.JobResult], None]


class ResultsTimeout(TimeoutError):
    """`wait` ran out of time; `results` holds what arrived, `missing` the ids that did not."""

    def __init__(self, results: dict[str, wire.JobResult], missing: list[str]) -> None:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        super().__init__(f"{len(missing)} result(s) missing: {shown}")
        self.results = results
        self.missing = missing


class Waiter:
    """The state of one `wait`: what is still missing and where to read next."""

    def __init__(
        self,
        ids: Iterable[str],
        timeout_s: float | None,
        on_result: OnResult | None,
        entries: Mapping[str, str] | None = None,
    ) -> None:
        self.wanted = list(dict.fromkeys(ids))
        self.pending = set(self.wanted)
        # The stream entry of each id this producer submitted: another job with the same id
        # (another tenant, an earlier run) has another entry, and its result is not ours.
        self.entries = {i: entries[i] for i in self.wanted if entries and i in entries}
        self.found: dict[str, wire.JobResult] = {}
        self.cursors: dict[KeyT, StreamIdT] = {}
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.recheck_at = time.monotonic() + RECHECK_S
        self.on_result = on_result
        self.misplaced_prefixes: tuple[str, ...] = ()

    def take(self, result: wire.JobResult | None) -> None:
        if result is None:
            return
        expected = self.entries.get(result.id)
        if expected is not None and result.entry != expected:
            return
        if result.id in self.pending:
            self.pending.discard(result.id)
            self.found[result.id] = result
            if self.on_result is not None:
                self.on_result(result)

    def take_entries(self, resp: Any) -> None:
        for stream, entry_id, fields in xread_entries(resp):
            self.cursors[stream] = entry_id
            self.take(parse_result(fields))

    def hash_chunks(self) -> list[list[str]]:
        self.recheck_at = time.monotonic() + RECHECK_S
        ids = [i for i in self.wanted if i in self.pending]
        return [ids[i : i + HASH_CHUNK] for i in range(0, len(ids), HASH_CHUNK)]

    def take_hashes(self, replies: list[Any]) -> None:
        for reply in replies:
            self.take(stored_result(reply))

    def block_ms(self) -> int | None:
        """How long the next XREAD may block; None when done or out of time."""
        if not self.pending:
            return None
        if self.deadline is None:
            return MAX_BLOCK_MS
        left_ms = int((self.deadline - time.monotonic()) * 1000)
        # XREAD BLOCK 0 would block forever.
        return min(left_ms, MAX_BLOCK_MS) if left_ms >= 1 else None

    def recheck_due(self) -> bool:
        return bool(self.pending) and time.monotonic() >= self.recheck_at

    def finish(self, raise_on_timeout: bool) -> dict[str, wire.JobResult]:
        results = {i: self.found[i] for i in self.wanted if i in self.found}
        if self.pending and raise_on_timeout:
            raise ResultsTimeout(results, [i for i in self.wanted if i in self.pending])
        return results

    def steps(
        self,
        watched: list[str],
        result_prefix: str,
        raise_on_timeout: bool,
        misplaced_prefixes: tuple[str, ...] = (),
    ) -> Steps[dict[str, wire.JobResult]]:
        """All of `wait` once something is pending: watch the streams in `watched` and look
        in the result hashes until nothing is pending or time is up. `misplaced_prefixes`:
        the other shards' result prefixes, looked in after the id's own (a job added by
        hand to another shard's stream is refused there, in that shard's hash)."""
        self.misplaced_prefixes = misplaced_prefixes
        # The cursors are taken before the hashes are read: a result published in between
        # is in both, one published later is in the stream after the cursor.
        replies = yield Batch(tuple(call("xrevrange", s, count=1) for s in watched))
        self.cursors = {s: last_id(r) for s, r in zip(watched, replies, strict=True)}
        yield from self._check_hashes(result_prefix)
        while (block := self.block_ms()) is not None:
            self.take_entries((yield call("xread", self.cursors, count=READ_COUNT, block=block)))
            if self.recheck_due():
                yield from self._check_hashes(result_prefix)
        if self.pending:
            yield from self._check_hashes(result_prefix)
        return self.finish(raise_on_timeout)

    def _check_hashes(self, result_prefix: str) -> Steps[None]:
        for chunk in self.hash_chunks():
            # A duplicate id's answer is stored under its entry ID, the id's under the id.
            keys = [wire.result_key(job_id, result_prefix) for job_id in chunk]
            keys += [
                wire.result_key(self.entries[job_id], result_prefix)
                for job_id in chunk
                if job_id in self.entries
            ]
            # After the id's own keys, so that a result there is taken first.
            keys += [
                wire.result_key(job_id, prefix)
                for prefix in self.misplaced_prefixes
                for job_id in chunk
            ]
            self.take_hashes((yield Batch(tuple(call("hgetall", k) for k in keys))))


class ResultsFeed:
    """The state of one `iter_results`: the next read, and the results in each reply."""

    def __init__(self, stream: str, start: str, block_ms: int | None, count: int) -> None:
        self.stream = stream
        self.count = count
        # "$" is resolved once: re-sent on every read it would skip entries between reads.
        self.cursor = None if start == "$" else start
        self.block = None if block_ms is None else max(1, min(block_ms, MAX_BLOCK_MS))
        self.done = False

    def next_read(self) -> Call | None:
        """The next request to make; None once a non-blocking read found nothing new."""
        if self.done:
            return None
        if self.cursor is None:
            return call("xrevrange", self.stream, count=1)
        return call("xread", {self.stream: self.cursor}, count=self.count, block=self.block)

    def take(self, reply: Any) -> list[tuple[str, wire.JobResult]]:
        """(entry id, result) from the reply to `next_read`'s request, in stream order."""
        if self.cursor is None:
            self.cursor = last_id(reply)
            return []
        entries = xread_entries(reply)
        if not entries and self.block is None:
            self.done = True
        results = []
        for _, entry_id, fields in entries:
            self.cursor = entry_id
            if (result := parse_result(fields)) is not None:
                results.append((entry_id, result))
        return results
