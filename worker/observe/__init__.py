"""Watching the worker: the observer that counts what happened (`observer.py`), the
Prometheus metrics (`metrics.py`), `/live` and `/ready` (`health.py`), GPU utilisation
(`gpu_sampler.py`) and what Redis itself spends per job (`redis_cpu.py`). It sits above
the stages it watches and reads what they hand it.

May import: base, config, delivery, jobs, pipeline.
"""
