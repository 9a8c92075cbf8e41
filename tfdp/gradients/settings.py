"""How tfdp's gradient path all-reduces a Keras 3 optimizer's gradients (TF-free: settings only).

Under any `tf.distribute` strategy with more than one replica, the gradient
path (tfdp/gradients/path.py, installed as tfdp.compat's fix
`gradient_path`) all-reduces a Keras optimizer's gradients first, in buckets
taken in reverse variable order (the order backward produces them), then clips them and checks them for
overflow, so every replica and worker takes the same decision on the same
reduced gradients, as one device does. These settings say how:

- `bucket_cap_mb`: the size of a bucket (PyTorch DDP's `bucket_cap_mb`); 0
  is one all-reduce for all the gradients.
- `first_bucket_mb`: the first bucket (the last layers' gradients, ready
  first) is this small, so that communication starts early.
- `compression`: "bf16" or "fp16" casts each float32 bucket before its
  all-reduce and back after; None (the default) sends it as it is. With fp16
  and loss scaling, an overflow in the all-reduce is a non-finite step that
  every replica skips.
- `timeout_seconds`: under a multi-worker strategy, a call of the model's
  train, test or predict function that runs longer than this (twice this for
  the first, which traces) has its collectives aborted, and the worker fails
  with one line naming the collective and the step (tfdp.liveness.stall; tfdp-launch
  then restarts the group); None waits forever.

The bucket and compression settings are read when the train step is
traced, so set them before `fit` (or the first custom step) runs: `tfdp.configure_gradients(...)`,
`tfdp.make_strategy(gradient_compression=...)` or tfdp-train's flags
`--gradient_compression`, `--bucket_cap_mb` and `--collective_timeout`.
"""

import dataclasses
import threading

from tfdp import errors

COMPRESSIONS = ("bf16", "fp16")
# PyTorch's default collective timeout is 10 minutes (torch.distributed).
DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclasses.dataclass(frozen=True)
class GradientConfig:
  """The gradient path's settings (see the module docstring)."""

  bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
  first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
  compression: str | None = None
  timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS

  def __post_init__(self):
    if self.compression not in (None,) + COMPRESSIONS:
      raise errors.ConfigError(
          f"gradient_compression must be one of {', '.join(COMPRESSIONS)} or None, "
          f"got {self.compression!r}.")
    for name in ("bucket_cap_mb", "first_bucket_mb"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise errors.ConfigError(f"{name} must be a number >= 0, got {value!r}.")
    if self.timeout_seconds is not None and not self.timeout_seconds > 0:
      raise errors.ConfigError(
          f"the collective timeout must be > 0 seconds (or None), got {self.timeout_seconds!r}.")


_config = GradientConfig()
_lock = threading.Lock()
_UNSET = object()


def configure_gradients(*, bucket_cap_mb=_UNSET, first_bucket_mb=_UNSET, compression=_UNSET,
                        timeout_seconds=_UNSET) -> GradientConfig:
  """Sets the gradient path's settings (the ones given; the others keep their value).

  Returns:
    The settings now in force.

  Raises:
    ConfigError: a setting out of range or an unknown compression.
  """
  global _config
  given = {k: v for k, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb),
                             ("compression", compression), ("timeout_seconds", timeout_seconds))
           if v is not _UNSET}
  if given.get("compression") in ("none", "None", ""):
    given["compression"] = None
  with _lock:
    _config = dataclasses.replace(_config, **given)
    return _config


def current() -> GradientConfig:
  """The settings in force."""
  return _config


def reset() -> GradientConfig:
  """Back to the defaults (tests)."""
  global _config
  with _lock:
    _config = GradientConfig()
    return _config
