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
