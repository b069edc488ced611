"""The model: loading, the one compiled step, its compile checks, precision and ceiling."""
