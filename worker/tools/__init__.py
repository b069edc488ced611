"""Tools around the serving pipeline, apart from it, one folder each: `doctor/` (why is the
GPU waiting), `bench/` (the benchmark report), `top/` (a live view of the workers),
`gpu_check/` (the GPU host check) and `demo.py`.

May import: base, config, decode, delivery, jobs, lifecycle, model, observe, pipeline,
producer.
"""
