"""The core config schema: the fields every run has, with their defaults
(`defaults.core_config`); the methods' own fields join them in `engine.schema.default_config`."""
