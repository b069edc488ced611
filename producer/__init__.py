"""gpufeed's client side: enqueue image jobs and read their results (no torch needed)."""

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
