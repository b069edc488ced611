"""The stages between the reader and the writer: the bounded job queue, the batcher, the
pinned staging ring, the host-to-device transfer, the GPU decode stage (`gpu_decode.py`:
the rows left for the GPU, decoded one batch ahead of the launch), the launch thread
(`launch.py`, which only copies and runs the step), the completion watcher and the degraded
step under backlog (`degrade.py`).

May import: base, decode, delivery, jobs, model.
"""
