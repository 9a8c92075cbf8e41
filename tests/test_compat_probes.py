"""Tests of tfdp.compat's probes: a fix whose upstream code changed is not installed, a warning says what changed (in-process)."""

import dataclasses
import os

from absl import logging
import keras
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.callbacks import csv_logger
from keras.src.callbacks import tensorboard
from keras.src.layers import layer as keras_layer
from keras.src.optimizers import loss_scale_optimizer
from keras.src.trainers import data_adapters
from keras.src.trainers import epoch_iterator as epoch_iterator_lib
from keras.src.trainers import trainer as base_trainer
import pytest
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.framework import ops

from tfdp import compat

_Trainer = tf_trainer.TensorFlowTrainer
_TFEpochIterator = tf_trainer.TFEpochIterator
_EpochIterator = epoch_iterator_lib.EpochIterator

# What a later Keras or TF could look like. Each function is the upstream one
# with one assumption of a fix broken; none of them runs.
# pylint: disable=protected-access,unused-argument


def _tf_apply_finite_after_the_reduce(self, grads, trainable_variables=None):
  # A later Keras that all-reduces before its finiteness check itself.
  self._common_apply(grads, trainable_variables=trainable_variables)


def _all_reduce_in_apply(self, grads, trainable_variables, learning_rate):
  # A later Keras whose update step no longer all-reduces (it does so earlier).
  self._distributed_tf_update_step(self._distribution_strategy, list(zip(grads, trainable_variables)),
                                   learning_rate)


def _get_iterator_of_another_dataset(self):
  # The attribute is still set by __init__, but fit no longer iterates it.
  return self._dataset_for_this_epoch


def _enumerate_iterator_fresh_each_epoch(self):
  self.data_adapter.on_epoch_begin()
  self._current_iterator = iter(self._get_iterator())
  for step in range(0, self.steps_per_epoch, self.steps_per_execution):
    yield step, step + self.steps_per_execution - 1, self._current_iterator


def _iter_without_enumerate(self):
  self._epoch_iterator = self.enumerate_epoch()
  return self


def _fit_reading_initial_epoch_too_early(self, x=None, y=None, epochs=1, verbose="auto",
                                         callbacks=None, initial_epoch=0):
  epoch_iterator = TFEpochIterator(x=x, y=y)  # pylint: disable=undefined-variable
  initial_epoch = self._initial_epoch or initial_epoch
  callbacks = CallbackList(callbacks, add_progbar=verbose != 0)  # pylint: disable=undefined-variable
  callbacks.on_train_begin()
  for _ in range(initial_epoch, epochs):
    for begin_step, end_step, iterator in epoch_iterator:
      callbacks.on_train_batch_end(end_step, self.train_function(iterator))


def _maybe_symbolic_build_fixed_upstream(self, iterator=None, data_batch=None):
  if self._distribute_strategy is None:
    return
  if iterator is not None:
    for _, _, it in iterator:
      data_batch = self.distribute_strategy.experimental_local_results(next(it))[0]
      break
  with self.distribute_strategy.scope():
    self._symbolic_build(data_batch=data_batch)


def _maybe_symbolic_build_batch_first(self, data_batch=None, iterator=None):
  if self._distribute_strategy is None:
    return
  if iterator is not None:
    for _, _, it in iterator:
      data_batch = self.distribute_strategy.reduce("MEAN", next(it), axis=None)
      break
  with self.distribute_strategy.scope():
    self._symbolic_build(data_batch=data_batch)


def _symbolic_build_from_values(self, iterator=None, data_batch=None):
  # The batch's values are used, not only its shapes and dtypes: specs would not do.
  y_pred = self(data_batch[0])
  return self.compute_loss(data_batch[0], data_batch[1], y_pred)


def _reduce_per_replica_fixed_upstream(values, strategy, reduction):
  if reduction == "auto":
    reduction = "mean"
  return strategy.reduce("MEAN", values, axis=None)


def _multi_worker_concat_all_dtypes(v, strategy):
  return strategy.experimental_local_results(v)


def _metrics_result_or_logs_logs_only(self, logs):
  return logs


def _csv_on_train_begin_elsewhere(self, logs=None):
  self.csv_file = open(self.path, "w", encoding="utf-8")  # pylint: disable=consider-using-with


def _tensorboard_set_model_elsewhere(self, model):
  self._model = model
  self._train_dir = os.path.join(self.log_dir, "train")


def _make_train_function_elsewhere(self, force=False):
  self.train_function = self._make_train_loop(self.train_step)


def _add_weight_dtype_second(self, *args, shape=None, dtype=None, initializer=None,
                             trainable=True, aggregation="none", name=None):
  if args:
    dtype = args[1]
  return self.variable_dtype


def _build_with_mean_aggregation(self, input_shape):
  self.moving_mean = self.add_weight(name="moving_mean", trainable=False, aggregation="mean")
  self.moving_variance = self.add_weight(name="moving_variance", trainable=False,
                                         aggregation="mean")


def _evaluate_without_verbose(self, x=None, y=None, batch_size=None, callbacks=None):
  return CallbackList(callbacks, add_progbar=True)  # pylint: disable=undefined-variable


def _next_instance_key_fed_through_control_flow(self):
  # Upstream forwards the call-time capture itself: the nested step works.
  if self._use_unique_instance_key():
    graph = ops.get_default_graph()
    return graph.capture_call_time_value(self._next_instance_key, None, forward_to_callers=True)
  return self._collective_keys.get_instance_key(self._group_key, self._device)


def _get_cross_device_ops_renamed(self, value):
  # MirroredExtended keeps its cross-device ops under another name: the fix
  # would not see a collective-based strategy.
  return self._reducer


def _initialize_multi_worker_without_counts(self, cluster_resolver):
  self._cluster_spec = cluster_resolver.cluster_spec()
  self._task_type = cluster_resolver.task_type
  self._task_id = cluster_resolver.task_id


# pylint: enable=protected-access,unused-argument


@pytest.fixture
def changed_upstream(monkeypatch):
  """Reverts the fixes for the test to change upstream (through monkeypatch); gives `apply`.

  `apply()` applies the fixes again and returns (installed, warnings logged).
  Afterwards upstream is restored and every fix applied again.
  """
  warnings = []
  compat.revert()

  def apply():
    monkeypatch.setattr(logging, "warning", lambda msg, *args: warnings.append(msg % args))
    return compat.apply(), warnings

  yield apply
  compat.revert()
  monkeypatch.undo()
  compat.apply()
  assert compat.applied() == set(compat.fixes()) and not compat.skipped()


def _assert_skipped(apply, expected, change):
  """The fixes `expected` are skipped (the others installed), each naming `change`, with one warning.

  `change` is what every reason says, or {fix: what its reason says}.
  """
  installed, warnings = apply()
  assert installed == set(compat.fixes()) - set(expected), warnings
  assert set(compat.skipped()) == set(expected)
  changes = change if isinstance(change, dict) else dict.fromkeys(expected, change)
  for name in expected:
    change = changes[name]
    assert change in compat.skipped()[name], compat.skipped()[name]
    assert compat.fixes()[name].without in compat.skipped()[name]
    found = [w for w in warnings if f"skipping {name}:" in w]
    assert len(found) == 1 and change in found[0], warnings


def test_installed_versions_pass_every_probe():
  assert compat.applied() == set(compat.fixes())
  assert compat.skipped() == {}
  for name, fix in compat.fixes().items():
    assert fix.changes() == [], name  # applied: the probes read upstream past the fixes


def test_fit_data_state_needs_fit_to_iterate_the_distributed_dataset(changed_upstream, monkeypatch):
  # Keras keeps `_distributed_dataset` but stops iterating it: the hook's
  # checkpointable dataset would not be the one fit takes its batches from,
  # and a backup would hold the position of an iterator fit never used.
  monkeypatch.setattr(_TFEpochIterator, "_get_iterator", _get_iterator_of_another_dataset)
  _assert_skipped(changed_upstream, {"fit_data_state"},
                  "TFEpochIterator._get_iterator no longer contains "
                  "`return self._distributed_dataset`")
  assert "data position" in compat.skipped()["fit_data_state"]
  for method in (_TFEpochIterator.__init__, _EpochIterator._enumerate_iterator):  # pylint: disable=protected-access
    assert not hasattr(method, "__wrapped__")  # upstream's, not fit_hooks' wrappers


def _exec_get_iterator():
  namespace = {}
  exec("def _get_iterator(self):\n  return self._distributed_dataset\n", namespace)  # pylint: disable=exec-used
  return namespace["_get_iterator"]


_DELETED = object()
_TELL_WORKERS_APART = {"symbolic_build_batch", "reduce_mean_axis", "chief_only_verbose",
                       "chief_only_files", "concat_gather_dtypes"}

# One upstream change per assumption family of each fix: (upstream owner,
# attribute, what it becomes, the fixes skipped, what their reason says).
CHANGES = {
    # fit_data_state: the adapters whose position it saves.
    "adapter_gone": (data_adapters, "ArrayDataAdapter", _DELETED, {"fit_data_state"},
                     "data_adapters no longer has ArrayDataAdapter"),
    "adapter_renamed": (data_adapters, "TFDatasetAdapter",
                        type("TFDatasetAdapterV2", (data_adapters.TFDatasetAdapter,), {}),
                        {"fit_data_state"},
                        "data_adapters.TFDatasetAdapter is now named TFDatasetAdapterV2"),
    # fit_data_state: the epoch loop it hooks.
    "current_iterator_not_kept": (
        _EpochIterator, "_enumerate_iterator", _enumerate_iterator_fresh_each_epoch,
        {"fit_data_state"}, "EpochIterator._enumerate_iterator no longer contains "
        "`if self._current_iterator is None or self.steps_per_epoch is None:`"),
    "iter_without_enumerate": (_EpochIterator, "__iter__", _iter_without_enumerate,
                               {"fit_data_state"},
                               "EpochIterator.__iter__ no longer contains "
                               "`self._enumerate_iterator()`"),
    "loop_overridden": (_TFEpochIterator, "_enumerate_iterator",
                        _EpochIterator._enumerate_iterator,  # pylint: disable=protected-access
                        {"fit_data_state"}, "TFEpochIterator now overrides _enumerate_iterator"),
    # fit_data_state: fit reads model._initial_epoch, which
    # BackupAndRestore.on_train_begin sets; read before, the resumed fit
    # would start at the wrong epoch.
    "initial_epoch_read_early": (_Trainer, "fit", _fit_reading_initial_epoch_too_early,
                                 {"fit_data_state"},
                                 "TensorFlowTrainer.fit no longer contains "
                                 "`self._initial_epoch or initial_epoch` where expected"),
    # Any fix: a source the probe cannot read is a change.
    "source_unreadable": (_TFEpochIterator, "_get_iterator", _exec_get_iterator(),
                          {"fit_data_state"},
                          "the source of TFEpochIterator._get_iterator cannot be read"),
    "symbolic_build_fixed_upstream": (_Trainer, "_maybe_symbolic_build",
                                      _maybe_symbolic_build_fixed_upstream,
                                      {"symbolic_build_batch"},
                                      "no longer contains `self.distribute_strategy.reduce(`"),
    "symbolic_build_arguments_swapped": (
        _Trainer, "_maybe_symbolic_build", _maybe_symbolic_build_batch_first,
        {"symbolic_build_batch"},
        "TensorFlowTrainer._maybe_symbolic_build no longer takes (self, iterator, data_batch, ...)"),
    # (fit_data_state builds metrics through the base class's _symbolic_build.)
    "symbolic_build_from_values": (
        _Trainer, "_symbolic_build", _symbolic_build_from_values,
        {"symbolic_build_batch", "fit_data_state"},
        {"symbolic_build_batch": "no longer contains `def to_symbolic_input(v):`",
         "fit_data_state": "TensorFlowTrainer now overrides _symbolic_build"}),
    "reduce_fixed_upstream": (
        tf_trainer, "reduce_per_replica", _reduce_per_replica_fixed_upstream,
        {"reduce_mean_axis", "concat_gather_dtypes"},
        {"reduce_mean_axis": "trainer.reduce_per_replica no longer contains "
                             "`strategy.reduce(\"MEAN\", v, axis=0)`",
         "concat_gather_dtypes": "trainer.reduce_per_replica no longer contains "
                                 "`return _multi_worker_concat(v, strategy)`"}),
    "gather_fixed_upstream": (tf_trainer, "_multi_worker_concat", _multi_worker_concat_all_dtypes,
                              {"concat_gather_dtypes"},
                              "_multi_worker_concat no longer contains `strategy.gather(v, axis=0)`"),
    "metrics_or_logs_reads_logs_only": (
        base_trainer.Trainer, "_get_metrics_result_or_logs", _metrics_result_or_logs_logs_only,
        {"fit_data_state"}, "no longer contains `metric_logs = self.get_metrics_result()`"),
    "csv_logger_opens_elsewhere": (csv_logger.CSVLogger, "on_train_begin",
                                   _csv_on_train_begin_elsewhere, {"chief_only_files"},
                                   "no longer contains `file_utils.exists(self.filename)`"),
    "tensorboard_dirs_elsewhere": (tensorboard.TensorBoard, "set_model",
                                   _tensorboard_set_model_elsewhere, {"chief_only_files"},
                                   "no longer contains `self._log_write_dir = self.log_dir`"),
    # gradient_path: where upstream decides finiteness and all-reduces.
    "loss_scale_decides_after_the_reduce": (
        loss_scale_optimizer.LossScaleOptimizer, "_tf_apply", _tf_apply_finite_after_the_reduce,
        {"gradient_path"}, "LossScaleOptimizer._tf_apply no longer contains "
        "`distribution.experimental_local_results(`"),
    "update_step_without_all_reduce": (
        keras.src.backend.tensorflow.optimizer.TFOptimizer, "_backend_update_step",
        _all_reduce_in_apply, {"gradient_path"},
        "TFOptimizer._backend_update_step no longer contains "
        "`self._all_reduce_sum_gradients(grads_and_vars)`"),
    # steps_per_execution_inline: the cause it works around, and where it
    # reads which collectives a strategy's step launches.
    "instance_key_fed_through_control_flow": (
        cross_device_utils.CollectiveReplicaLauncher, "_next_instance_key",
        _next_instance_key_fed_through_control_flow, {"steps_per_execution_inline"},
        "CollectiveReplicaLauncher._next_instance_key no longer contains "
        "`while getattr(graph, 'is_control_flow_graph', False):`"),
    "mirrored_cross_device_ops_renamed": (
        mirrored_strategy.MirroredExtended, "_get_cross_device_ops",
        _get_cross_device_ops_renamed, {"steps_per_execution_inline"},
        "MirroredExtended._get_cross_device_ops no longer contains "
        "`return self._cross_device_ops`"),
    "unique_instance_key_gone": (cross_device_utils.CollectiveReplicaLauncher,
                                 "_use_unique_instance_key", _DELETED,
                                 {"steps_per_execution_inline"},
                                 "no longer has _use_unique_instance_key"),
    "train_function_elsewhere": (_Trainer, "make_train_function", _make_train_function_elsewhere,
                                 {"steps_per_execution_inline"},
                                 "TensorFlowTrainer.make_train_function no longer contains "
                                 "`self._make_function(self.train_step)`"),
    "add_weight_dtype_moved": (keras_layer.Layer, "add_weight", _add_weight_dtype_second,
                               {"non_trainable_mean_aggregation"},
                               "Layer.add_weight no longer contains `dtype = args[2]`"),
    "batch_norm_fixed_upstream": (keras.layers.BatchNormalization, "build",
                                  _build_with_mean_aggregation,
                                  {"non_trainable_mean_aggregation"},
                                  "BatchNormalization.build now contains `aggregation`"),
    "verbose_gone": (_Trainer, "evaluate", _evaluate_without_verbose, {"chief_only_verbose"},
                     "TensorFlowTrainer.evaluate no longer takes verbose"),
    # The fixes that act on multi-worker strategies only: tfdp.cluster reads
    # `_num_workers` with a default of 1, without it they would never act.
    "num_workers_gone": (collective_all_reduce_strategy.CollectiveAllReduceExtended,
                         "_initialize_multi_worker", _initialize_multi_worker_without_counts,
                         _TELL_WORKERS_APART,
                         "CollectiveAllReduceExtended._initialize_multi_worker no longer "
                         "contains `self._num_workers = `"),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_fix_is_skipped_when_upstream_changed_under_it(changed_upstream, monkeypatch, case):
  owner, attr, value, expected, change = CHANGES[case]
  if value is _DELETED:
    monkeypatch.delattr(owner, attr)
  else:
    monkeypatch.setattr(owner, attr, value)
  _assert_skipped(changed_upstream, expected, change)


def test_a_probe_that_raises_is_a_change(changed_upstream, monkeypatch):
  fix = dataclasses.replace(compat.fixes()["reduce_mean_axis"],
                            probe=lambda: [getattr(tf_trainer, "reduce_per_replica_v2")])
  monkeypatch.setitem(compat._REGISTRY, "reduce_mean_axis", fix)  # pylint: disable=protected-access
  _assert_skipped(changed_upstream, {"reduce_mean_axis"}, "probing raised AttributeError")


def test_skipped_warns_once_per_reason_and_revert_forgets(changed_upstream, monkeypatch):
  monkeypatch.setattr(tf_trainer, "reduce_per_replica", _reduce_per_replica_fixed_upstream)
  _, warnings = changed_upstream()
  compat.apply()  # idempotent: no second warning
  assert sum("skipping reduce_mean_axis" in w for w in warnings) == 1
  compat.revert()
  assert compat.skipped() == {}
  compat.apply()
  assert sum("skipping reduce_mean_axis" in w for w in warnings) == 2


def test_a_disabled_fix_is_not_probed_or_listed_as_skipped(changed_upstream, monkeypatch):
  monkeypatch.setattr(_TFEpochIterator, "_get_iterator", _get_iterator_of_another_dataset)
  monkeypatch.setenv(compat.DISABLE_ENV, "fit_data_state")
  installed, warnings = changed_upstream()
  assert installed == set(compat.fixes()) - {"fit_data_state"}
  assert compat.skipped() == {} and not warnings
