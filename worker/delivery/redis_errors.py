"""The Redis errors the worker tells apart, each set named once.

Every stage that talks to Redis waits out the same outages and passes the same refusals; a
set spelled anew at each `except` drifts (one forgets OSError, another the cluster's
failover answers). Torch-free, like the rest of delivery/.
"""

from __future__ import annotations

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.reach import UNREACHABLE as NOT_USABLE

Errors = tuple[type[Exception], ...]

# Redis unreachable: the connection refused, dropped or timed out.
UNREACHABLE: Errors = (RedisConnectionError, RedisTimeoutError, OSError)

# A Redis Cluster between a master's failure and its replica's promotion (CLUSTERDOWN,
# TRYAGAIN, MASTERDOWN, a slot without a master).
FAILING_OVER: Errors = (
    ClusterDownError,
    TryAgainError,
    MasterDownError,
    SlotNotCoveredError,
    RedisClusterException,
)

# Redis away for a while: a reader or a housekeeping duty backs off and tries again.
AWAY: Errors = (*UNREACHABLE, *FAILING_OVER)

# Answers a cluster node gives before a command runs: the slot is elsewhere, or the cluster
# is failing over. Nothing was done; tried again after the slot map is read again.
REDIRECTED: Errors = (MovedError, AskError, TryAgainError, ClusterDownError, MasterDownError)

# At start-up: Redis away, something other than Redis on its port (the producer's set, exit
# 3 for the CLIs), or a cluster that cannot serve yet.
NO_REDIS: Errors = (*NOT_USABLE, RedisClusterException)

# Any failure of a Redis call, whatever answers (it may not even be a Redis server): where
# the worker only tidies up or asks, and goes on whatever happens.
ANY: Errors = (RedisError, OSError, TimeoutError)

# A publish call that did not run: Redis unreachable, or the script not loaded. Tried again
# whole.
NOT_RUN: Errors = (*UNREACHABLE, NoScriptError)

# Errors that concern a whole publish call, not one of its jobs: it did not run, or Redis
# refused it under maxmemory (at the call's first write: nothing was written).
CALL_WIDE: Errors = (*NOT_RUN, OutOfMemoryError)

# Refusals that pass (memory freed, a dataset loaded, a failover or resharding over): the
# answer is kept and tried again. Any other error Redis gives one job's call alone is about
# that job's answer.
PASSING: Errors = (
    OutOfMemoryError,
    BusyLoadingError,
    ReadOnlyError,
    TryAgainError,
    ClusterDownError,
    MovedError,
    AskError,
)

# Refusals Redis gives everyone for a while, then stops giving: a script or function running
# past busy-reply-threshold (BUSY: any client with EVAL can hold every other one), a dataset
# loading (LOADING), a replica without its master (MASTERDOWN), a cluster failing over or
# resharding (TRYAGAIN, CLUSTERDOWN). The command did not run; the same command succeeds once
# they pass, so a stage waits them out as it waits out Redis away, and never takes one for
# an answer about a job. redis-py has a class for each but BUSY (a plain ResponseError).
REFUSING_FOR_NOW: Errors = (BusyLoadingError, MasterDownError, TryAgainError, ClusterDownError)
TEMPORARY_CODES = frozenset({"BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"})
# Subclasses first: MASTERDOWN is a CLUSTERDOWN to redis-py.
_CODES: tuple[tuple[type[Exception], str], ...] = (
    (BusyLoadingError, "LOADING"),
    (MasterDownError, "MASTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
    (ClusterDownError, "CLUSTERDOWN"),
)


def error_code(exc: BaseException) -> str:
    """The code Redis answered with (BUSY, NOGROUP, ...); '' for an error that is no answer."""
    code = getattr(exc, "status_code", None)  # redis-py 6 and later
    if isinstance(exc, RedisError) and isinstance(code, str) and code:
        return code
    # Older redis-py drops a code it has a class for from the message.
    for kind, name in _CODES:
        if isinstance(exc, kind):
            return name
    if not isinstance(exc, ResponseError):
        return ""
    # An unknown code stays the message's first word.
    first = str(exc).split(" ", 1)[0]
    return first if first.isupper() and first.isalpha() else ""


def temporary(exc: BaseException) -> bool:
    """A refusal that passes (REFUSING_FOR_NOW's, BUSY among them): wait, then ask again."""
    return isinstance(exc, REFUSING_FOR_NOW) or error_code(exc) in TEMPORARY_CODES


def outage(exc: BaseException) -> bool:
    """Redis away (AWAY) or refusing everyone for now (`temporary`): waited out, with
    /ready at 503, never a reason to stop."""
    return isinstance(exc, AWAY) or temporary(exc)
