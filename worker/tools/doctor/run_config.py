"""The settings the doctor's Worker runs with: a private stream, and random weights where
the configured ones cannot be fetched."""

from __future__ import annotations

import dataclasses

from worker.config.settings import WorkerConfig

_GROUP = "gpufeed-doctor"


def doctor_config(config: WorkerConfig, redis_url: str, base: str, name: str) -> WorkerConfig:
    """The configured settings on a private stream of their own. The names extend the
    configured stream's, so a Cluster hash tag and ACL key patterns still apply."""
    return dataclasses.replace(
        config,
        redis_url=redis_url,
        stream=f"{base}:jobs",
        # The run feeds one stream: priority levels would leave its jobs unread.
        priorities="",
        priority_weights="",
        group=_GROUP,
        results_stream=f"{base}:results",
        result_prefix=f"{base}:result:",
        dead_stream=f"{base}:dead",
        worker_name=name,
        shards=1,  # one stream, named after the configured first shard's
        redis_cluster="auto",  # the configured Redis, or a private one
        result_ttl_s=600,  # a safety net: the run deletes its keys itself
        trim_interval_s=1.0,  # processed images leave Redis within a second
        metrics_port=0,  # a production worker may hold the configured port
        stats_interval_s=3600.0,
        # The synthetic jobs reuse a few images: cache hits would hide the decode cost the
        # doctor is there to measure.
        decode_cache_mb=0,
    )


def usable_weights(config: WorkerConfig, notes: list[str]) -> WorkerConfig:
    """Speed does not depend on the weights' values: where the configured ones cannot be
    fetched (no network), measure with random ones and say so."""
    weights = config.weights
    if weights.lower() == "none" or "/" in weights or weights.endswith((".pt", ".pth")):
        return config
    from worker.base.errors import ConfigError
    from worker.model.loader import classification_models, prefetch_weights

    if config.model not in classification_models():
        return config  # the worker's start-up says which models there are
    problem = prefetch_weights(config.model, weights, timeout_s=15)
    if problem is None:
        return config
    if problem.startswith("GPUFEED_WEIGHTS:"):
        raise ConfigError(problem)  # a wrong name, not a missing network
    notes.append(
        f"weights {weights} could not be fetched ({problem}); measured with random weights "
        "(speed does not depend on them)"
    )
    return dataclasses.replace(config, weights="none")
