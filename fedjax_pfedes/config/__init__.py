"""The config schema: every field with its default (`defaults.default_config`)."""
