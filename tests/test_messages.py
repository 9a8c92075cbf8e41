"""Failures a new user meets first end in one line that names the real fix (issue 24)."""

import keras
import numpy as np
import pytest

from tfdp import callbacks
from tfdp import errors


def test_a_backup_dir_that_is_a_file_is_one_config_error_before_tensorflow_touches_it(tmp_path):
  path = tmp_path / "backup"
  path.write_text("not a directory")
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
  with pytest.raises(errors.ConfigError) as e:
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0,
              callbacks=[callbacks.BackupAndRestore(str(path))])
  assert str(e.value) == (f"{path} is a file, not a directory: pass a directory for the "
                          "checkpoints (it is created if missing).")
  assert path.read_text() == "not a directory"
