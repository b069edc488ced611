"""The result writer in a process of its own (the tuning constant RESULT_WRITER: process).

Building a job's result (its fields, their msgpack map, the publish call's arguments) and
parsing the script's answers is per-job Python: on the event loop it is the largest share
of what the worker's GIL holds per job once decode runs in processes (docs/concepts.md,
"The result writer's process", has the figures). Here the
writer (worker/delivery/writer.py, one per shard, unchanged) runs in its own process
(worker/delivery/writer_main.py), and the worker's side is this proxy, with the interface
of a ResultWriter: per batch it packs the outcomes' rows (worker/delivery/outcome_wire.py)
into one frame, sent by the child's sender thread (a blocking send, without the GIL;
worker/ipc/), and it reads one report per publish of a batch back on the event loop, where
the worker's bookkeeping (held entries, in-flight places, metrics) goes on as before.

Nothing of a job's guarantee moves to the proxy: a job is acknowledged only with its
result, by the script, in Redis. A writer process that dies is replaced and sent every
outcome it had not reported published; one it had published but not reported meets its
entry acknowledged already (the script answers NOT_OURS) and nothing is written twice. A
writer process that dies again and again without publishing anything ends the worker, as
a failed writer task does.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from worker.base.errors import GpufeedError
from worker.delivery.outcome_wire import outcome_rows
from worker.delivery.writer_main import (
    WRITER,
    Close,
    Closed,
    Done,
    Event,
    Now,
    NowDone,
    Put,
    Stall,
    WriterInit,
)
from worker.ipc.child import READY_TIMEOUT_S, Child, ChildNotReady, Restarts
from worker.ipc.messages import Ready
from worker.jobs import Outcome

log = structlog.get_logger("gpufeed.writer")

CHILD_MODULE = "worker.delivery.writer_main"
# Writer processes that end in a row without publishing anything before the worker stops.
MAX_RESTARTS = 3
# How long a writer process may take to end once its socket is closed.
_EXIT_WAIT_S = 5.0


class WriterProcessFailed(GpufeedError, RuntimeError):
    """The result writer's process cannot start, or ends again and again."""


@dataclass(eq=False)
class _Item:
    """Outcomes sent under one token; `left` of them not reported published yet."""

    outcomes: list[Outcome]
    done: bytearray
    left: int
    now: asyncio.Future[None] | None = None  # publish_now's waiter


class WriterProcess:
    """The worker's side of its writer process: what the pipeline calls a result writer."""

    def __init__(
        self,
        init: WriterInit,
        *,
        on_published: Callable[[list[Outcome], list[int]], None],
        on_event: Callable[[str, int], None],
    ) -> None:
        self._init = init
        self._on_published = on_published
        self._on_event = on_event
        self._max_items = init.max_queued
        self._tokens = itertools.count(1)
        self._items: dict[int, _Item] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._loop = asyncio.get_running_loop()
        self._closing = False
        self._ended: asyncio.Future[None] = self._loop.create_future()
        # Counts of the writer processes before the current one, and its own.
        self._counted = (0, 0)
        self._counts = (0, 0)
        self._stalled_since: float | None = None
        self._stall_reason = ""
        self._restarting_since: float | None = None
        # Processes that ended in a row without a publish: past MAX_RESTARTS, the worker stops.
        self._restarts = Restarts(MAX_RESTARTS + 1)
        self._child = self._spawn()
        self._wait_ready()

    # ------------------------------------------------------------- writer's interface
    @property
    def published(self) -> int:
        return self._counted[0] + self._counts[0]

    @property
    def duplicates(self) -> int:
        return self._counted[1] + self._counts[1]

    @property
    def queued(self) -> int:
        return sum(item.left for item in self._items.values())

    @property
    def pid(self) -> int:
        return self._child.pid

    def stalled(self) -> tuple[float, str]:
        """How long answers have waited that could not be published, and why (0: none)."""
        now = time.monotonic()
        if self._restarting_since is not None:
            return now - self._restarting_since, "the result writer's process is restarting"
        since = self._stalled_since
        return (0.0, "") if since is None else (now - since, self._stall_reason)

    async def put(self, outcomes: list[Outcome]) -> None:
        if not outcomes:
            return
        # Bounded as the writer's own queue is: in batches not yet published.
        while len(self._items) >= self._max_items and not self._ended.done():
            self._room.clear()
            await self._room.wait()
        self._submit(Put, outcomes)

    async def publish_now(self, outcomes: list[Outcome]) -> None:
        """Publish outside the queue; returns once the writer's process has (see
        ResultWriter.publish_now)."""
        if outcomes:
            now = self._loop.create_future()
            self._submit(Now, outcomes, now)
            await now

    async def close(self) -> None:
        """Ask `run` to finish once everything sent before this call is published."""
        self._closing = True
        self._child.send(Close())

    async def run(self) -> None:
        try:
            await self._ended
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """End the writer's process (its socket closed; killed if it does not end)."""
        self._child.end(_EXIT_WAIT_S if self._ended.done() else 0.1)
        for item in self._items.values():
            if item.now is not None and not item.now.done():
                item.now.cancel()
        if not self._ended.done():
            self._ended.cancel()
        self._room.set()

    # --------------------------------------------------------------------- sending
    def _submit(
        self, kind: type[Put] | type[Now], outcomes: list[Outcome], now: Any = None
    ) -> None:
        if self._ended.done():
            raise WriterProcessFailed("the result writer's process has ended")
        token = next(self._tokens)
        self._items[token] = _Item(outcomes, bytearray(len(outcomes)), len(outcomes), now)
        self._child.send(kind(token, outcome_rows(outcomes)))

    # ------------------------------------------------------------------- processes
    def _spawn(self) -> Child:
        child = Child(CHILD_MODULE, wire=WRITER, sender="gpufeed-writer-send")
        child.send(self._init)
        child.watch(self._loop, self._on_readable, child)
        return child

    def _wait_ready(self) -> None:
        """Start-up only: the writer's process imported its modules and built its writers."""
        child = self._child
        try:
            child.wait_ready(time.monotonic() + READY_TIMEOUT_S, partial(self._handle, child))
        except ChildNotReady as exc:
            self.shutdown()
            raise WriterProcessFailed(exc.said("the result writer's process")) from None

    def _on_readable(self, child: Child) -> None:
        messages = child.receive()
        if messages is None:
            child.unwatch()
            # After its last report (`Closed`) a process ends as asked: nothing to replace.
            if child is self._child and not self._ended.done():
                self._ended_child(child)
            return
        for message in messages:
            self._handle(child, message)

    def _handle(self, child: Child, message: Any) -> None:
        if isinstance(message, Done):
            self._counts = (message.published, message.duplicates)
            self._restarts.proved()
            self._done(message.token, message.positions, message.states, message.write_ms)
        elif isinstance(message, NowDone):
            item = self._items.get(message.token)
            if item is not None and item.now is not None:
                if not item.now.done():
                    item.now.set_result(None)
                item.now = None
                self._forget(message.token, item)
        elif isinstance(message, Stall):
            seconds = message.seconds
            self._stalled_since = time.monotonic() - seconds if seconds > 0 else None
            self._stall_reason = message.reason
        elif isinstance(message, Event):
            self._on_event(message.name, message.n)
        elif isinstance(message, Ready):
            self._restarting_since = None
        elif isinstance(message, Closed) and not self._ended.done():
            self._ended.set_result(None)

    def _done(
        self, token: int, positions: list[int], states: list[int], write_ms: list[float]
    ) -> None:
        item = self._items.get(token)
        if item is None:
            return
        outcomes = item.outcomes
        done = item.done
        published: list[Outcome] = []
        kept: list[int] = []
        for position, state, ms in zip(positions, states, write_ms, strict=True):
            if done[position]:
                continue
            done[position] = 1
            outcome = outcomes[position]
            outcome.job.timings_ms["write"] = ms
            published.append(outcome)
            kept.append(state)
        item.left -= len(published)
        if published:
            self._on_published(published, kept)
        self._forget(token, item)

    def _forget(self, token: int, item: _Item) -> None:
        if item.left == 0 and item.now is None:
            del self._items[token]
            self._room.set()

    def _ended_child(self, child: Child) -> None:
        """The writer's process ended without being asked: a new one gets what it had not
        reported published."""
        # Its socket closed, yet one that runs on is killed: it is replaced all the same.
        code = child.end(_EXIT_WAIT_S)
        self._counted = (self.published, self.duplicates)
        self._counts = (0, 0)
        held = self.queued
        if self._restarts.charge():
            log.error("result_writer_process_failed", exit_code=code, held=held)
            self._ended.set_exception(
                WriterProcessFailed(
                    f"the result writer's process ended {self._restarts.in_a_row} times in a row "
                    f"without publishing (last exit code {code}); {held} answers stay pending in "
                    "Redis"
                )
            )
            self._room.set()
            return
        log.error(
            "result_writer_process_ended",
            exit_code=code,
            held=held,
            note="a new one publishes what it held; nothing is written twice",
        )
        self._restarting_since = self._restarting_since or time.monotonic()
        self._child = self._spawn()
        for token, item in list(self._items.items()):
            del self._items[token]
            todo = [o for o, d in zip(item.outcomes, item.done, strict=True) if not d]
            if todo:
                self._submit(Now if item.now is not None else Put, todo, item.now)
            elif item.now is not None:
                self._submit(Now, [], item.now)
        if self._closing:
            self._child.send(Close())
