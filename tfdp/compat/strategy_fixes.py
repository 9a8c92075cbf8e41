"""The fixes of Keras's steps under mirrored strategies: model build, metric reduction, multi-step loop, weight aggregation."""

import functools

import keras
import tensorflow as tf

from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers import layer as keras_layer
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values

from tfdp.distribute import cluster
from tfdp.compat import multi_step
from tfdp.compat import probes
from tfdp.compat.registry import patch_attr
from tfdp.compat.registry import register

_Trainer = tf_trainer.TensorFlowTrainer


def _is_multi_replica(strategy):
  """Whether `strategy` mirrors variables over more than one replica."""
  return (
      isinstance(strategy, (tf.distribute.MirroredStrategy,
                            tf.distribute.MultiWorkerMirroredStrategy))
      and strategy.num_replicas_in_sync > 1
  )


# ---------------------------------------------------------------------------
# Fix: symbolic build from the input's element spec.


def _probe_symbolic_build_batch():
  # The patch calls upstream with (iterator=None, data_batch=specs or a
  # batch): upstream must still build from `data_batch`, use only its shapes
  # and dtypes, and still peek (and reduce) a batch otherwise; the specs come
  # from the epoch iterator's distributed dataset.
  return [
      *probes.params(_Trainer, "_maybe_symbolic_build", ("self", "iterator", "data_batch")),
      *probes.reads(_Trainer, "_maybe_symbolic_build", "self._distribute_strategy",
                    "for _, _, it in iterator:", "self.distribute_strategy.reduce(",
                    "self._symbolic_build(data_batch=data_batch)", ordered=True),
      *probes.reads(_Trainer, "_symbolic_build", "def to_symbolic_input(v):",
                    "v.shape, backend.standardize_dtype(v.dtype)",
                    "data_batch = tree.map_structure(to_symbolic_input, data_batch)",
                    ordered=True),
      *probes.reads(tf_trainer.TFEpochIterator, "__init__",
                    "self._distributed_dataset = dataset"),
      *probes.multi_worker_attributes(),
  ]


def _element_spec(epoch_iterator):
  """One replica's spec of an element of the epoch iterator's distributed input, or None."""
  spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
  if spec is None:
    return None
  return tf.nest.map_structure(
      lambda s: s._value_specs[0] if isinstance(s, values.PerReplicaSpec) else s,  # pylint: disable=protected-access
      spec)


@register("symbolic_build_batch", _probe_symbolic_build_batch,
          "fit and evaluate under a multi-worker MultiWorkerMirroredStrategy may fail "
          "building the model from its first batch, and under any strategy a reshuffling "
          "dataset is seen one reshuffle later than without one")
def _install_symbolic_build_batch():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer._maybe_symbolic_build.

  Under a strategy upstream makes an iterator of the input, takes its first
  distributed batch and calls `strategy.reduce("MEAN", batch, axis=None)` on
  the whole (x, y, sw) nest to get one tensor per input, then discards that
  iterator. MultiWorkerMirroredStrategy's `reduce` does not accept a nest,
  so `fit`/`evaluate` fail with "Attempt to convert a value (PerReplica...)
  to a Tensor". Under any strategy the extra iterator draws the next seeds of
  every reshuffling `shuffle` in the pipeline, so each epoch sees the order a
  run without a strategy sees one epoch later: the same script trains on
  other batches on one device and on two. Only shapes and dtypes are used to
  build the model, so the patch hands upstream the element spec of one
  replica's input instead of a batch: no iterator is made, no batch read, no
  collective launched. An input without an element spec goes to upstream
  (under multi-worker MultiWorkerMirroredStrategy with its first local
  replica's batch instead of the reduce).
  """
  original = _Trainer._maybe_symbolic_build  # pylint: disable=protected-access

  @functools.wraps(original)
  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if iterator is None or strategy is None:
      return original(self, iterator=iterator, data_batch=data_batch)
    spec = _element_spec(iterator)
    if spec is not None:
      return original(self, iterator=None, data_batch=spec)
    if not cluster.is_multi_worker(strategy):
      return original(self, iterator=iterator, data_batch=data_batch)
    for _, _, it in iterator:
      data_batch = tree.map_structure(
          lambda v: strategy.experimental_local_results(v)[0]
          if isinstance(v, tf.distribute.DistributedValues) else v,
          next(it),
      )
      break
    return original(self, iterator=None, data_batch=data_batch)

  return patch_attr(_Trainer, "_maybe_symbolic_build", _maybe_symbolic_build,
                    "symbolic_build_batch")


# ---------------------------------------------------------------------------
# Fix: "mean" reduction of step outputs across workers.


def _probe_reduce_mean_axis():
  # The patch replaces the module's function: the steps must still look it
  # up there when they run (not hold a reference of their own).
  return [
      *probes.params(tf_trainer, "reduce_per_replica", ("values", "strategy", "reduction")),
      *probes.reads(tf_trainer, "reduce_per_replica", "isinstance(strategy, tf.distribute.TPUStrategy)",
                    'reduction = "mean"', 'strategy.reduce("MEAN", v, axis=0)', ordered=True),
      *probes.reads(_Trainer, "_make_function", "reduce_per_replica(", 'reduction="auto"'),
      *probes.multi_worker_attributes(),
  ]


@register("reduce_mean_axis", _probe_reduce_mean_axis,
          "fit and evaluate under a multi-worker MultiWorkerMirroredStrategy may fail "
          "reducing scalar metrics")
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
    if resolved == "auto" and not isinstance(strategy, tf.distribute.TPUStrategy):
      resolved = "mean"
    if resolved != "mean" or not cluster.is_multi_worker(strategy):
      return original(values, strategy, reduction)
    return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)

  return patch_attr(tf_trainer, "reduce_per_replica", reduce_per_replica, "reduce_mean_axis")


# ---------------------------------------------------------------------------
# Fix: predict's concatenation across workers of dtypes collectives cannot gather.

# What TF's CollectiveGather kernels take (tensorflow/core/kernels/collective_ops.cc).
_GATHERABLE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _wider(dtype):
  """The dtype a collective gathers `dtype` in, exactly: int64 for integers, float32 for the rest."""
  return tf.int64 if dtype.is_integer else tf.float32


def _cast_local(value, dtype):
  """`value` (a tensor or one worker's PerReplica) cast to `dtype`, replica by replica."""
  if isinstance(value, values.PerReplica):
    return values.PerReplica(tuple(tf.cast(v, dtype) for v in value.values))
  return tf.cast(value, dtype)


def _dtype_of(value):
  parts = value.values if isinstance(value, values.PerReplica) else (value,)
  return getattr(parts[0], "dtype", None) if parts and isinstance(parts[0], tf.Tensor) else None


def _probe_concat_gather_dtypes():
  # The patch wraps the module's function, as reduce_mean_axis does; upstream
  # must still concatenate multi-worker outputs with `strategy.gather`.
  return [
      *probes.params(tf_trainer, "reduce_per_replica", ("values", "strategy", "reduction")),
      *probes.reads(tf_trainer, "reduce_per_replica", 'if reduction == "concat":',
                    "return _multi_worker_concat(v, strategy)", ordered=True),
      *probes.reads(tf_trainer, "_multi_worker_concat", "strategy.gather(v, axis=0)"),
      *probes.reads(_Trainer, "make_predict_function", "reduce_per_replica(",
                    'reduction="concat"'),
      *probes.multi_worker_attributes(),
  ]


@register("concat_gather_dtypes", _probe_concat_gather_dtypes,
          "predict under a multi-worker MultiWorkerMirroredStrategy fails on outputs in "
          "bfloat16 (mixed_bfloat16), int8, bool and other dtypes collectives cannot gather")
def _install_concat_gather_dtypes():
  """keras/src/backend/tensorflow/trainer.py reduce_per_replica (reduction="concat").

  Across workers upstream concatenates `predict`'s outputs with
  `strategy.gather`, a collective whose kernels take float16, float32,
  float64, int32 and int64 only: a model under the mixed_bfloat16 policy
  fails with "Value passed to parameter 'input' has DataType bfloat16 not
  in list of allowed values". The patch gathers such outputs cast to
  float32 (int64 for integers), which holds every value exactly, and casts
  the result back; every other case goes to upstream.
  """
  original = tf_trainer.reduce_per_replica

  @functools.wraps(original)
  def reduce_per_replica(values_, strategy, reduction):
    if reduction != "concat" or not cluster.is_multi_worker(strategy):
      return original(values_, strategy, reduction)

    def concat(v):
      dtype = _dtype_of(v)
      if dtype is None or dtype in _GATHERABLE:
        return original(v, strategy, reduction)
      return tf.cast(original(_cast_local(v, _wider(dtype)), strategy, reduction), dtype)

    return tree.map_structure(concat, values_)

  return patch_attr(tf_trainer, "reduce_per_replica", reduce_per_replica, "concat_gather_dtypes")


# ---------------------------------------------------------------------------
# Fix: steps_per_execution > 1.

# Where a strategy's extended keeps the cross-device ops its steps reduce
# with: MirroredExtended (the device all-reduce) and
# CollectiveAllReduceExtended (that, and one for host tensors).
_CROSS_DEVICE_OPS_ATTRS = ("_cross_device_ops", "_host_cross_device_ops")


def defers_collective_keys(strategy) -> bool:
  """Whether a step of `strategy` launches collective ops whose instance key is fed at call time.

  It does when the cross-device ops its steps all-reduce with are
  `CollectiveAllReduce` over more than one participant (devices of this
  worker and of the others) and its launchers take unique instance keys
  (TF 2: `CollectiveReplicaLauncher._next_instance_key` captures the key as a
  call-time value of the function being built). That is
  MultiWorkerMirroredStrategy on several workers or several local replicas,
  and MirroredStrategy over several devices with its default cross-device ops
  (or any collective-based ones); not one replica, not the default strategy,
  not a MirroredStrategy that reduces with ReductionToOneDevice,
  HierarchicalCopyAllReduce or NcclAllReduce.
  """
  if strategy is None:
    return False
  extended = strategy.extended
  for attr in _CROSS_DEVICE_OPS_ATTRS:
    ops = getattr(extended, attr, None)
    if (isinstance(ops, cross_device_ops_lib.CollectiveAllReduce)
        and ops._group_size > 1  # pylint: disable=protected-access
        and any(launcher._use_unique_instance_key()  # pylint: disable=protected-access
                for launcher in ops._launchers)):  # pylint: disable=protected-access
      return True
  return False


def _probe_steps_per_execution_inline():
  # The inline loop copies upstream's (tfdp.compat.multi_step): the bug's
  # shape, the private names both use, and that train/test functions are
  # still made by `_make_function`. `defers_collective_keys` reads where the
  # strategies keep their cross-device ops, which ones the steps use, and
  # how a launcher takes its instance keys (the cause: a call-time capture
  # that control flow moves to the outer function graph, which the nested
  # step function's caller does not feed).
  launcher = cross_device_utils.CollectiveReplicaLauncher
  return [
      *probes.params(_Trainer, "_make_function", ("self", "step_function")),
      *probes.reads(_Trainer, "_make_function", "one_step_on_data = tf.function(",
                    "self._autoconvert_optionals(one_step_on_data)",
                    "def multi_step_on_iterator(iterator):", "tf.cond(",
                    "._element_spec = ", "self.unrolled_steps_per_execution",
                    "raise StopIteration"),
      *probes.reads(_Trainer, "make_train_function", "self._make_function(self.train_step)"),
      *probes.reads(_Trainer, "make_test_function", "self._make_function(self.test_step)"),
      *probes.reads(_Trainer, "__init__", "self.unrolled_steps_per_execution = "),
      *probes.reads(launcher, "_next_instance_key", "if self._use_unique_instance_key():",
                    "while getattr(graph, 'is_control_flow_graph', False):",
                    "graph = graph.outer_graph", "graph.capture_call_time_value(", ordered=True),
      *probes.defines(launcher, "_use_unique_instance_key"),
      *probes.reads(cross_device_ops_lib.CollectiveAllReduce, "__init__",
                    "self._group_size = group_size", "self._launchers.append(launcher)"),
      *probes.reads(mirrored_strategy.MirroredExtended, "_initialize_strategy",
                    "self._cross_device_ops = self._collective_ops"),
      *probes.reads(mirrored_strategy.MirroredExtended, "_get_cross_device_ops",
                    "return self._cross_device_ops"),
      *probes.reads(collective_all_reduce_strategy.CollectiveAllReduceExtended,
                    "_get_cross_device_ops", "return self._cross_device_ops",
                    "return self._host_cross_device_ops"),
  ]


@register("steps_per_execution_inline", _probe_steps_per_execution_inline,
          "fit and evaluate with steps_per_execution > 1 fail under a strategy that "
          "all-reduces with collective ops (MultiWorkerMirroredStrategy; MirroredStrategy "
          "over several devices with its default cross-device ops)")
def _install_steps_per_execution_inline():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer._make_function.

  With `steps_per_execution > 1` upstream calls the step, its own
  `tf.function` (`one_step_on_data`), inside a `tf.cond` in a `tf.while_loop`
  (`multi_step_on_iterator`). Collective ops (the gradient all-reduce) take
  their instance key from a call-time capture
  (tensorflow/python/distribute/cross_device_utils.py
  CollectiveReplicaLauncher._next_instance_key), which control flow puts in
  the graph of the function around it: the step function's own graph, whose
  caller inside the loop does not feed it. `fit`/`evaluate` then fail with
  "You must feed a value for placeholder tensor '.../while/cond/Placeholder'
  with dtype int32". Under every strategy whose step launches such
  collectives (`defers_collective_keys`: MultiWorkerMirroredStrategy with
  more than one replica in all, MirroredStrategy over several devices with
  collective cross-device ops, its default) and with `steps_per_execution >
  1` (and no `jit_compile`, no `run_eagerly`), the patch builds the same loop
  with the step traced inline, so the collectives live in the outer
  function, whose call feeds their keys, as in tf-keras; all other cases go
  to upstream.
  """
  original = _Trainer._make_function  # pylint: disable=protected-access

  @functools.wraps(original)
  def _make_function(self, step_function):
    if (self.steps_per_execution <= 1 or self.run_eagerly or self.jit_compile
        or not defers_collective_keys(self.distribute_strategy)):
      return original(self, step_function)
    return multi_step.inline_multi_step_function(self, step_function)

  return patch_attr(_Trainer, "_make_function", _make_function, "steps_per_execution_inline")


# ---------------------------------------------------------------------------
# Fix: non-trainable layer weights (BatchNormalization statistics).


def _probe_non_trainable_mean_aggregation():
  # The patch reads dtype, trainable and aggregation from the call's keywords
  # (dtype also third positional, Keras 2 style) and the layer's
  # variable_dtype, as upstream does.
  return [
      *probes.params(keras_layer.Layer, "add_weight", ("self", "args"),
                     {"dtype": None, "trainable": True, "aggregation": "none"}),
      *probes.reads(keras_layer.Layer, "add_weight", "dtype = args[2]", "self.variable_dtype"),
      *probes.defines(keras_layer.Layer, "variable_dtype"),
      *probes.reads(keras.layers.BatchNormalization, "build", 'name="moving_mean"',
                    'name="moving_variance"', "trainable=False"),
      *probes.omits(keras.layers.BatchNormalization, "build", "aggregation"),
  ]


@register("non_trainable_mean_aggregation", _probe_non_trainable_mean_aggregation,
          "BatchNormalization statistics (and other non-trainable weights) differ "
          "between replicas and workers after fit")
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

  return patch_attr(keras_layer.Layer, "add_weight", add_weight,
                    "non_trainable_mean_aggregation")
