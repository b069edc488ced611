"""Tools around the serving pipeline, apart from it, one folder each: `doctor/` (why is the
GPU waiting), `bench/` (the benchmark report), `top/` (a live view of the workers),
`gpu_check/` (the GPU host check), `docs_gen/` (the site's reference pages), and `demo.py`.

May import: cli, config, decode, delivery, jobs, lifecycle, model, observe, pipeline,
producer.
"""
