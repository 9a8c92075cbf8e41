"""`fit` that starts at any global step: Keras epochs cut so the data position is exact."""

import dataclasses

from tfdp import errors


@dataclasses.dataclass(frozen=True)
class Segment:
  """One `model.fit` call: epochs [first_epoch, last_epoch) of `steps` steps each."""
  first_epoch: int
  last_epoch: int
  first_step: int
  steps: int


def plan(start_step, train_steps, steps_per_epoch):
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


def fit(model, make_dataset, *, start_step, train_steps, steps_per_epoch,
        callbacks=None, verbose="auto", **fit_kwargs):
  """Trains `model` from global step `start_step` to `train_steps`.

  Args:
    model: a compiled Keras model, restored to `start_step`.
    make_dataset: `fn(first_step) -> dataset` whose element n is the batch of
      global step `first_step + n` (e.g. `tfdp.data.distribute`).
    start_step: the step the model is at (the optimizer's iterations).
    train_steps: the step to stop at.
    steps_per_epoch: steps of a full epoch.
    callbacks: Keras callbacks, shared by every segment.
    verbose: Keras verbosity.
    **fit_kwargs: passed to every `model.fit` call.

  Returns:
    The History of each `model.fit` call made.
  """
  histories = []
  for seg in plan(start_step, train_steps, steps_per_epoch):
    histories.append(model.fit(
        make_dataset(seg.first_step), initial_epoch=seg.first_epoch,
        epochs=seg.last_epoch, steps_per_epoch=seg.steps, callbacks=callbacks,
        verbose=verbose, shuffle=False, **fit_kwargs))
  return histories
