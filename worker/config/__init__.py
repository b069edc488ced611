"""Settings: the one table of every setting (`table.py`: variable, default, bounds, meaning,
section), `WorkerConfig`, the typed configuration object read once at start-up from the
environment and flags and checked against that table (`settings.py`), the tuning constants
that are no settings (`tuning.py`) and the job streams the settings describe (`lanes.py`).
It checks a model directory's manifest and a fetch policy's lists with their own parsers,
so it stands above them.

May import: base, fetch, model, producer.
"""
