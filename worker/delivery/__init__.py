"""Redis in and out: reading jobs through the consumer group (`reader.py`), reclaiming and
dead-lettering what others left (`reclaimer.py`), publishing results with their
acknowledgement in one script (`writer.py`, `redis_scripts.py`), shards and Redis Cluster
(`sharding.py`, `cluster_node.py`), replica waits (`replicas.py`), the start-up checks
of what the worker's Redis user may do (`redis_check.py`), the in-flight budget
(`in_flight.py`), the fleet's hot list of images worth decoding before a worker starts
(`hot_list.py`), the Redis errors told apart (`redis_errors.py`), and the result writer in a
process of its own (`writer_process.py`, the worker's side; `writer_main.py`, the process;
`outcome_wire.py`, what crosses between them), and the reads in a process of their own
(`intake_process.py`, the worker's side; `intake_main.py`, the process; `stream_reply.py`,
its reading of XREADGROUP's replies, payloads straight into shared memory; `payload_ring.py`,
which part of the payload memory each read may fill). It imports model for the answer kinds, which
the writer's process rebuilds from their rows.

May import: base, config, ipc, jobs, model, producer.
"""
