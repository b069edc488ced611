"""`python -m worker bench` (`make bench`): what gpufeed is worth, measured on this machine.

- `suite`: one invocation runs the direct-feed ceiling, the naive reference worker, gpufeed
  with its defaults and with each optimisation switched off (every job's bytes unique, so
  the decode cache never hits), and the decode cache on repeated images, on deterministic
  image sets;
  `context`: what the runs share; `redis_env`: the private Redis, each run's streams;
  `gpufeed_run`, `naive_run`, `latency_curve`: one kind of run each; `measurement`: what a
  run measured and the timed ceiling; `rate_table`: decode rates at the runs' sizes;
  `analysis`: ideals, efficiencies, targets and the limiting stage;
- `naive`: the naive reference worker (reference only, never deployed);
- `ablations`: the gpufeed variants, the decode-cache pair (repeated images, cache on and
  off), and the emulation of "GPU preprocessing off";
- `images`: the deterministic image sets; `profiles`: tiny, quick and full;
- `stage_rates`: each stage's cost alone, and the throughput those costs allow;
- `accuracy`: both resize placements against torchvision's eval transforms (pixels, a
  classifier's top-1 and embedding cosine);
- `probe`: CPU per thread group, GPU utilisation and memory during a run;
- the sections beside those runs, one module each: `overhead` (what gpufeed costs per job,
  beside `queue_ceiling`), `load_latency`, `live_producer`, `priority`, `tenants`,
  `warm_start`, `batch` and `process_scaling`; `url_jobs` and `image_server` for `url`
  jobs;
- `report`: report.json (docs/bench-schema.md), report.md and throughput.png; `provenance`:
  the CPU and the source tree its figures come from; `figures_page`: docs/figures.md,
  written from a report.
"""
