"""What a training state is (variables, step, RNG, run config) and when a saved one fits this run."""

import json

from absl import logging
import keras
import tensorflow as tf

from tfdp import errors

STATE_VERSION = 1
RUN_CONFIG_KEY = "run_config/.ATTRIBUTES/py_state"
# The model's Keras config (its architecture, as `model.to_json()`'s), so
# that `tfdp-ckpt export --format=keras` rebuilds any Keras model.
MODEL_CONFIG_KEY = "keras_model/.ATTRIBUTES/py_state"
ITERATIONS_KEY = "optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE"

# Run-config entries that must match for a resumed run to see the same data
# and the same updates. Others (world size, replicas) may change on resume.
MUST_MATCH = ("global_batch_size", "dataset", "seed")


def global_step(model: keras.Model) -> int:
  """The global step of a compiled Keras model: its optimizer's updates so far (survives resumes).

  Read from one local copy: every replica's copy of a mirrored (on-write)
  variable holds the same value after a step, and reading one costs about
  30 us where the mirrored read costs 130-300 us (the callbacks read it at
  every step).
  """
  v = _tf_variable(model.optimizer.iterations)
  copies = getattr(v, "values", None)
  if copies and v.synchronization != tf.VariableSynchronization.ON_READ:
    v = copies[0]
  return int(v.value().numpy())  # One op (`numpy()` adds an identity).


def _tree(keyed):
  """A trackable tree of `(key, variable)` pairs, each key a '/'-separated Keras path.

  Keras 3 layers do not track every variable for `tf.train.Checkpoint` (the
  state of `SeedGenerator`s, such as dropout's, is left out), and the keys of
  what they do track name layers by position. A tree built from
  `variable.path` saves all of them under readable, stable keys such as
  `model/conv2d/kernel/.ATTRIBUTES/VARIABLE_VALUE`.
  """
  root = tf.Module()
  seen = set()
  for key, v in keyed:
    parts = key.split("/")
    if key in seen:
      raise errors.ConfigError(
          f"Two variables share the path {key!r}; give the layers distinct names.")
    seen.add(key)
    node = root
    for part in parts[:-1]:
      child = getattr(node, part, None)
      if child is None:
        child = tf.Module()
        setattr(node, part, child)
      node = child
    setattr(node, parts[-1], _tf_variable(v))
  return root


def _optimizer_keys(optimizer):
  """The optimizer's variables keyed by their paths without the optimizer's name.

  So the keys do not depend on the name Keras gave the optimizer ("adam",
  "adam_1"). A LossScaleOptimizer's inner optimizer's variables get the keys
  they have without it (its `iteration` is the global step,
  ITERATIONS_KEY), and the wrapper's own variables (the loss scale, its step
  counter) keep their full path, e.g. `loss_scale_optimizer/dynamic_scale`.
  """
  inner = getattr(optimizer, "inner_optimizer", None)
  inner_ids = {id(v) for v in inner.variables} if inner is not None else set()
  keyed = []
  for v in optimizer.variables:
    parts = v.path.split("/")
    strip = len(parts) > 1 and (inner is None or id(v) in inner_ids)
    keyed.append(("/".join(parts[1:] if strip else parts), v))
  return keyed


def _tf_variable(v):
  """The `tf.Variable` behind a Keras variable (which wraps one)."""
  return v if isinstance(v, tf.Variable) else v.value


class _JsonState(tf.train.experimental.PythonState):
  """A dict saved as JSON text in the checkpoint.

  A Python-state string, not a tf.Variable: MultiWorkerMirroredStrategy
  broadcasts every variable's initial value, and collectives carry no strings.
  `fixed`: the dict is tfdp's own and never changes in place (a model's
  config), so its text is made once, when it is set, not at every save: a
  ResNet-50's config is 169 KB of JSON, 8 ms to make, and a local save at
  every step would make it on the training thread at every step.
  """

  def __init__(self, value, fixed: bool = False):
    self._fixed = fixed
    self._text = None
    self.value = value

  @property
  def value(self):
    return self._value

  @value.setter
  def value(self, value):
    self._value = value
    self._text = json.dumps(value, sort_keys=True) if self._fixed else None

  def serialize(self):
    return self._text if self._text is not None else json.dumps(self.value, sort_keys=True)

  def deserialize(self, string_value):
    raw = string_value.decode() if isinstance(string_value, bytes) else string_value
    self.value = json.loads(raw)


class TrainState:
  """The checkpointable state of a Keras training run.

  Holds the model's variables (including non-trainable ones and the RNG state
  of every `SeedGenerator`), the optimizer's variables (its iteration count
  is the global step, which also fixes the data position and the learning
  rate schedule), the run config as JSON, so that a restore can refuse a
  checkpoint of another run, and the model's Keras config (its
  architecture; empty for a model Keras cannot serialize), so that the
  checkpoint alone rebuilds the model.

  Create it under the strategy's scope after the model is built; it builds
  the optimizer's variables if they do not exist yet.

  Args:
    model: a built `keras.Model`.
    optimizer: its optimizer (default: `model.optimizer`).
    run_config: dict describing the run (global_batch_size, dataset, seed,
      world_size, ...). Saved with the state.
  """

  def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None, *,
               run_config: dict | None = None):
    self.model = model
    self.optimizer = optimizer or model.optimizer
    if self.optimizer is None:
      raise errors.ConfigError("TrainState needs a compiled model or an optimizer.")
    if not self.optimizer.built:
      self.optimizer.build(model.trainable_variables)
    self.run_config = dict(run_config or {}, state_version=STATE_VERSION)
    self.checkpoint = tf.train.Checkpoint(
        model=_tree((v.path, v) for v in model.variables),
        optimizer=_tree(_optimizer_keys(self.optimizer)),
        run_config=_JsonState(self.run_config),
        keras_model=_JsonState(model_config(model), fixed=True))

  @property
  def step(self) -> int:
    """The global step: optimizer updates applied so far."""
    return int(self.optimizer.iterations.numpy())

  def check_compatible(self, saved: dict, allow_mismatch: bool = False) -> list[str]:
    """Raises IncompatibleCheckpointError if `saved` (a run config) differs where it must not."""
    diffs = [f"{k}: checkpoint has {saved.get(k)!r}, this run has {self.run_config.get(k)!r}"
             for k in MUST_MATCH
             if k in saved and k in self.run_config and saved[k] != self.run_config[k]]
    if diffs and not allow_mismatch:
      raise errors.IncompatibleCheckpointError(
          "The checkpoint was written by a run with another config ("
          + "; ".join(diffs) + "). Resuming would not continue that run "
          "exactly. Use a new --model_dir, or pass "
          "--allow_config_mismatch (allow_mismatch=True) to load it anyway.")
    return diffs


def model_config(model: keras.Model) -> dict:
  """`model`'s Keras config without its compile state (what `keras.saving.deserialize_keras_object` rebuilds); {} if Keras cannot serialize it."""
  try:
    config = keras.saving.serialize_keras_object(model)
    json.dumps(config)
  except Exception as e:  # pylint: disable=broad-except
    logging.info("tfdp: checkpoints of %s hold no model config (%s: %s); tfdp-ckpt export "
                 "--format=keras will need the model built in code.", model.name,
                 type(e).__name__, e)
    return {}
  config.pop("compile_config", None)  # Names the optimizer and loss: not the architecture.
  return config


def read_model_config(path: str) -> dict:
  """The model config stored in the checkpoint at `path` ({} if it has none)."""
  return _read_json(path, MODEL_CONFIG_KEY)


def check_checkpoint(train_state: "TrainState", path: str, allow_mismatch: bool = False) -> list[str]:
  """`train_state.check_compatible` against the run config saved at `path`.

  A checkpoint whose run config cannot be read (a missing or short file
  raises IndexError or an OpError in TF's reader, bad JSON a ValueError)
  passes: restoring it will say what is wrong with it (and set it aside when
  it is corrupt). Callers check file sizes first (restore_newest_intact).

  Returns:
    The differences allowed by `allow_mismatch` (see check_compatible).
  """
  try:
    saved = read_run_config(path)
  except (tf.errors.OpError, IndexError, ValueError):
    return []
  return train_state.check_compatible(saved, allow_mismatch)


def read_run_config(path: str) -> dict:
  """The run config stored in the checkpoint at `path` ({} if it has none)."""
  return _read_json(path, RUN_CONFIG_KEY)


def _read_json(path: str, key: str) -> dict:
  reader = tf.train.load_checkpoint(path)
  if not reader.has_tensor(key):
    return {}
  raw = reader.get_tensor(key)
  return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
