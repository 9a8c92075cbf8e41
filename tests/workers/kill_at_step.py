"""tfdp-train that SIGKILLs itself right after TensorBoard wrote global step $TFDP_TEST_KILL_AT, its events flushed."""

import os
import signal

from tfdp import summaries
from tfdp.cli import train

KILL_AT = int(os.environ.get("TFDP_TEST_KILL_AT", "-1"))

_original = summaries.TensorBoard.on_train_batch_end


def _on_train_batch_end(self, batch, logs=None):
  _original(self, batch, logs)
  if int(self.model.optimizer.iterations.numpy()) == KILL_AT:
    # As if the writer's periodic flush had run just before the crash: the
    # points past the last checkpoint are on disk.
    self.flush()
    os.kill(os.getpid(), signal.SIGKILL)


summaries.TensorBoard.on_train_batch_end = _on_train_batch_end

if __name__ == "__main__":
  train.run()
