"""Version-gated Keras 3 fixes for fit/evaluate/predict under MultiWorkerMirroredStrategy."""

import dataclasses
import functools
import inspect
import os
import threading
from typing import Callable

from absl import logging
import keras
import tensorflow as tf

from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers import layer as keras_layer
from keras.src.trainers import epoch_iterator as epoch_iterator_lib

from tfdp import cluster
from tfdp import fit_hooks

# Versions every fix was written against and tested on (prefixes).
TESTED_KERAS = "3.15."
TESTED_TF = "2.21."

DISABLE_ENV = "TFDP_COMPAT_DISABLE"

_MARK = "__tfdp_compat_fix__"


@dataclasses.dataclass(frozen=True)
class Fix:
  """One named patch of upstream code.

  Attributes:
    name: The name used in `TFDP_COMPAT_DISABLE`.
    doc: Which upstream behaviour the fix corrects (the install function's
      docstring).
    looks_as_expected: Returns True when the upstream target still has the
      shape the patch was written for (the bug is there and the patch fits).
    install: Patches upstream; returns a callable that undoes the patch.
  """

  name: str
  doc: str
  looks_as_expected: Callable[[], bool]
  install: Callable[[], Callable[[], None]]


_REGISTRY: dict[str, Fix] = {}
_applied: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()
_warned_versions = False


def _register(name, looks_as_expected):
  def decorator(install):
    _REGISTRY[name] = Fix(
        name=name,
        doc=inspect.cleandoc(install.__doc__ or ""),
        looks_as_expected=looks_as_expected,
        install=install,
    )
    return install

  return decorator


def _source_contains(obj, *snippets):
  """Whether the source of `obj` contains every snippet (False if unreadable)."""
  try:
    source = inspect.getsource(inspect.unwrap(obj))
  except (OSError, TypeError):
    return False
  return all(s in source for s in snippets)


def _patch_attr(owner, attr, replacement, fix_name):
  """Sets `owner.attr = replacement` and returns the undo callable.

  If `owner.attr` is already this fix (tfdp.compat was reloaded), nothing is
  patched twice.
  """
  original = owner.__dict__[attr] if isinstance(owner, type) else getattr(
      owner, attr)
  if getattr(original, _MARK, None) == fix_name:
    return lambda: None
  setattr(replacement, _MARK, fix_name)

  def undo():
    setattr(owner, attr, original)

  setattr(owner, attr, replacement)
  return undo


def _is_multi_replica(strategy):
  """Whether `strategy` mirrors variables over more than one replica."""
  return (
      isinstance(strategy, (tf.distribute.MirroredStrategy,
                            tf.distribute.MultiWorkerMirroredStrategy))
      and strategy.num_replicas_in_sync > 1
  )


# ---------------------------------------------------------------------------
# Fix: symbolic build from the first batch.


@_register(
    "symbolic_build_batch",
    looks_as_expected=lambda: _source_contains(
        tf_trainer.TensorFlowTrainer._maybe_symbolic_build,  # pylint: disable=protected-access
        "self.distribute_strategy.reduce(",
    ),
)
def _install_symbolic_build_batch():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer._maybe_symbolic_build.

  Upstream peeks at the first distributed batch and calls
  `strategy.reduce("MEAN", batch, axis=None)` on the whole (x, y, sw) nest to
  get one tensor per input. MultiWorkerMirroredStrategy's `reduce` does not
  accept a nest, so `fit`/`evaluate` fail with "Attempt to convert a value
  (PerReplica...) to a Tensor". Only shapes and dtypes are needed to build the
  model, so under MultiWorkerMirroredStrategy the patch takes the first local
  replica's value (no collective is launched) and hands that batch to the
  upstream function.
  """
  original = tf_trainer.TensorFlowTrainer._maybe_symbolic_build  # pylint: disable=protected-access

  @functools.wraps(original)
  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if iterator is None or not cluster.is_multi_worker(strategy):
      return original(self, iterator=iterator, data_batch=data_batch)
    for _, _, it in iterator:
      data_batch = tree.map_structure(
          lambda v: strategy.experimental_local_results(v)[0]
          if isinstance(v, tf.distribute.DistributedValues) else v,
          next(it),
      )
      break
    return original(self, iterator=None, data_batch=data_batch)

  return _patch_attr(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build",
                     _maybe_symbolic_build, "symbolic_build_batch")


# ---------------------------------------------------------------------------
# Fix: "mean" reduction of step outputs across workers.


@_register(
    "reduce_mean_axis",
    looks_as_expected=lambda: _source_contains(
        tf_trainer.reduce_per_replica,
        'strategy.reduce("MEAN", v, axis=0)',
    ),
)
def _install_reduce_mean_axis():
  """keras/src/backend/tensorflow/trainer.py reduce_per_replica.

  For multi-worker MultiWorkerMirroredStrategy upstream reduces the
  `reduction="mean"` (what "auto" means off TPU) outputs of `train_step` /
  `test_step` with `strategy.reduce("MEAN", v, axis=0)`, which also averages
  over dimension 0: scalar metrics fail with "Invalid reduction dimension 0
  for input with 0 dimensions", and other outputs get a shape different from
  MirroredStrategy's. The patch reduces with `axis=None` (an element-wise mean
  over all replicas of all workers, the value MirroredStrategy computes over
  its local replicas); every other case goes to upstream.
  """
  original = tf_trainer.reduce_per_replica

  @functools.wraps(original)
  def reduce_per_replica(values, strategy, reduction):
    resolved = reduction
    if resolved == "auto" and not isinstance(strategy,
                                             tf.distribute.TPUStrategy):
      resolved = "mean"
    if resolved != "mean" or not cluster.is_multi_worker(strategy):
      return original(values, strategy, reduction)
    return tree.map_structure(
        lambda v: strategy.reduce("MEAN", v, axis=None), values)

  return _patch_attr(tf_trainer, "reduce_per_replica", reduce_per_replica,
                     "reduce_mean_axis")


# ---------------------------------------------------------------------------
# Fix: steps_per_execution > 1.


@_register(
    "steps_per_execution_inline",
    looks_as_expected=lambda: _source_contains(
        tf_trainer.TensorFlowTrainer._make_function,  # pylint: disable=protected-access
        "one_step_on_data = tf.function(",
        "def multi_step_on_iterator(iterator):",
        "tf.cond(",
    ),
)
def _install_steps_per_execution_inline():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer._make_function.

  With `steps_per_execution > 1` upstream calls the step, its own
  `tf.function` (`one_step_on_data`), inside a `tf.cond` in a `tf.while_loop`
  (`multi_step_on_iterator`). Collective ops (the gradient all-reduce) take
  their instance key from a call-time capture
  (tensorflow/python/distribute/cross_device_utils.py
  CollectiveReplicaLauncher._next_instance_key) that a nested function call
  inside control flow does not forward, so `fit`/`evaluate` fail with "You
  must feed a value for placeholder tensor '.../while/cond/Placeholder' with
  dtype int32". Under multi-worker MultiWorkerMirroredStrategy with
  `steps_per_execution > 1` (and no `jit_compile`, no `run_eagerly`) the patch
  builds the same loop with the step traced inline, so the collectives live
  in the outer function, as in tf-keras; all other cases go to upstream.
  (MirroredStrategy on several CPUs has the same upstream failure; it is left
  as upstream.)
  """
  original = tf_trainer.TensorFlowTrainer._make_function  # pylint: disable=protected-access

  @functools.wraps(original)
  def _make_function(self, step_function):
    if (self.steps_per_execution <= 1 or self.run_eagerly or self.jit_compile
        or not cluster.is_multi_worker(self.distribute_strategy)):
      return original(self, step_function)
    return _inline_multi_step_function(self, step_function)

  return _patch_attr(tf_trainer.TensorFlowTrainer, "_make_function",
                     _make_function, "steps_per_execution_inline")


def _inline_multi_step_function(trainer, step_function):
  """Upstream's `_make_function` loop with the step traced inline."""

  @tf.autograph.experimental.do_not_convert
  def one_step_on_data(data):
    outputs = trainer.distribute_strategy.run(step_function, args=(data,))
    # Looked up at call time so the "reduce_mean_axis" fix applies here too.
    return tf_trainer.reduce_per_replica(
        outputs, trainer.distribute_strategy, reduction="auto")

  # Upstream's function for `train_on_batch`-style generators, one step per
  # call; the inline one for the loop.
  one_step_function = trainer._autoconvert_optionals(  # pylint: disable=protected-access
      tf.function(one_step_on_data, reduce_retracing=True))
  one_step_on_data = trainer._autoconvert_optionals(one_step_on_data)  # pylint: disable=protected-access

  @tf.autograph.experimental.do_not_convert
  def multi_step_on_iterator(iterator):
    steps = trainer.steps_per_execution
    # The spec is set while `tf.while_loop` traces the body, as upstream does.
    empty_outputs = tf.experimental.Optional.empty(None)

    def cond(execution_step, optional_outputs, next_optional_inputs):
      del optional_outputs
      return tf.logical_and(
          tf.less(execution_step, steps), next_optional_inputs.has_value())

    def inner_body(execution_step, optional_outputs, next_optional_inputs):

      def has_next():
        next_optional_outputs = tf.experimental.Optional.from_value(
            one_step_on_data(next_optional_inputs.get_value()))
        empty_outputs._element_spec = next_optional_outputs.element_spec  # pylint: disable=protected-access
        return next_optional_outputs

      def no_has_next():
        optional_outputs._element_spec = empty_outputs._element_spec  # pylint: disable=protected-access
        return optional_outputs

      next_optional_outputs = tf.cond(
          tf.logical_and(
              tf.less(execution_step, steps),
              next_optional_inputs.has_value()),
          has_next,
          no_has_next,
      )
      return (
          execution_step + 1,
          next_optional_outputs,
          tf.cond(
              tf.less(execution_step + 1, steps),
              iterator.get_next_as_optional,
              lambda: next_optional_inputs,
          ),
      )

    def body(execution_step, optional_outputs, next_optional_inputs):
      for _ in range(min(trainer.unrolled_steps_per_execution, steps)):
        execution_step, optional_outputs, next_optional_inputs = inner_body(
            execution_step, optional_outputs, next_optional_inputs)
      return execution_step, optional_outputs, next_optional_inputs

    _, final_optional_outputs, _ = tf.while_loop(
        cond,
        body,
        loop_vars=[
            tf.constant(0), empty_outputs, iterator.get_next_as_optional()
        ],
    )
    final_optional_outputs._element_spec = empty_outputs.element_spec  # pylint: disable=protected-access
    return final_optional_outputs

  multi_step_on_iterator = tf.function(
      multi_step_on_iterator, reduce_retracing=True)

  def function(iterator):
    if isinstance(iterator,
                  (tf.data.Iterator, tf.distribute.DistributedIterator)):
      opt_outputs = multi_step_on_iterator(iterator)
      if not opt_outputs.has_value():
        raise StopIteration
      return opt_outputs.get_value()
    outputs = None
    for _, data in zip(range(trainer.steps_per_execution), iterator):
      outputs = one_step_function(data)
    return outputs

  return function


# ---------------------------------------------------------------------------
# Fix: non-trainable layer weights (BatchNormalization statistics).


@_register(
    "non_trainable_mean_aggregation",
    looks_as_expected=lambda: (
        inspect.signature(keras_layer.Layer.add_weight)
        .parameters["aggregation"].default == "none"
        and _source_contains(
            keras.layers.BatchNormalization.build,
            'name="moving_mean"') and not _source_contains(
                keras.layers.BatchNormalization.build, "aggregation")),
)
def _install_non_trainable_mean_aggregation():
  """keras/src/layers/layer.py Layer.add_weight.

  Layer weights default to `aggregation="none"`. A MirroredVariable with no
  aggregation that is assigned in replica context (BatchNormalization's
  moving mean/variance during `fit`) only updates the local copy
  (tensorflow/python/distribute/values.py _on_write_update_replica). Under
  MultiWorkerMirroredStrategy every worker then ends `fit` with its own moving
  statistics: the workers' weights differ, and so do their checkpoints and
  predictions, with no error. Under MirroredStrategy each device keeps its own
  and a checkpoint holds device 0's, so 1 worker x 2 replicas and 2 workers x
  1 replica end with different statistics and a run cannot resume bitwise on
  another topology. tf-keras averaged them across replicas. Under any
  mirrored strategy with more than one replica the patch creates
  floating-point non-trainable layer weights whose caller left `aggregation`
  at its default with `aggregation="mean"`, so each replica-context update is
  averaged over all replicas (one small all-reduce per such weight per step).
  Other weights, and single-replica strategies, go to upstream unchanged.
  """
  original = keras_layer.Layer.add_weight

  @functools.wraps(original)
  def add_weight(self, *args, **kwargs):
    if (not kwargs.get("trainable", True)
        and kwargs.get("aggregation", "none") in ("none", None)
        and _is_multi_replica(tf.distribute.get_strategy())):
      dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
      dtype = (keras.backend.standardize_dtype(dtype)
               if dtype is not None else self.variable_dtype)
      if "float" in dtype:
        kwargs["aggregation"] = "mean"
    return original(self, *args, **kwargs)

  return _patch_attr(keras_layer.Layer, "add_weight", add_weight,
                     "non_trainable_mean_aggregation")


# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Hooks: the training data's position under plain `fit`; chief-only output.


@_register(
    "fit_data_state",
    looks_as_expected=lambda: _source_contains(
        epoch_iterator_lib.EpochIterator._enumerate_iterator,  # pylint: disable=protected-access
        "self._current_iterator = iter(self._get_iterator())",
        "range(0, steps_per_epoch, self.steps_per_execution)",
    ) and _source_contains(tf_trainer.TFEpochIterator.__init__, "experimental_distribute_dataset"),
)
def _install_fit_data_state():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer.fit, TFEpochIterator.

  Upstream makes the training data's distributed iterator inside `fit`
  before any callback runs; TF cannot checkpoint it, and `fit` always starts
  an epoch at its first step. With a callback that asks for the data position
  (`tfdp.callbacks.BackupAndRestore`), the patch gives the `tf.data` input
  checkpointable iterators (`tfdp.iterators`), lets the callback find them
  (`tfdp.fit_hooks.current`), and lets it start the resumed epoch at the
  restored step.
  """
  undo = [
      _patch_attr(tf_trainer.TensorFlowTrainer, "fit",
                  fit_hooks.wrap_fit(tf_trainer.TensorFlowTrainer.__dict__["fit"]),
                  "fit_data_state"),
      _patch_attr(tf_trainer.TFEpochIterator, "__init__",
                  fit_hooks.wrap_epoch_iterator_init(tf_trainer.TFEpochIterator.__dict__["__init__"]),
                  "fit_data_state"),
      _patch_attr(epoch_iterator_lib.EpochIterator, "_enumerate_iterator",
                  fit_hooks.wrap_enumerate_iterator(
                      epoch_iterator_lib.EpochIterator.__dict__["_enumerate_iterator"]),
                  "fit_data_state"),
  ]
  return lambda: [u() for u in reversed(undo)]


@_register(
    "chief_only_verbose",
    looks_as_expected=lambda: all(
        "verbose" in inspect.signature(getattr(tf_trainer.TensorFlowTrainer, m)).parameters
        for m in ("evaluate", "predict")),
)
def _install_chief_only_verbose():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer.evaluate, predict (and fit).

  Upstream prints a progress bar on every worker of a multi-worker job. The
  patch makes `verbose="auto"` (the default) mean 0 on non-chief workers; an
  explicit verbose is kept. `fit` gets it from the `fit_data_state` hook.
  """
  undo = [
      _patch_attr(tf_trainer.TensorFlowTrainer, m,
                  fit_hooks.wrap_quiet(tf_trainer.TensorFlowTrainer.__dict__[m]),
                  "chief_only_verbose")
      for m in ("evaluate", "predict")
  ]
  return lambda: [u() for u in reversed(undo)]


def disabled_fixes() -> frozenset[str]:
  """Returns the names of the fixes `TFDP_COMPAT_DISABLE` turns off.

  Raises:
    ConfigError: if the variable names a fix that does not exist.
  """
  from tfdp import errors  # pylint: disable=g-import-not-at-top

  raw = os.environ.get(DISABLE_ENV, "").strip()
  if not raw:
    return frozenset()
  names = {n.strip() for n in raw.split(",") if n.strip()}
  if "all" in names:
    return frozenset(_REGISTRY)
  unknown = names - set(_REGISTRY)
  if unknown:
    raise errors.ConfigError(
        f"{DISABLE_ENV} names unknown fixes {sorted(unknown)}; use 'all' or a "
        f"comma-separated subset of {sorted(_REGISTRY)}.")
  return frozenset(names)


def fixes() -> dict[str, Fix]:
  """Returns the registered fixes by name."""
  return dict(_REGISTRY)


def applied() -> frozenset[str]:
  """Returns the names of the fixes currently installed."""
  return frozenset(_applied)


def _versions_tested():
  return (keras.__version__.startswith(TESTED_KERAS)
          and tf.__version__.startswith(TESTED_TF))


def apply() -> frozenset[str]:
  """Installs every registered fix not disabled by `TFDP_COMPAT_DISABLE`.

  Idempotent. On the tested versions (Keras 3.15.x, TensorFlow 2.21.x) every
  enabled fix is installed. On other versions a warning is logged once, and
  each fix is installed only if the upstream code it patches still looks as
  expected (the buggy code is there); otherwise it is skipped with a warning.

  Returns:
    The names of the fixes installed after the call.

  Raises:
    ConfigError: if `TFDP_COMPAT_DISABLE` names an unknown fix.
  """
  global _warned_versions
  disabled = disabled_fixes()
  with _lock:
    tested = _versions_tested()
    if not tested and not _warned_versions:
      _warned_versions = True
      logging.warning(
          "tfdp.compat was tested on Keras %sx and TensorFlow %sx, found Keras "
          "%s and TensorFlow %s; installing only the fixes whose upstream "
          "code still looks as expected.", TESTED_KERAS, TESTED_TF,
          keras.__version__, tf.__version__)
    for name, fix in _REGISTRY.items():
      if name in _applied:
        continue
      if name in disabled:
        logging.info("tfdp.compat: %s disabled by %s.", name, DISABLE_ENV)
        continue
      if not tested and not fix.looks_as_expected():
        logging.warning(
            "tfdp.compat: skipping %s: the upstream code it patches changed.",
            name)
        continue
      _applied[name] = fix.install()
    return frozenset(_applied)


def revert() -> None:
  """Removes every installed fix, restoring upstream behaviour."""
  with _lock:
    for name in reversed(list(_applied)):
      _applied.pop(name)()
