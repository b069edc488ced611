"""Watching the worker: the observer that counts what happened (`observer.py`), the
Prometheus metrics (`metrics.py`), `/live` and `/ready` (`health.py`), GPU utilisation
(`gpu_sampler.py`), who holds the GIL (`gil_account.py`), what Redis itself spends per job
(`redis_cpu.py`) and the log set-up (`logs.py`).

May import: config, decode, delivery, jobs, pipeline.
"""
