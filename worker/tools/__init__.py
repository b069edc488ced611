"""Tools around the serving pipeline, apart from it: `doctor` (why is the GPU waiting),
`bench` (the benchmark report), `top` (a live view of the workers), `demo`, and the GPU
host check (`gpu_check`, `gpu_preflight`)."""
