"""`python -m measure bench` (`make bench`): what gpufeed is worth, measured on this machine.

- `suite`: one invocation runs the direct-feed ceiling, the naive reference worker, gpufeed
  with its defaults and with each optimisation switched off (every job's bytes unique, so
  the decode cache never hits), and the decode cache on repeated images, on deterministic
  image sets;
  `context`: what the runs share; `gpufeed_run`, `naive_run`, `latency_curve`: one kind of
  run each; `rate_table`: decode rates at the runs' sizes; `analysis`: ideals,
  efficiencies, targets and the limiting stage;
- `naive`: the naive reference worker (reference only, never deployed);
- `ablations`: the gpufeed variants, the decode-cache pair (repeated images, cache on and
  off), and the emulation of "GPU preprocessing off";
- `profiles`: tiny, quick and full;
- `stage_rates`: each stage's cost alone, and the throughput those costs allow;
- `accuracy`: both resize placements against torchvision's eval transforms (pixels, a
  classifier's top-1 and embedding cosine);
- the sections beside those runs, one module each: `overhead` (what gpufeed costs per job,
  beside the harness's queue ceiling), `load_latency`, `live_producer`, `priority`,
  `tenants`, `warm_start` and `batch`; `url_jobs` for `url` jobs;
- `report`: report.json (docs/bench-schema.md) and report.md and throughput.png;
  `figures_page`: docs/figures.md, written from a report.

What it shares with the GPU check and the doctor (the private Redis and each run's streams,
the image sets, the probe of CPU per thread group and GPU, the timed ceiling, the queue
ceiling, the instruments, provenance, the image server) is the measurement harness,
worker/tools/harness/.
"""
