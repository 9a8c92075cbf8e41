"""Test-only Keras callback: env TFDP_TEST_SLOW_FROM=N sleeps after each step from global step N on."""

import os
import time

import keras


class SlowFrom(keras.callbacks.Callback):
  """Sleeps `seconds` after each step from global step $TFDP_TEST_SLOW_FROM on, so a test can kill mid-run."""

  def __init__(self, seconds=0.3):
    super().__init__()
    self.seconds = seconds

  def on_train_batch_end(self, batch, logs=None):
    if 0 <= int(os.environ.get("TFDP_TEST_SLOW_FROM", "-1")) <= int(
        self.model.optimizer.iterations.numpy()):
      time.sleep(self.seconds)
