"""The hooks into Keras's fit loop: the training data's position (fit_data_state), chief-only output (chief_only_verbose)."""

from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers import data_adapters
from keras.src.trainers import epoch_iterator as epoch_iterator_lib
from keras.src.trainers import trainer as base_trainer

from tfdp.resume import fit_hooks
from tfdp.compat import probes
from tfdp.compat.registry import patch_attr
from tfdp.compat.registry import register

_Trainer = tf_trainer.TensorFlowTrainer
_TFEpochIterator = tf_trainer.TFEpochIterator
_EpochIterator = epoch_iterator_lib.EpochIterator
_BaseTrainer = base_trainer.Trainer

# ---------------------------------------------------------------------------
# Hooks: the training data's position under plain `fit`.


def _probe_fit_loop():
  """`fit` makes its training epoch iterator first, then runs on_train_begin, then reads `_initial_epoch`.

  tfdp.resume.fit_hooks takes the first TFEpochIterator a fit makes as its
  training data's, swaps its dataset before any callback runs, and
  BackupAndRestore.on_train_begin sets `model._initial_epoch` (as Keras's own
  callback does) for fit to start at the restored epoch; a callback's batch
  number is the last step of the execution.
  """
  return [
      *probes.defines(_Trainer, "fit", own=True),
      *probes.params(_Trainer, "fit", defaults={"callbacks": None}),
      *probes.reads(_Trainer, "fit", "epoch_iterator = TFEpochIterator(",
                    "callbacks_module.CallbackList(", "callbacks,",
                    "callbacks.on_train_begin()", "logs = {}",
                    "self._initial_epoch or initial_epoch", "self.reset_metrics()",
                    "callbacks.on_epoch_begin(epoch)",
                    "for begin_step, end_step, iterator in epoch_iterator:",
                    "logs = self.train_function(iterator)",
                    "callbacks.on_train_batch_end(end_step",
                    "epoch_logs = dict(self._get_metrics_result_or_logs(logs))",
                    ordered=True),
      *probes.inherits(_Trainer, "_get_metrics_result_or_logs", "_symbolic_build"),
      *probes.params(_BaseTrainer, "_symbolic_build", ("self", "iterator", "data_batch")),
      *probes.reads(_BaseTrainer, "_symbolic_build", "self._compile_metrics.built",
                    "if compile_metrics_unbuilt:", "self.compute_metrics,", ordered=True),
      *probes.reads(_BaseTrainer, "_get_metrics_result_or_logs",
                    "metric_logs = self.get_metrics_result()", "return metric_logs",
                    "return logs", ordered=True),
  ]


def _probe_tf_epoch_iterator():
  """TFEpochIterator distributes the adapter's dataset into `_distributed_dataset`, and iterates that.

  The hook replaces `_distributed_dataset` right after `__init__`: if Keras
  kept the attribute but stopped iterating it, a backup would save the
  position of an iterator fit no longer uses (a silently wrong resume).
  """
  return [
      *probes.params(_TFEpochIterator, "__init__", ("self", "distribute_strategy")),
      *probes.reads(_TFEpochIterator, "__init__", "self._distribute_strategy = distribute_strategy",
                    "self.data_adapter.get_tf_dataset()", "experimental_distribute_dataset(",
                    "self._distributed_dataset = dataset", ordered=True),
      *probes.defines(_TFEpochIterator, "__init__", "_get_iterator", own=True),
      *probes.reads(_TFEpochIterator, "_get_iterator", "return self._distributed_dataset"),
      *probes.inherits(_TFEpochIterator, "_enumerate_iterator", "__iter__"),
  ]


def _probe_epoch_iterator():
  """EpochIterator's loop: one item per `steps_per_execution` steps, `_current_iterator` kept only with `steps_per_epoch`.

  `FitRun.skip_steps` drops whole items of `_enumerate_iterator`;
  `FitRun.next_iterator` reads `steps_per_epoch` and `_current_iterator` to
  tell the iterator the next step takes its batch from.
  """
  return [
      *probes.reads(_EpochIterator, "__init__", "self.steps_per_epoch = steps_per_epoch",
                    "self.steps_per_execution = steps_per_execution",
                    "self._current_iterator = None", "self.data_adapter = "),
      *probes.defines(_EpochIterator, "_enumerate_iterator", own=True),
      *probes.reads(_EpochIterator, "_enumerate_iterator",
                    "if self._current_iterator is None or self.steps_per_epoch is None:",
                    "self._current_iterator = iter(self._get_iterator())",
                    "for step in range(0, steps_per_epoch, self.steps_per_execution):",
                    "self._current_iterator,", ordered=True),
      *probes.reads(_EpochIterator, "__iter__", "self._enumerate_iterator()"),
  ]


def _probe_adapters():
  """The adapters tfdp.resume.fit_hooks saves the position of still exist under their names and make a tf.data pipeline.

  Arrays are shuffled with tf.random.shuffle, whose kernel state the hook
  leaves out of the saved iterator (ExternalStatePolicy.IGNORE).
  """
  changes = probes.defines(data_adapters, *fit_hooks.SERIALIZABLE_ADAPTERS)
  for name in fit_hooks.SERIALIZABLE_ADAPTERS:
    adapter = getattr(data_adapters, name, None)
    if adapter is None:
      continue
    if adapter.__name__ != name:
      changes.append(f"data_adapters.{name} is now named {adapter.__name__}")
    changes += probes.defines(adapter, "get_tf_dataset", own=True)
    changes += probes.reads(data_adapters, "get_data_adapter", f"return {name}(")
    if name == "ArrayDataAdapter":
      changes += probes.reads(adapter, "get_tf_dataset", "tf.random.shuffle(")
  return changes


def _probe_fit_data_state():
  return [*_probe_fit_loop(), *_probe_tf_epoch_iterator(), *_probe_epoch_iterator(),
          *_probe_adapters()]


@register("fit_data_state", _probe_fit_data_state,
          "backups of plain model.fit hold no data position, callback state or metric "
          "state: a resumed fit restarts the interrupted epoch from its first batch, and "
          "the other callbacks start again")
def _install_fit_data_state():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer.fit, TFEpochIterator.

  Upstream makes the training data's distributed iterator inside `fit`
  before any callback runs; TF cannot checkpoint it, and `fit` always starts
  an epoch at its first step. With a callback that asks for the data position
  (`tfdp.callbacks.BackupAndRestore`), the patch gives the `tf.data` input
  checkpointable iterators (`tfdp.data.iterators`), lets the callback find them
  and the fit's other callbacks (`tfdp.resume.fit_hooks.current`), and lets it start
  the resumed epoch at the restored step; an epoch resumed after its last
  step logs its restored metrics (upstream: none but validation's). Callbacks
  that set `tfdp_runs_last` come after the others, wherever they are in the
  list.
  """
  undo = [
      patch_attr(_Trainer, "fit", fit_hooks.wrap_fit(_Trainer.__dict__["fit"]), "fit_data_state"),
      patch_attr(_BaseTrainer, "_get_metrics_result_or_logs", fit_hooks.wrap_metrics_or_logs(
          _BaseTrainer.__dict__["_get_metrics_result_or_logs"]), "fit_data_state"),
      patch_attr(_TFEpochIterator, "__init__",
                 fit_hooks.wrap_epoch_iterator_init(_TFEpochIterator.__dict__["__init__"]),
                 "fit_data_state"),
      patch_attr(_EpochIterator, "_enumerate_iterator",
                 fit_hooks.wrap_enumerate_iterator(_EpochIterator.__dict__["_enumerate_iterator"]),
                 "fit_data_state"),
  ]
  return lambda: [u() for u in reversed(undo)]


# ---------------------------------------------------------------------------
# Hook: chief-only output.

_QUIET_METHODS = ("fit", "evaluate", "predict")


def _probe_chief_only_verbose():
  changes = probes.multi_worker_attributes()
  for method in _QUIET_METHODS:
    changes += probes.defines(_Trainer, method, own=True)
    changes += probes.params(_Trainer, method, defaults={"verbose": "auto", "callbacks": None})
    changes += probes.reads(_Trainer, method, "add_progbar=verbose != 0")
  return changes


@register("chief_only_verbose", _probe_chief_only_verbose,
          "every worker of a multi-worker job prints progress bars")
def _install_chief_only_verbose():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer.fit, evaluate, predict.

  Upstream prints progress (bars, or a line per epoch with verbose=2) and
  the messages of Keras's callbacks (ModelCheckpoint's, EarlyStopping's) on
  every worker of a multi-worker job. The patch makes them print on the
  chief only, whatever `verbose` says; $TFDP_PROGRESS_ALL_WORKERS=1 keeps
  every worker's.
  """
  undo = [
      patch_attr(_Trainer, m, fit_hooks.wrap_quiet(_Trainer.__dict__[m]), "chief_only_verbose")
      for m in _QUIET_METHODS
  ]
  return lambda: [u() for u in reversed(undo)]
