"""Settings: `WorkerConfig`, the one typed configuration object read once at start-up
from the environment and flags (`settings.py`), every setting's meaning (`settings_help.py`)
and the job streams the settings describe (`lanes.py`). It checks a model directory's
manifest and a fetch policy's lists with their own parsers, so it stands above them.

May import: base, fetch, model, producer.
"""
