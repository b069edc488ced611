"""Settings: `WorkerConfig`, the one typed configuration object read once at start-up
from the environment and flags (`settings.py`), its error (`errors.py`), the file-system
look-ups a setting may need (`paths.py`), every setting's meaning (`settings_help.py`) and
the job streams the settings describe (`lanes.py`).

May import: fetch, model, producer.
"""
