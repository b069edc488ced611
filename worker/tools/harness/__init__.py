"""The one measurement harness: what the doctor (worker/tools/doctor/), the benchmark and
the GPU check (measure/) share when they start a worker and measure it.

- `redis_env`: a private redis-server, each run's own streams, pushing jobs and reading
  their answers back;
- `images`: deterministic image sets, made here and cached on disk; `image_server`: a
  loopback HTTP server of them, for `url` jobs;
- `feed`: the feeder, which keeps a worker's stream at a depth or a rate while a window is
  timed;
- `measurement`: what a run measured, and the timed direct-feed ceiling;
  `queue_ceiling`: Redis's own ceiling for the same jobs, without gpufeed;
- `probe`: the samplers, CPU per thread group, GPU utilisation and memory during a run;
- `instruments`: host syncs, compiled-step replays and GPU-decoded rows counted around a
  running worker;
- `process_scaling`: decode rates by number of decode processes;
- `environment`: the host, its packages and device, as every report heads them;
  `serving_step`: the model's step alone, on a random batch; `provenance`: the CPU and the
  source tree a figure comes from; `report_head`: those fields defined once for the three
  reports (which carries which, under what name), and the reports' schema validator.

May import: base, config, decode, delivery, jobs, lifecycle, model, observe, pipeline,
producer, and the tools' `demo`.
"""
