"""Redis in and out: reading jobs through the consumer group (`reader.py`), reclaiming and
dead-lettering what others left (`reclaimer.py`), publishing results with their
acknowledgement in one script (`writer.py`, `redis_scripts.py`), shards and Redis Cluster
(`sharding.py`, `cluster_node.py`), replica waits (`replicas.py`), the start-up checks
of what the worker's Redis user may do (`redis_check.py`), the in-flight budget
(`in_flight.py`), the fleet's hot list of images worth decoding before a worker starts
(`hot_list.py`) and the Redis errors told apart (`redis_errors.py`).

May import: config, jobs, producer.
"""
