"""Errors a user can act on. Entry points print their message (no traceback) and exit non-zero."""


class JaxppoError(Exception):
    """Base class: the message names the file, key or row at fault."""


class CheckpointError(JaxppoError):
    """A model directory, config.json or safetensors file is missing or does not match the config."""


class DataError(JaxppoError):
    """A dataset file, column or row is missing or malformed."""


class ConfigError(JaxppoError):
    """A run configuration is invalid (unknown key, wrong type, impossible combination)."""
