"""Redis requests as data, so that the logic of every `Producer` method is written once.

Each method's logic is a generator (`Steps`) that yields the requests it needs and is sent
their replies; it does no I/O itself. `Producer` executes the requests on a `redis.Redis`,
`AsyncProducer` awaits them on a `redis.asyncio.Redis`: those two are the only I/O.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One command, by the name of its redis-py method; the reply is the method's."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def on(self, target: Any) -> Any:
        """Send (or, on a pipeline, queue) the command; an awaitable on asyncio clients."""
        return getattr(target, self.name)(*self.args, **self.kwargs)


def call(name: str, *args: Any, **kwargs: Any) -> Call:
    return Call(name, args, kwargs)


@dataclass(frozen=True)
class _Queued:
    calls: tuple[Call, ...]

    def queue(self, pipe: Any) -> None:
        for c in self.calls:
            c.on(pipe)


@dataclass(frozen=True)
class Batch(_Queued):
    """Commands sent in one non-transactional pipeline; the reply is the list of theirs."""


@dataclass(frozen=True)
class Transaction:
    """`body`, run with `key` watched on a transaction pipeline. Its own requests go to the
    client as usual, but for `Unwatch` and `Exec`, which go to that pipeline. The reply is
    what `body` returns, or the `redis.WatchError` that aborted it (to retry, or raise)."""

    key: str
    body: Steps[Any]


@dataclass(frozen=True)
class Unwatch:
    """In a `Transaction`'s body: give up the watch (UNWATCH)."""


@dataclass(frozen=True)
class Exec(_Queued):
    """In a `Transaction`'s body: MULTI, the commands, EXEC; the reply is the EXEC reply.
    With no commands nothing is sent and the reply is []."""


Request: TypeAlias = Call | Batch | Transaction | Unwatch | Exec
Steps: TypeAlias = Generator[Request, Any, T]


@dataclass(frozen=True)
class Done(Generic[T]):
    value: T


def advance(steps: Steps[T], reply: Any) -> Request | Done[T]:
    """Send `steps` the reply to its last request: its next request, or what it returned."""
    try:
        return steps.send(reply)
    except StopIteration as stop:
        return Done(stop.value)
