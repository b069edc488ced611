"""The operator's tools around the serving pipeline, apart from it: `doctor/` (why is the
GPU waiting), `top/` (a live view of the workers), `demo.py`, and `harness/`, the one
measurement harness (a worker on a private stream, the feeder, the timed window, the
samplers, the instruments, provenance) that the doctor shares with the benchmark and the GPU
check, which live outside the worker package (`measure/`).

May import: base, config, decode, delivery, jobs, lifecycle, model, observe, pipeline,
producer.
"""
