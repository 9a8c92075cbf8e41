"""tfdp.resume.fit_hooks in one process: who prints under multi-worker, and the order of the callbacks."""

import keras
import numpy as np

from tfdp.resume import fit_hooks

X = np.zeros((16, 3), "float32")


def _fit(verbose):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
  stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9, verbose=1)
  model.fit(X, X[:, :1], batch_size=8, epochs=3, verbose=verbose, callbacks=[stop])
  model.evaluate(X, X[:, :1], verbose=verbose)
  return stop


def test_a_worker_other_than_the_chief_prints_nothing_unless_every_worker_is_asked_for(
    monkeypatch, capsys):
  monkeypatch.setattr(fit_hooks, "_is_chief", lambda model: False)
  stop = _fit(verbose=2)
  assert capsys.readouterr().out == ""  # No epoch line, nor EarlyStopping's message.
  assert stop.verbose == 1  # The callback is given back as it was.
  monkeypatch.setenv(fit_hooks.ALL_WORKERS_ENV, "1")
  _fit(verbose=2)
  out = capsys.readouterr().out
  assert "2/2 - " in out and "early stopping" in out, out


def test_tfdp_backups_come_after_the_other_callbacks():
  from tfdp import callbacks  # pylint: disable=g-import-not-at-top

  class Last(keras.callbacks.Callback):
    tfdp_runs_last = True

  last, a, b = Last(), keras.callbacks.History(), keras.callbacks.EarlyStopping()
  assert fit_hooks.runs_last([last, a, b]) == [a, b, last]
  assert fit_hooks.runs_last((a, last, b)) == [a, b, last]
  assert fit_hooks.runs_last(None) is None
  # tfdp's own callbacks go with it, in their order (tfdp-train times its saves so).
  timer = callbacks.Throughput(8)
  assert fit_hooks.runs_last([timer, a, last, b]) == [a, b, timer, last]
