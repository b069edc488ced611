"""The stages between the reader and the writer: the bounded job queue, the batcher, the
pinned staging ring, the host-to-device transfer, the launch thread (`launch.py`), the
completion watcher, the degraded step under backlog (`degrade.py`) and the device's own
helpers (`device.py`: contexts, events, CUDA graph marks).

May import: config, decode, delivery, jobs, model.
"""
