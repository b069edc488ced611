"""Settings: the one typed configuration object, read once at start-up, its
validation, its help text, and the stream layout (lanes) it describes."""
