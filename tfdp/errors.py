"""Errors a user can cause, each with a message that says what to do."""


class TfdpError(Exception):
  """Base class of every error tfdp raises on purpose."""


class ConfigError(TfdpError, ValueError):
  """A flag, argument, environment variable or TF_CONFIG is wrong."""


class CheckpointError(TfdpError, RuntimeError):
  """A checkpoint cannot be written or read."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint file is missing, truncated or does not match its manifest."""


class IncompatibleCheckpointError(CheckpointError):
  """A checkpoint was written by a run whose config, or model, does not match this one."""
