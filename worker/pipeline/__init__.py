"""The stages between the reader and the writer: the bounded job queue, the batcher, the
pinned staging ring, the host-to-device transfer, the launch thread (`launch.py`), the
completion watcher and the degraded step under backlog (`degrade.py`).

May import: base, decode, delivery, jobs, model.
"""
