"""tfdp.resume.callback_state: the hook for users' callbacks, and what it keeps of Keras's own."""

import keras
import numpy as np

from tfdp.resume import callback_state


class Mine(keras.callbacks.Callback):

  def __init__(self, state=None):
    super().__init__()
    self.state = state

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.state = state


def test_a_callbacks_own_state_round_trips_with_its_arrays_and_numbers():
  saved = {"n": 3, "best": np.float32(0.25), "names": ["a", "b"],
           "history": np.arange(6.0).reshape(2, 3), "nested": {"w": [np.ones(2, "int8")]}}
  stop = keras.callbacks.EarlyStopping(restore_best_weights=True)
  stop.wait, stop.best, stop.best_weights = 2, 0.5, [np.ones((2, 2), "float32")]
  text, blob = callback_state.capture([Mine(saved), stop, keras.callbacks.History()])
  fresh, fresh_stop = Mine(), keras.callbacks.EarlyStopping(restore_best_weights=True)
  done = callback_state.restore([fresh, keras.callbacks.History(), fresh_stop], text, blob)
  assert done == [f"{__name__}.Mine#0", "keras.src.callbacks.early_stopping.EarlyStopping#0"]
  state = fresh.state
  assert (state["n"], state["best"], state["names"]) == (3, 0.25, ["a", "b"])
  np.testing.assert_array_equal(state["history"], saved["history"])
  assert state["nested"]["w"][0].dtype == np.int8
  assert (fresh_stop.wait, fresh_stop.best) == (2, 0.5)
  np.testing.assert_array_equal(fresh_stop.best_weights[0], stop.best_weights[0])


def test_callbacks_of_one_class_are_matched_in_order_and_a_bad_state_is_left_out(caplog):
  text, blob = callback_state.capture([Mine({"i": 0}), Mine({"i": 1}), Mine(object())])
  assert "Mine#2" in caplog.text and "JSON values and NumPy arrays" in caplog.text
  first, second, third = Mine(), Mine(), Mine("untouched")
  callback_state.restore([first, second, third], text, blob)
  assert (first.state, second.state, third.state) == ({"i": 0}, {"i": 1}, "untouched")
