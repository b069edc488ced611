"""The private Redis Cluster the tests and the soak start: it lives in the measurement
harness (worker/tools/harness/redis_cluster.py) so that measure/ can start one without
importing tests/."""

from worker.tools.harness.redis_cluster import (
    NODE_TIMEOUT_MS,
    ClusterNode,
    RedisCluster,
    ResultWatcher,
    results_by_id,
)

__all__ = ["NODE_TIMEOUT_MS", "ClusterNode", "RedisCluster", "ResultWatcher", "results_by_id"]
