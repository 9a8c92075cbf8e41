"""The gradient path of data parallelism: Keras 3's optimizer all-reduces first, then clips and checks for overflow.

Keras 3's TF backend all-reduces a replica's gradients at the very end of
`optimizer.apply`, inside `_backend_update_step`: after `clipnorm`,
`clipvalue` and `global_clipnorm` were applied to each replica's own
(1/N-scaled) gradients, and, under `LossScaleOptimizer`, after "are they
finite?" was decided from replica 0's own gradients. So clipping means
something else on 2 replicas than on 1 and on 256; one replica's overflow is
applied by the others (non-finite weights under MirroredStrategy); and under
MultiWorkerMirroredStrategy the workers take different branches of a `cond`
that holds the all-reduce, so the job hangs.

The patch moves the all-reduce to the start of `apply`, in buckets
(tfdp.gradients.buckets): clipping, loss-scale unscaling, the finiteness check,
gradient accumulation, weight decay and the update all see the reduced
gradients, the same on every replica and worker, as one device sees its
gradients; no collective is left inside a `cond` that replicas may decide
differently. The optimizer's own all-reduce (`_all_reduce_sum_gradients`)
is then a no-op for the call.

With `gradient_accumulation_steps`, each replica accumulates its own
gradients and the update step all-reduces their accumulated mean, as
upstream does, but before clipping: upstream's sum, one all-reduce per
update rather than one per accumulated step. (All-reducing each step's
gradients instead gave upstream's sum only where the replicas' gradients are
distinct tensors: `ReplicaContext.all_reduce` takes a tensor that every
replica passes as the same object for one value, not a sum, so a gradient
shared by the replicas was applied once where upstream applies it per
replica.)

This module holds the path itself: `replacements()` builds the patched
methods. tfdp.compat.gradient_path probes the upstream code they replace and
registers them as the compat fix `gradient_path` (installed by `import tfdp`,
turned off by `TFDP_COMPAT_DISABLE=gradient_path`).
"""

import functools
import threading

from keras.src import backend
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
import tensorflow as tf

from tfdp.gradients import buckets

_Base = base_optimizer.BaseOptimizer
_TFOptimizer = tf_optimizer.TFOptimizer
_LSO = loss_scale_optimizer.LossScaleOptimizer
# Set on a LossScaleOptimizer's inner optimizer: its gradients arrive reduced.
_OUTER_REDUCES = "_tfdp_outer_reduces"

# Set while a thread traces an `apply` whose gradients are already reduced
# (thread-local: MirroredStrategy traces each replica in its own thread).
_reduced = threading.local()


def _multi_replica() -> bool:
  """In a replica context of a strategy with more than one replica."""
  if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
    return False
  return tf.distribute.get_strategy().num_replicas_in_sync > 1


def _reduce(optimizer, grads, trainable_variables):
  """`grads` all-reduced, but for variables Keras overwrites with their gradient (float8 scales)."""
  grads = list(grads)
  keep = [i for i, (g, v) in enumerate(zip(grads, trainable_variables))
          if g is not None and not optimizer._overwrite_variable_with_gradient(v)]  # pylint: disable=protected-access
  reduced = buckets.all_reduce([grads[i] for i in keep])
  for i, r in zip(keep, reduced):
    grads[i] = r
  return grads


class _Reduced:
  """Marks this thread's trace: the optimizer's own all-reduce is a no-op inside."""

  def __enter__(self):
    _reduced.depth = getattr(_reduced, "depth", 0) + 1

  def __exit__(self, *exc):
    _reduced.depth -= 1


def _reduces_at_update(optimizer) -> bool:
  """Whether `optimizer` accumulates each replica's own gradients and all-reduces on the update step.

  So it does in a replica context of more than one replica of a strategy
  that merges (see `_accumulate_across_replicas`); elsewhere `apply`
  all-reduces each step's gradients first.
  """
  return bool(optimizer.gradient_accumulation_steps and not optimizer.use_ema
              and not tf.__internal__.distribute.strategy_supports_no_merge_call())


def _accumulate_across_replicas(self, grads, trainable_variables):
  """Upstream's gradient accumulation, with its `cond` taken in cross-replica context.

  Upstream's `cond` (update on every `gradient_accumulation_steps`-th step,
  else accumulate) holds `merge_call`s in its branches, which
  MirroredStrategy cannot trace in a replica context: Keras 3 fails there
  with "`merge_call` called while defining a new graph". As
  LossScaleOptimizer does for its own `cond`, the branches here run each
  replica's part through `call_for_each_replica` from a `cond` in
  cross-replica context; the condition is the optimizer's step, the same on
  every replica and worker, so every replica takes the same branch.

  Each replica accumulates its own gradients; the update step all-reduces
  their accumulated mean, as upstream does, then clips it (unless a
  LossScaleOptimizer around it reduced every step's gradients already).
  """
  steps = self.gradient_accumulation_steps
  is_update_step = (self._iterations + 1) % steps == 0  # pylint: disable=protected-access
  accumulators = [self._accumulated_gradients[self._get_variable_index(v)]  # pylint: disable=protected-access
                  for v in trainable_variables]

  reduce = not getattr(self, _OUTER_REDUCES, False)

  def update(grads):
    with _Reduced():  # a thread of its own: the optimizer's all-reduce is off here too
      grads = [(g + a) / steps for g, a in zip(grads, accumulators)]
      if reduce:
        grads = _reduce(self, grads, trainable_variables)
      grads = self._clip_gradients(grads)  # pylint: disable=protected-access
      self._apply_weight_decay(trainable_variables)  # pylint: disable=protected-access
      self._backend_update_step(grads, trainable_variables, self.learning_rate)  # pylint: disable=protected-access
      self._backend_reset_gradient_accumulators()  # pylint: disable=protected-access

  def increment(grads):
    self._backend_increment_gradient_accumulators(grads, accumulators)  # pylint: disable=protected-access

  def cross_replica(distribution, grads):
    tf.cond(is_update_step,
            lambda: distribution.extended.call_for_each_replica(update, args=(grads,)),
            lambda: distribution.extended.call_for_each_replica(increment, args=(grads,)))

  tf.distribute.get_replica_context().merge_call(cross_replica, args=(grads,))


def replacements():
  """The gradient path's methods, each wrapping the upstream one it replaces.

  Upstream all-reduces in `_backend_update_step`, after clipping, and
  LossScaleOptimizer decides finiteness before it (see the module
  docstring). The replacements all-reduce at the start of `apply` in a
  replica context of more than one replica (in buckets,
  tfdp.gradients.buckets; with gradient accumulation, on the update step
  instead), then run upstream's `apply` on the reduced gradients with the
  optimizer's own all-reduce turned off; LossScaleOptimizer reduces before
  its finiteness check, and its inner optimizer takes the gradients as they
  come. Outside such a context (no strategy, one replica, cross-replica)
  upstream runs unchanged.

  Returns:
    [(class, attribute name, replacement)], in the order they are to be set.
  """
  base_apply = _Base.apply
  backend_apply = _Base._backend_apply_gradients  # pylint: disable=protected-access
  lso_apply = _LSO.apply
  all_reduce_sum = _TFOptimizer._all_reduce_sum_gradients  # pylint: disable=protected-access

  @functools.wraps(base_apply)
  def apply(self, grads, trainable_variables=None):
    if not _multi_replica() or len(grads) == 0:
      return base_apply(self, grads, trainable_variables)
    if not getattr(self, _OUTER_REDUCES, False) and not _reduces_at_update(self):
      variables = trainable_variables if trainable_variables is not None else self._trainable_variables  # pylint: disable=protected-access
      grads = _reduce(self, grads, list(variables))
    with _Reduced():
      return base_apply(self, grads, trainable_variables)

  @functools.wraps(backend_apply)
  def _backend_apply_gradients(self, grads, trainable_variables):
    if not _multi_replica() or not _reduces_at_update(self):
      return backend_apply(self, grads, trainable_variables)
    return _accumulate_across_replicas(self, grads, trainable_variables)

  @functools.wraps(lso_apply)
  def lso_apply_reduced(self, grads, trainable_variables=None):
    if not _multi_replica() or len(grads) == 0:
      return lso_apply(self, grads, trainable_variables)
    if not self.built:  # as upstream, so that the variables below exist
      with backend.name_scope(self.name, caller=self):
        self.build(trainable_variables)
      self.built = True
    setattr(self.inner_optimizer, _OUTER_REDUCES, True)
    variables = trainable_variables if trainable_variables is not None else self._trainable_variables  # pylint: disable=protected-access
    grads = _reduce(self, grads, list(variables))
    with _Reduced():
      return lso_apply(self, grads, trainable_variables)

  @functools.wraps(all_reduce_sum)
  def _all_reduce_sum_gradients(self, grads_and_vars):
    if getattr(_reduced, "depth", 0) > 0:
      return list(grads_and_vars)
    return all_reduce_sum(self, grads_and_vars)

  return [(_Base, "apply", apply),
          (_Base, "_backend_apply_gradients", _backend_apply_gradients),
          (_LSO, "apply", lso_apply_reduced),
          (_TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum_gradients)]
