"""The fix that keeps a deadline on a multi-worker step: a stuck collective is one line and exit 70, not a hang.

Under MultiWorkerMirroredStrategy a worker whose peer is alive but stuck
waits in its next collective forever, and TensorFlow's own per-collective
timeout keeps a thread per collective (see tfdp.liveness.stall). The patch runs
every call of a model's train, test and predict functions under
tfdp.liveness.stall's deadline (tfdp.gradients' `timeout_seconds`): past it the
pending collectives are aborted, and the worker ends with one line naming
the collective and the step (tfdp-launch restarts the group).
"""

import functools

from keras.src.backend.tensorflow import trainer as tf_trainer
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp.gradients import settings
from tfdp.liveness import stall
from tfdp.compat import probes
from tfdp.compat.registry import patch_attr
from tfdp.compat.registry import register

_Trainer = tf_trainer.TensorFlowTrainer
# make_X_function -> (the attribute it sets, what a stuck call is named by).
_FUNCTIONS = {"make_train_function": ("train_function", "step"),
              "make_test_function": ("test_function", "evaluate"),
              "make_predict_function": ("predict_function", "predict")}


def _probe():
  return [p for name, (attr, _) in _FUNCTIONS.items()
          for p in probes.reads(_Trainer, name, f"self.{attr} = ")]


def _under_deadline(make, attr, where):
  """`make_X_function` whose function, under a multi-worker strategy, runs each call under tfdp.liveness.stall's deadline."""

  @functools.wraps(make)
  def make_function(self, force=False):
    made = make(self, force)
    function = getattr(self, attr, None)
    if (function is None or getattr(function, "_tfdp_deadline", False)
        or not cluster.is_multi_worker(self.distribute_strategy)):
      return made
    calls = [0]

    def call(*args, **kwargs):
      timeout = settings.current().timeout_seconds
      calls[0] += 1
      limit = None if timeout is None else timeout * (
          stall.FIRST_CALL_FACTOR if calls[0] == 1 else 1)
      try:
        with stall.DEADLINE.watch(limit, where):
          return function(*args, **kwargs)
      except tf.errors.OpError as e:
        step = None
        if where == "step" and getattr(self, "optimizer", None) is not None:
          step = int(self.optimizer.iterations.numpy()) + 1
        stall.exit_if_stalled(e, step, where)
        raise

    call._tfdp_deadline = True  # pylint: disable=protected-access
    setattr(self, attr, call)
    return call if made is function else made

  return make_function


@register("collective_deadline", _probe,
          "a worker of a multi-worker job whose peer is alive but stuck (or took another "
          "path) waits in its next collective forever, saying nothing")
def _install_collective_deadline():
  """keras/src/backend/tensorflow/trainer.py TensorFlowTrainer.make_train_function, make_test_function, make_predict_function.

  Upstream's functions run unbounded. Under a multi-worker strategy the patch
  wraps the function each one makes so that every call runs under
  tfdp.liveness.stall's deadline and a call whose collectives it aborted ends the
  worker with one line (see the module docstring). Other strategies get
  upstream's function unchanged.
  """
  undo = [patch_attr(_Trainer, name, _under_deadline(_Trainer.__dict__[name], attr, where),
                     "collective_deadline")
          for name, (attr, where) in _FUNCTIONS.items()]

  def revert():
    for u in reversed(undo):
      u()

  return revert
