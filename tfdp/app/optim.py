"""Optimizers and learning-rate schedules (Goyal et al.'s large-batch recipe) from a config."""

import math

import keras

from tfdp import errors

OPTIMIZERS = ("auto", "sgd", "adamw", "adam")
DECAYS = ("constant", "cosine", "linear")
REFERENCE_BATCH = 256
# Biases and normalisation scales/offsets are not decayed (Goyal et al. §5.1;
# BERT's AdamW likewise skips LayerNorm and biases).
NO_DECAY = ("bias", "gamma", "beta")


def peak_learning_rate(global_batch_size, *, learning_rate=None,
                       base_learning_rate=None, default=0.05, scale_default=False):
  """The learning rate after warmup.

  Args:
    global_batch_size: examples per step across all replicas.
    learning_rate: an absolute rate; wins over everything.
    base_learning_rate: the rate per 256 examples, scaled linearly:
      base * global_batch_size / 256 (Goyal et al.'s linear scaling rule).
    default: the model's default rate.
    scale_default: `default` is per 256 examples and is scaled too.

  Returns:
    A positive float.

  Raises:
    ConfigError: a rate is not positive, or both rates are given.
  """
  if learning_rate is not None and base_learning_rate is not None:
    raise errors.ConfigError(
        "Pass --learning_rate (absolute) or --base_learning_rate (per 256 "
        "examples, scaled by the global batch), not both.")
  for flag, value in (("learning_rate", learning_rate),
                      ("base_learning_rate", base_learning_rate)):
    if value is not None and value <= 0:
      raise errors.ConfigError(f"--{flag} must be > 0, got {value}.")
  if learning_rate is not None:
    return float(learning_rate)
  if base_learning_rate is not None:
    return base_learning_rate * global_batch_size / REFERENCE_BATCH
  return default * global_batch_size / REFERENCE_BATCH if scale_default else float(default)


@keras.saving.register_keras_serializable("tfdp")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warmup from 0 to `peak` over `warmup_steps`, then constant, cosine or linear decay.

  A pure function of the step: a restored optimizer (whose `iterations` is
  the global step) resumes the schedule exactly, with nothing else to save.
  Decay ends at 0 at `total_steps`.
  """

  def __init__(self, peak, warmup_steps=0, decay="constant", total_steps=None):
    if decay not in DECAYS:
      raise errors.ConfigError(f"--lr_decay must be one of {', '.join(DECAYS)}, got {decay!r}.")
    if warmup_steps < 0:
      raise errors.ConfigError(f"--warmup_steps must be >= 0, got {warmup_steps}.")
    if decay != "constant" and not (total_steps and total_steps > warmup_steps):
      raise errors.ConfigError(
          f"--lr_decay={decay} needs --train_steps ({total_steps}) greater than "
          f"--warmup_steps ({warmup_steps}).")
    self.peak = float(peak)
    self.warmup_steps = int(warmup_steps)
    self.decay = decay
    self.total_steps = total_steps

  def __call__(self, step):
    ops = keras.ops
    step = ops.cast(step, "float32")
    lr = ops.convert_to_tensor(self.peak, "float32")
    if self.decay != "constant":
      frac = ops.clip((step - self.warmup_steps) / float(self.total_steps - self.warmup_steps),
                      0.0, 1.0)
      if self.decay == "cosine":
        lr = lr * 0.5 * (1.0 + ops.cos(math.pi * frac))
      else:
        lr = lr * (1.0 - frac)
    if self.warmup_steps:
      # Step k trains with (k + 1) / warmup of the peak, so step 0 moves too.
      lr = lr * ops.minimum(1.0, (step + 1.0) / self.warmup_steps)
    return lr

  def get_config(self):
    return dict(peak=self.peak, warmup_steps=self.warmup_steps, decay=self.decay,
                total_steps=self.total_steps)


@keras.saving.register_keras_serializable("tfdp")
class SGD(keras.optimizers.SGD):
  """Momentum SGD with L2 weight decay added to the gradient (before momentum).

  That is the weight decay of Goyal et al. (and of torch.optim.SGD);
  Keras's own `weight_decay` is decoupled (w -= lr * wd * w after the
  update), which under momentum 0.9 decays about 10x less.
  """

  def __init__(self, *args, l2=0.0, **kwargs):
    super().__init__(*args, **kwargs)
    self.l2 = float(l2)

  def update_step(self, gradient, variable, learning_rate):
    if self.l2 and self._use_weight_decay(variable):
      gradient = gradient + keras.ops.cast(self.l2, variable.dtype) * variable
    super().update_step(gradient, variable, learning_rate)

  def get_config(self):
    return dict(super().get_config(), l2=self.l2)


def make_optimizer(kind, learning_rate, *, momentum=0.9, weight_decay=0.0):
  """A Keras optimizer.

  Args:
    kind: sgd (momentum, L2 weight decay), adamw (decoupled weight decay) or
      adam (no weight decay allowed).
    learning_rate: a float or a LearningRateSchedule.
    momentum: SGD momentum.
    weight_decay: see `kind`; biases and normalisation parameters are exempt.

  Returns:
    An unbuilt optimizer.
  """
  if weight_decay < 0:
    raise errors.ConfigError(f"--weight_decay must be >= 0, got {weight_decay}.")
  if kind == "sgd":
    opt = SGD(learning_rate, momentum=momentum, l2=weight_decay)
  elif kind == "adamw":
    opt = keras.optimizers.AdamW(learning_rate, weight_decay=weight_decay)
  elif kind == "adam":
    if weight_decay:
      raise errors.ConfigError(
          "--optimizer=adam has no weight decay; use --optimizer=adamw or "
          "--weight_decay=0.")
    opt = keras.optimizers.Adam(learning_rate)
  else:
    raise errors.ConfigError(
        f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}.")
  if weight_decay:
    opt.exclude_from_weight_decay(var_names=list(NO_DECAY))
  return opt


def from_config(config, spec):
  """The optimizer of a TrainConfig for the model of `spec` (a models.ModelSpec).

  Unset fields (None, `auto`) take the model's defaults.
  """
  peak = peak_learning_rate(
      config.global_batch_size, learning_rate=config.learning_rate,
      base_learning_rate=config.base_learning_rate, default=spec.learning_rate,
      scale_default=spec.scale_learning_rate)
  schedule = WarmupSchedule(peak, config.warmup_steps, config.lr_decay, config.train_steps)
  kind = spec.optimizer if config.optimizer == "auto" else config.optimizer
  wd = spec.weight_decay if config.weight_decay is None else config.weight_decay
  if kind == "adam" and config.weight_decay is None:
    wd = 0.0
  return make_optimizer(kind, schedule, momentum=config.momentum, weight_decay=wd)
