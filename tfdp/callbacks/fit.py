"""`fit` that starts at any global step: Keras epochs cut so the data position is exact."""

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import keras

from tfdp.callbacks import backup as backup_lib
from tfdp.distribute import cluster
from tfdp import errors
from tfdp.resume import train_state as state_lib


@dataclasses.dataclass(frozen=True)
class Segment:
  """One `model.fit` call: epochs [first_epoch, last_epoch) of `steps` steps each."""
  first_epoch: int
  last_epoch: int
  first_step: int
  steps: int


def plan(start_step: int, train_steps: int, steps_per_epoch: int) -> list[Segment]:
  """Splits steps [start_step, train_steps) into `model.fit` calls.

  Keras runs whole epochs of one `steps_per_epoch`; a run resumed mid-epoch
  (or one whose last epoch is short) needs a call for the partial epoch. Full
  epochs in between share one call. Epoch e covers steps
  [e * steps_per_epoch, (e + 1) * steps_per_epoch).

  Returns:
    A list of Segments; empty when there is nothing left to train.
  """
  if steps_per_epoch < 1:
    raise errors.ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}.")
  segments = []
  step = start_step
  while step < train_steps:
    epoch, offset = divmod(step, steps_per_epoch)
    epoch_end = min((epoch + 1) * steps_per_epoch, train_steps)
    if offset == 0 and epoch_end - step == steps_per_epoch:
      full = (train_steps - step) // steps_per_epoch
      segments.append(Segment(epoch, epoch + full, step, steps_per_epoch))
      step += full * steps_per_epoch
    else:
      segments.append(Segment(epoch, epoch + 1, step, epoch_end - step))
      step = epoch_end
  return segments


def fit(model: keras.Model, make_dataset: Callable[[int], Any], *, steps_per_epoch: int,
        epochs: int | None = None, train_steps: int | None = None,
        start_step: int | None = None, callbacks: Sequence[keras.callbacks.Callback] | None = None,
        verbose: str | int = "auto", **fit_kwargs) -> list[keras.callbacks.History]:
  """`model.fit` that starts at any global step, with its data exactly there.

  The smallest change to a Keras script for an exact resume: replace
  `model.fit(dataset, epochs=E, steps_per_epoch=S, callbacks=cbs)` by
  `tfdp.fit(model, make_dataset, epochs=E, steps_per_epoch=S, callbacks=cbs)`
  where `make_dataset(step)` returns the dataset from global step `step` on
  (e.g. `lambda step: tfdp.data.distribute(strategy, source, ...,
  start_step=step)`). A `tfdp.callbacks.BackupAndRestore` among `callbacks`
  restores its backup before the dataset is made.

  Args:
    model: a compiled Keras model.
    make_dataset: `fn(first_step) -> dataset` whose element n is the batch of
      global step `first_step + n` (e.g. `tfdp.data.distribute`).
    steps_per_epoch: steps of a full epoch.
    epochs: train to the end of this epoch (or pass `train_steps`).
    train_steps: the global step to stop at (or pass `epochs`).
    start_step: the step the model is at; None: restore any BackupAndRestore
      callback, then read the optimizer's iterations.
    callbacks: Keras callbacks, shared by every `model.fit` call.
    verbose: Keras verbosity.
    **fit_kwargs: passed to every `model.fit` call.

  Returns:
    The History of each `model.fit` call made (a run resumed mid-epoch makes
    one for the rest of that epoch, then one for the remaining epochs).
    Training ends early when a callback sets `model.stop_training`.
  """
  if (epochs is None) == (train_steps is None):
    raise errors.ConfigError("Pass exactly one of epochs= and train_steps= to tfdp.fit.")
  if train_steps is None:
    train_steps = epochs * steps_per_epoch
  callbacks = list(callbacks or [])
  backups = [c for c in callbacks if isinstance(c, backup_lib.BackupAndRestore)]
  histories = []
  with contextlib.ExitStack() as stack:
    for backup in backups:
      stack.enter_context(backup.spanning_fit_calls(model, steps_per_epoch))
    if start_step is None:
      for backup in backups:
        backup.restore(model)
      start_step = state_lib.global_step(model)
    if start_step >= train_steps and verbose != 0 and cluster.resolve(objects=model).is_chief:
      # A rerun of a finished script: say so, rather than exit without a word.
      print(f"tfdp.fit: the model is at step {start_step}, at or past train_steps="
            f"{train_steps}; nothing to train.", flush=True)
    for seg in plan(start_step, train_steps, steps_per_epoch):
      # A restore by Keras's own BackupAndRestore leaves this set; it would
      # override the segment's first epoch.
      model._initial_epoch = None  # pylint: disable=protected-access
      histories.append(model.fit(
          make_dataset(seg.first_step), initial_epoch=seg.first_epoch,
          epochs=seg.last_epoch, steps_per_epoch=seg.steps, callbacks=callbacks,
          verbose=verbose, shuffle=False, **fit_kwargs))
      if getattr(model, "stop_training", False):
        break
  return histories
