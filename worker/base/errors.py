"""The one error a setting raises: kept apart from the settings themselves, so that what
validates a setting (worker/model/manifest.py, worker/model/names.py) can raise it without
importing the settings that import it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is missing or invalid; the message is one line meant for the operator."""
