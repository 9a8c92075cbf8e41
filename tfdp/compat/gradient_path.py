"""The compat fix `gradient_path`: probes the upstream optimizer code that tfdp.gradients.path replaces, and installs it."""

from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer

from tfdp.compat import probes
from tfdp.compat.registry import patch_attr
from tfdp.compat.registry import register
from tfdp.gradients import path

_Base = base_optimizer.BaseOptimizer
_TFOptimizer = tf_optimizer.TFOptimizer
_LSO = loss_scale_optimizer.LossScaleOptimizer


def _probe():
  """Where upstream clips, decides finiteness and all-reduces, as the gradient path assumes."""
  return [
      *probes.reads(_Base, "apply", "self._filter_empty_gradients(",
                    "self._backend_apply_gradients(grads, trainable_variables)", ordered=True),
      *probes.reads(_Base, "_backend_apply_gradients", "if self.gradient_accumulation_steps:",
                    "self._iterations + 1", "self._accumulated_gradients[self._get_variable_index(v)]",
                    "grads = self._clip_gradients(grads)", "self._apply_weight_decay(trainable_variables)",
                    "self._backend_update_step(", "self._backend_reset_gradient_accumulators()",
                    "self._backend_increment_gradient_accumulators(", "if self.use_ema:"),
      *probes.reads(_TFOptimizer, "_backend_update_step",
                    "self._all_reduce_sum_gradients(grads_and_vars)"),
      *probes.params(_TFOptimizer, "_all_reduce_sum_gradients", ("self", "grads_and_vars")),
      *probes.reads(_LSO, "apply", "self._tf_apply(grads, trainable_variables)"),
      *probes.reads(_LSO, "_tf_apply", "self._common_apply(grads",
                    "distribution.experimental_local_results(", "self.check_finite"),
      *probes.reads(_LSO, "_stateful_handle_finite_grads", "self.inner_optimizer.apply("),
  ]


@register("gradient_path", _probe,
          "under MirroredStrategy and MultiWorkerMirroredStrategy, gradient clipping acts "
          "on each replica's own gradients (it depends on the number of replicas), a "
          "float16 overflow on one replica is applied by the others (non-finite weights) "
          "or hangs a multi-worker job, and the all-reduce is one block after backward")
def _install_gradient_path():
  """keras/src/optimizers/base_optimizer.py BaseOptimizer.apply, LossScaleOptimizer.apply, TFOptimizer._all_reduce_sum_gradients.

  Upstream all-reduces in `_backend_update_step`, after clipping, and
  LossScaleOptimizer decides finiteness before it. The patch sets the
  methods of tfdp.gradients.path (all-reduce first, in buckets, then clip
  and check for overflow; see `path.replacements`).
  """
  undo = [patch_attr(owner, attr, replacement, "gradient_path")
          for owner, attr, replacement in path.replacements()]

  def revert():
    for u in reversed(undo):
      u()

  return revert
