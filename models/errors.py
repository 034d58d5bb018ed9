"""The error a model description raises, kept apart so that the variants (models.mixers) can raise it while the
config (models.config) looks them up by name."""


class ConfigError(ValueError):
    """A config that cannot describe a valid model; the message says which field and why."""
