"""TensorBoard keyed by the global step across a SIGKILL and resume, the end-of-run summary, and model.keras."""

import os

import keras
import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing import plugin_event_accumulator
import tensorflow as tf

from tests import train_run

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def runs(train_runs):
  """The shared runs of tests/train_run.py (the train_runs fixture of tests/conftest.py)."""
  return train_runs


def _accumulated(model_dir, run):
  """What TensorBoard shows for `run`: every event file of it, orphaned points purged.

  The accumulator of TensorBoard's Python data loader; the legacy
  `event_accumulator` purges TF 1 scalars only, not TF 2's tensor summaries.
  """
  acc = plugin_event_accumulator.EventAccumulator(
      os.path.join(model_dir, "logs", run), size_guidance={plugin_event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _steps(acc, tag):
  return [e.step for e in acc.Tensors(tag)]


def _raw_steps(path, tag):
  """Steps of `tag` in one event file, as written (nothing purged)."""
  return [e.step for e in event_file_loader.EventFileLoader(path).Load()
          for v in e.summary.value if v.tag == tag]


def test_the_runs_were_killed_resumed_and_rerun(runs):
  assert runs["killed"]["code"] == -9, runs["killed"]["stderr"][-3000:]
  assert runs["resumed"]["code"] == 0, runs["resumed"]["stderr"][-3000:]
  assert "Restored" in runs["resumed"]["stderr"] and "at step 10" in runs["resumed"]["stderr"]


def test_batch_points_continue_at_the_global_step_after_a_kill(runs):
  model_dir = runs["model_dir"]
  killed_file, = runs["files_after_kill"]["train"]
  resumed_file, = [f for f in runs["files_after_resume"]["train"] if f != killed_file]
  # The killed run had written steps 11..13 past its last checkpoint (10).
  assert _raw_steps(killed_file, "batch_loss") == list(range(1, train_run.KILL_AT + 1))
  # The resumed run continues at the restored step + 1, not at 1.
  assert _raw_steps(resumed_file, "batch_loss") == list(range(11, train_run.TRAIN_STEPS + 1))
  # TensorBoard shows one point per step: the killed run's 11..13 are dropped
  # (SessionLog.START at 11 in the resumed run's file).
  acc = _accumulated(model_dir, "train")
  for tag in ("batch_loss", "batch_accuracy", "batch_examples_per_second"):
    assert _steps(acc, tag) == list(range(1, train_run.TRAIN_STEPS + 1)), tag
  resumed_losses = [e for e in event_file_loader.EventFileLoader(resumed_file).Load()
                    for v in e.summary.value if v.tag == "batch_loss"]
  shown = {e.step: e for e in acc.Tensors("batch_loss")}
  for e in resumed_losses:
    assert tf.make_ndarray(shown[e.step].tensor_proto) == tf.make_ndarray(
        e.summary.value[0].tensor)


def test_the_interrupted_epoch_gets_its_point_at_the_step_that_ends_it(runs):
  acc = _accumulated(runs["model_dir"], "train")
  # Epochs of 8 steps: epoch 2 (steps 9..16) was killed at 13 and finished
  # by the resumed run.
  for tag in ("epoch_loss", "epoch_accuracy", "epoch_learning_rate", "epoch_examples_per_second"):
    assert _steps(acc, tag) == [8, 16, 24], tag


def test_throughput_and_checkpoint_time_are_scalars(runs):
  acc = _accumulated(runs["model_dir"], "train")
  rates = [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors("batch_examples_per_second")]
  assert all(r > 0 for r in rates)
  # Saves at 5 and 10 (killed run), 15, 20 and the final one at 24.
  assert _steps(acc, "checkpoint_seconds") == [5, 10, 15, 20, 24]
  assert all(float(tf.make_ndarray(e.tensor_proto)) > 0 for e in acc.Tensors("checkpoint_seconds"))


def test_the_summary_is_printed_once_at_the_end(runs):
  out = runs["resumed"]["stdout"]
  model_dir = runs["model_dir"]
  assert out.count("tfdp-train: finished at step 24 (14 steps from step 10)") == 1, out
  lines = out[out.index("tfdp-train: finished"):].splitlines()
  fields = {line.split()[0]: line for line in lines[1:]}
  assert set(fields) == {"wall", "throughput", "train", "eval", "checkpoint", "model"}, lines
  assert "examples/s" in fields["throughput"]
  assert "loss" in fields["train"] and "accuracy" in fields["train"]
  assert "val_loss" in fields["eval"] and "step 24" in fields["eval"]
  assert fields["checkpoint"].split()[-1] == os.path.join(model_dir, "ckpt-24")
  assert fields["model"].split()[-1] == os.path.join(model_dir, "model.keras")
  # The killed run printed none; the progress bar is not on stdout's summary lines.
  assert "tfdp-train: finished" not in runs["killed"]["stdout"]


def test_an_already_complete_run_says_so_and_exits_0(runs):
  rerun = runs["rerun"]
  assert rerun["code"] == 0, rerun["stderr"][-3000:]
  expected = f"tfdp-train: already complete at step 24: {runs['model_dir']}/ckpt-24"
  assert rerun["stdout"].strip() == expected
  assert "Epoch" not in rerun["stdout"] + rerun["stderr"]
  # It wrote no event file.
  assert runs["files_after_rerun"] == runs["files_after_resume"]


def test_model_keras_loads_in_plain_keras_and_predicts_as_the_final_checkpoint(runs):
  # tests/train_run.py PLAIN_KERAS_CHECK: a process without tfdp loads it.
  check = runs["plain_keras"]
  assert check["code"] == 0 and "OK" in check["stdout"], check["stdout"] + check["stderr"][-3000:]


def test_the_run_config_names_the_model_for_a_keras_export(runs):
  from tfdp import export  # pylint: disable=g-import-not-at-top
  from tfdp.resume import train_state as state  # pylint: disable=g-import-not-at-top
  config = state.read_run_config(os.path.join(runs["model_dir"], "ckpt-24"))
  assert config["model"] == "cnn" and config["dtype_policy"] == "float32"
  assert config["model_kwargs"] == {"input_shape": [32, 32, 3], "num_classes": 10}
  keras.backend.clear_session()  # Layer names as in a fresh process (earlier tests built models).
  rebuilt = export.model_from_run_config(config)
  reader = tf.train.load_checkpoint(os.path.join(runs["model_dir"], "ckpt-24"))
  for w in rebuilt.weights:
    assert reader.get_tensor(f"model/{w.path}/.ATTRIBUTES/VARIABLE_VALUE").shape == w.shape
