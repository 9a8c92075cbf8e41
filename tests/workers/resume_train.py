"""tfdp-train, slowed down after a step (in its BackupAndRestore) so that a test can interrupt it there."""

import os
import time

from tfdp import callbacks
from tfdp.cli import train

SLOW_FROM = int(os.environ.get("TFDP_TEST_SLOW_FROM", "-1"))
SLEEP = float(os.environ.get("TFDP_TEST_STEP_SLEEP", "0.5"))

_original = callbacks.BackupAndRestore.on_train_batch_end


def _slow_on_train_batch_end(self, batch, logs=None):
  _original(self, batch, logs)
  if 0 <= SLOW_FROM <= int(self.model.optimizer.iterations.numpy()):
    time.sleep(SLEEP)


callbacks.BackupAndRestore.on_train_batch_end = _slow_on_train_batch_end

if __name__ == "__main__":
  train.run()
