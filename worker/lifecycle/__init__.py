"""A worker's life: `service.py` builds the stages, serves and shuts down; `supervisor.py`
runs several worker processes on one device; `event_loop.py` is the loop every command
runs in.

May import: config, decode, delivery, fetch, jobs, model, observe, pipeline, producer.
"""
