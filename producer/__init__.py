"""gpufeed's client side: enqueue image jobs and read their results (no torch needed).

The names below are imported on first use: a process that needs only the wire contract
(`producer.wire`, as the worker's decode processes do) does not pay for the Redis client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.admission import AdmissionRefused, BacklogFull, RedisMemoryFull
    from producer.client import (
        AsyncProducer,
        DeadLetter,
        DeadLetterNotFound,
        Job,
        Producer,
        ResultsTimeout,
        file_job_ids,
        jobs_from_files,
    )
    from producer.priorities import UnknownPriority
    from producer.stats import collect_stats
    from producer.wire import ErrorCode, JobResult

_HOMES = {
    "AdmissionRefused": "producer.admission",
    "BacklogFull": "producer.admission",
    "RedisMemoryFull": "producer.admission",
    "AsyncProducer": "producer.client",
    "DeadLetter": "producer.client",
    "DeadLetterNotFound": "producer.client",
    "Job": "producer.client",
    "Producer": "producer.client",
    "ResultsTimeout": "producer.client",
    "file_job_ids": "producer.client",
    "jobs_from_files": "producer.client",
    "UnknownPriority": "producer.priorities",
    "collect_stats": "producer.stats",
    "ErrorCode": "producer.wire",
    "JobResult": "producer.wire",
}

__all__ = [
    "AdmissionRefused",
    "AsyncProducer",
    "BacklogFull",
    "DeadLetter",
    "DeadLetterNotFound",
    "ErrorCode",
    "Job",
    "JobResult",
    "Producer",
    "RedisMemoryFull",
    "ResultsTimeout",
    "UnknownPriority",
    "collect_stats",
    "file_job_ids",
    "jobs_from_files",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'producer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
