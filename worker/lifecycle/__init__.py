"""A worker's life: `service.py` reads serve -> startup -> main_loop -> shutdown;
`engine.py` warms the model side up after `feed_plan.py` chose its decoders, `wiring.py`
builds the stages as one object whose teardown is registered as each is built,
`dispatch.py` hands reads and batches on, `settlement.py` (Settlement) frees what a
published outcome held; `report.py` (WorkerReport) is what the tools read of a running
worker; `warm_start.py` decodes the fleet's hot list into the cache before the worker joins
the group; `supervisor.py` runs several worker processes on one device; `event_loop.py` is
the loop every command runs in.

May import: base, config, decode, delivery, fetch, jobs, model, observe, pipeline, producer.
"""
